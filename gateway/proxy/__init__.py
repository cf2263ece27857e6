"""The request path: from a client's bytes to exactly one terminal response.

- ``app``: the ASGI app: routes, thin handlers, the one place errors become OpenAI envelopes.
- ``forward``: the attempt loop and the commit point; before it a failed attempt moves on, after it nothing is
  re-sent and a cut stream ends with an explicit error event.
- ``idempotency``: the Idempotency-Key guard (claim, replay, 409/422).
- ``headers``: header hygiene both ways; ``wire``: the OpenAI error envelope and SSE framing; ``dialect``: how a
  stream of each API ends and fails (chat's ``[DONE]``, the Responses API's typed terminal events).
- ``responses``: the Responses API's stickiness (response id → the endpoint holding it, in the store), and the
  ``GET`` / ``cancel`` routes of a stored response.
- ``stream_tap``: reads per-request acceptance from speculative pools' responses; ``record``: the per-request record.
"""
