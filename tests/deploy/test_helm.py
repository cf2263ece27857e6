"""The Helm chart (helm/specgate): `helm lint` and `helm template` with the default and the all-features values.

Needs a real helm 3 binary, on PATH or in .tools/bin/ (tools/install-ci-tools.sh puts it there); the tests that
need it are skipped with a reason when it is missing. The file-copy checks run without helm.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.loader import load_rules_text

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specgate"
ALL_FEATURES = CHART / "ci" / "all-features-values.yaml"
RELEASE = "sg"
NAMESPACE = "llm"

Doc = dict[str, Any]

# Every kind the chart may render, with the apiVersion it must use (current, non-deprecated APIs).
API_VERSIONS = {
    "ConfigMap": "v1",
    "Secret": "v1",
    "Service": "v1",
    "ServiceAccount": "v1",
    "Deployment": "apps/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
}
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _find_helm() -> str | None:
    found = shutil.which("helm")
    if found:
        return found
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if local.is_file() else None


HELM = _find_helm()
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm 3 not found on PATH or in .tools/bin (install it: tools/install-ci-tools.sh)"
)


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60, check=False)


def _values_args(values_file: Path | None, sets: dict[str, str] | None) -> list[str]:
    args: list[str] = []
    if values_file is not None:
        args += ["-f", str(values_file)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def render(values_file: Path | None = None, sets: dict[str, str] | None = None) -> list[Doc]:
    proc = _helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_values_args(values_file, sets))
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_fails(sets: dict[str, str], values_file: Path | None = None) -> str:
    proc = _helm("template", RELEASE, str(CHART), *_values_args(values_file, sets))
    assert proc.returncode != 0, f"helm template accepted {sets}"
    return proc.stderr


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def gateway_deployment(docs: list[Doc]) -> Doc:
    return one(docs, "Deployment", f"{RELEASE}-specgate")


def gateway_container(docs: list[Doc]) -> Doc:
    containers = gateway_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gateway")


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def routing_text(docs: list[Doc]) -> str:
    text = one(docs, "ConfigMap", f"{RELEASE}-specgate-routing")["data"]["routing.yaml"]
    assert isinstance(text, str)
    return text


def pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for d in by_kind(docs, "Deployment"):
        yield d["metadata"]["name"], d["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def default_docs() -> list[Doc]:
    if HELM is None:
        pytest.skip("helm 3 not found on PATH or in .tools/bin (install it: tools/install-ci-tools.sh)")
    return render()


@pytest.fixture(scope="module")
def full_docs() -> list[Doc]:
    if HELM is None:
        pytest.skip("helm 3 not found on PATH or in .tools/bin (install it: tools/install-ci-tools.sh)")
    return render(ALL_FEATURES)


@pytest.fixture(params=["default", "all-features"])
def docs(request: pytest.FixtureRequest, default_docs: list[Doc], full_docs: list[Doc]) -> list[Doc]:
    return default_docs if request.param == "default" else full_docs


# ------------------------------------------------------------------------------------------ files and values


@pytest.mark.parametrize(
    ("copy", "source"),
    [
        ("files/routing-default.yaml", "routing_rules/default.yaml"),
        ("files/alerts.yaml", "deploy/prometheus/alerts.yaml"),
        ("files/specgate-dashboard.json", "deploy/grafana/specgate-dashboard.json"),
    ],
)
def test_chart_file_copies_match_their_sources(copy: str, source: str) -> None:
    # helm reads files inside the chart only: these are copies, and must not drift from the originals.
    assert (REPO / source).is_file(), f"{source} is missing"
    assert (CHART / copy).read_bytes() == (REPO / source).read_bytes(), f"cp {source} helm/specgate/{copy}"


def test_values_yaml_is_documented() -> None:
    # Every key carries a comment: on its line, or on the line right above it.
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^ *[A-Za-z][\w./-]*:", line)
        if not m or "#" in line:
            continue
        above = lines[i - 1].strip() if i else ""
        if not above.startswith("#"):
            undocumented.append(f"line {i + 1}: {line.strip()}")
    assert not undocumented, undocumented


def test_schema_is_valid_json_and_closed() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])


# ------------------------------------------------------------------------------------------------ lint, schema


@needs_helm
@pytest.mark.parametrize("values_file", [None, ALL_FEATURES], ids=["default", "all-features"])
def test_helm_lint_strict(values_file: Path | None) -> None:
    proc = _helm("lint", "--strict", str(CHART), *_values_args(values_file, None))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_helm
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"replicaCount": "two"}, "replicaCount"),
        ({"gateway.logLevel": "verbose"}, "logLevel"),
        ({"gateway.port": "70000"}, "port"),
        ({"securityContext.allowPrivilegeEscalation": "true"}, "allowPrivilegeEscalation"),
        ({"redis.enabled": "false", "redis.url": "http://redis:6379"}, "url"),
        ({"pools.speculative.speculativeConfig.disable_by_batch_size": "4"}, "speculativeConfig"),
        ({"pools.speculative.externalEndpoints[0].url": "vllm:8000"}, "url"),
        ({"replicaCuont": "2"}, "replicaCuont"),
    ],
)
def test_values_schema_rejects_bad_values(sets: dict[str, str], message: str) -> None:
    stderr = render_fails(sets)
    assert message in stderr, stderr
    lint = _helm("lint", str(CHART), *_values_args(None, sets))
    assert lint.returncode != 0


@needs_helm
def test_grace_period_shorter_than_drain_is_refused() -> None:
    stderr = render_fails({"shutdown.terminationGracePeriodSeconds": "35"})
    assert "terminationGracePeriodSeconds" in stderr


@needs_helm
def test_pool_without_endpoints_is_refused() -> None:
    assert "externalEndpoints" in render_fails({"pools.standard.externalEndpoints": "null"})


# -------------------------------------------------------------------------------------------- valid objects


def test_objects_are_valid_kubernetes(docs: list[Doc]) -> None:
    for d in docs:
        kind, meta = d.get("kind"), d.get("metadata", {})
        assert kind in API_VERSIONS, f"unexpected kind {kind}"
        assert d["apiVersion"] == API_VERSIONS[kind], f"{kind}: {d['apiVersion']}"
        name = meta.get("name", "")
        pattern = DNS_1123_LABEL if kind in ("Service", "Deployment") else DNS_1123_SUBDOMAIN
        assert len(name) <= 63, f"{kind} name {name!r}"
        assert pattern.match(name), f"{kind} name {name!r}"
        assert meta.get("namespace") == NAMESPACE, f"{kind}/{name} namespace"
        for key, value in meta.get("labels", {}).items():
            assert isinstance(value, str), f"{kind}/{name} {key}"
            assert LABEL_VALUE.match(value), f"{kind}/{name} {key}={value!r}"
            assert len(value) <= 63, f"{kind}/{name} {key}={value!r}"
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "duplicate objects"


def test_deployment_selectors_match_their_pods(docs: list[Doc]) -> None:
    for d in by_kind(docs, "Deployment"):
        selector = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), d["metadata"]["name"]
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert c["name"]
            assert ":" in c["image"]
            for res in (c.get("resources") or {}).values():
                assert all(isinstance(v, str | int) for v in res.values())


def test_services_select_existing_pods_and_named_ports(docs: list[Doc]) -> None:
    pods = [d["spec"]["template"] for d in by_kind(docs, "Deployment")]
    for svc in by_kind(docs, "Service"):
        selector = svc["spec"]["selector"]
        targets = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert targets, f"Service {svc['metadata']['name']} selects no pod"
        port_names = {p["name"] for t in targets for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, svc["metadata"]["name"]


@pytest.mark.parametrize(
    ("which", "expected"),
    [
        ("default", {"ConfigMap", "Secret", "Service", "ServiceAccount", "Deployment", "PodDisruptionBudget"}),
        ("all-features", set(API_VERSIONS)),
    ],
)
def test_rendered_kinds(which: str, expected: set[str], default_docs: list[Doc], full_docs: list[Doc]) -> None:
    docs = default_docs if which == "default" else full_docs
    assert {d["kind"] for d in docs} == expected


# ---------------------------------------------------------------------------------------------- pod security


def test_every_container_runs_restricted(docs: list[Doc]) -> None:
    for name, spec in pod_specs(docs):
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, name
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        assert spec.get("hostNetwork") is not True, name
        assert spec.get("hostPID") is not True, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c.get("securityContext", {})
            where = f"{name}/{c['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("runAsNonRoot") is True, where
            assert sc.get("privileged") is not True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("seccompProfile", {}).get("type", "RuntimeDefault") == "RuntimeDefault", where


def test_gateway_has_a_writable_tmp(docs: list[Doc]) -> None:
    # readOnlyRootFilesystem: prometheus_client's multiprocess directory (tempfile.mkdtemp) needs /tmp.
    spec = gateway_deployment(docs)["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in gateway_container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


# ----------------------------------------------------------------------------------- probes and shutdown


def _gateway_drain_seconds() -> int:
    # The gateway's drain on SIGTERM: uvicorn's timeout_graceful_shutdown in gateway/cli/serve.py.
    m = re.search(r'"timeout_graceful_shutdown":\s*(\d+)', (REPO / "gateway" / "cli" / "serve.py").read_text())
    assert m, "timeout_graceful_shutdown not found in gateway/cli/serve.py"
    return int(m.group(1))


def test_probes_on_the_client_port(docs: list[Doc]) -> None:
    c = gateway_container(docs)
    http = next(p for p in c["ports"] if p["name"] == "http")
    assert http["containerPort"] == 8080
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    env = env_of(c)
    assert env["SPECGATE_PORT"]["value"] == "8080"


def test_prestop_and_grace_period_outlast_the_drain(docs: list[Doc]) -> None:
    spec = gateway_deployment(docs)["spec"]["template"]["spec"]
    command = gateway_container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    assert pre_stop >= 5
    assert spec["terminationGracePeriodSeconds"] > pre_stop + _gateway_drain_seconds()


def test_rolling_update_keeps_capacity(docs: list[Doc]) -> None:
    assert gateway_deployment(docs)["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# ---------------------------------------------------------------------------------------------- routing YAML


def test_routing_configmap_is_mounted_as_a_directory(docs: list[Doc]) -> None:
    # subPath mounts never see ConfigMap updates: the hot reload needs a directory mount.
    spec = gateway_deployment(docs)["spec"]["template"]["spec"]
    c = gateway_container(docs)
    config_volumes = {v["name"] for v in spec["volumes"] if "configMap" in v or "secret" in v}
    routing = next(v for v in spec["volumes"] if v["name"] == "routing")
    assert routing["configMap"]["name"] == f"{RELEASE}-specgate-routing"
    for m in c["volumeMounts"]:
        if m["name"] in config_volumes:
            assert "subPath" not in m, m
            assert "subPathExpr" not in m, m
    mount = next(m for m in c["volumeMounts"] if m["name"] == "routing")
    args = c["args"]
    rules_path = args[args.index("--rules") + 1]
    assert rules_path == f"{mount['mountPath']}/routing.yaml"
    assert c["command"] == ["specgate", "serve"]


def test_routing_yaml_validates(docs: list[Doc]) -> None:
    rules = load_rules_text(routing_text(docs), "configmap routing.yaml")  # what `specgate validate` runs
    assert {p.name for p in rules.pools} == {"speculative", "standard"}


def test_default_routing_is_the_repository_default(default_docs: list[Doc]) -> None:
    rendered = load_rules_text(routing_text(default_docs))
    default = load_rules_text((REPO / "routing_rules" / "default.yaml").read_text())
    assert rendered == default


def test_in_chart_pools_are_the_routing_endpoints(full_docs: list[Doc]) -> None:
    rules = load_rules_text(routing_text(full_docs))
    services = {s["metadata"]["name"]: s for s in by_kind(full_docs, "Service")}
    for pool in rules.pools:
        (endpoint,) = pool.endpoints
        host, port = endpoint.url.removeprefix("http://").split(":")
        assert host == f"{RELEASE}-specgate-vllm-{pool.name}"
        assert services[host]["spec"]["ports"][0]["port"] == int(port)
        assert pool.api_key_env == f"VLLM_{pool.name.upper()}_API_KEY"
    assert rules.scrape.interval_s == 5  # routing.overrides merged


@needs_helm
def test_external_pool_urls_and_verbatim_rules() -> None:
    docs = render(sets={"pools.standard.externalEndpoints[0].url": "https://std.example.com:8443"})
    rules = load_rules_text(routing_text(docs))
    assert [e.url for e in rules.pool("standard").endpoints] == ["https://std.example.com:8443"]
    own_file = REPO / "routing_rules" / "examples" / "code-assistant.yaml"
    proc = _helm("template", RELEASE, str(CHART), "--set-file", f"routing.rules={own_file}")
    assert proc.returncode == 0, proc.stderr
    cm = next(d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "ConfigMap")
    assert cm["data"]["routing.yaml"].strip() == own_file.read_text().strip()


def test_routing_changes_do_not_restart_pods_unless_asked(default_docs: list[Doc], full_docs: list[Doc]) -> None:
    annotations = gateway_deployment(default_docs)["spec"]["template"]["metadata"].get("annotations") or {}
    assert "checksum/routing" not in annotations  # hot reload, open streams kept
    assert "checksum/routing" in gateway_deployment(full_docs)["spec"]["template"]["metadata"]["annotations"]


# ---------------------------------------------------------------------------------------------------- admin


def test_admin_token_from_a_secret(docs: list[Doc]) -> None:
    env = env_of(gateway_container(docs))
    ref = env["SPECGATE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret", ref["name"])
    assert ref["key"] in secret["data"]
    assert env["SPECGATE_ADMIN_HOST"]["value"] == "0.0.0.0"
    assert env["SPECGATE_ADMIN_PORT"]["value"] == "8081"
    admin = one(docs, "Service", f"{RELEASE}-specgate-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert admin["spec"]["ports"][0]["targetPort"] == "admin"
    client = one(docs, "Service", f"{RELEASE}-specgate")
    assert [p["targetPort"] for p in client["spec"]["ports"]] == ["http"]


@needs_helm
def test_admin_existing_secret_and_disabled() -> None:
    docs = render(sets={"admin.existingSecret": "ops-token", "admin.secretKey": "token"})
    assert not by_kind(docs, "Secret")
    ref = env_of(gateway_container(docs))["SPECGATE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "ops-token", "key": "token"}

    docs = render(sets={"admin.enabled": "false"})
    env = env_of(gateway_container(docs))
    assert "SPECGATE_ADMIN_TOKEN" not in env
    assert env["SPECGATE_ADMIN_HOST"]["value"] == "127.0.0.1"  # never on all addresses without the token
    assert not [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-admin")]
    assert not by_kind(docs, "Secret")


# ---------------------------------------------------------------------------------------------------- Redis


def test_bundled_redis(docs: list[Doc]) -> None:
    env = env_of(gateway_container(docs))
    assert env["SPECGATE_REDIS_URL"]["value"] == f"redis://{RELEASE}-specgate-redis:6379/0"
    one(docs, "Service", f"{RELEASE}-specgate-redis")
    one(docs, "Deployment", f"{RELEASE}-specgate-redis")


@needs_helm
def test_external_redis() -> None:
    docs = render(sets={"redis.enabled": "false", "redis.url": "rediss://cache.example.com:6380/1"})
    assert env_of(gateway_container(docs))["SPECGATE_REDIS_URL"]["value"] == "rediss://cache.example.com:6380/1"
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    docs = render(sets={"redis.enabled": "false", "redis.existingSecret": "redis-auth"})
    ref = env_of(gateway_container(docs))["SPECGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "redis-auth", "key": "redis-url"}
    docs = render(sets={"redis.enabled": "false"})
    assert "SPECGATE_REDIS_URL" not in env_of(gateway_container(docs))


# ------------------------------------------------------------------------------------------------ vLLM pools


def _vllm(docs: list[Doc], pool: str) -> Doc:
    d = one(docs, "Deployment", f"{RELEASE}-specgate-vllm-{pool}")
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def test_vllm_pools_use_current_flags(full_docs: list[Doc]) -> None:
    spec = _vllm(full_docs, "speculative")
    args = spec["args"]
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config["method"] == "eagle3"
    assert config["model"] == "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"
    assert config["num_speculative_tokens"] == 4
    assert config["num_speculative_tokens_per_batch_size"][0] == [1, 64, 4]  # dynamic K: any key is passed on
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "summary"
    std = _vllm(full_docs, "standard")
    for c in (spec, std):
        joined = " ".join(c["args"])
        for gone in ("--speculative-model", "--num-speculative-tokens", "--use-v2-block-manager", "disable_by_batch"):
            assert gone not in joined
        assert c["command"] == ["vllm", "serve"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert env_of(c)["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "vllm-keys"
    assert "--speculative-config" not in std["args"]
    gateway_env = env_of(gateway_container(full_docs))
    for pool in ("SPECULATIVE", "STANDARD"):
        assert gateway_env[f"VLLM_{pool}_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "vllm-keys"


def test_no_pool_deployments_by_default(default_docs: list[Doc]) -> None:
    assert not [d for d in default_docs if "vllm" in d["metadata"]["name"]]


# -------------------------------------------------------------------------------------- network and scaling


def test_network_policies_admit_only_the_gateway(full_docs: list[Doc], default_docs: list[Doc]) -> None:
    assert not by_kind(default_docs, "NetworkPolicy")
    gateway_labels = gateway_deployment(full_docs)["spec"]["template"]["metadata"]["labels"]
    policies = {p["metadata"]["name"]: p for p in by_kind(full_docs, "NetworkPolicy")}
    for target in ("vllm-speculative", "vllm-standard", "redis"):
        policy = policies[f"{RELEASE}-specgate-{target}"]
        deployment = one(full_docs, "Deployment", f"{RELEASE}-specgate-{target}")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = policy["spec"]["ingress"]
        pod_peers = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
        assert pod_peers
        assert all(peer.items() <= gateway_labels.items() for peer in pod_peers)
        for peer in pod_peers:  # the gateway selector must not match the pool itself
            assert not peer.items() <= pod_labels.items()


def test_hpa_and_pdb(full_docs: list[Doc], default_docs: list[Doc]) -> None:
    assert not by_kind(default_docs, "HorizontalPodAutoscaler")
    assert gateway_deployment(default_docs)["spec"]["replicas"] == 2
    (hpa,) = by_kind(full_docs, "HorizontalPodAutoscaler")
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{RELEASE}-specgate"}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert "replicas" not in gateway_deployment(full_docs)["spec"]  # the HPA owns the count
    for docs in (default_docs, full_docs):
        (pdb,) = by_kind(docs, "PodDisruptionBudget")
        labels = gateway_deployment(docs)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["minAvailable"] == 1


# ----------------------------------------------------------------------------------------------- monitoring


def test_monitoring_objects_only_when_enabled(default_docs: list[Doc], full_docs: list[Doc]) -> None:
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert not by_kind(default_docs, kind)
    assert not [d for d in default_docs if d["metadata"]["name"].endswith("-dashboard")]

    monitors = {m["metadata"]["name"]: m for m in by_kind(full_docs, "ServiceMonitor")}
    gateway = monitors[f"{RELEASE}-specgate"]
    assert gateway["spec"]["endpoints"][0]["path"] == "/metrics"
    assert gateway["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    client = one(full_docs, "Service", f"{RELEASE}-specgate")
    admin = one(full_docs, "Service", f"{RELEASE}-specgate-admin")
    selector = gateway["spec"]["selector"]["matchLabels"].items()
    assert selector <= client["metadata"]["labels"].items()
    assert not selector <= admin["metadata"]["labels"].items()  # scrape the client port only, once per pod
    relabel = monitors[f"{RELEASE}-specgate-vllm"]["spec"]["endpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_service_label_specgate_io_pool"], "targetLabel": "pool"} in relabel


def test_keyed_gateways_are_scraped_with_the_metrics_token(default_docs: list[Doc], full_docs: list[Doc]) -> None:
    # With client keys /metrics needs a bearer: the ServiceMonitor sends the metrics token the gateway reads.
    monitor = one(full_docs, "ServiceMonitor", f"{RELEASE}-specgate")
    secret = {"name": "specgate-metrics-token", "key": "metrics-token"}
    assert monitor["spec"]["endpoints"][0]["authorization"] == {"type": "Bearer", "credentials": secret}
    env = env_of(gateway_container(full_docs))
    assert env["SPECGATE_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == secret
    assert "SPECGATE_METRICS_TOKEN" not in env_of(gateway_container(default_docs))
    # keys and a ServiceMonitor without the token: refused, saying what to set
    sets = {
        "serviceMonitor.enabled": "true",
        "gateway.apiKeysSecret.name": "keys",
    }
    assert "gateway.metricsTokenSecret" in render_fails(sets)


def test_prometheus_rule_carries_the_alerts(full_docs: list[Doc]) -> None:
    (rule,) = by_kind(full_docs, "PrometheusRule")
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yaml").read_text())
    assert rule["spec"] == alerts


def test_grafana_dashboard_configmap(full_docs: list[Doc]) -> None:
    cm = one(full_docs, "ConfigMap", f"{RELEASE}-specgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    dashboard = json.loads((REPO / "deploy" / "grafana" / "specgate-dashboard.json").read_text())
    assert json.loads(text) == dashboard


def test_render_is_deterministic(default_docs: list[Doc]) -> None:
    # The created admin Secret is the one random part; everything else renders identically every time.
    def strip(docs: list[Doc]) -> list[Doc]:
        return [d for d in docs if d["kind"] != "Secret"]

    assert strip(render()) == strip(default_docs)
