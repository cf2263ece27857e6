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

The checks (``Report.problems``; none = pass) and the report are in ``gateway.bench.soak_checks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.bench.controller import scaled_rules, with_admission
from gateway.bench.soak_checks import Report, Sample, SoakConfig, read_gateway_log
from gateway.sim.launch import StandIn, free_port, plan_stand_ins, stand_in_rules, wait_for_port

PROMPTS = (
    (0.0, "Write a python function that parses a CSV file and returns the rows as dicts."),
    (0.3, "What should I look at when I compare two job offers?"),
    (1.0, "Write a short story about a lighthouse keeper who finds a map."),
)


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
                    await self.sim_faults(session, target, "PUT", "/sim/faults", f.patch)
                await asyncio.sleep(max(0.0, self.t0 + f.end * self.cfg.duration_s - time.monotonic()))
                if f.patch and not await self.sim_faults(session, target, "POST", "/sim/faults/reset", None):
                    await self.stop.wait()  # still on: its window stays open to the end of the run (which fails)
                    return
                windows[-1] = (windows[-1][0], round(time.monotonic() - self.t0, 1), f.name)
        finally:
            if windows and windows[-1][1] == float("inf"):  # cut short by the end of the run
                windows[-1] = (windows[-1][0], round(time.monotonic() - self.t0, 1), windows[-1][2])

    async def sim_faults(
        self, session: aiohttp.ClientSession, target: StandIn, method: str, path: str, body: dict[str, Any] | None
    ) -> bool:
        """Set or reset the server's faults, tried three times; a failure is one of the run's problems (a fault that
        stays on outlasts its window)."""
        error = ""
        for _ in range(3):
            try:
                async with session.request(method, f"http://127.0.0.1:{target.port}{path}", json=body) as r:
                    await r.read()
                    if r.status < 300:
                        return True
                    error = f"HTTP {r.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(1.0)
        self.report.problems.append(f"{method} {path} on {target.pool}'s server failed: {error}")
        return False

    def restart(self, target: StandIn) -> None:
        """Stop the pool's server process and start it again on the same port (a pod restart)."""
        proc = self.procs[target.pool]
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
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
            cmd = [sys.executable, "-P", "-m", "gateway", "serve", "--rules", str(path), "--port", str(port)]
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
