"""Per-class route-state controller: live measurements → speculative or standard pool, without flapping.

Pure: no I/O, no clock (every call takes ``now``). One ``Controller`` per traffic class with a controller (its
``controller:`` block or ``defaults.controller``; ``ControllerConfig``); the caller feeds it one ``Observation``
per scrape round and sends the class's requests to its speculative candidate pool with probability ``share``, to
the standard one otherwise.

The class does not move as a whole: ``share`` moves in steps of ``share_step``, at most one step per ``window_s``
(so each step's effect on the queues is seen before the next). A step against the previous one's direction is
half as big, down to 1/8 of ``share_step``, so the share homes in on the balance instead of cycling around it; the
third step in a row in one direction is twice as big again, up to ``share_step``, and the first step after
``STEP_MEMORY_WINDOWS`` quiet windows is a full one, so a real change in load is followed quickly. The state is a
label of the share: ``speculative`` (1), ``split`` (between) or ``standard`` (0). Under sustained load the share
settles where the two pools' costs meet (within ``balance_margin``; without it, anywhere within the hysteresis
band), instead of the class alternating between the pools (moving it whole makes the other pool the loaded one).
``share_step: 1`` moves it whole.

The decision is the ordered list of named rules in ``gateway.routing.controller_rules`` (``RULES``: forced,
safe_state, min_samples, guard, balance, limits, order, settled, step, min_hold, cap, take_step); the
controller builds each round's ``Situation``, evaluates them and applies the verdict of the rule that decided
(``ControllerSnapshot.rule``, ``Transition.rule``). The guard: acceptance below ``disable_below`` (vLLM's rate) or,
on the speculative pool, p95 above ``baseline x (1 + latency_regression_pct/100)``, for ``disable_after_windows``
consecutive windows, trips it: the class goes to standard and stays there until no window showed the condition for
``reenable_after_s``; a trip when ``max_reenables_per_day`` re-enables were already used in the last 24 h locks the
class until ``unlock`` / ``force``. The load rules compare the class's costs on its two pools
(``gateway.routing.estimate``) relative to its HOME (``home``: its route.preferred kind; share 1 is home for a
speculative home, 0 for a standard one).

Load steps (``load``, ``load_recovered``, ``reenabled``) wait ``window_s`` after the previous share change; a step
that changes the state (a transition) also waits ``min_hold_s`` after the previous transition and is refused while
``max_changes_per_hour`` automatic transitions happened in the last hour. Safety moves (``stale``,
``acceptance_floor``, ``latency_regression``, ``locked``) go straight to share 0 or 1, at once, and count toward
the cap; with ``safe_state: standard`` every safety move goes to standard, so flapping still needs load moves.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

from gateway.config.schema import ControllerConfig, PoolKind
from gateway.routing.controller_rules import (
    LOAD_REASONS,
    SHARE,
    ControllerState,
    Guard,
    Holding,
    Reason,
    Situation,
    Verdict,
    evaluate,
    label,
    probe_share,
)
from gateway.routing.estimate import Observation

HOUR_S = 3600.0
DAY_S = 86400.0


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of a class's route state: one metric increment, one log line, one audit record."""

    class_name: str
    from_state: ControllerState
    to_state: ControllerState
    reason: Reason
    at: float
    detail: str = ""
    share: float = 0.0  # the speculative share after the transition
    rule: str = ""  # the rule of ``controller_rules.RULES`` that decided it ("on_call" for a force)


