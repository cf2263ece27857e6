"""``specgate bench controller``: the route-state controllers against simulated pools under a load step.

Starts one simulated vLLM server per pool of a routing YAML (the shipped default unless told otherwise), the
gateway in front of them (``specgate serve``, a child process), and sends an open-loop Poisson mix of requests in
phases of different rates (default low → high → low). The controllers' time constants (windows, hold times,
scrape interval) are multiplied by ``--time-scale`` like the simulators' clocks, so a run of a minute shows what
takes twenty minutes on real servers. While it runs it polls the gateway's ``/metrics`` every ``poll_s`` and
records every change of each controlled class's state and speculative share.

Reports: the transitions with their times since the start; per phase and class the requests, the errors, the
requests shed (admission control's answer), the share answered by the speculative pool,
client-side p50/p95 latency of the answered ones and the class's acceptance rate over the phase (Δaccepted /
Δdraft tokens of the gateway's per-class counters, i.e. vLLM's per-request spec-decode metrics); and the recovery
after the busiest phase: for the requests of the phases after it, by the time each was due, p50/p95 latency, the
shed and failed ones, how late the load generator sent them (a starved machine's generator falls behind: a request
due during the step but sent after it belongs to the step, not to the recovery), and the gateway's own in-flight
count and admission bound in that bin (from ``/metrics``). The tables are built by
``gateway.bench.controller_report``.

"Shed" is what admission control answers: 429, or 503 ``overloaded`` with ``Retry-After``. Any other refusal (a
503 ``upstream_timeout`` or ``no_capacity``, with or without ``Retry-After``) is an error.

Each simulated pool's ``max_num_seqs`` is written into the gateway's copy of the YAML, so admission control is
sized from it (``admission=False`` turns admission control off, for the comparison).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.controller import balancing_controller
from gateway.sim.launch import free_port, plan_stand_ins, stand_in_rules, wait_for_port

MODEL_PLACEHOLDER = "{model}"


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    rate: float  # requests per second (Poisson)
    duration_s: float


@dataclass(frozen=True, slots=True)
class MixItem:
    label: str
    weight: float
    temperature: float
    prompt: str


DEFAULT_MIX = (
    MixItem("code T=0", 0.45, 0.0, "Write a python function that parses a CSV file and returns the rows as dicts."),
    MixItem("chat T=0.3", 0.35, 0.3, "What should I look at when I compare two job offers?"),
    MixItem("creative T=1.0", 0.2, 1.0, "Write a short story about a lighthouse keeper who finds a map."),
)


def parse_phases(text: str) -> list[Phase]:
    """``"low:6:20,high:30:30,low:6:30"``: name:rate:seconds, comma-separated."""
    phases = []
    for part in text.split(","):
        bits = part.strip().split(":")
        if len(bits) != 3:
            raise ValueError(f"phase {part!r}: expected name:rate:seconds")
        try:
            name, rate, secs = bits[0], float(bits[1]), float(bits[2])
        except ValueError as exc:
            raise ValueError(f"phase {part!r}: rate and seconds must be numbers") from exc
        if rate <= 0 or secs <= 0:
            raise ValueError(f"phase {part!r}: rate and seconds must be > 0")
        phases.append(Phase(name, rate, secs))
    seen: dict[str, int] = {}
    unique = []
    for p in phases:  # "low" twice → "low", "low-2": per-phase numbers must not merge
        seen[p.name] = seen.get(p.name, 0) + 1
        unique.append(p if seen[p.name] == 1 else Phase(f"{p.name}-{seen[p.name]}", p.rate, p.duration_s))
    return unique


def _scaled_controller(ctl: dict[str, Any], time_scale: float, interval: float) -> dict[str, Any]:
    ctl = dict(ctl)
    ctl.setdefault("window_s", 30.0)
    ctl.setdefault("min_hold_s", 60.0)
    ctl.setdefault("reenable_after_s", 600.0)
    for key in ("window_s", "min_hold_s", "reenable_after_s"):
        ctl[key] = float(ctl[key]) * time_scale
    ctl["window_s"] = max(ctl["window_s"], 2 * interval)
    ctl["min_samples"] = min(int(ctl.get("min_samples", 20)), 5)
    ctl["max_changes_per_hour"] = max(int(ctl.get("max_changes_per_hour", 6)), 60)
    return ctl


def scaled_rules(rules: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """The controllers' and the scraper's time constants times ``time_scale`` (like the simulators' clocks)."""
    out = dict(rules)
    scrape = dict(out.get("scrape") or {})
    # not below a quarter second: a loaded 2-core machine answers /metrics in tens of milliseconds, not one
    interval = max(0.25, float(scrape.get("interval_s", 2.0)) * time_scale)
    scrape["interval_s"] = interval
    scrape["timeout_s"] = min(interval, max(0.25, float(scrape.get("timeout_s", 1.0)) * time_scale))
    scrape["window_s"] = max(2.5 * interval, float(scrape.get("window_s", 60.0)) * time_scale)
    scrape.pop("stale_after_s", None)
    out["scrape"] = scrape
    defaults = dict(out.get("defaults") or {})
    kinds = {p.get("kind", "standard") for p in out.get("pools", []) if isinstance(p, dict)}
    if "controller" not in defaults and len(kinds) > 1:  # the built-in balancing controller, scaled like a written one
        defaults["controller"] = balancing_controller().model_dump(exclude_defaults=True)
        out["defaults"] = defaults
    if isinstance(defaults.get("controller"), dict):
        out["defaults"] = {**defaults, "controller": _scaled_controller(defaults["controller"], time_scale, interval)}
    classes = []
    for cls in out.get("classes", []):
        c = dict(cls)
        ctl = c.get("controller")
        if isinstance(ctl, dict):
            c["controller"] = _scaled_controller(ctl, time_scale, interval)
        classes.append(c)
    out["classes"] = classes
    return out


def with_admission(rules: dict[str, Any], max_num_seqs: int, enabled: bool) -> dict[str, Any]:
    """Every pool runs ``max_num_seqs`` at once (the simulators' batch), admission control on or off."""
    out = dict(rules)
    pools = []
    for pool in out.get("pools", []):
        p = dict(pool)
        p["max_num_seqs"] = max_num_seqs
        p["admission"] = {**(p.get("admission") or {}), "enabled": enabled}
        pools.append(p)
    out["pools"] = pools
    return out


@dataclass(slots=True)
class Result:
    sent_at: float  # seconds since the start, when the request was sent
    label: str
    phase: str
    status: int
    latency_s: float
    traffic_class: str = ""
    pool: str = ""
    shed: bool = False  # 429, or 503 overloaded with Retry-After: refused fast, as admission control does
    due_at: float | None = None  # when the open-loop schedule wanted it sent (None: sent_at)
    code: str = ""  # the error envelope's code of a refused request

    @property
    def error(self) -> bool:
        return self.status != 200 and not self.shed

    @property
    def due(self) -> float:
        return self.sent_at if self.due_at is None else self.due_at

    @property
    def late_s(self) -> float:
        """How far behind its schedule the load generator sent it."""
        return max(0.0, self.sent_at - self.due)


def is_shed(status: int, retry_after: bool, code: str) -> bool:
    """Admission control's answer: 429, or 503 ``overloaded``, with ``Retry-After``."""
    return retry_after and (status == 429 or (status == 503 and code == "overloaded"))


def error_code(body: bytes) -> str:
    """The ``error.code`` of an OpenAI error envelope ("" when the body is not one)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    err = parsed.get("error") if isinstance(parsed, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else ""


@dataclass(frozen=True, slots=True)
class GatewayLoad:
    """One poll of the gateway's own numbers: requests in flight (all pools), the admission bound summed over the
    bounded pools, and the endpoints whose last health check passed."""

    at: float
    in_flight: float
    limit: float
    healthy: float


@dataclass(slots=True)
class Change:
    at: float
    traffic_class: str
    state: str
    share: float
    reason: str


@dataclass(slots=True)
class Run:
    phases: list[Phase]
    results: list[Result] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    boundaries: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)  # phase → class → counts
    final_share: dict[str, float] = field(default_factory=dict)
    load: list[GatewayLoad] = field(default_factory=list)


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


def _draft_counts(text: str) -> dict[str, tuple[float, float]]:
    drafted: dict[str, float] = {}
    accepted: dict[str, float] = {}
    for name, labels, value in _samples(text):
        if name == "specgate_class_draft_tokens_total":
            drafted[labels["class"]] = value
        elif name == "specgate_class_accepted_draft_tokens_total":
            accepted[labels["class"]] = value
    return {c: (drafted[c], accepted.get(c, 0.0)) for c in drafted}


class _Monitor:
    """Polls /metrics; records each controlled class's state/share changes with the reason of the transition."""

    def __init__(self, session: aiohttp.ClientSession, url: str, t0: float, run: Run) -> None:
        self.session, self.url, self.t0, self.run = session, url, t0, run
        self.state: dict[str, tuple[str, float]] = {}
        self.transitions: dict[tuple[str, str, str, str], float] = {}
        self.last_text = ""

    async def poll(self) -> None:
        async with self.session.get(f"{self.url}/metrics") as r:
            self.last_text = await r.text()
        now = time.monotonic() - self.t0
        states: dict[str, str] = {}
        shares: dict[str, float] = {}
        reasons: dict[str, str] = {}
        in_flight = limit = healthy = 0.0
        for name, labels, value in _samples(self.last_text):
            if name == "specgate_in_flight_requests":
                in_flight += value
            elif name == "specgate_admission_limit":
                limit += value
            elif name == "specgate_endpoint_healthy":
                healthy += value
            elif name == "specgate_class_route_state" and value == 1.0:
                states[labels["class"]] = labels["state"]
            elif name == "specgate_class_speculative_share":
                shares[labels["class"]] = value
            elif name == "specgate_controller_transitions_total":
                key = (labels["class"], labels["from"], labels["to"], labels["reason"])
                if value > self.transitions.get(key, 0.0):
                    reasons[labels["class"]] = labels["reason"]
                self.transitions[key] = value
        for cls, st in states.items():
            cur = (st, shares.get(cls, math.nan))
            if self.state.get(cls) != cur:
                reason = reasons.get(cls, "step" if cls in self.state and self.state[cls][0] == st else "start")
                self.run.changes.append(Change(round(now, 2), cls, st, cur[1], reason))
                self.state[cls] = cur
        self.run.final_share = shares
        self.run.load.append(GatewayLoad(round(now, 2), in_flight, limit, healthy))

    async def loop(self, poll_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                await self.poll()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    item: MixItem,
    phase: str,
    max_tokens: int,
    t0: float,
    due: float,
) -> Result:
    body = {
        "model": model,
        "temperature": item.temperature,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": item.prompt}],
    }
    start = time.monotonic()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            data = await r.read()
            code = error_code(data) if r.status != 200 else ""
            return Result(
                start - t0,
                item.label,
                phase,
                r.status,
                time.monotonic() - start,
                r.headers.get("x-specgate-class", ""),
                r.headers.get("x-specgate-pool", ""),
                shed=is_shed(r.status, "retry-after" in r.headers, code),
                due_at=due,
                code=code,
            )
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(start - t0, item.label, phase, 0, time.monotonic() - start, type(exc).__name__, due_at=due)


async def drive(
    url: str,
    model: str,
    phases: list[Phase],
    *,
    mix: tuple[MixItem, ...] = DEFAULT_MIX,
    max_tokens: int = 256,
    poll_s: float = 0.25,
    seed: int = 7,
) -> Run:
    """Open-loop Poisson arrivals per phase against the gateway at ``url``, with the /metrics monitor."""
    rng = random.Random(seed)
    run = Run(phases)
    weights = [m.weight for m in mix]
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)  # below uvicorn's 5 s: no reuse race
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        t0 = time.monotonic()
        monitor = _Monitor(session, url, t0, run)
        stop = asyncio.Event()
        mon = asyncio.create_task(monitor.loop(poll_s, stop))
        tasks: list[asyncio.Task[Result]] = []
        next_at = 0.0
        for phase in phases:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):  # a busy gateway may not answer
                await monitor.poll()
            run.boundaries[phase.name + "@start"] = _draft_counts(monitor.last_text)
            end = next_at + phase.duration_s
            while True:
                next_at += rng.expovariate(phase.rate)
                if next_at >= end:
                    next_at = end
                    break
                delay = t0 + next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                item = rng.choices(mix, weights)[0]
                job = _one(session, url, model, item, phase.name, max_tokens, t0, next_at)
                tasks.append(asyncio.create_task(job))
            delay = t0 + end - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        run.results = list(await asyncio.gather(*tasks))
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            await monitor.poll()
        run.boundaries["end"] = _draft_counts(monitor.last_text)
        stop.set()
        await mon
    return run


