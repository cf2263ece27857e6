"""The exemplar gate: at most one exemplar per histogram bucket per second, per child."""

from gateway.observability.exemplars import ExemplarGate

BOUNDS = (0.1, 1.0, 10.0)


def test_first_observation_in_a_bucket_sets_its_exemplar() -> None:
    gate = ExemplarGate(BOUNDS)
    assert gate.due("a", 0.5, now=100.0)
    assert not gate.due("a", 0.7, now=100.5)  # same bucket (0.1, 1.0], within the second
    assert gate.due("a", 0.9, now=101.0)  # a second later


def test_buckets_and_children_are_gated_apart() -> None:
    gate = ExemplarGate(BOUNDS)
    assert gate.due("a", 0.05, now=0.0)
    assert gate.due("a", 5.0, now=0.0)  # another bucket
    assert gate.due("a", 50.0, now=0.0)  # the +Inf bucket
    assert gate.due("b", 0.05, now=0.0)  # another child
    assert not gate.due("a", 0.1, now=0.5)  # le=0.1 holds 0.1 itself
    assert not gate.due("a", 99.0, now=0.5)


def test_a_fresh_gate_lets_the_first_observation_through_at_time_zero() -> None:
    assert ExemplarGate(BOUNDS).due("a", 1.0, now=0.0)
