"""Classification: request body + headers + rules → features → traffic class. Pure, no I/O.

``Classifier`` is compiled once per routing config (regexes compiled, conditions flattened into closures
over plain floats) so that classifying one request touches only dict lookups and a few comparisons.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Literal

import re2

# A request's API (chat, completions, responses): ``api`` in the code; the YAML's condition and ``RequestFeatures``
# call it ``endpoint`` (OpenAI's word for its paths), which is not a pool's endpoint (``config.pool.Endpoint``).
from gateway.config.base import ApiKind as ApiKind  # re-exported
from gateway.config.schema import Conditions, Range, RoutingRules, TaskRule, TrafficClass, re2_options
from gateway.errors import InvalidParameter, finite_number
from gateway.routing.responses_features import format_type, responses_inputs, responses_texts
from gateway.routing.responses_features import reasoning_effort as _reasoning_effort

TaskSource = Literal["header", "rule", "default"]
TASK_HEADER = "x-task-type"
_TASK_HEADER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class RequestFeatures:
    """What the router knows about one request. ``max_tokens`` is +inf when the client set no limit."""

    endpoint: ApiKind
    model: str
    temperature: float
    top_p: float
    max_tokens: float
    stream: bool
    n: int
    tools: bool
    response_format: str
    prompt_tokens: int
    task_type: str
    task_source: TaskSource
    reasoning: str = "none"  # the reasoning effort asked for (``reasoning.effort`` / ``reasoning_effort``)


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class Classification:
    """A request's routing features and the first traffic class whose conditions they meet."""

    features: RequestFeatures
    traffic_class: TrafficClass


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidParameter(f"'{key}' must be a number, got {type(v).__name__}", param=key)
    return finite_number(v, key, f"'{key}' must be a finite number")


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(t for t in parts if isinstance(t, str))
    return ""


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class Texts:
    """What the task rules read of a prompt (its system text, its last user text) and its length in characters."""

    system: str
    last_user: str
    chars: int


def _chat_texts(body: Mapping[str, Any]) -> Texts:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("'messages' must be a non-empty array", param="messages")
    system: list[str] = []
    last_user = ""
    chars = 0
    for m in messages:
        if not isinstance(m, dict):
            raise InvalidParameter("each message must be an object", param="messages")
        text = _text_of(m.get("content"))
        chars += len(text)
        role = m.get("role")
        if role == "system" or role == "developer":
            system.append(text)
        elif role == "user":
            last_user = text
    return Texts("\n".join(system), last_user, chars)


