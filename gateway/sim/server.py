"""Running a simulated ``vllm serve``: ``SimServer`` (uvicorn on a socket it owns, in this thread or a background
one) and ``run_sim`` (blocking, uvloop + httptools, one process). The ``specgate sim`` command that starts one is
``gateway.sim.command``.

Refusing connections: ``SimServer`` is the app's ``ListenerControl``. To refuse it closes uvicorn's listening
servers (the socket goes with them, so a connect gets ECONNREFUSED) and asks every open connection to shut down
the way uvicorn does at exit (idle keep-alive connections close, in-flight responses finish first). To listen
again it binds a fresh socket to the same address and hands it to ``loop.create_server`` with the protocol
uvicorn itself builds (same config, server state and lifespan state), so new connections are served as before.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

from gateway.sim.app import SimOptions, SimState, create_sim_app, sim_state
from gateway.sim.faults import Faults


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class SimServer:
    """One simulated vLLM server on a real socket::

    with SimServer(SimOptions(port=0, time_scale=0.05)) as sim:   # a background thread
        ... sim.url ...

    ``run()`` serves in the calling thread until interrupted; ``await serve()`` in a running loop.
    """

    def __init__(self, options: SimOptions, *, loop: str = "auto", http: str = "auto") -> None:
        self.options = options
        self.app = create_sim_app(options)
        self.state: SimState = sim_state(self.app)
        self.state.faults.listener = self
        self.host = options.host
        self._sock = _bind(options.host, options.port)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            loop=loop,
            http=http,
            lifespan="on",
            log_level=options.log_level,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,  # hung requests must not hold up Ctrl-C
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        initial = asyncio.create_task(self._apply_initial_faults())
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            initial.cancel()

    async def _apply_initial_faults(self) -> None:
        while not self._server.started:  # noqa: ASYNC110 - uvicorn's `started` is a plain flag, no event
            await asyncio.sleep(0.005)
        await self.state.faults.apply(self.state.faults.faults)  # refuse_connections given as a flag

    def run(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C) or ``stop()``."""
        with asyncio.Runner(loop_factory=self._server.config.get_loop_factory()) as runner:
            runner.run(self.serve())

    async def set_listening(self, listening: bool) -> None:
        """Stop listening (connections are refused) or listen again on the same address. Runs in the server's
        loop (the app calls it)."""
        server = self._server
        if not listening:
            for srv in server.servers:
                srv.close()
            server.servers = []
            for connection in list(server.server_state.connections):
                connection.shutdown()  # idle keep-alive connections close; in-flight ones after their response
            return
        if server.servers:
            return
        config, server_state, app_state = server.config, server.server_state, server.lifespan.state

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=server_state, app_state=app_state
            )

        sock = _bind(self.host, self.port)
        srv = await asyncio.get_running_loop().create_server(protocol, sock=sock, backlog=config.backlog)
        server.servers.append(srv)

    def update_faults(self, patch: dict[str, Any], timeout_s: float = 5.0) -> Faults:
        """Merge ``patch`` into the faults in force, from any thread (the in-process twin of ``PUT /sim/faults``,
        which cannot be reached while the server refuses connections). Raises ValueError on a bad patch."""
        faults = self.state.faults.faults.merged(patch)
        loop = self._loop
        if loop is None or not self.started:
            raise RuntimeError("the simulator is not running")
        future = asyncio.run_coroutine_threadsafe(self.state.faults.apply(faults), loop)
        return future.result(timeout_s)

    # -- background thread (tests, the demo) ------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> SimServer:
        self._thread = threading.Thread(target=self.run, name=f"sim-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"simulator on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop: in-flight requests get a second to finish, then are cancelled; the engine stops."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def run_sim(options: SimOptions) -> None:
    """Serve one simulated vLLM server until interrupted (blocking; uvloop and httptools, one process)."""
    SimServer(options, loop="uvloop", http="httptools").run()
