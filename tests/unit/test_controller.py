"""gateway.routing.controller: the per-class route-state controller, driven with synthetic measurement sequences."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any, get_args

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.schema import ControllerConfig, PoolKind, TrafficClass
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.routing.controller import Controller, Transition
from gateway.routing.controller_rules import LOAD_REASONS, ControllerState, Reason
from gateway.routing.estimate import Observation, estimate

REASONS = get_args(Reason)
# The moves that go straight to share 0 or 1, at once (the rest are load steps, or on-call's and the sample count's).
SAFETY_REASONS = frozenset({"stale", "acceptance_floor", "latency_regression", "locked"})

BASE: dict[str, Any] = {
    "window_s": 10.0,
    "min_samples": 5,
    "exit_margin": 1.3,
    "enter_margin": 0.9,
    "acceptance_weight": 0.0,
    "min_hold_s": 30.0,
    "max_changes_per_hour": 4,
    "disable_below": 0.3,
    "disable_after_windows": 3,
    "reenable_after_s": 60.0,
    "max_reenables_per_day": 2,
    "share_step": 1.0,  # whole-class moves; the split tests set their own step
}


def cfg(**kw: Any) -> ControllerConfig:
    return ControllerConfig.model_validate({**BASE, **kw})


def ob(
    spec: float | None = 1.0,
    alt: float | None = 1.0,
    *,
    samples: int = 50,
    acc: float | None = None,
    p95: float | None = None,
    stale: bool = False,
    queue: float | None = None,
    batch: float | None = None,
) -> Observation:
    return Observation(samples, spec, alt, queue, batch, acc, p95, stale)


def drive(c: Controller, seq: Iterable[Observation], *, t0: float = 0.0, dt: float = 2.0) -> list[Transition]:
    out = []
    t = t0
    for o in seq:
        tr = c.observe(t, o)
        if tr is not None:
            out.append(tr)
        t += dt
    return out


# -- config --------------------------------------------------------------------------------------------------


def test_config_defaults_and_the_traffic_class_block() -> None:
    tc = TrafficClass.model_validate({"name": "c", "route": {"preferred": "spec"}, "controller": {}})
    assert tc.controller == ControllerConfig()
    assert TrafficClass.model_validate({"name": "c", "route": {"preferred": "spec"}}).controller is None
    assert cfg(min_hold_s=10).min_hold_s == 10.0  # YAML ints are numbers


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"enter_margin": 1.3, "exit_margin": 1.3}, "enter_margin 1.3 must be below exit_margin"),
        ({"enter_margin": 1.5, "exit_margin": 1.2}, "thresholds out of order"),
        ({"max_queue_enter": 4}, "max_queue_enter and max_queue_exit go together"),
        ({"max_batch_exit": 4}, "max_batch_enter and max_batch_exit go together"),
        ({"max_queue_enter": 8, "max_queue_exit": 4}, "max_queue_enter 8.0 must be below max_queue_exit 4.0"),
        ({"max_batch_enter": 32, "max_batch_exit": 32}, "max_batch_enter 32.0 must be below max_batch_exit"),
        ({"disable_below": 1.5}, "less than or equal to 1"),
        ({"safe_state": "off"}, "safe_state"),
        ({"flap": True}, "Extra inputs are not permitted"),
        ({"min_samples": "5"}, "min_samples"),
    ],
)
def test_config_errors_are_clear(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        cfg(**kw)


# -- expected completion time ------------------------------------------------------------------------------------------


def view(
    running: float | None,
    waiting: float | None,
    *,
    fresh: int = 1,
    tpot: float | None = 0.02,
    out_mean: float | None = 100.0,
) -> PoolLoadView:
    return PoolLoadView("p", max(fresh, 1), fresh, running, waiting, None, None, tpot, None, out_mean)


def expected(v: PoolLoadView, tpot_s: float, output_tokens: float = 100) -> float | None:
    e = estimate(v, "standard", tpot_s, output_tokens=output_tokens)
    return None if e is None else e.expected_s


def test_expected_completion_time() -> None:
    # idle: one step for the first token + the decode
    assert expected(view(0, 0), 0.02) == pytest.approx(0.02 + 2.0)
    # 8 running, 4 waiting per endpoint: half a decode of queueing
    assert expected(view(16, 8, fresh=2), 0.02) == pytest.approx(1.0 + 0.02 + 2.0)
    # the queued requests are the pool's: its mean output, or 256 tokens before it finished any
    assert expected(view(16, 8, fresh=2, out_mean=300), 0.02) == pytest.approx(3.0 + 2.02)
    assert expected(view(16, 8, fresh=2, out_mean=None), 0.02) == pytest.approx(2.56 + 2.02)
    assert expected(view(16, 8, fresh=2, out_mean=0.0), 0.02) == pytest.approx(2.56 + 2.02)
    # a mean no server reports (a corrupt cluster snapshot) is capped at 16 x 256 tokens
    assert expected(view(16, 8, fresh=2, out_mean=1e300), 0.02) == pytest.approx(40.96 + 2.02)
    # stale: unknown, not 0; an unusable TPOT too
    assert expected(view(None, None, fresh=0), 0.05) is None
    assert expected(view(0, 0, tpot=None), math.nan) is None


# -- the decision --------------------------------------------------------------------------------------------


def test_no_decision_before_min_samples() -> None:
    c = Controller("json", cfg(min_samples=20))
    assert drive(c, [ob(5.0, 1.0, samples=n) for n in range(20)]) == []
    assert c.state == "speculative"
    assert c.snapshot().holding == "min_samples"
    [t] = drive(c, [ob(5.0, 1.0, samples=20)], t0=100)
    assert (t.from_state, t.to_state, t.reason, t.at) == ("speculative", "standard", "load", 100)
    assert t.reason in REASONS


def test_load_oscillating_around_one_threshold_does_not_flap() -> None:
    c = Controller("json", cfg(min_hold_s=0, max_changes_per_hour=1000))
    # around the exit ratio 1.3: once out, it needs < 0.9 to come back
    trs = drive(c, [ob(1.3 + (0.05 if i % 2 else -0.05), 1.0) for i in range(5000)])
    assert [t.reason for t in trs] == ["load"]
    # around the enter ratio 0.9: once back, it needs > 1.3 to leave
    trs = drive(c, [ob(0.9 + (0.05 if i % 2 else -0.05), 1.0) for i in range(5000)], t0=20_000)
    assert [t.reason for t in trs] == ["load_recovered"]


@pytest.mark.parametrize("hold", [0.0, 30.0])
def test_a_step_in_load_moves_the_class_within_one_window_plus_the_hold_time(hold: float) -> None:
    window, dt = 10.0, 2.0
    c = Controller("json", cfg(window_s=window, min_hold_s=hold), now=0.0)

    def windowed(t: float, step_at: float, low: float, high: float) -> float:
        """The window's mean of a delay that steps from low to high at step_at (a sliding window lags)."""
        inside = min(max(t - step_at, 0.0), window) / window
        return low + (high - low) * inside

    # the class moved to standard just before the step up: the hold time is running when the step comes
    c.force("standard", 95.0, reason="manual")
    c.force("speculative", 99.0, reason="manual")
    moves: list[Transition] = []
    t = 100.0
    while t < 300:
        moves += [tr for tr in [c.observe(t, ob(windowed(t, 100.0, 1.0, 3.0), 1.0))] if tr]
        t += dt
    [up] = moves
    assert up.to_state == "standard"
    assert up.at <= 100.0 + window + max(hold - 1.0, 0) + dt
    moves = []
    while t < 600:
        moves += [tr for tr in [c.observe(t, ob(windowed(t, 300.0, 3.0, 0.5), 1.0))] if tr]
        t += dt
    [down] = moves
    assert down.to_state == "speculative"
    assert down.reason == "load_recovered"
    assert down.at <= 300.0 + window + dt


