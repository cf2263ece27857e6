"""A large request body as the gateway reads it, built from the raw bytes in a parsing process (``parse_pool``).

Parsing 8 MiB of JSON into Python objects takes orjson about 100 ms, with the interpreter held: every other
request of the event loop would wait. So a large body is parsed in another process, and only what the gateway
reads of it comes back, never the body's objects:

- ``head``: the body's top-level members as they are, except the bulky ones (a member whose JSON is longer than
  ``HEAD_MEMBER_BYTES``: the messages, a long prompt, many tools); those are there as small stand-ins of the same
  shape (a list keeps its first element, an object its first members, nested containers emptied past two levels),
  enough for every check that reads a type, a length or a ``type`` field;
- ``bulk``: the JSON text of each bulky member, so the body can be written again (``serialize``) with members the
  gateway sets (its ``request_id``, a fallback ``model``, ``stream_options``) without building the rest;
- ``texts``: what the task rules and the token estimate read of the prompt (``gateway.routing.classify.Texts``,
  windowed as the task rules scan them), or the client error reading them raised;
- ``prompt``: the head of the rendered prompt that prefix affinity hashes (the hashes are taken by the gateway,
  whose ``hash()`` is salted per process);
- ``fingerprint``: the Idempotency-Key fingerprint of the whole body, when asked.

``summarize`` is pure and runs the same code the event loop runs for a small body (parse, container cap, depth
check, ``request_texts``, ``render_prompt``, ``fingerprint``), so both paths decide alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.errors import GatewayError, InvalidJSON, InvalidParameter
from gateway.fleet.prefix_index import CHUNK_CHARS, MAX_PROMPT_CHUNKS
from gateway.proxy.http import parse_object
from gateway.proxy.idempotency import fingerprint
from gateway.proxy.json_depth import check_json_containers, check_json_depth
from gateway.routing.classify import ApiKind, Texts, request_texts, window
from gateway.routing.prompt_key import render_prompt

HEAD_MEMBER_BYTES = 16 * 1024  # a top-level member whose JSON is longer is bulk: a stand-in in ``head``
_STAND_IN_MEMBERS = 64  # members an object's stand-in keeps
_STAND_IN_LEVELS = 2  # containers below this many levels are emptied in a stand-in
_SCALARS = (str, int, float, bool, type(None))
# Members the gateway reads inside a top-level member (``response_format.type``, ``text.format.type``,
# ``reasoning.effort``, ``stream_options``): a stand-in keeps them wherever they are.
_READ_INSIDE = frozenset({"type", "format", "effort", "include_usage", "continuous_usage_stats"})


@dataclass(frozen=True, slots=True)
class ViewRequest:
    """What ``summarize`` needs besides the bytes: the route's request shape and the limits in force."""

    api: ApiKind | None
    max_depth: int
    max_containers: int
    scan_chars: int  # the task rules' window (``Classifier.scan_chars``)
    fingerprint: tuple[str, str] | None = None  # (method, path) when the request has an Idempotency-Key
    prompt: bool = False  # render the prompt for prefix affinity


@dataclass(frozen=True, slots=True)
class Refusal:
    """A client error found in the parsing process, raised again in the gateway (``error``)."""

    kind: Literal["json", "parameter"]
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: GatewayError) -> Refusal:
        return cls("json" if isinstance(exc, InvalidJSON) else "parameter", exc.message, exc.param)

    def error(self) -> GatewayError:
        if self.kind == "json":
            return InvalidJSON(self.message, param=self.param)
        return InvalidParameter(self.message, param=self.param)


@dataclass(frozen=True, slots=True)
class BodyView:
    """What the gateway reads of one large body (the module docstring says what each part is)."""

    head: dict[str, Any]
    bulk: dict[str, bytes]
    texts: Texts | Refusal | None
    prompt: str = ""
    fingerprint: str | None = None

    def read_texts(self) -> Texts:
        """The prompt's texts, or the client error reading them raised (``Classifier.features``'s ``texts``)."""
        if isinstance(self.texts, Refusal):
            raise self.texts.error()
        if self.texts is None:
            raise InvalidParameter("this request has no prompt")
        return self.texts

    def serialize(self, body: Mapping[str, Any]) -> bytes:
        """``body`` (``head`` with members set, added or left out) as JSON text: a bulky member still holding its
        stand-in is written as the client sent it."""
        parts: list[bytes] = []
        for key, value in body.items():
            text = self.bulk.get(key)
            if text is None or value is not self.head.get(key):
                text = orjson.dumps(value)
            parts.append(orjson.dumps(key) + b":" + text)
        return b"{" + b",".join(parts) + b"}"


def stand_in(value: Any, level: int = 0) -> Any:
    """A small value of ``value``'s shape: scalars as they are; a list's first element; an object's first members
    and those the gateway reads; containers emptied below ``_STAND_IN_LEVELS``."""
    if isinstance(value, _SCALARS):
        return value
    if level >= _STAND_IN_LEVELS:
        return [] if isinstance(value, list) else {}
    if isinstance(value, list):
        return [stand_in(value[0], level + 1)] if value else []
    out: dict[str, Any] = {}
    for key, member in value.items():
        if len(out) < _STAND_IN_MEMBERS or key in _READ_INSIDE:
            out[key] = stand_in(member, level + 1)
    return out


def summarize(raw: bytes, req: ViewRequest) -> BodyView | Refusal:
    """The view of one body, or the client error it gets (what the event loop's path raises for it)."""
    try:
        check_json_containers(raw, req.max_containers)
        body = parse_object(raw)
        check_json_depth(raw, req.max_depth)
    except GatewayError as exc:
        return Refusal.of(exc)
    texts: Texts | Refusal | None = None
    prompt = ""
    if req.api is not None:
        try:
            t = request_texts(req.api, body)
            texts = Texts(window(t.system, req.scan_chars), window(t.last_user, req.scan_chars), t.chars)
        except GatewayError as exc:
            texts = Refusal.of(exc)
        if req.prompt and not isinstance(texts, Refusal):
            prompt = render_prompt(req.api, body)[: CHUNK_CHARS * MAX_PROMPT_CHUNKS]
    head: dict[str, Any] = {}
    bulk: dict[str, bytes] = {}
    for key, value in body.items():
        if isinstance(value, _SCALARS):
            head[key] = value
            continue
        text = orjson.dumps(value)
        if len(text) <= HEAD_MEMBER_BYTES:
            head[key] = value
        else:
            head[key], bulk[key] = stand_in(value), text
    fp = None if req.fingerprint is None else fingerprint(req.fingerprint[0], req.fingerprint[1], body)
    return BodyView(head, bulk, texts, prompt, fp)
