"""Label children updated on every request without prometheus_client's checks on every call.

A child's ``inc`` checks that it is observable and that the amount is not negative, then takes its value's lock;
a histogram's ``observe`` checks the same and walks its buckets in Python, one comparison each. On the request
path (a few updates per request) those checks are the larger part of the cost, and they always pass: the children
here are looked up with their label values, and the amounts are counts and durations. ``counter``, ``gauge`` and
``histogram`` check once, when the child is wrapped, and then update the child's own values (the same objects its
exposition reads, in one process or in the multiprocess files): a counter's and a gauge's ``inc`` is the value's
``inc``, a histogram finds its bucket by bisection. Where a prometheus_client release keeps its values elsewhere,
the wrapper falls back on the child's own methods.

One process (no ``--workers``): a value is a float behind a lock (``MutexValue``), and taking and releasing that
lock was most of an ``inc`` (0.5 against 0.13 us). The children wrapped here are written only on the event loop's
thread, so no two writes can interleave, and a scrape (another thread) reads the float whole, before or after an
update: the wrappers add to the float directly. With ``--workers`` the values live in the shared files, and their
own ``inc`` (under the files' lock) is used.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client.values import MutexValue


def adder(value: Any) -> Callable[[float], None] | None:
    """How to add to a child's value (``_value``, or a histogram's bucket or sum): directly to a one-process value
    (module docstring), else the value's own ``inc``; None when it has neither."""
    if type(value) is MutexValue:

        def add(amount: float) -> None:
            value._value += amount

        return add
    inc = getattr(value, "inc", None)
    return inc if callable(inc) else None


class Counting:
    """A counter's or a gauge's child: ``inc(amount)`` (a counter's amount is never negative), ``dec(amount)``."""

    __slots__ = ("child", "inc")

    def __init__(self, child: Any) -> None:
        child.inc(0)  # raises here, once, for a metric without its label values
        self.child = child
        self.inc: Callable[[float], None] = adder(getattr(child, "_value", None)) or child.inc

    def dec(self, amount: float = 1) -> None:
        self.inc(-amount)


class Observing:
    """A histogram's child: ``observe(amount)`` without an exemplar (``child.observe`` takes one)."""

    __slots__ = ("_bounds", "_buckets", "_sum", "child")

    def __init__(self, child: Any) -> None:
        child._raise_if_not_observable()
        self.child = child
        bounds, buckets, total = (getattr(child, n, None) for n in ("_upper_bounds", "_buckets", "_sum"))
        adders = [adder(b) for b in buckets] if buckets is not None else []
        add_sum = adder(total)
        if bounds is None or buckets is None or add_sum is None or len(bounds) != len(buckets) or None in adders:
            self._bounds: tuple[float, ...] = ()
            self._buckets: tuple[Callable[[float], None], ...] = ()
            self._sum: Callable[[float], None] | None = None
        else:
            self._bounds = tuple(bounds)
            self._buckets = tuple(a for a in adders if a is not None)
            self._sum = add_sum

    def observe(self, amount: float) -> None:
        add = self._sum
        if add is None:
            self.child.observe(amount)
            return
        add(amount)
        i = bisect_left(self._bounds, amount)  # the first bucket whose upper bound is >= amount (the last is +Inf)
        if i < len(self._buckets) and amount == amount:  # NaN: in no bucket, as prometheus_client counts it
            self._buckets[i](1)
