"""The wrapped label children (gateway.observability.fast_child) count exactly as prometheus_client's own methods."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.observability.fast_child import Counting, Observing


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


def test_a_histogram_counts_as_its_own_observe_does() -> None:
    values = [0.0, 0.005, 0.0050001, 0.01, 0.3, 1.0, 7.0, 1e9, -1.0, math.inf, math.nan]
    got = []
    for wrapped in (False, True):
        r = CollectorRegistry()
        h = Histogram("h", "h", ["c"], registry=r, buckets=(0.005, 0.01, 0.025, 0.5, 1, 5))
        child = h.labels("a")
        fast = Observing(child)
        for v in values:
            (fast.observe if wrapped else child.observe)(v)
        got.append(_samples(r))
    plain, fast_ = got
    sums = [k for k in plain if k[0] == "h_sum"]
    assert all(math.isnan(plain[k]) and math.isnan(fast_[k]) for k in sums)
    assert {k: v for k, v in plain.items() if k not in sums} == {k: v for k, v in fast_.items() if k not in sums}


def test_counters_and_gauges_count_as_their_own_methods_do() -> None:
    r = CollectorRegistry()
    c = Counting(Counter("c", "c", ["p"], registry=r).labels("x"))
    g = Counting(Gauge("g", "g", ["p"], registry=r).labels("x"))
    c.inc(1)
    c.inc(16)
    g.inc(1)
    g.inc(1)
    g.dec()
    s = _samples(r)
    assert s[("c_total", (("p", "x"),))] == 17
    assert s[("g", (("p", "x"),))] == 1


def test_a_parent_without_its_label_values_is_refused_when_wrapped() -> None:
    r = CollectorRegistry()
    with pytest.raises(ValueError, match="missing label values"):
        Counting(Counter("c", "c", ["p"], registry=r))
    with pytest.raises(ValueError, match="missing label values"):
        Observing(Histogram("h", "h", ["p"], registry=r))


def test_without_the_library_internals_it_falls_back_on_the_childs_methods() -> None:
    class Child:
        def __init__(self) -> None:
            self.total = 0.0
            self.seen: list[float] = []

        def inc(self, amount: float = 1) -> None:
            self.total += amount

        def observe(self, amount: float) -> None:
            self.seen.append(amount)

        def _raise_if_not_observable(self) -> None:
            pass

    counted, observed = Child(), Child()
    Counting(counted).inc(3)
    Observing(observed).observe(0.5)
    assert counted.total == 3
    assert observed.seen == [0.5]


def test_one_process_values_are_added_to_without_their_lock() -> None:
    """The wrapped children are written on the event loop's thread only: the lock prometheus_client takes on every
    update is left out (held here by someone else, the update still goes through, and the exposition reads it)."""
    r = CollectorRegistry()
    child = Counter("c", "c", ["p"], registry=r).labels("x")
    h = Histogram("h", "h", ["p"], registry=r, buckets=(1, 2)).labels("x")
    c, o = Counting(child), Observing(h)
    with child._value._lock, h._sum._lock:
        c.inc(2)
        o.observe(1.5)
    s = _samples(r)
    assert s[("c_total", (("p", "x"),))] == 2
    assert s[("h_sum", (("p", "x"),))] == 1.5
    assert s[("h_bucket", (("le", "2.0"), ("p", "x")))] == 1
