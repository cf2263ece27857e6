"""The live route state of every controlled traffic class: one ``Controller`` per class with a ``controller:`` block.

Owned by the ``Runtime``; fed once per scrape round (``on_scrape_round``, called by the scraper's round hook) and
read on the hot path (``state_for_request``: one dict lookup and one integer increment).

Per controlled class and round it builds one ``Observation`` of the class's two candidate pools (the speculative
and the standard one among ``route.preferred`` / ``route.saturated``; the loader checks there is one of each):

- samples: the class's requests routed by this process in the last ``controller.window_s`` (counted by
  ``state_for_request``, differenced against per-round snapshots);
- expected delays, queue and batch from the scraped ``PoolLoadView``\\ s, averaged over the fresh rounds of the
  window (one scrape of a queue is noise); a pool without a TPOT measurement in
  the scrape window (idle: no request finished) uses its last measured TPOT, else the other candidate's, else
  ``DEFAULT_TPOT_S``;
- acceptance: the class's own rate over the window, Δaccepted / Δdraft tokens of the gateway's per-class counters
  (``specgate_class_draft_tokens`` / ``specgate_class_accepted_draft_tokens``, fed from the responses of
  speculative pools); when the class ran on its speculative pool in the window but no response reported its
  acceptance (vLLM returns none for the Responses API), the pool's scraped rate; None while the class drafted
  nothing in the window (e.g. while it is on the standard pool);
- p95: the end-to-end p95 of the class's successful requests on its speculative pool over the window
  (``latency_p95``, from the gateway's own per-request timings; None without a request there).

Every transition increments ``specgate_controller_transitions_total{class,from,to,reason}``, moves the
``specgate_class_route_state{class,state}`` gauge, logs one JSON line on the ``specgate.controller`` logger and
goes to ``on_transition`` (the audit log). A share step within ``split`` moves ``specgate_class_speculative_share``
and logs a ``controller_step`` line.
Not thread-safe: the event loop owns it. With several workers each process runs its own controllers.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.config.schema import ControllerConfig, PoolKind, RoutingRules
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.routing.controller import Controller, Observation, RouteState, Transition

logger = logging.getLogger("specgate.controller")

DEFAULT_TPOT_S = 0.03  # a 70B model's time per output token when neither candidate pool has a measurement
STATES: tuple[RouteState, ...] = ("speculative", "split", "standard")
DRAFT_TOKENS = "specgate_class_draft_tokens"
ACCEPTED_TOKENS = "specgate_class_accepted_draft_tokens"


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """The controller's answer for one request of a class."""

    state: RouteState  # the class's route state: speculative | split | standard
    pick: PoolKind  # this request's first pool kind (drawn with probability ``share`` while split)
    share: float  # the class's share of requests sent to the speculative pool first
    forced: bool = False  # an on-call class route on a class without a controller (``set_forced``)


@dataclass(slots=True)
class _Class:
    """One controlled class: its controller, its candidate pools and its window counters."""

    controller: Controller
    spec_pool: str
    std_pool: str
    since: float  # when this controller was made: the first window's base
    requests: int = 0  # cumulative, bumped per routed request
    start_requests: int = 0  # ``requests`` when this controller was made
    # (time, requests, draft tokens, accepted tokens) at each round, oldest first; the first one is the window base
    history: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    # (time, observation) of the fresh rounds in the window: the controller sees their mean, not one noisy scrape
    fresh: deque[tuple[float, Observation]] = field(default_factory=deque)


def _windowed(fresh: deque[tuple[float, Observation]], now: float, window_s: float, obs: Observation) -> Observation:
    """``obs`` with its delays, queue and batch averaged over the fresh rounds of the last ``window_s``: one
    scrape of a queue under Poisson arrivals is noise, and a decision on it flaps. A stale or incomplete round
    passes as it is (the controller reacts to missing data at once) and empties the window."""
    if obs.stale or obs.spec_delay_s is None or obs.alt_delay_s is None:
        fresh.clear()
        return obs
    fresh.append((now, obs))
    while fresh and fresh[0][0] <= now - window_s:
        fresh.popleft()
    rounds = [o for _, o in fresh]

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    return replace(
        obs,
        spec_delay_s=mean([o.spec_delay_s for o in rounds]),
        alt_delay_s=mean([o.alt_delay_s for o in rounds]),
        spec_queue=mean([o.spec_queue for o in rounds]) if obs.spec_queue is not None else None,
        spec_batch=mean([o.spec_batch for o in rounds]) if obs.spec_batch is not None else None,
    )


