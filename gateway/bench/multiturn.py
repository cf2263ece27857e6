"""``specgate bench policies`` on a multi-turn mix: conversations against each policy's fleet, one load at a time.

Conversations arrive open loop (Poisson at the load point's rate of conversations); inside one the turns follow
each other: the answer is read, the think time passes (simulated seconds x the time scale), the next turn carries
the history and the answer back. A load point runs ``warmup_s + duration_s`` wall seconds of arrivals: turns sent
in the first ``warmup_s`` fill the caches and the in-flight conversations and are not measured; no turn is sent
after the end; the measured turns are those sent inside the window. The prefix hit rate is the simulated servers'
``vllm:prefix_cache_hits_total`` / ``queries_total`` over the window (deltas summed over the servers).

Offered load is a fraction of the capacity of a fleet that prefills only what a warm server would not have cached
(each turn's new text; the system prompts, documents and history cached): a policy that loses the cache prefills
more and meets its capacity earlier.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.bench.conversations import Conversation, ConversationSpec, plan_conversations, turn_request
from gateway.bench.cpu import CpuMeter
from gateway.bench.fleet import clock_lag, policy_rules, running_fleet, sim_clocks
from gateway.bench.jobs import interrupt_on_term, run_side_by_side
from gateway.bench.load import Result, arrival_times, meets_targets, tpot_from_chunks
from gateway.bench.mix import Mix, TrafficClass
from gateway.bench.multiturn_report import MultiTurnPoint, TurnResult, write_multiturn_report
from gateway.bench.points import LABELS, Setup
from gateway.bench.policies import busiest, check_policies
from gateway.bench.prefix_precision import Snapshot, TurnMirror, capacities, precision, snapshot
from gateway.config.packaged import DEFAULT_RULES
from gateway.sim.launch import PRESET
from gateway.sim.physics import step_time

MULTITURN_POLICIES = ("adaptive", "peer-cache-aware", "peer-round-robin")
MAX_ANSWER_CHARS = 64_000  # an answer carried back into the history at most
CONVERSATIONS_PER_LOAD = 1_000_000  # load point i plans conversations from i x this on


# ---------------------------------------------------------------------------------------------------------------
# Capacity


def conversation_capacity(mix: Mix, spec: ConversationSpec, setup: Setup, n: int = 600) -> tuple[float, str]:
    """Turns per simulated second the fleet's count of standard servers sustains at a full batch, prefilling only
    each turn's new text (a perfectly warm cache)."""
    convs = plan_conversations(spec, mix.classes, setup.seed, n)
    outs, prompts, new = [], [], []
    k = 0
    for conv in convs:
        context = (len(conv.system) + 3) // 4 + 7
        for turn in conv.turns:
            user = (len(turn.user) + 3) // 4 + 4
            out = min(setup.lengths.natural(k), int(dict(turn.params).get("max_tokens", 10**9)))
            k += 1
            outs.append(out)
            prompts.append(context + user)
            new.append(user)
            context += user + out + 5
    turns = len(outs)
    mean_out, mean_prompt, mean_new = sum(outs) / turns, sum(prompts) / turns, sum(new) / turns
    b = setup.max_num_seqs
    target, _ = setup.costs(None)
    step = step_time(target, None, 0, b, 0, round(b * (mean_prompt + mean_out / 2)))
    per_turn = mean_out * step / b + mean_new * target.gamma_prefill_s
    cap = setup.servers / per_turn
    how = (
        f"from the simulator's step model ({PRESET}, per-token costs x{setup.scale}): {setup.servers} standard servers "
        f"at a full batch of {b}, prefilling only each turn's new text; step {step * 1000:.1f} ms, mean output "
        f"{mean_out:.0f} tokens, mean prompt {mean_prompt:.0f} tokens of which {mean_new:.0f} new, "
        f"{turns / n:.1f} turns per conversation -> {cap:.2f} turns/s (simulated clock)"
    )
    return cap, how


# ---------------------------------------------------------------------------------------------------------------
# One turn


def _delta_text(chunk: dict[str, Any]) -> str:
    if chunk.get("type") == "response.output_text.delta":
        return str(chunk.get("delta") or "")
    out = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        out.append(str(delta.get("content") or ""))
    return "".join(out)


