"""The client's presence while its request is forwarded: what the client leaving, or no longer reading, does.

A client that goes away cancels the upstream request at once (whether the gateway was waiting for headers, the
first token, or relaying): a small watcher task reads the client's side of the connection and cancels the
request's task on ``http.disconnect``. Two exceptions:

- A request with an Idempotency-Key runs on to its end (bounded by the pool's ``total_s``) when its client leaves:
  its response is stored, and the client's retry with the same key gets the whole answer instead of a second
  generation. As many as the detached budget (``gateway.runtime.detached``) allows, per client and in total; the
  others are cancelled ("cut").
- Once the last message went out, a disconnect is the normal end of the exchange and changes nothing.

A client that reads nothing for the send deadline is cut off (``gateway.proxy.stall``): its connection is aborted,
and the disconnect path above does the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.observability.metrics import GatewayMetrics
from gateway.periodic import DelayedCalls
from gateway.proxy.job import ProxyJob
from gateway.proxy.stall import StallWatch, abort_client

logger = logging.getLogger("specgate.forward")

# How long a request runs before the gateway starts watching for its client's disconnect (at most half as long
# again: the serving loop starts the watches by one timer, ``periodic.DelayedCalls``): the bound on how late a
# disconnect cancels the upstream request. Most requests to a fast upstream are answered before, and a watcher task
# costs a tenth of a request; a disconnect before it starts is still seen at once when it starts (the server's
# receive() answers http.disconnect for a client already gone).
WATCH_AFTER_S = 0.05


class ClientPresence:
    """The client of one forwarded request, watched from ``WATCH_AFTER_S`` after the start until ``done()``:
    ``send`` is the send to the client under the stall deadline; ``gone`` once it left (or was cut off);
    ``last_send`` once the exchange sent its last message. Sets the record's outcome when the client ends it."""

    __slots__ = (
        "_cut",
        "_detached",
        "_job",
        "_metrics",
        "_scope",
        "_start",
        "_starts",
        "_task",
        "_watcher",
        "gone",
        "last_send",
        "stall",
    )

    def __init__(
        self,
        job: ProxyJob,
        metrics: GatewayMetrics,
        send_timeout: Callable[[], float],
        scope: Scope,
        receive: Receive,
        send: Send,
        starts: DelayedCalls | None = None,
    ) -> None:
        # the request's work runs in the task that creates this; ``starts`` (of the serving loop, its delay
        # ``WATCH_AFTER_S``) knows the running loop (Python 3.11 finds it with a getpid system call) and starts the
        # watch, else a timer of this request's own does
        task = asyncio.current_task(starts.loop) if starts is not None else None
        if task is None:  # no starts given, or not of the loop serving now
            task = asyncio.current_task()
            starts = None
        assert task is not None
        self._task: asyncio.Task[Any] | None = task
        self._job = job
        self._metrics = metrics
        self._scope = scope
        self.gone = False
        self.last_send = False
        self._cut = False  # a keyed request cancelled for its client: the detached budget was spent
        self._detached = False  # a keyed request running on without its client, counted in job.detached
        self._watcher: asyncio.Task[None] | None = None
        self.stall = StallWatch(send, send_timeout, self._stalled)
        self._starts = starts
        self._start: asyncio.TimerHandle | None = None
        if starts is not None:  # ``WATCH_AFTER_S`` later, by the loop's one timer for all of them
            starts.add(self, self.start_watch, receive)
        else:  # the task's loop (asking for the running loop costs a getpid system call)
            self._start = task.get_loop().call_later(WATCH_AFTER_S, self.start_watch, receive)

    @property
    def send(self) -> Send:
        return self.stall.send

    def is_gone(self) -> bool:
        return self.gone

    def ended_it(self) -> bool:
        """Whether a cancellation of the request's task is the client's doing, to end the request quietly: it left,
        and the request had no key to run on for, or was cut past the detached budget."""
        return self.gone and (self._job.idempotency is None or self._cut)

    def start_watch(self, receive: Receive) -> None:
        """Watch the client from now on (``WATCH_AFTER_S`` after the request began)."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        self.stall.start()

    def _stalled(self, timeout: float) -> None:
        """The client has taken nothing for ``timeout`` s: cut it off (the disconnect path does the rest)."""
        if self.last_send:
            return
        rec = self._job.record
        rec.outcome = "client_stalled"
        rec.error = f"the client read nothing for {timeout:g}s: cut off"
        self._metrics.client_stalled.labels(rec.pool).inc()
        logger.warning("request %s: %s", rec.request_id, rec.error)
        if not abort_client(self._scope):  # else the server reports the disconnect and the watcher acts on it
            self._cancel()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self.last_send:
                    return
                self.gone = True
                job = self._job
                if job.record.outcome != "client_stalled":
                    job.record.outcome = "client_disconnect"
                if job.idempotency is None:
                    self._cancel()
                    return
                budget = job.detached  # a keyed request runs on, within the detached budget
                if budget is None or budget.acquire(job.tenant):
                    self._detached = budget is not None
                else:
                    self._cut = True
                    self._metrics.limit_refused("detached")
                    self._cancel()
                return

    def _cancel(self) -> None:
        self.gone = True
        if self._task is not None:
            self._task.cancel()

    def done(self) -> None:
        """Stop watching, give back the detached budget, and drop what holds the request (no cycle left for the GC)."""
        if self._starts is not None:
            self._starts.discard(self)
        elif self._start is not None:
            self._start.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._detached and self._job.detached is not None:
            self._detached = False
            self._job.detached.release(self._job.tenant)
        self.stall.done()
        self._task = None  # the task's frame holds the exchange, which holds this
