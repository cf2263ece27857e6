"""Shared fixtures: real uvicorn servers in threads (the gateway and fake vLLM upstreams), a private redis-server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from starlette.types import ASGIApp

from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.proxy.limits import client_limits, http_protocol
from gateway.testing.fake_upstream import FakeConfig, FakeUpstreamServer

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
SPEC_ONLY_MODEL = "spec-only-model"


class ServerThread:
    """Any ASGI app on a real loopback socket, served by uvicorn in a background thread."""

    def __init__(self, app: ASGIApp, **config: Any) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        options: dict[str, Any] = {
            "log_config": None,
            "access_log": False,
            "lifespan": "on",
            "timeout_graceful_shutdown": 1,
            **config,
        }
        self._server = uvicorn.Server(uvicorn.Config(app, **options))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def poll(check: Callable[[], bool], timeout_s: float) -> bool:
    """True as soon as ``check()`` is; else its last answer after ``timeout_s`` (checked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def closed_port_url() -> str:
    """A URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def rules_for(spec_urls: list[str], std_urls: list[str], **overrides: Any) -> dict[str, Any]:
    """A small routing config: a speculative home for low-temperature code/structured work, standard otherwise.
    Static routes (``defaults.controller: null``): a test that asserts where a request went must not depend on the
    built-in balancing controller's draws (it has tests of its own); a test that wants controllers gives them."""
    rules: dict[str, Any] = {
        "version": 1,
        "defaults": {"temperature": 1.0, "max_attempts": 2, "controller": None},
        "pools": [
            {
                "name": "spec",
                "kind": "speculative",
                "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
                "models": [MODEL, SPEC_ONLY_MODEL],
                "endpoints": [{"url": u, "id": f"spec-{i}"} for i, u in enumerate(spec_urls)],
                "timeouts": {"connect_s": 1, "first_byte_s": 5, "total_s": 30},
            },
            {
                "name": "std",
                "kind": "standard",
                "models": [MODEL],
                "endpoints": [{"url": u, "id": f"std-{i}"} for i, u in enumerate(std_urls)],
                "timeouts": {"connect_s": 1, "first_byte_s": 5, "total_s": 30},
            },
        ],
        "task_rules": [
            {"task": "structured", "response_format": {"in": ["json_object", "json_schema"]}},
            {"task": "code", "patterns": [r"\bpython\b", r"```", r"\bdef \w+\("]},
        ],
        "classes": [
            {
                "name": "precise",
                "when": {"temperature": {"lte": 0.5}, "task_type": {"in": ["code", "structured"]}},
                "route": {"preferred": "spec", "saturated": "std", "fallback": ["std"]},
            },
            {"name": "default", "route": {"preferred": "std", "fallback": ["spec"]}},
        ],
    }
    rules.update(overrides)
    return rules


def started_sims(n: int, *, time_scale: float, median: int, max_num_seqs: int) -> Iterator[list[Any]]:
    """``n`` in-process simulated vLLM servers (answers of exactly ``median`` tokens, seeds 0..n-1), stopped after
    the test: the body of a fixture."""
    from gateway.sim.server import SimOptions, SimServer
    from gateway.sim.wire import OutputLengths

    started = [
        SimServer(
            SimOptions(
                model=MODEL,
                port=0,
                time_scale=time_scale,
                output_lengths=OutputLengths(median=median, sigma=0),
                max_num_seqs=max_num_seqs,
                seed=i,
            )
        ).start()
        for i in range(n)
    ]
    yield started
    for sim in started:
        sim.stop()


def static_routes(rules: dict[str, Any]) -> dict[str, Any]:
    """``defaults.controller: null`` on a rules dict: classes without a controller block of their own keep their
    static route (the explicit opt-out of the built-in balancing controller). Returns the same dict."""
    rules["defaults"] = {**(rules.get("defaults") or {}), "controller": None}
    return rules


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeUpstreamServer]]:
    started: list[FakeUpstreamServer] = []

    def start(name: str = "fake", **kw: Any) -> FakeUpstreamServer:
        kw.setdefault("models", [MODEL, SPEC_ONLY_MODEL])
        server = FakeUpstreamServer(FakeConfig(name=name, **kw)).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(rules: dict[str, Any], **settings: Any) -> ServerThread:
        path = tmp_path / f"rules-{len(started)}.yaml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        settings.setdefault("health_interval_s", 0.2)
        settings.setdefault("health_timeout_s", 0.5)
        config = Settings(rules=path, host="127.0.0.1", port=8080, **settings)
        app = create_app(config)
        # as ``specgate serve``: the client limits, and the client address is the socket peer
        server = ServerThread(app, http=http_protocol(client_limits(config)), proxy_headers=False).start()
        started.append(server)
        deadline = time.monotonic() + 5
        while app.state.runtime.health.rounds == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return server

    yield start
    for s in started:
        s.stop()


