"""The gateway's background loops: one step every interval, forever, where a bug in one step is logged and the
loop goes on (a scrape, a health check or a file poll that raised once must not stop for good); and their end.
And calls to make a while later, many of them by one timer (``DelayedCalls``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any


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


class DelayedCalls:
    """Calls to make ``delay_s`` after each was added, unless it is discarded first, all made by one timer of
    ``loop``: due the first ``delay_s`` after it is needed, then every ``tick_s`` (default: half the delay) while any
    call waits, so each call is made between ``delay_s`` and ``delay_s + tick_s`` after it was added. With uvloop a
    timer of its own per call (a timer handle and its libuv timer, made and closed again) costs more than a
    request's whole watch for its client, or than its upstream deadline, which nearly every request discards before
    it is due."""

    __slots__ = ("_handle", "_waiting", "delay_s", "loop", "tick_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float, tick_s: float | None = None) -> None:
        self.loop = loop
        self.delay_s = delay_s
        self.tick_s = delay_s / 2 if tick_s is None else tick_s
        # key -> (when added, the call, its argument), in the order they came: oldest first
        self._waiting: dict[Hashable, tuple[float, Callable[[Any], object], Any]] = {}
        self._handle: asyncio.TimerHandle | None = None

    def add(self, key: Hashable, call: Callable[[Any], object], arg: Any) -> None:
        """``call(arg)`` ``delay_s`` from now, unless ``discard(key)`` comes first (a key added again waits anew)."""
        waiting = self._waiting
        waiting.pop(key, None)  # to the end: the order stays the order of the times
        waiting[key] = (self.loop.time(), call, arg)
        if self._handle is None:
            self._handle = self.loop.call_later(self.delay_s, self._tick)

    def discard(self, key: Hashable) -> None:
        self._waiting.pop(key, None)

    def _tick(self) -> None:
        self._handle = None
        waiting = self._waiting
        due = self.loop.time() - self.delay_s + min(0.001, self.tick_s / 10)  # a timer may fire a little early
        try:
            while waiting:
                key = next(iter(waiting))
                since, call, arg = waiting[key]
                if since > due:
                    break
                del waiting[key]
                call(arg)
        finally:  # a call that raised (a bug: the loop logs it) leaves the others to the next tick
            if waiting and not self.loop.is_closed():
                self._handle = self.loop.call_later(self.tick_s, self._tick)

    def close(self) -> None:
        """Make none of the waiting calls."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._waiting.clear()
