"""Serving the gateway: the client listener and, next to it, the admin listener.

One worker: both are uvicorn servers in one event loop sharing the one ``Runtime``: the main app's lifespan starts
and stops it, the admin app has no lifespan. Only the main server handles SIGINT / SIGTERM; the admin server stops as
soon as the main one starts shutting down (or ends for any other reason), so Ctrl-C stops both. SIGHUP reloads the
routing YAML: the main app's lifespan (``Runtime.start``, ``gateway.runtime.reload``) adds its handler to the loop.

``--workers N``: uvicorn's supervisor (``Supervisor``) binds the client socket and, here, the admin socket too, and
hands both to every worker. Each worker runs one uvicorn server on both sockets; its app sends the connections that
reached the admin port to its own admin app (``GatewayApp.serve_admin_on``), so whichever worker the kernel gives a
connection answers it. What they answer is the same across workers because the state behind it is shared:
with Redis every worker is a replica of the cluster (``gateway.cluster``: one leader scrapes and runs the
controllers, every worker routes on its snapshot and shows it), overrides and the audit log are in Redis, and a
``POST /admin/reload`` reloads every worker before it answers (``gateway.runtime.workers``). Without Redis
(``--per-worker-state``) each worker has its own overrides, so the admin API refuses override changes (409
``per_worker_state``) rather than apply them to one worker; reads answer that worker's view and say so, and a
reload still reaches every worker. SIGHUP to the supervisor reloads every worker in place, as with one worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.supervisors import Multiprocess

from gateway.admin.app import create_admin_app
from gateway.admin.protocol import TOKEN_ENV
from gateway.cli.console import fail as _fail
from gateway.config.settings import Settings, SettingsError
from gateway.proxy.app import GatewayApp, create_app_from_env
from gateway.proxy.limits import client_limits, http_protocol
from gateway.runtime.workers import GROUP_DIR_ENV

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
        task = asyncio.current_task()
        if task is not None:  # log lines name the listener they come from (gateway.observability.logs)
            task.set_name("client")
        if self.admin is None:
            await self.main.serve()
            return
        admin = asyncio.create_task(
            self.admin.serve(sockets=[self.admin_socket] if self.admin_socket else None), name="admin"
        )
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


def admin_listener(
    application: GatewayApp, settings: Settings, environ: Mapping[str, str] | None = None
) -> tuple[Starlette, socket.socket, str | None] | None:
    """The admin app over ``application``'s runtime and its bound socket (None with ``--admin-port 0``), checked
    before anything serves. Raises ``AdminSetupError``."""
    if settings.admin_port == 0:
        return None
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
    return admin_app, sock, token


def _announce_admin(host: str, port: int, token: str | None, workers: int) -> None:
    shown = f"[{host}]" if ":" in host else host
    access = "token required" if token is not None else f"read-only, no {TOKEN_ENV} set"
    served = f", served by each of the {workers} workers" if workers > 1 else ""
    logger.info("admin API on http://%s:%d/admin (%s%s)", shown, port, access, served)


def build_listeners(
    application: GatewayApp, settings: Settings, common: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> Listeners:
    """The servers of a one-worker gateway. ``common``: uvicorn.Config arguments shared by both (host and port are
    the main listener's). Binds the admin socket now, so that a port in use fails before anything serves.
    Raises ``AdminSetupError``."""
    main = uvicorn.Server(uvicorn.Config(application, **common))
    admin = admin_listener(application, settings, environ)
    if admin is None:
        return Listeners(main)
    admin_app, sock, token = admin
    kw = {k: v for k, v in common.items() if k not in ("host", "port")}
    kw.update(host=settings.admin_host, port=sock.getsockname()[1], lifespan="off", timeout_graceful_shutdown=1)
    server = AdminServer(uvicorn.Config(admin_app, **kw), main)
    _announce_admin(settings.admin_host, kw["port"], token, 1)
    return Listeners(main, server, sock)


class Supervisor(Multiprocess):
    """uvicorn's supervisor of ``--workers N``, except that SIGHUP reloads every worker's routing YAML in place
    (as it does in a one-worker gateway) instead of replacing the workers. Only workers in the group directory get
    it: they are the ones whose handler is in place (a worker still starting would be killed by a SIGHUP, and loads
    the file as it starts anyway)."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], group: Path) -> None:
        super().__init__(config, sockets)
        self.group = group

    def handle_hup(self) -> None:
        ready = {f.stem for f in self.group.glob("*.json")}
        logger.info("SIGHUP: reloading the routing YAML in every worker (%d ready)", len(ready))
        for process in self.processes:
            if process.pid is not None and str(process.pid) in ready:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)


def worker_app() -> GatewayApp:
    """uvicorn's factory in each worker of ``--workers N``: the gateway app (settings from the environment), which
    also serves the admin app on the admin socket the supervisor bound (``--admin-port``; 0: none)."""
    app = create_app_from_env()
    settings = app.runtime.settings
    if settings.admin_port:
        app.serve_admin_on(settings.admin_port, create_admin_app(app.runtime, admin_token()))
    return app


def run_server(settings: Settings) -> None:

    from gateway.config.loader import RulesError
    from gateway.observability.logs import configure_logging
    from gateway.observability.tracing import TracingUnavailable
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
    except (SettingsError, OSError, ValueError, TracingUnavailable) as exc:  # ValueError: an OTEL_* variable
        raise _fail(str(exc)) from exc
    tune_gc()
    common = {
        "host": settings.host,
        "port": settings.port,
        "log_config": None,
        "access_log": False,
        "loop": "uvloop",
        "http": http_protocol(client_limits(settings)),  # uvicorn's httptools, with the client limits
        # The ASGI client address stays the socket peer: uvicorn would otherwise take it from a loopback client's
        # X-Forwarded-For. Which peers may speak for others is --trusted-proxies (gateway.proxy.headers).
        "proxy_headers": False,
        "timeout_graceful_shutdown": 30,
    }
    if settings.workers == 1:
        try:
            listeners = build_listeners(application, settings, common)  # the admin listener too, unless port 0
        except AdminSetupError as exc:
            raise _fail(str(exc)) from exc
        listeners.run()
    else:
        _serve_workers(application, settings, common)


def _serve_workers(application: GatewayApp, settings: Settings, common: Mapping[str, Any]) -> None:
    try:
        admin = admin_listener(application, settings)  # checked and bound here, served by every worker
    except AdminSetupError as exc:
        raise _fail(str(exc)) from exc
    os.environ.update(settings.to_env())
    # One view of the metrics across workers (gateway/observability/metrics.py): a private directory for
    # prometheus_client's multiprocess mode, set before uvicorn spawns the workers (fresh interpreters, which import
    # prometheus_client with it set; this process imported it before, so it writes nothing there).
    metrics_dir = tempfile.mkdtemp(prefix="specgate-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    group_dir = tempfile.mkdtemp(prefix="specgate-workers-")  # the workers' config digests (gateway.runtime.workers)
    os.environ[GROUP_DIR_ENV] = group_dir
    config = uvicorn.Config("gateway.cli.serve:worker_app", factory=True, workers=settings.workers, **common)
    sockets = [config.bind_socket()]
    if admin is not None:
        sockets.append(admin[1])
        _announce_admin(settings.admin_host, admin[1].getsockname()[1], admin[2], settings.workers)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            Supervisor(config, sockets, Path(group_dir)).run()
    finally:
        for sock in sockets:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(group_dir, ignore_errors=True)
