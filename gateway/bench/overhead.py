"""``specgate bench overhead``: what the gateway adds to a request, against a static upstream, with wrk.

One run measures, one after the other in the same conditions, four targets in front of one static upstream:
the upstream itself (``direct``), the simplest pass-through proxy with httpx's default transport and with aiohttp
(``gateway.bench.minimal_proxy``), and a real ``specgate serve`` process (classification, routing, header
hygiene, metrics, one JSON log line per request); non-streaming and streaming (16 events), at each connection
count. It reports requests/s, p50 and p99 latency, the latency each adds to ``direct``, and throughput ratios
against ``direct`` and against the minimal aiohttp proxy; for streams at one connection, the time to first event
(a socket client that times it) and the relay cost per event; and the issue's targets, met or not.
wrk (Debian package ``wrk``) generates the load: a C load generator on one thread leaves the most CPU to the
processes under test on a small machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.bench.overhead_epp import EPP_TARGETS, render_epp, start_epp_targets
from gateway.bench.ttft_probe import measure_ttft
from gateway.bench.turns import cpu_s, in_turns
from gateway.sim.launch import free_port, wait_for_port

_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
{extra}wrk.body = '{body}'
"""
LONG_STREAM_EVENTS = 256  # the second stream length: (added(256) - added(16)) / 240 is the relay cost per event
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


TARGETS = ("direct", "minimal-httpx", "minimal-aiohttp", "specgate")
# With --tracing: specgate again with OpenTelemetry on, at a head sample of 100% and 10%, exporting to a local OTLP
# sink (gateway.bench.otlp_sink) on the same machine.
TRACED = {"specgate-trace100": "1.0", "specgate-trace10": "0.1"}
TARGET_TRACED_RATIO = {"specgate-trace100": 0.85, "specgate-trace10": 0.95}  # req/s vs specgate, 32 connections
TRACED_COPIES = 2  # gateway processes per target measured in turns (``turns.in_turns``)


@dataclass(frozen=True, slots=True)
class OverheadRow:
    """One mode and connection count: wrk's result for each target, measured one after the other."""

    mode: str
    connections: int
    results: dict[str, WrkResult]
    # Each proxy process's CPU microseconds per request (Linux /proc); with --tracing, specgate's and the traced
    # targets' over the interleaved rounds
    cpu_us: dict[str, float] = field(default_factory=dict)
    # With --tracing: each traced target's req/s ratio to specgate, the median of the interleaved rounds' ratios
    ratios: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # of ``ratios``: 90%, over the rounds
    copies: int = 1  # processes per gateway measured in turns

    def added_ms(self, target: str, pct: str = "p50") -> float:
        base, r = self.results["direct"], self.results[target]
        return ((r.p50_s - base.p50_s) if pct == "p50" else (r.p99_s - base.p99_s)) * 1000


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


@dataclass(frozen=True, slots=True)
class Workload:
    """One kind of request: a wrk script, and the same body and headers for the built-in tool."""

    script: Path
    body: bytes
    headers: dict[str, str]


def load_tool(requested: str = "auto") -> str:
    """``wrk`` when installed (or asked for), else ``builtin`` (``gateway.bench.closed_loop``)."""
    if requested not in ("auto", "wrk", "builtin"):
        raise ValueError(f"unknown load tool {requested!r}: auto, wrk or builtin")
    if requested == "wrk" and shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install wrk)")
    if requested == "auto":
        return "wrk" if shutil.which("wrk") is not None else "builtin"
    return requested


def run_tool(tool: str, url: str, work: Workload, connections: int, duration_s: int) -> WrkResult:
    if tool == "wrk":
        return run_wrk(url, work.script, connections, duration_s)
    from gateway.bench.closed_loop import drive

    rps, p50, p99, errors = asyncio.run(drive(url, work.body, work.headers, connections, duration_s))
    return WrkResult(rps, p50, p99, errors)


def run_wrk(url: str, script: Path, connections: int, duration_s: int) -> WrkResult:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", str(script), url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {proc.stderr or proc.stdout}")
    return parse_wrk(proc.stdout)


