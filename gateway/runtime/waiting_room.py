"""A full pool's waiting room (tenants configured only): a request that admission control would shed waits here a
bounded time for a slot instead, and each slot that frees goes to the best waiter:

1. the better (lower) priority first;
2. within a priority, the tenant with the fewest requests in the pool per unit of share weight (weighted fair
   queuing: the tenant furthest under its share is served first, the one furthest above it last);
3. then the earliest arrival.

Bounded in size and in time: at most ``capacity`` waiters per pool, and each gives up after its deadline (the
caller's; then it is shed, 503 ``overloaded``, as it would have been at once without the room). A request arriving
at a full room takes the place of the worst-ranked waiter if it ranks better (that one is shed at once: the lowest
priority, and within it the tenant furthest above its share, goes first), else it is shed itself.

A slot handed to a waiter counts as taken (``granted``) until the waiter has entered the pool or given up, so a
request arriving meanwhile does not take it twice.

No I/O: futures on the running event loop, plain numbers in (``load``: the pool's requests in flight against its
admission bound, read when slots are counted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.routing.fairshare import PoolTenants, TenantWeight, hold_back

# (priority, requests in the pool per unit of weight, arrival): the smallest is served first, the largest shed first.
Rank = tuple[int, float, int]
HeldBack = Callable[["Waiter", Mapping[str, int]], bool]  # must this waiter leave the free slot to others?
Load = Callable[[], tuple[int, int | None]]


@dataclass(slots=True, eq=False)
class Waiter:
    """One request waiting for a slot of the pool; ``future`` resolves True (a slot is its) or False (shed)."""

    tenant: str
    priority: int
    weight: float
    seq: int
    future: asyncio.Future[bool]

    def rank(self, counts: Mapping[str, int]) -> Rank:
        return self.priority, counts.get(self.tenant, 0) / self.weight, self.seq


class WaitingRoom:
    """The waiters of one pool in this process (see the module docstring)."""

    __slots__ = ("_seq", "granted", "load", "waiters")

    def __init__(self) -> None:
        self.waiters: list[Waiter] = []
        self.granted = 0  # slots handed to waiters that have not entered the pool yet
        self._seq = 0
        # The pool's requests in flight against its admission bound (the latest joiner's view of the pool).
        self.load: Load = lambda: (0, None)

    def __len__(self) -> int:
        return len(self.waiters)

    def join(
        self, tenant: str, priority: int, weight: float, counts: Mapping[str, int], capacity: int
    ) -> Waiter | None:
        """A new waiter, or None when the room is full of waiters that rank better (then it is shed). At a full room
        the worst-ranked waiter is shed (its future resolves False) to make room for a better one."""
        if capacity <= 0:
            return None
        self._seq += 1
        waiter = Waiter(tenant, priority, max(weight, 1e-9), self._seq, asyncio.get_running_loop().create_future())
        if len(self.waiters) >= capacity:
            worst = max(self.waiters, key=lambda w: w.rank(counts))
            if waiter.rank(counts) >= worst.rank(counts):
                return None
            self.waiters.remove(worst)
            worst.future.set_result(False)
        self.waiters.append(waiter)
        return waiter

    def best(self, counts: Mapping[str, int]) -> Waiter | None:
        return min(self.waiters, key=lambda w: w.rank(counts)) if self.waiters else None

    def grant(
        self, free: int, counts: Mapping[str, int], held_back: Callable[[Waiter, Mapping[str, int]], bool]
    ) -> int:
        """Hand up to ``free`` slots to the best waiters, one at a time (each granted request counts in its tenant's
        requests for the next choice); stops at a waiter that must leave the slot to others (``held_back``).
        Returns how many were granted."""
        given = 0
        provisional = dict(counts)
        while given < free and self.waiters:
            best = min(self.waiters, key=lambda w: w.rank(provisional))
            if held_back(best, provisional):
                break
            self.waiters.remove(best)
            best.future.set_result(True)
            self.granted += 1
            provisional[best.tenant] = provisional.get(best.tenant, 0) + 1
            given += 1
        return given

    def done(self, waiter: Waiter) -> bool:
        """The waiter stops waiting (entering the pool, timed out, cancelled): out of the room, its granted slot (if
        any) no longer held for it. True when a slot had been granted to it."""
        if waiter in self.waiters:
            self.waiters.remove(waiter)
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.result():
            self.granted -= 1
            return True
        if not waiter.future.done():
            waiter.future.cancel()
        return False

    def refill(
        self, counts: Mapping[str, int], weights: Mapping[str, TenantWeight], best: int, load: Load | None = None
    ) -> None:
        """Slots may have freed: hand the free ones (below the bound, less those granted already) to the best
        waiters; a waiter above its share still leaves the last free slots to the other tenants, and a worse
        priority the fast lane (``gateway.routing.fairshare.hold_back``). ``counts``: the pool's requests per
        tenant; ``best``: the best priority configured."""
        if not self.waiters:
            return
        in_flight, bound = (load or self.load)()
        if bound is None:
            self.grant(len(self.waiters), counts, lambda w, c: False)
            return
        taken = in_flight + self.granted
        if taken >= bound:
            return
        base = sum(counts.values())

        def held_back(w: Waiter, now: Mapping[str, int]) -> bool:
            in_flight = taken + sum(now.values()) - base
            return hold_back(w.tenant, PoolTenants(now, weights, bound, in_flight), priority=w.priority, best=best)

        self.grant(bound - taken, counts, held_back)

    async def wait(self, waiter: Waiter, wait_s: float, recheck_s: float, look_again: Callable[[], bool]) -> bool:
        """Wait up to ``wait_s`` for ``waiter``'s slot: True when one is its (handed to it, or ``look_again``, asked
        every ``recheck_s``, says it may go in); False when shed (by a better arrival, or at the deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (left := deadline - loop.time()) > 0:
            await asyncio.wait((waiter.future,), timeout=min(left, recheck_s))
            if not waiter.future.done() and look_again():
                return True
            if waiter.future.done():
                return waiter.future.result()
        return False
