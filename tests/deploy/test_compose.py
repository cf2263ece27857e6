"""docker/: the compose stack and the image, checked statically (no Docker engine here).

The compose file parses, every local file it references exists, the profiles split real and simulated pools, the
gateway and simulator command lines use only flags ``specgate serve`` / ``specgate sim`` have, the vLLM servers use
vLLM 0.33's flags (``--speculative-config`` JSON, per-request spec-decode metrics), the routing YAML for compose
loads and points at compose services, Prometheus and Grafana are wired to the right files, and the Dockerfile is a
multi-stage build whose final stage has no compilers, runs as a non-root user and has a HEALTHCHECK.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml

from gateway.cli.main import app
from gateway.config.loader import load_rules_file
from gateway.config.setting_spec import ENV_PREFIX
from gateway.config.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"

GATEWAYS = ("gateway-1", "gateway-2")
ALWAYS = (*GATEWAYS, "redis", "prometheus", "grafana")
SIM = ("sim-speculative", "sim-standard")
GPU = ("vllm-speculative", "vllm-standard")
SPEC_METHODS = {"ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix", "dflash"}
SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "draft_tensor_parallel_size",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "num_speculative_tokens_per_batch_size",
    "enable_adaptive_verification",
}
REMOVED_VLLM_FLAGS = {
    "--speculative-model",
    "--num-speculative-tokens",
    "--use-v2-block-manager",
    "--spec-decoding-acceptance-method",
    "--speculative-disable-by-batch-size",
    "--speculative-draft-tensor-parallel-size",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = compose["services"]
    return out


def specgate_flags(command: str) -> set[str]:
    """The long options of ``specgate COMMAND``, from the CLI's own definition (what ``--help`` prints)."""
    sub = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for p in sub.params for opt in p.opts if opt.startswith("--")}


def flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def host_path(ref: str) -> Path | None:
    """The local file a compose path refers to (relative to docker/), None for a named volume."""
    if ref.startswith((".", "/")):
        return (DOCKER / ref).resolve()
    return None


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert set(svc) == {*ALWAYS, *SIM, *GPU}
    for name in ALWAYS:
        assert "profiles" not in svc[name], name
    for name in SIM:
        assert svc[name]["profiles"] == ["sim"], name
    for name in GPU:
        assert svc[name]["profiles"] == ["gpu"], name


def test_local_files_exist(compose: dict[str, Any]) -> None:
    checked = 0
    for name, svc in services(compose).items():
        build = svc.get("build")
        if build is not None:
            context = host_path(build["context"] if isinstance(build, dict) else build)
            assert context is not None
            assert context.is_dir(), name
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
            checked += 1
        for volume in svc.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":", 1)[0]
            path = host_path(source)
            if path is None:
                assert source in (compose.get("volumes") or {}), f"{name}: undeclared volume {source}"
            else:
                assert path.exists(), f"{name}: {source}"
                checked += 1
        env_files = svc.get("env_file", [])
        for env_file in [env_files] if isinstance(env_files, str) else env_files:
            assert host_path(env_file if isinstance(env_file, str) else env_file["path"]), name
        for config in svc.get("configs", []):
            source = config["source"] if isinstance(config, dict) else config
            assert host_path(compose["configs"][source]["file"]).exists(), name  # type: ignore[union-attr]
    assert checked >= 8


