"""CPU time of the benchmark's processes, so that a report can show the harness was not the bottleneck.

A policy sweep is only a measurement of the simulated GPUs if no Python event loop in the rig (the load generator,
the gateway, a simulated server) ran out of CPU: a saturated loop adds queueing that looks like server latency (on 2
cores every SSE event crosses three Python processes). ``CpuMeter`` reads each process's user + system time (Linux
``/proc``; elsewhere it reports nothing) at the start and end of a load point; ``busy`` is CPU seconds per wall
second, 1.0 being one core kept busy the whole time. A named process with processes of its own (a gateway with
``--workers N``: its supervisor, and the workers under it) is metered as itself plus each descendant as a process
of its own (``gateway``, ``gateway child 1`` ...), found when the interval starts; a child that stayed idle (a
multiprocessing helper process) is left out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

SATURATED = 0.8  # a process above this share of one core may have queued work of its own
IDLE_CHILD = 0.005  # a child below this share of one core (a multiprocessing helper) is left out of the result


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after "pid (comm) " (state first), or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot): with the pid, it names one process even if the pid is reused."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, their children ...), from each process's parent in /proc; [] where
    /proc cannot tell."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for name in names:
        if name.isdigit() and (fields := _stat(int(name))) is not None:
            with contextlib.suppress(IndexError, ValueError):
                children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of ``pid`` (None: this process), or None where /proc cannot tell."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = _stat(pid)  # after "pid (comm) ": state is field 3, utime 14, stime 15
    if fields is None:
        return None
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError, OSError):
        return None


@dataclass(slots=True)
class CpuMeter:
    """CPU share of one core per named process over one interval (``start`` … ``stop``)."""

    pids: Mapping[str, int | None]  # name -> pid (None: this process, not expanded: its children are named)
    _t0: float = 0.0
    _cpu0: dict[str, float | None] | None = None
    _metered: dict[str, int | None] | None = None

    def start(self) -> None:
        self._metered = with_children(self.pids)
        self._t0 = time.monotonic()
        self._cpu0 = {name: cpu_seconds(pid) for name, pid in self._metered.items()}

    def stop(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self._t0)
        before = self._cpu0 or {}
        out: dict[str, float] = {}
        for name, pid in (self._metered or self.pids).items():
            a, b = before.get(name), cpu_seconds(pid)
            if a is not None and b is not None and (name in self.pids or b - a >= IDLE_CHILD * wall):
                out[name] = (b - a) / wall
        return out


def with_children(pids: Mapping[str, int | None]) -> dict[str, int | None]:
    """``pids`` with each named process's descendants added as ``NAME child K`` (this process's are not: the bench
    names its own children)."""
    out: dict[str, int | None] = dict(pids)
    for name, pid in pids.items():
        if pid is not None:
            for k, child in enumerate(descendants(pid), 1):
                out[f"{name} child {k}"] = child
    return out