@contextlib.contextmanager
def _process(cmd: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
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


@dataclass(frozen=True, slots=True)
class StreamCost:
    """Streams at one connection: time to first token per target (a socket client that times the first event),
    and wrk's p50 for a 16-event and a LONG_STREAM_EVENTS-event stream (relay cost per event)."""

    ttft_p50_s: dict[str, float]
    ttft_p99_s: dict[str, float]
    short_p50_s: dict[str, float]
    long_p50_s: dict[str, float]

    def added_ttft_ms(self, target: str, pct: str = "p50") -> float:
        d = self.ttft_p50_s if pct == "p50" else self.ttft_p99_s
        return (d[target] - d["direct"]) * 1000

    def relay_us_per_event(self, target: str) -> float:
        extra = (self.long_p50_s[target] - self.long_p50_s["direct"]) - (
            self.short_p50_s[target] - self.short_p50_s["direct"]
        )
        return extra / (LONG_STREAM_EVENTS - 16) * 1e6


@dataclass(frozen=True, slots=True)
class Interleaved:
    results: dict[str, WrkResult]  # per target: mean req/s, median p50 and p99 over the rounds
    cpu_us: dict[str, float]  # per target: CPU microseconds per request of its process
    ratios: dict[str, float]  # per target: req/s to the first target's, median of the rounds' ratios
    intervals: dict[str, tuple[float, float]]  # of ``ratios``, 90%


def _interleaved(
    tool: str, urls: dict[str, list[str]], work: Workload, connections: int, rounds: int, pids: dict[str, list[int]]
) -> Interleaved:
    """``urls``' targets (each served by one or more processes) measured in turns (``gateway.bench.turns``)."""
    for processes in urls.values():
        for url in processes:
            run_tool(tool, url, work, connections, 1)  # warm
    got = in_turns(urls, rounds, pids, lambda url: run_tool(tool, url, work, connections, 1))
    results = {}
    for target, rs in got.samples.items():
        mid = len(rs) // 2
        results[target] = WrkResult(
            sum(r.rps for r in rs) / len(rs),
            sorted(r.p50_s for r in rs)[mid],
            sorted(r.p99_s for r in rs)[mid],
            sum(r.errors for r in rs),
        )
    return Interleaved(results, got.cpu_us, got.ratios, got.intervals)


def bench_overhead(
    connections: list[int],
    duration_s: int,
    *,
    prompt_chars: int = 2000,
    tool: str = "wrk",
    tracing: bool = False,
    epp: bool = True,
    copies: int = TRACED_COPIES,
) -> tuple[list[OverheadRow], StreamCost]:
    """Measure every target at every connection count, non-streaming then streaming, with ``tool`` (``load_tool``);
    ``tracing``: the ``TRACED`` targets too, measured interleaved with ``specgate`` (``_interleaved``), each of the
    three served by ``copies`` identical gateway processes (``turns.in_turns``); ``epp``
    (where Envoy and the epp extra are here, ``epp_skipped``): Envoy alone and Envoy + ``specgate epp``,
    non-streaming."""
    rows: list[OverheadRow] = []
    targets = (*TARGETS, *TRACED) if tracing else TARGETS
    with_epp = epp and epp_skipped() is None
    with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
        d = Path(tmp)
        text = ("lorem ipsum dolor sit amet " * (prompt_chars // 27 + 1))[:prompt_chars]
        scripts: dict[str, Workload] = {}
        long_header = f'wrk.headers["x-static-events"] = "{LONG_STREAM_EVENTS}"\n'
        for mode, stream, extra in (("json", "false", ""), ("stream", "true", ""), ("long", "true", long_header)):
            body = _BODY.format(stream=stream, text=text)
            script = d / f"{mode}.lua"
            script.write_text(_LUA.format(body=body, extra=extra))
            headers = {"content-type": "application/json"}
            if extra:
                headers["x-static-events"] = str(LONG_STREAM_EVENTS)
            scripts[mode] = Workload(script, body.encode(), headers)
        stream_body = _BODY.format(stream="true", text=text).encode()
        up_port = free_port()
        up_url = f"http://127.0.0.1:{up_port}"
        rules = d / "rules.yaml"
        rules.write_text(yaml.safe_dump(_rules(up_url), sort_keys=False))
        ports = {t: free_port() for t in targets if t != "direct"}
        py = sys.executable
        commands = {
            "minimal-httpx": [py, "-m", "gateway.bench.minimal_proxy", "--client", "httpx"],
            "minimal-aiohttp": [py, "-m", "gateway.bench.minimal_proxy", "--client", "aiohttp"],
        }
        with contextlib.ExitStack() as stack:
            stack.enter_context(_process([py, "-m", "gateway.bench.static_upstream", "--port", str(up_port)], up_port))
            procs = {}  # each target's process, for its CPU per request (the plain rows measure it too)
            for name, cmd in commands.items():
                cmd = [*cmd, "--port", str(ports[name]), "--upstream", up_url]
                procs[name] = stack.enter_context(_process(cmd, ports[name])).pid
            gw_cmd = [
                py,
                "-P",  # not the working directory first: PYTHONPATH picks the tree (an A/B of two trees)
                "-m",
                "gateway",
                "serve",
                "--rules",
                str(rules),
                "--host",
                "127.0.0.1",
                "--admin-port",
                "0",
                "--port",
                str(ports["specgate"]),
            ]  # fmt: skip (no admin listener: 8081 may be taken)
            procs["specgate"] = stack.enter_context(_process(gw_cmd, ports["specgate"])).pid
            turn_ports: dict[str, list[int]] = {"specgate": [ports["specgate"]]}  # with tracing: every copy's
            pids: dict[str, list[int]] = {"specgate": [procs["specgate"]]}
            if tracing:
                sink = free_port()
                stack.enter_context(_process([py, "-m", "gateway.bench.otlp_sink", "--port", str(sink)], sink))
                for name in ("specgate", *TRACED):  # ``copies`` processes each, the first on ``ports[name]``
                    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink}"}
                    if name in TRACED:
                        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=TRACED[name])
                    turn_ports.setdefault(name, [])
                    pids.setdefault(name, [])
                    for k in range(len(turn_ports[name]), copies):
                        port = ports[name] if k == 0 else free_port()
                        cmd = [*gw_cmd[:-1], str(port)] + (["--tracing"] if name in TRACED else [])
                        pids[name].append(stack.enter_context(_process(cmd, port, env)).pid)
                        turn_ports[name].append(port)
            urls = {"direct": up_url, **{t: f"http://127.0.0.1:{p}" for t, p in ports.items()}}
            if with_epp:
                urls.update(stack.enter_context(start_epp_targets(d, rules, up_url, _process)))
            for mode in ("json", "stream"):
                for c in connections:
                    results: dict[str, WrkResult] = {}
                    plain: dict[str, float] = {}  # CPU us per request of each process measured here
                    base = TARGETS if not tracing else TARGETS[:-1]  # with tracing, specgate runs in turns below
                    for target in (*base, *EPP_TARGETS) if with_epp and mode == "json" else base:
                        url = urls[target] + "/v1/chat/completions"
                        run_tool(tool, url, scripts[mode], c, 1)  # warm connection pools and caches
                        before = cpu_s(procs[target]) if target in procs else None
                        results[target] = w = run_tool(tool, url, scripts[mode], c, duration_s)
                        if before is not None and (after := cpu_s(procs[target])) is not None and w.rps > 0:
                            plain[target] = (after - before) / (w.rps * duration_s) * 1e6
                    cpu: dict[str, float] = {}
                    ratios: dict[str, float] = {}
                    intervals: dict[str, tuple[float, float]] = {}
                    if tracing:  # specgate with and without tracing: in turns, and their CPU per request
                        group = {
                            t: [f"http://127.0.0.1:{p}/v1/chat/completions" for p in turn_ports[t]]
                            for t in ("specgate", *TRACED)
                        }
                        turns = _interleaved(tool, group, scripts[mode], c, duration_s, pids)
                        results.update(turns.results)
                        cpu, ratios, intervals = turns.cpu_us, turns.ratios, turns.intervals
                    n = copies if tracing else 1
                    rows.append(OverheadRow(mode, c, results, {**plain, **cpu}, ratios, intervals, n))
            ttft50: dict[str, float] = {}
            ttft99: dict[str, float] = {}
            short: dict[str, float] = {}
            long: dict[str, float] = {}
            for target in ("direct", "minimal-aiohttp", "specgate"):
                port = up_port if target == "direct" else ports[target]
                measure_ttft(port, stream_body, 0.5)  # warm
                ttft50[target], ttft99[target] = measure_ttft(port, stream_body, duration_s)
                url = urls[target] + "/v1/chat/completions"
                short[target] = run_tool(tool, url, scripts["stream"], 1, duration_s).p50_s
                run_tool(tool, url, scripts["long"], 1, 1)
                long[target] = run_tool(tool, url, scripts["long"], 1, duration_s).p50_s
    return rows, StreamCost(ttft50, ttft99, short, long)


TARGET_ADDED_P50_MS = 0.5  # the overhead targets: one worker, 1 connection
TARGET_RPS_32 = 3000  # non-streaming, 32 connections, load tool and upstream on the same 2-core machine
TARGET_ADDED_TTFT_MS = 1.0  # streams, p50


def epp_skipped() -> str | None:
    """Why the EPP targets cannot run here (no Envoy binary, no epp extra), or None."""
    from gateway.bench.envoy import missing

    return missing()


def render(rows: list[OverheadRow], streams: StreamCost | None = None, epp_note: str | None = None) -> str:
    head = (
        f"{'mode':<7}{'conns':>6} {'target':<16}{'req/s':>9}{'vs direct':>10}{'vs minimal':>11}"
        f"{'p50':>10}{'p99':>10}{'added p50':>11}{'added p99':>11}{'errors':>8}{'CPU/req':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        base_rps = r.results["direct"].rps
        minimal_rps = r.results["minimal-aiohttp"].rps
        for target in (t for t in (*TARGETS, *TRACED, *EPP_TARGETS) if t in r.results):
            w = r.results[target]
            vs_direct = f"{w.rps / base_rps:.2f}" if base_rps else "-"
            vs_min = f"{w.rps / minimal_rps:.2f}" if minimal_rps and target != "direct" else ""
            added50 = f"{r.added_ms(target):.2f}ms" if target != "direct" else ""
            added99 = f"{r.added_ms(target, 'p99'):.2f}ms" if target != "direct" else ""
            lines.append(
                f"{r.mode:<7}{r.connections:>6} {target:<16}{w.rps:>9.0f}{vs_direct:>10}{vs_min:>11}"
                f"{w.p50_s * 1000:>8.2f}ms{w.p99_s * 1000:>8.2f}ms{added50:>11}{added99:>11}{w.errors:>8}"
                + (f"{r.cpu_us[target]:>7.0f}us" if target in r.cpu_us else "")
            )
        lines.append("")
    if streams is not None:
        lines.append(
            f"streams at 1 connection (time to first event, socket client; relay cost from {LONG_STREAM_EVENTS}- vs "
            "16-event streams, events arriving together)"
        )
        lines.append(
            f"{'target':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'added p50':>11}{'added p99':>11}{'relay/event':>13}"
        )
        for target in ("direct", "minimal-aiohttp", "specgate"):
            added = target != "direct"
            lines.append(
                f"{target:<16}{streams.ttft_p50_s[target] * 1000:>8.2f}ms{streams.ttft_p99_s[target] * 1000:>8.2f}ms"
                + (
                    f"{streams.added_ttft_ms(target):>9.2f}ms{streams.added_ttft_ms(target, 'p99'):>9.2f}ms"
                    if added
                    else " " * 22
                )
                + (f"{streams.relay_us_per_event(target):>11.1f}us" if added else "")
            )
        lines.append("")
    lines.extend(_targets(rows, streams))
    lines.append("")
    lines.extend(render_epp(rows, epp_note))
    return "\n".join(lines)


def _targets(rows: list[OverheadRow], streams: StreamCost | None) -> list[str]:
    """The issue's targets for ``specgate``, each with the measured value and the minimal aiohttp proxy's."""
    out = ["targets (specgate; minimal aiohttp proxy in brackets, measured in the same run):"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for r in rows:
        if r.mode == "json" and r.connections == 1:
            v, m = r.added_ms("specgate"), r.added_ms("minimal-aiohttp")
            out.append(f"  added p50, 1 connection: {v:.2f} ms [{m:.2f}] (target <= {TARGET_ADDED_P50_MS} ms): "
                       f"{verdict(v <= TARGET_ADDED_P50_MS)}")  # fmt: skip
        if r.mode == "json" and r.connections == 32:
            v, m = r.results["specgate"].rps, r.results["minimal-aiohttp"].rps
            out.append(f"  non-streaming req/s, 32 connections: {v:.0f} [{m:.0f}] (target >= {TARGET_RPS_32}): "
                       f"{verdict(v >= TARGET_RPS_32)}")  # fmt: skip
        if r.connections == 32 and r.results.get("specgate"):
            v = r.results["specgate"].rps
            for name, least in TARGET_TRACED_RATIO.items():
                if name in r.results:
                    ratio = r.ratios.get(name, r.results[name].rps / v)
                    lo, hi = r.intervals.get(name, (ratio, ratio))
                    base_cpu, cpu = r.cpu_us.get("specgate"), r.cpu_us.get(name)
                    cost = f"; CPU {cpu:.0f} vs {base_cpu:.0f} us/request" if cpu and base_cpu else ""
                    said = "met" if lo >= least else "NOT met" if hi < least else "undecided (the interval spans it)"
                    out.append(f"  tracing on ({name}, {r.mode}), req/s vs specgate at 32 connections (median of "
                               f"the rounds' ratios): {ratio:.2f}, 90% interval {lo:.2f}-{hi:.2f} "
                               f"(target >= {least}): {said}{cost}")  # fmt: skip
    if any(name in r.results for r in rows for name in TRACED):
        n = max(r.copies for r in rows)
        out.append("  (tracing: exported to a local OTLP sink that takes the bytes without decoding them; CPU is the "
                   "gateway process's, all its threads and its export process, per request; each gateway measured "
                   f"in turns ran as {n} identical process{'es' if n > 1 else ''}, one of each per round)")  # fmt: skip
    if streams is not None:
        v, m = streams.added_ttft_ms("specgate"), streams.added_ttft_ms("minimal-aiohttp")
        out.append(f"  added TTFT p50: {v:.2f} ms [{m:.2f}] (target <= {TARGET_ADDED_TTFT_MS} ms): "
                   f"{verdict(v <= TARGET_ADDED_TTFT_MS)}")  # fmt: skip
    return out