def _usage_tokens(usage: dict[str, Any]) -> tuple[int, int | None]:
    """(prompt tokens, cached prompt tokens or None) from a chat or Responses API usage object."""
    prompt = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return prompt, None if cached is None else int(cached)


def _body_text(body: dict[str, Any]) -> str:
    if body.get("object") == "response":
        return "".join(
            str(part.get("text") or "")
            for item in body.get("output") or ()
            for part in item.get("content") or ()
            if isinstance(part, dict)
        )
    choices = body.get("choices") or [{}]
    return str((choices[0].get("message") or {}).get("content") or "")


async def send_turn(
    session: aiohttp.ClientSession,
    url: str,
    request: tuple[str, dict[str, Any], dict[str, str]],
    cls: TrafficClass,
    sent_s: float,
    time_scale: float,
) -> tuple[Result, str, tuple[int, int | None]]:
    """One turn: its measured result, the answer's text (carried back into the next turn) and (prompt tokens, cached
    prompt tokens) from its usage."""
    path, body, headers = request
    stream = bool(body.get("stream"))
    res = Result(sent_s, cls.name, cls.task, stream)
    start = time.monotonic()
    chunk_times: list[float] = []
    text: list[str] = []
    tokens: tuple[int, int | None] = (0, None)
    try:
        async with session.post(f"{url}{path}", json=body, headers=headers) as r:
            res.status = r.status
            res.pool = r.headers.get("x-specgate-pool", "")
            res.route_class = r.headers.get("x-specgate-class", "")
            res.endpoint = r.headers.get("x-specgate-endpoint", "")
            if r.status != 200:
                res.error = (await r.text())[:200]
            elif stream:
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
                    piece = _delta_text(chunk)
                    if piece:
                        chunk_times.append(time.monotonic() - start)
                        text.append(piece)
                    usage = chunk.get("usage") or (chunk.get("response") or {}).get("usage")
                    if usage:
                        res.completion_tokens = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
                        tokens = _usage_tokens(usage)
            else:
                answer = await r.json()
                usage = answer.get("usage") or {}
                res.completion_tokens = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
                tokens = _usage_tokens(usage)
                text.append(_body_text(answer))
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        res.error = type(exc).__name__
    res.e2e_s = (time.monotonic() - start) / time_scale
    if chunk_times:
        scaled = [t / time_scale for t in chunk_times]
        res.ttft_s = scaled[0]
        res.chunks = len(scaled)
        res.tpot_s = tpot_from_chunks(scaled, res.completion_tokens or len(scaled))
    res.good = meets_targets(res, cls.targets.ttft_s, cls.targets.tpot_s)
    return res, "".join(text)[:MAX_ANSWER_CHARS], tokens


# ---------------------------------------------------------------------------------------------------------------
# One load point


