"""A peer router in front of the bench's simulated servers: the Rust ``vllm-router`` (PyPI ``vllm-router``).

``specgate bench policies`` runs it where the gateway would run, in front of the same simulated servers, so that
its routing is measured on the same traffic and the same physics:

- ``peer-cache-aware``: the homogeneous fleet (every server standard) behind ``--policy cache_aware`` (a radix tree
  of the request texts it sent to each worker; the longest match wins unless the load is imbalanced);
- ``peer-round-robin``: the homogeneous fleet behind ``--policy round_robin``;
- ``peer-cache-aware-mixed``: the mixed fleet (speculative + standard servers) behind ``cache_aware``: prefix
  affinity with no notion of which server is speculative.

The router is not a dependency of specgate (it is in the ``bench`` extra): without it a sweep that asks for a peer
policy stops with the install hint before any server starts.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

PEER_POLICIES = {
    "peer-cache-aware": "cache_aware",
    "peer-round-robin": "round_robin",
    "peer-cache-aware-mixed": "cache_aware",
}
MIXED_PEERS = frozenset({"peer-cache-aware-mixed"})  # in front of the mixed fleet (the others: homogeneous)
INSTALL_HINT = "pip install 'specgate[bench]' (or: pip install vllm-router)"


class PeerUnavailable(RuntimeError):
    """The ``vllm-router`` binary is not installed."""


def router_binary() -> str | None:
    """The ``vllm-router`` executable: on PATH, or next to this Python (a virtual environment not activated)."""
    found = shutil.which("vllm-router")
    if found:
        return found
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.exists() else None


def require_router() -> str:
    binary = router_binary()
    if binary is None:
        raise PeerUnavailable(f"the peer policies run the vllm-router binary, which is not installed: {INSTALL_HINT}")
    return binary


def router_command(binary: str, policy: str, workers: list[str], port: int, metrics_port: int) -> list[str]:
    """The router's command line: its policy, the workers, its port and a private metrics port (its default,
    29000, would collide between sweeps running side by side)."""
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", PEER_POLICIES[policy]]
    cmd += ["--worker-urls", *workers]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    # the workers are up before the router starts: check them at once instead of every 30 s
    cmd += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "60"]
    return [*cmd, "--request-timeout-secs", "600", "--log-level", "error"]