def test_gateways(compose: dict[str, Any]) -> None:
    svc = services(compose)
    serve_flags = specgate_flags("serve")
    settings_env = {ENV_PREFIX + f.name.upper() for f in fields(Settings)} | {"SPECGATE_ADMIN_TOKEN"}
    host_ports = []
    for name in GATEWAYS:
        gw = svc[name]
        assert gw["image"] == "specgate:local"
        assert "entrypoint" not in gw  # the image's: specgate serve
        assert set(flags_of(gw["command"])) <= serve_flags, name
        env = gw["environment"]
        specgate_env = {k for k in env if k.startswith(ENV_PREFIX)}
        assert specgate_env <= settings_env, specgate_env - settings_env
        assert env["SPECGATE_RULES"] == "/etc/specgate/rules.yaml"
        assert urlsplit(env["SPECGATE_REDIS_URL"]).hostname == "redis"
        assert env["SPECGATE_ADMIN_TOKEN"].startswith("${SPECGATE_ADMIN_TOKEN:?")  # required, never a default
        assert "./rules.yaml:/etc/specgate/rules.yaml:ro" in gw["volumes"]
        assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
        host_ports += [p.rsplit(":", 1)[0] for p in gw["ports"]]
        assert all(p.startswith("127.0.0.1:") for p in gw["ports"])
    assert len(host_ports) == len(set(host_ports))


def test_simulated_pools(compose: dict[str, Any]) -> None:
    svc = services(compose)
    sim_flags = specgate_flags("sim")
    for name in SIM:
        sim = svc[name]
        assert sim["entrypoint"] == ["specgate", "sim"]
        assert set(flags_of(sim["command"])) <= sim_flags, name
        assert arg_after(sim["command"], "--host") == "0.0.0.0"
        assert arg_after(sim["command"], "--port") == "8000"
    spec = svc["sim-speculative"]["command"]
    assert arg_after(spec, "--per-request-spec-decode-metrics") == "summary"
    assert "--speculative-config" not in svc["sim-standard"]["command"]