class RedisServer:
    """A private ``redis-server`` on a free loopback port (never the shared 6379), no persistence.

    ``stop()`` kills it (a crashed Redis), ``start()`` brings it back on the same port (empty), so tests can check
    that the gateway notices an outage and recovers by itself.
    """

    def __init__(self, binary: str, workdir: Path) -> None:
        self._binary = binary
        self._workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> RedisServer:
        if self._proc is not None and self._proc.poll() is None:
            return self
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self._workdir), "--daemonize", "no", "--loglevel", "warning"]
        log = self._workdir / "redis.log"
        with log.open("ab") as out:  # the child keeps its own copy of the descriptor
            self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self._ping():
            if self._proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:].strip()
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh private redis-server for one test (``.url``, ``.port``, ``.stop()``, ``.start()``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (CI installs it: .ci/run; locally: apt-get install redis-server)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


ADMIN_TOKEN = "served-admin-token"


class Served:
    """One ``python -m gateway serve`` process (``--workers N``), with its admin listener; its output in ``log``."""

    def __init__(self, rules: Path, log: Path, *, workers: int, redis_url: str | None, args: list[str]) -> None:
        def free() -> int:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port: int = sock.getsockname()[1]
            return port

        self.rules, self.log, self.workers = rules, log, workers
        self.port, self.admin_port = free(), free()
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_") and "multiproc_dir" not in k.lower()
        }
        env.update(SPECGATE_ADMIN_TOKEN=ADMIN_TOKEN, SPECGATE_LOG_LEVEL="warning", TMPDIR=str(log.parent))
        cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--admin-port", str(self.admin_port), "--workers", str(workers)]
        cmd += ["--redis-url", redis_url] if redis_url is not None else (["--per-worker-state"] if workers > 1 else [])
        with log.open("ab") as out:
            self.proc = subprocess.Popen(cmd + args, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float = 60) -> Served:
        """Ready on several fresh connections in a row (so every worker answered), admin API included."""
        deadline, in_a_row = time.monotonic() + timeout_s, 0  # a loaded CI machine starts workers slowly
        while in_a_row < 4 * self.workers:
            assert self.proc.poll() is None, f"gateway exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"gateway not ready:\n{self.output()}"
            try:
                ok = httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
                ok = ok and httpx.get(f"{self.admin}/admin/config", headers=ADMIN_AUTH, timeout=2).status_code == 200
            except httpx.TransportError:
                ok = False
            in_a_row = in_a_row + 1 if ok else 0
            if not ok:
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


ADMIN_AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Start ``specgate serve`` as a process: ``served(rules, workers=2, redis_url=..., args=[...])``."""
    started: list[Served] = []

    def start(
        rules: dict[str, Any], *, workers: int = 1, redis_url: str | None = None, args: Sequence[str] = ()
    ) -> Served:
        path = tmp_path / f"rules-{len(started)}.yaml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        gw = Served(path, tmp_path / f"serve-{len(started)}.log", workers=workers, redis_url=redis_url, args=list(args))
        started.append(gw)
        return gw.wait_ready()

    yield start
    for gw in started:
        gw.stop()


# Tests skip when an external tool is missing; the end of the run names them and how to install them, since a green
# run with fifty skips looks the same as a full one. (A reason names the tool; the first match counts.)
MISSING_TOOLS: tuple[tuple[str, str], ...] = (
    ("helm", "tools/install-ci-tools.sh"),
    ("promtool", "tools/install-ci-tools.sh"),
    ("prometheus server", "tools/install-ci-tools.sh"),
    ("redis-server", "apt-get install redis-server"),
    ("chromium", "apt-get install chromium"),
    ("playwright", "pip install -e '.[dev]'"),
)


def skipped_tools(reasons: list[str]) -> str | None:
    """One line naming the missing tools that made tests skip, with how many and the command that installs each;
    None when no test skipped for a missing tool."""
    counts: dict[str, int] = {}
    for reason in reasons:
        text = reason.lower()
        for tool, _ in MISSING_TOOLS:
            if tool in text:
                counts[tool] = counts.get(tool, 0) + 1
                break
    if not counts:
        return None
    install = dict(MISSING_TOOLS)
    commands = " and ".join(dict.fromkeys(install[t] for t in counts))
    named = ", ".join(f"{tool}: {n}" for tool, n in counts.items())
    return f"{sum(counts.values())} tests skipped for missing tools ({named}); install them with {commands}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reasons: list[str] = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons.append(str(longrepr[2]))
    line = skipped_tools(reasons)
    if line is not None:
        terminalreporter.write_line(line, yellow=True, bold=True)
