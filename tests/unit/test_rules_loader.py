"""The routing YAML loader: valid and invalid fixtures, error paths, lines and messages, the shipped YAMLs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gateway.config.checks import format_path, semantic_issues
from gateway.config.loader import (
    ConfigIssue,
    RulesError,
    load_rules_file,
    load_rules_text,
    summary,
)
from gateway.config.schema import Conditions, RoutingRules, TrafficClass

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "rules"
SHIPPED = [ROOT / "routing_rules" / "default.yaml", *sorted((ROOT / "routing_rules" / "examples").glob("*.yaml"))]

# fixture name → (path of the issue, a substring of its message, its line). An empty path means the document.
INVALID: dict[str, tuple[str, str, int | None]] = {
    "bad_pool_name": ("pools[0].name", 'invalid name "spec pool"', 3),
    "class_after_catch_all": ("classes[2]", 'class "never" is unreachable', 26),
    "duplicate_class_name": ("classes[1].name", 'duplicate class name "low-temperature"', 22),
    "duplicate_endpoint": ("pools[1].endpoints[0].url", 'duplicate endpoint id "spec:8000"', 13),
    "duplicate_key": ("pools[1].kind", 'duplicate key "kind" (first on line 10)', 11),
    "duplicate_key_flow": ("classes[0].when.temperature.lte", 'duplicate key "lte"', 17),
    "duplicate_pool_name": ("pools[1].name", 'duplicate pool name "standard"', 9),
    "empty_document": ("", "got an empty document", None),
    "empty_range": ("classes[0].when.temperature", "the range is empty", 17),
    "fallback_duplicate": ("classes[0].route.fallback[1]", 'duplicate fallback pool "standard"', 21),
    "fallback_is_preferred": ("classes[0].route.fallback[1]", '"speculative" is route.preferred', 21),
    "fallback_model_not_served": ("classes[0].route.fallback_model", 'no pool in route.fallback serves "tiny"', 21),
    "ejection_out_of_order": ("defaults.outlier_detection", "thresholds out of order: base_ejection_s", 3),
    "invalid_regex": ("task_rules[0].patterns[1]", "invalid regular expression '(def'", 18),
    "merge_unknown_pool": ("classes[1].route.fallback[0]", 'unknown pool "standrd"', 17),
    "missing_catch_all": ("classes[1].when", "must be a catch-all", 23),
    "missing_route_preferred": ("classes[1].route.preferred", "required field missing", 23),
    "nan_bound": ("classes[0].when.temperature", "not NaN", 17),
    "negative_weight": ("pools[1].endpoints[0].weight", "must be >= 0", 14),
    "non_http_url": ("pools[0].endpoints[0].url", "must be http(s)", 8),
    "non_string_key": ("", "keys must be strings, got 1", 2),
    "range_not_mapping": ("classes[0].when.temperature", "expected a range such as {lte: 0.5}", 17),
    "controller_without_standard_candidate": (
        "classes[0].controller",
        'needs a pool of the other kind than its home "speculative" (speculative) to move a share to; there is none',
        22,
    ),
    "saturated_is_preferred": ("classes[0].route.saturated", '"speculative" is route.preferred', 20),
    "saturation_without_saturated": ("classes[1].route.saturation", "without route.saturated", 26),
    "speculative_without_block": ("pools[0]", "needs a `speculative` block", 3),
    "standard_with_block": ("pools[1]", "must not have a `speculative` block", 9),
    "string_weight": ("pools[1].endpoints[0].weight", 'expected a number, got a string "2"', 14),
    "timeouts_out_of_order": ("pools[1].timeouts", "thresholds out of order", 14),
    "top_level_list": ("", "the top level must be a mapping", 2),
    "two_documents": ("", "expected a single document", 26),
    "unknown_embeddings_pool": ("embeddings_pool", 'unknown pool "embed"', 2),
    "unknown_endpoint": ("classes[0].when.endpoint.in[0]", 'unknown endpoint "chats"', 17),
    "unknown_field": ("classes[0].when.temprature", 'unknown field "temprature"', 17),
    "unknown_model": ("classes[0].when.model.in[1]", 'no pool serves model "other-model"', 17),
    "unknown_pool_in_fallback": ("classes[1].route.fallback[0]", 'unknown pool "std"', 25),
    "unknown_response_format": ("classes[0].when.response_format.in[1]", 'unknown response_format type "json"', 17),
    "unknown_spec_method": ("pools[0].speculative.method", 'got "medusa"', 5),
    "unknown_task_type": ("classes[0].when.task_type.in[0]", 'unknown task type "cod"', 18),
    "yaml_syntax_error": ("", "invalid YAML: expected ',' or ']'", 22),
}


def _matches(issue: ConfigIssue, path: str, message: str, line: int | None) -> bool:
    path_ok = issue.path == "" if path == "" else path in issue.path
    return path_ok and message in issue.message and issue.line == line


def test_every_invalid_fixture_has_an_expectation() -> None:
    assert sorted(p.stem for p in (FIXTURES / "invalid").glob("*.yaml")) == sorted(INVALID)
    assert len(INVALID) >= 15


@pytest.mark.parametrize(("name", "expected"), sorted(INVALID.items()), ids=sorted(INVALID))
def test_invalid_fixture(name: str, expected: tuple[str, str, int | None]) -> None:
    path, message, line = expected
    source = FIXTURES / "invalid" / f"{name}.yaml"
    with pytest.raises(RulesError) as info:
        load_rules_file(source)
    err = info.value
    assert err.source == str(source)
    assert any(_matches(i, path, message, line) for i in err.issues), "\n".join(map(repr, err.issues))
    rendered = str(err).splitlines()
    assert len(rendered) == len(err.issues)
    assert all(r.startswith(f"{source}: ") for r in rendered)


@pytest.mark.parametrize("source", sorted((FIXTURES / "valid").glob("*.yaml")), ids=lambda p: p.stem)
def test_valid_fixture(source: Path) -> None:
    rules = load_rules_file(source)
    assert rules.classes[-1].when.is_empty()
    assert list(semantic_issues(rules)) == []


@pytest.mark.parametrize("source", SHIPPED, ids=lambda p: p.name)
def test_shipped_rules_load(source: Path) -> None:
    rules = load_rules_file(source)
    assert summary(rules).startswith("ok: ")
    assert rules.defaults.temperature == 1.0


def test_examples_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"default.yaml", "ngram-summarization-rag.yaml", "code-assistant.yaml"} <= names


# ------------------------------------------------------------------------------------------- messages


def test_config_issue_str() -> None:
    issue = ConfigIssue("classes[2].route.fallback[0]", 'unknown pool "std"', 41)
    assert str(issue) == 'classes[2].route.fallback[0]: unknown pool "std" (line 41)'
    assert str(ConfigIssue("", "invalid YAML: boom", None)) == "invalid YAML: boom"


def test_rules_error_lists_every_issue_with_the_source() -> None:
    err = RulesError([ConfigIssue("a", "x", 1), ConfigIssue("b[0]", "y", None)], "rules.yaml")
    assert str(err) == "rules.yaml: a: x (line 1)\nrules.yaml: b[0]: y"


MINIMAL = """\
pools:
  - name: standard
    kind: standard
    models: [m]
    endpoints: [{url: "http://std:8000"}]