@pytest.mark.parametrize("safe", ["standard", "speculative"])
def test_stale_data_leads_to_the_safe_state_not_to_acceptance_zero(safe: ControllerState) -> None:
    start: ControllerState = "speculative" if safe == "standard" else "standard"
    c = Controller("json", cfg(safe_state=safe), initial=start)
    [t] = drive(c, [ob(1.0, 1.0, stale=True, acc=None) for _ in range(200)])
    assert (t.to_state, t.reason, t.at) == (safe, "stale", 0.0)
    snap = c.snapshot()
    assert (snap.holding, snap.below_floor_windows, snap.guard_tripped) == ("stale", 0, False)
    # a missing number counts as stale even without the flag
    c2 = Controller("json", cfg(safe_state=safe), initial=start)
    assert [t.reason for t in drive(c2, [ob(None, 1.0)])] == ["stale"]
    c3 = Controller("json", cfg(safe_state=safe, max_queue_enter=2, max_queue_exit=8), initial=start)
    assert [t.reason for t in drive(c3, [ob(1.0, 1.0, queue=None)])] == ["stale"]


def test_missing_acceptance_never_counts_below_the_floor() -> None:
    c = Controller("json", cfg())
    assert drive(c, [ob(0.5, 1.0, acc=None) for _ in range(1000)]) == []
    assert c.snapshot().below_floor_windows == 0


