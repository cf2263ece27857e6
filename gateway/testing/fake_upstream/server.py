"""Running the fake upstream: ``serve_fake_upstream`` (blocking, uvicorn), ``FakeUpstreamServer`` (a real
socket served from a background thread, for tests) and ``main``, the command line of
``python -m gateway.testing.fake_upstream``.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType

import uvicorn

from gateway.testing.fake_upstream.app import create_fake_upstream, fake_state
from gateway.testing.fake_upstream.behavior import FakeConfig
from gateway.testing.fake_upstream.state import FakeState

# --------------------------------------------------------------------------------------------------------------
# Running it


def serve_fake_upstream(config: FakeConfig, host: str, port: int) -> None:
    """Serve a fake upstream with uvicorn until interrupted (blocking)."""
    uvicorn.run(
        create_fake_upstream(config),
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,  # hung requests must not hold up Ctrl-C
    )


class FakeUpstreamServer:
    """A fake upstream on a real socket, served by uvicorn in a background thread (for tests)::

    with FakeUpstreamServer(FakeConfig(name="spec")) as fake:
        ... fake.url ...        # "http://127.0.0.1:<port>"
        fake.state.stats()
    """

    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config if config is not None else FakeConfig()
        self.app = create_fake_upstream(self.config)
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        uv_config = uvicorn.Config(self.app, log_level="warning", log_config=None, lifespan="off", access_log=False)
        self._server = uvicorn.Server(uv_config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> FakeState:
        return fake_state(self.app)

    def start(self, timeout_s: float = 10.0) -> FakeUpstreamServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"fake-upstream-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake upstream on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop at once: requests still in flight (hung ones included) are cancelled, not waited for."""
        self._server.should_exit = True
        self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> FakeUpstreamServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A small deterministic fake of `vllm serve` for tests and demos.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="fake", help="system_fingerprint becomes fake-<name>")
    parser.add_argument("--model", action="append", dest="models", help="served model name (repeatable)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds before the first byte")
    parser.add_argument("--embeddings", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--spec-metrics", action="store_true", help="per-request speculative decoding metrics")
    args = parser.parse_args(argv)
    config = FakeConfig(
        name=args.name,
        tokens=args.tokens,
        token_delay_s=args.token_delay,
        first_token_delay_s=args.first_token_delay,
        embeddings=args.embeddings,
        api_key=args.api_key,
        spec_metrics=args.spec_metrics,
    )
    if args.models:
        config.models = list(args.models)
    serve_fake_upstream(config, args.host, args.port)
