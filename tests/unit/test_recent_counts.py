"""The last minutes' counts of the console's tenants panel: a fixed ring advanced by the clock."""

from __future__ import annotations

from gateway.observability.recent_counts import RecentCounts


def test_counts_leave_the_window_as_the_clock_passes_it() -> None:
    now = [1000.0]
    ring = RecentCounts(("shed", "limited"), window_s=300, buckets=10, clock=lambda: now[0])
    ring.add("shed")
    ring.add("limited", 2)
    assert ring.totals() == {"shed": 1, "limited": 2}
    now[0] += 120
    ring.add("shed")
    assert ring.totals() == {"shed": 2, "limited": 2}
    now[0] += 200  # the first interval is out of the window, the second still in it
    assert ring.totals() == {"shed": 1, "limited": 0}
    now[0] += 10_000  # long idle: everything zeroed, once
    assert ring.totals() == {"shed": 0, "limited": 0}
    ring.add("limited")
    assert ring.totals() == {"shed": 0, "limited": 1}
    assert ring.window_s == 300