def _completion_texts(body: Mapping[str, Any]) -> Texts:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Texts("", prompt, len(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            joined = "\n".join(prompt)
            return Texts("", prompt[-1], len(joined))
        if all(isinstance(p, int) for p in prompt):  # token ids
            return Texts("", "", len(prompt) * 4)
        if all(isinstance(p, list) for p in prompt):  # batches of token ids
            return Texts("", "", sum(len(p) for p in prompt) * 4)
    raise InvalidParameter("'prompt' must be a string, an array of strings or of token ids", param="prompt")


def _in_range(body: Mapping[str, Any], key: str, value: float, low: float, high: float = math.inf) -> float:
    """``value`` (read from ``body[key]``) within [low, high] when the client set it: else the 400 OpenAI answers,
    naming the field, before any pool sees the request. A default from the YAML is not checked here."""
    if key in body and body[key] is not None:
        if value < low:
            raise InvalidParameter(
                f"Invalid '{key}': below minimum value. Expected a value >= {low:g}, but got {value:g} instead.",
                param=key,
            )
        if value > high:
            raise InvalidParameter(
                f"Invalid '{key}': above maximum value. Expected a value <= {high:g}, but got {value:g} instead.",
                param=key,
            )
    return value


def _n_of(body: Mapping[str, Any]) -> int:
    n_raw = body.get("n")
    if n_raw is None:
        return 1
    if isinstance(n_raw, int) and not isinstance(n_raw, bool):
        return int(_in_range(body, "n", n_raw, 1))
    raise InvalidParameter("'n' must be an integer", param="n")


def request_texts(api: ApiKind, body: Mapping[str, Any]) -> Texts:
    """The texts of a request's prompt. Raises ``InvalidParameter`` when the prompt's fields have the wrong shape."""
    if api == "chat":
        return _chat_texts(body)
    if api == "completions":
        return _completion_texts(body)
    return Texts(*responses_texts(body))


def window(text: str, limit: int) -> str:
    """The head and tail of a long text: task cues sit at the start or the end of a prompt. Windowing a windowed
    text again changes nothing."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + "\n" + text[-half:]


SYSTEM_HITS_KEPT = 256  # system prompts whose task-rule hits are kept (the few an application sends, again and again)


class _TaskMatcher:
    """All task rules' patterns in two RE2 sets (system prompt, last user message): one linear pass per text, and
    none for a system prompt seen recently (its hits are kept)."""

    def __init__(self, rules: Sequence[TaskRule], scan_chars: int) -> None:
        self._scan_chars = scan_chars
        self._rules = tuple(
            (r.task, frozenset(r.response_format.in_) if r.response_format else None, r.tools, bool(r.patterns))
            for r in rules
        )
        self._sets: list[tuple[Any, list[int], str]] = []
        # system text -> the rules its patterns hit (at most SYSTEM_HITS_KEPT texts, then forgotten all at once)
        self._system_hits: dict[str, frozenset[int]] = {}
        for scope in ("system", "last_user"):
            owners: list[int] = []
            rset = re2.Set.SearchSet(re2_options())
            for i, rule in enumerate(rules):
                if scope in rule.scope:
                    for pattern in rule.patterns:
                        rset.Add(pattern)
                        owners.append(i)
            if owners:
                rset.Compile()
                self._sets.append((rset, owners, scope))

    def _scan(self, texts: Texts) -> set[int]:
        hits: set[int] = set()
        for rset, owners, scope in self._sets:
            if scope == "system":  # most requests repeat a system prompt of a few: its rules' hits are kept
                text = window(texts.system, self._scan_chars)  # kept as scanned: at most scan_chars characters
                if text:
                    got = self._system_hits.get(text)
                    if got is None:
                        got = frozenset(self._match(rset, owners, text))
                        if len(self._system_hits) >= SYSTEM_HITS_KEPT:
                            self._system_hits.clear()
                        self._system_hits[text] = got
                    hits.update(got)
            elif texts.last_user:
                hits.update(self._match(rset, owners, texts.last_user))
        return hits

    def _match(self, rset: Any, owners: list[int], text: str) -> list[int]:
        # Encoded here: "replace" keeps a lone surrogate (possible in JSON) from raising.
        data = window(text, self._scan_chars).encode("utf-8", "replace")
        return [owners[k] for k in rset.Match(data) or ()]

    def match(self, response_format: str, tools: bool, texts: Texts) -> str | None:
        hits: set[int] | None = None
        for i, (task, formats, want_tools, has_patterns) in enumerate(self._rules):
            if formats is not None and response_format not in formats:
                continue
            if want_tools is not None and tools != want_tools:
                continue
            if not has_patterns:
                return task
            if hits is None:
                hits = self._scan(texts)
            if i in hits:
                return task
        return None


Predicate = Callable[[RequestFeatures], bool]


def _range_pred(attr: str, r: Range) -> Predicate:
    get = attrgetter(attr)
    lo = max((b for b in (r.gt, r.gte) if b is not None), default=-math.inf)
    hi = min((b for b in (r.lt, r.lte) if b is not None), default=math.inf)
    lo_open = r.gt is not None and r.gt == lo
    hi_open = r.lt is not None and r.lt == hi
    if lo_open and hi_open:
        return lambda f: lo < get(f) < hi
    if lo_open:
        return lambda f: lo < get(f) <= hi
    if hi_open:
        return lambda f: lo <= get(f) < hi
    return lambda f: lo <= get(f) <= hi


def _set_pred(attr: str, values: list[str]) -> Predicate:
    get = attrgetter(attr)
    allowed = frozenset(values)
    return lambda f: get(f) in allowed


def _bool_pred(attr: str, want: bool) -> Predicate:
    get = attrgetter(attr)
    return lambda f: bool(get(f)) is want


def compile_conditions(c: Conditions) -> tuple[Predicate, ...]:
    preds: list[Predicate] = []
    for attr in ("temperature", "top_p", "max_tokens", "n", "prompt_tokens"):
        r = getattr(c, attr)
        if r is not None:
            preds.append(_range_pred(attr, r))
    for attr in ("stream", "tools"):
        b = getattr(c, attr)
        if b is not None:
            preds.append(_bool_pred(attr, b))
    for attr in ("response_format", "model", "task_type", "endpoint", "reasoning"):
        s = getattr(c, attr)
        if s is not None:
            preds.append(_set_pred(attr, s.in_))
    return tuple(preds)


class Classifier:
    """Compiled from one ``RoutingRules``; safe to share between requests (what it keeps, the task rules' hits of
    recent system prompts, changes no answer)."""

    def __init__(self, rules: RoutingRules) -> None:
        d = rules.defaults
        self._default_temperature = d.temperature
        self._default_top_p = d.top_p
        self._default_task = d.task_type
        self._chars_per_token = d.chars_per_token
        self._scan_chars = d.task_scan_chars
        self._tasks = _TaskMatcher(rules.task_rules, d.task_scan_chars)
        self._classes = tuple((c, compile_conditions(c.when)) for c in rules.classes)

    @property
    def scan_chars(self) -> int:
        """The characters of a text the task rules scan (its head and tail, ``window``)."""
        return self._scan_chars

    def features(
        self,
        api: ApiKind,
        body: Mapping[str, Any],
        task_header: str | None = None,
        texts: Callable[[], Texts] | None = None,
    ) -> RequestFeatures:
        """Read the routing features of a parsed request body. Raises ``InvalidParameter`` on bad types. ``texts``:
        the prompt's texts read elsewhere (a large body's, ``gateway.proxy.body_view``), asked for where the body's
        would be read, so a request with several faults gets the same error either way."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidParameter("'model' is required and must be a string", param="model")
        temperature = _in_range(body, "temperature", _number(body, "temperature", self._default_temperature), 0, 2)
        top_p = _in_range(body, "top_p", _number(body, "top_p", self._default_top_p), 0, 1)
        stream_raw = body.get("stream", False)
        if stream_raw is None:
            stream_raw = False
        if not isinstance(stream_raw, bool):
            raise InvalidParameter("'stream' must be a boolean", param="stream")
        read: Texts
        if api == "responses":
            given = texts() if texts is not None else None
            r = responses_inputs(body, None if given is None else (given.system, given.last_user, given.chars))
            max_tokens, n, tools, response_format, reasoning, read = (
                r.max_tokens,
                1,
                r.tools,
                r.response_format,
                r.reasoning,
                Texts(r.system, r.last_user, r.chars),
            )
        else:
            max_tokens = _number(body, "max_completion_tokens", math.nan)
            if math.isnan(max_tokens):
                max_tokens = _in_range(body, "max_tokens", _number(body, "max_tokens", math.inf), 1)
            else:
                _in_range(body, "max_completion_tokens", max_tokens, 1)
            n = _n_of(body)
            tools_raw = body.get("tools")
            tools = isinstance(tools_raw, list) and len(tools_raw) > 0
            response_format = format_type(body.get("response_format"), "response_format")
            reasoning = _reasoning_effort(body.get("reasoning_effort"), "reasoning_effort")
            read = texts() if texts is not None else request_texts(api, body)

        task_source: TaskSource
        if task_header and _TASK_HEADER_RE.fullmatch(task_header):
            task, task_source = task_header.lower(), "header"
        else:
            matched = self._tasks.match(response_format, tools, read)
            if matched is not None:
                task, task_source = matched, "rule"
            else:
                task, task_source = self._default_task, "default"

        return RequestFeatures(
            endpoint=api,
            model=model,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stream=stream_raw,
            n=n,
            tools=tools,
            response_format=response_format,
            prompt_tokens=int(read.chars / self._chars_per_token),
            task_type=task,
            task_source=task_source,
            reasoning=reasoning,
        )

    def traffic_class(self, features: RequestFeatures) -> TrafficClass:
        """The first class whose conditions all hold. The loader guarantees a catch-all at the end."""
        for cls, preds in self._classes:
            for p in preds:
                if not p(features):
                    break
            else:
                return cls
        return self._classes[-1][0]

    def classify(
        self,
        api: ApiKind,
        body: Mapping[str, Any],
        task_header: str | None = None,
        texts: Callable[[], Texts] | None = None,
    ) -> Classification:
        f = self.features(api, body, task_header, texts)
        return Classification(f, self.traffic_class(f))
