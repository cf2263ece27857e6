"""Classification: request body + X-Task-Type + routing rules → features → traffic class.

Three parts: a table of requests against a small routing config written here (so that every border is
deliberate), the error cases (each a 400 naming the parameter), a property test (any JSON-like body either
classifies or raises ``InvalidParameter``), and a table against the shipped ``routing_rules/default.yaml``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.loader import load_rules_file, load_rules_text
from gateway.config.schema import RoutingRules
from gateway.errors import InvalidParameter
from gateway.routing.classify import ApiKind, Classifier

# ---------------------------------------------------------------------------------------------- fixture config

RULES_YAML = r"""
version: 1
defaults:
  temperature: 1.0      # OpenAI's default for a request without temperature
  top_p: 1.0
  task_type: chat
  chars_per_token: 4.0
  task_scan_chars: 4096  # task rules read the first and last 2048 characters of a text
pools:
  - name: spec
    kind: speculative
    speculative: {method: eagle3, num_speculative_tokens: 4}
    models: [m]
    endpoints: [{url: "http://spec-0:8000"}]
  - name: std
    kind: standard
    models: [m, m-large]
    endpoints: [{url: "http://std-0:8000"}]
task_rules:
  - task: structured
    response_format: {in: [json_object, json_schema]}
  - task: tool_use
    tools: true
  - task: rag                      # before code: retrieved documents may contain any keyword
    patterns:
      - '<context>'
      - '\baccording to the (?:context|documents?)\b'
  - task: code
    patterns:
      - '```'
      - '\bdef \w+\('
      - '\b(?:python|javascript|sql)\b'
      - '\b(?:refactor|traceback)\b'
  - task: summarization
    patterns: ['\b(?:summari[sz]e|summary|tl;?dr)\b']
  - task: extraction
    patterns: ['\bextract\b', '\bnamed entities\b']
  - task: math
    scope: [last_user]             # a system prompt mentioning maths does not make every turn maths
    patterns: ['\b(?:solve|integral|equation)\b']
  - task: creative
    scope: [last_user]
    patterns: ['\b(?:poem|story|haiku)\b']
classes:
  - name: multi-choice
    when: {n: {gt: 1}}
    route: {preferred: std, fallback: [spec]}
  - name: tiny-output
    when: {max_tokens: {lte: 16}}
    route: {preferred: std, fallback: [spec]}
  - name: long-prompt
    when: {endpoint: {in: [chat]}, prompt_tokens: {gte: 2000}}
    route: {preferred: std, fallback: [spec]}
  - name: json-cool
    when:
      model: {in: [m]}
      response_format: {in: [json_object, json_schema]}
      temperature: {lt: 0.7}
    route: {preferred: spec, fallback: [std]}
  - name: predictable-cold
    when:
      model: {in: [m]}
      temperature: {lte: 0.5}
      task_type: {in: [code, tool_use, extraction, summarization, rag]}
    route: {preferred: spec, fallback: [std]}
  - name: cold-stream
    when:
      model: {in: [m]}
      stream: true
      tools: false
      temperature: {gte: 0.0, lt: 0.5}
      top_p: {gt: 0.5}
    route: {preferred: spec, fallback: [std]}
  - name: legacy-warm
    when:
      endpoint: {in: [completions]}
      temperature: {gt: 0.5, lte: 0.7}
    route: {preferred: spec, fallback: [std]}
  - name: default
    route: {preferred: std, fallback: [spec]}
