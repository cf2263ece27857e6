"""Local simulated servers standing in for a routing YAML's pools: their command lines, ports and the rewritten YAML.

Used by ``specgate demo`` and the benchmarks. Each pool gets one ``specgate sim`` server (the 70B preset;
speculative pools run with the ``--speculative-config`` their YAML block describes), an embeddings pool the fake
vLLM. Works on the YAML as plain data: nothing here imports the gateway.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

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
            cmd += ["--time-scale", str(time_scale), "--enable-responses-store"]  # previous_response_id works
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


def stand_in_rules(rules: dict[str, Any], ports: dict[str, int]) -> dict[str, Any]:
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
