"""Serving one gateway process: the client listener and, next to it, the admin listener, in one event loop.

Both are uvicorn servers sharing the one ``Runtime``: the main app's lifespan starts and stops it, the admin app has
no lifespan. Only the main server handles SIGINT / SIGTERM; the admin server stops as soon as the main one starts
shutting down (or ends for any other reason), so Ctrl-C stops both. SIGHUP reloads the routing YAML: the main app's
lifespan (``Runtime.start``, ``gateway.runtime.reload``) adds its handler to the running loop.

With several workers each process has its own state (controllers, in-flight counts), so one admin listener could
only show one worker's view: ``specgate serve --workers N`` does not start it (yet) and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.admin.app import create_admin_app
from gateway.admin.protocol import TOKEN_ENV
from gateway.cli.console import fail as _fail
from gateway.config.settings import Settings, SettingsError
from gateway.proxy.app import GatewayApp
from gateway.proxy.limits import head_limits, http_protocol

logger = logging.getLogger("specgate")


class AdminSetupError(RuntimeError):
    """The admin listener cannot start as configured (checked before anything listens)."""


class AdminServer(uvicorn.Server):
    """The admin listener: no signal handlers of its own; exits when ``main`` does."""

    def __init__(self, config: uvicorn.Config, main: uvicorn.Server) -> None:
        super().__init__(config)
        self._main = main

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the main server owns SIGINT / SIGTERM

    async def on_tick(self, counter: int) -> bool:
        return self._main.should_exit or await super().on_tick(counter)


def admin_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``SPECGATE_ADMIN_TOKEN``, None when unset or empty."""
    value = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    return value or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


@dataclass(slots=True)
class Listeners:
    """The uvicorn servers of a one-worker gateway: the client listener and, unless ``--admin-port 0``, the
    admin listener on its own socket, served in one event loop."""

    main: uvicorn.Server
    admin: AdminServer | None = None
    admin_socket: socket.socket | None = None

    async def serve(self) -> None:
        if self.admin is None:
            await self.main.serve()
            return
        admin = asyncio.create_task(self.admin.serve(sockets=[self.admin_socket] if self.admin_socket else None))
        try:
            await self.main.serve()
        finally:
            self.admin.should_exit = True
            await admin

    def run(self) -> None:
        with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(self.serve())
        if self.admin_socket is not None:
            self.admin_socket.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it; without it, asyncio's own loop
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def build_listeners(
    application: GatewayApp, settings: Settings, common: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> Listeners:
    """The servers of a one-worker gateway. ``common``: uvicorn.Config arguments shared by both (host and port are
    the main listener's). Binds the admin socket now, so that a port in use fails before anything serves.
    Raises ``AdminSetupError``."""
    main = uvicorn.Server(uvicorn.Config(application, **common))
    if settings.admin_port == 0:
        return Listeners(main)
    token = admin_token(environ)
    host, port = settings.admin_host, settings.admin_port
    if token is None and not is_loopback(host):
        raise AdminSetupError(
            f"the admin listener on {host} (not loopback) needs a token: set {TOKEN_ENV}, "
            "or --admin-host 127.0.0.1, or --admin-port 0 to turn it off"
        )
    try:
        admin_app = create_admin_app(application.state.runtime, token)
    except ValueError as exc:
        raise AdminSetupError(str(exc)) from exc
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise AdminSetupError(f"cannot listen for the admin API on {host}:{port}: {exc} (--admin-port 0: off)") from exc
    kw = {k: v for k, v in common.items() if k not in ("host", "port")}
    kw.update(host=host, port=sock.getsockname()[1], lifespan="off", timeout_graceful_shutdown=1)
    admin = AdminServer(uvicorn.Config(admin_app, **kw), main)
    shown = f"[{host}]" if ":" in host else host
    access = "token required" if token is not None else f"read-only, no {TOKEN_ENV} set"
    logger.info("admin API on http://%s:%d/admin (%s)", shown, kw["port"], access)
    return Listeners(main, admin, sock)


def run_server(settings: Settings) -> None:
    import uvicorn

    from gateway.config.loader import RulesError
    from gateway.observability.logs import configure_logging
    from gateway.proxy.app import create_app, tune_gc

    configure_logging(settings.log_level)
    problem = settings.shared_state_problem()
    if problem is not None:
        raise _fail(problem)
    if settings.workers > 1 and settings.redis_url is None:
        logger.warning("--per-worker-state: %d workers, each with its own idempotency records", settings.workers)
    try:
        application = create_app(settings)  # validates the YAML and the key file before listening
    except RulesError as exc:
        raise _fail(f"invalid routing rules:\n{exc}") from exc
    except (SettingsError, OSError) as exc:
        raise _fail(str(exc)) from exc
    tune_gc()
    common = {
        "host": settings.host,
        "port": settings.port,
        "log_config": None,
        "access_log": False,
        "loop": "uvloop",
        "http": http_protocol(head_limits(settings)),  # uvicorn's httptools, with the request-head limits
        "timeout_graceful_shutdown": 30,
    }
    if settings.workers == 1:
        try:
            listeners = build_listeners(application, settings, common)  # the admin listener too, unless port 0
        except AdminSetupError as exc:
            raise _fail(str(exc)) from exc
        listeners.run()
    else:
        if settings.admin_port:
            logging.getLogger("specgate").warning(
                "the admin API is not available with several workers yet (each has its own state): not started"
            )
        os.environ.update(settings.to_env())
        # One view of the metrics across workers (gateway/observability/metrics.py): a private directory for
        # prometheus_client's
        # multiprocess mode, set before uvicorn spawns the workers (fresh interpreters, which import
        # prometheus_client with it set; this process imported it before, so it writes nothing there).
        metrics_dir = tempfile.mkdtemp(prefix="specgate-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        try:
            uvicorn.run(
                "gateway.proxy.app:create_app_from_env",
                factory=True,
                workers=settings.workers,
                **common,  # type: ignore[arg-type]
            )
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