@dataclass(frozen=True, slots=True)
class ControllerSnapshot:
    """For /admin/state and explain."""

    class_name: str
    state: ControllerState
    share: float  # of the class's requests sent to the speculative pool first
    since: float  # of the current state
    share_since: float  # of the current share
    last_reason: Reason | None
    holding: Holding | None  # why the last observation changed nothing, if something held it
    guard_tripped: bool
    guard_cause: Reason | None
    locked: bool
    below_floor_windows: int
    latency_windows: int
    guard_clear_since: float | None
    changes_last_hour: int
    reenables_last_day: int
    forced_until: float | None
    exit_ratio: float
    enter_ratio: float
    last_observation: Observation | None
    home: PoolKind = "speculative"  # the class's route.preferred kind: share 1 or 0 is "home"
    acceptance: float | None = None  # the class's last measured acceptance rate (None: never measured)
    probe_share: float = 0.0  # of its requests sent to the speculative pool to measure it (see probe_share())
    rule: str | None = None  # the rule that decided the last observation (controller_rules.RULES)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Controller:
    """The route state of one traffic class. Not thread-safe: one owner calls it (the event loop)."""

    def __init__(
        self,
        class_name: str,
        config: ControllerConfig,
        *,
        initial: ControllerState = "speculative",
        now: float = 0.0,
        baseline_p95_s: float | None = None,
        share: float | None = None,
        home: PoolKind = "speculative",
    ) -> None:
        self.class_name = class_name
        self.home: PoolKind = home
        self.config = config
        self.baseline_p95_s = baseline_p95_s if baseline_p95_s is not None else config.baseline_p95_s
        if share is None:
            share = {"speculative": 1.0, "split": 0.5, "standard": 0.0}[initial]
        self._share = min(1.0, max(0.0, share))
        self._since = now
        self._share_since = now
        self._last_step: float | None = None  # the last automatic share change: steps are window_s apart
        self._step = config.share_step  # the next step's size: halved on a reversal, grown back in one direction
        self._direction = 0  # of the last load step: -1 toward standard, +1 toward speculative
        self._run = 0  # load steps in a row in that direction
        self._last_reason: Reason | None = None
        self._holding: Holding | None = None
        self._rule: str | None = None
        self._changes: deque[float] = deque()  # times of automatic transitions in the last hour
        self._guard = Guard()
        self._forced_until: float | None = None
        self._acceptance: float | None = None  # last measured; scales the margins
        self._last_obs: Observation | None = None
        self._last_now = now

    @property
    def state(self) -> ControllerState:
        return label(self._share)

    @property
    def share(self) -> float:
        """The share of the class's requests sent to the speculative pool first."""
        return self._share

    @property
    def acceptance(self) -> float | None:
        """The class's last measured acceptance rate; None: never measured."""
        return self._acceptance

    @property
    def last_reason(self) -> Reason | None:
        return self._last_reason

    @property
    def locked(self) -> bool:
        return self._guard.locked

    @property
    def guard_tripped(self) -> bool:
        return self._guard.tripped

    @property
    def safe_kind(self) -> PoolKind:
        """Where the class goes while measurements are missing: ``safe_state``, ``home`` resolved."""
        safe = self.config.safe_state
        return self.home if safe == "home" else safe

    def ratios(self) -> tuple[float, float]:
        """(exit ratio, enter ratio): the margins scaled by the class's last measured acceptance."""
        factor = 1.0 + self.config.acceptance_weight * (self._acceptance if self._acceptance is not None else 0.0)
        return self.config.exit_margin * factor, self.config.enter_margin * factor

    # -- the decision ------------------------------------------------------------------------------------------

    def observe(self, now: float, obs: Observation) -> Transition | None:
        """One window's measurements at ``now``: the rules decide; returns the transition it causes, if any."""
        self._last_now, self._last_obs = now, obs
        self._prune(now)
        if obs.acceptance is not None and math.isfinite(obs.acceptance):
            self._acceptance = obs.acceptance
        if self._forced_until is not None and now >= self._forced_until:
            self._forced_until = None
        verdict, self._guard = evaluate(self._situation(now, obs))
        self._rule = verdict.rule
        return self._apply(verdict, now)

    def _situation(self, now: float, obs: Observation) -> Situation:
        return Situation(
            now=now,
            obs=obs,
            config=self.config,
            home=self.home,
            share=self._share,
            since=self._since,
            guard=self._guard,
            forced_until=self._forced_until,
            baseline_p95_s=self.baseline_p95_s,
            acceptance=self._acceptance,
            last_step=self._last_step,
            step=self._step,
            direction=self._direction,
            run=self._run,
            changes_last_hour=len(self._changes),
        )

    def _apply(self, v: Verdict, now: float) -> Transition | None:
        if v.share is None or v.reason is None:  # nothing moves; a guard trip off the pool still names its reason
            if v.reason is not None:
                self._last_reason = v.reason
            self._holding = v.holding
            return None
        p = v.proposal
        if p is not None:  # a load step: remember its size and direction for the next one
            self._step, self._direction, self._run = p.size, p.direction, p.run
        return self._move(v.share, v.reason, now, v.detail, rule=v.rule)

    def probe_share(self) -> float:
        """The share of the class's requests to send to the speculative pool to measure its acceptance
        (``controller_rules.probe_share``, on the last observation and the state now)."""
        obs = self._last_obs
        return probe_share(None if obs is None else self._situation(self._last_now, obs))

    # -- on-call ---------------------------------------------------------------------------------------------

    def force(
        self, state: PoolKind, now: float, reason: Reason = "manual", *, ttl_s: float | None = None
    ) -> Transition | None:
        """Set the state by hand; ``ttl_s``: the controller changes nothing for that long (else min_hold_s applies
        as after any transition). Forcing ``speculative`` is a person re-enabling the class: it clears the guard and
        the lock. Not counted against the change cap."""
        if state == "speculative":
            self._clear_guard()
        self._forced_until = None if ttl_s is None else now + ttl_s
        if state == self.state:
            self._last_reason = reason
            return None
        return self._move(SHARE[state], reason, now, "forced by on-call", automatic=False, rule="on_call")

    def release(self) -> None:
        """End a ``force`` before its TTL (on-call set the class back to ``auto``): the next observation decides."""
        self._forced_until = None

    @property
    def forced_until(self) -> float | None:
        return self._forced_until

    def unlock(self, now: float) -> None:
        """A person re-enables a locked (or tripped) class: guard, lock and re-enable count cleared; the next
        observation decides the state by load as usual."""
        self._last_now = now
        self._clear_guard()

    def _clear_guard(self) -> None:
        self._guard = Guard(window_start=self._guard.window_start)

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def _move(
        self, share: float, reason: Reason, now: float, detail: str, *, automatic: bool = True, rule: str = ""
    ) -> Transition | None:
        """Set the share; a transition when the state changes with it (None: a step within ``split``)."""
        before = self.state
        self._share, self._share_since, self._last_reason, self._holding = share, now, reason, None
        if automatic:
            self._last_step = now
        after = self.state
        if after == "speculative":
            self._guard = replace(self._guard, reenable_pending=False)
        if reason not in LOAD_REASONS:  # after a safety or manual move the next load step is a full one
            self._step, self._direction, self._run = self.config.share_step, 0, 0
        if after == before:
            return None
        self._since = now
        if automatic:
            self._changes.append(now)
        return Transition(self.class_name, before, after, reason, now, detail, share, rule)

    def _prune(self, now: float) -> None:
        while self._changes and self._changes[0] <= now - HOUR_S:
            self._changes.popleft()
        reenables = self._guard.reenables
        if reenables and reenables[0] <= now - DAY_S:
            self._guard = replace(self._guard, reenables=tuple(t for t in reenables if t > now - DAY_S))

    def snapshot(self, now: float | None = None) -> ControllerSnapshot:
        """The controller's state for /admin/state and explain (counters as of ``now``, else the last call)."""
        at = self._last_now if now is None else now
        g = self._guard
        exit_ratio, enter_ratio = self.ratios()
        return ControllerSnapshot(
            class_name=self.class_name,
            state=self.state,
            share=self._share,
            since=self._since,
            share_since=self._share_since,
            last_reason=self._last_reason,
            holding=self._holding,
            guard_tripped=g.tripped,
            guard_cause=g.cause,
            locked=g.locked,
            below_floor_windows=g.below_floor,
            latency_windows=g.latency_high,
            guard_clear_since=g.clear_since,
            changes_last_hour=sum(1 for t in self._changes if t > at - HOUR_S),
            reenables_last_day=sum(1 for t in g.reenables if t > at - DAY_S),
            forced_until=self._forced_until,
            exit_ratio=exit_ratio,
            enter_ratio=enter_ratio,
            last_observation=self._last_obs,
            home=self.home,
            acceptance=self._acceptance,
            probe_share=self.probe_share(),
            rule=self._rule,
        )
