"""Hot reload of the routing YAML: triggers, validation first, one reference swap, and the retirement of old clients.

Triggers (all end in ``Runtime.reload(trigger)``, which serialises them with one lock):

- ``sighup``: ``kill -HUP <pid>`` of ``specgate serve`` (the handler is added to the running loop by
  ``Runtime.start``; uvicorn owns SIGINT / SIGTERM, not SIGHUP). It runs ``Runtime.reload`` as the admin route
  does, so the tenants file is re-read too. With ``--workers N`` the supervisor passes the signal on to every
  worker (``gateway.cli.serve.Supervisor``), each reloading in place.
- ``admin``: ``POST /admin/reload`` (with ``--workers N``: this worker, then a SIGHUP to each sibling, answered once
  they all have the new config in force; ``gateway.runtime.workers``).
- ``watch``: ``ConfigWatcher`` (``gateway.runtime.watch``) polls the file every second and hands on a new content.

A reload reads the file, and when its hash equals the config in force answers ``unchanged`` (no swap). Otherwise
the text goes through ``load_rules_text`` completely (YAML, schema, semantic checks; every error names its path and
line) before anything changes. Invalid: nothing changes, the last good config keeps serving, each error is logged,
``specgate_config_reload_total{result="invalid"}`` counts it, the admin answer is a 422 listing every error. Valid:
``LiveConfig.build(..., previous=old)`` and one assignment ``runtime.live = new``. A request reads ``runtime.live``
once and keeps that object (its pools and clients) to its end, so requests in flight finish under the config they
started with. Clients (connection pools) of pools whose spec did not change are carried over; the others are
closed by ``ClientRetirer`` (``gateway.runtime.retire``) once nothing uses them, never cutting an open stream. Then
``runtime.apply_overrides()`` drops the overrides that refer to pools or classes the new config removed; they are
reported in the result and the log. Every attempt is an audit record and sets ``specgate_config_info``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway.config.loader import ConfigIssue, RulesError, load_rules_text
from gateway.config.settings import Settings
from gateway.observability.metrics import GatewayMetrics
from gateway.overrides.audit import AuditRecord
from gateway.overrides.manager import OverrideManager
from gateway.periodic import cancel_and_wait
from gateway.runtime.live import LiveConfig, config_digest
from gateway.runtime.retire import ClientRetirer
from gateway.runtime.watch import ConfigWatcher, read_config

logger = logging.getLogger("specgate")

ReloadOutcome = Literal["ok", "unchanged", "invalid", "error"]
RESULTS: tuple[ReloadOutcome, ...] = ("ok", "unchanged", "invalid", "error")


def default_actor(trigger: str) -> str:
    """The audit actor of a reload nobody named: ``signal`` (SIGHUP), ``watcher``, else the trigger itself."""
    return {"sighup": "signal", "watch": "watcher"}.get(trigger, trigger)


def issue_dict(issue: ConfigIssue) -> dict[str, Any]:
    return {"path": issue.path, "line": issue.line, "message": issue.message}


def jsonable(obj: object) -> Any:
    """An override (whatever ``Runtime.apply_overrides`` returns) as JSON: ``as_dict()``, a dataclass, or as is."""
    as_dict = getattr(obj, "as_dict", None)
    if callable(as_dict):
        return as_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if obj is None or isinstance(obj, str | int | float | bool | list | dict):
        return obj
    return str(obj)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """One reload attempt. ``version`` / ``hash``: the config in force afterwards (the new one when ``ok``)."""

    result: ReloadOutcome
    trigger: str
    source: str
    version: int
    hash: str
    previous_hash: str
    attempted_hash: str | None = None  # the hash of the text read; None when it could not be read
    issues: tuple[ConfigIssue, ...] = ()
    dropped_overrides: tuple[Any, ...] = ()
    message: str = ""
    at: float = dataclasses.field(default_factory=time.time)

    @property
    def changed(self) -> bool:
        return self.result == "ok"

    def as_dict(self) -> dict[str, Any]:
        """The body of ``POST /admin/reload`` (200) and the detail of the audit record."""
        return {
            "result": self.result,
            "trigger": self.trigger,
            "source": self.source,
            "version": self.version,
            "hash": self.hash,
            "previous_hash": self.previous_hash,
            "attempted_hash": self.attempted_hash,
            "errors": [issue_dict(i) for i in self.issues],
            "dropped_overrides": [jsonable(o) for o in self.dropped_overrides],
            "message": self.message,
            "at": self.at,
        }

    def error_message(self) -> str:
        """One line for the admin answer and the log: every error with its path and line."""
        if not self.issues:
            return self.message
        listed = "; ".join(str(i) for i in self.issues)
        n = len(self.issues)
        errors = f"{n} error{'s' if n != 1 else ''}"
        return f"{self.source}: the routing YAML was rejected ({errors}; the config in force is unchanged): {listed}"


# ---------------------------------------------------------------------------------------------- SIGHUP


def add_sighup_handler(callback: Callable[[], object]) -> bool:
    """SIGHUP → ``callback`` on the running loop; False where that is impossible (not the main thread, Windows)."""
    sig = getattr(signal, "SIGHUP", None)
    if sig is None:
        return False
    try:
        asyncio.get_running_loop().add_signal_handler(sig, callback)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def remove_sighup_handler() -> None:
    sig = getattr(signal, "SIGHUP", None)
    if sig is None:
        return
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().remove_signal_handler(sig)


# ---------------------------------------------------------------------------------------------- the reload


class ReloadTarget(Protocol):
    """What a reload reads and swaps on the process's runtime (``gateway.runtime.container.Runtime``)."""

    settings: Settings
    live: LiveConfig
    metrics: GatewayMetrics
    overrides: OverrideManager

    async def apply_overrides(self) -> Any: ...

    async def reload(self, trigger: str, actor: str | None = None) -> ReloadResult: ...


