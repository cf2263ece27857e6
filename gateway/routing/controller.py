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

Decision order in ``observe`` (the first that applies wins; 6 overrides the direction 5 chose):

1. forced by on-call (``force`` with a TTL): no change.
2. stale or missing data (a stale pool, no delay estimate, a queue/batch limit without its number) → the configured
   ``safe_state`` (``standard`` while the guard is tripped or locked), reason ``stale``. Never read as 0.
3. fewer than ``min_samples`` → no decision (``holding == "min_samples"``).
4. the fallback guard, counted once per ``window_s``: acceptance below ``disable_below`` (vLLM's rate) or, on the
   speculative pool, p95 above ``baseline x (1 + latency_regression_pct/100)``, for ``disable_after_windows``
   consecutive windows, trips it: the class goes to standard (``acceptance_floor`` / ``latency_regression``) and
   stays there until no window showed the condition for ``reenable_after_s`` (a window without the measurement
   does not show it, so on the standard pool this is a timed retry). A trip when ``max_reenables_per_day``
   re-enables were already used in the last 24 h locks the class (reason ``locked``) until ``unlock`` / ``force``.
5. load, with hysteresis, on the class's expected completion times (``gateway.routing.estimate``), relative to
   its HOME (``home``: its route.preferred kind; share 1 is home for a speculative home, 0 for a standard one): one
   step away from home when home's time > the other pool's x exit ratio; one step back when home's < the other's
   x enter ratio; in between nothing changes, so with equal times a class at home stays home. A share already
   away from home (with ``balance_margin`` and ``share_step`` < 1) moves on toward the pool that is cheaper by more
   than ``balance_margin``, both ways, instead of the enter ratio. A step onto the
   speculative pool also needs queue/batch within the enter limits; above an exit limit a share leaves it when
   the standard pool is faster (never onto a slower pool). The speculative time is divided by
   ``1 + acceptance_weight x acceptance`` (the class's last measured rate; none measured: 1) first.
   Away steps are ``load``, home steps ``load_recovered`` (``reenabled`` for the first step onto speculative
   after the guard cleared).
6. the order of the classes on a speculative pool (``Observation.outranked_by``, set by the routing state from
   ``gateway.routing.order``): while a class with clearly more acceptance there is partly off it, this class
   takes no share onto it (``holding == "order"``) and steps off it whatever its own costs say, so the pool
   goes to the classes that gain most from it instead of two classes swapping places.

While the class has never had its acceptance measured and sits wholly on standard, ``probe_share()`` sends a small
capped share to the speculative pool (only with headroom there) so that its estimate rests on measurement.

Load steps (``load``, ``load_recovered``, ``reenabled``) wait ``window_s`` after the previous share change; a step
that changes the state (a transition) also waits ``min_hold_s`` after the previous transition and is refused while
``max_changes_per_hour`` automatic transitions happened in the last hour. Safety moves (``stale``,
``acceptance_floor``, ``latency_regression``, ``locked``) go straight to share 0 or 1, at once, and count toward
the cap; with ``safe_state: standard`` every safety move goes to standard, so flapping still needs load moves.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from gateway.config.schema import ControllerConfig, PoolKind
from gateway.routing.estimate import DEFAULT_OUTPUT_TOKENS as DEFAULT_OUTPUT_TOKENS
from gateway.routing.estimate import Observation as Observation
from gateway.routing.estimate import expected_delay as expected_delay

RouteState = Literal["speculative", "split", "standard"]
Reason = Literal[
    "min_samples",
    "load",
    "load_recovered",
    "stale",
    "acceptance_floor",
    "latency_regression",
    "reenabled",
    "locked",
    "manual",
]
REASONS: tuple[Reason, ...] = get_args(Reason)
SAFETY_REASONS: frozenset[Reason] = frozenset({"stale", "acceptance_floor", "latency_regression", "locked"})
LOAD_REASONS: frozenset[Reason] = frozenset({"load", "load_recovered", "reenabled"})
Holding = Literal["forced", "stale", "min_samples", "locked", "guard", "hold", "cap", "step", "order"]
HOUR_S = 3600.0
DAY_S = 86400.0
STEP_MEMORY_WINDOWS = 10  # a load step this many windows after the last one starts again with a full step


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of a class's route state: one metric increment, one log line, one audit record."""

    class_name: str
    from_state: RouteState
    to_state: RouteState
    reason: Reason
    at: float
    detail: str = ""
    share: float = 0.0  # the speculative share after the transition


@dataclass(frozen=True, slots=True)
class ControllerSnapshot:
    """For /admin/state and explain."""

    class_name: str
    state: RouteState
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Guard:
    tripped: bool = False
    locked: bool = False
    cause: Reason | None = None
    below_floor: int = 0
    latency_high: int = 0
    window_start: float | None = None
    clear_since: float | None = None
    reenable_pending: bool = False
    reenables: deque[float] = field(default_factory=deque)


class Controller:
    """The route state of one traffic class. Not thread-safe: one owner calls it (the event loop)."""

    def __init__(
        self,
        class_name: str,
        config: ControllerConfig,
        *,
        initial: RouteState = "speculative",
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
        self._changes: deque[float] = deque()  # times of automatic transitions in the last hour
        self._guard = _Guard()
        self._forced_until: float | None = None
        self._acceptance: float | None = None  # last measured; scales the margins
        self._last_obs: Observation | None = None
        self._last_now = now

    @property
    def state(self) -> RouteState:
        return _label(self._share)

    @property
    def share(self) -> float:
        """The share of the class's requests sent to the speculative pool first."""
        return self._share

    @property
    def _state(self) -> RouteState:
        return _label(self._share)

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
        """One window's measurements at ``now``; returns the transition it causes, if any."""
        self._last_now, self._last_obs = now, obs
        self._prune(now)
        if obs.acceptance is not None and math.isfinite(obs.acceptance):
            self._acceptance = obs.acceptance
        if self._forced_until is not None and now < self._forced_until:
            return self._hold("forced")
        self._forced_until = None
        if self._missing(obs):
            g = self._guard
            if g.tripped:
                g.clear_since = now  # clearance needs reenable_after_s of fresh windows
            target: PoolKind = "standard" if g.tripped or g.locked else self.safe_kind
            if target != self._state:
                return self._move(_SHARE[target], "stale", now, "measurements missing or stale")
            return self._hold("stale")
        if obs.samples < self.config.min_samples:
            return self._hold("min_samples")
        tripped = self._guard_window(now, obs)
        if tripped is not None:
            return tripped
        if self._guard.locked:
            return self._hold("locked")
        if self._guard.tripped:
            return self._hold("guard")
        return self._load_decision(now, obs)

    def _missing(self, obs: Observation) -> bool:
        c = self.config
        return (
            obs.stale
            or not _finite(obs.spec_delay_s)
            or not _finite(obs.alt_delay_s)
            or (c.max_queue_exit is not None and not _finite(obs.spec_queue))
            or (c.max_batch_exit is not None and not _finite(obs.spec_batch))
        )

    def _guard_window(self, now: float, obs: Observation) -> Transition | None:
        """Count one guard window per ``window_s``; trip, lock or clear the guard. A trip's transition, if any."""
        c, g = self.config, self._guard
        if g.window_start is None:
            g.window_start = now
        if now - g.window_start < c.window_s:
            return None
        g.window_start = now
        acc_bad: bool | None = None
        if c.disable_below is not None and obs.acceptance is not None:
            acc_bad = obs.acceptance < c.disable_below
            g.below_floor = g.below_floor + 1 if acc_bad else 0
        lat_bad: bool | None = None
        if (
            c.latency_regression_pct is not None
            and self.baseline_p95_s is not None
            and obs.p95_s is not None
            and self._share > 0
        ):
            lat_bad = obs.p95_s > self.baseline_p95_s * (1.0 + c.latency_regression_pct / 100.0)
            g.latency_high = g.latency_high + 1 if lat_bad else 0
        if g.locked:
            return None
        if g.tripped:
            if acc_bad or lat_bad or g.clear_since is None:
                g.clear_since = now
            elif now - g.clear_since >= c.reenable_after_s:
                g.tripped, g.clear_since, g.reenable_pending = False, None, True
                g.reenables.append(now)
            return None
        if g.below_floor < c.disable_after_windows and g.latency_high < c.disable_after_windows:
            return None
        cause: Reason = "acceptance_floor" if g.below_floor >= c.disable_after_windows else "latency_regression"
        detail = f"{cause} for {c.disable_after_windows} windows"
        g.tripped, g.cause, g.clear_since, g.below_floor, g.latency_high = True, cause, now, 0, 0
        reason: Reason = cause
        if len(g.reenables) >= c.max_reenables_per_day:
            g.locked, reason = True, "locked"
            detail += f"; {len(g.reenables)} re-enables in 24 h: locked until a person unlocks it"
        if self._share > 0:
            return self._move(0.0, reason, now, detail)
        self._last_reason = reason
        return self._hold("locked" if g.locked else "guard")

    def _load_decision(self, now: float, obs: Observation) -> Transition | None:
        c = self.config
        spec, alt = obs.spec_delay_s, obs.alt_delay_s
        if spec is None or alt is None:  # _missing checked them; for the type checker
            return self._hold("stale")
        exit_ratio, enter_ratio = self.ratios()
        factor = exit_ratio / c.exit_margin  # the acceptance bonus (1 without one)
        over = _over(obs.spec_queue, c.max_queue_exit) or _over(obs.spec_batch, c.max_batch_exit)
        within = not _over(obs.spec_queue, c.max_queue_enter) and not _over(obs.spec_batch, c.max_batch_enter)
        # Leaving home takes exit_margin; a share already away balances within balance_margin both ways.
        balance = c.balance_margin if c.balance_margin is not None and c.share_step < 1 else None
        at_home = self._share == (1.0 if self.home == "speculative" else 0.0)
        direction = 0
        detail = ""
        if self.home == "speculative":
            away, back = exit_ratio, enter_ratio
            if balance is not None and not at_home:
                away, back = balance * factor, factor / balance
            if self._share > 0:
                if spec > alt * away:
                    direction, detail = -1, f"cost {spec:.3g}s > {away:.3g} x standard {alt:.3g}s"
                elif over and alt < spec:
                    direction, detail = -1, f"over queue/batch limit and standard faster ({alt:.3g}s < {spec:.3g}s)"
            if direction == 0 and self._share < 1 and spec < alt * back and within:
                direction, detail = 1, f"cost {spec:.3g}s < {back:.3g} x standard {alt:.3g}s"
        else:  # standard home: the same band, mirrored (the acceptance bonus still favours speculation)
            away, back = c.exit_margin, c.enter_margin
            if balance is not None and not at_home:
                away, back = balance, 1 / balance
            if self._share > 0:
                if alt < spec / factor * back:
                    direction = -1
                    detail = f"standard {alt:.3g}s < {back:.3g} x speculative {spec / factor:.3g}s: home"
                elif over and alt < spec:
                    direction, detail = -1, f"over queue/batch limit and standard faster ({alt:.3g}s < {spec:.3g}s)"
            if direction == 0 and self._share < 1 and alt > spec / factor * away and within:
                direction = 1
                detail = f"standard {alt:.3g}s > {away:.3g} x speculative {spec / factor:.3g}s: cheaper there"
        yielding = False
        if obs.outranked_by is not None:  # the speculative pool goes to the classes that gain most there first
            if self._share > 0:
                direction, yielding = -1, True
                detail = f"yields the speculative pool to {obs.outranked_by} (more acceptance, partly off it)"
            elif direction > 0:
                return self._hold("order")
        if direction == 0:
            self._holding = None
            return None
        fresh = self._last_step is None or now - self._last_step > STEP_MEMORY_WINDOWS * c.window_s
        if self._direction == 0 or fresh or c.share_step >= 1.0 or yielding:  # whole-class moves, a yield: full
            size, run = c.share_step, 1
        elif direction != self._direction:
            size, run = max(self._step / 2, c.share_step / 8), 1
        else:
            run = self._run + 1
            size = min(self._step * 2, c.share_step) if run >= 3 else self._step
        target = _clamp(self._share + direction * size)
        if self._last_step is not None and now - self._last_step < c.window_s:
            return self._hold("step")
        if _label(target) != self._state:
            if now - self._since < c.min_hold_s:
                return self._hold("hold")
            if len(self._changes) >= c.max_changes_per_hour:
                return self._hold("cap")
        toward_home = direction == (1 if self.home == "speculative" else -1)
        reason: Reason = "load_recovered" if toward_home else "load"
        if direction > 0 and self._guard.reenable_pending:
            reason = "reenabled"
        self._step, self._direction, self._run = size, direction, run
        return self._move(target, reason, now, detail)

    def probe_share(self) -> float:
        """The share of the class's requests to send to the speculative pool to measure its acceptance: the
        configured ``probe_share`` while the class has never had its acceptance measured, sits wholly on the
        standard pool, is neither forced nor held off by the guard, and the last (fresh) observation shows
        headroom on the speculative pool (less than one request waiting per endpoint, batch within
        ``max_batch_enter``); else 0."""
        c, g, obs = self.config, self._guard, self._last_obs
        if c.probe_share <= 0 or self._acceptance is not None or self._share > 0 or g.tripped or g.locked:
            return 0.0
        if self._forced_until is not None and self._last_now < self._forced_until:
            return 0.0
        if obs is None or self._missing(obs) or obs.spec_queue is None or obs.spec_queue >= 1.0:
            return 0.0
        return 0.0 if _over(obs.spec_batch, c.max_batch_enter) else c.probe_share

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
        if state == self._state:
            self._last_reason = reason
            return None
        return self._move(_SHARE[state], reason, now, "forced by on-call", automatic=False)

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
        self._guard = _Guard(window_start=self._guard.window_start)

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def _move(
        self, share: float, reason: Reason, now: float, detail: str, *, automatic: bool = True
    ) -> Transition | None:
        """Set the share; a transition when the state changes with it (None: a step within ``split``)."""
        before = self._state
        self._share, self._share_since, self._last_reason, self._holding = share, now, reason, None
        if automatic:
            self._last_step = now
        after = self._state
        if after == "speculative":
            self._guard.reenable_pending = False
        if reason not in LOAD_REASONS:  # after a safety or manual move the next load step is a full one
            self._step, self._direction, self._run = self.config.share_step, 0, 0
        if after == before:
            return None
        self._since = now
        if automatic:
            self._changes.append(now)
        return Transition(self.class_name, before, after, reason, now, detail, share)

    def _hold(self, why: Holding) -> Transition | None:
        """Nothing changes; remember why (snapshot ``holding``)."""
        self._holding = why
        return None

    def _prune(self, now: float) -> None:
        while self._changes and self._changes[0] <= now - HOUR_S:
            self._changes.popleft()
        reenables = self._guard.reenables
        while reenables and reenables[0] <= now - DAY_S:
            reenables.popleft()

    def snapshot(self, now: float | None = None) -> ControllerSnapshot:
        """The controller's state for /admin/state and explain (counters as of ``now``, else the last call)."""
        at = self._last_now if now is None else now
        g = self._guard
        exit_ratio, enter_ratio = self.ratios()
        return ControllerSnapshot(
            class_name=self.class_name,
            state=self._state,
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
        )


_SHARE: dict[PoolKind, float] = {"speculative": 1.0, "standard": 0.0}


def _label(share: float) -> RouteState:
    return "speculative" if share >= 1.0 else "standard" if share <= 0.0 else "split"


def _clamp(share: float) -> float:
    """Into [0, 1], rounded so that steps of 0.1 add up to exactly 1."""
    return min(1.0, max(0.0, round(share, 9)))


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _over(value: float | None, limit: float | None) -> bool:
    """``value`` above ``limit``; no limit is never over (a missing value with a limit is caught as stale)."""
    return limit is not None and value is not None and value > limit
