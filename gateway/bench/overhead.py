"""``specgate bench overhead``: what the gateway adds to a request, against a static upstream, with wrk.

One run measures, side by side and in the same conditions: wrk straight to the static upstream (the baseline),
and wrk through a real ``specgate serve`` process in front of the same upstream; non-streaming and streaming
(16 events), at each connection count. It reports requests/s, p50 and p99 latency, the latency the gateway
adds at p50 and p99, and the throughput ratio. wrk (Debian package ``wrk``) generates the load: a C load
generator on one thread leaves the most CPU to the processes under test on a small machine.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.demo import free_port, wait_for_port

_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
"""
_BODY = (
    '{{"model": "static", "temperature": 0.2, "max_tokens": 64, "stream": {stream}, '
    '"messages": [{{"role": "system", "content": "You are a helpful assistant."}}, '
    '{{"role": "user", "content": "Summarise the following text in two sentences: {text}"}}]}}'
)


@dataclass(frozen=True, slots=True)
class WrkResult:
    rps: float
    p50_s: float
    p99_s: float
    errors: int


@dataclass(frozen=True, slots=True)
class OverheadRow:
    mode: str
    connections: int
    direct: WrkResult
    gateway: WrkResult

    @property
    def added_p50_ms(self) -> float:
        return (self.gateway.p50_s - self.direct.p50_s) * 1000

    @property
    def added_p99_ms(self) -> float:
        return (self.gateway.p99_s - self.direct.p99_s) * 1000

    @property
    def rps_ratio(self) -> float:
        return self.gateway.rps / self.direct.rps if self.direct.rps else 0.0


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        raise ValueError(f"cannot read wrk latency {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_wrk(output: str) -> WrkResult:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", output)
    p50 = re.search(r"^\s+50%\s+(\S+)", output, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", output, re.M)
    if not (rps and p50 and p99):
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    errors = 0
    for m in re.finditer(r"Non-2xx or 3xx responses:\s+(\d+)|Socket errors:.*?(\d+).*?(\d+).*?(\d+).*?(\d+)", output):
        errors += sum(int(g) for g in m.groups() if g)
    return WrkResult(float(rps.group(1)), _seconds(p50.group(1)), _seconds(p99.group(1)), errors)


def run_wrk(url: str, script: Path, connections: int, duration_s: int) -> WrkResult:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", str(script), url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {proc.stderr or proc.stdout}")
    return parse_wrk(proc.stdout)


@contextlib.contextmanager
def _process(cmd: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def _rules(upstream_url: str) -> dict[str, object]:
    pool = {"models": ["static"], "endpoints": [{"url": upstream_url}], "max_connections": 512}
    return {
        "version": 1,
        "pools": [
            {
                "name": "speculative",
                "kind": "speculative",
                **pool,
                "endpoints": [{"url": upstream_url, "id": "s0"}],
                "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
            },
            {"name": "standard", "kind": "standard", **pool, "endpoints": [{"url": upstream_url, "id": "d0"}]},
        ],
        "task_rules": [{"task": "summarization", "patterns": [r"\bsummari[sz]e\b"]}],
        "classes": [
            {
                "name": "summaries",
                "when": {"temperature": {"lte": 0.5}, "task_type": {"in": ["summarization"]}},
                "route": {"preferred": "speculative", "saturated": "standard", "fallback": ["standard"]},
            },
            {"name": "default", "route": {"preferred": "standard", "fallback": ["speculative"]}},
        ],
    }


def bench_overhead(connections: list[int], duration_s: int, *, prompt_chars: int = 2000) -> list[OverheadRow]:
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install wrk)")
    rows: list[OverheadRow] = []
    with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
        d = Path(tmp)
        text = ("lorem ipsum dolor sit amet " * (prompt_chars // 27 + 1))[:prompt_chars]
        scripts = {}
        for mode, stream in (("json", "false"), ("stream", "true")):
            scripts[mode] = d / f"{mode}.lua"
            scripts[mode].write_text(_LUA.format(body=_BODY.format(stream=stream, text=text)))
        up_port, gw_port = free_port(), free_port()
        up_url = f"http://127.0.0.1:{up_port}"
        rules = d / "rules.yaml"
        rules.write_text(yaml.safe_dump(_rules(up_url), sort_keys=False))
        up_cmd = [sys.executable, "-m", "gateway.bench.static_upstream", "--port", str(up_port)]
        gw_cmd = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--rules",
            str(rules),
            "--host",
            "127.0.0.1",
            "--port",
            str(gw_port),
            "--health-interval",
            "5",
        ]
        with _process(up_cmd, up_port), _process(gw_cmd, gw_port):
            for mode in ("json", "stream"):
                for c in connections:
                    # Warm both paths (connection pools, caches) before measuring.
                    run_wrk(up_url + "/v1/chat/completions", scripts[mode], c, 1)
                    run_wrk(f"http://127.0.0.1:{gw_port}/v1/chat/completions", scripts[mode], c, 1)
                    direct = run_wrk(up_url + "/v1/chat/completions", scripts[mode], c, duration_s)
                    via = run_wrk(f"http://127.0.0.1:{gw_port}/v1/chat/completions", scripts[mode], c, duration_s)
                    rows.append(OverheadRow(mode, c, direct, via))
    return rows


def render(rows: list[OverheadRow]) -> str:
    head = (
        f"{'mode':<7}{'conns':>6}{'direct rps':>12}{'gw rps':>10}{'ratio':>7}"
        f"{'direct p50':>12}{'gw p50':>9}{'added p50':>11}{'direct p99':>12}{'gw p99':>9}{'added p99':>11}{'errors':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.mode:<7}{r.connections:>6}{r.direct.rps:>12.0f}{r.gateway.rps:>10.0f}{r.rps_ratio:>7.2f}"
            f"{r.direct.p50_s * 1000:>10.2f}ms{r.gateway.p50_s * 1000:>7.2f}ms{r.added_p50_ms:>9.2f}ms"
            f"{r.direct.p99_s * 1000:>10.2f}ms{r.gateway.p99_s * 1000:>7.2f}ms{r.added_p99_ms:>9.2f}ms"
            f"{r.direct.errors + r.gateway.errors:>8}"
        )
    return "\n".join(lines)
