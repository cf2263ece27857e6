"""A full pool's waiting room: the rank (priority, then weighted fair share, then arrival), the bound on waiters,
and a ticket's wait through ``Ticket.admission`` on a pool whose load the test sets."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from gateway.config.tenants import load_tenants_text
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.runtime.tenants import Tenancy, Ticket
from gateway.runtime.waiting_room import Waiter, WaitingRoom
from gateway.store.ratelimit import MemoryRateLimiter

TENANTS = """
tenants:
  - {name: low, keys: [sk-low-000001]}
  - {name: other, keys: [sk-other-00001], weight: 2}
  - {name: high, keys: [sk-high-00001], priority: -1}
waiting: {wait_s: WAIT, max_waiting_per_pool: 3}
"""


def never(w: Waiter, counts: Mapping[str, int]) -> bool:
    return False


def test_a_slot_goes_to_the_better_priority_then_the_tenant_furthest_under_its_share() -> None:
    async def run() -> list[str]:
        room = WaitingRoom()
        counts = {"low": 4, "other": 4}  # per unit of weight: low 4, other 2
        joined = [room.join(t, p, w, counts, 10) for t, p, w in [("low", 0, 1), ("other", 0, 2), ("high", -1, 1)]]
        order = []
        for _ in range(3):
            assert room.grant(1, counts, never) == 1
            order += [w.tenant for w in joined if w is not None and w.future.done() and w.tenant not in order]
        assert room.granted == 3
        return order

    assert asyncio.run(run()) == ["high", "other", "low"]


def test_a_full_room_sheds_its_worst_waiter_for_a_better_one_and_refuses_a_worse() -> None:
    async def run() -> None:
        room = WaitingRoom()
        counts = {"low": 3}
        first = room.join("low", 0, 1.0, counts, 2)
        second = room.join("low", 0, 1.0, counts, 2)
        assert first is not None
        assert second is not None
        assert room.join("low", 0, 1.0, counts, 2) is None  # the same rank, later: refused
        high = room.join("high", -1, 1.0, counts, 2)
        assert high is not None
        assert second.future.result() is False  # the latest of the worst rank is shed for it
        assert not first.future.done()
        assert len(room) == 2
        assert room.join("x", 0, 1.0, counts, 0) is None  # no room at all

    asyncio.run(run())


def test_granting_stops_at_a_waiter_that_must_leave_the_slot_to_others() -> None:
    async def run() -> None:
        room = WaitingRoom()
        w = room.join("low", 0, 1.0, {}, 5)
        assert room.grant(3, {}, lambda waiter, counts: True) == 0
        assert w is not None
        assert not w.future.done()
        assert room.done(w) is False
        assert len(room) == 0

    asyncio.run(run())


def tenancy(wait_s: float = 5.0) -> Tenancy:
    spec = load_tenants_text(TENANTS.replace("WAIT", str(wait_s)), "t")
    return Tenancy(spec, frozenset(), TenantMetrics(CollectorRegistry()), MemoryRateLimiter())


async def ticket(t: Tenancy, name: str) -> Ticket:
    tenant = t.tenants[name]
    assert tenant.spec is not None
    return await t.admit(tenant, tenant.spec.priority, 0)


def test_a_high_priority_request_is_admitted_before_earlier_waiters() -> None:
    async def run() -> list[str]:
        t = tenancy()
        pool = {"n": 0}
        load = lambda: (pool["n"], 3)  # noqa: E731
        order: list[str] = []
        holders = []
        for _ in range(6):  # low fills the pool to twice its bound: nobody gets in past it any more
            tk = await ticket(t, "low")
            tk.enter("std")
            holders.append(tk)
        pool["n"] = 6

        async def request(name: str) -> None:
            tk = await ticket(t, name)
            if await tk.admission("std", load, True):
                order.append(name)
                pool["n"] += 1
                tk.enter("std")
                holders.append(tk)

        waiting = [asyncio.create_task(request("low"))]
        await asyncio.sleep(0.01)
        waiting.append(asyncio.create_task(request("other")))
        await asyncio.sleep(0.01)
        waiting.append(asyncio.create_task(request("high")))
        await asyncio.sleep(0.01)
        assert order == []
        assert len(t.rooms["std"]) == 3
        while holders:  # the pool drains, newest first: each slot freed goes to the best waiter
            pool["n"] -= 1
            holders.pop().finish("ok", True)
            await asyncio.sleep(0.01)
        await asyncio.gather(*waiting)
        assert t.rooms["std"].granted == 0
        return order

    # high first (priority), then other (low still had requests in the pool, other none), then low. The pool's
    # last slot is high's fast lane: other waits for a second one to free.
    assert asyncio.run(run()) == ["high", "other", "low"]


def test_a_waiter_is_shed_at_its_deadline_and_a_cancelled_one_passes_its_slot_on() -> None:
    async def run() -> None:
        t = tenancy(wait_s=0.3)
        pool = {"n": 4}
        load = lambda: (pool["n"], 2)  # noqa: E731
        tk = await ticket(t, "low")
        started = asyncio.get_running_loop().time()
        assert await tk.admission("std", load, True) is False
        assert asyncio.get_running_loop().time() - started >= 0.25
        assert await tk.admission("std", load, False) is False  # another pool to go to: no wait
        assert len(t.rooms["std"]) == 0

        first = asyncio.create_task((await ticket(t, "low")).admission("std", load, True))
        await asyncio.sleep(0.01)
        second = asyncio.create_task((await ticket(t, "low")).admission("std", load, True))
        await asyncio.sleep(0.01)
        pool["n"] = 0  # the pool empties: one slot for the first waiter (the last is high's fast lane)
        t.pump("std")
        assert t.rooms["std"].granted == 1
        first.cancel()  # its client left before it entered: the slot goes to the next
        await asyncio.sleep(0.01)
        assert await second is True
        assert t.rooms["std"].granted == 0

    asyncio.run(run())
