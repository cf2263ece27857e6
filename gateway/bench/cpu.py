"""CPU time of the benchmark's processes, so that a report can show the harness was not the bottleneck.

A policy sweep is only a measurement of the simulated GPUs if no Python event loop in the rig (the load generator,
the gateway, a simulated server) ran out of CPU: a saturated loop adds queueing that looks like server latency (on 2
cores every SSE event crosses three Python processes). ``CpuMeter`` reads each process's user + system time (Linux
``/proc``; elsewhere it reports nothing) at the start and end of a load point; ``busy`` is CPU seconds per wall
second, 1.0 being one core kept busy the whole time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

SATURATED = 0.8  # a process above this share of one core may have queued work of its own


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of ``pid`` (None: this process), or None where /proc cannot tell."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError, OSError):
        return None


@dataclass(slots=True)
class CpuMeter:
    """CPU share of one core per named process over one interval (``start`` … ``stop``)."""

    pids: Mapping[str, int | None]  # name -> pid (None: this process)
    _t0: float = 0.0
    _cpu0: dict[str, float | None] | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self._t0)
        before = self._cpu0 or {}
        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            a, b = before.get(name), cpu_seconds(pid)
            if a is not None and b is not None:
                out[name] = (b - a) / wall
        return out