def bench_controller(
    rules_path: Path,
    phases: list[Phase],
    *,
    time_scale: float = 0.05,
    max_num_seqs: int = 4,
    output_len: int = 200,
    max_tokens: int = 256,
    admission: bool = True,
) -> tuple[Run, set[str]]:
    """Start simulated pools and the gateway, drive the phases, stop everything; the run and the speculative
    pools' names."""
    rules = yaml.safe_load(rules_path.read_text())
    ports = {p["name"]: free_port() for p in rules["pools"]}
    stand_ins = plan_stand_ins(rules, ports, time_scale=time_scale)
    extra = ["--max-num-seqs", str(max_num_seqs), "--output-len-median", str(output_len), "--seed", "3"]
    procs = [subprocess.Popen(s.cmd + (extra if "sim" in s.cmd else [])) for s in stand_ins]
    gw: subprocess.Popen[bytes] | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
            for s in stand_ins:
                wait_for_port(s.port, timeout_s=60)  # a busy machine starts a Python process slowly
            path = Path(tmp) / "rules.yaml"
            gw_rules = with_admission(scaled_rules(stand_in_rules(rules, ports), time_scale), max_num_seqs, admission)
            path.write_text(yaml.safe_dump(gw_rules, sort_keys=False))
            port = free_port()
            cmd = [sys.executable, "-P", "-m", "gateway", "serve", "--rules", str(path), "--port", str(port)]
            cmd += ["--host", "127.0.0.1", "--health-interval", "0.5", "--log-level", "warning", "--admin-port", "0"]
            gw = subprocess.Popen(cmd)
            wait_for_port(port, timeout_s=60)
            model = rules["pools"][0]["models"][0]
            run = asyncio.run(drive(f"http://127.0.0.1:{port}", model, phases, max_tokens=max_tokens))
    finally:
        for proc in [*procs, *([gw] if gw is not None else [])]:
            proc.terminate()
        for proc in [*procs, *([gw] if gw is not None else [])]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
    spec_pools = {p["name"] for p in rules["pools"] if p.get("kind") == "speculative"}
    return run, spec_pools
