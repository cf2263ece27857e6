"""``specgate bench load``: an open-loop load generator for an OpenAI-compatible endpoint, driven by a traffic mix.

Arrivals are open loop (a request is sent at its time whether or not earlier ones have finished, so an overloaded
server sees its queue grow instead of a politely slower client): ``poisson`` or ``constant`` at ``--rate``,
``burst:BASE,PEAK,PERIOD,LENGTH`` (Poisson at PEAK for LENGTH seconds at the start of every PERIOD, BASE
otherwise) and ``step:R1@S1,R2@S2,...`` (Poisson at R1 for S1 seconds, then R2 for S2 seconds, ...).

Per request: TTFT (first content chunk), TPOT = (last content chunk − first) / (completion_tokens − 1) with
completion_tokens from the stream's usage chunk (the first token excluded), the inter-chunk gaps, E2E, status.
Non-streaming requests have E2E only; they count towards goodput when E2E ≤ ttft_s + tpot_s·(tokens − 1).
Times are divided by ``time_scale`` (a simulated server's clock: 0.5 = it runs twice as fast as real time).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.bench.mix import Mix, Planned, plan_request

# ---------------------------------------------------------------------------------------------------------------
# Arrivals


def _poisson(rate: float, start: float, end: float, rng: random.Random) -> list[float]:
    out: list[float] = []
    if rate <= 0:
        return out
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append(t)


def arrival_times(kind: str, rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start. ``kind``: poisson | constant | burst:B,P,PERIOD,LEN | step:R@S,..."""
    name, _, spec = kind.partition(":")
    name = name.strip().lower()
    if name == "poisson":
        return _poisson(rate, 0.0, duration_s, rng)
    if name == "constant":
        if rate <= 0:
            return []
        return [i / rate for i in range(math.ceil(duration_s * rate - 1e-9))]
    if name == "burst":
        try:
            base, peak, period, length = (float(x) for x in spec.split(","))
        except ValueError:
            raise ValueError(f"burst arrivals: expected burst:BASE,PEAK,PERIOD,LENGTH, got {kind!r}") from None
        if period <= 0 or not 0 < length <= period or base < 0 or peak < 0:
            raise ValueError(f"burst arrivals {kind!r}: need 0 < LENGTH <= PERIOD and rates >= 0")
        out: list[float] = []
        t = 0.0
        while t < duration_s:
            out += _poisson(peak, t, min(t + length, duration_s), rng)
            out += _poisson(base, t + length, min(t + period, duration_s), rng)
            t += period
        return out
    if name == "step":
        out = []
        t = 0.0
        for part in spec.split(","):
            r, at, secs = part.partition("@")
            try:
                seg_rate, seg_s = float(r), float(secs)
            except ValueError:
                raise ValueError(f"step arrivals: expected step:RATE@SECONDS,..., got {kind!r}") from None
            if not at or seg_rate < 0 or seg_s <= 0:
                raise ValueError(f"step arrivals: expected step:RATE@SECONDS,..., got {kind!r}")
            out += _poisson(seg_rate, t, t + seg_s, rng)
            t += seg_s
        return out
    raise ValueError(f"unknown arrival process {kind!r} (poisson | constant | burst:... | step:...)")


def arrival_span(kind: str, duration_s: float) -> float:
    """Seconds the arrivals cover: ``duration_s``, or for ``step:`` the sum of its segments."""
    name, _, spec = kind.partition(":")
    if name.strip().lower() != "step":
        return duration_s
    return sum(float(part.partition("@")[2]) for part in spec.split(","))


# ---------------------------------------------------------------------------------------------------------------
# One request


