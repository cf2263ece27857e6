"""A built-in closed-loop HTTP load tool for ``specgate bench overhead`` on machines without ``wrk``.

``wrk`` (C, one thread) costs little CPU per request, so it hides nothing of the gateway's cost; it is what the
overhead targets are measured with. Without it, this module drives N keep-alive connections from Python with the
gateway's own lean client (``gateway.fleet.h1client``), each sending the next request when the last answer is read, and
reports the same numbers. Its own CPU (tens of microseconds per request) comes out of the same two cores, so
absolute rates are lower than with ``wrk``; the ratios between targets measured in one run stay comparable.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from gateway.bench.load import percentile
from gateway.fleet.h1client import HostPool


async def drive(
    url: str, body: bytes, headers: dict[str, str], connections: int, duration_s: float
) -> tuple[float, float, float, int]:
    """Requests/s, p50 and p99 latency (s), and errors (non-200 or failed) of a closed loop on ``connections``."""
    parts = urlsplit(url)
    pool = HostPool(
        f"{parts.scheme}://{parts.netloc}",
        limit=connections,
        connect_s=5.0,
        acquire_s=5.0,
        total_s=60.0,
        keepalive_s=3600.0,
    )
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors = 0
    end = loop.time() + duration_s

    async def worker() -> None:
        nonlocal errors
        while loop.time() < end:
            t0 = time.perf_counter()
            try:
                response = await pool.request(parts.path, body, headers)
                await response.read()
                response.release()
                ok = response.status == 200
            except (OSError, TimeoutError):
                ok = False
            latencies.append(time.perf_counter() - t0)
            if not ok:
                errors += 1

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(connections)))
    finally:
        pool.close()
    elapsed = time.perf_counter() - start
    return len(latencies) / elapsed, percentile(latencies, 0.5), percentile(latencies, 0.99), errors
