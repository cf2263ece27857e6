"""``specgate demo``: the gateway plus one simulated vLLM server per pool, on this machine, no GPU.

The routing YAML is used as it is, except that every pool's endpoints are replaced by a local ``specgate sim``
server (the 70B preset; speculative pools run with the ``--speculative-config`` their YAML block describes).
The simulated servers are child processes, stopped with the gateway.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.settings import Settings

# Draft models the simulated speculative servers name when the YAML's pool does not (vLLM requires one for
# these methods; the simulator only uses the name to pick the draft's cost model).
_DEFAULT_DRAFT = {
    "draft_model": "meta-llama/Llama-3.2-1B-Instruct",
    "eagle": "yuhuili/EAGLE-LLaMA3.1-Instruct-70B",
    "eagle3": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
    "dflash": "z-lab/Llama-3.3-70B-Instruct-DFlash",
}
PRESET = "llama70b-4xh100"


@dataclass(frozen=True, slots=True)
class StandIn:
    """One local server standing in for a pool: the simulator, or for an embeddings pool the fake vLLM."""

    pool: str
    port: int
    cmd: list[str]


def spec_config_json(pool: dict[str, Any]) -> str | None:
    """The ``--speculative-config`` JSON a vLLM server of this pool would run with."""
    spec = pool.get("speculative")
    if pool.get("kind") != "speculative" or not isinstance(spec, dict):
        return None
    method = spec.get("method", "eagle3")
    cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": spec.get("num_speculative_tokens", 4)}
    model = spec.get("draft_model") or _DEFAULT_DRAFT.get(method)
    if model:
        cfg["model"] = model
    return json.dumps(cfg)


def plan_stand_ins(rules: dict[str, Any], ports: dict[str, int], *, time_scale: float = 1.0) -> list[StandIn]:
    py = sys.executable
    out: list[StandIn] = []
    for pool in rules.get("pools", []):
        name, port, models = pool["name"], ports[pool["name"]], list(pool["models"])
        if name == rules.get("embeddings_pool"):
            cmd = [py, "-m", "gateway.testing.fake_upstream", "--port", str(port), "--name", name, "--embeddings"]
            for m in models:
                cmd += ["--model", m]
        else:
            cmd = [py, "-m", "gateway", "sim", models[0], "--port", str(port), "--preset", PRESET]
            cmd += ["--time-scale", str(time_scale)]
            for m in models:
                cmd += ["--served-model-name", m]
            spec = spec_config_json(pool)
            if spec is not None:
                cmd += ["--speculative-config", spec, "--per-request-spec-decode-metrics", "summary"]
        out.append(StandIn(name, port, cmd))
    return out


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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_demo(rules_path: Path, port: int, *, time_scale: float = 1.0) -> None:
    from gateway.cli import run_server

    if not rules_path.exists():
        raise RuntimeError(f"{rules_path} not found (run from the repository root, or pass --rules)")
    rules = yaml.safe_load(rules_path.read_text())
    ports = {p["name"]: free_port() for p in rules["pools"]}
    stand_ins = plan_stand_ins(rules, ports, time_scale=time_scale)
    procs = [subprocess.Popen(s.cmd) for s in stand_ins]
    # uvicorn re-raises a captured SIGTERM once it has shut down; under the default handler that would end this
    # process before the ``finally`` below and leave the simulated servers running. Exit through Python instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="specgate-demo-") as tmp:
        try:
            for s in stand_ins:
                wait_for_port(s.port)
            path = Path(tmp) / "rules.yaml"
            path.write_text(yaml.safe_dump(demo_rules(rules, ports), sort_keys=False))
            admin_port = port + 1 if port < 65535 else port - 1
            print(_banner(rules, ports, port, admin_port), flush=True)
            settings = Settings(rules=path, host="127.0.0.1", port=port, health_interval_s=2.0, admin_port=admin_port)
            run_server(settings)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)


def _banner(rules: dict[str, Any], ports: dict[str, int], port: int, admin_port: int) -> str:
    model = rules["pools"][0]["models"][0]
    pools = ", ".join(f"{p['name']} ({p.get('kind')}) on :{ports[p['name']]}" for p in rules["pools"])
    return f"""
specgate demo — gateway on http://127.0.0.1:{port}/v1
simulated vLLM servers ({PRESET}): {pools}

  curl -s http://127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "temperature": 0.2, "max_tokens": 256,
         "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}' -i

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="demo")
  r = client.chat.completions.with_raw_response.create(model="{model}", max_tokens=64,
        messages=[{{"role": "user", "content": "Tell me a story"}}])
  print(r.headers["x-specgate-class"], r.headers["x-specgate-pool"], r.parse().choices[0].message.content)

Why a request goes where it goes (admin API on http://127.0.0.1:{admin_port}/admin, read-only without a token):

  echo '{{"model": "{model}", "temperature": 0.2,
         "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}' \\
    | specgate explain - --url http://127.0.0.1:{admin_port}

Ctrl-C stops the gateway and the simulated servers.
"""
