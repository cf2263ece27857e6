"""A config file on disk, watched: read as text, its signature, and ``ConfigWatcher``, which polls it.

``ConfigWatcher`` polls the file every second. It compares the resolved path (``os.path.realpath``), device, inode,
mtime and size, so that an in-place edit, an atomic rename and a Kubernetes ConfigMap or Secret update
(``rules.yaml -> ..data/rules.yaml``, ``..data`` an atomically swapped symlink to a new timestamped directory) are
all seen; then it hashes the content and hands only a new content on. Every ``recheck_every`` polls it hashes the
file even when the signature did not change (a filesystem with a coarse mtime). A half-written file is handed on,
rejected by validation, and handed on again once complete (its size or mtime changed). The routing YAML
(``gateway.runtime.reload``) and the tenants file (``gateway.runtime.tenants_reload``) are watched this way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.config.loader import ConfigIssue, RulesError
from gateway.periodic import run_every
from gateway.runtime.live import config_digest

logger = logging.getLogger("specgate")


def read_config(path: str | os.PathLike[str]) -> str:
    """The file's text (UTF-8, a BOM dropped); raises ``RulesError`` naming the file when it cannot be read."""
    source = os.fspath(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RulesError([ConfigIssue("", f"cannot read the file: {exc.strerror or exc}")], source) from exc
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RulesError([ConfigIssue("", f"the file is not UTF-8 text: {exc.reason}")], source) from exc


@dataclass(frozen=True, slots=True)
class FileSignature:
    """What changes when the file is edited in place, replaced by a rename, or swapped behind symlinks."""

    realpath: str
    device: int
    inode: int
    mtime_ns: int
    size: int


def file_signature(path: str | os.PathLike[str]) -> FileSignature | None:
    """The signature of the file ``path`` resolves to now; None when it does not exist (mid-swap, deleted)."""
    try:
        st = os.stat(path)  # follows symlinks: the file a ConfigMap's ``..data`` points at now
        real = os.path.realpath(path)
    except OSError:
        return None
    return FileSignature(real, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigWatcher:
    """Polls one file; ``poll()`` answers True when its content differs from what was seen or is in force."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[], Awaitable[object]],
        current_digest: Callable[[], str],
        *,
        interval_s: float = 1.0,
        recheck_every: int = 10,
    ) -> None:
        self.path = os.fspath(path)
        self._on_change = on_change
        self._current = current_digest
        self.interval_s = interval_s
        self._recheck_every = max(1, recheck_every)
        self._signature: FileSignature | None = None  # None first: the first poll compares with the config in force
        self._seen: str | None = None  # the hash last handed on
        self._polls = 0
        self.changes = 0  # contents handed on

    def poll(self) -> bool:
        """One look at the file (blocking I/O: stat, and a read when the signature changed)."""
        self._polls += 1
        sig = file_signature(self.path)
        if sig is None:
            self._signature = None  # gone for now: its return is a change
            return False
        if sig == self._signature and self._polls % self._recheck_every != 0:
            return False
        try:
            text = read_config(self.path)
        except RulesError:
            return False  # vanished between stat and read (a swap): the next poll sees the new one
        self._signature = sig
        digest = config_digest(text)
        if digest == self._seen or digest == self._current():
            self._seen = digest
            return False
        self._seen = digest
        self.changes += 1
        return True

    async def run(self) -> None:
        await run_every(
            self._poll_once,
            lambda: self.interval_s,
            what=f"config watcher: polling {self.path}",
            log=logger,
            sleep_first=True,
        )

    async def _poll_once(self) -> None:
        if await asyncio.to_thread(self.poll):
            await self._on_change()
