"""Time to the first streamed event through a proxy, measured over one raw keep-alive connection (``specgate bench
overhead``): no client library's own cost in the number."""

from __future__ import annotations

import socket
import time


def measure_ttft(port: int, body: bytes, duration_s: float) -> tuple[float, float]:
    """p50 and p99 time to the first SSE event over one keep-alive connection, requests one after the other."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    samples: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            start = time.perf_counter()
            sock.sendall(request)
            buf = b""
            first: float | None = None
            while not buf.endswith(b"0\r\n\r\n"):
                data = sock.recv(65536)
                if not data:
                    raise RuntimeError("connection closed during a stream")
                buf += data
                if first is None and b"data:" in buf:
                    first = time.perf_counter()
            samples.append((first or time.perf_counter()) - start)
    samples.sort()
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(len(samples) * 0.99))]
