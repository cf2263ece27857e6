"""The processes that parse large request bodies, away from the event loop (``gateway.proxy.body_view``).

``ParsePool`` holds a ``ProcessPoolExecutor`` of ``workers`` processes (forkserver, else spawn: never a fork of
the running gateway), started in the background when the app starts and shut down when it stops. A large body goes
over as bytes (the executor's own threads pickle it and write the pipe; the event loop only hands the job over),
and what the function made of it comes back the same way. At most ``QUEUE_PER_WORKER`` bodies per process are in
the pool at once; one more is answered 503 ``overloaded`` (with Retry-After) at once, not queued. A process that
dies is replaced, and the body that was in it answered 503.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from typing import Any, TypeVar

from gateway.errors import Overloaded

T = TypeVar("T")

logger = logging.getLogger(__name__)

QUEUE_PER_WORKER = 4  # large bodies per parsing process at once (parsing or waiting); past it: 503


def _quiet() -> None:
    """A parsing process ignores Ctrl-C: the gateway it belongs to shuts it down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ready() -> bool:
    return True


def _context() -> multiprocessing.context.BaseContext:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


class ParsePool:
    """``workers`` parsing processes, shared by the requests of one gateway process."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.limit = workers * QUEUE_PER_WORKER
        self._executor: ProcessPoolExecutor | None = None
        self._starting: asyncio.Task[ProcessPoolExecutor] | None = None
        self._pending = 0

    @property
    def pending(self) -> int:
        """Bodies in the pool now (parsing or waiting)."""
        return self._pending

    def start(self) -> None:
        """Start the processes in the background (a thread: starting them blocks for a while)."""
        if self._starting is None:
            self._starting = asyncio.create_task(asyncio.to_thread(self._new), name="specgate-parse-pool")

    def _new(self) -> ProcessPoolExecutor:
        executor = ProcessPoolExecutor(self.workers, mp_context=_context(), initializer=_quiet)
        # One job per process: they all start here, not on the event loop at the first large body.
        for f in [executor.submit(_ready) for _ in range(self.workers)]:
            f.result()
        return executor

    async def _ready_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self.start()
            assert self._starting is not None
            self._executor = await asyncio.shield(self._starting)
        return self._executor

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a parsing process (``fn`` a module-level function, the arguments and the result
        picklable); 503 ``overloaded`` when the pool is full or the process died."""
        if self._pending >= self.limit:
            raise Overloaded(f"{self._pending} large request bodies are being read; retry shortly")
        self._pending += 1
        try:
            executor = await self._ready_executor()
            try:
                return await asyncio.wrap_future(executor.submit(fn, *args))
            except BrokenExecutor as exc:
                self._replace(executor)
                raise Overloaded("the process reading large request bodies stopped; retry") from exc
        finally:
            self._pending -= 1

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is broken:
            logger.warning("a body-parsing process died; starting a new pool")
            self._executor, self._starting = None, None
            broken.shutdown(wait=False, cancel_futures=True)
            self.start()

    async def close(self) -> None:
        """Stop the processes (the bodies still in them are dropped)."""
        starting, self._starting = self._starting, None
        executor, self._executor = self._executor, None
        if executor is None and starting is not None:
            try:
                executor = await starting
            except Exception:
                executor = None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