class Reloader:
    """The reload of one runtime: triggers, the serialised attempt, its metrics, log lines and audit record."""

    def __init__(
        self,
        runtime: ReloadTarget,
        *,
        watch_interval_s: float = 1.0,
        on_result: Callable[[ReloadResult], object] | None = None,
    ) -> None:
        self._rt = runtime
        self._on_result = on_result  # after every attempt, whatever its trigger (the worker group's digest file)
        self.watch_interval_s = watch_interval_s  # 0: no file watcher
        self.retirer = ClientRetirer()
        self.watcher: ConfigWatcher | None = None
        self.last: ReloadResult | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sighup = False
        runtime.metrics.set_config(str(runtime.live.rules.version), runtime.live.digest)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """On the running loop (the lifespan): the SIGHUP handler and the file watcher."""
        self._sighup = add_sighup_handler(self._on_sighup)
        if self.watch_interval_s > 0:
            rt = self._rt
            self.watcher = ConfigWatcher(
                rt.settings.rules,
                lambda: self.reload("watch"),
                lambda: rt.live.digest,
                interval_s=self.watch_interval_s,
            )
            self._spawn(self.watcher.run(), "specgate-config-watch")

    @property
    def handles_sighup(self) -> bool:
        """Whether ``start`` put the SIGHUP handler on the running loop."""
        return self._sighup

    async def stop(self) -> None:
        if self._sighup:
            remove_sighup_handler()
            self._sighup = False
        await cancel_and_wait(self._tasks)
        await self.retirer.close_all()

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_sighup(self) -> None:
        # The runtime's reload, as POST /admin/reload: the routing YAML and every other file it reloads (tenants).
        logger.info("SIGHUP: reloading the routing YAML %s", self._rt.settings.rules)
        self._spawn(self._rt.reload("sighup"), "specgate-config-sighup")

    # -- the attempt -----------------------------------------------------------------------------------------

    async def reload(self, trigger: str, actor: str | None = None) -> ReloadResult:
        """Re-read, validate and (when valid and new) swap the routing YAML; never raises for a bad file."""
        async with self._lock:
            result = await self._attempt(trigger)
            self.last = result
            self._report(result, actor)
            if self._on_result is not None:
                self._on_result(result)
        return result

    async def _attempt(self, trigger: str) -> ReloadResult:

        rt = self._rt
        old = rt.live
        source = str(rt.settings.rules)

        def result(outcome: ReloadOutcome, **kw: Any) -> ReloadResult:
            kw.setdefault("version", old.rules.version)
            kw.setdefault("hash", old.digest)
            return ReloadResult(outcome, trigger, source, previous_hash=old.digest, **kw)

        try:
            text = await asyncio.to_thread(read_config, rt.settings.rules)
        except RulesError as exc:
            return result("invalid", issues=tuple(exc.issues))
        digest = config_digest(text)
        if digest == old.digest:
            return result("unchanged", attempted_hash=digest, message="the file is the config in force")
        try:
            rules = load_rules_text(text, source, rt.settings.stand_in_urls())
        except RulesError as exc:
            return result("invalid", attempted_hash=digest, issues=tuple(exc.issues))
        try:
            new = LiveConfig.build(rules, source, text, previous=old)
        except Exception as exc:
            logger.exception("config reload (%s): building the new config from %s failed", trigger, source)
            return result("error", attempted_hash=digest, message=f"building the new config failed: {exc!r}")
        rt.live = new  # the swap: requests from here on see the new config; those in flight keep the old one
        self.retirer.retire([c for name, c in old.clients.items() if new.clients.get(name) is not c], old.pools)
        dropped: list[Any] = []
        try:
            got: Any = rt.apply_overrides()
            if inspect.isawaitable(got):
                got = await got
            dropped = list(got or ())
        except Exception:
            logger.exception("config reload (%s): re-applying the overrides to the new config failed", trigger)
        message = f"loaded {source} ({old.digest} -> {new.digest})"
        if dropped:
            message += f"; dropped {len(dropped)} override(s) referring to removed pools or classes"
        return result(
            "ok",
            version=new.rules.version,
            hash=new.digest,
            attempted_hash=digest,
            dropped_overrides=tuple(dropped),
            message=message,
        )

    def _report(self, r: ReloadResult, actor: str | None) -> None:
        rt = self._rt
        rt.metrics.config_reloads.labels(r.result).inc()
        if r.result == "ok":
            rt.metrics.set_config(str(r.version), r.hash)
            logger.info("config reload (%s): %s", r.trigger, r.message)
            for o in r.dropped_overrides:
                logger.warning("config reload (%s): override dropped: %s", r.trigger, jsonable(o))
        elif r.result == "invalid":
            logger.error(
                "config reload (%s): %s rejected with %d error(s); the last good config (%s) keeps serving",
                r.trigger,
                r.source,
                len(r.issues),
                r.hash,
            )
            for issue in r.issues:
                logger.error("config reload (%s): %s: %s", r.trigger, r.source, issue)
        elif r.result == "error":
            logger.error(
                "config reload (%s): %s; the last good config (%s) keeps serving", r.trigger, r.message, r.hash
            )
        else:
            logger.info("config reload (%s): %s unchanged (%s)", r.trigger, r.source, r.hash)
        who = actor or default_actor(r.trigger)
        reason = r.error_message() if r.result == "invalid" else r.message
        detail = r.as_dict()
        rt.overrides.record(AuditRecord.now(who, "config_reload", "config", reason, detail))  # the store's audit log
