"""The routing features of a Responses API request (``POST /v1/responses``). Pure, no I/O.

The Responses API names things differently from chat completions; this module maps them onto the same features:

- ``max_output_tokens`` is the ``max_tokens`` feature (missing = unbounded);
- ``tools`` (a non-empty list, unless ``tool_choice`` is ``"none"``) is the ``tools`` feature;
- ``text.format.type`` (``text``, ``json_schema``, ``json_object``) is the ``response_format`` feature;
- ``reasoning.effort`` is the ``reasoning`` feature (``none`` when absent);
- ``instructions`` and the system/developer messages of ``input`` are the system text of the task rules, the
  last user message of ``input`` (or ``input`` itself when it is a string) their last user text.

It also reads what makes a request depend on state a pool holds: ``previous_response_id`` and ``store``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidParameter

# Response ids as vLLM makes them (``resp_<hex>``) and as clients may pass them on: bounded, and safe in a URL path
# and a store key.
RESPONSE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,255}")
_EFFORT_RE = re.compile(r"[a-z][a-z_]{0,31}")
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True, slots=True)
class ResponsesInputs:
    max_tokens: float
    tools: bool
    response_format: str
    reasoning: str
    system: str
    last_user: str
    chars: int
    previous_response_id: str | None
    store: bool  # the pool keeps the response (the API's default); False: nothing to be sticky to


def valid_response_id(value: object) -> bool:
    return isinstance(value, str) and RESPONSE_ID_RE.fullmatch(value) is not None


def reasoning_effort(value: object, param: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, str) and _EFFORT_RE.fullmatch(value):
        return value
    raise InvalidParameter(f"'{param}' must be a reasoning effort such as 'low', 'medium' or 'high'", param=param)


def format_type(value: object, param: str) -> str:
    """The ``type`` of a response format object (chat's ``response_format``, the Responses API's ``text.format``);
    ``text`` when it is missing."""
    if value is None:
        return "text"
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return str(value["type"])
    raise InvalidParameter(f"'{param}' must be an object with a 'type'", param=param)


def _object(body: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    """``body[key]``: an object, or None when missing."""
    v = body.get(key)
    if v is None or isinstance(v, dict):
        return v
    raise InvalidParameter(f"'{key}' must be an object", param=key)


def _max_output_tokens(body: Mapping[str, Any]) -> float:
    v = body.get("max_output_tokens")
    if v is None:
        return math.inf
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidParameter("'max_output_tokens' must be a positive integer", param="max_output_tokens")
    return float(v)


def _format(body: Mapping[str, Any]) -> str:
    text = _object(body, "text")
    return "text" if text is None else format_type(text.get("format"), "text.format")


def _tools(body: Mapping[str, Any]) -> bool:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidParameter("'tools' must be an array", param="tools")
    return bool(tools) and body.get("tool_choice") != "none"


def _reasoning(body: Mapping[str, Any]) -> str:
    r = _object(body, "reasoning")
    return "none" if r is None else reasoning_effort(r.get("effort"), "reasoning.effort")


def _content_text(content: Any) -> str:
    """A message's content: a string, or the text of its text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
        return "\n".join(t for t in texts if isinstance(t, str))
    return ""


def _item_text(item: Mapping[str, Any]) -> str:
    """The text of an input item that is not a message (a tool call's arguments or output): counted, not scanned."""
    for key in ("output", "arguments", "text"):
        v = item.get(key)
        if isinstance(v, str):
            return v
    return ""


def responses_texts(body: Mapping[str, Any]) -> tuple[str, str, int]:
    """The system text (``instructions`` and system/developer messages), the last user text and the characters of
    ``instructions`` and ``input``. Raises ``InvalidParameter`` when they have the wrong shape."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidParameter("'instructions' must be a string", param="instructions")
    system: list[str] = [instructions] if instructions else []
    chars = len(instructions or "")
    last_user = ""
    raw = body.get("input")
    if isinstance(raw, str):
        last_user, chars = raw, chars + len(raw)
    elif isinstance(raw, list):
        for item in raw:
            if not isinstance(item, dict):
                raise InvalidParameter("each input item must be an object", param="input")
            role = item.get("role")
            if role is None:  # a tool call, its output, a reasoning item, ...
                chars += len(_item_text(item))
                continue
            text = _content_text(item.get("content"))
            chars += len(text)
            if role in ("system", "developer"):
                system.append(text)
            elif role == "user":
                last_user = text
    else:
        raise InvalidParameter("'input' is required: a string or an array of input items", param="input")
    return "\n".join(system), last_user, chars


def responses_inputs(body: Mapping[str, Any], texts: tuple[str, str, int] | None = None) -> ResponsesInputs:
    """Read a Responses API body. Raises ``InvalidParameter`` (400 naming the field) on wrong types. ``texts``:
    what ``responses_texts`` gave for it, when read elsewhere."""
    system, last_user, chars = responses_texts(body) if texts is None else texts
    previous = body.get("previous_response_id")
    if previous is not None and not valid_response_id(previous):
        raise InvalidParameter(
            "'previous_response_id' must be a response id (letters, digits, '_', '.', ':', '-'; at most 256)",
            param="previous_response_id",
        )
    store = body.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise InvalidParameter("'store' must be a boolean", param="store")
    return ResponsesInputs(
        max_tokens=_max_output_tokens(body),
        tools=_tools(body),
        response_format=_format(body),
        reasoning=_reasoning(body),
        system=system,
        last_user=last_user,
        chars=chars,
        previous_response_id=previous,
        store=store,
    )
