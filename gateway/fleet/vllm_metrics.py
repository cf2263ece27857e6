"""vLLM's scraped samples → endpoint and pool load. Pure: no I/O, no clock (every method takes ``now``). The
samples come from ``gateway.fleet.vllm_exposition`` (parsing one /metrics body).

``EndpointLoad`` keeps one endpoint's latest gauges (with the time they were scraped) and a window of cumulative
counter snapshots. Rules:

- stale: the last scrape failed (error, timeout, bad status, malformed text) or the last good one is older than
  ``stale_after_s``. Stale data reads as None, never as 0.
- counter reset (a server restart): any counter lower than in the previous snapshot, or a changed ``_created``
  timestamp. The window starts again from the new snapshot: no negative rate, no absurd one.
- acceptance over the window, from counter deltas (vLLM has no acceptance gauge): rate = Δaccepted /
  Δdraft_tokens, mean acceptance length = 1 + Δaccepted / Δdrafts, per position = Δaccepted_per_pos[i] / Δdrafts.
  None when the window has no drafts (a standard server, an idle one).
- between scrapes the gateway's own in-flight count moves the scraped numbers: requests sent since the scrape join
  the queue; requests finished since leave the queue first (a waiting request takes the freed slot), then the batch.

``PoolLoad`` aggregates a pool's endpoints: running and waiting summed, KV usage the maximum, acceptance pooled from
the counter deltas of every fresh endpoint (not an average of ratios); stale only when no endpoint is fresh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.fleet.vllm_exposition import VllmSample

MIN_FINISHED = 3  # requests finished in a window before its mean output length is given


# ---------------------------------------------------------------------------------------------------------------
# Windows of counter deltas


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Speculative decoding over a window, from counter deltas: never built from a window without drafts."""

    rate: float  # Δaccepted / Δdraft_tokens
    mean_length: float  # 1 + Δaccepted / Δdrafts (with the bonus token)
    per_position: tuple[float, ...]  # Δaccepted_per_pos[i] / Δdrafts
    drafts: float  # Δdrafts: the sample size


