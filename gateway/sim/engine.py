"""One simulated vLLM engine: V1-style continuous batching on a simulated clock.

Each step (``Engine._schedule``) takes, in this order: one decode slot per running sequence that has finished its
prefill (``1 + K`` tokens of the per-step budget on a speculative server), a chunk for every running sequence still
prefilling (chunked prefill), then waiting requests while ``running < max_num_seqs`` and the token budget
(``max_num_batched_tokens``) and the KV cache (``block_size``-token blocks, 16 by default; K lookahead slots per
sequence when speculative) allow. With prefix caching (on by default, as in vLLM V1) a request's cached prefix
is not prefilled again (``batch``); the cache's changes go to ``on_kv_events`` after every step.
A decode that finds the KV cache full preempts the newest running sequence back to the front of the queue (its KV
is dropped and recomputed later, as vLLM's recompute preemption does). Under ``scheduling_policy="priority"`` the
queue is ordered by the request's priority, then arrival (``request_queue``), and the running sequence of lowest
priority is the one preempted (``Batch._preempt_lowest``). K comes from the speculative config, per
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
from collections.abc import Callable
from typing import Any

from gateway.sim.batch import BLOCK_SIZE, Batch
from gateway.sim.metrics import SpecStats, VllmMetrics
from gateway.sim.physics import DraftCost, Preset, SpecConfig, TargetCost, step_time
from gateway.sim.prefix_cache import Event, PrefixCache, chain_hashes
from gateway.sim.request_queue import POLICIES, SchedulingPolicy, WaitingQueue, new_queue
from gateway.sim.sequence import EngineDead, Generation, GenRequest, QueueFull

__all__ = ["BLOCK_SIZE", "Engine", "EngineDead", "GenRequest", "Generation", "QueueFull", "SpecStats"]

log = logging.getLogger(__name__)


_INT_STATS = (
    "steps", "spec_steps", "max_batch", "generated_tokens", "prompt_tokens", "submitted", "finished", "aborted",
    "rejected", "preemptions", "drafts", "draft_tokens", "accepted_tokens", "late_steps",
)  # fmt: skip


class Engine(Batch):
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
        block_size: int = BLOCK_SIZE,
        enable_prefix_caching: bool = True,
        on_kv_events: Callable[[list[Event]], None] | None = None,
        scheduling_policy: SchedulingPolicy = "fcfs",
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}")
        self.scheduling_policy: SchedulingPolicy = scheduling_policy
        self.priority_policy = scheduling_policy == "priority"
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
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.total_blocks = (kv_cache_tokens or preset.kv_cache_tokens) // block_size
        self.cache = PrefixCache(block_size, record_events=on_kv_events is not None) if enable_prefix_caching else None
        self._on_kv_events = on_kv_events
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
        self._waiting: WaitingQueue = new_queue(scheduling_policy)
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

    def note_abort(self) -> None:
        """A generation was aborted: the next step drops it from the batch."""
        self._aborts += 1
        self._wake.set()

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
            raise ValueError(f"request needs more KV cache than the server has ({self.total_blocks * self.block_size})")
        g = Generation(self, req, self.now(), self.k_max)
        if self.cache is not None and req.prompt_ids:
            g.hashes = chain_hashes(req.prompt_ids, self.block_size)
        self._waiting.append(g)
        self._queued_prompt_tokens += req.prompt_tokens
        self._s["submitted"] += 1
        self.metrics.set_scheduler(len(self._running), len(self._waiting), self.kv_usage)
        self._wake.set()
        return g

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's ``/reset_prefix_cache``); False while running sequences hold some."""
        if self.cache is None or not self.cache.clear():
            return False
        self._publish_kv_events()
        return True

    def _publish_kv_events(self) -> None:
        cache, sink = self.cache, self._on_kv_events
        if cache is not None and sink is not None and cache.events:
            sink(cache.take_events())

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
            num_gpu_blocks=self.total_blocks,
            cached_blocks=len(self.cache) if self.cache is not None else 0,
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
            if self._on_kv_events is not None:
                self._publish_kv_events()
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

    def _fail_all(self, reason: str) -> None:
        """The engine stopped: every unfinished generation ends (no metrics: the server is going away)."""
        now = self.now()
        for g in [*self._running, *self._waiting]:
            if not g.done:
                g.end(reason, now)
        self._running = []
        self._waiting = new_queue(self.scheduling_policy)
        self._free_blocks = self.total_blocks
        if self.cache is not None:
            self.cache.drop_all()
            self._publish_kv_events()
        self._ctx = 0
        self._queued_prompt_tokens = 0
