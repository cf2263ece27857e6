"""The request path: from a client's bytes to exactly one terminal response.

- ``app``: the ASGI app: a dispatcher sending the POSTs of ``PROXY_ROUTES`` (one table) straight to the front
  half, everything else (/v1/models, /tokenize, a stored response's routes, /health, /ready, /metrics, lifespan)
  to Starlette, whose proxied routes run the same front half.
- ``front``: the one front half of every proxied route (``ProxyRoute``, ``admit``, ``serve``): the record, the
  route's own part, then a ``ProxyExchange`` or a refusal rendered; ``outcome``: a request's outcome label.
- ``intake``: a classified POST's part: auth, body under a limit, classify and plan, Idempotency-Key claim;
  ``tokens``: ``/tokenize`` and ``/detokenize``'s; ``stored_responses``: a stored response's GET / cancel / DELETE.
- ``http``: JSON answers, bodies read under a limit, and ``error_response``, the one place where an exception
  becomes an OpenAI envelope (the admin API's too).
- ``forward``: ``ProxyExchange``, one request from its first attempt to its last byte, and the relay after the
  commit point (nothing is re-sent, a cut stream ends with an explicit error event); ``attempt_loop``: the attempts
  up to the commit point (a failed one moves on); ``presence``: what the client leaving or not reading does
  (cancel, run on detached, cut off), next to ``stall``, the send deadline.
- ``idempotency``: the Idempotency-Key guard (claim, replay, 409/422).
- ``headers``: header hygiene both ways; ``wire``: the OpenAI error envelope and SSE framing; ``dialect``: how a
  stream of each API ends and fails (chat's ``[DONE]``, the Responses API's typed terminal events).
- ``responses``: the Responses API's stickiness (response id → the endpoint holding it, in the store).
- ``limits``: the uvicorn protocol that bounds a client's connection before the app sees a request (head size and
  header count, head / body deadlines, keep-alive), counting connections in a ``connections.ConnectionGate``
  (caps in total and per client address), its transport writing a response's head with what follows (``coalesce``);
  ``json_depth``: a body's nesting, read from its text.
- ``stream_tap``: reads per-request acceptance from speculative pools' responses; ``record``: the per-request record.
"""