@dataclass(slots=True)
class Result:
    sent_s: float
    cls: str
    task: str
    stream: bool
    status: int = 0
    error: str = ""
    e2e_s: float = math.nan
    ttft_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int = 0
    chunks: int = 0
    itl_s: list[float] = field(default_factory=list)
    pool: str = ""
    route_class: str = ""
    good: bool = False
    endpoint: str = ""  # the gateway's x-specgate-endpoint (empty: another front, or no answer)
    route: str = ""  # the gateway's x-specgate-route: why the plan put that pool first (empty: another front)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def tpot_from_chunks(chunk_times: list[float], completion_tokens: int) -> float | None:
    """Time per output token after the first: (last content chunk − first) / (tokens − 1). A speculative server
    sends several tokens in one chunk, so the chunk count is not the token count; the usage's is."""
    if len(chunk_times) < 2 or completion_tokens < 2:
        return None
    return (chunk_times[-1] - chunk_times[0]) / (completion_tokens - 1)


def _content(chunk: dict[str, Any]) -> bool:
    if chunk.get("type") == "response.output_text.delta":  # the Responses API
        return bool(chunk.get("delta"))
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


def _output_tokens(usage: dict[str, Any]) -> int:
    """Generated tokens from chat's ``completion_tokens`` or the Responses API's ``output_tokens``."""
    return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)


async def send_one(
    session: aiohttp.ClientSession, url: str, planned: Planned, sent_s: float, time_scale: float = 1.0
) -> Result:
    res = Result(sent_s, planned.cls.name, planned.cls.task, planned.stream)
    start = time.monotonic()
    chunk_times: list[float] = []
    try:
        async with session.post(f"{url}{planned.path}", json=planned.body, headers=planned.headers) as r:
            res.status = r.status
            res.pool = r.headers.get("x-specgate-pool", "")
            res.route_class = r.headers.get("x-specgate-class", "")
            res.route = r.headers.get("x-specgate-route", "")
            if r.status != 200:
                res.error = (await r.text())[:200]
            elif planned.stream:
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        res.error = str(chunk["error"])[:200]
                    if _content(chunk):
                        chunk_times.append(time.monotonic() - start)
                    usage = chunk.get("usage") or (chunk.get("response") or {}).get("usage")
                    if usage:
                        res.completion_tokens = _output_tokens(usage)
            else:
                body = await r.json()
                res.completion_tokens = _output_tokens(body.get("usage") or {})
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        res.error = type(exc).__name__
    res.e2e_s = (time.monotonic() - start) / time_scale
    if chunk_times:
        scaled = [t / time_scale for t in chunk_times]
        res.ttft_s = scaled[0]
        res.chunks = len(scaled)
        res.itl_s = [round(b - a, 6) for a, b in itertools.pairwise(scaled)]
        res.tpot_s = tpot_from_chunks(scaled, res.completion_tokens or len(scaled))
    res.good = meets_targets(res, planned.cls.targets.ttft_s, planned.cls.targets.tpot_s)
    return res


def meets_targets(r: Result, ttft_s: float, tpot_s: float) -> bool:
    if not r.ok:
        return False
    if r.stream:
        if r.ttft_s is None or r.ttft_s > ttft_s:
            return False
        return r.tpot_s is None or r.tpot_s <= tpot_s
    return r.e2e_s <= ttft_s + tpot_s * max(0, r.completion_tokens - 1)


# ---------------------------------------------------------------------------------------------------------------
# The run


