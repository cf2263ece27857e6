"""``bench_classify``: the shape of its result on a small run (never its timing: tests do not assert speed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.bench.classify import ClassifyBenchResult, Timing, bench_classify, make_requests, run
from gateway.config.loader import load_rules_text

RULES_YAML = r"""
version: 1
pools:
  - name: spec
    kind: speculative
    speculative: {method: ngram, num_speculative_tokens: 4}
    models: [m]
    endpoints: [{url: "http://spec-0:8000"}]
  - name: std
    kind: standard
    models: [m]
    endpoints: [{url: "http://std-0:8000"}]
task_rules:
  - task: structured
    response_format: {in: [json_object, json_schema]}
  - task: tool_use
    tools: true
  - task: code
    patterns: ['```', '\bpython\b', '\bdef \w+\(']
  - task: summarization
    patterns: ['\bsummari[sz]e\b']
classes:
  - name: short
    when: {max_tokens: {lt: 32}}
    route: {preferred: std}
  - name: predictable
    when: {temperature: {lte: 0.5}, task_type: {in: [code, structured, tool_use, summarization]}}
    route: {preferred: spec, fallback: [std]}
  - name: rest
    route: {preferred: std}
"""
RULES = load_rules_text(RULES_YAML)
N = 500


@pytest.fixture(scope="module")
def result() -> ClassifyBenchResult:
    return bench_classify(RULES, n=N, seed=1)


def test_result_structure(result: ClassifyBenchResult) -> None:
    assert result.n == N
    assert result.batch == 100
    assert result.mean_body_bytes > 0
    for t in (result.classify_only, result.parse_and_classify):
        assert isinstance(t, Timing)
        assert all(isinstance(v, float) and v > 0 for v in (t.mean_ns, t.p50_ns, t.p99_ns))
        assert t.p50_ns <= t.p99_ns
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.n = 1  # type: ignore[misc]


def test_distributions(result: ClassifyBenchResult) -> None:
    class_names = {c.name for c in RULES.classes}
    assert sum(count for _, count in result.classes) == N
    assert sum(count for _, count in result.tasks) == N
    assert {name for name, _ in result.classes} <= class_names
    assert len(result.classes) == len(class_names)  # the mix reaches every class of this config
    assert {"chat", "code", "structured", "tool_use", "summarization"} <= {task for task, _ in result.tasks}
    counts = [count for _, count in result.classes]
    assert counts == sorted(counts, reverse=True)


def test_render(result: ClassifyBenchResult) -> None:
    text = result.render()
    assert "classify only" in text
    assert "parse + classify" in text
    for name, _ in result.classes:
        assert name in text


def test_request_mix_is_deterministic_and_varied() -> None:
    a = make_requests(RULES, 300, seed=7)
    assert [r.raw for r in a] == [r.raw for r in make_requests(RULES, 300, seed=7)]
    assert {r.endpoint for r in a} == {"chat", "completions"}
    chats = [r.body for r in a if r.endpoint == "chat"]
    assert all(1 <= len(b["messages"]) <= 6 for b in chats)
    assert any(b["messages"][0]["role"] in ("system", "developer") for b in chats)
    assert any("tools" in b for b in chats)
    assert any("response_format" in b for b in chats)
    assert any("temperature" not in b for b in chats)
    assert any(r.task_header is not None for r in a)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive"):
        bench_classify(RULES, n=0)


def test_run_loads_the_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES_YAML)
    assert run(str(path), 50).n == 50