def test_vllm_pools(compose: dict[str, Any]) -> None:
    svc = services(compose)
    devices: list[str] = []
    for name in GPU:
        server = svc[name]
        assert server["image"].startswith("vllm/vllm-openai:")
        args = [str(a) for a in server["command"]]
        assert not set(flags_of(args)) & REMOVED_VLLM_FLAGS, name
        assert arg_after(args, "--port") == "8000"
        (reservation,) = server["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia"
        assert reservation["capabilities"] == ["gpu"]
        devices += reservation["device_ids"]
    assert len(devices) == len(set(devices)), "the two pools must not share GPUs"
    spec = [str(a) for a in svc["vllm-speculative"]["command"]]
    assert arg_after(spec, "--per-request-spec-decode-metrics") == "summary"
    config = json.loads(arg_after(spec, "--speculative-config"))
    assert config["method"] in SPEC_METHODS
    assert set(config) <= SPEC_KEYS, set(config) - SPEC_KEYS
    assert isinstance(config["num_speculative_tokens"], int)
    assert config["num_speculative_tokens"] > 0
    assert "--speculative-config" not in svc["vllm-standard"]["command"]
    # the simulated speculative pool runs the same configuration
    assert json.loads(arg_after(svc["sim-speculative"]["command"], "--speculative-config")) == config


def aliases(svc: dict[str, Any]) -> set[str]:
    nets = svc.get("networks") or {}
    return {a for net in nets.values() if net for a in net.get("aliases", [])}


def test_rules_point_at_compose_services(compose: dict[str, Any]) -> None:
    svc = services(compose)
    rules = load_rules_file(DOCKER / "rules.yaml")
    gpu_names = set(GPU)
    sim_names = set().union(*(aliases(svc[name]) for name in SIM))
    spec_config = json.loads(arg_after([str(a) for a in svc["vllm-speculative"]["command"]], "--speculative-config"))
    for pool in rules.pools:
        for endpoint in pool.endpoints:
            url = urlsplit(endpoint.url)
            assert url.hostname in gpu_names, endpoint.url  # the gpu profile's service ...
            assert url.hostname in sim_names, endpoint.url  # ... and the sim profile's alias
            assert url.port == 8000
        if pool.speculative is not None:
            assert pool.speculative.method == spec_config["method"]
            assert pool.speculative.num_speculative_tokens == spec_config["num_speculative_tokens"]
            assert pool.speculative.draft_model == spec_config["model"]


def test_prometheus_config(compose: dict[str, Any]) -> None:
    svc = services(compose)
    prom = yaml.safe_load((DOCKER / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    gw_targets = {t for c in jobs["specgate"]["static_configs"] for t in c["targets"]}
    assert gw_targets == {f"{name}:8080" for name in GATEWAYS}
    assert jobs["specgate"].get("metrics_path", "/metrics") == "/metrics"
    pools = {t: c["labels"]["pool"] for c in jobs["vllm"]["static_configs"] for t in c["targets"]}
    rules = load_rules_file(DOCKER / "rules.yaml")
    assert pools == {urlsplit(ep.url).netloc: p.name for p in rules.pools for ep in p.endpoints}
    # the rule files glob matches where compose mounts deploy/prometheus/alerts.yaml
    mounts = dict(v.split(":")[:2] for v in svc["prometheus"]["volumes"])
    alerts_target = mounts["../deploy/prometheus/alerts.yaml"]
    (pattern,) = prom["rule_files"]
    assert Path(alerts_target).match(pattern)
    assert mounts["./prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_grafana_provisioning(compose: dict[str, Any]) -> None:
    svc = services(compose)
    mounts = dict(v.split(":")[:2] for v in svc["grafana"]["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard_target = Path(mounts["../deploy/grafana/specgate-dashboard.json"])
    provisioning = DOCKER / "grafana/provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert urlsplit(datasource["url"]).hostname == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards/specgate.yaml").read_text())["providers"]
    assert dashboard_target.parent == Path(provider["options"]["path"])
    dashboard = json.loads((ROOT / "deploy/grafana/specgate-dashboard.json").read_text())
    (ds_var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["current"]["value"] == datasource["uid"]


# -- the Dockerfile --------------------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions (upper-case keyword, arguments) per stage; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append((keyword.upper(), rest.strip()))
    return stages


def test_dockerfile() -> None:
    preamble, *stages = dockerfile_stages()
    assert all(k == "ARG" for k, _ in preamble)
    assert "PYTHON_IMAGE=python:3.11-slim" in [a for _, a in preamble]
    assert len(stages) >= 2
    froms = [stage[0][1].split() for stage in stages]
    assert all(f[0] == "${PYTHON_IMAGE}" for f in froms)
    builder_name = froms[0][2]
    final = stages[-1]
    instructions = [k for k, _ in final]
    run_lines = " ".join(a for k, a in final if k == "RUN")
    # no compilers in the final image: nothing installed with apt, no build tools named anywhere
    assert not re.search(r"\b(apt-get|apt|apk)\b", run_lines)
    assert not re.search(r"\b(gcc|g\+\+|build-essential|clang|make)\b", run_lines)
    assert any(k == "COPY" and a.startswith(f"--from={builder_name} ") for k, a in final)
    assert "pip install --no-index" in run_lines
    # non-root
    (user,) = [a for k, a in final if k == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    assert instructions.index("USER") < instructions.index("ENTRYPOINT")
    # entrypoint, rules default, ports, health check
    (entrypoint,) = [json.loads(a) for k, a in final if k == "ENTRYPOINT"]
    assert entrypoint == ["specgate", "serve"]
    assert "SPECGATE_RULES=/etc/specgate/rules.yaml" in " ".join(a for k, a in final if k == "ENV")
    (exposed,) = [a.split() for k, a in final if k == "EXPOSE"]
    assert set(exposed) == {"8080", "8081"}
    (healthcheck,) = [a for k, a in final if k == "HEALTHCHECK"]
    assert "/health" in healthcheck
    assert "urllib.request" in healthcheck
    assert "curl" not in healthcheck
    # what the build copies from the context exists (and is not excluded by .dockerignore)
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for stage in stages:
        for keyword, args in stage:
            if keyword == "COPY" and not args.startswith("--from="):
                sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
                for source in sources:
                    assert (ROOT / source).exists(), source
                    assert source.split("/")[0] not in ignored, source