@dataclass(frozen=True, slots=True)
class WindowDeltas:
    """Counter increases over a window (one endpoint, or a pool's endpoints added up)."""

    span_s: float
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()
    generation_tokens: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0
    out_sum: float = 0.0
    out_count: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0

    def __add__(self, other: WindowDeltas) -> WindowDeltas:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0.0,) * (n - len(other.accepted_per_pos))
        return WindowDeltas(
            span_s=max(self.span_s, other.span_s),
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted=self.accepted + other.accepted,
            accepted_per_pos=tuple(x + y for x, y in zip(a, b, strict=True)),
            generation_tokens=self.generation_tokens + other.generation_tokens,
            tpot_sum=self.tpot_sum + other.tpot_sum,
            tpot_count=self.tpot_count + other.tpot_count,
            out_sum=self.out_sum + other.out_sum,
            out_count=self.out_count + other.out_count,
            prefix_queries=self.prefix_queries + other.prefix_queries,
            prefix_hits=self.prefix_hits + other.prefix_hits,
        )

    def acceptance(self) -> Acceptance | None:
        if self.drafts <= 0 or self.draft_tokens <= 0:
            return None
        return Acceptance(
            rate=self.accepted / self.draft_tokens,
            mean_length=1.0 + self.accepted / self.drafts,
            per_position=tuple(x / self.drafts for x in self.accepted_per_pos),
            drafts=self.drafts,
        )

    @property
    def prefix_hit_ratio(self) -> float | None:
        """Prompt tokens found in the prefix cache / prompt tokens looked up, over the window."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries > 0 else None

    @property
    def tpot_mean_s(self) -> float | None:
        """Mean time per output token of the requests that finished in the window."""
        return self.tpot_sum / self.tpot_count if self.tpot_count > 0 else None

    @property
    def generation_tokens_per_s(self) -> float | None:
        return self.generation_tokens / self.span_s if self.span_s > 0 else None

    @property
    def output_tokens_mean(self) -> float | None:
        """Output tokens per request that finished in the window (vLLM's per-request histogram of generated
        tokens); None until ``MIN_FINISHED`` requests finished in it (a mean of one or two is noise)."""
        return self.out_sum / self.out_count if self.out_count >= MIN_FINISHED else None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    t: float
    counters: tuple[float, ...]  # drafts, draft_tokens, accepted, generation_tokens, tpot and out sum/count, prefix
    per_pos: tuple[float, ...]
    created: float | None

    @classmethod
    def of(cls, sample: VllmSample, t: float) -> _Snapshot:
        values = (sample.drafts, sample.draft_tokens, sample.accepted, sample.generation_tokens)
        counters = (
            *values,
            sample.tpot_sum,
            sample.tpot_count,
            sample.out_sum,
            sample.out_count,
            sample.prefix_queries,
            sample.prefix_hits,
        )
        return cls(t, tuple(0.0 if v is None else v for v in counters), sample.accepted_per_pos, sample.created)

    def is_reset_of(self, prev: _Snapshot) -> bool:
        if self.created is not None and prev.created is not None and self.created != prev.created:
            return True
        if any(now < before for now, before in zip(self.counters, prev.counters, strict=True)):
            return True
        return any(self._pos(i) < prev._pos(i) for i in range(len(prev.per_pos)))

    def _pos(self, i: int) -> float:
        return self.per_pos[i] if i < len(self.per_pos) else 0.0

    def minus(self, base: _Snapshot) -> WindowDeltas:
        d = [a - b for a, b in zip(self.counters, base.counters, strict=True)]
        n = max(len(self.per_pos), len(base.per_pos))
        return WindowDeltas(
            span_s=self.t - base.t,
            drafts=d[0],
            draft_tokens=d[1],
            accepted=d[2],
            accepted_per_pos=tuple(self._pos(i) - base._pos(i) for i in range(n)),
            generation_tokens=d[3],
            tpot_sum=d[4],
            tpot_count=d[5],
            out_sum=d[6],
            out_count=d[7],
            prefix_queries=d[8],
            prefix_hits=d[9],
        )


# ---------------------------------------------------------------------------------------------------------------
# One endpoint, one pool


@dataclass(frozen=True, slots=True)
class EndpointGauges:
    """An endpoint's latest scraped queue: requests running and waiting, KV-cache use, and how old that is."""

    running: float
    waiting: float
    kv_usage: float | None
    age_s: float  # since the scrape these come from


