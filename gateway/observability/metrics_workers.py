"""Metrics across ``--workers N``: every worker is its own process with its own values, so ``/metrics``
(answered by whichever worker accepts the connection) must not render just that worker's registry.

``specgate serve`` then points ``PROMETHEUS_MULTIPROC_DIR`` at a private directory before the workers start;
prometheus_client, imported by each fresh worker with that variable set, keeps every value in a per-process file
there, and each worker's ``/metrics`` renders the merge of all the files (``MultiProcessCollector``), so every worker
answers the same totals. Counters and histograms are summed, dead workers included (totals never go down while the
gateway runs); the gauges say how to merge them (``multiprocess_mode``) and forget workers that are gone: a worker
that exits normally removes its gauge files in its lifespan shutdown (``GatewayMetrics.worker_exited``), and every
scrape removes those of workers that died without one (killed, crashed). Single-process mode renders its own
registry, as always.
"""

from __future__ import annotations

import contextlib
import os
import re

from prometheus_client import values
from prometheus_client.multiprocess import mark_process_dead


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when this process's metric values are kept there, else None.

    prometheus_client chooses where values live once, when it is imported: a variable set later (or a process
    that imported it before) still keeps them in memory, where no other worker can see them.
    """
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or values.ValueClass is values.MutexValue or not os.path.isdir(path):
        return None
    return path


_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


def forget_dead_processes(path: str) -> None:
    """Remove the live-gauge files of processes that no longer exist (a worker killed without a shutdown)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    pids = {int(m.group(1)) for m in map(_LIVE_GAUGE_FILE.fullmatch, names) if m is not None}
    for pid in pids:
        if pid > 0 and not _process_exists(pid):
            forget_process(pid, path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and belongs to someone else
        return True
    return True


def forget_process(pid: int, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # another worker's scrape got there first
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
