"""``specgate demo``: the gateway plus one simulated vLLM server per pool, on this machine, no GPU.

The routing YAML is used as it is, except that every pool's endpoints are replaced by a local simulated
server serving the pool's models. The simulated servers are child processes, stopped with the gateway.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gateway.settings import Settings

# Per pool kind, how fast the stand-in generates (seconds per token): the speculative pool is faster at
# low load, as it would be with a good draft.
_TOKEN_DELAY = {"speculative": 0.012, "standard": 0.025}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_port(port: int, timeout_s: float = 15.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {host}:{port} after {timeout_s:g}s")


def start_upstream(name: str, models: list[str], token_delay_s: float, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway.testing.fake_upstream", "--port", str(port), "--name", name]
    for m in models:
        cmd += ["--model", m]
    cmd += ["--token-delay", str(token_delay_s)]
    return subprocess.Popen(cmd)


def demo_rules(rules: dict[str, Any], ports: dict[str, int]) -> dict[str, Any]:
    """The same rules, with each pool's endpoints replaced by its local simulated server."""
    out = dict(rules)
    pools = []
    for pool in rules.get("pools", []):
        p = dict(pool)
        p["endpoints"] = [{"url": f"http://127.0.0.1:{ports[p['name']]}", "weight": 1, "id": f"{p['name']}-sim-0"}]
        p.pop("api_key_env", None)
        pools.append(p)
    out["pools"] = pools
    return out


def run_demo(rules_path: Path, port: int) -> None:
    from gateway.cli import run_server

    if not rules_path.exists():
        raise RuntimeError(f"{rules_path} not found (run from the repository root, or pass --rules)")
    rules = yaml.safe_load(rules_path.read_text())
    ports = {p["name"]: free_port() for p in rules["pools"]}
    procs = [
        start_upstream(p["name"], list(p["models"]), _TOKEN_DELAY.get(p.get("kind", ""), 0.02), ports[p["name"]])
        for p in rules["pools"]
    ]
    try:
        for p in ports.values():
            wait_for_port(p)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="specgate-demo-", delete=False) as f:
            yaml.safe_dump(demo_rules(rules, ports), f, sort_keys=False)
        print(
            f"specgate demo: gateway on http://127.0.0.1:{port}/v1, simulated pools "
            + ", ".join(f"{n} on :{p}" for n, p in ports.items()),
            flush=True,
        )
        run_server(Settings(rules=Path(f.name), host="127.0.0.1", port=port, health_interval_s=2.0))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