"""

RULES = load_rules_text(RULES_YAML, "test_classify.RULES_YAML")
CLASSIFIER = Classifier(RULES)
CLASS_NAMES = frozenset(c.name for c in RULES.classes)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def chat(*messages: dict[str, Any] | str, model: Any = "m", **kw: Any) -> dict[str, Any]:
    """A chat body; a bare string is a user message."""
    msgs = [user(m) if isinstance(m, str) else m for m in messages]
    return {"model": model, "messages": msgs, **kw}


def completion(prompt: Any, model: str = "m", **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, **kw}


# (id, endpoint, body, X-Task-Type, expected class, expected task type)
Case = tuple[str, ApiKind, dict[str, Any], str | None, str, str]

CASES: list[Case] = [
    # --- temperature: the missing default and the borders of lt / lte / gt / gte
    (
        "no-temperature-is-1.0-not-speculative",
        "chat",
        chat("Write a python parser", stream=True),
        None,
        "default",
        "code",
    ),
    ("temperature-null-is-default", "chat", chat("Write a python parser", temperature=None), None, "default", "code"),
    ("code-t0.2-speculative", "chat", chat("Fix this python bug", temperature=0.2), None, "predictable-cold", "code"),
    ("temperature-int-0", "chat", chat("Refactor this module", temperature=0), None, "predictable-cold", "code"),
    ("lte-0.5-at-bound-matches", "chat", chat("Fix the traceback", temperature=0.5), None, "predictable-cold", "code"),
    ("lte-0.5-just-above", "chat", chat("Fix the traceback", temperature=0.51), None, "default", "code"),
    ("code-t0.7-standard", "chat", chat("Fix the traceback", temperature=0.7), None, "default", "code"),
    ("temperature-2.0", "chat", chat("Fix the traceback", temperature=2.0), None, "default", "code"),
    (
        "lt-0.7-below-bound",
        "chat",
        chat("x", response_format={"type": "json_object"}, temperature=0.69),
        None,
        "json-cool",
        "structured",
    ),
    (
        "lt-0.7-at-bound-excluded",
        "chat",
        chat("x", response_format={"type": "json_object"}, temperature=0.7),
        None,
        "default",
        "structured",
    ),
    ("gte-0.0-at-bound-matches", "chat", chat("hello", temperature=0.0, stream=True), None, "cold-stream", "chat"),
    ("lt-0.5-at-bound-excluded", "chat", chat("hello", temperature=0.5, stream=True), None, "default", "chat"),
    (
        "gt-top_p-at-bound-excluded",
        "chat",
        chat("hello", temperature=0.2, stream=True, top_p=0.5),
        None,
        "default",
        "chat",
    ),
    (
        "gt-top_p-above-bound",
        "chat",
        chat("hello", temperature=0.2, stream=True, top_p=0.51),
        None,
        "cold-stream",
        "chat",
    ),
    # --- stream
    ("stream-false", "chat", chat("hello", temperature=0.2, stream=False), None, "default", "chat"),
    ("stream-null-is-false", "chat", chat("hello", temperature=0.2, stream=None), None, "default", "chat"),
    # --- n
    ("n-2-multi-choice", "chat", chat("Fix the traceback", temperature=0.2, n=2), None, "multi-choice", "code"),
    ("n-1-explicit", "chat", chat("Fix the traceback", temperature=0.2, n=1), None, "predictable-cold", "code"),
    # --- max_tokens / max_completion_tokens
    (
        "max_tokens-lte-16-at-bound",
        "chat",
        chat("Fix the traceback", temperature=0.2, max_tokens=16),
        None,
        "tiny-output",
        "code",
    ),
    (
        "max_tokens-17",
        "chat",
        chat("Fix the traceback", temperature=0.2, max_tokens=17),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "max_completion_tokens-wins-small",
        "chat",
        chat("Fix the traceback", temperature=0.2, max_completion_tokens=8, max_tokens=500),
        None,
        "tiny-output",
        "code",
    ),
    (
        "max_completion_tokens-wins-large",
        "chat",
        chat("Fix the traceback", temperature=0.2, max_completion_tokens=500, max_tokens=8),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "max_completion_tokens-null-falls-back",
        "chat",
        chat("Fix the traceback", temperature=0.2, max_completion_tokens=None, max_tokens=8),
        None,
        "tiny-output",
        "code",
    ),
    ("no-max-is-unbounded", "chat", chat("hello", temperature=0.9), None, "default", "chat"),
    # --- tools / tool_choice
    (
        "tools-present",
        "chat",
        chat("What's the weather?", temperature=0.3, tools=[TOOL]),
        None,
        "predictable-cold",
        "tool_use",
    ),
    (
        "tools-stream-warm",
        "chat",
        chat("What's the weather?", temperature=0.6, stream=True, tools=[TOOL]),
        None,
        "default",
        "tool_use",
    ),
    (
        "tool_choice-without-tools-is-not-tool-use",
        "chat",
        chat("hi", temperature=0.3, tool_choice="auto"),
        None,
        "default",
        "chat",
    ),
    (
        "tool_choice-none-no-tools",
        "chat",
        chat("hi", temperature=0.3, stream=True, tool_choice="none"),
        None,
        "cold-stream",
        "chat",
    ),
    ("tools-empty-list", "chat", chat("hi", temperature=0.3, stream=True, tools=[]), None, "cold-stream", "chat"),
    (
        "tools-and-json-structured-first",
        "chat",
        chat("hi", temperature=0.3, tools=[TOOL], response_format={"type": "json_schema", "json_schema": {}}),
        None,
        "json-cool",
        "structured",
    ),
    # --- response_format
    (
        "json_schema-t0",
        "chat",
        chat("hi", temperature=0, response_format={"type": "json_schema"}),
        None,
        "json-cool",
        "structured",
    ),
    (
        "response_format-text",
        "chat",
        chat("hi", temperature=0.2, stream=True, response_format={"type": "text"}),
        None,
        "cold-stream",
        "chat",
    ),
    # --- what text the task rules read
    (
        "content-parts-text-only",
        "chat",
        chat(
            user(
                [
                    {"type": "text", "text": "Please summarize this chart"},
                    {"type": "image_url", "image_url": {"url": "https://x/python.png"}},
                ]
            ),
            temperature=0.2,
        ),
        None,
        "predictable-cold",
        "summarization",
    ),
    (
        "content-parts-image-not-scanned",
        "chat",
        chat(
            user(
                [
                    {"type": "image_url", "image_url": {"url": "https://x/python-traceback.png"}},
                    {"type": "text", "text": "what is this?"},
                ]
            ),
            temperature=0.2,
        ),
        None,
        "default",
        "chat",
    ),
    (
        "system-prompt-scanned",
        "chat",
        chat({"role": "system", "content": "You are a senior Python engineer."}, "hi", temperature=0.2),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "developer-role-is-system",
        "chat",
        chat({"role": "developer", "content": "Answer in SQL only."}, "hi", temperature=0.2),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "assistant-not-scanned",
        "chat",
        chat("hi", {"role": "assistant", "content": "```python\nprint(1)\n```"}, "thanks!", temperature=0.2),
        None,
        "default",
        "chat",
    ),
    (
        "only-last-user-creative",
        "chat",
        chat("Summarize this article", {"role": "assistant", "content": "ok"}, "now write me a haiku", temperature=0.2),
        None,
        "default",
        "creative",
    ),
    (
        "only-last-user-summarize",
        "chat",
        chat("write a poem", {"role": "assistant", "content": "roses..."}, "now summarize it", temperature=0.2),
        None,
        "predictable-cold",
        "summarization",
    ),
    (
        "scope-last_user-ignores-system",
        "chat",
        chat({"role": "system", "content": "You solve equations."}, "hello", temperature=0.2, stream=True),
        None,
        "cold-stream",
        "chat",
    ),
    ("math-in-last-user", "chat", chat("solve x^2 = 4", temperature=0.2, stream=True), None, "cold-stream", "math"),
    (
        "rag-before-code",
        "chat",
        chat("<context>Python is a language.</context> According to the context, what is it?", temperature=0.4),
        None,
        "predictable-cold",
        "rag",
    ),
    (
        "extraction",
        "chat",
        chat("Extract the named entities from: ...", temperature=0.1),
        None,
        "predictable-cold",
        "extraction",
    ),
    (
        "tool-call-history-content-null",
        "chat",
        chat(
            "weather?",
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "sunny", "tool_call_id": "1"},
            temperature=0.9,
        ),
        None,
        "default",
        "chat",
    ),
    # --- X-Task-Type
    ("header-overrides-rules", "chat", chat("write a poem", temperature=0.2), "code", "predictable-cold", "code"),
    ("header-lowercased", "chat", chat("hello", temperature=0.2), "Summarization", "predictable-cold", "summarization"),
    ("header-invalid-ignored", "chat", chat("write a poem", temperature=0.2), "co de!", "default", "creative"),
    ("header-empty-ignored", "chat", chat("Fix the traceback", temperature=0.2), "", "predictable-cold", "code"),
    (
        "header-unknown-task-kept",
        "chat",
        chat("Fix the traceback", temperature=0.2),
        "translation",
        "default",
        "translation",
    ),
    (
        "header-creative-json-still-json-class",
        "chat",
        chat("hi", temperature=0.2, response_format={"type": "json_object"}),
        "creative",
        "json-cool",
        "creative",
    ),
    # --- legacy completions
    (
        "completions-string-prompt",
        "completions",
        completion("def add(a, b):", temperature=0.2),
        None,
        "predictable-cold",
        "code",
    ),
    (
        "completions-gt-0.5-at-bound-excluded",
        "completions",
        completion("Once upon a time", temperature=0.5),
        None,
        "default",
        "chat",
    ),
    ("completions-warm", "completions", completion("Once upon a time", temperature=0.6), None, "legacy-warm", "chat"),
    (
        "completions-lte-0.7-at-bound",
        "completions",
        completion("Once upon a time", temperature=0.7),
        None,
        "legacy-warm",
        "chat",
    ),
    (
        "completions-list-last-prompt-scanned",
        "completions",
        completion(["def f(x):", "tell me a story"], temperature=0.2),
        None,
        "default",
        "creative",
    ),
    ("completions-token-ids", "completions", completion([1, 2, 3], temperature=0.2), None, "default", "chat"),
    (
        "completions-long-token-batches-not-chat",
        "completions",
        completion([[1] * 1500, [2] * 1000], temperature=0.9),
        None,
        "default",
        "chat",
    ),
    # --- model
    (
        "model-without-spec-pool",
        "chat",
        chat("Fix the traceback", model="m-large", temperature=0.2),
        None,
        "default",
        "code",
    ),
    # --- prompt size
    ("long-prompt-at-bound", "chat", chat("```" + "a" * 7997, temperature=0.2), None, "long-prompt", "code"),
    ("long-prompt-just-below", "chat", chat("```" + "a" * 7996, temperature=0.2), None, "predictable-cold", "code"),
    (
        "long-prompt-summed-over-messages",
        "chat",
        chat({"role": "system", "content": "s" * 4000}, "Summarize: " + "w" * 3989, temperature=0.2),
        None,
        "long-prompt",
        "summarization",
    ),
    # --- the task rules read the head and the tail of a long text (task_scan_chars: 4096), not its middle
    (
        "long-text-cue-at-tail-scanned",
        "chat",
        chat("a " * 20000 + "in python", temperature=0.9),
        None,
        "long-prompt",
        "code",
    ),
    (
        "long-text-cue-in-middle-not-scanned",
        "chat",
        chat("a " * 10000 + "python " + "a " * 10000, temperature=0.9),
        None,
        "long-prompt",
        "chat",
    ),
    # --- first match wins
    ("first-match-n-before-tiny", "chat", chat("hi", n=3, max_tokens=4), None, "multi-choice", "chat"),
    ("first-match-n-before-model", "chat", chat("hi", model="m-large", n=2), None, "multi-choice", "chat"),
    (
        "first-match-tiny-before-json",
        "chat",
        chat("hi", temperature=0, max_tokens=10, response_format={"type": "json_object"}),
        None,
        "tiny-output",
        "structured",
    ),
    # --- catch-all
    ("catch-all-plain-chat", "chat", chat("Tell me about Paris."), None, "default", "chat"),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "header", "expected_class", "expected_task"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_classification_table(
    endpoint: ApiKind, body: dict[str, Any], header: str | None, expected_class: str, expected_task: str
) -> None:
    result = CLASSIFIER.classify(endpoint, body, header)
    assert (result.traffic_class.name, result.features.task_type) == (expected_class, expected_task)


def test_table_is_big_and_ids_are_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) >= 40
    assert len(set(ids)) == len(ids)
    assert {c[4] for c in CASES} == CLASS_NAMES  # every class is reached by some row


# ---------------------------------------------------------------------------------------------- features


def test_missing_fields_take_the_defaults() -> None:
    f = CLASSIFIER.features("chat", chat("hello"))
    assert f.temperature == 1.0
    assert f.top_p == 1.0
    assert f.max_tokens == math.inf
    assert f.stream is False
    assert f.n == 1
    assert f.tools is False
    assert f.response_format == "text"
    assert (f.task_type, f.task_source) == ("chat", "default")


def test_default_temperature_comes_from_the_config() -> None:
    data = RULES.model_dump(by_alias=True)
    data["defaults"]["temperature"] = 0.2
    f = Classifier(RoutingRules.model_validate(data)).features("chat", chat("hello"))
    assert f.temperature == 0.2


def test_task_source() -> None:
    assert CLASSIFIER.features("chat", chat("hi"), "code").task_source == "header"
    assert CLASSIFIER.features("chat", chat("write a poem")).task_source == "rule"
    assert CLASSIFIER.features("chat", chat("hi"), "bad header").task_source == "default"


def test_prompt_tokens_estimate() -> None:
    assert CLASSIFIER.features("chat", chat("a" * 400)).prompt_tokens == 100
    assert CLASSIFIER.features("completions", completion(["ab", "cd"])).prompt_tokens == 1  # "ab\ncd": 5 chars
    assert CLASSIFIER.features("completions", completion(list(range(10)))).prompt_tokens == 10
    assert CLASSIFIER.features("completions", completion([[1, 2], [3]])).prompt_tokens == 3


def test_ints_become_floats() -> None:
    f = CLASSIFIER.features("chat", chat("hi", temperature=1, top_p=1, max_tokens=100))
    assert (type(f.temperature), type(f.top_p), type(f.max_tokens)) == (float, float, float)


# ---------------------------------------------------------------------------------------------- errors

ERROR_CASES: list[tuple[str, ApiKind, dict[str, Any], str]] = [
    ("temperature-string", "chat", chat("hi", temperature="0.2"), "temperature"),
    ("temperature-bool", "chat", chat("hi", temperature=True), "temperature"),
    ("temperature-inf", "chat", chat("hi", temperature=float("inf")), "temperature"),
    ("temperature-nan", "chat", chat("hi", temperature=float("nan")), "temperature"),
    ("top_p-string", "chat", chat("hi", top_p="1"), "top_p"),
    ("max_tokens-string", "chat", chat("hi", max_tokens="100"), "max_tokens"),
    ("max_tokens-minus-inf", "chat", chat("hi", max_tokens=float("-inf")), "max_tokens"),
    ("max_completion_tokens-list", "chat", chat("hi", max_completion_tokens=[1]), "max_completion_tokens"),
    ("model-missing", "chat", {"messages": [user("hi")]}, "model"),
    ("model-empty", "chat", chat("hi", model=""), "model"),
    ("model-not-string", "chat", chat("hi", model=7), "model"),
    ("messages-missing", "chat", {"model": "m"}, "messages"),
    ("messages-not-list", "chat", {"model": "m", "messages": {"role": "user", "content": "hi"}}, "messages"),
    ("messages-empty", "chat", {"model": "m", "messages": []}, "messages"),
    ("message-not-object", "chat", {"model": "m", "messages": ["hi"]}, "messages"),
    ("prompt-missing", "completions", {"model": "m"}, "prompt"),
    ("prompt-number", "completions", completion(42), "prompt"),
    ("prompt-empty-list", "completions", completion([]), "prompt"),
    ("prompt-mixed-list", "completions", completion(["a", 1]), "prompt"),
    ("n-float", "chat", chat("hi", n=2.0), "n"),
    ("n-string", "chat", chat("hi", n="2"), "n"),
    ("n-bool", "chat", chat("hi", n=True), "n"),
    ("stream-string", "chat", chat("hi", stream="true"), "stream"),
    ("stream-int", "chat", chat("hi", stream=1), "stream"),
    ("response_format-string", "chat", chat("hi", response_format="json_object"), "response_format"),
    ("response_format-no-type", "chat", chat("hi", response_format={}), "response_format"),
    ("response_format-type-not-string", "chat", chat("hi", response_format={"type": 1}), "response_format"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), [pytest.param(*case[1:], id=case[0]) for case in ERROR_CASES])
def test_invalid_parameters(endpoint: ApiKind, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameter) as info:
        CLASSIFIER.classify(endpoint, body)
    assert info.value.param == param
    assert info.value.status == 400
    assert info.value.envelope()["error"]["param"] == param


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(chat("hi \ud800 python"), id="last-user"),
        pytest.param(chat({"role": "system", "content": "\udcff"}, "hi"), id="system"),
        pytest.param(completion("\ud83d tell me a story"), id="completions"),
    ],
)
def test_lone_surrogate_in_text_classifies_or_is_an_invalid_parameter(body: dict[str, Any]) -> None:
    endpoint: ApiKind = "completions" if "prompt" in body else "chat"
    try:
        name = CLASSIFIER.classify(endpoint, body).traffic_class.name
    except InvalidParameter:
        return
    assert name in CLASS_NAMES


def test_huge_int_temperature_is_an_invalid_parameter() -> None:
    with pytest.raises(InvalidParameter) as info:
        CLASSIFIER.classify("chat", chat("hi", temperature=10**400))
    assert info.value.param == "temperature"


# ---------------------------------------------------------------------------------------------- property

_FIELDS = [
    "model", "messages", "prompt", "temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "stream",
    "tools", "tool_choice", "response_format",
]  # fmt: skip
# orjson's domain: integers that fit 64 bits (larger ones arrive as floats), floats (inf/nan only when passed directly).
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["m", "m-large", "user", "system", "text", "json_object", "none", "auto", "```"])
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_words = st.lists(
    st.sampled_from(["hello", "python", "summarize", "extract", "poem", "solve", "<context>", "```", "the", "a"]),
    max_size=6,
).map(" ".join)
_message = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls"]),
    st.sampled_from(["user", "system", "developer", "assistant", "tool"])
    | _words
    | _json
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _words | _scalars})),
    max_size=3,
)


def _mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A plausible value nine times in ten, any JSON-like value otherwise."""
    return st.sampled_from([*[good] * 9, _json]).flatmap(lambda s: s)


