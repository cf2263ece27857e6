"""A static OpenAI-shaped upstream on raw asyncio, fast enough that it is never the bottleneck.

For measuring the gateway's own cost: it answers every POST with the same chat completion (or, when the body
asks for a stream, the same 16-event SSE stream; N events with an ``x-static-events: N`` header) and every GET
with 200, over HTTP/1.1 keep-alive. It parses just enough HTTP for well-behaved clients (wrk, aiohttp); it is not
a general server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import cast

import orjson

_COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-static",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "static",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
    }
)


def _chunk(content: str, finish: str | None = None) -> bytes:
    delta = {"content": content} if content else {}
    obj = {
        "id": "chatcmpl-static",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "static",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_EVENTS = [_chunk("ok ") for _ in range(16)] + [_chunk("", "stop"), b"data: [DONE]\n\n"]


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_COMPLETION)).encode()
    + b"\r\n\r\n"
    + _COMPLETION
)
_SSE_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"".join(_http_chunk(e) for e in _EVENTS)
    + b"0\r\n\r\n"
)
_EMPTY_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
EVENTS_HEADER = b"x-static-events:"  # a stream of this many content events instead of 16 (relay cost per chunk)
_SSE_BY_COUNT: dict[int, bytes] = {16: _SSE_RESPONSE}


def _sse_response(count: int) -> bytes:
    cached = _SSE_BY_COUNT.get(count)
    if cached is None:
        events = [_chunk("ok ") for _ in range(count)] + [_chunk("", "stop"), b"data: [DONE]\n\n"]
        cached = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"".join(_http_chunk(e) for e in events)
            + b"0\r\n\r\n"
        )
        if len(_SSE_BY_COUNT) < 64:
            _SSE_BY_COUNT[count] = cached
    return cached


def _header_int(head: bytes, name: bytes) -> int | None:
    i = head.find(name)
    if i < 0:
        return None
    end = head.find(b"\r\n", i)
    try:
        return int(head[i + len(name) : end if end > 0 else None].strip())
    except ValueError:
        return None


class _StaticProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._buf = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None].strip())
            total = end + 4 + length
            if len(self._buf) < total:
                return
            body = self._buf[end + 4 : total]
            self._buf = self._buf[total:]
            assert self._transport is not None
            if head.startswith(b"get"):
                self._transport.write(_EMPTY_RESPONSE)
            elif b'"stream":true' in body.replace(b" ", b""):
                count = _header_int(head, EVENTS_HEADER)
                self._transport.write(_SSE_RESPONSE if count is None else _sse_response(max(1, min(count, 100_000))))
            else:
                self._transport.write(_JSON_RESPONSE)


async def serve_static(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_StaticProtocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description="static OpenAI-shaped upstream for overhead benchmarks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve_static(args.host, args.port))


if __name__ == "__main__":
    main()
