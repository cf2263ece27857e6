"""A class controller's decision as an ordered list of named rules (``RULES``), each a small pure function.

Every scrape round the ``Controller`` hands the rules one ``Situation`` (the class's window of measurements and its
own state: share, home, guard counts, last step) and evaluates them in the order of ``RULES``. Each returns a
``Verdict`` that names itself and says one of three things, as a router's match does:

- ``pass``: the rule does not apply; the next one speaks;
- ``adjust``: it proposes or reshapes the load step (a ``Proposal``: direction, size, target share) and the next
  one speaks;
- ``decide``: it ends the evaluation: a move to a share (with a ``Reason``), or no change (with a ``Holding``
  saying why, or none when nothing needs to move).

``explain`` and the audit show the rule that decided (``ControllerSnapshot.rule``, ``Transition.rule``). The
class's home (``Situation.home``) is an input like the measurements: every rule reads it, none branches on a
fixed one, so a rule that changes what counts as home for a round goes in front of ``balance``.

The order (the first that decides wins):

1. ``forced``: an on-call force holds the class where a person put it until its TTL.
2. ``safe_state``: missing or stale measurements send the class to its safe state (never read as 0).
3. ``min_samples``: too few requests to tell load from noise: no decision.
4. ``guard``: low acceptance or a p95 regression for N windows takes the class off the speculative pool.
5. ``balance``: follow the cheaper pool, with hysteresis relative to home (proposes a direction).
6. ``limits``: queue/batch limits of the speculative pool: leave above an exit limit, enter only within the enter
   limits.
7. ``order``: the speculative pool goes first to the classes that gain most there (yield, or hold back).
8. ``settled``: no proposal left: nothing moves.
9. ``step``: one step per ``window_s``, halved against the last one's direction (sizes the proposal).
10. ``min_hold``: a step that changes the state waits ``min_hold_s`` after the last transition.
11. ``cap``: at most ``max_changes_per_hour`` automatic transitions.
12. ``take_step``: what is left is a load step: take it.

``probe_share`` is asked once a round after the decision: the share to send to the speculative pool to measure a
class's acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from gateway.config.schema import ControllerConfig, PoolKind
from gateway.routing.estimate import Observation

# Where a class's controller sends it: all to the speculative pool, a share each way, or all to the standard pool
# (not ``routing_state.RoutingState``, which holds every class's controller).
ControllerState = Literal["speculative", "split", "standard"]
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
LOAD_REASONS: frozenset[Reason] = frozenset({"load", "load_recovered", "reenabled"})
Holding = Literal["forced", "stale", "min_samples", "locked", "guard", "hold", "cap", "step", "order"]
Outcome = Literal["pass", "adjust", "decide"]
STEP_MEMORY_WINDOWS = 10  # a load step this many windows after the last one starts again with a full step
SHARE: dict[PoolKind, float] = {"speculative": 1.0, "standard": 0.0}


@dataclass(frozen=True, slots=True)
class Guard:
    """The fallback guard's counts: consecutive bad windows, trip, lock, and the re-enables of the last day."""

    tripped: bool = False
    locked: bool = False
    cause: Reason | None = None
    below_floor: int = 0
    latency_high: int = 0
    window_start: float | None = None
    clear_since: float | None = None
    reenable_pending: bool = False
    reenables: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Situation:
    """What every rule reads: one window's measurements and the class's own state at ``now``."""

    now: float
    obs: Observation
    config: ControllerConfig
    home: PoolKind  # where the class goes when nothing argues otherwise (share 1 or 0)
    share: float  # of its requests sent to the speculative pool first
    since: float  # of the current state
    guard: Guard
    forced_until: float | None = None
    baseline_p95_s: float | None = None
    acceptance: float | None = None  # the class's last measured rate (None: never measured)
    last_step: float | None = None  # the last automatic share change
    step: float = 0.25  # the size of the last load step
    direction: int = 0  # of the last load step: -1 toward standard, +1 toward speculative
    run: int = 0  # load steps in a row in that direction
    changes_last_hour: int = 0  # automatic transitions

    @property
    def safe_kind(self) -> PoolKind:
        """Where the class goes while measurements are missing: ``safe_state``, ``home`` resolved."""
        safe = self.config.safe_state
        return self.home if safe == "home" else safe

    @property
    def factor(self) -> float:
        """The acceptance bonus of the speculative pool: 1 + acceptance_weight x the last measured acceptance."""
        return 1.0 + self.config.acceptance_weight * (self.acceptance if self.acceptance is not None else 0.0)


