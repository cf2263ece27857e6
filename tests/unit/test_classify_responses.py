"""Classification of Responses API bodies (``POST /v1/responses``): the same routing features from its own fields.

A table against the fixture config of ``test_classify`` (plus two classes on the new conditions), the feature
mapping field by field, and a property test: any JSON-like body classifies or raises ``InvalidParameter``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.loader import load_rules_text
from gateway.errors import InvalidParameter
from gateway.routing.classify import Classifier
from tests.unit.test_classify import RULES_YAML

EXTRA = """
  - name: responses-reasoning
    when: {endpoint: {in: [responses]}, reasoning: {in: [high]}}
    route: {preferred: std, fallback: [spec]}
"""
# The new classes go first: insert them right after "classes:".
YAML = RULES_YAML.replace("classes:\n", "classes:\n" + EXTRA.lstrip("\n"), 1)
CLASSIFIER = Classifier(load_rules_text(YAML, "test_classify_responses"))
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
SCHEMA = {"type": "json_schema", "name": "a", "schema": {"type": "object"}}


def resp(inp: Any = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "input": inp, **kw}


def msg(role: str, text: str, part: str = "input_text") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


# (id, body, X-Task-Type, expected class, expected task type)
CASES: list[tuple[str, dict[str, Any], str | None, str, str]] = [
    ("string-input-code-cold", resp("Write a python parser", temperature=0.2), None, "predictable-cold", "code"),
    ("no-temperature-is-default", resp("Write a python parser"), None, "default", "code"),
    (
        "instructions-are-the-system-text",
        resp("go", instructions="<context> docs", temperature=0),
        None,
        "predictable-cold",
        "rag",
    ),
    (
        "message-items-last-user-wins",
        resp(
            [msg("user", "write a poem"), msg("assistant", "ok", "output_text"), msg("user", "now a python def f(x):")],
            temperature=0.1,
        ),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "developer-role-is-system",
        resp([msg("developer", "```"), msg("user", "hi")], temperature=0.1),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "string-content-items",
        resp([{"role": "user", "content": "summarize this"}], temperature=0.3),
        None,
        "predictable-cold",
        "summarization",
    ),
    (
        "tool-output-items-count-not-scan",
        resp(
            [{"type": "function_call_output", "call_id": "c", "output": "def f("}, msg("user", "thanks")],
            temperature=0.1,
        ),
        None,
        "default",
        "chat",
    ),
    ("max-output-tokens-is-max-tokens", resp("hi", max_output_tokens=16), None, "tiny-output", "chat"),
    ("max-output-tokens-17-not-tiny", resp("hi", max_output_tokens=17), None, "default", "chat"),
    (
        "json-schema-is-structured",
        resp("hi", text={"format": SCHEMA}, temperature=0.5),
        None,
        "json-cool",
        "structured",
    ),
    (
        "text-format-text-is-chat",
        resp("hi", text={"format": {"type": "text"}}, temperature=0.5),
        None,
        "default",
        "chat",
    ),
    ("tools-are-tool-use", resp("weather?", tools=[TOOL], temperature=0.1), None, "predictable-cold", "tool_use"),
    (
        "tool-choice-none-is-no-tools",
        resp("weather?", tools=[TOOL], tool_choice="none", temperature=0.1),
        None,
        "default",
        "chat",
    ),
    ("stream-cold", resp("hi", stream=True, temperature=0.1, top_p=0.9), None, "cold-stream", "chat"),
    ("reasoning-effort", resp("hi", reasoning={"effort": "high"}), None, "responses-reasoning", "chat"),
    ("header-task-wins", resp("hi", temperature=0.1), "extraction", "predictable-cold", "extraction"),
    ("long-prompt-is-chat-only", resp("x" * 9000), None, "default", "chat"),
]


@pytest.mark.parametrize(("body", "header", "klass", "task"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classification_table(body: dict[str, Any], header: str | None, klass: str, task: str) -> None:
    c = CLASSIFIER.classify("responses", body, header)
    assert (c.traffic_class.name, c.features.task_type) == (klass, task)
    assert c.features.endpoint == "responses"
    assert c.features.n == 1


def test_features_field_by_field() -> None:
    f = CLASSIFIER.features(
        "responses",
        resp(
            [msg("user", "abcd" * 10)],
            instructions="be brief",
            temperature=0.3,
            top_p=0.8,
            max_output_tokens=99,
            stream=True,
            tools=[TOOL],
            text={"format": {"type": "json_object"}},
            reasoning={"effort": "low"},
        ),
    )
    assert (f.temperature, f.top_p, f.max_tokens, f.stream, f.tools) == (0.3, 0.8, 99.0, True, True)
    assert (f.response_format, f.reasoning) == ("json_object", "low")
    assert f.prompt_tokens == int((40 + len("be brief")) / 4.0)
    bare = CLASSIFIER.features("responses", resp("hi"))
    assert (bare.max_tokens, bare.reasoning, bare.response_format, bare.tools) == (math.inf, "none", "text", False)


def test_chat_reasoning_effort_is_the_same_feature() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}
    assert CLASSIFIER.features("chat", body).reasoning == "high"
    with pytest.raises(InvalidParameter):
        CLASSIFIER.features("chat", {**body, "reasoning_effort": 3})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(
    [
        "input",
        "instructions",
        "temperature",
        "top_p",
        "max_output_tokens",
        "stream",
        "tools",
        "tool_choice",
        "text",
        "reasoning",
        "store",
        "previous_response_id",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, json_values, max_size=6))
def test_any_body_classifies_or_is_a_400(extra: dict[str, Any]) -> None:
    try:
        CLASSIFIER.classify("responses", {"model": "m", **extra})
    except InvalidParameter as exc:
        failed: InvalidParameter | None = exc
    else:
        failed = None
    assert failed is None or (failed.status == 400 and failed.param)
