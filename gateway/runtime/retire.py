"""The clients (connection pools) of a replaced config, closed once nothing uses them.

After a reload, the clients of pools whose spec changed or that the new config removed are handed to
``ClientRetirer``. It closes them only once the old pools have no request in flight (or after the pool's
``total_s``, which bounds every request made through that session anyway), never cutting an open stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping

from gateway.fleet.pools import PoolState
from gateway.fleet.upstream import PoolClient
from gateway.periodic import cancel_and_wait

logger = logging.getLogger("specgate")


class ClientRetirer:
    """Closes the clients of a replaced config once nothing uses them (``close_all`` at shutdown)."""

    def __init__(self, *, min_grace_s: float = 2.0, check_s: float = 0.5, margin_s: float = 5.0) -> None:
        self.min_grace_s = min_grace_s  # covers a request that read the old config but has not counted itself yet
        self.check_s = check_s
        self.margin_s = margin_s
        self._pending: set[PoolClient] = set()
        self._closed: set[PoolClient] = set()  # retired and closed once; closed again at shutdown
        self._tasks: set[asyncio.Task[None]] = set()

    def retire(self, clients: Collection[PoolClient], pools: Mapping[str, PoolState]) -> None:
        """``clients``: those the new config no longer uses; ``pools``: the old config's pools (in-flight counts)."""
        if not clients:
            return
        self._pending.update(clients)
        task = asyncio.create_task(self._close_when_idle(list(clients), pools), name="specgate-retire-clients")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _close_when_idle(self, clients: list[PoolClient], pools: Mapping[str, PoolState]) -> None:
        # The session's total timeout bounds every request made through it: past it, closing cuts nothing.
        limit = max(c.spec.timeouts.total_s for c in clients) + self.margin_s
        names = {c.spec.name for c in clients}
        started = time.monotonic()
        await asyncio.sleep(self.min_grace_s)
        # Conservative: endpoints carried over to the new config share their in-flight counters with it.
        while time.monotonic() - started < limit:
            if not any(pools[n].in_flight for n in names if n in pools):
                break
            await asyncio.sleep(self.check_s)
        for c in clients:
            await self._close(c)

    async def _close(self, client: PoolClient) -> None:
        # Kept in _closed: a request of a kept pool falling back onto a retired one may reopen its session, and
        # close_all closes it again at shutdown (closing twice is harmless).
        self._pending.discard(client)
        self._closed.add(client)
        try:
            await client.close()
        except Exception:
            logger.exception("closing the client of the replaced pool %s failed", client.spec.name)

    async def close_all(self) -> None:
        """Shutdown: stop waiting and close every retired client (a straggler may have reopened its session)."""
        await cancel_and_wait(self._tasks)
        for c in list(self._pending | self._closed):
            await self._close(c)
