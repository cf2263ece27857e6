"""One simulated vLLM engine: V1-style continuous batching on a simulated clock.

Each step (``Engine._schedule``) takes, in this order: one decode slot per running sequence that has finished its
prefill (``1 + K`` tokens of the per-step budget on a speculative server), a chunk for every running sequence still
prefilling (chunked prefill), then waiting requests while ``running < max_num_seqs`` and the token budget
(``max_num_batched_tokens``) and the KV cache (16-token blocks; K lookahead slots per sequence when speculative) allow.
A decode that finds the KV cache full preempts the newest running sequence back to the front of the queue (its KV
is dropped and recomputed later, as vLLM's recompute preemption does). K comes from the speculative config, per
number of scheduled requests when it has ``num_speculative_tokens_per_batch_size``.

The step lasts ``physics.step_time``; the loop sleeps until the simulated clock reaches its end, then emits: a
sequence whose prefill completed gets one token (the first, or the next after a preemption), a decoding sequence one
token (standard) or ``sample_accepted(a, K) + 1`` (speculative, capped by what it has left), delivered to its
``Generation`` as one burst. Simulated time is ``(monotonic() − t0) / time_scale``.

Timing: the next step starts where the previous one ended, or later when a request admitted into it arrived later.
The loop's own Python work and the sleep's overshoot (asyncio timers have ~1 ms resolution) overlap the step in
flight — vLLM's async scheduling overlaps CPU scheduling with GPU execution — up to one step's length or
``timer_slack_s`` of real time, whichever is longer. Beyond that the loop is late: the step starts late and the
lateness shows as latency (counted in ``stats()["lag_s"]``), never hidden. So the simulated clock of the engine's
timestamps trails the wall clock by at most that bound.

``virtual_clock=True`` decouples the simulation from the wall clock: time jumps from step to step (and to the next
``sleep_until`` timer when idle), so a run is exact, deterministic and as fast as the Python allows; for tests and
offline sweeps, not for a server that clients talk to.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.sim.metrics import SpecStats, VllmMetrics, observe_n
from gateway.sim.physics import DraftCost, Preset, SpecConfig, TargetCost, step_time

__all__ = ["BLOCK_SIZE", "Engine", "EngineDead", "GenRequest", "Generation", "QueueFull", "SpecStats"]

log = logging.getLogger(__name__)

BLOCK_SIZE = 16  # vLLM's default KV block size (tokens)


@dataclass
class GenRequest:
    request_id: str
    prompt_tokens: int
    output_tokens: int  # tokens this request generates (the app's min(max_tokens, natural length))
    acceptance: float  # this request's draft acceptance a (ignored by a standard server)
    params_max_tokens: int | None = None
    finish_reason: str = "length"  # reported when output_tokens is reached ("stop" or "length")


class QueueFull(Exception):
    """Admission refused by ``--max-num-queued-reqs`` (or ``--max-num-queued-tokens``): the app answers 503."""

    def __init__(self, reason: str = "max_num_queued_reqs", limit: int | None = None) -> None:
        super().__init__(f"request queue full ({reason}={limit})")
        self.reason = reason
        self.limit = limit


class EngineDead(RuntimeError):
    """The engine loop is stopped or crashed: ``submit`` is refused (``/health`` should answer 503)."""


class Generation:
    """One submitted request. Iterate it for the tokens of each engine step; ``abort()`` when the client leaves."""

    __slots__ = (
        "_aborted", "_blocks", "_bursts", "_computed", "_done", "_engine", "_finish_fut", "_out", "_target", "_waiter",
        "acceptance", "arrival", "finished", "finished_reason", "first_token", "last_token", "num_preemptions",
        "request", "request_id", "scheduled", "spec", "tokens",
    )  # fmt: skip

    def __init__(self, engine: Engine, req: GenRequest, arrival: float, k: int) -> None:
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
        self._out = req.output_tokens
        self._computed = 0  # tokens whose KV is computed
        self._target = req.prompt_tokens  # prefill target: prompt (+ tokens made before a preemption)
        self._blocks = 0  # KV blocks held
        self._bursts: deque[int] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._finish_fut: asyncio.Future[None] | None = None
        self._done = False
        self._aborted = False

    def __aiter__(self) -> AsyncIterator[int]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[int]:
        bursts = self._bursts
        while True:
            if bursts:
                yield bursts.popleft()
                continue
            if self._done:
                return
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiter = fut
            try:
                await fut
            finally:
                self._waiter = None

    async def wait(self) -> None:
        """Until the generation has finished (without consuming its bursts)."""
        if self._done:
            return
        if self._finish_fut is None:
            self._finish_fut = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._finish_fut)

    def abort(self) -> None:
        """The client went away: the sequence leaves the batch at the next step (``finished_reason`` "abort")."""
        if self._done:
            return
        self._aborted = True
        engine = self._engine
        self._end("abort", engine.now())
        engine._aborts += 1
        engine._wake.set()

    def _push(self, n: int) -> None:
        self._bursts.append(n)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self, reason: str, t: float) -> None:
        self.finished_reason = reason
        self.finished = t
        self._done = True
        for fut in (self._waiter, self._finish_fut):
            if fut is not None and not fut.done():
                fut.set_result(None)


_INT_STATS = (
    "steps", "spec_steps", "max_batch", "generated_tokens", "prompt_tokens", "submitted", "finished", "aborted",
    "rejected", "preemptions", "drafts", "draft_tokens", "accepted_tokens", "late_steps",
)  # fmt: skip


@dataclass(slots=True)
class _Plan:
    decodes: list[Generation]
    prefills: list[tuple[Generation, int]]
    admitted: list[Generation]
    latest_arrival: float
    n_prefill_tokens: int


class Engine:
    """The engine loop of one simulated server (an asyncio task)."""

    def __init__(
        self,
        preset: Preset,
        spec: SpecConfig | None,
        metrics: VllmMetrics,
        *,
        time_scale: float = 1.0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_queued_reqs: int | None = None,
        seed: int = 0,
        target: TargetCost | None = None,
        draft: DraftCost | None = None,
        max_num_queued_tokens: int | None = None,
        kv_cache_tokens: int | None = None,
        timer_slack_s: float = 0.005,
        virtual_clock: bool = False,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.preset = preset
        self.spec = spec
        self.metrics = metrics
        self.time_scale = time_scale
        self.target = target or preset.target
        self.draft = (draft or preset.draft_for(spec.method)) if spec is not None else None
        self.k_max = spec.num_speculative_tokens if spec is not None else 0
        self.max_num_seqs = max_num_seqs or preset.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or preset.max_num_batched_tokens
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.timer_slack_s = timer_slack_s
        self.total_blocks = (kv_cache_tokens or preset.kv_cache_tokens) // BLOCK_SIZE
        if self.max_num_batched_tokens < 1 + self.k_max:
            raise ValueError("max_num_batched_tokens must leave room for one decode (1 + K tokens)")
        self._free_blocks = self.total_blocks
        self._rng = random.Random(seed)
        self._t0 = time.monotonic()
        self.virtual_clock = virtual_clock
        self._vnow = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []  # virtual clock: (t, seq, future) heap
        self._timer_seq = itertools.count()
        self._running: list[Generation] = []
        self._waiting: deque[Generation] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._aborts = 0
        self._ctx = 0  # Σ computed tokens of running sequences (N_kv)
        self._queued_prompt_tokens = 0  # prompt tokens of requests without a first token yet
        self.dead = False
        self.error: BaseException | None = None
        self._s: dict[str, float] = dict.fromkeys(
            (*_INT_STATS, "busy_s", "decode_seq_steps", "lag_s", "python_s", "python_s_max"), 0.0
        )

    # -- public ---------------------------------------------------------------------------------------------

    def now(self) -> float:
        if self.virtual_clock:
            return self._vnow
        return (time.monotonic() - self._t0) / self.time_scale

    async def sleep_until(self, t: float) -> None:
        """Wait until simulated time ``t``. On the virtual clock, time jumps from event to event: the engine fires
        these timers in order, so open-loop arrivals land exactly at their simulated times (fast, deterministic)."""
        if not self.virtual_clock:
            delay = (t - self.now()) * self.time_scale
            if delay > 0:
                await asyncio.sleep(delay)
            return
        if t <= self._vnow:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (t, next(self._timer_seq), fut))
        self._wake.set()
        await fut

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self._free_blocks / self.total_blocks if self.total_blocks else 0.0

    async def start(self) -> None:
        if self._task is None:
            self.dead = False
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all("error")
        self.dead = True
        for _, _, fut in self._timers:
            fut.cancel()
        self._timers.clear()

    def submit(self, req: GenRequest) -> Generation:
        if self.dead:
            raise EngineDead("the engine is not running")
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        limit = self.max_num_queued_reqs
        if limit is not None and len(self._running) + len(self._waiting) + 1 > limit:
            self._s["rejected"] += 1
            self.metrics.reject("max_num_queued_reqs")
            raise QueueFull("max_num_queued_reqs", limit)
        limit = self.max_num_queued_tokens
        if limit is not None and self._queued_prompt_tokens >= limit:
            self._s["rejected"] += 1
            self.metrics.reject("max_num_queued_tokens")
            raise QueueFull("max_num_queued_tokens", limit)
        if self._blocks_for(req.prompt_tokens + req.output_tokens + 2 * self.k_max + 1) > self.total_blocks:
            raise ValueError(f"request needs more KV cache than the server has ({self.total_blocks * BLOCK_SIZE})")
        g = Generation(self, req, self.now(), self.k_max)
        self._waiting.append(g)
        self._queued_prompt_tokens += req.prompt_tokens
        self._s["submitted"] += 1
        self.metrics.set_scheduler(len(self._running), len(self._waiting), self.kv_usage)
        self._wake.set()
        return g

    def stats(self) -> dict[str, Any]:
        """Counters for ``/sim/stats``: steps, tokens, busy time, lateness, Python cost per step."""
        s: dict[str, Any] = dict(self._s)
        steps = s["steps"] or 1.0
        now = self.now()
        s.update(
            sim_time_s=now,
            utilization=s["busy_s"] / now if now > 0 else 0.0,
            mean_batch=s["decode_seq_steps"] / steps,
            python_s_per_step=s["python_s"] / steps,
            acceptance_rate=s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else None,
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            num_speculative_tokens=self.k_max or None,
            time_scale=self.time_scale,
        )
        for key in _INT_STATS:
            s[key] = int(s[key])
        return s

    # -- the loop ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: fail every request rather than leave them hanging
            log.exception("simulated engine crashed")
            self.error, self.dead = e, True
            self._fail_all("error")

    async def _loop(self) -> None:
        prev_end: float | None = None
        prev_t = 0.0
        slack = self.timer_slack_s / self.time_scale
        s = self._s
        perf = time.perf_counter
        while True:
            if not self._running and not self._waiting:
                prev_end = None
                if self._timers:  # virtual clock, idle: jump to the next timer
                    await self._fire_timers(self._timers[0][0])
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            c0 = perf()
            now = self.now()
            plan = self._schedule(now)
            if plan is None:  # everything left was aborted, or nothing fits: wait for news
                self._wake.clear()
                await self._wake.wait()
                continue
            if prev_end is None:
                start = now
            else:
                start = max(prev_end, now - max(prev_t, slack))
                if start > prev_end:
                    s["late_steps"] += 1
                    s["lag_s"] += start - prev_end
            start = max(start, plan.latest_arrival)
            for g in plan.admitted:
                if g.scheduled is None:
                    g.scheduled = start
            n_dec = len(plan.decodes)
            k = self.k_max
            if k and self.spec is not None:
                k = self.spec.k_for_batch(n_dec + len(plan.prefills))
            n_kv = self._ctx + plan.n_prefill_tokens + n_dec
            t = step_time(self.target, self.draft, k, n_dec, plan.n_prefill_tokens, n_kv)
            end = start + t
            cpu = perf() - c0
            if self.virtual_clock:
                await self._fire_timers(end)
                self._vnow = max(self._vnow, end)
            else:
                delay = (end - self.now()) * self.time_scale
                await asyncio.sleep(delay if delay > 0 else 0)
            c1 = perf()
            self._emit(plan, k, end)
            cpu += perf() - c1
            s["python_s"] += cpu
            if cpu > s["python_s_max"]:
                s["python_s_max"] = cpu
            s["steps"] += 1
            s["busy_s"] += t
            s["decode_seq_steps"] += n_dec
            if n_dec > s["max_batch"]:
                s["max_batch"] = n_dec
            if k and n_dec:
                s["spec_steps"] += 1
            prev_end, prev_t = end, t

    async def _fire_timers(self, until: float) -> None:
        """Virtual clock: wake every ``sleep_until`` due by ``until``, in time order, letting each waiter run (and
        submit, stamped with its own time) before the clock moves on."""
        timers = self._timers
        while timers and timers[0][0] <= until:
            t, _, fut = heapq.heappop(timers)
            self._vnow = max(self._vnow, t)
            if not fut.done():
                fut.set_result(None)
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.sleep(0)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    def _schedule(self, now: float) -> _Plan | None:
        if self._aborts:
            self._drop_aborted(now)
        running, waiting = self._running, self._waiting
        k = self.k_max
        budget = self.max_num_batched_tokens
        decode_cost = 1 + k
        reserve = 1 + 2 * k  # the last token + K drafts verified + K lookahead slots for the next drafts
        decodes: list[Generation] = []
        prefilling: list[Generation] = []
        preempted = False
        i = 0
        while i < len(running):
            g = running[i]
            i += 1
            if g._computed < g._target:
                prefilling.append(g)
                continue
            if budget < decode_cost:
                continue
            need = -(-(g._computed + reserve) // BLOCK_SIZE) - g._blocks
            if need > 0:
                while need > self._free_blocks and running[-1] is not g:
                    self._preempt(running[-1])
                    preempted = True
                if need > self._free_blocks:  # g itself is the newest: it goes back to the queue
                    self._preempt(g)
                    preempted = True
                    break
                self._free_blocks -= need
                g._blocks += need
            decodes.append(g)
            budget -= decode_cost
        prefills: list[tuple[Generation, int]] = []
        n_prefill = 0
        for g in prefilling:
            if budget <= 0:
                break
            if g._blocks == 0:  # preempted above
                continue
            chunk = min(g._target - g._computed, budget)
            need = self._blocks_for(g._computed + chunk + k) - g._blocks
            if need > self._free_blocks:
                busy = set(map(id, decodes))  # never preempt a sequence already scheduled in this step
                while need > self._free_blocks and running[-1] is not g and id(running[-1]) not in busy:
                    self._preempt(running[-1])
                    preempted = True
                if need > self._free_blocks:
                    continue
            self._free_blocks -= need
            g._blocks += need
            prefills.append((g, chunk))
            n_prefill += chunk
            budget -= chunk
        admitted: list[Generation] = []
        latest = 0.0
        # vLLM admits nothing in a step that preempted, unless the step would otherwise be empty
        blocked = preempted and bool(decodes or prefills)
        while waiting and not blocked and budget > 0 and len(running) < self.max_num_seqs:
            g = waiting[0]
            chunk = min(g._target - g._computed, budget)
            need = self._blocks_for(g._computed + chunk + k) - g._blocks
            if need > self._free_blocks:
                break
            waiting.popleft()
            running.append(g)
            self._free_blocks -= need
            g._blocks += need
            prefills.append((g, chunk))
            admitted.append(g)
            n_prefill += chunk
            budget -= chunk
            if g.arrival is not None and g.arrival > latest:
                latest = g.arrival
        self.metrics.set_scheduler(len(running), len(waiting), self.kv_usage)
        if not decodes and not prefills:
            return None
        return _Plan(decodes, prefills, admitted, latest, n_prefill)

    def _preempt(self, g: Generation) -> None:
        """Recompute preemption: drop the sequence's KV, back to the front of the queue."""
        running = self._running
        if running and running[-1] is g:
            running.pop()
        else:
            running.remove(g)
        self._free_blocks += g._blocks
        self._ctx -= g._computed
        g._blocks = 0
        g._computed = 0
        g._target = g.request.prompt_tokens + g.tokens
        g.num_preemptions += 1
        self._waiting.appendleft(g)
        self._s["preemptions"] += 1
        self.metrics.preemptions.inc()

    def _emit(self, plan: _Plan, k: int, end: float) -> None:
        """The step is over at simulated time ``end``: tokens, counters, histograms, bursts."""
        rand = self._rng.random
        metrics = self.metrics
        itl: dict[float, int] = {}
        finished: list[Generation] = []
        generated = 0
        acc_hist = [0] * (k + 1)
        itl_get = itl.get
        for g in plan.decodes:
            if g._done:  # aborted during the step
                continue
            left = g._out - g.tokens
            if k:
                a = g.acceptance
                acc = 0
                while acc < k and rand() < a:
                    acc += 1
                n = acc + 1 if acc < left else left
                sp = g.spec
                sp.num_spec_steps += 1
                sp.num_draft_tokens += k
                sp.num_accepted_draft_tokens += acc
                sp.acceptance_histogram[acc] += 1
                sp.per_step_accepted.append(acc)
                sp.per_step_drafted.append(k)
                acc_hist[acc] += 1
            else:
                n = 1
            g._computed += n
            g.tokens += n
            generated += n
            last = g.last_token
            if last is not None:
                itl[last] = itl_get(last, 0) + 1
            g.last_token = end
            g._bursts.append(n)  # Generation._push, inlined: this loop runs for every sequence of every step
            w = g._waiter
            if w is not None and not w.done():
                w.set_result(None)
            if n >= left:
                finished.append(g)
        drafts = sum(acc_hist)
        self._ctx += generated
        n_prefill_done = 0
        for g, chunk in plan.prefills:
            g._computed += chunk
            self._ctx += chunk
            if g._computed < g._target or g._done:
                continue
            left = g._out - g.tokens
            g.tokens += 1
            generated += 1
            if g.first_token is None:
                g.first_token = end
                metrics.ttft.observe(end - (g.arrival or 0.0))
                n_prefill_done += g.request.prompt_tokens
                self._queued_prompt_tokens -= g.request.prompt_tokens
            elif g.last_token is not None:  # resumed after a preemption
                itl[g.last_token] = itl.get(g.last_token, 0) + 1
            g.last_token = end
            g._push(1)
            if left <= 1:
                finished.append(g)
        for last, count in itl.items():
            observe_n(metrics.itl, end - last, count)
        if generated:
            metrics.generation_tokens.inc(generated)
        if n_prefill_done:
            metrics.prompt_tokens.inc(n_prefill_done)
            self._s["prompt_tokens"] += n_prefill_done
        self._s["generated_tokens"] += generated
        if drafts:
            accepted = sum(j * c for j, c in enumerate(acc_hist))
            per_pos = [0] * k
            tail = 0
            for j in range(k, 0, -1):  # position j-1 accepted by every draft that accepted >= j
                tail += acc_hist[j]
                per_pos[j - 1] = tail
            metrics.observe_spec(drafts, drafts * k, accepted, per_pos)
            self._s["drafts"] += drafts
            self._s["draft_tokens"] += drafts * k
            self._s["accepted_tokens"] += accepted
        if finished:
            for g in finished:
                self._release(g)
                self._finish(g, g.request.finish_reason, end)
            done = set(map(id, finished))
            self._running = [g for g in self._running if id(g) not in done]
        self.metrics.set_scheduler(len(self._running), len(self._waiting), self.kv_usage)

    def _release(self, g: Generation) -> None:
        self._free_blocks += g._blocks
        self._ctx -= g._computed
        g._blocks = 0
        g._computed = 0

    def _finish(self, g: Generation, reason: str, t: float) -> None:
        """Terminal state + vLLM's per-request histograms (phases never reached are not observed)."""
        if not g._done:
            g._end(reason, t)
        if g.first_token is None:
            self._queued_prompt_tokens -= g.request.prompt_tokens
        self._s["aborted" if reason == "abort" else "finished"] += 1
        arrival = g.arrival or 0.0
        first, last, sched = g.first_token, g.last_token, g.scheduled
        self.metrics.observe_finished(
            reason,
            e2e=t - arrival,
            queued=None if sched is None else sched - arrival,
            prefill=None if first is None or sched is None else first - sched,
            decode=None if first is None or last is None else last - first,
            inference=None if last is None or sched is None else last - sched,
            prompt_tokens=g.request.prompt_tokens,
            generation_tokens=g.tokens,
            max_tokens=g.request.params_max_tokens,
        )

    def _drop_aborted(self, now: float) -> None:
        self._aborts = 0
        dropped = [g for g in self._running if g._aborted]
        if dropped:
            self._running = [g for g in self._running if not g._aborted]
        queued = [g for g in self._waiting if g._aborted]
        if queued:
            self._waiting = deque(g for g in self._waiting if not g._aborted)
        for g in dropped + queued:
            self._release(g)
            self._finish(g, "abort", g.finished if g.finished is not None else now)

    def _fail_all(self, reason: str) -> None:
        """The engine stopped: every unfinished generation ends (no metrics: the server is going away)."""
        now = self.now()
        for g in [*self._running, *self._waiting]:
            if not g._done:
                g._end(reason, now)
        self._running = []
        self._waiting = deque()
        self._free_blocks = self.total_blocks
        self._ctx = 0
        self._queued_prompt_tokens = 0
