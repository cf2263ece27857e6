"""Targets measured in turns, one short measurement each per round (``specgate bench overhead --tracing``): a
machine whose load drifts (other work on the same cores) shifts them all alike, which one target after the other
does not. Each round starts with another target, so none is always the one measured first; the req/s ratio to the
first target is the median over the rounds of the ratio within a round, so a burst of other work on the machine
spoils one round's ratio, not the result. Each target's CPU per request comes from its process's /proc counters.

After each measurement the target's process is let settle (``settle``: its CPU idle) before the next target runs:
work a target defers past its own turn (a tracing gateway's export thread sending what it queued) would otherwise
run during the next target's turn, slowing that one and not itself. Its CPU until it settles counts as its own, and
so does the CPU of the processes it started (a tracing gateway's export process)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar


class _Measured(Protocol):
    @property
    def rps(self) -> float: ...


R = TypeVar("R", bound=_Measured)


@dataclass(frozen=True, slots=True)
class Turns(Generic[R]):
    samples: dict[str, list[R]]  # per target, one per round
    cpu_us: dict[str, float]  # per target: its process's CPU microseconds per request (where /proc tells)
    ratios: dict[str, float]  # per target: median over the rounds of its req/s over the first target's
    # per target: the 90% interval of that median (``median_interval``): what the rounds settle
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)


LEVEL = 0.90


def median_interval(values: list[float], level: float = LEVEL) -> tuple[float, float]:
    """A distribution-free interval for the median of what ``values`` were drawn from: the order statistics
    ``(j, n - j + 1)`` with the largest ``j`` whose coverage, 1 - 2 P(Binomial(n, 1/2) < j), is still ``level``
    (five values: their least and greatest, 94%; fewer than five cover less than ``level``). Rounds are taken as
    independent draws: a drift that spans rounds slows every target of a round alike and so leaves the within-round
    ratio alone."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        return (math.nan, math.nan)
    tail = 1 / 2**n  # P(X < j + 1) for X ~ Binomial(n, 1/2): order statistic j (0-based) covers 1 - 2 tail
    j = 0
    while j + 1 <= (n - 1) // 2:
        further = tail + math.comb(n, j + 1) / 2**n
        if 1 - 2 * further < level:
            break
        tail, j = further, j + 1
    return (v[j], v[n - 1 - j])


def settle(
    pid: int, window_s: float = 0.1, limit_s: float = 5.0, read: Callable[[int], float | None] | None = None
) -> None:
    """Wait until process ``pid`` used at most one clock tick of CPU in ``window_s`` (or ``limit_s`` passed).
    ``read``: its CPU seconds (``cpu_s``; tests)."""
    read = cpu_s if read is None else read
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + limit_s
    last = read(pid)
    while last is not None and time.monotonic() < deadline:
        time.sleep(window_s)
        now = read(pid)
        if now is None or now - last <= tick + 1e-9:
            return
        last = now


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) and of the processes it started that still
    run (a tracing gateway's export process), or None where /proc cannot tell."""
    total = _own_cpu_s(pid)
    if total is None:
        return None
    for child in _descendants(pid):
        total += _own_cpu_s(child) or 0.0
    return total


def _own_cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from /proc's children lists (empty where the kernel does not keep them)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                found = [int(x) for x in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += found
            todo += found
    return out


def replica(round_: int, position: int, copies: int) -> int:
    """Which of a target's ``copies`` processes is measured in round ``round_`` (``position``: the target's place in
    the targets' order): every combination of the targets' copies comes in turn, ``copies ** targets`` rounds a
    cycle, so each ratio is taken between many pairs of processes, not one."""
    return (round_ // int(copies**position)) % copies


def in_turns(
    urls: Mapping[str, str | Sequence[str]],
    rounds: int,
    pids: Mapping[str, int | Sequence[int]],
    measure: Callable[[str], R],
) -> Turns[R]:
    """``measure`` each of ``urls``' targets once per round, ``rounds`` rounds (module docstring).

    A target may be served by several identical processes (a sequence of urls, and of pids in the same order): one
    of them is measured each round (``replica``). Two processes of one build differ in speed by a few percent (where
    their objects landed in memory, their hash seeds), which more rounds of the same two processes never average
    out; rounds spread over several processes per target do, and the ratio's interval then holds that spread."""
    samples: dict[str, list[R]] = {t: [] for t in urls}
    cpu: dict[str, float] = dict.fromkeys(urls, 0.0)
    done: dict[str, float] = dict.fromkeys(urls, 0.0)
    per_round: dict[str, list[float]] = {t: [] for t in urls}
    copies = {t: [u] if isinstance(u, str) else list(u) for t, u in urls.items()}
    procs = {t: [p] if isinstance(p, int) else list(p) for t, p in pids.items()}
    if any(len(procs[t]) != len(c) or not c for t, c in copies.items()):
        raise ValueError("each target needs as many pids as urls, and at least one")
    order = list(copies)
    first = order[0]
    for i in range(rounds):
        got: dict[str, float] = {}
        for target in order[i % len(order) :] + order[: i % len(order)]:
            k = replica(i, order.index(target), len(copies[target]))
            url, pid = copies[target][k], procs[target][k]
            before = cpu_s(pid)
            r = measure(url)
            settle(pid)
            after = cpu_s(pid)
            samples[target].append(r)
            got[target] = r.rps
            if before is not None and after is not None:
                cpu[target] += after - before
                done[target] += r.rps
        if got[first] > 0:
            for target, rps in got.items():
                per_round[target].append(rps / got[first])
    ratios = {t: sorted(v)[len(v) // 2] for t, v in per_round.items() if v}
    intervals = {t: median_interval(v) for t, v in per_round.items() if v}
    cpu_us = {t: cpu[t] / done[t] * 1e6 for t in urls if done[t] > 0 and cpu[t] > 0}
    return Turns(samples, cpu_us, ratios, intervals)