def candidates(rules: RoutingRules, class_name: str) -> tuple[str, str] | None:
    """(speculative pool, standard pool) of a class among route.preferred / route.saturated, if one of each."""
    kinds = {p.name: p.kind for p in rules.pools}
    for cls in rules.classes:
        if cls.name != class_name:
            continue
        names = [cls.route.preferred] if cls.route.saturated is None else [cls.route.preferred, cls.route.saturated]
        by_kind = {kinds.get(n): n for n in names}
        spec, std = by_kind.get("speculative"), by_kind.get("standard")
        return (spec, std) if spec is not None and std is not None and len(names) == 2 else None
    return None


class RoutingState:
    """Every controlled class's ``Controller``, fed by the scrape rounds, with its metrics and log lines."""

    def __init__(
        self,
        rules: Callable[[], RoutingRules],
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
        latency_p95: Callable[[str, str, float], float | None] | None = None,
        on_transition: Callable[[Transition], object] | None = None,
    ) -> None:
        self._rules = rules
        self._registry = registry
        self._clock = clock
        self._latency_p95 = latency_p95  # (class, pool, since) → p95 seconds
        self._on_transition = on_transition
        self._classes: dict[str, _Class] = {}
        self._last_tpot: dict[str, float] = {}  # per pool: the last TPOT measured, for while it idles
        # On-call class routes (``set_forced``): class → (first pool kind, until: this clock, inf = until removed)
        self._forced: dict[str, tuple[PoolKind, float]] = {}
        # A follower of a cluster routes on the leader's decisions (``adopt``): class → (state, share).
        self._adopted: dict[str, tuple[RouteState, float]] = {}
        # The other replicas' cumulative (requests, draft tokens, accepted tokens) per class, added to this
        # process's own in each round (a cluster's leader decides on the whole cluster's samples).
        self.remote_counts: Callable[[], Mapping[str, tuple[float, float, float]]] = dict
        self.transitions = Counter(
            "specgate_controller_transitions_total",
            "Route-state changes of a traffic class's controller, by reason.",
            ["class", "from", "to", "reason"],
            registry=registry,
        )
        # Every worker runs its own controllers: the merge shows 1 for a state while any live worker has it.
        self.route_state = Gauge(
            "specgate_class_route_state",
            "1 for the traffic class's current route state (speculative, split or standard), 0 for the others.",
            ["class", "state"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.share = Gauge(
            "specgate_class_speculative_share",
            "Share of the traffic class's requests the controller sends to the speculative pool first.",
            ["class"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self._sync(clock())

    # -- the hot path ----------------------------------------------------------------------------------------

    def state_of(self, class_name: str) -> RouteState | None:
        """The class's route state; None when the class has no controller."""
        c = self._classes.get(class_name)
        return None if c is None else c.controller.state

    def choose(self, class_name: str, rng: random.Random, *, count: bool = True) -> RouteChoice | None:
        """The pool kind for one request of the class (None: the class has no controller). While the class is
        split, the speculative pool is picked with probability ``share``. ``count``: the request counts toward
        the controller's samples (explain passes False)."""
        c = self._classes.get(class_name)
        if c is None:
            forced = self._forced.get(class_name)
            if forced is None:
                return None
            kind = forced[0]
            return RouteChoice(kind, kind, 1.0 if kind == "speculative" else 0.0, forced=True)
        if count:
            c.requests += 1
        ctl = c.controller
        adopted = self._adopted.get(class_name)
        if adopted is not None and class_name not in self._forced:
            state, share = adopted
        else:
            state, share = ctl.state, ctl.share
        pick: PoolKind
        pick = ("speculative" if rng.random() < share else "standard") if state == "split" else state
        return RouteChoice(state, pick, share)

    # -- a cluster's follower ---------------------------------------------------------------------------------

    def adopt(self, shares: Mapping[str, tuple[RouteState, float]]) -> None:
        """Route on another replica's controllers: class → (state, share), for the classes this process controls
        too (an on-call force here still wins). An empty mapping returns to this process's own controllers."""
        self._adopted = {name: v for name, v in shares.items() if name in self._classes}
        for name, c in self._classes.items():
            state, share = self._adopted.get(name, (c.controller.state, c.controller.share))
            self._set_gauge(name, state, share)

    @property
    def adopted(self) -> bool:
        return bool(self._adopted)

    def local_counts(self) -> dict[str, tuple[float, float, float]]:
        """This process's cumulative (requests, draft tokens, accepted tokens) per controlled class."""
        drafted, accepted = self._class_draft_counts()
        return {
            name: (float(c.requests), drafted.get(name, 0.0), accepted.get(name, 0.0))
            for name, c in self._classes.items()
        }

    # -- on-call class routes --------------------------------------------------------------------------------

    def set_forced(self, forced: Mapping[str, tuple[PoolKind, float | None]]) -> list[Transition]:
        """Replace the on-call class routes: class → (first pool kind, ttl_s; None: until removed). A controlled
        class's controller is forced (``Controller.force`` with the TTL: it changes nothing meanwhile); a class
        without one gets a forced ``RouteChoice`` from ``choose`` (``plan_route(forced=True)`` orders its route's
        pools by kind). A class no longer listed is released: its controller (or its route) decides again.
        Returns the transitions the forces caused (recorded like the controller's own)."""
        now = self._clock()
        self._sync(now)
        for name in self._forced.keys() - forced.keys():
            c = self._classes.get(name)
            if c is not None:
                c.controller.release()
        self._forced = {
            name: (kind, math.inf if ttl_s is None else now + max(0.0, ttl_s)) for name, (kind, ttl_s) in forced.items()
        }
        out: list[Transition] = []
        for name in self._forced:
            t = self._force_controller(name, now)
            if t is not None:
                out.append(t)
        return out

    def forced(self) -> dict[str, PoolKind]:
        """The on-call class routes in force: class → first pool kind."""
        return {name: kind for name, (kind, _) in self._forced.items()}

    def _force_controller(self, name: str, now: float) -> Transition | None:
        c, forced = self._classes.get(name), self._forced.get(name)
        if c is None or forced is None:
            return None
        kind, until = forced
        if until <= now:  # over: the override component removes it on its next tick
            return None
        t = c.controller.force(kind, now, ttl_s=until - now if math.isfinite(until) else math.inf)
        if t is not None:
            self._record(t)
        return t

    # -- the scrape round ------------------------------------------------------------------------------------

    def on_scrape_round(self, now: float, views: Mapping[str, PoolLoadView]) -> list[Transition]:
        """One observation per controlled class from this round's pool views; the transitions it caused."""
        self._sync(now)
        if not self._classes:
            return []
        drafted, accepted = self._class_draft_counts()
        remote = self.remote_counts()
        if self._adopted:  # deciding again (no fresh snapshot to follow): from this process's controllers
            self.adopt({})
        out: list[Transition] = []
        for name, c in self._classes.items():
            cfg = c.controller.config
            r_req, r_drafted, r_accepted = remote.get(name, (0.0, 0.0, 0.0))
            requests = c.requests + r_req
            n_drafted, n_accepted = drafted.get(name, 0.0) + r_drafted, accepted.get(name, 0.0) + r_accepted
            if not c.history:  # the first round: requests count from the controller's start, drafts from now
                c.history.append((c.since, c.start_requests + r_req, n_drafted, n_accepted))
            c.history.append((now, requests, n_drafted, n_accepted))
            while len(c.history) > 1 and c.history[1][0] <= now - cfg.window_s:
                c.history.popleft()
            _, base_requests, base_drafted, base_accepted = c.history[0]
            # Other replicas' totals move when one joins or leaves: a window never counts less than nothing.
            d_drafted = n_drafted - base_drafted
            d_accepted = max(0.0, min(d_drafted, n_accepted - base_accepted))
            acceptance = d_accepted / d_drafted if d_drafted > 0 else None
            p95 = None if self._latency_p95 is None else self._latency_p95(name, c.spec_pool, now - cfg.window_s)
            if acceptance is None and p95 is not None:
                # It ran on its speculative pool, yet nothing reported per-request acceptance (the Responses API, or
                # vLLM without --per-request-spec-decode-metrics): the pool's counters stand in for the class's.
                spec_view = views.get(c.spec_pool)
                if spec_view is not None and spec_view.acceptance is not None:
                    acceptance = spec_view.acceptance.rate
            obs = self._observation(
                views.get(c.spec_pool),
                views.get(c.std_pool),
                samples=max(0, round(requests - base_requests)),
                acceptance=acceptance,
                p95_s=p95,
            )
            before = c.controller.share
            t = c.controller.observe(now, _windowed(c.fresh, now, cfg.window_s, obs))
            if t is not None:
                self._record(t)
                out.append(t)
            elif c.controller.share != before:
                self._step(name, before, c.controller)
        return out

    def _observation(
        self,
        spec: PoolLoadView | None,
        std: PoolLoadView | None,
        *,
        samples: int,
        acceptance: float | None,
        p95_s: float | None,
    ) -> Observation:
        if spec is None or std is None:  # not scraped yet: unknown, never 0
            return Observation(
                samples=samples, spec_delay_s=None, alt_delay_s=None, acceptance=acceptance, p95_s=p95_s, stale=True
            )
        spec_tpot, std_tpot = self._tpot(spec), self._tpot(std)
        # An idle pool has no TPOT in the scrape window: its last measured one (an idle pool is not slower than it
        # was under load), else the other candidate's, else the default.
        spec = replace(spec, tpot_mean_s=spec_tpot if spec_tpot is not None else std_tpot)
        std = replace(std, tpot_mean_s=std_tpot if std_tpot is not None else spec_tpot)
        return Observation.from_views(
            spec, std, samples=samples, tpot_fallback_s=DEFAULT_TPOT_S, acceptance=acceptance, p95_s=p95_s
        )

    def _tpot(self, view: PoolLoadView) -> float | None:
        """The pool's TPOT over the scrape window, else the last one measured (remembered per pool)."""
        t = view.tpot_mean_s
        if t is not None and t > 0 and math.isfinite(t):
            self._last_tpot[view.pool] = t
            return t
        return self._last_tpot.get(view.pool)

    def _class_draft_counts(self) -> tuple[dict[str, float], dict[str, float]]:
        """Cumulative draft and accepted tokens per class, from the gateway's per-class counters (this process)."""
        drafted: dict[str, float] = {}
        accepted: dict[str, float] = {}
        targets = {DRAFT_TOKENS + "_total": drafted, ACCEPTED_TOKENS + "_total": accepted}
        for family in self._registry.restricted_registry(list(targets)).collect():
            for sample in family.samples:
                into = targets.get(sample.name)
                cls = sample.labels.get("class")
                if into is not None and cls is not None:
                    into[cls] = into.get(cls, 0.0) + sample.value
        return drafted, accepted

    def _record(self, t: Transition) -> None:
        self.transitions.labels(t.class_name, t.from_state, t.to_state, t.reason).inc()
        self._set_gauge(t.class_name, t.to_state, t.share)
        line = {
            "event": "controller_transition",
            "class": t.class_name,
            "from": t.from_state,
            "to": t.to_state,
            "reason": t.reason,
            "share": t.share,
            "at": t.at,
            "detail": t.detail,
        }
        logger.info(orjson.dumps(line).decode())
        if self._on_transition is not None:
            self._on_transition(t)

    def _step(self, class_name: str, before: float, controller: Controller) -> None:
        """A share step within ``split``: the share gauge and a log line (not a transition)."""
        self.share.labels(class_name).set(controller.share)
        snap = controller.snapshot()
        line = {
            "event": "controller_step",
            "class": class_name,
            "share_from": before,
            "share": controller.share,
            "reason": snap.last_reason,
            "at": snap.share_since,
        }
        logger.info(orjson.dumps(line).decode())

    def _set_gauge(self, class_name: str, state: RouteState, share: float) -> None:
        for s in STATES:
            self.route_state.labels(class_name, s).set(1 if s == state else 0)
        self.share.labels(class_name).set(share)

    # -- config ----------------------------------------------------------------------------------------------

    def _sync(self, now: float) -> None:
        """Match the controllers to the current rules: a new or changed ``controller:`` block gets a new controller
        (a changed one keeps the current state); a class that lost its block or is gone is forgotten."""
        rules = self._rules()
        kinds = {p.name: p.kind for p in rules.pools}
        wanted: dict[str, tuple[ControllerConfig, str, str, RouteState]] = {}
        for cls in rules.classes:
            pair = candidates(rules, cls.name) if cls.controller is not None else None
            if cls.controller is None or pair is None:
                continue
            home: RouteState = "speculative" if kinds.get(cls.route.preferred) == "speculative" else "standard"
            wanted[cls.name] = (cls.controller, pair[0], pair[1], home)
        for name in set(self._classes) - set(wanted):
            del self._classes[name]
            for s in STATES:
                self.route_state.remove(name, s)
            self.share.remove(name)
        for name, (cfg, spec, std, home) in wanted.items():
            old = self._classes.get(name)
            if old is not None and old.controller.config == cfg and (old.spec_pool, old.std_pool) == (spec, std):
                continue
            share = old.controller.share if old is not None else None
            controller = Controller(name, cfg, initial=home, share=share, now=now)
            count = old.requests if old is not None else 0
            self._classes[name] = _Class(controller, spec, std, now, requests=count, start_requests=count)
            self._set_gauge(name, controller.state, controller.share)
            if name in self._forced:  # a new controller (changed config) keeps the on-call force
                self._force_controller(name, now)

    def snapshot(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Every controlled class's controller state and candidate pools, for /admin/state and explain."""
        out: dict[str, dict[str, Any]] = {}
        for name, c in self._classes.items():
            snap = c.controller.snapshot(now).as_dict()
            snap["speculative_pool"], snap["standard_pool"] = c.spec_pool, c.std_pool
            out[name] = snap
        return out
