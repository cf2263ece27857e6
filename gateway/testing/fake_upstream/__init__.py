"""A small, deterministic fake of ``vllm serve`` (vLLM 0.33 wire format) with per-request failure injection.

It is not the simulator (no batching, no speculative-decoding physics): every request produces ``tokens``
tokens named ``tok1 ``, ``tok2 ``, … after ``first_token_delay_s``, one every ``token_delay_s``. What it is
for is the gateway's tests and the demo: it speaks vLLM's shapes (integer ``code`` in error envelopes,
``{"error": "Unauthorized"}`` for a bad key, ``data: {"error": …}`` mid-stream, the ``metrics`` field of
``--per-request-spec-decode-metrics``), its ``/metrics`` gauges follow the real number of requests in flight,
and a request header chooses how this one request fails.

``X-Fake-Behavior`` (comma-separated directives; ``PUT /_fake/behavior`` sets a default for requests without
the header)::

    status=503            answer at once with that status and a vLLM error envelope
    break_after=3         stream: after 3 token chunks the TCP connection is closed mid-body (no [DONE], no
                          terminating chunk); non-stream: the connection is closed without any response
    error_event_after=3   stream: after 3 token chunks ``data: {"error": {...}}`` then ``data: [DONE]``;
                          non-stream: a 500 envelope instead of the completion
    tokens=N              tokens to generate (still capped by max_tokens)
    token_delay=0.05      seconds between tokens
    first_token_delay=1.5 seconds before anything is sent (the response headers included)
    hang=1                never answer (until the client goes away)

Test hooks (never behind ``--api-key``, never recorded): ``GET/DELETE /_fake/requests`` (every other request
received, newest last: method, path, query, headers with lower-case names, parsed JSON body; ``?path=``
filters), ``GET /_fake/stats`` (below), and ``GET/PUT /_fake/behavior`` (``{"default": "status=503" | null,
"health_status": 200}``; ``health_status`` is what ``GET /health`` answers).

Stats count admitted generation/embedding requests, i.e. not those refused with 400/401/404 or an injected
``status=``: ``started``; ``completed`` (the whole response went out, ``error_event_after`` included);
``aborted`` (the client went away first: noticed within a loop tick of the socket closing, whatever the request
was waiting on); ``broken`` (``break_after``); ``in_flight``. A request is booked before its last bytes are
sent, so a client that has read its whole response already sees it counted. In ``/metrics`` a request is
"waiting" until its first token (``first_token_delay``, ``hang``) and "running" after.

The abrupt break closes uvicorn's transport directly (reached through the ASGI ``send`` it hands the app, a
bound method of its RequestResponseCycle): buffered chunks are flushed, then FIN in the middle of the chunked
body. aiohttp then raises ``ClientPayloadError`` (stream) / ``ServerDisconnectedError`` (no response yet);
httpx ``RemoteProtocolError`` ("incomplete chunked read" / "Server disconnected without sending a response").
Under another ASGI server (or httpx's ASGITransport) it raises instead, which makes a server drop the
connection once a response has started.
"""

from gateway.testing.fake_upstream.app import create_fake_upstream, fake_state
from gateway.testing.fake_upstream.behavior import BEHAVIOR_HEADER, Behavior, FakeConfig, parse_behavior
from gateway.testing.fake_upstream.server import FakeUpstreamServer, main, serve_fake_upstream
from gateway.testing.fake_upstream.state import FakeState, spec_decode_metrics

__all__ = [
    "BEHAVIOR_HEADER",
    "Behavior",
    "FakeConfig",
    "FakeState",
    "FakeUpstreamServer",
    "create_fake_upstream",
    "fake_state",
    "main",
    "parse_behavior",
    "serve_fake_upstream",
    "spec_decode_metrics",
]