class EndpointLoad:
    """What the scrapes of one endpoint say. ``stale_after_s`` and ``window_s`` follow the YAML (set by the scraper)."""

    def __init__(self, pool: str, endpoint: str, url: str, *, stale_after_s: float = 6.0, window_s: float = 60.0):
        self.pool = pool
        self.endpoint = endpoint
        self.url = url
        self.stale_after_s = stale_after_s
        self.window_s = window_s
        self.sample: VllmSample | None = None
        self.sampled_at: float | None = None
        self.in_flight_at_sample = 0
        self.failed = False  # the last scrape failed
        self.last_result = "none"
        self.last_error: str | None = None
        self.health_ok: bool | None = None  # the last /health probe (None before any)
        self.resets = 0
        self._window: deque[_Snapshot] = deque()

    def record(self, sample: VllmSample, now: float, in_flight: int = 0) -> bool:
        """A good scrape at ``now`` (``in_flight``: the gateway's requests on it then). True when it was a reset."""
        snap = _Snapshot.of(sample, now)
        reset = bool(self._window) and snap.is_reset_of(self._window[-1])
        if reset:
            self._window.clear()
            self.resets += 1
        self._window.append(snap)
        cutoff = now - self.window_s
        while len(self._window) >= 2 and self._window[1].t <= cutoff:
            self._window.popleft()  # keep one snapshot at or before the cutoff: the window's base
        self.sample = sample
        self.sampled_at = now
        self.in_flight_at_sample = in_flight
        self.failed = False
        self.last_result = "ok"
        self.last_error = None
        return reset

    def record_failure(self, result: str, error: str) -> None:
        """A failed scrape: the endpoint is stale until the next good one (its window is kept)."""
        self.failed = True
        self.last_result = result
        self.last_error = error

    def stale(self, now: float) -> bool:
        return self.failed or self.sampled_at is None or now - self.sampled_at > self.stale_after_s

    def gauges(self, now: float, in_flight: int | None = None) -> EndpointGauges | None:
        """The scraped gauges (moved by the gateway's in-flight change since the scrape when given); None if stale."""
        sample, at = self.sample, self.sampled_at
        if sample is None or at is None or self.stale(now):
            return None
        running, waiting = sample.running, sample.waiting
        if in_flight is not None:
            delta = in_flight - self.in_flight_at_sample
            if delta >= 0:
                # New requests join the running batch while the server had no queue at the scrape (vLLM admits
                # them at the next step), else they queue: one request in flight must not look like a queue.
                if waiting > 0:
                    waiting += delta
                else:
                    running += delta
            else:
                gone = -delta
                from_queue = min(waiting, gone)
                waiting -= from_queue
                running = max(0.0, running - (gone - from_queue))
        return EndpointGauges(running, waiting, sample.kv_usage, now - at)

    def deltas(self, now: float) -> WindowDeltas | None:
        """Counter increases over the window ending at the latest scrape; None if stale or fewer than two scrapes."""
        if self.stale(now) or len(self._window) < 2:
            return None
        cutoff = now - self.window_s
        base = self._window[0]
        for snap in self._window:
            if snap.t > cutoff:
                break
            base = snap
        last = self._window[-1]
        return None if base is last else last.minus(base)

    def acceptance(self, now: float) -> Acceptance | None:
        d = self.deltas(now)
        return None if d is None else d.acceptance()

    def tpot_mean_s(self, now: float) -> float | None:
        d = self.deltas(now)
        return None if d is None else d.tpot_mean_s


@dataclass(frozen=True, slots=True)
class PoolLoadView:
    """One pool right now. Numbers are None when unknown (stale), never 0 for it."""

    pool: str
    endpoints: int
    fresh_endpoints: int
    running: float | None
    waiting: float | None
    kv_usage: float | None
    acceptance: Acceptance | None
    tpot_mean_s: float | None
    generation_tokens_per_s: float | None
    output_tokens_mean: float | None = None  # per finished request in the scrape window

    @property
    def stale(self) -> bool:
        return self.fresh_endpoints == 0


@dataclass(slots=True)
class PoolLoad:
    """A pool's endpoint loads, by endpoint id."""

    name: str
    endpoints: dict[str, EndpointLoad] = field(default_factory=dict)

    def view(self, now: float, in_flight: Mapping[str, int] | None = None) -> PoolLoadView:
        running = waiting = 0.0
        kv: float | None = None
        fresh = 0
        total: WindowDeltas | None = None
        for ep_id, ep in self.endpoints.items():
            g = ep.gauges(now, None if in_flight is None else in_flight.get(ep_id, 0))
            if g is None:
                continue
            fresh += 1
            running += g.running
            waiting += g.waiting
            if g.kv_usage is not None:
                kv = g.kv_usage if kv is None else max(kv, g.kv_usage)
            d = ep.deltas(now)
            if d is not None:
                total = d if total is None else total + d
        return PoolLoadView(
            pool=self.name,
            endpoints=len(self.endpoints),
            fresh_endpoints=fresh,
            running=running if fresh else None,
            waiting=waiting if fresh else None,
            kv_usage=kv,
            acceptance=None if total is None else total.acceptance(),
            tpot_mean_s=None if total is None else total.tpot_mean_s,
            generation_tokens_per_s=None if total is None else total.generation_tokens_per_s,
            output_tokens_mean=None if total is None else total.output_tokens_mean,
        )