_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["m", "m-large", "other"]),
    "messages": st.lists(_message, min_size=1, max_size=4),
    "prompt": _words
    | st.lists(_words, max_size=3)
    | st.lists(st.integers(0, 50000), max_size=5)
    | st.lists(st.lists(st.integers(0, 50000), max_size=3), max_size=3),
    "temperature": st.none() | st.floats(0, 2) | st.integers(0, 2),
    "top_p": st.none() | st.floats(0, 1),
    "max_tokens": st.none() | st.integers(0, 5000),
    "max_completion_tokens": st.none() | st.integers(0, 5000),
    "n": st.none() | st.integers(1, 4),
    "stream": st.none() | st.booleans(),
    "tools": st.none() | st.lists(st.just(TOOL), max_size=2),
    "tool_choice": st.none() | st.sampled_from(["auto", "none", "required"]),
    "response_format": st.none()
    | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "regex"])}),
}
# Every real field, plausible or of a random type (each but the three below present or absent), plus unknown keys.
_REQUIRED = ("model", "messages", "prompt")
_body = st.builds(
    lambda known, unknown: {**unknown, **known},
    st.fixed_dictionaries(
        {k: _mostly(_PLAUSIBLE[k]) for k in _REQUIRED},
        optional={k: _mostly(v) for k, v in _PLAUSIBLE.items() if k not in _REQUIRED},
    ),
    st.dictionaries(st.text(max_size=8), _scalars, max_size=2),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    endpoint=st.sampled_from(["chat", "completions"]),
    body=_body,
    header=st.none() | st.text(max_size=10) | st.sampled_from(["code", "Creative", "x y"]),
)
def test_any_body_classifies_or_is_an_invalid_parameter(
    endpoint: ApiKind, body: dict[str, Any], header: str | None
) -> None:
    outcome: str | InvalidParameter
    try:
        outcome = CLASSIFIER.classify(endpoint, body, header).traffic_class.name
    except InvalidParameter as exc:  # anything else fails the test
        outcome = exc
    if isinstance(outcome, InvalidParameter):
        assert outcome.status == 400
        assert outcome.param in _FIELDS
    else:
        assert outcome in CLASS_NAMES