classes:
  - name: default
    route: {preferred: standard}
"""


def test_all_semantic_issues_are_collected_in_line_order() -> None:
    text = MINIMAL.replace(
        "classes:\n",
        "classes:\n"
        "  - name: a\n"
        "    when: {task_type: {in: [cod]}, endpoint: {in: [chat, embeddings]}}\n"
        "    route: {preferred: spec, fallback: [standard, standard]}\n",
    )
    with pytest.raises(RulesError) as info:
        load_rules_text(text)
    got = [(i.path, i.line) for i in info.value.issues]
    assert got == [
        ("classes[0].when.task_type.in[0]", 8),
        ("classes[0].when.endpoint.in[1]", 8),
        ("classes[0].route.preferred", 9),
        ("classes[0].route.fallback[1]", 9),
    ]
    assert info.value.source == "<string>"
    assert str(info.value).startswith("<string>: classes[0].when.task_type.in[0]: unknown task type")


def test_schema_and_duplicate_key_issues_are_reported_together() -> None:
    text = MINIMAL.replace("    kind: standard\n", "    kind: standard\n    kind: standard\n    colour: red\n")
    with pytest.raises(RulesError) as info:
        load_rules_text(text, "x.yaml")
    assert [str(i) for i in info.value.issues] == [
        'pools[0].kind: duplicate key "kind" (first on line 3) (line 4)',
        'pools[0].colour: unknown field "colour" (allowed: name, kind, speculative, models, endpoints, '
        "api_key_env, timeouts, max_connections, max_response_bytes, max_event_bytes, max_num_seqs, admission, "
        "scheduling_policy, "
        "prefix_affinity) (line 5)",
    ]


def test_missing_field_points_at_the_parent() -> None:
    with pytest.raises(RulesError) as info:
        load_rules_text(MINIMAL.replace("    models: [m]\n", ""))
    (issue,) = info.value.issues
    assert (issue.path, issue.message, issue.line) == ("pools[0].models", "required field missing", 2)


def test_unknown_field_suggests_the_closest_name() -> None:
    with pytest.raises(RulesError) as info:
        load_rules_text(MINIMAL.replace("route: {preferred: standard}", "route: {prefered: standard}"))
    assert [str(i) for i in info.value.issues] == [
        "classes[0].route.preferred: required field missing (line 8)",
        'classes[0].route.prefered: unknown field "prefered"; did you mean "preferred"? '
        "(allowed: preferred, saturated, fallback, saturation, ttft_deadline_s, fallback_model, pin) (line 8)",
    ]


def test_unreadable_file() -> None:
    with pytest.raises(RulesError) as info:
        load_rules_file(FIXTURES / "does-not-exist.yaml")
    assert "cannot read the file" in str(info.value)


def test_semantic_issues_of_rules_built_in_code() -> None:
    rules = load_rules_text(MINIMAL)
    broken = rules.model_copy(
        update={"classes": [TrafficClass.model_validate({"name": "x", "route": {"preferred": "nope"}})]}
    )
    issues = [(format_path(loc), msg) for loc, msg in semantic_issues(broken)]
    assert issues == [("classes[0].route.preferred", 'unknown pool "nope" (known: standard)')]


# ------------------------------------------------------------------------------------------- content


def test_summary() -> None:
    assert summary(load_rules_text(MINIMAL)) == ("ok: 1 pool (standard: 1 endpoint), 1 class, 0 task rules, models: m")
    rules = load_rules_file(ROOT / "routing_rules" / "default.yaml")
    assert summary(rules) == (
        "ok: 2 pools (speculative: 1 endpoint, standard: 1 endpoint), 7 classes, 8 task rules, "
        "models: meta-llama/Llama-3.3-70B-Instruct"
    )


def test_anchors_and_merge_keys() -> None:
    rules = load_rules_file(FIXTURES / "valid" / "full.yaml")
    tools = next(c for c in rules.classes if c.name == "tools-low")
    assert tools.route.preferred == "spec-eagle"
    assert tools.route.saturation.max_inflight_per_endpoint == 32
    assert rules.pool("spec.ngram").timeouts == rules.pool("spec-eagle").timeouts
    assert rules.pool("spec-eagle").endpoints[0].url == "http://10.0.0.1:8000"
    assert rules.classes[0].route == rules.classes[-1].route


def _class_for(rules: RoutingRules, **features: object) -> str:
    """A test-local matcher over the schema (classification proper lives in gateway.routing.classify)."""
    f: dict[str, object] = {
        "temperature": rules.defaults.temperature,
        "top_p": 1.0,
        "max_tokens": math.inf,
        "n": 1,
        "prompt_tokens": 100,
        "stream": True,
        "tools": False,
        "response_format": "text",
        "model": "meta-llama/Llama-3.3-70B-Instruct",
        "task_type": rules.defaults.task_type,
        "endpoint": "chat",
        **features,
    }

    def holds(when: Conditions) -> bool:
        for name in type(when).model_fields:
            cond = getattr(when, name)
            if cond is None:
                continue
            value = f[name]
            if isinstance(cond, bool):
                ok = cond is value
            elif hasattr(cond, "in_"):
                ok = value in cond.in_
            else:
                ok = cond.contains(value)
            if not ok:
                return False
        return True

    return next(c.name for c in rules.classes if holds(c.when))


DEFAULT_MATRIX = [
    # (features, class, preferred pool)
    ({}, "high-temperature", "standard"),  # no temperature = 1.0 (the seed's NGINX rule said speculative)
    ({"temperature": 1.0}, "high-temperature", "standard"),
    ({"temperature": 0.8, "task_type": "code"}, "high-temperature", "standard"),
    ({"temperature": 0.0}, "low-temperature", "speculative"),
    ({"temperature": 0.5}, "low-temperature", "speculative"),
    ({"temperature": 0.2, "task_type": "structured"}, "predictable-low-temperature", "speculative"),
    ({"temperature": 0.6, "task_type": "code"}, "predictable-mid-temperature", "speculative"),
    ({"temperature": 0.7, "task_type": "rag"}, "predictable-mid-temperature", "speculative"),
    ({"temperature": 0.6, "task_type": "chat"}, "open-mid-temperature", "standard"),
    ({"temperature": 0.6, "task_type": "creative"}, "open-mid-temperature", "standard"),
    ({"temperature": 0.0, "max_tokens": 16}, "short-output", "standard"),
    ({"temperature": 0.0, "max_tokens": 48, "stream": False}, "short-blocking", "standard"),
    ({"temperature": 0.0, "max_tokens": 48, "stream": True}, "low-temperature", "speculative"),
    ({"temperature": 0.0, "max_tokens": 64, "stream": False}, "low-temperature", "speculative"),
]


@pytest.mark.parametrize(("features", "cls", "pool"), DEFAULT_MATRIX)
def test_default_yaml_decision_matrix(features: dict[str, object], cls: str, pool: str) -> None:
    rules = load_rules_file(ROOT / "routing_rules" / "default.yaml")
    name = _class_for(rules, **features)
    assert name == cls
    route = next(c.route for c in rules.classes if c.name == name)
    assert route.preferred == pool
    other = "standard" if pool == "speculative" else "speculative"
    assert route.fallback == [other]
    if pool == "speculative":
        assert route.saturated == "standard"
        assert route.saturation.max_inflight_per_endpoint is not None


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("version: 1\npools:\n  - name: a\n    kind: standard\n     models: [m]\n", 5),  # a key one column too deep
        ("version: 1\npools:\n  - name: a\n    kind: standard\n   models: [m]\n", 5),  # ... one too shallow
        ("a:\n\tb: 1\n", 2),  # a tab
    ],
)
def test_an_indentation_mistake_names_its_line_and_says_what_to_check(text: str, line: int) -> None:
    with pytest.raises(RulesError) as info:
        load_rules_text(text)
    (issue,) = info.value.issues
    assert issue.line == line
    assert f"usually the indentation of line {line}" in issue.message
