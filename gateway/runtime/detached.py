"""``DetachedBudget``: how many keyed generations may keep running after their client went away.

A request with an ``Idempotency-Key`` is not cancelled when its client disconnects: it runs to its end so that
the client's retry with the same key replays the whole answer instead of generating a second one. Unbounded, that
lets one client leave any number of generations running on the pools (each up to the pool's ``total_s``) by
connecting and hanging up. The budget caps them per client scope (a digest of the bearer token) and in total;
a disconnect past either cap cancels the request like an unkeyed one (``gateway.proxy.forward``).
"""

from __future__ import annotations


class DetachedBudget:
    """Counts detached generations per scope and in total; ``acquire`` says whether one more may run on."""

    def __init__(self, total: int, per_scope: int) -> None:
        if total < 0 or per_scope < 0:
            raise ValueError("total and per_scope must be >= 0")
        self.total = total
        self.per_scope = per_scope
        self._running = 0
        self._by_scope: dict[bytes, int] = {}

    @property
    def running(self) -> int:
        return self._running

    def running_for(self, scope: bytes) -> int:
        return self._by_scope.get(scope, 0)

    def acquire(self, scope: bytes) -> bool:
        """One more detached generation for ``scope``, if both caps allow it (then ``release`` it once)."""
        held = self._by_scope.get(scope, 0)
        if self._running >= self.total or held >= self.per_scope:
            return False
        self._running += 1
        self._by_scope[scope] = held + 1
        return True

    def release(self, scope: bytes) -> None:
        held = self._by_scope.get(scope, 0)
        if held <= 0:
            raise RuntimeError("release without acquire")
        self._running -= 1
        if held == 1:
            del self._by_scope[scope]
        else:
            self._by_scope[scope] = held - 1
