"""What one request is to the simulated engine: ``GenRequest`` (what the app submits), ``Generation`` (the handle
it gets back: iterate it for each engine step's tokens, ``abort()`` it when the client leaves) and the two
admission refusals, ``QueueFull`` and ``EngineDead``. The engine loop that drives them is ``engine.Engine``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.sim.metrics import SpecStats


class AbortSink(Protocol):
    """What an aborted generation tells its engine: the time now, and that it must drop the sequence."""

    def now(self) -> float: ...
    def note_abort(self) -> None: ...


@dataclass
class GenRequest:
    request_id: str
    prompt_tokens: int
    output_tokens: int  # tokens this request generates (the app's min(max_tokens, natural length))
    acceptance: float  # this request's draft acceptance a (ignored by a standard server)
    params_max_tokens: int | None = None
    finish_reason: str = "length"  # reported when output_tokens is reached ("stop" or "length")
    prompt_ids: Sequence[int] = ()  # the prompt's token ids (prefix caching); empty: the request is not cached
    answer_ids: Callable[[int], Sequence[int]] | None = None  # the answer's token ids once n tokens are emitted
    priority: int = 0  # the body's `priority`: lower first under the priority scheduling policy (ignored by fcfs)


class QueueFull(Exception):
    """Admission refused by ``--max-num-queued-reqs`` (or ``--max-num-queued-tokens``): the app answers 503."""

    def __init__(self, reason: str = "max_num_queued_reqs", limit: int | None = None) -> None:
        super().__init__(f"request queue full ({reason}={limit})")
        self.reason = reason
        self.limit = limit


class EngineDead(RuntimeError):
    """The engine loop is stopped or crashed: ``submit`` is refused (``/health`` should answer 503)."""


class Generation:
    """One submitted request. Iterate it for the tokens of each engine step; ``abort()`` when the client leaves.

    The engine's batch mechanics (``batch.Batch``) read and advance its scheduling fields: ``computed`` (tokens whose
    KV is computed), ``prefill_target``, ``blocks`` (KV blocks of its own), ``shared`` (how many of its first blocks
    are prefix-cache blocks it holds, hashes ``hashes``), ``output_tokens``; they hand it tokens through
    ``bursts``/``waiter`` (``push``, inlined on the hot path) and finish it with ``end``."""

    __slots__ = (
        "_engine", "_finish_fut", "aborted", "acceptance", "arrival", "blocks", "bursts", "cached_tokens", "computed",
        "done", "finished", "finished_reason", "first_token", "hashes", "last_token", "num_preemptions",
        "output_tokens", "prefill_target", "request", "request_id", "scheduled", "shared", "spec", "tokens", "waiter",
    )  # fmt: skip

    def __init__(self, engine: AbortSink, req: GenRequest, arrival: float, k: int) -> None:
        self._engine = engine
        self.request = req
        self.request_id = req.request_id
        self.acceptance = req.acceptance
        self.finished_reason: str | None = None
        self.spec = SpecStats(num_spec_tokens=k, acceptance_histogram=[0] * (k + 1))
        self.arrival: float | None = arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finished: float | None = None
        self.tokens = 0  # emitted so far
        self.num_preemptions = 0
        self.output_tokens = req.output_tokens
        self.computed = 0  # tokens whose KV is computed
        self.prefill_target = req.prompt_tokens  # prefill target: prompt (+ tokens made before a preemption)
        self.blocks = 0  # KV blocks of its own (not prefix-cache blocks)
        self.shared = 0  # its first ``shared`` blocks are prefix-cache blocks it holds
        self.hashes: list[bytes] = []  # the block hashes of its prompt (and of the answer, once finished)
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied at its first admission
        self.bursts: deque[int] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self._finish_fut: asyncio.Future[None] | None = None
        self.done = False
        self.aborted = False

    def __aiter__(self) -> AsyncIterator[int]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[int]:
        bursts = self.bursts
        while True:
            if bursts:
                yield bursts.popleft()
                continue
            if self.done:
                return
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiter = fut
            try:
                await fut
            finally:
                self.waiter = None

    async def wait(self) -> None:
        """Until the generation has finished (without consuming its bursts)."""
        if self.done:
            return
        if self._finish_fut is None:
            self._finish_fut = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._finish_fut)

    def abort(self) -> None:
        """The client went away: the sequence leaves the batch at the next step (``finished_reason`` "abort")."""
        if self.done:
            return
        self.aborted = True
        engine = self._engine
        self.end("abort", engine.now())
        engine.note_abort()

    def push(self, n: int) -> None:
        self.bursts.append(n)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def end(self, reason: str, t: float) -> None:
        self.finished_reason = reason
        self.finished = t
        self.done = True
        for fut in (self.waiter, self._finish_fut):
            if fut is not None and not fut.done():
                fut.set_result(None)
