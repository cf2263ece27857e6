"""The request path: from a client's bytes to exactly one terminal response.

- ``app``: the ASGI app: routes, thin handlers, the one place errors become OpenAI envelopes.
- ``forward``: the attempt loop and the commit point; before it a failed attempt moves on, after it nothing is
  re-sent and a cut stream ends with an explicit error event.
- ``idempotency``: the Idempotency-Key guard (claim, replay, 409/422).
- ``headers``: header hygiene both ways; ``wire``: the OpenAI error envelope and SSE framing.
- ``stream_tap``: reads per-request acceptance from speculative pools' responses; ``record``: the per-request record.
"""
