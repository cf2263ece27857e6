"""The worker group of ``--workers N``: each worker's config digest in a shared directory, dead workers dropped,
a reload signalled to the siblings and waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from gateway.runtime.workers import GROUP_DIR_ENV, WorkerGroup


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_with_several_workers_and_the_supervisors_directory(tmp_path: Path) -> None:
    assert WorkerGroup.from_env(1, {GROUP_DIR_ENV: str(tmp_path)}) is None
    assert WorkerGroup.from_env(2, {}) is None
    assert WorkerGroup.from_env(2, {GROUP_DIR_ENV: str(tmp_path / "gone")}) is None
    group = WorkerGroup.from_env(2, {GROUP_DIR_ENV: str(tmp_path)})
    assert group is not None
    assert group.pid == os.getpid()


async def test_members_digests_and_dead_workers_dropped(tmp_path: Path) -> None:
    me = WorkerGroup(tmp_path, workers=3)
    me.publish("aaa")
    dead = _dead_pid()
    (tmp_path / f"{dead}.json").write_bytes(orjson.dumps({"pid": dead, "digest": "old", "at": 0}))
    (tmp_path / "junk.json").write_text("{")
    assert me.members() == {os.getpid(): "aaa"}
    assert not (tmp_path / f"{dead}.json").exists()  # whoever reads it removes a dead worker's file
    d = me.describe("aaa")
    assert (d["pid"], d["workers"], d["live"], d["same_config"]) == (os.getpid(), 3, 1, True)
    assert await me.wait_for("aaa", [os.getpid()], timeout_s=0.1) == []
    me.publish("bbb")
    assert me.describe("aaa")["same_config"] is False
    assert await me.wait_for("aaa", [os.getpid()], timeout_s=0.1) == [os.getpid()]  # still pending at the end
    me.withdraw()
    assert me.members() == {}


def test_a_reload_is_signalled_to_the_other_workers_only(tmp_path: Path) -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGHUP, lambda *a: sys.exit(7)); print(1, flush=True)"
    code += "; time.sleep(30)"
    sibling = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert sibling.stdout is not None
        sibling.stdout.readline()  # its handler is in place
        WorkerGroup(tmp_path, workers=2, pid=sibling.pid).publish("aaa")
        me = WorkerGroup(tmp_path, workers=2)
        me.publish("aaa")
        assert me.signal_reload() == [sibling.pid]
        deadline = time.monotonic() + 10
        while sibling.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sibling.returncode == 7
    finally:
        if sibling.poll() is None:
            sibling.kill()
            sibling.wait()
