"""gateway.routing.controller, both ways: a standard-home class moves a share onto the speculative pool when that is
clearly faster for it, and back; shares stay in [0, 1]; equal times keep a class home; probes stay capped."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.controller import PROBE_CAP
from gateway.config.schema import ControllerConfig, PoolKind
from gateway.routing.controller import Controller
from gateway.routing.estimate import Observation

BASE: dict[str, Any] = {
    "window_s": 10.0,
    "min_samples": 5,
    "exit_margin": 1.25,
    "enter_margin": 0.9,
    "acceptance_weight": 0.0,
    "min_hold_s": 0.0,
    "max_changes_per_hour": 100,
    "share_step": 0.25,
}
HOME_SHARE = {"speculative": 1.0, "standard": 0.0}


def cfg(**kw: Any) -> ControllerConfig:
    return ControllerConfig.model_validate({**BASE, **kw})


def ob(spec: float | None, std: float | None, *, queue: float | None = 0.0, acc: float | None = None) -> Observation:
    return Observation(50, spec, std, queue, 1.0, acc, None, False)


def run(c: Controller, obs: list[Observation], *, t0: float = 0.0, dt: float = 11.0) -> list[float]:
    """Observe each, one window apart; the share after each."""
    shares = []
    for i, o in enumerate(obs):
        c.observe(t0 + i * dt, o)
        shares.append(c.share)
    return shares


def test_a_standard_home_class_moves_onto_a_clearly_faster_speculative_pool_and_back() -> None:
    c = Controller("chat", cfg(), initial="standard", home="standard")
    # speculative is twice as fast for this class (low load): a share moves over, one step per window
    assert run(c, [ob(1.0, 2.0)] * 4) == [0.25, 0.5, 0.75, 1.0]
    assert c.state == "speculative"
    assert c.snapshot().last_reason == "load"
    # much later the standard pool is clearly faster: back home, step by step
    shares = run(c, [ob(3.0, 1.0)] * 4, t0=1000.0)
    assert shares == [0.75, 0.5, 0.25, 0.0]
    assert c.snapshot().last_reason == "load_recovered"


def test_a_speculative_home_class_behaves_as_before() -> None:
    c = Controller("json", cfg())
    assert run(c, [ob(3.0, 1.0)] * 4) == [0.75, 0.5, 0.25, 0.0]
    assert run(c, [ob(0.5, 1.0)] * 4, t0=1000.0) == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("home", ["speculative", "standard"])
def test_inside_the_band_nothing_moves(home: PoolKind) -> None:
    c = Controller("x", cfg(), initial=home, home=home)
    # the other pool 10% faster: within the exit margin (1.25), so the class stays home
    other_faster = ob(1.0, 1.1) if home == "standard" else ob(1.1, 1.0)
    assert run(c, [other_faster] * 6) == [HOME_SHARE[home]] * 6


def test_a_standard_home_class_does_not_move_onto_speculation_over_its_queue_limit() -> None:
    c = Controller("chat", cfg(max_queue_enter=2, max_queue_exit=6), initial="standard", home="standard")
    assert run(c, [ob(1.0, 3.0, queue=4.0)] * 3) == [0.0, 0.0, 0.0]  # faster, but queueing beyond the enter limit
    assert run(c, [ob(1.0, 3.0, queue=1.0)], t0=50.0) == [0.25]
    # over the exit limit and standard faster: a share goes back home
    assert run(c, [ob(1.2, 1.0, queue=7.0)], t0=70.0) == [0.125]  # a reversal: half a step


def test_the_guard_takes_a_standard_home_class_off_speculation() -> None:
    c = Controller(
        "chat",
        cfg(disable_below=0.3, disable_after_windows=2, reenable_after_s=1000),
        initial="standard",
        home="standard",
    )
    run(c, [ob(1.0, 3.0, acc=0.5)] * 3)
    assert c.share > 0
    run(c, [ob(1.0, 3.0, acc=0.1)] * 3, t0=40.0)
    assert c.share == 0.0
    assert c.guard_tripped
    assert run(c, [ob(1.0, 3.0)] * 3, t0=100.0) == [0.0, 0.0, 0.0]  # held off until the guard clears


# -- properties ----------------------------------------------------------------------------------------------

delays = st.floats(0.05, 20.0)
obs_strategy = st.builds(
    Observation,
    samples=st.integers(0, 60),
    spec_cost_s=st.one_of(st.none(), delays),
    std_cost_s=st.one_of(st.none(), delays),
    spec_queue=st.one_of(st.none(), st.floats(0, 20)),
    spec_batch=st.one_of(st.none(), st.floats(0, 64)),
    acceptance=st.one_of(st.none(), st.floats(0, 1)),
    p95_s=st.none(),
    stale=st.booleans(),
)
configs = st.builds(
    lambda step, weight, probe, queues: cfg(
        share_step=step,
        acceptance_weight=weight,
        probe_share=probe,
        disable_below=0.2,
        disable_after_windows=2,
        **({"max_queue_enter": 2.0, "max_queue_exit": 6.0} if queues else {}),
    ),
    st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    st.sampled_from([0.0, 0.5]),
    st.floats(0, PROBE_CAP),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(
    config=configs,
    home=st.sampled_from(["speculative", "standard"]),
    seq=st.lists(st.tuples(st.floats(0.1, 40.0), obs_strategy), max_size=120),
)
def test_shares_stay_in_0_1_and_the_probe_share_never_exceeds_its_cap(
    config: ControllerConfig, home: PoolKind, seq: list[tuple[float, Observation]]
) -> None:
    c = Controller("x", config, initial=home, home=home)
    now = 0.0
    for dt, o in seq:
        now += dt
        t = c.observe(now, o)
        assert 0.0 <= c.share <= 1.0
        assert t is None or 0.0 <= t.share <= 1.0
        probe = c.probe_share()
        assert 0.0 <= probe <= config.probe_share <= PROBE_CAP
        if probe > 0:  # only while never measured, wholly on standard, with fresh data and headroom
            assert c.acceptance is None
            assert c.share == 0.0
            assert not c.guard_tripped
            assert o.spec_queue is not None
            assert o.spec_queue < 1.0
            assert not o.stale


@settings(max_examples=200, deadline=None)
@given(
    config=configs,
    home=st.sampled_from(["speculative", "standard"]),
    times=st.lists(st.tuples(st.floats(0.1, 40.0), delays, st.floats(0, 1)), max_size=120),
)
def test_with_equal_expected_times_a_class_stays_home(
    config: ControllerConfig, home: PoolKind, times: list[tuple[float, float, float]]
) -> None:
    """Whatever the load (equal on both pools), the acceptance and the step size: no move away from home."""
    c = Controller("x", config.model_copy(update={"acceptance_weight": 0.0}), initial=home, home=home)
    now = 0.0
    for dt, delay, acc in times:
        now += dt
        assert c.observe(now, ob(delay, delay, acc=acc if acc > 0.3 else None)) is None
        assert c.share == HOME_SHARE[home]


def test_the_probe_share_is_capped_in_the_yaml() -> None:
    assert cfg(probe_share=PROBE_CAP).probe_share == PROBE_CAP
    with pytest.raises(pydantic.ValidationError, match=r"less than or equal to 0\.05"):
        cfg(probe_share=0.2)


def test_probes_only_while_unmeasured_on_standard_with_headroom() -> None:
    c = Controller("chat", cfg(probe_share=0.02), initial="standard", home="standard")
    assert c.probe_share() == 0.0  # nothing observed yet
    c.observe(0.0, ob(2.0, 2.0, queue=0.0))
    assert c.probe_share() == 0.02
    c.observe(11.0, ob(2.0, 2.0, queue=3.0))  # the speculative pool queues: no headroom
    assert c.probe_share() == 0.0
    c.observe(22.0, ob(2.0, 2.0, queue=0.0, acc=0.4))  # measured: no more probes
    assert c.acceptance == 0.4
    assert c.probe_share() == 0.0
    off = Controller("chat", cfg(probe_share=0.0), initial="standard", home="standard")
    off.observe(0.0, ob(2.0, 2.0))
    assert off.probe_share() == 0.0  # turned off for the class