@dataclass(frozen=True, slots=True)
class Proposal:
    """The load step proposed so far: its direction (+1 toward speculative), why, and once sized its target."""

    direction: int
    detail: str
    yielding: bool = False  # a yield to a class that gains more on the speculative pool: a full step
    size: float = 0.0
    run: int = 0
    target: float | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """One rule's answer. ``decide`` with ``share`` moves the class there (``reason``, ``detail``); without it
    nothing changes (``holding``: why; ``reason``: the last reason to remember, a guard trip off the pool)."""

    rule: str
    outcome: Outcome
    proposal: Proposal | None = None
    share: float | None = None
    reason: Reason | None = None
    detail: str = ""
    holding: Holding | None = None
    guard: Guard | None = None  # the guard's counts after this rule (None: unchanged)


Rule = Callable[[Situation, Proposal | None], Verdict]


def _pass(rule: str, guard: Guard | None = None) -> Verdict:
    return Verdict(rule, "pass", guard=guard)


def _hold(rule: str, holding: Holding | None, guard: Guard | None = None, reason: Reason | None = None) -> Verdict:
    return Verdict(rule, "decide", holding=holding, guard=guard, reason=reason)


def _adjust(rule: str, proposal: Proposal) -> Verdict:
    return Verdict(rule, "adjust", proposal=proposal)


def label(share: float) -> ControllerState:
    return "speculative" if share >= 1.0 else "standard" if share <= 0.0 else "split"


def clamp(share: float) -> float:
    """Into [0, 1], rounded so that steps of 0.1 add up to exactly 1."""
    return min(1.0, max(0.0, round(share, 9)))


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def over(value: float | None, limit: float | None) -> bool:
    """``value`` above ``limit``; no limit is never over (a missing value with a limit is caught as stale)."""
    return limit is not None and value is not None and value > limit


def missing(obs: Observation, c: ControllerConfig) -> bool:
    """A stale pool, no cost estimate, or a queue/batch limit without its number."""
    return (
        obs.stale
        or not _finite(obs.spec_cost_s)
        or not _finite(obs.std_cost_s)
        or (c.max_queue_exit is not None and not _finite(obs.spec_queue))
        or (c.max_batch_exit is not None and not _finite(obs.spec_batch))
    )


# -- the rules, in order -------------------------------------------------------------------------------------


def forced(s: Situation, p: Proposal | None) -> Verdict:
    """An on-call force holds the class where a person put it until its TTL ends."""
    if s.forced_until is not None and s.now < s.forced_until:
        return _hold("forced", "forced")
    return _pass("forced")


def safe_state(s: Situation, p: Proposal | None) -> Verdict:
    """Unknown is never 0: without fresh measurements the class goes to its safe state (standard while guarded)."""
    if not missing(s.obs, s.config):
        return _pass("safe_state")
    g = s.guard
    if g.tripped:
        g = replace(g, clear_since=s.now)  # clearance needs reenable_after_s of fresh windows
    target: PoolKind = "standard" if g.tripped or g.locked else s.safe_kind
    if target != label(s.share):
        return Verdict("safe_state", "decide", share=SHARE[target], reason="stale", detail="measurements missing or "
                       "stale", guard=g)  # fmt: skip
    return _hold("safe_state", "stale", g)


def min_samples(s: Situation, p: Proposal | None) -> Verdict:
    """Too few of the class's requests in the window to tell its load from noise: no decision."""
    if s.obs.samples < s.config.min_samples:
        return _hold("min_samples", "min_samples")
    return _pass("min_samples")


def guard(s: Situation, p: Proposal | None) -> Verdict:
    """Acceptance below the floor or a p95 regression for N windows takes the class off the speculative pool until
    the condition is gone; a trip after too many re-enables in a day locks it until a person unlocks it."""
    g, trip = _count_window(s)
    if trip is not None:
        reason, detail = trip
        if s.share > 0:
            return Verdict("guard", "decide", share=0.0, reason=reason, detail=detail, guard=g)
        return _hold("guard", "locked" if g.locked else "guard", g, reason)
    if g.locked:
        return _hold("guard", "locked", g)
    if g.tripped:
        return _hold("guard", "guard", g)
    return _pass("guard", g)


