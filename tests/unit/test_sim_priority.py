"""The simulated engine's scheduling policies (vLLM's ``--scheduling-policy``): under ``priority`` the waiting queue
is ordered by (priority, arrival, request id), lower first, and a full KV cache preempts the running request of
lowest priority; under ``fcfs`` (the default) the body's priority changes nothing. On the virtual clock: exact."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.sim.engine import Engine, Generation, GenRequest
from gateway.sim.framing import WireError
from gateway.sim.metrics import VllmMetrics
from gateway.sim.parsing import OutputLengths, parse_request, priority_header
from gateway.sim.presets import get_preset
from gateway.sim.request_queue import PRIORITY_MAX, PRIORITY_MIN, PriorityQueue, rank


def make(policy: str, **kw: Any) -> Engine:
    preset = get_preset("llama70b-4xh100")
    metrics = VllmMetrics("sim", max_model_len=preset.max_model_len)
    return Engine(preset, None, metrics, virtual_clock=True, scheduling_policy=policy, **kw)  # type: ignore[arg-type]


def gauge(engine: Engine, name: str) -> float:
    prefix = f"{name}{{"
    lines = [line for line in engine.metrics.render().decode().splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, lines
    return float(lines[0].rsplit(" ", 1)[1])


# (request id, priority), arriving 1 ms apart in this order; ids run against arrival so arrival must win ties
ARRIVALS = (("z1", 5), ("y2", 1), ("x3", 5), ("w4", -3), ("v5", 1))


async def admission_order(policy: str) -> list[str]:
    """One slot (max_num_seqs=1) held by a blocker while ARRIVALS queue up; the order they get their first token."""
    engine = make(policy, max_num_seqs=1)
    await engine.start()
    gens: list[Generation] = []
    try:
        gens.append(engine.submit(GenRequest("blocker", 100, 20, 0.0, priority=100)))
        for i, (rid, priority) in enumerate(ARRIVALS, 1):
            await engine.sleep_until(i * 0.001)
            gens.append(engine.submit(GenRequest(rid, 100, 5, 0.0, priority=priority)))
        assert gens[0].first_token is None or gens[0].tokens < 20  # still running: the others all wait
        assert engine.waiting == len(ARRIVALS)
        assert gauge(engine, "vllm:num_requests_waiting") == len(ARRIVALS)
        await asyncio.wait_for(asyncio.gather(*(g.wait() for g in gens)), timeout=30)
    finally:
        await engine.stop()
    assert all(g.finished_reason == "length" for g in gens)
    assert engine.waiting == 0
    assert gauge(engine, "vllm:num_requests_waiting") == 0
    return [g.request_id for g in sorted(gens, key=lambda g: g.first_token or 0.0)]


async def test_priority_orders_the_queue_by_priority_then_arrival() -> None:
    assert await admission_order("priority") == ["blocker", "w4", "y2", "v5", "z1", "x3"]


async def test_fcfs_ignores_priority() -> None:
    assert await admission_order("fcfs") == ["blocker", "z1", "y2", "x3", "w4", "v5"]


def test_priority_queue_ties_and_preempted_requests_keep_their_place() -> None:
    engine = make("priority")
    gens = [engine.submit(GenRequest(rid, 10, 5, 0.0, priority=p)) for rid, p in (("b", 0), ("a", 0), ("c", -1))]
    queue = PriorityQueue(gens)
    assert [g.request_id for g in queue] == ["c", "a", "b"]  # same priority and arrival: by request id
    assert queue[0].request_id == "c"
    assert len(queue) == 3
    first = queue.popleft()
    queue.appendleft(first)  # back from a preemption: ordered by its keys, not put in front of the rest
    late = Generation(engine, GenRequest("late", 10, 5, 0.0, priority=-1), arrival=5.0, k=0)
    queue.appendleft(late)
    assert [queue.popleft().request_id for _ in range(4)] == ["c", "late", "a", "b"]
    with pytest.raises(IndexError):
        queue[0]
    assert rank(late) == (-1, 5.0)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make("lifo")


async def preemption_run(policy: str, priorities: tuple[int, ...]) -> list[Generation]:
    """Four requests of 100 + 100 tokens in a 640-token KV cache: they cannot all keep running. The first arrives
    alone (first in the running batch), the other three together 1 ms later."""
    engine = make(policy, kv_cache_tokens=16 * 40)
    gens = [engine.submit(GenRequest("r0", 100, 100, 0.0, priority=priorities[0]))]
    await engine.start()
    try:
        await engine.sleep_until(0.001)
        gens += [engine.submit(GenRequest(f"r{i}", 100, 100, 0.0, priority=priorities[i])) for i in (1, 2, 3)]
        await asyncio.wait_for(asyncio.gather(*(g.wait() for g in gens)), timeout=30)
    finally:
        await engine.stop()
    assert all(g.tokens == 100 and g.finished_reason == "length" for g in gens)
    assert engine.kv_usage == 0
    assert engine.running == engine.waiting == 0
    assert sum(g.num_preemptions for g in gens) == engine.stats()["preemptions"] > 0
    return gens


async def test_priority_preempts_the_lowest_priority_running_request() -> None:
    gens = await preemption_run("priority", (9, 0, 0, 0))  # the oldest, first in the batch, ranks lowest
    assert [g.num_preemptions > 0 for g in gens] == [True, False, False, False]
    assert gens[0].finished is not None
    assert all(g.finished is not None and g.finished < gens[0].finished for g in gens[1:])


async def test_priority_preempts_the_latest_arrival_among_equals() -> None:
    gens = await preemption_run("priority", (0, 0, 0, 0))
    assert gens[3].num_preemptions > 0
    assert gens[0].num_preemptions == 0


async def test_fcfs_preempts_the_newest_whatever_its_priority() -> None:
    gens = await preemption_run("fcfs", (9, 0, 0, 0))
    assert gens[3].num_preemptions > 0
    assert gens[0].num_preemptions == 0


async def test_aborting_a_queued_request_under_priority() -> None:
    engine = make("priority", max_num_seqs=1)
    await engine.start()
    try:
        running = engine.submit(GenRequest("run", 100, 50, 0.0))
        queued = [engine.submit(GenRequest(f"q{i}", 100, 5, 0.0, priority=-i)) for i in range(3)]
        await engine.sleep_until(0.001)
        queued[2].abort()
        await asyncio.wait_for(asyncio.gather(running.wait(), *(g.wait() for g in queued)), timeout=30)
    finally:
        await engine.stop()
    assert queued[2].finished_reason == "abort"
    assert queued[2].tokens == 0
    assert [g.finished_reason for g in queued[:2]] == ["length", "length"]
    assert queued[1].first_token is not None
    assert queued[0].first_token is not None
    assert queued[1].first_token < queued[0].first_token
    assert engine.stats()["aborted"] == 1


def parse(body: dict[str, Any]) -> int:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_request("chat", {**base, **body}, served=["m"], max_model_len=4096, lengths=OutputLengths())
    return req.priority


def test_body_priority_is_validated_like_vllm() -> None:
    assert parse({}) == 0
    assert parse({"priority": None}) == 0
    assert parse({"priority": -7}) == -7
    assert parse({"priority": PRIORITY_MAX}) == PRIORITY_MAX
    for bad in ("high", 1.5, True, PRIORITY_MIN - 1, PRIORITY_MAX + 1, [1]):
        with pytest.raises(WireError) as err:
            parse({"priority": bad})
        assert err.value.status == 400
        assert err.value.body["error"]["param"] == "priority"


def test_priority_header() -> None:
    assert priority_header(None) is None
    assert priority_header("-3") == -3
    assert priority_header(" 12 ") == 12
    assert priority_header("urgent") is None
    assert priority_header("1.5") is None
    assert priority_header(str(PRIORITY_MAX + 1)) is None
    assert priority_header("9" * 100) is None
