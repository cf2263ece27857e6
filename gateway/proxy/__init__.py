"""The request path: from a client's bytes to exactly one terminal response.

- ``app``: the ASGI app: a dispatcher sending the POSTs of ``PROXY_ROUTES`` (one table) straight to the proxy
  exchange, everything else (/v1/models, a stored response's GET / cancel, /health, /ready, /metrics, lifespan) to
  Starlette.
- ``intake``: a proxied POST's front half: auth, body under a limit, classify and plan, Idempotency-Key claim.
- ``http``: JSON answers, bodies read under a limit, and ``error_response``, the one place where an exception
  becomes an OpenAI envelope (the admin API's too).
- ``forward``: ``ProxyExchange``, the attempt loop and the commit point; before it a failed attempt moves on,
  after it nothing is re-sent and a cut stream ends with an explicit error event.
- ``idempotency``: the Idempotency-Key guard (claim, replay, 409/422).
- ``headers``: header hygiene both ways; ``wire``: the OpenAI error envelope and SSE framing; ``dialect``: how a
  stream of each API ends and fails (chat's ``[DONE]``, the Responses API's typed terminal events).
- ``responses``: the Responses API's stickiness (response id → the endpoint holding it, in the store), and the
  ``GET`` / ``cancel`` routes of a stored response.
- ``limits``: the uvicorn protocol that bounds a client's connection before the app sees a request (head size and
  header count, head / body deadlines, keep-alive), counting connections in a ``connections.ConnectionGate``
  (caps in total and per client address); ``json_depth``: a body's nesting, read from its text.
- ``stream_tap``: reads per-request acceptance from speculative pools' responses; ``record``: the per-request record.
"""
