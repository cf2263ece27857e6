"""The sibling workers of one ``specgate serve --workers N``: who they are, which config each has in force.

The supervisor makes a private directory and names it in ``SPECGATE_WORKER_GROUP_DIR`` before it spawns the
workers; each worker keeps one file in it, ``<pid>.json``, with the digest of the config it has in force, written at
start and after every reload, removed at exit. That is enough for the admin API, which every worker serves on the
one admin socket (``gateway.cli.serve``):

- ``POST /admin/reload`` on one worker reloads it and sends SIGHUP to the others (each reloads in place, as on a
  signal), then waits until every live sibling shows the same digest, so the next admin call reads the new config
  whichever worker answers it;
- ``GET /admin/state`` names the worker that answered and the digests of all of them.

A file whose process is gone (a worker killed, restarted by the supervisor under a new pid) is removed by whoever
reads it. No Redis needed: it works with ``--per-worker-state`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

GROUP_DIR_ENV = "SPECGATE_WORKER_GROUP_DIR"


class WorkerGroup:
    """One worker's view of its group's directory."""

    def __init__(self, directory: Path, *, workers: int, pid: int | None = None) -> None:
        self.directory = directory
        self.workers = workers
        self.pid = os.getpid() if pid is None else pid
        self._file = directory / f"{self.pid}.json"

    @classmethod
    def from_env(cls, workers: int, environ: Mapping[str, str] | None = None) -> WorkerGroup | None:
        """The group named by the supervisor; None in a one-worker gateway (or a worker started without it)."""
        raw = (os.environ if environ is None else environ).get(GROUP_DIR_ENV, "")
        if workers <= 1 or not raw or not Path(raw).is_dir():
            return None
        return cls(Path(raw), workers=workers)

    def publish(self, digest: str) -> None:
        """This worker's config digest (atomically: a reader sees the old file or the new one)."""
        tmp = self._file.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps({"pid": self.pid, "digest": digest, "at": time.time()}))
        os.replace(tmp, self._file)

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            self._file.unlink()

    def members(self) -> dict[int, str]:
        """Every live worker's config digest, by pid (this one included)."""
        out: dict[int, str] = {}
        for f in self.directory.glob("*.json"):
            try:
                d = orjson.loads(f.read_bytes())
                pid, digest = int(d["pid"]), str(d["digest"])
            except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if pid != self.pid and not _alive(pid):
                with contextlib.suppress(OSError):
                    f.unlink()
                continue
            out[pid] = digest
        return out

    def signal_reload(self) -> list[int]:
        """SIGHUP to every other live worker (each reloads in place); the pids signalled."""
        sent: list[int] = []
        for pid in self.members():
            if pid == self.pid:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGHUP)
                sent.append(pid)
        return sent

    async def wait_for(self, digest: str, pids: list[int], timeout_s: float = 5.0) -> list[int]:
        """Wait until each of ``pids`` (still alive) has ``digest`` in force; the pids that did not in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            members = self.members()
            pending = [p for p in pids if p in members and members[p] != digest]
            if not pending or time.monotonic() >= deadline:
                return pending
            await asyncio.sleep(0.05)

    def describe(self, digest: str) -> dict[str, Any]:
        """For /admin/state: the worker that answered, how many were started, each live one's config digest."""
        members = self.members()
        return {
            "pid": self.pid,
            "workers": self.workers,
            "live": len(members),
            "configs": {str(p): d for p, d in sorted(members.items())},
            "same_config": all(d == digest for d in members.values()),
        }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