def test_stale_back_to_fresh_waits_for_the_hold_time() -> None:
    c = Controller("json", cfg(min_hold_s=30))
    drive(c, [ob(stale=True)])
    trs = drive(c, [ob(0.5, 1.0) for _ in range(30)], t0=2.0)
    assert [(t.reason, t.at) for t in trs] == [("load_recovered", 30.0)]


def test_the_guard_trips_comes_back_and_locks() -> None:
    c = Controller("creative", cfg(max_reenables_per_day=2))
    good_load = 0.5  # the speculative pool is faster all along: only the guard moves the class
    t = 0.0

    def run(n: int, acc: float | None) -> list[Transition]:
        nonlocal t
        out = drive(c, [ob(good_load, 1.0, acc=acc) for _ in range(n)], t0=t)
        t += 2.0 * n
        return out

    for cycle in range(2):
        trs = run(16, 0.1)  # a window ends every 10 s after the first observation: the third below-floor one trips
        assert [(x.to_state, x.reason) for x in trs] == [("standard", "acceptance_floor")]
        trip_at = trs[0].at
        assert c.guard_tripped
        assert c.state == "standard"
        assert run(20, None) == []  # unmeasured: not bad, but not yet reenable_after_s
        trs = run(30, 0.6)
        assert [(x.to_state, x.reason) for x in trs] == [("speculative", "reenabled")]
        assert trs[0].at - trip_at >= 60.0
        assert c.snapshot().reenables_last_day == cycle + 1
    trs = run(20, 0.1)
    assert [(x.to_state, x.reason) for x in trs] == [("standard", "locked")]
    assert c.locked
    assert run(3000, 0.9) == []  # hours of good acceptance: it stays off until a person unlocks it
    assert c.snapshot().holding == "locked"
    c.unlock(t)
    trs = run(2, 0.9)
    assert [(x.to_state, x.reason) for x in trs] == [("speculative", "load_recovered")]
    assert not c.locked
    assert c.snapshot().reenables_last_day == 0


def test_a_bad_window_while_tripped_restarts_the_clearance_clock() -> None:
    c = Controller("creative", cfg())
    drive(c, [ob(0.5, 1.0, acc=0.1) for _ in range(16)])  # trips at t=30
    assert c.guard_tripped
    # good windows, then one bad window (72..82 s: the window ending at 80 s counts it), then good again
    trs = drive(c, [ob(0.5, 1.0, acc=0.1 if 20 <= i < 26 else 0.6) for i in range(60)], t0=32.0)
    [back] = trs
    assert back.reason == "reenabled"
    assert back.at >= 80.0 + 60.0  # without the bad window it would be back at 90 s


def test_latency_regression_trips_the_guard() -> None:
    c = Controller("json", cfg(latency_regression_pct=50), baseline_p95_s=2.0)
    assert drive(c, [ob(0.5, 1.0, p95=2.9) for _ in range(100)]) == []  # +45%: fine
    trs = drive(c, [ob(0.5, 1.0, p95=3.5) for _ in range(16)], t0=200)
    assert [(x.to_state, x.reason) for x in trs] == [("standard", "latency_regression")]
    assert c.snapshot().guard_cause == "latency_regression"