# ---------------------------------------------------------------------------------------------- default.yaml

DEFAULT_YAML = Path(__file__).resolve().parents[2] / "routing_rules" / "default.yaml"
LLAMA = "meta-llama/Llama-3.3-70B-Instruct"


def llama(*messages: dict[str, Any] | str, **kw: Any) -> dict[str, Any]:
    return chat(*messages, model=LLAMA, **kw)


# (id, endpoint, body, X-Task-Type, expected class, expected pool kind)
DEFAULT_CASES: list[Case] = [
    (
        "missing-temperature-code-is-standard",
        "chat",
        llama("Refactor this python function", stream=True),
        None,
        "high-temperature",
        "standard",
    ),
    (
        "code-t0.2-speculative",
        "chat",
        llama("Refactor this python function", temperature=0.2, stream=True),
        None,
        "predictable-low-temperature",
        "speculative",
    ),
    (
        "json-t0-speculative",
        "chat",
        llama("hi", temperature=0, response_format={"type": "json_object"}),
        None,
        "predictable-low-temperature",
        "speculative",
    ),
    (
        "rag-t0.4-speculative",
        "chat",
        llama("<context>...</context> Based on the context, who won?", temperature=0.4),
        None,
        "predictable-low-temperature",
        "speculative",
    ),
    (
        "chat-t0.5-at-bound-speculative",
        "chat",
        llama("hello there", temperature=0.5),
        None,
        "low-temperature",
        "speculative",
    ),
    (
        "header-creative-t0.3-speculative",
        "chat",
        llama("def f():", temperature=0.3),
        "creative",
        "low-temperature",
        "speculative",
    ),
    (
        "no-max-tokens-not-short",
        "chat",
        llama("hello", temperature=0.2, stream=False),
        None,
        "low-temperature",
        "speculative",
    ),
    (
        "creative-t1.0-standard",
        "chat",
        llama("Write a poem about the sea", temperature=1.0, stream=True),
        None,
        "high-temperature",
        "standard",
    ),
    (
        "max_tokens-16-standard",
        "chat",
        llama("Refactor this python", temperature=0.0, max_tokens=16),
        None,
        "short-output",
        "standard",
    ),
    (
        "max_tokens-31-border",
        "chat",
        llama("Refactor this python", temperature=0.0, max_tokens=31, stream=True),
        None,
        "short-output",
        "standard",
    ),
    (
        "max_tokens-32-not-short",
        "chat",
        llama("Refactor this python", temperature=0.0, max_tokens=32, stream=True),
        None,
        "predictable-low-temperature",
        "speculative",
    ),
    (
        "max_completion_tokens-8-wins",
        "chat",
        llama("Refactor this python", temperature=0.0, max_completion_tokens=8, max_tokens=4000),
        None,
        "short-output",
        "standard",
    ),
    (
        "short-blocking",
        "chat",
        llama("Refactor this python", temperature=0.0, max_tokens=50, stream=False),
        None,
        "short-blocking",
        "standard",
    ),
    (
        "short-streaming-not-blocking",
        "chat",
        llama("Refactor this python", temperature=0.0, max_tokens=50, stream=True),
        None,
        "predictable-low-temperature",
        "speculative",
    ),
    (
        "summarization-t0.6-mid",
        "chat",
        llama("Summarize this report", temperature=0.6),
        None,
        "predictable-mid-temperature",
        "speculative",
    ),
    (
        "code-t0.7-at-bound-mid",
        "chat",
        llama("Fix this traceback", temperature=0.7),
        None,
        "predictable-mid-temperature",
        "speculative",
    ),
    (
        "code-t0.71-standard",
        "chat",
        llama("Fix this traceback", temperature=0.71),
        None,
        "high-temperature",
        "standard",
    ),
    (
        "creative-t0.6-open-mid",
        "chat",
        llama("Write a story", temperature=0.6),
        None,
        "open-mid-temperature",
        "standard",
    ),
    (
        "tool_use-t0.6-open-mid",
        "chat",
        llama("weather?", temperature=0.6, tools=[TOOL]),
        None,
        "open-mid-temperature",
        "standard",
    ),
    (
        "completions-token-ids-t0",
        "completions",
        completion([1, 2, 3], model=LLAMA, temperature=0),
        None,
        "low-temperature",
        "speculative",
    ),
    ("plain-chat-no-temperature", "chat", llama("Tell me about Paris."), None, "high-temperature", "standard"),
]


