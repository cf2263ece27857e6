"""The Grafana dashboard and the Prometheus alert rules (deploy/).

- ``promtool check rules`` / ``promtool test rules`` on deploy/prometheus/ (the real binary: Debian's ``prometheus``
  package, installed by tools/install-ci-tools.sh; skipped with the reason when it is missing locally);
- the dashboard JSON loads, and its expressions are valid PromQL (promtool checks them as recording rules);
- every metric name in the dashboard's and the rules' PromQL is one that a real gateway (with the simulator behind
  it, after a few requests so lazily created series exist) or a simulated vLLM 0.33 server serves at /metrics;
- every alert has a runbook_url whose anchor is a heading of the on-call runbook in docs/operations.md.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, ServerThread, rules_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/specgate-dashboard.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
ALERTS_TEST = ROOT / "deploy/prometheus/alerts_test.yaml"
RUNBOOK = ROOT / "docs/operations.md"
SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
# Grafana's variables, replaced by something PromQL accepts before parsing or checking.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$class": ".*", "$pool": ".*"}

# -- PromQL: which identifiers are metric names ------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.])[A-Za-z_:][\w:]*")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "inf",
     "nan", "atan2"}
)  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside strings, label matchers, ranges and grouping
    clauses that are neither keywords nor followed by ``(`` (functions and aggregations)."""
    text = expr
    for var, value in GRAFANA_VARS.items():
        text = text.replace(var, value)
    text = _STRING.sub('""', text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        if m.group() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(m.group())
    return names


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (class, le) (rate(specgate_time_to_first_token_seconds_bucket{class=~"$class",'
        ' pool!="none"}[$__rate_interval] offset 1d))) / ignoring(position) group_left sum by (pool) '
        '(rate(vllm:spec_decode_num_drafts_total{x="a b"}[5m])) > 0.5 and on () (max(up) == 1) unless bool 1e3'
    )
    assert metric_names(expr) == {"specgate_time_to_first_token_seconds_bucket", "vllm:spec_decode_num_drafts_total",
                                  "up"}  # fmt: skip


def series_names(exposition: str) -> set[str]:
    """Every series name a Prometheus server would store from this exposition, from the families' types (so that
    a labelled family without any child yet still counts) and from the samples themselves."""
    out: set[str] = set()
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
        "info": ("_info",),
    }
    for fam in text_string_to_metric_families(exposition):
        out.update(fam.name + suffix for suffix in suffixes.get(fam.type, ("",)))
        out.update(s.name for s in fam.samples)
    return out


# -- the real /metrics ---------------------------------------------------------------------------------------------


def _sim(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "model": MODEL,
        "port": 0,
        "time_scale": 0.005,
        "output_lengths": OutputLengths(median=12, sigma=0),
        "seed": 3,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


CONTROLLER = {"window_s": 1, "min_samples": 1, "min_hold_s": 0, "safe_state": "speculative"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Series names served by a gateway (single process, in-memory store) and by a speculative and a standard
    simulated vLLM server, after a plain, a streamed and a keyed request (twice: stored, then replayed)."""
    spec = _sim(speculative_config=SPEC, per_request_spec_decode_metrics="summary", fixed_acceptance=0.7)
    std = _sim()
    gw: ServerThread | None = None
    try:
        rules = rules_for([spec.url], [std.url])
        rules["classes"][0]["controller"] = CONTROLLER
        path = tmp_path_factory.mktemp("observability") / "rules.yaml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        settings = Settings(rules=path, host="127.0.0.1", port=8080, admin_port=0, health_interval_s=0.2)
        gw = ServerThread(create_app(settings)).start()
        precise = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "def add(a, b):"}]}
        casual = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            assert c.post("/v1/chat/completions", json=precise).status_code == 200
            assert c.post("/v1/chat/completions", json={**precise, "stream": True}).status_code == 200
            assert c.post("/v1/chat/completions", json=casual).status_code == 200
            for _ in range(2):
                r = c.post("/v1/chat/completions", json=casual, headers={"Idempotency-Key": "observability-1"})
                assert r.status_code == 200
            time.sleep(0.3)  # a scrape round of the pools
            names = series_names(c.get("/metrics").text)
        names |= series_names(httpx.get(f"{spec.url}/metrics", timeout=10).text)
        names |= series_names(httpx.get(f"{std.url}/metrics", timeout=10).text)
        yield names
    finally:
        if gw is not None:
            gw.stop()
        spec.stop()
        std.stop()


def test_exported_names_cover_both_sides(exported: set[str]) -> None:
    for name in (
        "specgate_requests_total",
        "specgate_time_to_first_token_seconds_bucket",
        "specgate_controller_transitions_total",
        "specgate_idempotency_total",
        "specgate_store_up",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:num_requests_waiting",
    ):
        assert name in exported


# -- the dashboard -------------------------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dashboard()) if p["type"] != "row" for t in p.get("targets", [])]


def template_metrics() -> set[str]:
    out = set()
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)", var["definition"])
            assert m, var["definition"]
            out.add(m.group(1))
    return out


def test_dashboard_loads() -> None:
    dash = dashboard()
    assert dash["uid"] == "specgate"
    assert dash["title"]
    assert isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "class", "pool"} <= names
    for p in panels(dash):
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_dashboard_covers_the_issue() -> None:
    used = set().union(*(metric_names(e) for _, e in dashboard_exprs()))
    required = {
        "specgate_requests_total",  # traffic per class and pool
        "specgate_time_to_first_token_seconds_bucket",  # TTFT per class
        "specgate_request_duration_seconds_bucket",  # E2E per class
        "vllm:request_time_per_output_token_seconds_bucket",  # TPOT per pool
        "specgate_pool_queue_depth",
        "specgate_pool_batch_size",
        "vllm:spec_decode_num_accepted_tokens_total",  # acceptance per pool, from counters
        "vllm:spec_decode_num_draft_tokens_total",
        "specgate_class_accepted_draft_tokens_total",  # acceptance per class, from counters
        "specgate_class_draft_tokens_total",
        "specgate_class_route_state",
        "specgate_controller_transitions_total",
        "specgate_class_speculative_share",
        "specgate_fallbacks_total",
        "specgate_idempotency_total",
        "specgate_overrides_active",
        "specgate_store_up",
    }
    assert required <= used, required - used
    # V0 names that vLLM 0.33 no longer serves
    assert not used & {"vllm:spec_decode_draft_acceptance_rate", "vllm:gpu_cache_usage_perc"}


def test_dashboard_metrics_exist(exported: set[str]) -> None:
    missing = {
        (title, name) for title, expr in dashboard_exprs() for name in metric_names(expr) if name not in exported
    }
    missing |= {("templating", name) for name in template_metrics() if name not in exported}
    assert not missing


# -- the rules -----------------------------------------------------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def test_rule_metrics_exist(exported: set[str]) -> None:
    missing = {(r["alert"], n) for r in rules() for n in metric_names(r["expr"]) if n not in exported}
    assert not missing


def test_acceptance_alerts_use_the_v1_counters() -> None:
    by_name = {r["alert"]: r for r in rules()}
    for name, threshold, for_ in (("LowAcceptRatio", "< 0.5", "10m"), ("CriticalAcceptRatio", "< 0.3", "5m")):
        rule = by_name[name]
        assert metric_names(rule["expr"]) == {
            "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_draft_tokens_total",
        }
        assert rule["expr"].strip().endswith(threshold)
        assert rule["for"] == for_
    names = set(by_name)
    assert {
        "SpecgateLatencyRegression",
        "SpecgateFallbackStorm",
        "SpecgateClassStuckInSafeState",
        "SpecgateStoreDegraded",
        "SpecgateConfigReloadFailed",
    } <= names


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_alert_has_a_runbook_section() -> None:
    readme = RUNBOOK.read_text()
    anchors = {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", readme, re.M)}
    assert "on-call-runbook" in anchors
    runbook = readme[readme.index("## On-call runbook") :]
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("https://"), url
        assert "/blob/main/docs/operations.md#" in url, url
        anchor = url.split("#", 1)[1]
        assert anchor == rule["alert"].lower(), url
        assert anchor in anchors, f"{rule['alert']}: no docs/operations.md heading for #{anchor}"
        assert f"### {rule['alert']}" in runbook, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]


# -- promtool ------------------------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (CI installs it: tools/install-ci-tools.sh; locally: "
                    "apt-get install prometheus)")  # fmt: skip
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_rules() -> None:
    done = run(promtool(), "check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_test_rules() -> None:
    done = run(promtool(), "test", "rules", str(ALERTS_TEST))
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_promql_is_valid(tmp_path: Path) -> None:
    """Every dashboard expression, as a recording rule: ``promtool check rules`` parses the PromQL."""
    exprs = [expr for _, expr in dashboard_exprs()]
    for var, value in GRAFANA_VARS.items():
        exprs = [e.replace(var, value) for e in exprs]
    group = {"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [group]}, sort_keys=False))
    done = run(promtool(), "check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
