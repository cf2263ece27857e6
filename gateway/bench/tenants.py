"""``specgate bench tenants``: one tenant flooding a simulated pool at 5x its capacity next to a steady one at 20%
(and optionally a high-priority one at 10%): is the steady tenant served as if it were alone?

Starts one simulated vLLM server (``specgate sim``, ``--max-num-seqs`` M) and the gateway in front of it
(``specgate serve`` with a tenants file; the pool's admission bound is M requests in flight). Then:

1. **capacity**: M closed-loop clients for a few seconds: the pool's throughput C, in requests per second;
2. **alone**: the steady tenant alone, Poisson arrivals at 0.2 C;
3. **flood**: the same steady load, the flood tenant at 5 C (its requests-per-minute limit lets about two thirds
   of that through over the phase: a burst of 2.5 C x the phase, then its refill), and
   with ``--high-priority`` a third tenant of a better priority at 0.1 C.

At the full pool a request waits up to ``--wait`` seconds (the tenants file's ``waiting.wait_s``; 0: shed at
once) in the gateway's waiting room, best priority and fair share first.

The steady tenant has share weight 2 by default (``--steady-weight``): with equal weights its fair share is half
the bound, and its Poisson bursts at 20% of capacity reach that now and then, when it is shed as the rule says.

Per tenant and phase: sent, ok, shed (503), limited (429), p50 / p99 of the end-to-end latency of its successful
requests; and the steady tenant's p99 with the flood over its p99 alone. The target: at most 1.5x, none of the
steady tenant's requests shed or limited, the flood both shed and limited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.sim.launch import free_port, wait_for_port

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
KEYS = {
    "flood": "sk-bench-flood-0001",
    "steady": "sk-bench-steady-001",
    "gold": "sk-bench-gold-00001",
    "probe": "sk-bench-probe-0001",
}


@dataclass(slots=True)
class TenantResult:
    sent: int = 0
    ok: int = 0
    shed: int = 0
    limited: int = 0
    other: int = 0
    latencies: list[float] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)  # the error codes of the refused requests
    examples: dict[str, str] = field(default_factory=dict)  # the first message of each code

    def quantile(self, q: float) -> float | None:
        if not self.latencies:
            return None
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass(slots=True)
class TenantsRun:
    capacity_rps: float
    alone: dict[str, TenantResult]
    flood: dict[str, TenantResult]
    flood_rpm: int
    max_num_seqs: int
    duration_s: float
    priority: bool = False  # the simulator ran --scheduling-policy priority
    steady_weight: float = 2.0
    wait_s: float = 2.0  # the tenants file's waiting.wait_s

    def steady_ratio(self) -> float | None:
        a, b = self.alone["steady"].quantile(0.99), self.flood["steady"].quantile(0.99)
        return None if a is None or b is None or a <= 0 else b / a

    def problems(self) -> list[str]:
        out = []
        ratio = self.steady_ratio()
        if ratio is None or ratio > 1.5:
            out.append(f"steady p99 with the flood / alone = {ratio if ratio is None else round(ratio, 2)} (> 1.5)")
        s = self.flood["steady"]
        if s.shed or s.limited:
            out.append(f"steady tenant: {s.shed} shed, {s.limited} limited (want 0)")
        f = self.flood["flood"]
        if not f.shed or not f.limited:
            out.append(f"flood tenant: {f.shed} shed, {f.limited} limited (want both > 0)")
        gold = self.flood.get("gold")
        if gold is not None and self.priority:  # the fast lane, and vLLM's priority scheduling past the bound
            best = gold.quantile(0.99)
            others = [r.quantile(0.99) for name, r in self.flood.items() if name != "gold"]
            if best is None or any(o is not None and best >= o for o in others):
                out.append("the high-priority tenant's p99 is not below the others'")
        return out


def tenants_yaml(flood_rpm: int, steady_weight: float = 2.0, wait_s: float = 2.0) -> dict[str, Any]:
    return {
        "waiting": {"wait_s": wait_s},
        "tenants": [
            {"name": "flood", "keys": [KEYS["flood"]], "limits": {"requests_per_minute": flood_rpm}},
            {"name": "steady", "keys": [KEYS["steady"]], "weight": steady_weight},
            {"name": "gold", "keys": [KEYS["gold"]], "priority": -1},
            {"name": "probe", "keys": [KEYS["probe"]]},
        ],
    }


def rules_yaml(port: int, max_num_seqs: int, priority: bool = False) -> dict[str, Any]:
    return {
        "version": 1,
        "defaults": {"controller": None, "max_attempts": 1},
        "pools": [
            {
                "name": "std",
                "kind": "standard",
                "models": [MODEL],
                "endpoints": [{"url": f"http://127.0.0.1:{port}", "id": "std-sim-0"}],
                "max_num_seqs": max_num_seqs,
                "admission": {"max_waiting_per_endpoint": 0},
                "timeouts": {"connect_s": 2, "first_byte_s": 60, "total_s": 120},
                "scheduling_policy": "priority" if priority else "fcfs",
            }
        ],
        "classes": [{"name": "default", "route": {"preferred": "std"}}],
    }


async def _one(session: aiohttp.ClientSession, url: str, key: str, max_tokens: int, res: TenantResult) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens}
    res.sent += 1
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as r:
            raw = await r.read()
            status = r.status
            if status != 200:
                code = str(status)
                message = ""
                with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                    err = json.loads(raw)["error"]
                    code, message = f"{status} {err['code']}", str(err["message"])
                res.codes[code] = res.codes.get(code, 0) + 1
                res.examples.setdefault(code, message[:160])
    except (aiohttp.ClientError, TimeoutError):
        res.other += 1
        return
    if status == 200:
        res.ok += 1
        res.latencies.append(time.perf_counter() - started)
    elif status == 503:
        res.shed += 1
    elif status == 429:
        res.limited += 1
    else:
        res.other += 1


async def _open_loop(
    base: str, rates: dict[str, float], duration_s: float, max_tokens: int, seed: int
) -> dict[str, TenantResult]:
    url = base + "/v1/chat/completions"
    results = {name: TenantResult() for name in rates}
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        tasks: list[asyncio.Task[None]] = []

        async def arrivals(name: str, rate: float) -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            t = 0.0
            while True:
                t += rng.expovariate(rate)
                if t >= duration_s:
                    return
                await asyncio.sleep(max(0.0, start + t - loop.time()))
                tasks.append(asyncio.create_task(_one(session, url, KEYS[name], max_tokens, results[name])))

        await asyncio.gather(*(arrivals(n, r) for n, r in rates.items() if r > 0))
        await asyncio.gather(*tasks)
    return results


async def _capacity(base: str, clients: int, duration_s: float, max_tokens: int) -> float:
    url = base + "/v1/chat/completions"
    res = TenantResult()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.perf_counter() + duration_s

        async def loop() -> None:
            while time.perf_counter() < end:
                await _one(session, url, KEYS["probe"], max_tokens, res)

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        took = time.perf_counter() - started
    return res.ok / took


def bench_tenants(
    *,
    duration_s: float = 60.0,
    max_num_seqs: int = 16,
    output_len: int = 256,
    time_scale: float = 1.0,
    high_priority: bool = False,
    steady_weight: float = 2.0,
    wait_s: float = 2.0,
    seed: int = 7,
) -> TenantsRun:
    sim_port, gw_port = free_port(), free_port()
    py = sys.executable
    sim_cmd = [py, "-P", "-m", "gateway", "sim", MODEL, "--port", str(sim_port), "--time-scale", str(time_scale)]
    sim_cmd += ["--max-num-seqs", str(max_num_seqs), "--output-len-median", str(output_len), "--seed", str(seed)]
    # The simulator schedules by the body's priority as vLLM's --scheduling-policy priority does; the pool is marked
    # so, and the gateway sends each tenant's priority.
    priority = True
    sim_cmd += ["--scheduling-policy", "priority"]
    procs: list[subprocess.Popen[bytes]] = [subprocess.Popen(sim_cmd)]
    try:
        with tempfile.TemporaryDirectory(prefix="specgate-bench-tenants-") as tmp:
            wait_for_port(sim_port, timeout_s=60)
            rules, tenants = Path(tmp) / "rules.yaml", Path(tmp) / "tenants.yaml"
            rules.write_text(yaml.safe_dump(rules_yaml(sim_port, max_num_seqs, priority), sort_keys=False))
            base = f"http://127.0.0.1:{gw_port}"
            max_tokens = output_len * 2

            def start_gateway(flood_rpm: int) -> subprocess.Popen[bytes]:
                tenants.write_text(yaml.safe_dump(tenants_yaml(flood_rpm, steady_weight, wait_s), sort_keys=False))
                cmd = [py, "-P", "-m", "gateway", "serve", "--rules", str(rules), "--port", str(gw_port)]
                cmd += ["--host", "127.0.0.1", "--tenants-file", str(tenants), "--log-level", "warning"]
                cmd += ["--admin-port", "0", "--health-interval", "0.5"]
                proc = subprocess.Popen(cmd)
                procs.append(proc)
                wait_for_port(gw_port, timeout_s=60)
                return proc

            gw = start_gateway(1_000_000)
            time.sleep(1.0)  # the first health round
            capacity = asyncio.run(_capacity(base, max_num_seqs, min(10.0, duration_s / 2), max_tokens))
            # Over the phase its bucket lets through its burst (rpm) and the refill (rpm x phase / 60): set to
            # two thirds of the 5 C it sends, which still keeps the pool at its bound (so it is shed as well).
            flood_rpm = max(1, int((10 / 3) * capacity * duration_s / (1 + duration_s / 60)))
            gw.terminate()
            gw.wait(timeout=10)
            start_gateway(flood_rpm)
            time.sleep(1.0)
            steady = 0.2 * capacity
            alone = asyncio.run(_open_loop(base, {"steady": steady}, duration_s, max_tokens, seed))
            rates = {"steady": steady, "flood": 5 * capacity}
            if high_priority:
                rates["gold"] = 0.1 * capacity
            flood = asyncio.run(_open_loop(base, rates, duration_s, max_tokens, seed + 1))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
    return TenantsRun(capacity, alone, flood, flood_rpm, max_num_seqs, duration_s, priority, steady_weight, wait_s)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def render(run: TenantsRun) -> str:
    lines = [
        f"pool: 1 simulated endpoint, max_num_seqs {run.max_num_seqs} (admission bound {run.max_num_seqs}); "
        f"capacity {run.capacity_rps:.1f} req/s; flood limited to {run.flood_rpm} requests/min; "
        f"{run.duration_s:g} s per phase; vLLM scheduling: {'priority' if run.priority else 'fcfs'}; "
        f"weights: steady {run.steady_weight:g}, flood 1, gold 1 (priority -1); waiting room: {run.wait_s:g} s",
        "",
        f"{'phase':<7} {'tenant':<7} {'rate/s':>7} {'sent':>6} {'ok':>6} {'shed':>6} {'limited':>8} "
        f"{'p50 ms':>7} {'p99 ms':>7}",
    ]
    for phase, results in (("alone", run.alone), ("flood", run.flood)):
        for name, r in results.items():
            rate = r.sent / run.duration_s
            lines.append(
                f"{phase:<7} {name:<7} {rate:>7.1f} {r.sent:>6} {r.ok:>6} {r.shed:>6} {r.limited:>8} "
                f"{_ms(r.quantile(0.5)):>7} {_ms(r.quantile(0.99)):>7}"
            )
    for phase, results in (("alone", run.alone), ("flood", run.flood)):
        for name, r in results.items():
            for code, n in sorted(r.codes.items()):
                lines.append(f"{phase} {name} refused {n}x {code}: {r.examples.get(code, '')}")
    ratio = run.steady_ratio()
    lines += ["", f"steady p99 with the flood / alone: {'-' if ratio is None else f'{ratio:.2f}x'} (target <= 1.5x)"]
    problems = run.problems()
    lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return "\n".join(lines)
