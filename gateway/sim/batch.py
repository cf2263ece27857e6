"""The batch mechanics of one simulated engine: which sequences one step decodes, prefills (in chunks) and admits
under ``max_num_seqs``, the token budget and the KV cache (``block_size``-token blocks), recompute preemption
when the cache is full, the tokens each sequence gets at the end of the step, and the bookkeeping of a finished
sequence. ``Batch`` holds these methods; ``engine.Engine``, which runs the loop and owns the state, inherits them.

Prefix caching (``cache``, a ``prefix_cache.PrefixCache``; None when off): a request admitted from the queue
starts with the longest cached prefix of its prompt's full blocks (at most ``prompt − 1`` tokens: the last token
is always computed, as in vLLM) already computed, so its prefill costs only the rest. Its prompt's blocks join the
cache when its prefill completes (another request can share them from then on), its answer's blocks when it
finishes; a sequence's blocks that no one holds stay cached in free memory until ``evict`` needs the room.
``_free_blocks`` counts the blocks no running sequence holds, cached ones included (vLLM's free block queue).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.sim.metrics import VllmMetrics, observe_n
from gateway.sim.prefix_cache import PrefixCache, chain_hashes
from gateway.sim.request_queue import SchedulingPolicy, WaitingQueue, new_queue, rank
from gateway.sim.sequence import Generation

BLOCK_SIZE = 16  # vLLM's default KV block size (tokens)


@dataclass(slots=True)
class _Plan:
    decodes: list[Generation]
    prefills: list[tuple[Generation, int]]
    admitted: list[Generation]
    latest_arrival: float
    n_prefill_tokens: int


class Batch:
    """The step mechanics ``Engine`` inherits: what one step schedules (``_schedule``), what it emits (``_emit``),
    preemption, KV-block accounting and how a sequence finishes. ``Engine.__init__`` sets the attributes declared
    here."""

    metrics: VllmMetrics
    k_max: int
    max_num_seqs: int
    max_num_batched_tokens: int
    total_blocks: int
    block_size: int
    cache: PrefixCache | None
    scheduling_policy: SchedulingPolicy
    priority_policy: bool
    _free_blocks: int
    _rng: random.Random
    _running: list[Generation]
    _waiting: WaitingQueue
    _aborts: int
    _ctx: int
    _queued_prompt_tokens: int
    _s: dict[str, float]

    @property
    def kv_usage(self) -> float:
        return 1.0 - self._free_blocks / self.total_blocks if self.total_blocks else 0.0

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _schedule(self, now: float) -> _Plan | None:
        if self._aborts:
            self._drop_aborted(now)
        running, waiting = self._running, self._waiting
        k = self.k_max
        bs = self.block_size
        cache = self.cache
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
            if g.computed < g.prefill_target:
                prefilling.append(g)
                continue
            if budget < decode_cost:
                continue
            need = -(-(g.computed + reserve) // bs) - g.blocks - g.shared
            if need > 0:
                if need > self._free_blocks and self.priority_policy:
                    preempted = True
                    fits, i, back, _ = self._preempt_lowest(g, need, i, decodes, [])
                    budget += back
                    if not fits:  # g was the lowest: the sequences after it rank higher and may still fit
                        continue
                while need > self._free_blocks and running[-1] is not g:
                    self._preempt(running[-1])
                    preempted = True
                if need > self._free_blocks:  # g itself is the newest: it goes back to the queue
                    self._preempt(g)
                    preempted = True
                    break
                self._free_blocks -= need
                g.blocks += need
            decodes.append(g)
            budget -= decode_cost
        prefills: list[tuple[Generation, int]] = []
        n_prefill = 0
        for g in prefilling:
            if budget <= 0:
                break
            if g.blocks == 0 and g.shared == 0:  # preempted above
                continue
            chunk = min(g.prefill_target - g.computed, budget)
            need = self._blocks_for(g.computed + chunk + k) - g.blocks - g.shared
            if need > self._free_blocks and self.priority_policy:
                preempted = True
                fits, _, back, back_prefill = self._preempt_lowest(g, need, 0, decodes, prefills)
                budget += back
                n_prefill -= back_prefill
                if not fits:
                    continue
            if need > self._free_blocks:
                busy = set(map(id, decodes))  # never preempt a sequence already scheduled in this step
                while need > self._free_blocks and running[-1] is not g and id(running[-1]) not in busy:
                    self._preempt(running[-1])
                    preempted = True
                if need > self._free_blocks:
                    continue
            self._free_blocks -= need
            g.blocks += need
            prefills.append((g, chunk))
            n_prefill += chunk
            budget -= chunk
        admitted: list[Generation] = []
        latest = 0.0
        # vLLM admits nothing in a step that preempted, unless the step would otherwise be empty
        blocked = preempted and bool(decodes or prefills)
        while waiting and not blocked and budget > 0 and len(running) < self.max_num_seqs:
            g = waiting[0]
            hit = from_free = 0
            if cache is not None and g.hashes:  # a waiting sequence holds nothing: fresh, or preempted
                hit, from_free = cache.match(g.hashes, (g.prefill_target - 1) // bs)
            chunk = min(g.prefill_target - hit * bs, budget)
            need = self._blocks_for(hit * bs + chunk + k) - hit
            if need + from_free > self._free_blocks:
                break
            waiting.popleft()
            running.append(g)
            if hit:
                assert cache is not None
                cache.acquire(g.hashes[:hit])
                g.shared = hit
                g.computed = hit * bs
                self._ctx += g.computed
            self._free_blocks -= need + from_free
            g.blocks += need
            if cache is not None and g.num_preemptions == 0:
                g.cached_tokens = hit * bs
                self.metrics.observe_prefix_cache(g.request.prompt_tokens, g.cached_tokens)
            prefills.append((g, chunk))
            admitted.append(g)
            n_prefill += chunk
            budget -= chunk
            if g.arrival is not None and g.arrival > latest:
                latest = g.arrival
        if cache is not None and cache.free > self._free_blocks:
            cache.evict(self._free_blocks)
        self.metrics.set_scheduler(len(running), len(waiting), self.kv_usage)
        if not decodes and not prefills:
            return None
        return _Plan(decodes, prefills, admitted, latest, n_prefill)

    def _preempt_lowest(
        self, g: Generation, need: int, i: int, decodes: list[Generation], prefills: list[tuple[Generation, int]]
    ) -> tuple[bool, int, int, int]:
        """Priority policy, ``g`` needs ``need`` free blocks: preempt the running sequence of lowest priority (the
        largest ``rank``, whichever it is) until they are free or ``g`` itself was preempted, as vLLM does. A victim
        already scheduled in this step leaves the plan and its tokens go back to the budget. Returns whether ``g``
        fits, the running index ``i`` shifted past victims before it, the budget and the prefill tokens given back."""
        running = self._running
        back = back_prefill = 0
        while need > self._free_blocks:
            victim = max(reversed(running), key=rank)  # ties (same arrival time): the last admitted, as under fcfs
            if running.index(victim) < i:
                i -= 1
            if victim in decodes:
                decodes.remove(victim)
                back += 1 + self.k_max
            else:
                for j, (p, chunk) in enumerate(prefills):
                    if p is victim:
                        del prefills[j]
                        back += chunk
                        back_prefill += chunk
                        break
            self._preempt(victim)
            if victim is g:
                return False, i, back, back_prefill
        return True, i, back, back_prefill

    def _preempt(self, g: Generation) -> None:
        """Recompute preemption: drop the sequence's KV, back to the front of the queue (to its place by priority
        under the priority policy)."""
        running = self._running
        if running and running[-1] is g:
            running.pop()
        else:
            running.remove(g)
        self._free_blocks += g.blocks
        self._ctx -= g.computed
        self._unshare(g)
        g.blocks = 0
        g.computed = 0
        g.prefill_target = g.request.prompt_tokens + g.tokens
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
            if g.done:  # aborted during the step
                continue
            left = g.output_tokens - g.tokens
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
            g.computed += n
            g.tokens += n
            generated += n
            last = g.last_token
            if last is not None:
                itl[last] = itl_get(last, 0) + 1
            g.last_token = end
            g.bursts.append(n)  # Generation.push, inlined: this loop runs for every sequence of every step
            w = g.waiter
            if w is not None and not w.done():
                w.set_result(None)
            if n >= left:
                finished.append(g)
        drafts = sum(acc_hist)
        self._ctx += generated
        n_prefill_done = 0
        for g, chunk in plan.prefills:
            g.computed += chunk
            self._ctx += chunk
            if g.computed < g.prefill_target or g.done:
                continue
            if self.cache is not None and g.hashes:
                self._adopt(g, len(g.hashes), g.request.prompt_ids)
            left = g.output_tokens - g.tokens
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
            g.push(1)
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
                if self.cache is not None:
                    self._cache_answer(g)
                self._release(g)
                self._finish(g, g.request.finish_reason, end)
            done = set(map(id, finished))
            self._running = [g for g in self._running if id(g) not in done]
        self.metrics.set_scheduler(len(self._running), len(self._waiting), self.kv_usage)

    def _release(self, g: Generation) -> None:
        self._free_blocks += g.blocks
        self._ctx -= g.computed
        self._unshare(g)
        g.blocks = 0
        g.computed = 0

    def _unshare(self, g: Generation) -> None:
        """The sequence lets go of its prefix-cache blocks (they stay cached, in free memory once no one holds them)."""
        if g.shared and self.cache is not None:
            self._free_blocks += self.cache.release(g.hashes[: g.shared])
        g.shared = 0

    def _adopt(self, g: Generation, upto: int, ids: Sequence[int]) -> None:
        """The sequence's computed blocks up to ``upto`` (of ``g.hashes``; ``ids`` its tokens) join the cache."""
        cache, start = self.cache, g.shared
        n = min(upto - start, g.blocks)
        if cache is None or n <= 0:
            return
        parent = g.hashes[start - 1] if start else None
        self._free_blocks += cache.adopt(g.hashes[start : start + n], ids, start, parent)
        g.blocks -= n
        g.shared = start + n

    def _cache_answer(self, g: Generation) -> None:
        """A finished sequence's full blocks of prompt + answer join the cache (the answer as the next turn of the
        conversation renders it, up to the tokens actually computed)."""
        req = g.request
        if req.answer_ids is None or not req.prompt_ids or g.shared != len(g.hashes):
            return
        ids = [*req.prompt_ids, *req.answer_ids(g.tokens)]
        bs = self.block_size
        n_full = min(len(ids), req.prompt_tokens + g.tokens) // bs
        have = len(g.hashes)
        if n_full <= have:
            return
        parent = g.hashes[-1] if have else None
        g.hashes = g.hashes + chain_hashes(ids[: n_full * bs], bs, start_block=have, parent=parent)
        self._adopt(g, n_full, ids)

    def _finish(self, g: Generation, reason: str, t: float) -> None:
        """Terminal state + vLLM's per-request histograms (phases never reached are not observed)."""
        if not g.done:
            g.end(reason, t)
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
        dropped = [g for g in self._running if g.aborted]
        if dropped:
            self._running = [g for g in self._running if not g.aborted]
        queued = [g for g in self._waiting if g.aborted]
        if queued:
            self._waiting = new_queue(self.scheduling_policy, (g for g in self._waiting if not g.aborted))
        for g in dropped + queued:
            self._release(g)
            self._finish(g, "abort", g.finished if g.finished is not None else now)