def test_the_change_cap_holds() -> None:
    c = Controller("json", cfg(min_hold_s=0, max_changes_per_hour=4))
    seq = [ob(3.0 if (i // 5) % 2 else 0.5, 1.0) for i in range(1800 * 3)]  # flips every 10 s for 3 h
    times = [t.at for t in drive(c, seq)]
    assert len(times) == 12
    for t in times:
        assert sum(1 for u in times if t - 3600 < u <= t) <= 4
    assert c.snapshot().holding in ("cap", None)


def test_high_acceptance_classes_stay_on_the_speculative_pool_longest() -> None:
    high = Controller("json", cfg(acceptance_weight=0.5))
    low = Controller("creative", cfg(acceptance_weight=0.5))
    drive(high, [ob(1.0, 1.0, acc=0.8)])
    drive(low, [ob(1.0, 1.0, acc=0.1)])
    assert high.ratios()[0] == pytest.approx(1.3 * 1.4)
    # the speculative pool 1.6x slower by the estimate: the low-acceptance class leaves, the high one stays
    assert [t.reason for t in drive(low, [ob(1.6, 1.0, acc=0.1)], t0=100)] == ["load"]
    assert drive(high, [ob(1.6, 1.0, acc=0.8)], t0=100) == []


def test_queue_limits_leave_only_for_a_faster_pool() -> None:
    c = Controller("json", cfg(max_queue_enter=2, max_queue_exit=8, min_hold_s=0))
    assert drive(c, [ob(1.2, 1.5, queue=10)]) == []  # over the limit, but standard is slower: stay
    [t] = drive(c, [ob(1.2, 1.0, queue=10)], t0=10)
    assert (t.to_state, t.reason) == ("standard", "load")
    assert drive(c, [ob(0.5, 1.0, queue=5)], t0=20) == []  # faster, but the queue is above the enter limit
    [t] = drive(c, [ob(0.5, 1.0, queue=2)], t0=30)
    assert (t.to_state, t.reason) == ("speculative", "load_recovered")


def test_force_and_unlock() -> None:
    c = Controller("json", cfg())
    t = c.force("standard", 0.0, ttl_s=600)
    assert t is not None
    assert (t.to_state, t.reason) == ("standard", "manual")
    assert drive(c, [ob(0.1, 1.0) for _ in range(299)], t0=1.0) == []  # forced: the load changes nothing
    assert c.snapshot().holding == "forced"
    [t] = drive(c, [ob(0.1, 1.0)], t0=600.0)
    assert t.reason == "load_recovered"
    assert c.force("speculative", 700.0) is None  # already there
    # a person forcing speculative re-enables a locked class
    c2 = Controller("creative", cfg(max_reenables_per_day=0))
    [t] = drive(c2, [ob(0.5, 1.0, acc=0.1) for _ in range(16)])
    assert t.reason == "locked"
    assert c2.locked
    t = c2.force("speculative", 100.0)
    assert t is not None
    assert t.to_state == "speculative"
    assert not c2.locked
    snap = c2.snapshot(100.0).as_dict()
    assert (snap["state"], snap["last_reason"], snap["since"], snap["changes_last_hour"]) == (
        "speculative",
        "manual",
        100.0,
        1,  # the lock; manual changes do not count against the cap
    )


# -- properties ----------------------------------------------------------------------------------------------


def mostly(values: st.SearchStrategy[float]) -> st.SearchStrategy[float | None]:
    """A value 9 times in 10, else None (missing)."""
    return st.tuples(st.integers(0, 9), values).map(lambda p: None if p[0] == 0 else p[1])


observations = st.builds(
    Observation,
    samples=st.integers(0, 40),
    spec_cost_s=mostly(st.floats(0.1, 5.0)),
    std_cost_s=mostly(st.floats(0.1, 5.0)),
    spec_queue=mostly(st.floats(0, 20)),
    spec_batch=mostly(st.floats(0, 64)),
    acceptance=st.one_of(st.none(), st.floats(0, 1)),
    p95_s=st.one_of(st.none(), st.floats(0.5, 10)),
    stale=st.integers(0, 9).map(lambda i: i == 0),
)


@settings(max_examples=150, deadline=None)
@given(
    seq=st.lists(st.tuples(st.floats(0.5, 120.0), observations), min_size=1, max_size=300),
    hold=st.floats(0, 120),
    cap=st.integers(1, 6),
    safe=st.sampled_from(["standard", "speculative"]),
    queues=st.booleans(),
    step=st.sampled_from([0.25, 0.5, 1.0]),
    home=st.sampled_from(["speculative", "standard"]),
)
def test_transitions_respect_the_cap_and_the_hold_time(
    seq: list[tuple[float, Observation]],
    hold: float,
    cap: int,
    safe: ControllerState,
    queues: bool,
    step: float,
    home: PoolKind,
) -> None:
    """For either home (the symmetric controller): load moves never come within min_hold_s of the previous
    transition nor past the cap. Safety moves (stale, guard, lock) are exempt from both; with safe_state standard
    all of them go to standard, so there are at most cap + 1 of them in an hour and the total stays within
    2 x cap + 1."""
    extra = {"max_queue_enter": 4.0, "max_queue_exit": 8.0, "max_batch_enter": 16.0, "max_batch_exit": 32.0}
    config = cfg(
        min_hold_s=hold,
        max_changes_per_hour=cap,
        safe_state=safe,
        min_samples=10,
        latency_regression_pct=30.0,
        reenable_after_s=100.0,
        acceptance_weight=0.5,
        share_step=step,
        **(extra if queues else {}),
    )
    c = Controller("c", config, baseline_p95_s=3.0, initial=home, home=home)
    now = 0.0
    trs: list[Transition] = []
    for dt, o in seq:
        now += dt
        t = c.observe(now, o)
        if t is not None:
            assert t.reason in REASONS
            assert t.from_state != t.to_state
            assert t.at == now
            trs.append(t)
    for i, t in enumerate(trs):
        assert t.reason in LOAD_REASONS | SAFETY_REASONS
        if t.reason in LOAD_REASONS:
            if i:
                assert t.at - trs[i - 1].at >= hold
            assert sum(1 for u in trs[:i] if u.at > t.at - 3600) < cap
        if safe == "standard":
            assert sum(1 for u in trs[: i + 1] if u.at > t.at - 3600) <= 2 * cap + 1
        if t.to_state == "speculative" and t.reason in SAFETY_REASONS:
            assert t.reason == "stale"
            assert safe == "speculative"
        if t.reason in SAFETY_REASONS:  # safety moves go all the way, never to a split
            assert t.to_state != "split"
        assert 0.0 <= t.share <= 1.0
        assert t.share == {"speculative": 1.0, "standard": 0.0}.get(t.to_state, t.share)


# -- splitting a class between the pools ---------------------------------------------------------------------


def split_cfg(**kw: Any) -> ControllerConfig:
    return cfg(share_step=0.25, min_hold_s=0.0, max_changes_per_hour=100, **kw)


def test_the_share_moves_one_step_per_window_and_the_state_is_its_label() -> None:
    c = Controller("json", split_cfg())
    busy = ob(2.0, 1.0)  # speculative clearly slower by the estimate
    [t] = drive(c, [busy])
    assert (t.from_state, t.to_state, t.reason, t.share) == ("speculative", "split", "load", 0.75)
    # the next round, 2 s later, is within the window (10 s): no second step yet
    assert drive(c, [busy], t0=2) == []
    assert c.share == 0.75
    assert c.snapshot().holding == "step"
    assert drive(c, [busy], t0=10) == []
    assert c.share == 0.5
    assert drive(c, [busy], t0=20) == []
    assert c.share == 0.25
    [t] = drive(c, [busy], t0=30)
    assert (t.from_state, t.to_state, t.share) == ("split", "standard", 0.0)
    # and back once the speculative pool is faster: the first step against the last direction is half as big,
    # the third in a row twice as big again
    calm = ob(0.5, 1.0)
    [t] = drive(c, [calm], t0=40)
    assert (t.from_state, t.to_state, t.reason, t.share) == ("standard", "split", "load_recovered", 0.125)
    drive(c, [calm], t0=50)
    assert c.share == 0.25
    drive(c, [calm], t0=60)
    assert c.share == 0.5
    [t] = drive(c, [calm, calm], t0=70, dt=10)
    assert (t.to_state, t.share, t.at) == ("speculative", 1.0, 80)
    # after ten quiet windows a new load step starts with a full step again
    [t] = drive(c, [ob(2.0, 1.0)], t0=200)
    assert t.share == 0.75


def test_within_the_band_the_share_stays_put() -> None:
    c = Controller("json", split_cfg())
    drive(c, [ob(2.0, 1.0)])
    assert c.share == 0.75
    assert drive(c, [ob(1.1, 1.0), ob(0.95, 1.0), ob(1.25, 1.0)], t0=10, dt=10) == []  # 0.9 < ratio < 1.3
    assert c.share == 0.75
    assert c.snapshot().holding is None


def balanced_run(c: Controller, *, acceptance: float | None = None, rounds: int = 200) -> list[float]:
    """Two equal pools whose expected delay grows with the share of a heavy class sent to each: the speculative
    pool (K=4, high load) is 1.6x slower per unit of load. Returns the share after every round."""
    shares = []
    for i in range(rounds):
        spec = 0.5 + 3.2 * c.share
        alt = 0.5 + 2.0 * (1.0 - c.share)
        c.observe(i * 5.0, ob(spec, alt, acc=acceptance))
        shares.append(c.share)
    return shares


def test_under_sustained_load_the_class_settles_in_a_split_instead_of_alternating() -> None:
    whole = Controller("json", cfg(min_hold_s=0.0, max_changes_per_hour=100))  # share_step 1: moves as a whole
    split = Controller("json", split_cfg())
    whole_shares, split_shares = balanced_run(whole), balanced_run(split)
    flips = sum(1 for a, b in itertools.pairwise(whole_shares) if a != b)
    assert flips > 50  # each whole move makes the other pool the loaded one: it alternates every window
    late = split_shares[20:]
    assert set(late) == {late[0]}
    assert 0.0 < late[0] < 1.0
    spec, alt = 0.5 + 3.2 * late[0], 0.5 + 2.0 * (1 - late[0])
    assert 0.9 * alt <= spec <= 1.3 * alt  # the delays are within the band


def test_high_acceptance_classes_keep_a_larger_share_under_the_same_load() -> None:
    high = balanced_run(Controller("json", split_cfg(acceptance_weight=0.5)), acceptance=0.9)[-1]
    low = balanced_run(Controller("creative", split_cfg(acceptance_weight=0.5)), acceptance=0.1)[-1]
    assert high > low


def test_safety_moves_leave_a_split_all_the_way() -> None:
    c = Controller("json", split_cfg())
    drive(c, [ob(2.0, 1.0)])
    [t] = drive(c, [ob(stale=True)], t0=5)
    assert (t.from_state, t.to_state, t.reason, t.share) == ("split", "standard", "stale", 0.0)
    c2 = Controller("json", split_cfg(safe_state="speculative"))
    drive(c2, [ob(2.0, 1.0)])
    [t2] = drive(c2, [ob(None, 1.0)], t0=5)
    assert (t2.to_state, t2.share) == ("speculative", 1.0)
    c3 = Controller("json", split_cfg(disable_after_windows=1))
    drive(c3, [ob(2.0, 1.0)])
    [t3] = drive(c3, [ob(1.0, 1.0, acc=0.1)], t0=10)
    assert (t3.from_state, t3.to_state, t3.reason) == ("split", "standard", "acceptance_floor")


def test_latency_guard_watches_a_split_class_too() -> None:
    c = Controller("json", split_cfg(latency_regression_pct=20, disable_after_windows=2), baseline_p95_s=2.0)
    drive(c, [ob(2.0, 1.0)])
    assert c.state == "split"
    trs = drive(c, [ob(1.0, 1.0, p95=2.6)] * 3, t0=10, dt=10)
    assert [(t.to_state, t.reason) for t in trs] == [("standard", "latency_regression")]


def test_a_forced_state_overrides_a_split() -> None:
    c = Controller("json", split_cfg())
    drive(c, [ob(2.0, 1.0)])
    t = c.force("standard", 5.0, ttl_s=60)
    assert t is not None
    assert (t.from_state, t.to_state, t.share) == ("split", "standard", 0.0)
    assert drive(c, [ob(0.1, 1.0)], t0=10) == []
    assert c.snapshot().holding == "forced"
