"""Sweeps that stop when they are stopped: policies side by side in processes of their own (``bench policies
--jobs N``), and SIGTERM handled like Ctrl-C.

A sweep's ``finally`` blocks stop the simulated servers and the gateway it started (``bench.fleet``), but only if
the signal that ends it reaches them as an exception:

- ``interrupt_on_term``: SIGTERM raises ``KeyboardInterrupt`` in the sweep's main thread, as Ctrl-C does (Python's
  default for SIGTERM ends the process at once, leaving every child running);
- each policy process leads a process group of its own (its servers and gateway inherit it) and turns SIGINT and
  SIGTERM into ``KeyboardInterrupt`` directly (asyncio's own SIGINT handler only cancels the running task, which a
  load generator may absorb), so one signal stops its load point and its fleet;
- ``run_side_by_side``, interrupted, forwards SIGTERM to every policy process's group, waits ``JOB_GRACE_S`` for
  them to stop their fleets, then kills what is left of each group: a terminal's Ctrl-C reaches only the sweep, a
  policy process's group is no longer in the terminal's;
- a policy process whose sweep died without a word (SIGKILL) notices that its parent changed and stops itself the
  same way, instead of running on as an orphan whose load generator finds other sweeps' servers on reused ports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from types import FrameType
from typing import Any, TypeVar

from gateway.bench.fleet import STOP_GRACE_S

T = TypeVar("T")
JOB_GRACE_S = STOP_GRACE_S + 10.0  # a policy process's time to stop its fleet (which kills after STOP_GRACE_S)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interrupt_on_term() -> Iterator[None]:
    """Inside: SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def follow_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """When the process that started this one is gone (killed, not interrupted), SIGTERM this one: a real signal,
    which wakes a sleeping main thread or event loop and raises ``KeyboardInterrupt`` there (``job_process``)."""

    def watch() -> None:
        time.sleep(poll_s)
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def job_process(parent_pid: int, poll_s: float = 0.5) -> None:
    """A policy process's initializer: a process group of its own, SIGINT and SIGTERM as ``KeyboardInterrupt``, and
    it stops when its sweep is gone."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    follow_parent(parent_pid, poll_s)


def signal_group(pid: int, sig: int, alone: bool = True) -> None:
    """``sig`` to the process group ``pid`` leads; where it leads none (yet), to ``pid`` alone if ``alone``."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        if alone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    except PermissionError:
        pass  # the pid is no longer a group of ours


def stop_jobs(procs: Sequence[multiprocessing.process.BaseProcess], grace_s: float = JOB_GRACE_S) -> None:
    """SIGTERM to each job's group; once none of ``procs`` is alive or after ``grace_s``, SIGKILL to what is left of
    their groups (and to a job process still alive outside its group)."""
    pids = [p.pid for p in procs if p.pid is not None]
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        if proc.pid is not None:
            signal_group(proc.pid, signal.SIGKILL, alone=proc.is_alive())


def run_side_by_side(fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], jobs: int) -> list[T]:
    """``fn(*args)`` for every ``args`` of ``calls``, ``jobs`` at a time, each in a spawned process of its own (a
    process group with everything it starts); the results in the order of ``calls``. Interrupted (Ctrl-C, or
    SIGTERM inside ``interrupt_on_term``), every policy process and whatever it started is stopped before the
    interrupt goes on."""
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(min(jobs, len(calls)), mp_context=ctx, initializer=job_process, initargs=(os.getpid(),))
    try:
        futures = [pool.submit(fn, *args) for args in calls]
        results = [f.result() for f in futures]
    except BaseException:
        procs = list((pool._processes or {}).values())  # before shutdown forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        stop_jobs(procs)
        raise
    pool.shutdown(wait=True)
    return results
