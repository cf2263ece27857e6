"""The gateway's background loops: one step every interval, forever, where a bug in one step is logged and the
loop goes on (a scrape, a health check or a file poll that raised once must not stop for good); and their end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` when the current task was asked to stop. A loop calls it each round: a library that
    turns a cancellation into another exception (a timeout, a connection error the loop retries) must not make the
    loop run on forever, and the task's shutdown with it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def run_every(
    step: Callable[[], Awaitable[object]],
    interval_s: Callable[[], float],
    *,
    what: str,
    log: logging.Logger,
    sleep_first: bool = False,
    wake: asyncio.Event | None = None,
) -> None:
    """``await step()`` every ``interval_s()`` seconds (read each round, so a reloaded config applies), measured from
    the start of one step to the next. An exception other than cancellation is logged as ``"<what> failed"``.
    ``wake``: setting it starts the next step at once (e.g. a replica that just became the cluster's leader)."""
    if sleep_first:
        await asyncio.sleep(interval_s())
    while True:
        raise_if_cancelled()
        started = time.monotonic()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop the loop for good
            log.exception("%s failed", what)
        delay = max(0.0, interval_s() - (time.monotonic() - started))
        if wake is None:
            await asyncio.sleep(delay)
            continue
        wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), delay)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel background tasks and wait until each has ended (their cancellation is not an error here)."""
    pending = list(tasks)
    for t in pending:
        t.cancel()
    for t in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await t