def _count_window(s: Situation) -> tuple[Guard, tuple[Reason, str] | None]:
    """One guard window per ``window_s``: count it, trip, lock or clear the guard; the trip's reason, if any."""
    c, g, now, obs = s.config, s.guard, s.now, s.obs
    if g.window_start is None:
        g = replace(g, window_start=now)
    assert g.window_start is not None
    if now - g.window_start < c.window_s:
        return g, None
    g = replace(g, window_start=now)
    acc_bad: bool | None = None
    if c.disable_below is not None and obs.acceptance is not None:
        acc_bad = obs.acceptance < c.disable_below
        g = replace(g, below_floor=g.below_floor + 1 if acc_bad else 0)
    lat_bad: bool | None = None
    if c.latency_regression_pct is not None and s.baseline_p95_s is not None and obs.p95_s is not None and s.share > 0:
        lat_bad = obs.p95_s > s.baseline_p95_s * (1.0 + c.latency_regression_pct / 100.0)
        g = replace(g, latency_high=g.latency_high + 1 if lat_bad else 0)
    if g.locked:
        return g, None
    if g.tripped:
        if acc_bad or lat_bad or g.clear_since is None:
            g = replace(g, clear_since=now)
        elif now - g.clear_since >= c.reenable_after_s:
            g = replace(g, tripped=False, clear_since=None, reenable_pending=True, reenables=(*g.reenables, now))
        return g, None
    if g.below_floor < c.disable_after_windows and g.latency_high < c.disable_after_windows:
        return g, None
    cause: Reason = "acceptance_floor" if g.below_floor >= c.disable_after_windows else "latency_regression"
    detail = f"{cause} for {c.disable_after_windows} windows"
    g = replace(g, tripped=True, cause=cause, clear_since=now, below_floor=0, latency_high=0)
    reason: Reason = cause
    if len(g.reenables) >= c.max_reenables_per_day:
        g, reason = replace(g, locked=True), "locked"
        detail += f"; {len(g.reenables)} re-enables in 24 h: locked until a person unlocks it"
    return g, (reason, detail)


def balance(s: Situation, p: Proposal | None) -> Verdict:
    """Follow the cheaper pool relative to home: leave it past ``exit_margin``, come back past ``enter_margin``,
    and once a share is away settle where the costs meet (``balance_margin``), so a class at home stays home."""
    c, obs = s.config, s.obs
    spec, std = obs.spec_cost_s, obs.std_cost_s
    if spec is None or std is None:  # safe_state caught them; for the type checker
        return _pass("balance")
    spec = spec / s.factor  # the acceptance bonus favours speculation
    home_cost, other_cost = (spec, std) if s.home == "speculative" else (std, spec)
    other: PoolKind = "standard" if s.home == "speculative" else "speculative"
    at_home = s.share == SHARE[s.home]
    away, back = c.exit_margin, c.enter_margin
    if c.balance_margin is not None and c.share_step < 1 and not at_home:
        away, back = c.balance_margin, 1 / c.balance_margin
    home_dir = 1 if s.home == "speculative" else -1
    leave = (-home_dir, home_cost > other_cost * away, f"{s.home} {home_cost:.3g}s > {away:.3g} x {other} "
             f"{other_cost:.3g}s: cheaper away")  # fmt: skip
    come = (home_dir, home_cost < other_cost * back, f"{s.home} {home_cost:.3g}s < {back:.3g} x {other} "
            f"{other_cost:.3g}s: home")  # fmt: skip
    for direction, holds, detail in sorted((leave, come)):  # toward standard first
        if holds and (s.share > 0 if direction < 0 else s.share < 1):
            return _adjust("balance", Proposal(direction, detail))
    return _pass("balance")


def limits(s: Situation, p: Proposal | None) -> Verdict:
    """The speculative pool's queue/batch limits: above an exit limit a share leaves it while the standard pool is
    faster (never onto a slower pool); a step onto it needs queue and batch within the enter limits."""
    c, obs = s.config, s.obs
    spec, std = obs.spec_cost_s, obs.std_cost_s
    above = over(obs.spec_queue, c.max_queue_exit) or over(obs.spec_batch, c.max_batch_exit)
    if s.share > 0 and above and spec is not None and std is not None and std < spec and (p is None or p.direction > 0):
        detail = f"over queue/batch limit and standard faster ({std:.3g}s < {spec:.3g}s)"
        return _adjust("limits", Proposal(-1, detail))
    within = not over(obs.spec_queue, c.max_queue_enter) and not over(obs.spec_batch, c.max_batch_enter)
    if p is not None and p.direction > 0 and not within:
        return Verdict("limits", "adjust")  # the step onto the speculative pool is dropped
    return _pass("limits")


