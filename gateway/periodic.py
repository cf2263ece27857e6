"""The gateway's background loops: one step every interval, forever, where a bug in one step is logged and the
loop goes on (a scrape, a health check or a file poll that raised once must not stop for good)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable


async def run_every(
    step: Callable[[], Awaitable[object]],
    interval_s: Callable[[], float],
    *,
    what: str,
    log: logging.Logger,
    sleep_first: bool = False,
) -> None:
    """``await step()`` every ``interval_s()`` seconds (read each round, so a reloaded config applies), measured from
    the start of one step to the next. An exception other than cancellation is logged as ``"<what> failed"``."""
    if sleep_first:
        await asyncio.sleep(interval_s())
    while True:
        started = time.monotonic()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop the loop for good
            log.exception("%s failed", what)
        await asyncio.sleep(max(0.0, interval_s() - (time.monotonic() - started)))