async def run_load(
    url: str,
    mix: Mix,
    times: list[float],
    *,
    model: str,
    seed: int = 7,
    time_scale: float = 1.0,
    on_done: Callable[[Result], None] | None = None,
    timeout_s: float = 600.0,
) -> list[Result]:
    """Send one request of the mix at each of ``times`` (seconds from now, open loop); every result."""
    rng = random.Random(seed)
    plans = [plan_request(mix, model, rng) for _ in times]
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)  # below uvicorn's 5 s: no reuse race
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def one(planned: Planned, at: float) -> Result:
            res = await send_one(session, url, planned, at, time_scale)
            if on_done is not None:
                on_done(res)
            return res

        t0 = time.monotonic()
        tasks: list[asyncio.Task[Result]] = []
        for planned, at in zip(plans, times, strict=True):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(planned, at)))
        return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]); NaN for no values."""
    v = sorted(values)
    if not v:
        return math.nan
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


@dataclass(frozen=True, slots=True)
class Summary:
    cls: str
    requests: int
    errors: int
    goodput_rps: float
    good_share: float
    ttft: tuple[float, float, float]  # p50, p95, p99 (seconds)
    tpot: tuple[float, float, float]
    itl: tuple[float, float, float]
    e2e: tuple[float, float, float]
    spec_share: float = math.nan  # answered by a speculative pool (when known)


def _pcts(values: list[float]) -> tuple[float, float, float]:
    return percentile(values, 0.5), percentile(values, 0.95), percentile(values, 0.99)


def summarise(results: list[Result], duration_s: float, spec_pools: frozenset[str] = frozenset()) -> list[Summary]:
    """Per class and for all (``cls == "all"``); goodput = requests meeting their targets / ``duration_s``."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.cls, []).append(r)
    out = []
    for name, rs in [*sorted(groups.items()), ("all", results)]:
        ok = [r for r in rs if r.ok]
        good = sum(1 for r in rs if r.good)
        on_spec = sum(1 for r in ok if r.pool in spec_pools)
        out.append(
            Summary(
                cls=name,
                requests=len(rs),
                errors=len(rs) - len(ok),
                goodput_rps=good / duration_s if duration_s > 0 else math.nan,
                good_share=good / len(rs) if rs else math.nan,
                ttft=_pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
                tpot=_pcts([r.tpot_s for r in ok if r.tpot_s is not None]),
                itl=_pcts([g for r in ok for g in r.itl_s]),
                e2e=_pcts([r.e2e_s for r in ok]),
                spec_share=on_spec / len(ok) if ok and spec_pools else math.nan,
            )
        )
    return out


def write_jsonl(
    path: Path, results: list[Result], extra: dict[str, Any] | None = None, *, append: bool = False
) -> None:
    with path.open("a" if append else "w") as f:
        for r in results:
            row = {**(extra or {}), **asdict(r)}
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            f.write(json.dumps(clean) + "\n")


def render_summary(summaries: list[Summary], title: str = "bench load") -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    def ms(v: tuple[float, float, float]) -> str:
        return " / ".join("-" if math.isnan(x) else f"{x * 1000:.0f}" for x in v)

    buf = StringIO()
    table = Table(title=f"{title} (ms: p50 / p95 / p99)")
    for col in ("class", "requests", "errors", "TTFT", "TPOT", "inter-chunk", "E2E", "goodput req/s", "good"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for s in summaries:
        table.add_row(
            s.cls,
            str(s.requests),
            str(s.errors),
            ms(s.ttft),
            ms(s.tpot),
            ms(s.itl),
            ms(s.e2e),
            f"{s.goodput_rps:.2f}",
            "-" if math.isnan(s.good_share) else f"{s.good_share:.0%}",
        )
    Console(file=buf, width=140, force_terminal=False).print(table)
    return buf.getvalue()


async def _first_model(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models") as r:
        data = await r.json()
        return str(data["data"][0]["id"])


def bench_load(
    url: str,
    mix: Mix,
    *,
    arrival: str = "poisson",
    rate: float = 1.0,
    duration_s: float = 30.0,
    seed: int = 7,
    time_scale: float = 1.0,
    out: Path | None = None,
    progress: bool = True,
) -> tuple[list[Result], list[Summary]]:
    """The CLI's run: arrivals, a progress bar, the results (to ``out`` as JSONL) and their summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    url = url.rstrip("/").removesuffix("/v1")
    times = arrival_times(arrival, rate, duration_s, random.Random(seed))
    model = mix.model or asyncio.run(_first_model(url))
    with Progress(
        TextColumn("[bold]bench load"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
        disable=not progress,
        transient=True,
    ) as bar:
        task = bar.add_task("requests", total=len(times), errors=0)
        errors = [0]

        def done(r: Result) -> None:
            errors[0] += 0 if r.ok else 1
            bar.update(task, advance=1, errors=errors[0])

        results = asyncio.run(
            run_load(url, mix, times, model=model, seed=seed + 1, time_scale=time_scale, on_done=done)
        )
    if out is not None:
        write_jsonl(out, results, {"mix": mix.name, "arrival": arrival, "rate": rate})
    return results, summarise(results, arrival_span(arrival, duration_s) / time_scale)
