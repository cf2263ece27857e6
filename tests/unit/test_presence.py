"""``ClientPresence``: what a client leaving does to its request (cancel it; a keyed one runs on within the detached
budget, or is cut past it), and that nothing changes once the last message went out."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from starlette.types import Message

from gateway.observability.metrics import GatewayMetrics
from gateway.periodic import DelayedCalls
from gateway.proxy.idempotency import KeyClaim
from gateway.proxy.job import ProxyJob
from gateway.proxy.presence import WATCH_AFTER_S, ClientPresence
from gateway.proxy.record import RequestRecord
from gateway.routing.plan import Plan
from gateway.runtime.detached import DetachedBudget

KEYED = cast(KeyClaim, object())  # presence only asks whether the request has a key


def _job(claim: KeyClaim | None = None, budget: DetachedBudget | None = None) -> ProxyJob:
    return ProxyJob(
        path="/v1/chat/completions",
        body=b"{}",
        client_headers=[],
        stream=False,
        plan=Plan(("a",), "preferred"),
        max_attempts=1,
        record=RequestRecord("req-1", "/v1/chat/completions"),
        extra_headers=[],
        idempotency=claim,
        detached=budget,
        tenant=b"client",
    )


async def _run(
    job: ProxyJob, metrics: GatewayMetrics, *, last_send: bool = False, starts: DelayedCalls | None = None
) -> tuple[bool, ClientPresence]:
    """A request's work that waits, with a client that leaves at once; whether its task was cancelled. ``starts``:
    the serving loop's watch starts (the gateway's), else the presence's own timer."""
    left = asyncio.Event()

    async def receive() -> Message:
        left.set()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    async def work() -> ClientPresence:
        presence = ClientPresence(job, metrics, lambda: 30.0, {}, receive, send, starts)
        presence.last_send = last_send
        try:
            await left.wait()
            await asyncio.sleep(WATCH_AFTER_S)  # the watcher acts on the disconnect
        finally:
            held.append(presence)
        return presence

    held: list[ClientPresence] = []
    task = asyncio.get_running_loop().create_task(work())
    await asyncio.wait([task], timeout=30)
    assert task.done()
    return task.cancelled(), held[0]


def _refused(metrics: GatewayMetrics) -> float:
    registry: Any = metrics.registry
    return float(registry.get_sample_value("specgate_limit_refusals_total", {"limit": "detached"}) or 0.0)


async def test_a_client_that_leaves_cancels_its_request() -> None:
    job, metrics = _job(), GatewayMetrics()
    cancelled, presence = await _run(job, metrics)
    assert cancelled
    assert presence.gone
    assert presence.ended_it()
    assert job.record.outcome == "client_disconnect"
    presence.done()


async def test_the_loops_watch_starts_watch_the_client_as_its_own_timer_would() -> None:
    starts = DelayedCalls(asyncio.get_running_loop(), WATCH_AFTER_S)
    cancelled, presence = await _run(_job(), GatewayMetrics(), starts=starts)
    assert cancelled
    assert presence.gone
    presence.done()
    assert not starts._waiting
    starts.close()


async def test_a_request_done_before_its_watch_is_never_watched() -> None:
    starts = DelayedCalls(asyncio.get_running_loop(), WATCH_AFTER_S)

    async def receive() -> Message:
        raise AssertionError("not watched")

    async def send(message: Message) -> None:
        pass

    presence = ClientPresence(_job(), GatewayMetrics(), lambda: 30.0, {}, receive, send, starts)
    presence.done()
    await asyncio.sleep(WATCH_AFTER_S * 2)
    assert presence._watcher is None
    starts.close()


async def test_a_keyed_request_runs_on_within_the_detached_budget_and_gives_it_back() -> None:
    budget = DetachedBudget(total=1, per_scope=1)
    job, metrics = _job(KEYED, budget), GatewayMetrics()
    cancelled, presence = await _run(job, metrics)
    assert not cancelled
    assert presence.gone
    assert not presence.ended_it()
    assert budget.running == 1
    presence.done()
    assert budget.running == 0
    assert _refused(metrics) == 0


async def test_a_keyed_request_past_the_detached_budget_is_cut() -> None:
    budget = DetachedBudget(total=1, per_scope=1)
    assert budget.acquire(b"other")  # the budget is spent by another client's request
    job, metrics = _job(KEYED, budget), GatewayMetrics()
    cancelled, presence = await _run(job, metrics)
    assert cancelled
    assert presence.ended_it()
    assert budget.running == 1
    assert _refused(metrics) == 1
    presence.done()


async def test_a_disconnect_after_the_last_send_changes_nothing() -> None:
    job, metrics = _job(), GatewayMetrics()
    cancelled, presence = await _run(job, metrics, last_send=True)
    assert not cancelled
    assert not presence.gone
    assert job.record.outcome == "ok"
    presence.done()
