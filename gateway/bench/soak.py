"""``specgate bench soak``: many concurrent streams through the gateway for a long time, with faults on a schedule.

Starts one simulated vLLM server per pool of a routing YAML, the gateway in front of them (``specgate serve``, a
child process; with ``redis`` a private ``redis-server`` too), and keeps ``streams`` closed-loop clients streaming
chat completions through it for ``duration_s``. A share of the clients stop reading their (long) answer for a while,
as a hung client does. Faults are injected on a schedule, as fractions of the duration, on the first pool's server:
cut streams, hangs, 503s, a restart of the server process, and a restart of Redis when there is one.

Every second it samples the gateway's RSS and open file descriptors (``/proc``), the in-flight gauges, the
ejections and the gateway's request count. Every request carries its own ``X-Request-Id`` and ends with exactly one
client-side outcome (``ok``, ``stream_error``, ``shed``, ``stalled_cut``, ``stalled_ok``, ``status_N``,
``client_exception``, ``broken``); the gateway's access log (its stderr, kept in a file) gives its side: one line
per request it finished, and a warning per ejection with the failures that caused it.

Checks (``Report.problems``; none = pass):

- every request exactly one terminal outcome: no request id in the access log twice or unknown to the clients;
  every request the clients got an HTTP answer for is in the log; a request that failed on the client's side
  (``client_exception``: refused or reset, possibly before the gateway read it) may or may not be; the gateway's
  ``specgate_requests_total`` grew by exactly the number of lines in its access log;
- no stream ended without ``[DONE]`` or an error event (``broken``);
- the in-flight gauges are back to 0 at the end;
- RSS grew less than ``max_rss_growth`` from the end of the warm-up (the first ``warmup_share`` of the run) to the
  end; open file descriptors are back within a few of the start once idle connections have closed;
- no endpoint was ejected outside the fault windows (an endpoint that was only busy is never ejected); a window
  lasts until the fault's effects can have passed: ``effect_s`` after its end (a hung request's first token, a
  restarted server's first health check).
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.bench.controller import scaled_rules, with_admission
from gateway.sim.launch import StandIn, free_port, plan_stand_ins, stand_in_rules, wait_for_port

PROMPTS = (
    (0.0, "Write a python function that parses a CSV file and returns the rows as dicts."),
    (0.3, "What should I look at when I compare two job offers?"),
    (1.0, "Write a short story about a lighthouse keeper who finds a map."),
)


FD_SLACK = 10  # descriptors the gateway may hold open after the run beyond those at the start (logs, the loop's own)
EJECTED = re.compile(r"endpoint (\S+) ejected for")


@dataclass(frozen=True, slots=True)
class Fault:
    start: float  # fraction of the duration
    end: float
    name: str  # cut | hang | 503 | restart | redis
    patch: dict[str, Any] = field(default_factory=dict)  # PUT /sim/faults


SCHEDULE = (
    Fault(0.15, 0.25, "cut", {"cut_after": 3, "cut_rate": 0.2}),
    Fault(0.30, 0.40, "hang", {"hang_s": 2.0, "hang_rate": 0.1}),
    Fault(0.45, 0.55, "503", {"error_rate": 0.2, "error_status": 503}),
    Fault(0.60, 0.70, "restart"),
    Fault(0.75, 0.85, "redis"),
)


@dataclass(frozen=True, slots=True)
class SoakConfig:
    rules: Path = Path("routing_rules/default.yaml")
    streams: int = 1000
    duration_s: float = 600.0
    time_scale: float = 0.05
    max_num_seqs: int = 256
    max_tokens: int = 48
    stall_share: float = 0.01  # of the requests: a client that stops reading a long answer
    stall_tokens: int = 30000
    send_timeout_s: float = 2.0  # the gateway's overload.client_send_timeout_s for the run
    faults: bool = True
    redis: bool = False
    warmup_share: float = 0.2
    max_rss_growth: float = 0.10
    sample_s: float = 1.0
    settle_s: float = 6.0  # after the run, before the last sample: idle keep-alive connections close
    effect_s: float = 5.0  # a fault's effects may be seen this long after its window ends
    seed: int = 11


@dataclass(slots=True)
class Sample:
    t: float
    rss_kb: int
    fds: int
    in_flight: float
    ejections: float
    requests: float


@dataclass(slots=True)
class Ejection:
    at: float  # seconds since the start (when the sampler saw it)
    endpoint: str = ""  # pool/endpoint, from the gateway's log
    why: str = ""  # the log line's account of the failures


@dataclass(slots=True)
class Report:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    counted: float = 0.0  # the gateway's specgate_requests_total growth
    final_in_flight: float = float("nan")
    windows: list[tuple[float, float, str]] = field(default_factory=list)  # seconds, fault
    ejected_at: list[float] = field(default_factory=list)
    ejections: list[Ejection] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)  # request ids the clients got an HTTP answer for
    failed: set[str] = field(default_factory=set)  # request ids that failed on the client's side
    logged: Counter[str] = field(default_factory=Counter)  # request id -> access-log lines
    log_read: bool = False  # the access log was read (else the per-request checks are not made)
    problems: list[str] = field(default_factory=list)

    def rss_at(self, t: float) -> int:
        before = [s.rss_kb for s in self.samples if s.t <= t]
        return before[-1] if before else (self.samples[0].rss_kb if self.samples else 0)

    def check(self) -> None:
        c = self.config
        self._check_terminal()
        if self.outcomes.get("broken"):
            self.problems.append(f"{self.outcomes['broken']} stream(s) ended without [DONE] or an error event")
        if self.final_in_flight != 0:
            self.problems.append(f"in-flight gauges at the end: {self.final_in_flight:g} (expected 0)")
        if self.samples:
            warm, end = self.rss_at(c.duration_s * c.warmup_share), self.samples[-1].rss_kb
            if warm and (end - warm) / warm >= c.max_rss_growth:
                self.problems.append(f"RSS grew {100 * (end - warm) / warm:.1f}% after warm-up ({warm} -> {end} kB)")
        if len(self.samples) > 1 and self.samples[-1].fds > self.samples[0].fds + FD_SLACK:
            self.problems.append(f"open fds: {self.samples[0].fds} at the start, {self.samples[-1].fds} at the end")
        for at in self.ejected_at:
            if not any(start - 1.0 <= at <= end + c.effect_s for start, end, _ in self.windows):
                self.problems.append(f"an endpoint was ejected at {at:.1f}s, outside every fault window")

    def _check_terminal(self) -> None:
        """Every request exactly one terminal outcome, by request id (client side vs the gateway's access log)."""
        if not self.log_read:
            self.problems.append("the gateway's access log could not be read: the per-request checks were not made")
            return
        twice = [rid for rid, n in self.logged.items() if n > 1]
        if twice:
            self.problems.append(f"{len(twice)} request(s) logged more than once by the gateway, e.g. {twice[0]}")
        unknown = [rid for rid in self.logged if rid not in self.answered and rid not in self.failed]
        if unknown:
            self.problems.append(
                f"{len(unknown)} request(s) in the gateway's log that no client sent, e.g. {unknown[0]}"
            )
        missing = [rid for rid in self.answered if rid not in self.logged]
        if missing:
            self.problems.append(
                f"{len(missing)} answered request(s) missing from the gateway's log, e.g. {missing[0]}"
            )
        lines = sum(self.logged.values())
        if abs(self.counted - lines) > 0.5:
            self.problems.append(
                f"the gateway's specgate_requests_total grew by {self.counted:g}, its access log has {lines} lines"
            )

    def render(self) -> str:
        c, s = self.config, self.samples
        lines = [
            f"soak: {c.streams} streams for {c.duration_s:g}s through {c.rules} "
            f"({c.stall_share:.0%} of requests stop reading; faults {'on' if c.faults else 'off'})",
            f"requests sent {self.sent}, counted by the gateway {self.counted:g} "
            f"(access log: {sum(self.logged.values())} lines; client-side failures {len(self.failed)}, "
            f"{sum(1 for r in self.failed if r in self.logged)} of them seen by the gateway)",
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            "faults: " + (", ".join(f"{n} {a:.0f}-{b:.0f}s" for a, b, n in self.windows) or "none"),
        ]
        if s:
            warm = self.rss_at(c.duration_s * c.warmup_share)
            lines += [
                f"RSS kB: start {s[0].rss_kb}, after warm-up {warm}, end {s[-1].rss_kb}, "
                f"peak {max(x.rss_kb for x in s)}",
                f"open fds: start {s[0].fds}, end {s[-1].fds}, peak {max(x.fds for x in s)}",
                f"in flight: peak {max(x.in_flight for x in s):g}, at the end {self.final_in_flight:g}",
                f"ejections: {len(self.ejected_at)}" + (f" at {self.ejected_at}" if self.ejected_at else ""),
                *(f"  ejected {e.endpoint} at {e.at:.1f}s: {e.why}" for e in self.ejections),
                "timeline (t s, RSS kB, fds, in flight): "
                + "; ".join(f"{x.t:.0f} {x.rss_kb} {x.fds} {x.in_flight:g}" for x in s[:: max(1, len(s) // 12)]),
            ]
        lines.append("PASS" if not self.problems else "FAIL: " + "; ".join(self.problems))
        return "\n".join(lines)


def _proc_numbers(pid: int) -> tuple[int, int]:
    """RSS (kB) and open file descriptors of a process (0, 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return 0, 0


def _sum(text: str, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                total += s.value
    return total


def read_gateway_log(path: Path, report: Report, wall0: float) -> None:
    """The gateway's side from its log: access lines per request id, and each ejection (``wall0``: the wall-clock
    time of the run's start, for the ejections' times)."""
    with path.open("rb") as f:
        for raw in f:
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a line not written by the gateway's logger
            if not isinstance(line, dict):
                continue
            if line.get("event") == "request":
                report.logged[str(line.get("request_id"))] += 1
                continue
            message = str(line.get("message", ""))
            m = EJECTED.search(message)
            if m is not None:
                report.ejections.append(Ejection(_log_time(str(line.get("ts", ""))) - wall0, m.group(1), message))
    report.log_read = True


def _log_time(ts: str) -> float:
    """The epoch seconds of a log line's ``ts`` (UTC, ``2026-12-01T19:29:04.048Z``); nan when unreadable."""
    try:
        whole, _, ms = ts.rstrip("Z").partition(".")
        return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(ms or 0) / 1000
    except ValueError:
        return float("nan")


class _Soak:
    def __init__(self, cfg: SoakConfig, url: str, gw_pid: int, stand_ins: list[StandIn], redis: Any) -> None:
        self.cfg, self.url, self.gw_pid = cfg, url, gw_pid
        self.log_path: Path | None = None
        self.wall0 = 0.0
        self.seq = 0
        self.stand_ins = stand_ins
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.redis = redis
        self.report = Report(cfg)
        self.stop = asyncio.Event()
        self.rng = random.Random(cfg.seed)
        self.t0 = 0.0
        self.model = ""

    def body(self, max_tokens: int) -> bytes:
        temperature, prompt = self.rng.choice(PROMPTS)
        return orjson.dumps(
            {
                "model": self.model,
                "stream": True,
                "temperature": temperature,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompt}],
            }
        )

    def request_id(self) -> str:
        self.seq += 1
        return f"soak-{self.seq}"

    async def normal(self, session: aiohttp.ClientSession, rid: str) -> str:
        try:
            body, headers = self.body(self.cfg.max_tokens), {"content-type": "application/json", "x-request-id": rid}
            async with session.post(self.url + "/v1/chat/completions", data=body, headers=headers) as r:
                self.report.answered.add(rid)
                data = await r.read()
                if r.status in (429, 503) and "retry-after" in r.headers:
                    await asyncio.sleep(min(5.0, float(r.headers["retry-after"])))  # as the OpenAI SDKs do
                    return "shed"
                if r.status != 200:
                    return f"status_{r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError):
            return "client_exception"
        if not data.rstrip().endswith(b"data: [DONE]"):
            return "broken"
        return "stream_error" if b'data: {"error"' in data else "ok"

    async def stalled(self, rid: str) -> str:
        """A client with a tiny receive buffer that reads nothing for three send deadlines, then reads the rest."""
        body = self.body(self.cfg.stall_tokens)
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
            f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        host, port = self.url.removeprefix("http://").split(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return "client_exception"
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:  # a small receive window: the gateway's sends block once its buffers are full
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(head + body)
            await writer.drain()
            await asyncio.sleep(3 * self.cfg.send_timeout_s)
            async with asyncio.timeout(120):
                data = await reader.read()
        except (OSError, TimeoutError):
            return "client_exception"
        finally:
            writer.close()
        if data.startswith(b"HTTP/1.1 "):
            self.report.answered.add(rid)
        return "stalled_ok" if data.rstrip().endswith(b"data: [DONE]") else "stalled_cut"

    async def client(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            stall = self.rng.random() < self.cfg.stall_share
            rid = self.request_id()
            outcome = await (self.stalled(rid) if stall else self.normal(session, rid))
            if rid not in self.report.answered:
                self.report.failed.add(rid)
            self.report.outcomes[outcome] += 1
            self.report.sent += 1

    async def metrics_text(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self.url + "/metrics") as r:
            return await r.text()

    async def sampler(self, session: aiohttp.ClientSession) -> None:
        last_ejections = 0.0
        while True:
            rss, fds = _proc_numbers(self.gw_pid)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                text = await self.metrics_text(session)
                t = time.monotonic() - self.t0
                ejections = _sum(text, "specgate_endpoint_ejections_total")
                if ejections > last_ejections:
                    self.report.ejected_at.append(round(t, 1))
                last_ejections = ejections
                inflight, requests = _sum(text, "specgate_in_flight_requests"), _sum(text, "specgate_requests_total")
                self.report.samples.append(Sample(round(t, 1), rss, fds, inflight, ejections, requests))
            if self.stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.cfg.sample_s)

    async def faults(self, session: aiohttp.ClientSession) -> None:
        target = self.stand_ins[0]
        windows = self.report.windows
        try:
            for f in SCHEDULE:
                if f.name == "redis" and self.redis is None:
                    continue
                await asyncio.sleep(max(0.0, self.t0 + f.start * self.cfg.duration_s - time.monotonic()))
                windows.append((round(time.monotonic() - self.t0, 1), float("inf"), f.name))  # open until it ends
                if f.name == "restart":
                    await asyncio.to_thread(self.restart, target)
                elif f.name == "redis":
                    await asyncio.to_thread(self.redis.restart)
                else:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.put(f"http://127.0.0.1:{target.port}/sim/faults", json=f.patch) as r:
                            await r.read()
                await asyncio.sleep(max(0.0, self.t0 + f.end * self.cfg.duration_s - time.monotonic()))
                if f.patch:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.post(f"http://127.0.0.1:{target.port}/sim/faults/reset") as r:
                            await r.read()
                windows[-1] = (windows[-1][0], round(time.monotonic() - self.t0, 1), f.name)
        finally:
            if windows and windows[-1][1] == float("inf"):  # cut short by the end of the run
                windows[-1] = (windows[-1][0], round(time.monotonic() - self.t0, 1), windows[-1][2])

    def restart(self, target: StandIn) -> None:
        """Stop the pool's server process and start it again on the same port (a pod restart)."""
        proc = self.procs[target.pool]
        proc.terminate()
        proc.wait(10)
        time.sleep(0.5)
        self.procs[target.pool] = subprocess.Popen(target.cmd, stdout=subprocess.DEVNULL)
        wait_for_port(target.port, timeout_s=60)

    async def run(self) -> Report:
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            before = _sum(await self.metrics_text(session), "specgate_requests_total")
            self.t0, self.wall0 = time.monotonic(), time.time()
            sampler = asyncio.create_task(self.sampler(session))
            faults = asyncio.create_task(self.faults(session)) if self.cfg.faults else None
            clients = [asyncio.create_task(self.client(session)) for _ in range(self.cfg.streams)]
            await asyncio.sleep(self.cfg.duration_s)
            self.stop.set()
            if faults is not None:
                faults.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await faults
            await asyncio.gather(*clients)
            await sampler
            deadline = time.monotonic() + 30  # the gateway books a request just after its last byte
            while True:
                text = await self.metrics_text(session)
                self.report.counted = _sum(text, "specgate_requests_total") - before
                self.report.final_in_flight = _sum(text, "specgate_in_flight_requests")
                done = self.report.counted >= self.report.sent and self.report.final_in_flight == 0
                if done or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        # The clients' connections are closed now; idle upstream ones close when the servers' keep-alive ends.
        await asyncio.sleep(self.cfg.settle_s)
        rss, fds = _proc_numbers(self.gw_pid)
        t = round(time.monotonic() - self.t0, 1)
        self.report.samples.append(Sample(t, rss, fds, self.report.final_in_flight, 0.0, 0.0))
        if self.log_path is not None:
            with contextlib.suppress(OSError):  # not read: check() says so
                read_gateway_log(self.log_path, self.report, self.wall0)
        self.report.check()
        return self.report


class _Redis:
    """A private redis-server on a free port, restartable (an outage of the shared store)."""

    def __init__(self, binary: str, workdir: str) -> None:
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([*args, "--dir", self.workdir], stdout=subprocess.DEVNULL)
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        time.sleep(1.0)
        self.start()


def run_soak(cfg: SoakConfig) -> Report:
    """Start the simulated pools, the gateway (and Redis), run the soak, stop everything; the report."""
    rules = yaml.safe_load(cfg.rules.read_text())
    ports = {p["name"]: free_port() for p in rules["pools"]}
    stand_ins = plan_stand_ins(rules, ports, time_scale=cfg.time_scale)
    extra = ["--max-num-seqs", str(cfg.max_num_seqs), "--seed", "3"]
    stand_ins = [StandIn(s.pool, s.port, s.cmd + (extra if "sim" in s.cmd else [])) for s in stand_ins]
    procs = {s.pool: subprocess.Popen(s.cmd, stdout=subprocess.DEVNULL) for s in stand_ins}
    gw: subprocess.Popen[bytes] | None = None
    redis: _Redis | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="specgate-soak-") as tmp:
            for s in stand_ins:
                wait_for_port(s.port, timeout_s=60)
            binary = shutil.which("redis-server") if cfg.redis else None
            if cfg.redis and binary is None:
                raise RuntimeError("--redis: no redis-server on PATH")
            if binary is not None:
                redis = _Redis(binary, tmp)
                redis.start()
            scaled = scaled_rules(stand_in_rules(rules, ports), cfg.time_scale)
            gw_rules = with_admission(scaled, cfg.max_num_seqs, True)
            gw_rules["overload"] = {**(gw_rules.get("overload") or {}), "client_send_timeout_s": cfg.send_timeout_s}
            path = Path(tmp) / "rules.yaml"
            path.write_text(yaml.safe_dump(gw_rules, sort_keys=False))
            port = free_port()
            cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(path), "--port", str(port)]
            # info: the access log (one line per request) is the gateway's side of the per-request check
            cmd += ["--host", "127.0.0.1", "--health-interval", "0.5", "--log-level", "info", "--admin-port", "0"]
            if redis is not None:
                cmd += ["--redis-url", redis.url]
            log_path = Path(tmp) / "gateway.log"
            with log_path.open("wb") as log:
                gw = subprocess.Popen(cmd, stderr=log)
            wait_for_port(port, timeout_s=60)  # a busy machine starts a Python process slowly
            soak = _Soak(cfg, f"http://127.0.0.1:{port}", gw.pid, stand_ins, redis)
            soak.procs = procs
            soak.log_path = log_path
            soak.model = rules["pools"][0]["models"][0]
            return asyncio.run(soak.run())
    finally:
        for proc in [*procs.values(), *([gw] if gw is not None else [])]:
            proc.terminate()
        for proc in [*procs.values(), *([gw] if gw is not None else [])]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if redis is not None:
            redis.stop()
