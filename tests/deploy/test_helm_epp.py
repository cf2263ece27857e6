"""The Helm chart's EPP mode (helm/specgate, `mode: epp`): specgate epp as the Endpoint Picker of a Gateway API
Inference Extension gateway: the InferencePool (checked against the v1 CRD's schema for the fields the chart
sets), the picker's Deployment and Service, the example HTTPRoute; the proxy's objects left out; bad values
refused. Needs helm 3 (skipped with a reason without it, as tests/deploy/test_helm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest

import tests.deploy.test_helm as base
from gateway.config.loader import load_rules_text
from tests.deploy.test_helm import CHART, HELM, RELEASE, Doc, by_kind, needs_helm, one, render, render_fails

EPP_VALUES = CHART / "ci" / "epp-values.yaml"
FULL = f"{RELEASE}-specgate"
KINDS = {
    **base.API_VERSIONS,
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
}

# The v1 InferencePool CRD's spec (gateway-api-inference-extension), the parts the chart renders: what an API
# server with the CRD installed would refuse.
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
INFERENCE_POOL_SPEC: dict[str, Any] = {
    "type": "object",
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "additionalProperties": False,
    "properties": {
        "selector": {
            "type": "object",
            "required": ["matchLabels"],
            "additionalProperties": False,
            "properties": {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 64,
                    "additionalProperties": {"type": "string", "maxLength": 63},
                }
            },
        },
        "targetPorts": {
            "type": "array",
            "minItems": 1,
            "maxItems": 8,
            "items": {
                "type": "object",
                "required": ["number"],
                "additionalProperties": False,
                "properties": {"number": _PORT},
            },
        },
        "endpointPickerRef": {
            "type": "object",
            "required": ["name", "port"],
            "additionalProperties": False,
            "properties": {
                "group": {"type": "string", "maxLength": 253},
                "kind": {"type": "string", "enum": ["Service"]},
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
                "port": {
                    "type": "object",
                    "required": ["number"],
                    "additionalProperties": False,
                    "properties": {"number": _PORT},
                },
                "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]},
            },
        },
    },
}


@pytest.fixture(scope="module")
def epp_docs() -> list[Doc]:
    if HELM is None:
        pytest.skip("helm 3 not found on PATH or in .tools/bin (install it: tools/install-ci-tools.sh)")
    return render(EPP_VALUES)


def picker(docs: list[Doc]) -> Doc:
    containers = one(docs, "Deployment", f"{FULL}-epp")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "epp")


@needs_helm
def test_helm_lint_strict_in_epp_mode() -> None:
    proc = base._helm("lint", "--strict", str(CHART), "-f", str(EPP_VALUES))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_epp_mode_renders_the_picker_instead_of_the_proxy(epp_docs: list[Doc]) -> None:
    kinds = {d["kind"] for d in epp_docs}
    assert {"InferencePool", "HTTPRoute", "Deployment", "Service", "ConfigMap"} <= kinds
    assert "HorizontalPodAutoscaler" not in kinds
    assert "PodDisruptionBudget" not in kinds
    names = {(d["kind"], d["metadata"]["name"]) for d in epp_docs}
    assert ("Deployment", FULL) not in names  # the proxy
    assert ("Service", FULL) not in names
    assert ("Deployment", f"{FULL}-epp") in names
    for d in epp_docs:  # current apiVersions, DNS names, the namespace and labels, as in proxy mode
        assert d["apiVersion"] == KINDS[d["kind"]], d["kind"]
        assert d["metadata"]["namespace"] == base.NAMESPACE
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    base.test_deployment_selectors_match_their_pods(epp_docs)
    base.test_services_select_existing_pods_and_named_ports(epp_docs)
    base.test_every_container_runs_restricted(epp_docs)


def test_the_default_values_render_no_epp_objects(epp_docs: list[Doc]) -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] in ("InferencePool", "HTTPRoute")]
    assert not [d for d in docs if d["metadata"]["name"].endswith("-epp")]


def test_the_picker_container(epp_docs: list[Doc]) -> None:
    c = picker(epp_docs)
    assert c["command"] == ["specgate", "epp"]
    assert c["args"][:2] == ["--rules", "/etc/specgate/rules/routing.yaml"]
    env = base.env_of(c)
    assert env["SPECGATE_EPP_PORT"]["value"] == "9002"
    assert env["SPECGATE_METRICS_PORT"]["value"] == "9090"
    assert env["SPECGATE_EPP_USAGE_BYTES"]["value"] == "1048576"
    assert env["SPECGATE_REDIS_URL"]["value"] == f"redis://{FULL}-redis:6379/0"
    assert env["SPECGATE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-admin"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 9002, "metrics": 9090, "admin": 8081}
    assert c["livenessProbe"]["grpc"]["port"] == 9002  # the gRPC health service
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["routing"]["mountPath"] == "/etc/specgate/rules"
    assert "subPath" not in mounts["routing"]  # hot reload


def test_the_picker_watches_the_pools_pods(epp_docs: list[Doc]) -> None:
    c = picker(epp_docs)
    args = c["args"]
    assert args[args.index("--kube-selector") + 1] == "app=vllm-llama-70b"  # the InferencePool's selector
    assert args[args.index("--kube-port") + 1] == "8000"
    pod = one(epp_docs, "Deployment", f"{FULL}-epp")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    role = one(epp_docs, "Role", f"{FULL}-epp")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(epp_docs, "RoleBinding", f"{FULL}-epp")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "llm"}]
    without = render(EPP_VALUES, {"epp.watchPods": "false"})
    assert "--kube-selector" not in picker(without)["args"]
    assert not by_kind(without, "Role")
    assert (
        one(without, "Deployment", f"{FULL}-epp")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    )


@needs_helm
def test_in_chart_pools_are_the_inference_pool() -> None:
    docs = render(sets={"mode": "epp", "pools.speculative.deploy": "true", "pools.standard.deploy": "true"})
    pool = one(docs, "InferencePool", FULL)
    jsonschema.validate(pool["spec"], INFERENCE_POOL_SPEC)
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == {"specgate.io/model-server": FULL}
    args = picker(docs)["args"]
    assert args[args.index("--kube-selector") + 1] == f"specgate.io/model-server={FULL}"
    for name in ("speculative", "standard"):  # the pods the pool selects, each naming its pool for the picker
        labels = one(docs, "Deployment", f"{FULL}-vllm-{name}")["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert labels["specgate.io/pool"] == name
    policies = [p for p in by_kind(docs, "NetworkPolicy") if "vllm" in p["metadata"]["name"]]
    assert not policies  # networkPolicy is off by default
    with_policy = render(sets={"mode": "epp", "pools.speculative.deploy": "true", "networkPolicy.enabled": "true"})
    vllm = one(with_policy, "NetworkPolicy", f"{FULL}-vllm-speculative")
    admitted = vllm["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert admitted["app.kubernetes.io/component"] == "epp"  # the picker's health checks


def test_inference_pool_points_at_the_picker_service(epp_docs: list[Doc]) -> None:
    pool = one(epp_docs, "InferencePool", FULL)
    jsonschema.validate(pool["spec"], INFERENCE_POOL_SPEC)
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == {"app": "vllm-llama-70b"}
    assert spec["targetPorts"] == [{"number": 8000}]
    ref = spec["endpointPickerRef"]
    assert ref["failureMode"] == "FailOpen"
    svc = one(epp_docs, "Service", ref["name"])
    grpc = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc["targetPort"] == "grpc"
    assert grpc["appProtocol"] == "kubernetes.io/h2c"  # gRPC without TLS inside the cluster


def test_the_example_route_sends_everything_to_the_pool(epp_docs: list[Doc]) -> None:
    route = one(epp_docs, "HTTPRoute", FULL)
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateways"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": FULL}]
    assert rule["timeouts"]["request"] == "600s"
    without = render(EPP_VALUES, {"epp.httpRoute.create": "false"})
    assert not by_kind(without, "HTTPRoute")


def test_routing_yaml_lists_the_pods(epp_docs: list[Doc]) -> None:
    rules = load_rules_text(base.routing_text(epp_docs), "configmap routing.yaml")
    assert [e.url for e in rules.pool("speculative").endpoints] == ["http://10.0.3.11:8000", "http://10.0.3.12:8000"]
    assert [e.url for e in rules.pool("standard").endpoints] == ["http://10.0.4.21:8000"]


def test_monitoring_and_redis_policy_follow_the_picker(epp_docs: list[Doc]) -> None:
    (monitor,) = [m for m in by_kind(epp_docs, "ServiceMonitor") if m["metadata"]["name"] == FULL]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "epp"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    redis = one(epp_docs, "NetworkPolicy", f"{FULL}-redis")
    allowed = redis["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed["app.kubernetes.io/component"] == "epp"


@needs_helm
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"epp.watchPods": "false", "pools.speculative.deploy": "true"}, "needs epp.watchPods"),
        (
            {"epp.watchPods": "false", "pools.standard.externalEndpoints[0].url": "http://vllm-standard:8000"},
            "is not a pod address",
        ),
        ({"epp.inferencePool.selector": "null"}, "epp.inferencePool.selector"),
        ({"epp.inferencePool.failureMode": "Sometimes"}, "failureMode"),
        ({"epp.port": "9090"}, "epp.port must differ"),
        ({"gateway.apiKeysSecret.name": "keys"}, "apiKeysSecret"),
        ({"mode": "sidecar"}, "mode"),
    ],
)
def test_bad_epp_values_are_refused(sets: dict[str, str], message: str) -> None:
    assert message in render_fails(sets, EPP_VALUES)


def test_epp_values_file_is_documented() -> None:
    assert Path(EPP_VALUES).is_file()
    base.test_values_yaml_is_documented()
    base.test_schema_is_valid_json_and_closed()