@pytest.fixture(scope="module")
def default_classifier() -> tuple[Classifier, RoutingRules]:
    if not DEFAULT_YAML.exists():
        pytest.skip(f"{DEFAULT_YAML} does not exist yet (being written in parallel)")
    rules = load_rules_file(DEFAULT_YAML)  # a file that exists but does not load fails the test
    return Classifier(rules), rules


@pytest.mark.parametrize(
    ("endpoint", "body", "header", "expected_class", "expected_kind"),
    [pytest.param(*case[1:], id=case[0]) for case in DEFAULT_CASES],
)
def test_default_yaml(
    default_classifier: tuple[Classifier, RoutingRules],
    endpoint: ApiKind,
    body: dict[str, Any],
    header: str | None,
    expected_class: str,
    expected_kind: str,
) -> None:
    classifier, rules = default_classifier
    cls = classifier.classify(endpoint, body, header).traffic_class
    assert (cls.name, rules.pool(cls.route.preferred).kind) == (expected_class, expected_kind)


def test_default_yaml_table_is_big_enough() -> None:
    assert len(DEFAULT_CASES) >= 12


def test_a_system_prompt_seen_again_classifies_the_same_and_the_kept_hits_stay_bounded() -> None:
    from gateway.routing.classify import SYSTEM_HITS_KEPT

    c = Classifier(RULES)
    rag = chat({"role": "system", "content": "Answer according to the documents."}, "hello")
    plain = chat({"role": "system", "content": "You are terse."}, "hello")
    for _ in range(3):
        assert c.features("chat", rag).task_type == "rag"
        assert c.features("chat", plain).task_type == CLASSIFIER.features("chat", plain).task_type
    for i in range(SYSTEM_HITS_KEPT + 10):  # many distinct system prompts: each still scanned right
        body = chat({"role": "system", "content": f"note {i}: summarise"}, "hello")
        assert c.features("chat", body).task_type == "summarization"
    assert len(c._tasks._system_hits) <= SYSTEM_HITS_KEPT
    assert c.features("chat", rag).task_type == "rag"
