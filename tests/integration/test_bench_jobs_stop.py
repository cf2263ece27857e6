"""A ``bench policies --jobs 2`` sweep that is stopped (SIGTERM, or Ctrl-C to its terminal's process group) stops
its policy processes, their simulated servers and gateways with it, instead of running its load points on; and the
fleet's stop kills what ignores SIGTERM, with its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.bench.cpu import CpuMeter, descendants
from gateway.bench.fleet import stop_processes

ROOT = Path(__file__).resolve().parents[2]
# every process of a sweep gone within this: the sweep below would run its load points on for minutes
GONE_WITHIN_S = 60.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return []
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_stopped_side_by_side_sweep_leaves_nothing_running(tmp_path: Path, how: str) -> None:
    cmd = [sys.executable, "-m", "gateway", "bench", "policies", "--mix", "default", "--loads", "0.3,0.5"]
    cmd += ["--policies", "standard,adaptive", "--jobs", "2", "--duration", "120", "--warmup", "1", "--repeats", "1"]
    cmd += ["--out", str(tmp_path)]
    log = (tmp_path / "sweep.log").open("w")
    sweep = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # two policy processes, each with two simulated servers and a gateway
        deadline = time.monotonic() + 120
        while len(descendants(sweep.pid)) < 8 and sweep.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        started = descendants(sweep.pid)
        assert len(started) >= 8, (tmp_path / "sweep.log").read_text()
        if how == "sigterm":
            sweep.send_signal(signal.SIGTERM)
        else:
            os.killpg(sweep.pid, signal.SIGINT)  # what a terminal sends its foreground process group
        left = _wait_gone([sweep.pid, *started], GONE_WITHIN_S)
        assert not left, f"still running: {left}"
        assert sweep.wait(timeout=10) != 0
    finally:
        for pid in [sweep.pid, *descendants(sweep.pid)]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_the_fleet_stop_kills_what_ignores_sigterm_and_its_children() -> None:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    stop_processes([proc], grace_s=0.5)
    assert proc.poll() is not None
    assert not _wait_gone([child], 30.0)


BUSY_CHILD = (
    "import subprocess, sys, time\n"
    "busy = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
    "idle = subprocess.Popen(['sleep', '120'])\n"
    "print(busy.pid, idle.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_the_cpu_meter_counts_a_process_busy_children_as_processes_of_their_own() -> None:
    proc = subprocess.Popen([sys.executable, "-c", BUSY_CHILD], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        busy, idle = (int(x) for x in proc.stdout.readline().split())
        assert {busy, idle} <= set(descendants(proc.pid))
        meter = CpuMeter({"gateway": proc.pid, "load generator": None})
        meter.start()
        time.sleep(1.0)
        cpu = meter.stop()
        children = [name for name in cpu if name.startswith("gateway child ")]
        assert len(children) == 1  # the busy one; the idle one is left out
        assert cpu[children[0]] > 0
        assert {"gateway", "load generator"} <= set(cpu)
    finally:
        stop_processes([proc], grace_s=0.5)
