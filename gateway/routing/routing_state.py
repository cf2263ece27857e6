"""The live route state of every controlled traffic class: one ``Controller`` per class with a controller (its own
``controller:`` block, else ``defaults.controller``; never for a class with ``route.pin``).

Owned by the ``Runtime``; fed once per scrape round (``on_scrape_round``, called by the scraper's round hook) and
read on the hot path (``state_for_request``: one dict lookup and one integer increment).

Per controlled class and round it builds one ``Observation`` of the class's two candidate pools (its home,
``route.preferred``, and the first pool of the other kind among route.saturated, route.fallback, then all pools:
``RoutingRules.controller_pools``):

- samples: the class's requests routed in the last ``controller.window_s`` (counted by ``choose``, differenced
  against per-round snapshots; a cluster's leader adds the other replicas'), or all of them since the class's share
  last changed when that is more: a class too sparse to reach ``min_samples`` in one window (a minority class at
  low load, exactly when speculation pays most) still gets a decision once it has that many requests;
- the class's expected completion time on each pool (``gateway.routing.estimate``: queue, first step, output
  tokens x the class's time per token there), queue and batch from the scraped ``PoolLoadView``\\ s, averaged over
  the fresh rounds of the window (one scrape of a queue is noise); a pool without a TPOT measurement in the scrape
  window (idle: no request finished) uses its last measured TPOT (and the acceptance it was measured at), else the
  other candidate's, else ``class_track.DEFAULT_TPOT_S``. On the speculative pool the TPOT is rescaled from the pool's
  acceptance to the class's: measured in the window, else its last measured, else a prior: that of the
  temperatures the class's requests carry (a running mean over about its last 20), before any request that of
  its temperature band (``controller.prior_acceptance`` overrides both); without the pool's acceptance it is not
  rescaled;
- acceptance: the class's own rate over the window, Δaccepted / Δdraft tokens of the gateway's per-class counters
  (``specgate_class_draft_tokens`` / ``specgate_class_accepted_draft_tokens``, fed from the responses of
  speculative pools: in practice its speculative candidate's); when the class ran on its speculative pool in the
  window but no response reported its acceptance (vLLM returns none for the Responses API), the pool's scraped rate;
  None while the class drafted nothing in the window (e.g. while it is on the standard pool);
- p95: the end-to-end p95 of the class's successful requests on its speculative pool over the window
  (``latency_p95``, from the gateway's own per-request timings; None without a request there).

Order: a class is outranked on its speculative pool while a speculative-home class there with clearly more
acceptance is partly off it (``gateway.routing.ownership``, from the last round's standings); its observation says so
and its controller takes nothing onto that pool and hands back its share there first.

Probes: while a class's controller says so (``Controller.probe_share``), ``choose`` sends that share of a class
sitting wholly on standard to the speculative pool (``specgate_controller_probes_total{class}``, the
``specgate_class_probe_share`` gauge, a ``controller_probe`` log line and ``on_probe`` (the audit log) when probing
starts or stops).

Every transition, share step and probe change is recorded by ``gateway.routing.route_events`` (metrics, a log
line or the owner's callback: the audit log).
Not thread-safe: the event loop owns it. In cluster mode a follower runs none: it routes on the leader's states and
shares and shows the leader's controller snapshots (``adopt``); without it each process runs its own controllers.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.config.controller import PROBE_CAP
from gateway.config.schema import ControllerConfig, PoolKind, RoutingRules, TrafficClass
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.routing.batch_slope import PoolSpeeds
from gateway.routing.class_track import ClassTrack, Why, class_draft_counts, observe_pools, windowed
from gateway.routing.class_track import ProbeChange as ProbeChange  # re-exported: the audit's input
from gateway.routing.class_track import RouteChoice as RouteChoice  # re-exported: the decision's input
from gateway.routing.controller import Controller, Transition
from gateway.routing.controller_rules import ControllerState
from gateway.routing.estimate import (
    per_token_acceptance,
    prior_rate,
)
from gateway.routing.ownership import outranked, standing_of, visitor_limit, visitor_limits
from gateway.routing.route_events import RouteEvents

SEEN_WEIGHT = 0.05  # weight of one request's temperature in its class's mean: about the last 20 requests


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
        on_probe: Callable[[ProbeChange], object] | None = None,
    ) -> None:
        self._rules = rules
        self._registry = registry
        self._clock = clock
        self._latency_p95 = latency_p95  # (class, pool, since) → p95 seconds
        self._classes: dict[str, ClassTrack] = {}
        self._speeds = PoolSpeeds()  # per pool: last measured TPOT, and what one more running request adds to it
        # On-call class routes (``set_forced``): class → (first pool kind, until: this clock, inf = until removed)
        self._forced: dict[str, tuple[PoolKind, float]] = {}
        # A follower of a cluster routes on the leader's decisions (``adopt``): class → (state, share).
        self._adopted: dict[str, tuple[ControllerState, float]] = {}
        self._adopted_detail: dict[str, dict[str, Any]] = {}  # the leader's controller snapshots of those classes
        self._adopted_probe: dict[str, float] = {}  # and their probe shares
        # The other replicas' cumulative (requests, draft tokens, accepted tokens) per class, added to this
        # process's own in each round (a cluster's leader decides on the whole cluster's samples).
        self.remote_counts: Callable[[], Mapping[str, tuple[float, float, float]]] = dict
        self._events = RouteEvents(registry, on_transition, on_probe)
        self._sync(clock())

    # -- the hot path ----------------------------------------------------------------------------------------

    def state_of(self, class_name: str) -> ControllerState | None:
        """The class's route state; None when the class has no controller."""
        c = self._classes.get(class_name)
        return None if c is None else c.controller.state

    def choose(
        self, class_name: str, rng: random.Random, *, count: bool = True, temperature: float | None = None
    ) -> RouteChoice | None:
        """The pool kind for one request of the class (None: the class has no controller). While the class is
        split, the speculative pool is picked with probability ``share``. ``count``: the request counts toward
        the controller's samples (explain passes False). ``temperature``: the request's (its default applied),
        for the class's prior acceptance until its own is measured."""
        c = self._classes.get(class_name)
        if c is None:
            forced = self._forced.get(class_name)
            if forced is None:
                return None
            kind = forced[0]
            return RouteChoice(kind, kind, 1.0 if kind == "speculative" else 0.0, forced=True)
        if count:
            c.requests += 1
            if temperature is not None:
                a = per_token_acceptance(temperature)
                seen = c.seen_acceptance
                c.seen_acceptance = a if seen is None else seen + (a - seen) * SEEN_WEIGHT
        ctl = c.controller
        adopted = self._adopted.get(class_name)
        probe = c.probe
        if adopted is not None and class_name not in self._forced:
            state, share = adopted
            probe = self._adopted_probe.get(class_name, 0.0)  # the leader's: a cluster probes at one share
        else:
            state, share = ctl.state, ctl.share
        pools = (("speculative", c.spec_pool), ("standard", c.std_pool))
        forced = self._forced.get(class_name)
        if forced is not None:  # an on-call force decides, not the controller's share, probe or guard
            kind = forced[0]
            return RouteChoice(ctl.state, kind, ctl.share, forced=True, why="forced", pools=pools, speeds=c.speeds)
        pick: PoolKind
        pick = ("speculative" if rng.random() < share else "standard") if state == "split" else state
        if pick == "standard" and state == "standard" and probe > 0 and rng.random() < probe:
            if count:
                self._events.probe_sent(class_name)
            return RouteChoice(state, "speculative", share, why="probe", pools=pools, speeds=c.speeds)
        why = _why(ctl, pick)
        limit = c.visitor_limit if why == "spill" else None
        return RouteChoice(
            state, pick, share, why=why, pools=pools, speeds=c.speeds, visitor_limit=limit, away_limit=c.visitor_limit
        )

    # -- a cluster's follower ---------------------------------------------------------------------------------

    def adopt(
        self,
        shares: Mapping[str, tuple[ControllerState, float]],
        details: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Route on another replica's controllers: class → (state, share), for the classes this process controls
        too (an on-call force here still wins). ``details``: that replica's controller snapshots, which
        ``snapshot`` shows for those classes. An empty mapping returns to this process's own controllers."""
        self._adopted = {name: v for name, v in shares.items() if name in self._classes}
        self._adopted_detail = {n: dict(d) for n, d in (details or {}).items() if n in self._adopted}
        self._adopted_probe = {
            n: min(PROBE_CAP, max(0.0, float(p)))  # a corrupt or hostile snapshot never probes more than a YAML may
            for n, d in self._adopted_detail.items()
            if isinstance(p := d.get("probe_share"), int | float) and math.isfinite(p)
        }
        for name, c in self._classes.items():
            state, share = self._adopted.get(name, (c.controller.state, c.controller.share))
            self._events.set_state(name, state, share)

    @property
    def adopted(self) -> bool:
        return bool(self._adopted)

    def local_counts(self) -> dict[str, tuple[float, float, float]]:
        """This process's cumulative (requests, draft tokens, accepted tokens) per controlled class."""
        drafted, accepted = class_draft_counts(self._registry)
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
            self._events.transition(t)
        return t

    # -- the scrape round ------------------------------------------------------------------------------------

    def on_scrape_round(self, now: float, views: Mapping[str, PoolLoadView]) -> list[Transition]:
        """One observation per controlled class from this round's pool views; the transitions it caused."""
        self._sync(now)
        if not self._classes:
            return []
        rules = self._rules()
        spec_pools = {p.name for p in rules.pools if p.kind == "speculative"}
        self._speeds.round(now, views, speculative=spec_pools, window_s=rules.scrape.window_s)
        drafted, accepted = class_draft_counts(self._registry)
        remote = self.remote_counts()
        if self._adopted:  # deciding again (no fresh snapshot to follow): from this process's controllers
            self.adopt({})
        out: list[Transition] = []
        window: dict[str, float] = {}  # each class's requests in its last window (cluster-wide)
        ranks = outranked(
            standing_of(name, c.spec_pool, c.controller, c.estimates[0]) for name, c in self._classes.items()
        )
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
            window[name] = requests - base_requests
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
            if c.moved_at_requests is None:
                c.moved_at_requests = base_requests
            # the window's samples, or all since the last share change when that is more (a sparse class)
            since_move = max(requests - base_requests, requests - c.moved_at_requests)
            obs = observe_pools(
                c,
                self._speeds,
                views.get(c.spec_pool),
                views.get(c.std_pool),
                samples=max(0, round(since_move)),
                acceptance=acceptance,
                p95_s=p95,
                outranked_by=ranks.get(name),
            )
            before = c.controller.share
            t = c.controller.observe(now, windowed(c.fresh, now, cfg.window_s, obs))
            if c.controller.share != before:
                c.moved_at_requests = requests
            if t is not None:
                self._events.transition(t)
                out.append(t)
            elif c.controller.share != before:
                self._events.step(name, before, c.controller)
            self._set_probe(name, c, now)
        # A class without a controller is not counted: it carries traffic as far as anyone knows.
        limits = visitor_limits(rules, lambda cls: window.get(cls, 1.0) > 0)
        for c in self._classes.values():
            c.visitor_limit = limits.get(c.away_pool)
        return out

    def _set_probe(self, name: str, c: ClassTrack, now: float) -> None:
        """Set the class's probe share for the next round (recorded when probing starts or stops)."""
        share = c.controller.probe_share()
        if share != c.probe:
            c.probe = share
            self._events.probe_changed(name, share, now)

    # -- config ----------------------------------------------------------------------------------------------

    def _sync(self, now: float) -> None:
        """Match the controllers to the current rules: a new or changed controller config (or home, or its two
        pools) gets a new controller that keeps the current share; a class that lost its controller or is gone is
        forgotten."""
        rules = self._rules()
        kinds = {p.name: p.kind for p in rules.pools}
        wanted: dict[str, tuple[ControllerConfig, str, str, PoolKind, TrafficClass]] = {}
        for cls in rules.classes:
            cfg = rules.controller_of(cls)
            pair = rules.controller_pools(cls) if cfg is not None else None
            if cfg is None or pair is None:
                continue
            home: PoolKind = "speculative" if kinds.get(cls.route.preferred) == "speculative" else "standard"
            wanted[cls.name] = (cfg, pair[0], pair[1], home, cls)
        for name in set(self._classes) - set(wanted):
            del self._classes[name]
            self._events.forget(name)
        for name, (cfg, spec, std, home, cls) in wanted.items():
            spec_cfg = rules.pool(spec).speculative
            k = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
            prior = cfg.prior_acceptance
            fixed = prior is not None
            if prior is None:
                prior = prior_rate(cls.when.temperature, rules.defaults.temperature, k)
            old = self._classes.get(name)
            if (
                old is not None
                and old.controller.config == cfg
                and old.controller.home == home
                and (old.spec_pool, old.std_pool) == (spec, std)
            ):
                old.k, old.prior, old.prior_fixed = k, prior, fixed
                continue
            # the share carries over a config change, not a change of home (the class starts at its new home)
            share = old.controller.share if old is not None and old.controller.home == home else None
            controller = Controller(name, cfg, initial=home, share=share, now=now, home=home)
            count = old.requests if old is not None else 0
            self._classes[name] = ClassTrack(
                controller, spec, std, now, k=k, prior=prior, requests=count, start_requests=count, prior_fixed=fixed,
                seen_acceptance=None if old is None else old.seen_acceptance,
            )  # fmt: skip
            # until a round has counted the traffic: every class at home there counts
            self._classes[name].visitor_limit = visitor_limit(rules, self._classes[name].away_pool)
            self._events.set_state(name, controller.state, controller.share)
            if name in self._forced:  # a new controller (changed config) keeps the on-call force
                self._force_controller(name, now)

    def expected_s(self, name: str) -> tuple[tuple[str, float], ...]:
        """(pool, expected completion seconds) of class ``name``'s two pools in the last scrape round (traces)."""
        c = self._classes.get(name)
        return () if c is None else tuple((e.pool, e.expected_s) for e in c.estimates if e is not None)

    def snapshot(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Every controlled class's controller state, candidate pools, prior and the last round's expected
        completion times per pool (with their inputs), for /admin/state and explain."""
        out: dict[str, dict[str, Any]] = {}
        for name, c in self._classes.items():
            leader = self._adopted_detail.get(name)
            if leader is not None and name not in self._forced:  # a follower shows what it routes on
                out[name] = {**leader, "source": "cluster_leader"}
                continue
            snap = c.controller.snapshot(now).as_dict()
            snap["speculative_pool"], snap["standard_pool"] = c.spec_pool, c.std_pool
            snap["prior_acceptance"] = c.prior
            snap["estimates"] = {
                e.pool: {**asdict(e), "expected_s": e.expected_s, "cost_s": e.cost_s}
                for e in c.estimates
                if e is not None
            }
            out[name] = snap
        return out


def _why(ctl: Controller, pick: PoolKind) -> Why:
    """Why a controlled class's request drew ``pick`` (not a probe)."""
    if pick == "standard" and (ctl.guard_tripped or ctl.locked):
        return "guard"
    if ctl.forced_until is not None:
        return "forced"
    if ctl.last_reason == "stale" and pick == ctl.safe_kind:
        return "stale"
    return "home" if pick == ctl.home else "spill"
