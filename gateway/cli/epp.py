"""``specgate epp``: the Endpoint Picker for Envoy's ext_proc (``gateway.epp``) on one event loop with the admin
listener and a small HTTP listener for Prometheus and probes (``/metrics``, ``/ready``, ``/health``).

The runtime is the proxy's (``Runtime.from_settings``): the same YAML, classification, controllers, overrides,
admission and metrics, and with ``--redis-url`` the same cluster of replicas. ``--port`` is the gRPC port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.admin.app import create_admin_app
from gateway.cli.console import fail as _fail
from gateway.cli.serve import AdminSetupError, admin_token, bind, is_loopback
from gateway.config.settings import Settings, SettingsError
from gateway.epp.server import DEFAULT_USAGE_BYTES, EppServer
from gateway.proxy.app import health, metrics, ready
from gateway.runtime.container import Runtime

logger = logging.getLogger("specgate")


def probe_app(rt: Runtime) -> Starlette:
    """``/metrics`` (the gateway's Prometheus metrics), ``/ready`` and ``/health`` over HTTP."""
    app = Starlette(
        routes=[
            Route("/metrics", metrics, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
    app.state.runtime = rt
    return app


class _Listener(uvicorn.Server):
    """A uvicorn server on a socket bound here, without signal handlers of its own (``serve_epp`` owns them)."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        super().__init__(
            uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        )
        self.socket = bind(host, port)
        self.bound_port: int = self.socket.getsockname()[1]

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(frozen=True, slots=True)
class KubeSource:
    """``--kube-selector``: the pools' endpoints are the pods matching ``selector`` in ``namespace`` (``gateway.epp
    .kube``), on ``port``."""

    selector: str
    namespace: str | None
    port: int


async def serve_epp(
    settings: Settings, metrics_port: int, usage_bytes: int = DEFAULT_USAGE_BYTES, kube: KubeSource | None = None
) -> None:
    rt = Runtime.from_settings(settings)
    epp = EppServer(rt, settings.host, settings.port, usage_bytes=usage_bytes)
    servers: list[_Listener] = []
    if settings.admin_port:
        token = admin_token()
        if token is None and not is_loopback(settings.admin_host):
            raise AdminSetupError(f"the admin listener on {settings.admin_host} (not loopback) needs a token")
        admin = _Listener(create_admin_app(rt, token), settings.admin_host, settings.admin_port)
        servers.append(admin)
        logger.info("admin API on http://%s:%d/admin", settings.admin_host, admin.bound_port)
    if metrics_port:
        probes = _Listener(probe_app(rt), settings.host, metrics_port)
        servers.append(probes)
        logger.info("metrics and probes on http://%s:%d/metrics", settings.host, probes.bound_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await epp.start()
    tasks = [asyncio.create_task(s.serve(sockets=[s.socket])) for s in servers]
    watcher = None
    if kube is not None:
        from gateway.epp.kube import KubeEndpoints, PodWatcher, api_client, own_namespace

        namespace = kube.namespace or own_namespace()
        watcher = PodWatcher(api_client(), namespace, kube.selector, loop)
        watcher.start()
        tasks.append(asyncio.create_task(KubeEndpoints(rt, watcher, kube.port).run(), name="specgate-kube"))
        logger.info("pool endpoints: the pods matching %r in namespace %s, port %d", kube.selector, namespace,
                    kube.port)  # fmt: skip
    try:
        await stop.wait()
    finally:
        logger.info("specgate EPP stopping")
        for s in servers:
            s.should_exit = True
        if watcher is not None:
            watcher.stop()
            tasks[-1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await epp.stop()
        for s in servers:
            s.socket.close()


def run_epp(
    settings: Settings, metrics_port: int, usage_bytes: int = DEFAULT_USAGE_BYTES, kube: KubeSource | None = None
) -> None:
    from gateway.config.loader import RulesError
    from gateway.observability.logs import configure_logging

    configure_logging(settings.log_level)
    try:
        asyncio.run(serve_epp(settings, metrics_port, usage_bytes, kube))
    except RulesError as exc:
        raise _fail(f"invalid routing rules:\n{exc}") from exc
    except (SettingsError, AdminSetupError, OSError) as exc:
        raise _fail(str(exc)) from exc
