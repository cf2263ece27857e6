"""Targets measured in turns: each round starts with another target, and the ratio to the first target is the
median of the rounds' ratios (one disturbed round does not move it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from gateway.bench import turns
from gateway.bench.turns import in_turns


@dataclass
class Result:
    rps: float


def test_rounds_rotate_and_the_ratio_is_the_median() -> None:
    calls: list[str] = []
    base = {"a": 100.0, "b": 90.0, "c": 80.0}

    def measure(url: str) -> Result:
        calls.append(url)
        if len(calls) == 4:  # round 1, first turn (b): the machine was busy
            assert url == "b"
            return Result(10.0)
        return Result(base[url])

    got = in_turns({"a": "a", "b": "b", "c": "c"}, 3, {t: os.getpid() for t in "abc"}, measure)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each round starts with the next target
    assert got.ratios == {"a": 1.0, "b": 0.9, "c": 0.8}
    assert [r.rps for r in got.samples["b"]] == [90.0, 10.0, 90.0]


def test_settle_waits_until_the_process_stops_using_cpu() -> None:
    """Its CPU counter still moving (deferred work after its turn): settle reads on until a window without a tick."""
    from gateway.bench.turns import settle

    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    readings = iter([0.0, 5 * tick, 9 * tick, 10 * tick, 10 * tick])
    reads: list[float | None] = []

    def read(pid: int) -> float | None:
        value = next(readings, None)
        reads.append(value)
        return value

    settle(1, window_s=0.0, limit_s=60.0, read=read)
    assert reads == [0.0, 5 * tick, 9 * tick, 10 * tick]  # one tick in the last window: idle


def test_settle_returns_for_a_process_that_is_gone() -> None:
    from gateway.bench.turns import settle

    settle(2**22 + 12345, limit_s=1.0)  # no such pid: /proc cannot tell, nothing to wait for


def test_cpu_counts_the_processes_a_target_started() -> None:
    """A tracing gateway's export process is part of its cost: its CPU counts as the gateway's."""
    script = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"  # the busy one is the child
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == b"ready"
        child = turns._descendants(parent.pid)
        assert len(child) == 1
        deadline = time.monotonic() + 60
        while True:  # the busy child's CPU shows in the parent's total, not in its own
            own, total = turns._own_cpu_s(parent.pid), turns.cpu_s(parent.pid)
            assert own is not None
            assert total is not None
            if total - own >= 0.1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert total - own >= 0.1
    finally:
        for pid in turns._descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_the_median_interval_is_the_order_statistics_of_its_coverage() -> None:
    """Five rounds: the least and greatest (94%); forty rounds: the 15th and 26th of them (1 - 2 P(X < 15) = 0.919
    for X ~ Binomial(40, 1/2); the 16th would cover only 0.846); one wild round moves neither end."""
    from gateway.bench.turns import median_interval

    assert median_interval([0.9, 1.1, 1.0, 0.8, 1.2]) == (0.8, 1.2)
    values = [i / 100 for i in range(80, 120)]  # 0.80 .. 1.19
    assert median_interval(values) == (0.94, 1.05)
    values[0] = 0.01
    assert median_interval(values) == (0.94, 1.05)
    assert median_interval([1.0]) == (1.0, 1.0)


def test_in_turns_gives_each_ratio_its_interval() -> None:
    got = in_turns(
        {"a": "a", "b": "b"}, 5, {t: os.getpid() for t in "ab"}, lambda u: Result(100.0 if u == "a" else 95.0)
    )
    assert got.intervals["b"] == (0.95, 0.95)


def test_every_combination_of_the_targets_processes_comes_in_turn() -> None:
    """Two processes per target: over copies ** targets rounds each combination is measured once, so a ratio is
    not the speed of one pair of processes."""
    seen = {tuple(turns.replica(i, p, 2) for p in range(3)) for i in range(8)}
    assert len(seen) == 8
    assert [turns.replica(i, 0, 1) for i in range(4)] == [0, 0, 0, 0]


def test_in_turns_measures_each_targets_processes_in_turn() -> None:
    """One process of the second target is 10% slower: the ratio's median falls between the two pairs' ratios and
    its interval holds both, where a single pair would have given one of them with a narrow interval."""
    speed = {"a0": 100.0, "a1": 100.0, "b0": 100.0, "b1": 90.0}
    calls: list[str] = []

    def measure(url: str) -> Result:
        calls.append(url)
        return Result(speed[url])

    pid = os.getpid()
    got = in_turns({"a": ["a0", "a1"], "b": ["b0", "b1"]}, 8, {"a": [pid, pid], "b": [pid, pid]}, measure)
    assert calls[:8] == ["a0", "b0", "b0", "a1", "a0", "b1", "b1", "a1"]  # a alternates each round, b every two
    assert sorted(calls) == sorted(["a0", "a1", "b0", "b1"] * 4)
    assert got.intervals["b"] == (0.9, 1.0)
    assert len(got.samples["b"]) == 8


def test_in_turns_refuses_urls_without_their_pids() -> None:
    with pytest.raises(ValueError, match="as many pids as urls"):
        in_turns({"a": ["a0", "a1"]}, 1, {"a": [os.getpid()]}, lambda u: Result(1.0))
