"""Hostile clients and a misbehaving pool, to measure what the gateway's limits (docs/limits.md) buy.

``python -m gateway.bench.attacks flood --port P`` sends huge request heads from several clients for a while and
prints, as JSON, the statuses they got and a bystander's ``/health`` latencies meanwhile. ``upstream --port P
--mode gzip-bomb|huge-body|endless-header`` serves a pool that misbehaves so; ``bomb --url U --pid N`` sends one
request through a gateway and reports the gateway's peak RSS growth (Linux ``VmHWM``); ``bigbody --url U`` posts
a legal 7.9 MB chat body of 230k tiny messages a few times and reports how long a concurrent ``/health`` waited
meanwhile (its worst wait per post, in ms). Run them against one
gateway version, then another, to compare (docs/limits.md lists the numbers measured).

The tests use the same attack code (``tests/integration/test_limits_*``), started as a separate process so that
the attackers do not share the gateway's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx

from gateway.bench.load import percentile

REQUEST = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def huge_header(size: int) -> bytes:
    """A request head with one header value of ``size`` bytes."""
    return b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * size + b"\r\n\r\n"


def many_headers(count: int, auth: str | None = None, body: bytes = REQUEST) -> bytes:
    """A whole request with ``count`` small headers (and a bearer key when given)."""
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"host: x", b"content-type: application/json"]
    if auth:
        lines.append(b"authorization: Bearer " + auth.encode())
    lines += [b"x-h%d: v" % i for i in range(count)]
    lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def send_raw(host: str, port: int, data: bytes, timeout: float = 30.0) -> int:
    """Send ``data`` as fast as the server reads it, then read the status line; 0 when none came."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        got = b""
        with contextlib.suppress(OSError):
            while b"\r\n" not in got:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
    parts = got.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def flood(host: str, port: int, data: bytes, clients: int, seconds: float) -> Counter[int]:
    """``clients`` threads sending ``data`` over and over for ``seconds``: the statuses they got."""
    statuses: Counter[int] = Counter()
    stop = time.monotonic() + seconds

    def attack() -> None:
        while time.monotonic() < stop:
            try:
                statuses[send_raw(host, port, data)] += 1
            except OSError:
                statuses[0] += 1  # refused, or reset before an answer

    threads = [threading.Thread(target=attack, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def health_latencies(url: str, seconds: float) -> list[float]:
    """``GET /health`` one after another for ``seconds``: each one's latency."""
    out: list[float] = []
    stop = time.monotonic() + seconds
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            client.get(url + "/health")
            out.append(time.perf_counter() - t0)
    return out


def start_flood(port: int, size: int, clients: int, seconds: float) -> subprocess.Popen[str]:
    """The flood in its own process (its result comes as JSON on stdout)."""
    args = [sys.executable, "-m", "gateway.bench.attacks", "flood", "--port", str(port), "--size", str(size)]
    args += ["--clients", str(clients), "--seconds", str(seconds), "--no-bystander"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), KiB; 0 where /proc does not say."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# ---- a misbehaving pool ----------------------------------------------------------------------------------------


def bomb_body(decoded: int) -> bytes:
    """A gzip body that inflates to ``decoded`` bytes of JSON-ish text (about 1000:1)."""
    return gzip.compress(b'{"x":"' + b"a" * decoded + b'"}', compresslevel=9)


async def _hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mode: str, size: int) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
            elif mode == "gzip-bomb":
                body = bomb_body(size)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
            elif mode == "huge-body":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size)
                piece = b"a" * 65536
                for _ in range(size // len(piece)):
                    writer.write(piece)
                    await writer.drain()
            elif mode == "endless-header":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-endless: ")
                piece = b"a" * 65536
                for _ in range(size // len(piece)):
                    writer.write(piece)
                    await writer.drain()
            await writer.drain()


def big_body_stall(url: str, *, messages: int, posts: int, model: str) -> dict[str, object]:
    """Post a chat body of ``messages`` tiny messages ``posts`` times, one after another, while another client
    polls ``/health``: the worst ``/health`` latency seen during each post, and the status each post got."""
    one = {"role": "user", "content": "hello"}
    body = json.dumps({"model": model, "max_tokens": 4, "messages": [one] * messages}, separators=(",", ":"))
    raw = body.encode()
    seen: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                client.get(url + "/health")
                seen.append((t0, time.perf_counter() - t0))
                time.sleep(0.002)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.5)
    idle = [lat for _, lat in seen]
    worst: list[float] = []
    statuses: list[int] = []
    with httpx.Client(timeout=120) as client:
        for _ in range(posts):
            t0 = time.perf_counter()
            r = client.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            t1 = time.perf_counter()
            time.sleep(0.3)  # a /health sent during the post may still be waiting: let it finish
            statuses.append(r.status_code)
            worst.append(max((lat for start, lat in list(seen) if t0 <= start <= t1), default=0.0))
    stop.set()
    poller.join()
    return {
        "body_bytes": len(raw),
        "statuses": statuses,
        "health_idle_p50_ms": round(percentile(idle, 0.5) * 1000, 2) if idle else None,
        "health_worst_ms_per_post": [round(w * 1000, 1) for w in worst],
        "health_worst_ms_median": round(percentile(worst, 0.5) * 1000, 1),
    }


async def serve_hostile(port: int, mode: str, size: int) -> None:
    server = await asyncio.start_server(lambda r, w: _hostile(r, w, mode, size), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.attacks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flood", help="huge request heads from several clients; a bystander's /health meanwhile")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--size", type=int, default=32 * 2**20, help="bytes of the one huge header")
    f.add_argument("--clients", type=int, default=3)
    f.add_argument("--seconds", type=float, default=10.0)
    f.add_argument("--no-bystander", action="store_true")
    u = sub.add_parser("upstream", help="a pool that misbehaves")
    u.add_argument("--port", type=int, required=True)
    u.add_argument("--mode", choices=["gzip-bomb", "huge-body", "endless-header"], required=True)
    u.add_argument("--size", type=int, default=200 * 2**20, help="decoded / body / header bytes")
    b = sub.add_parser("bomb", help="one request through the gateway; its peak RSS growth")
    b.add_argument("--url", required=True)
    b.add_argument("--pid", type=int, required=True)
    b.add_argument("--stream", action="store_true")
    b.add_argument("--model", default="meta-llama/Llama-3.3-70B-Instruct")
    g = sub.add_parser("bigbody", help="legal bodies of many tiny messages; a concurrent /health's wait")
    g.add_argument("--url", required=True)
    g.add_argument("--messages", type=int, default=230_000)
    g.add_argument("--posts", type=int, default=6)
    g.add_argument("--model", default="meta-llama/Llama-3.3-70B-Instruct")
    a = parser.parse_args(argv)
    if a.cmd == "bigbody":
        print(json.dumps(big_body_stall(a.url, messages=a.messages, posts=a.posts, model=a.model)))
    elif a.cmd == "flood":
        result: dict[str, object] = {}
        if a.no_bystander:
            statuses = flood(a.host, a.port, huge_header(a.size), a.clients, a.seconds)
        else:
            attack = start_flood(a.port, a.size, a.clients, a.seconds)
            time.sleep(min(1.0, a.seconds / 4))
            lat = health_latencies(f"http://{a.host}:{a.port}", a.seconds * 0.6)
            out, _ = attack.communicate()
            statuses = Counter({int(k): v for k, v in json.loads(out)["statuses"].items()})
            result["health_ms"] = {
                "n": len(lat),
                "p50": round(percentile(lat, 0.5) * 1000, 2),
                "p99": round(percentile(lat, 0.99) * 1000, 2),
                "max": round(max(lat) * 1000, 2),
            }
        result["statuses"] = {str(k): v for k, v in sorted(statuses.items())}
        print(json.dumps(result))
    elif a.cmd == "upstream":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_hostile(a.port, a.mode, a.size))
    else:
        before = peak_rss_kib(a.pid)
        body = {"model": a.model, "messages": [{"role": "user", "content": "hi"}], "stream": a.stream}
        t0 = time.perf_counter()
        r = httpx.post(a.url + "/v1/chat/completions", json=body, timeout=120)
        took = time.perf_counter() - t0
        after = peak_rss_kib(a.pid)
        print(
            json.dumps(
                {
                    "status": r.status_code,
                    "body": r.text[:200],
                    "seconds": round(took, 2),
                    "rss_growth_mib": round((after - before) / 1024, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