def order(s: Situation, p: Proposal | None) -> Verdict:
    """The speculative pool goes first to the classes that gain most there: while one with clearly more acceptance
    is partly off it, this class takes no share onto it and hands back what it has there."""
    by = s.obs.outranked_by
    if by is None:
        return _pass("order")
    if s.share > 0:
        detail = f"yields the speculative pool to {by} (more acceptance, partly off it)"
        return _adjust("order", Proposal(-1, detail, yielding=True))
    if p is not None and p.direction > 0:
        return _hold("order", "order")
    return _pass("order")


def settled(s: Situation, p: Proposal | None) -> Verdict:
    """No step proposed: the costs are within the band (or already at the end of the range), nothing moves."""
    return _hold("settled", None) if p is None else _pass("settled")


def step(s: Situation, p: Proposal | None) -> Verdict:
    """One share step per ``window_s``, half as big against the last one's direction, so the share homes in on
    the balance instead of cycling around it; whole-class moves, yields and the first step after a quiet spell
    are full steps."""
    assert p is not None  # settled decided otherwise
    c = s.config
    fresh = s.last_step is None or s.now - s.last_step > STEP_MEMORY_WINDOWS * c.window_s
    if s.direction == 0 or fresh or c.share_step >= 1.0 or p.yielding:
        size, run = c.share_step, 1
    elif p.direction != s.direction:
        size, run = max(s.step / 2, c.share_step / 8), 1
    else:
        run = s.run + 1
        size = min(s.step * 2, c.share_step) if run >= 3 else s.step
    if s.last_step is not None and s.now - s.last_step < c.window_s:
        return _hold("step", "step")
    return _adjust("step", replace(p, size=size, run=run, target=clamp(s.share + p.direction * size)))


def min_hold(s: Situation, p: Proposal | None) -> Verdict:
    """A step that changes the state waits ``min_hold_s`` after the last transition: no flapping."""
    if _transition(s, p) and s.now - s.since < s.config.min_hold_s:
        return _hold("min_hold", "hold")
    return _pass("min_hold")


def cap(s: Situation, p: Proposal | None) -> Verdict:
    """At most ``max_changes_per_hour`` automatic transitions an hour: a late move costs less than flapping."""
    if _transition(s, p) and s.changes_last_hour >= s.config.max_changes_per_hour:
        return _hold("cap", "cap")
    return _pass("cap")


def take_step(s: Situation, p: Proposal | None) -> Verdict:
    """What is left is a load step: take it (``load`` away from home, ``load_recovered`` toward it, ``reenabled``
    for the first step back onto the speculative pool after the guard cleared)."""
    assert p is not None  # settled decided otherwise
    assert p.target is not None  # step sized it
    toward_home = p.direction == (1 if s.home == "speculative" else -1)
    reason: Reason = "load_recovered" if toward_home else "load"
    if p.direction > 0 and s.guard.reenable_pending:
        reason = "reenabled"
    return Verdict("take_step", "decide", proposal=p, share=p.target, reason=reason, detail=p.detail)


def _transition(s: Situation, p: Proposal | None) -> bool:
    return p is not None and p.target is not None and label(p.target) != label(s.share)


RULES: tuple[Rule, ...] = (
    forced,
    safe_state,
    min_samples,
    guard,
    balance,
    limits,
    order,
    settled,
    step,
    min_hold,
    cap,
    take_step,
)


def evaluate(s: Situation, rules: tuple[Rule, ...] = RULES) -> tuple[Verdict, Guard]:
    """Run ``rules`` in order until one decides; that verdict and the guard's counts after the rules that ran."""
    proposal: Proposal | None = None
    for rule in rules:
        v = rule(s, proposal)
        if v.guard is not None:
            s = replace(s, guard=v.guard)
        if v.outcome == "decide":
            return v, s.guard
        if v.outcome == "adjust":
            proposal = v.proposal
    raise AssertionError("the last rule decides")  # take_step always decides


def probe_share(s: Situation | None) -> float:
    """The share of the class's requests to send to the speculative pool to measure its acceptance: the configured
    ``probe_share`` while the class has never had its acceptance measured, sits wholly on the standard pool, is
    neither forced nor held off by the guard, and the last (fresh) observation shows headroom on the speculative
    pool (less than one request waiting per endpoint, batch within ``max_batch_enter``); else 0."""
    if s is None:
        return 0.0
    c, g, obs = s.config, s.guard, s.obs
    if c.probe_share <= 0 or s.acceptance is not None or s.share > 0 or g.tripped or g.locked:
        return 0.0
    if s.forced_until is not None and s.now < s.forced_until:
        return 0.0
    if missing(obs, c) or obs.spec_queue is None or obs.spec_queue >= 1.0:
        return 0.0
    return 0.0 if over(obs.spec_batch, c.max_batch_enter) else c.probe_share