async def prefix_counters(session: aiohttp.ClientSession, ports: list[int]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the simulated servers' ``/metrics``; NaN where one did not answer."""
    hits = queries = 0.0
    for port in ports:
        try:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        except (TimeoutError, aiohttp.ClientError):
            return math.nan, math.nan
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def run_conversations(
    url: str,
    convs: list[Conversation],
    starts: list[float],
    *,
    model: str,
    time_scale: float,
    stop_at: float,
    send_task_header: bool = False,
    at_window: Callable[[], Any] | None = None,
    window_at: float = 0.0,
    timeout_s: float = 600.0,
    mirror: TurnMirror | None = None,
) -> list[TurnResult]:
    """Each conversation from its start (wall seconds from now), turn after turn, until ``stop_at``; every turn's
    result. ``at_window`` (a coroutine function) runs once at ``window_at``, while the conversations go on.
    ``mirror``: replays the gateway's prefix index, for each turn's predicted hit tokens."""
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    out: list[TurnResult] = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.monotonic()

        async def one(conv: Conversation, start: float) -> None:
            await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
            answers: list[str] = []
            for t, turn in enumerate(conv.turns):
                if t:
                    await asyncio.sleep(turn.think_s * time_scale)
                sent = time.monotonic() - t0
                if sent >= stop_at:
                    return
                req = turn_request(conv, t, answers, model, send_task_header=send_task_header)
                res, answer, (prompt, cached) = await send_turn(session, url, req, turn.cls, sent, time_scale)
                changed = t > 0 and turn.cls.name != conv.turns[t - 1].cls.name
                predicted = mirror.record(res.endpoint, req[0], req[1]) if mirror is not None else None
                out.append(TurnResult(conv.index, t, conv.kind, res, prompt, cached, changed, predicted))
                if not res.ok:
                    return  # the history is broken: the conversation ends here
                answers.append(answer)

        async def window() -> None:
            if at_window is not None:
                await asyncio.sleep(max(0.0, t0 + window_at - time.monotonic()))
                await at_window()

        await asyncio.gather(window(), *(one(c, s) for c, s in zip(convs, starts, strict=True)))
    return out


def run_multiturn_policy(
    policy: str,
    rules: dict[str, Any],
    mix: Mix,
    spec: ConversationSpec,
    loads: list[float],
    capacity: float,
    setup: Setup,
    *,
    jsonl: Path | None = None,
    log: Callable[[str], None] = print,
) -> list[MultiTurnPoint]:
    """Start the policy's servers and front; one window of conversations per load; stop everything."""
    points: list[MultiTurnPoint] = []
    per_conv = sum(len(c.turns) for c in plan_conversations(spec, mix.classes, setup.seed, 400)) / 400
    # the servers report each answer's cached prompt tokens, as vLLM does with this flag
    with running_fleet(policy, rules, setup, mix.model, ("--enable-prompt-tokens-details",)) as fleet:
        meter = CpuMeter(fleet.pids)
        # one gateway process: its indexes replayed for each turn's prediction (several keep one index each)
        replay = bool(fleet.endpoints) and setup.gateway_workers == 1
        mirror = TurnMirror(asyncio.run(_capacities(fleet.endpoints))) if replay else None
        for i, load in enumerate(loads):
            rate = load * capacity
            conv_rate = rate / per_conv
            span = setup.warmup_s + setup.duration_s
            starts = arrival_times("poisson", conv_rate / setup.time_scale, span, random.Random(setup.seed + i))
            # the same conversations for every policy (paired); each load its own (no cache left warm by the last)
            convs = plan_conversations(spec, mix.classes, setup.seed, len(starts), first=CONVERSATIONS_PER_LOAD * i)
            marks: dict[str, Any] = {}

            async def at_window(marks: dict[str, Any] = marks) -> None:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                    marks["counters"] = await prefix_counters(s, fleet.sim_ports)
                    marks["predicted"] = await snapshot(s, fleet.url, fleet.endpoints) if fleet.endpoints else None
                marks["lag"] = sim_clocks(fleet.sim_ports)
                meter.start()

            began = time.monotonic()
            turns = asyncio.run(
                run_conversations(
                    fleet.url, convs, starts, model=fleet.model, time_scale=setup.time_scale, stop_at=span,
                    send_task_header=mix.send_task_header, at_window=at_window, window_at=setup.warmup_s,
                    mirror=mirror,
                )
            )  # fmt: skip
            cpu = meter.stop()

            async def counters() -> tuple[tuple[float, float], Snapshot | None]:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                    sums = await prefix_counters(s, fleet.sim_ports)
                    return sums, (await snapshot(s, fleet.url, fleet.endpoints) if fleet.endpoints else None)

            (hits, queries), predicted_after = asyncio.run(counters())
            hits0, queries0 = marks.get("counters", (math.nan, math.nan))
            lag = clock_lag(marks.get("lag", [None] * len(fleet.sim_ports)), sim_clocks(fleet.sim_ports))
            measured = tuple(t for t in turns if t.result.sent_s >= setup.warmup_s)
            point = MultiTurnPoint(
                policy, load, rate, conv_rate, setup.duration_s / setup.time_scale, measured,
                hits - hits0, queries - queries0, cpu, lag, time.monotonic() - began,
                precision(marks.get("predicted"), predicted_after),
            )  # fmt: skip
            points.append(point)
            if jsonl is not None:
                with jsonl.open("a") as f:
                    for t in measured:
                        row = {"policy": policy, "load": load, "conversation": t.conversation, "turn": t.turn,
                               "kind": t.kind, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                               "predicted_hit_tokens": t.predicted_tokens,
                               "class_changed": t.class_changed, **asdict(t.result)}  # fmt: skip
                        f.write(json.dumps({k: _finite(v) for k, v in row.items()}) + "\n")
            ok = [r for r in point.results if r.ok]
            e2e = sorted(r.e2e_s for r in ok)
            log(
                f"  {LABELS[policy]:<40} load {load:>4.0%} ({rate:.2f} turns/s): {len(measured)} turns, "
                f"{len(measured) - len(ok)} errors, E2E p50 {_q(e2e, 0.5):.2f} s p99 {_q(e2e, 0.99):.2f} s, "
                f"prefix hits {point.hit_rate:.0%} ({point.wall_s:.0f} s; busiest process {busiest(cpu)})"
            )
    return points


async def _capacities(endpoints: dict[str, int]) -> dict[str, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        return await capacities(s, endpoints)


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] if values else math.nan


def _printed(line: str) -> None:
    print(line, flush=True)


def _multiturn_job(
    policy: str, rules: dict[str, Any], mix: Mix, spec: ConversationSpec, loads: list[float], capacity: float,
    setup: Setup, jsonl: Path,
) -> list[MultiTurnPoint]:  # fmt: skip
    """One policy's points in a process of its own (``jobs`` > 1)."""
    return run_multiturn_policy(policy, rules, mix, spec, loads, capacity, setup, jsonl=jsonl, log=_printed)


def bench_multiturn(
    mix: Mix,
    spec: ConversationSpec,
    loads: list[float],
    setup: Setup,
    out_dir: Path,
    *,
    policies: tuple[str, ...] = MULTITURN_POLICIES,
    root: Path = Path("."),
    log: Callable[[str], None] = print,
    jobs: int = 1,
) -> list[MultiTurnPoint]:
    """The multi-turn sweep: every policy at every load; report.md and results.jsonl. ``jobs`` > 1 runs that many
    policies at once, each in a process of its own with its own servers (the same conversations for each)."""
    check_policies(policies)
    adaptive = yaml.safe_load(((root / mix.rules) if mix.rules else DEFAULT_RULES).read_text())
    if mix.output_len_median is not None:
        setup = replace(setup, output_median=mix.output_len_median)
    capacity, how = conversation_capacity(mix, spec, setup)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "results.jsonl"
    jsonl.write_text("")
    per_point = setup.warmup_s + setup.duration_s + 10.0
    log(
        f"capacity {capacity:.2f} turns/s (simulated) = {capacity / setup.time_scale:.2f} turns/s wall; planned: "
        f"{len(policies)} policies x {len(loads)} loads x {per_point:.0f} s "
        f"≈ {len(policies) * len(loads) * per_point / 60:.1f} min"
    )
    before = os.getloadavg()[0]
    points: list[MultiTurnPoint] = []
    rules = {policy: policy_rules(policy, adaptive, root) for policy in policies}
    with interrupt_on_term():  # SIGTERM stops the servers and the front as Ctrl-C does
        if jobs > 1 and len(policies) > 1:
            parts = {p: jsonl.with_name(f"{jsonl.stem}-{p}.jsonl") for p in policies}
            for part in parts.values():
                part.unlink(missing_ok=True)
            calls = [(p, rules[p], mix, spec, loads, capacity, setup, parts[p]) for p in policies]
            points = [pt for got in run_side_by_side(_multiturn_job, calls, jobs) for pt in got]
            with jsonl.open("a") as out:
                for part in parts.values():
                    if part.exists():
                        out.write(part.read_text())
                        part.unlink()
        else:
            for policy in policies:
                points += run_multiturn_policy(
                    policy, rules[policy], mix, spec, loads, capacity, setup, jsonl=jsonl, log=log
                )
    machine = (
        f"{os.cpu_count()} cores, load average {before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end "
        "(the harness-CPU section shows what the bench's own processes used; the load average also counts what "
        "else ran)" + (f"; {min(jobs, len(policies))} policies ran at once" if jobs > 1 and len(policies) > 1 else "")
    )
    write_multiturn_report(points, mix, setup, how, out_dir, policies, machine)
    return points
