"""The Responses API of the simulator, as ``vllm serve`` 0.33 answers it: ``POST /v1/responses`` (whole or typed SSE
stream), ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, and the in-process response store.

vLLM keeps responses in the memory of the one server that made them, only when started with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``SimOptions.enable_responses_store``); without it ``store: true`` is ignored
silently, ``background: true`` is refused, and every ``previous_response_id`` or retrieve is a 404. The response id
is the body's ``request_id``, else ``resp_<uuid hex>``.

A stream is ``event: <type>`` / ``data: <json>`` pairs, no ``[DONE]``: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one ``response.output_text.delta`` per engine step,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ended it). vLLM 0.33 puts no per-request
spec-decode metrics in Responses answers (only chat and completions carry ``metrics.speculative_decoding``), so
neither does the simulator. A generation that fails mid-stream makes vLLM's stream generator raise and the connection
drop without a terminal event; the simulator drops it the same way.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import Send

from gateway.sim import wire
from gateway.sim.call import GenerationCall, engine_steps, send_json
from gateway.sim.engine import EngineDead, QueueFull

MAX_STORED = 10_000  # responses the store keeps (vLLM's grows without bound; the simulator's forgets the oldest)
_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass
class ResponseStore:
    """vLLM's in-process stores: the responses, the conversation of each, the background tasks."""

    enabled: bool
    responses: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> None:
        rid = response["id"]
        self.responses[rid] = response
        self.responses.move_to_end(rid)
        if messages is not None:
            self.messages[rid] = messages
        while len(self.responses) > MAX_STORED:
            old, _ = self.responses.popitem(last=False)
            self.messages.pop(old, None)


def not_found(response_id: str) -> wire.WireError:
    return wire.WireError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _PARTS]
        return " ".join(t for t in texts if isinstance(t, str))
    return ""


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages (what the chat template would see). Raises WireError."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise wire.WireError(400, "input: Field required (a string or a list of input items).", param="input")
    out: list[dict[str, Any]] = []
    for item in raw:
        if not isinstance(item, dict):
            raise wire.WireError(400, "input: each item must be an object.", param="input")
        role = item.get("role")
        if role is not None:
            out.append({"role": str(role), "content": _text(item.get("content"))})
        elif isinstance(item.get("output"), str):  # a tool's output
            out.append({"role": "tool", "content": item["output"]})
    return out


def output_text_of(response: dict[str, Any]) -> str:
    return " ".join(_text(item.get("content")) for item in response.get("output", []) if item.get("type") == "message")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated Responses request: its chat-shaped body (for ``wire.parse_request``) and its response id."""

    chat_body: dict[str, Any]
    messages: list[dict[str, Any]]  # the whole conversation sent to the model (previous turns first)
    response_id: str
    store: bool
    background: bool


def prepare(body: dict[str, Any], store: ResponseStore) -> Prepared:
    """Validate like vLLM's ``create_responses`` and build the conversation. Raises WireError."""
    background = body.get("background") is True
    stored = body.get("store", True) is not False and store.enabled
    if background and not stored:
        raise wire.WireError(
            400,
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
            "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
            "launching the vLLM server.",
            param="background",
        )
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        rid = f"resp_{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        prev = store.responses.get(str(previous))
        if prev is None:
            raise not_found(str(previous))
        messages += store.messages.get(prev["id"], [])
        messages.append({"role": "assistant", "content": output_text_of(prev)})
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions and previous is None:
        messages.insert(0, {"role": "system", "content": instructions})
    elif isinstance(instructions, str) and instructions:  # instructions of earlier turns do not carry over
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": instructions})
    messages += input_messages(body)
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "stream": body.get("stream") is True and not background,
    }
    for key in ("temperature", "top_p", "tools", "seed", "ignore_eos", "min_tokens", "priority"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        chat["response_format"] = {"type": fmt["type"]}
    return Prepared(chat, messages, rid, stored, background)


def response_object(
    body: dict[str, Any],
    req: wire.SimRequest,
    *,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse.from_request`` as JSON."""

    def get(key: str, default: Any = None) -> Any:
        v = body.get(key)
        return default if v is None else v

    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": req.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": get("parallel_tool_calls", True),
        "temperature": req.temperature,
        "tool_choice": get("tool_choice", "auto"),
        "tools": get("tools", []),
        "top_p": float(get("top_p", 1.0)),
        "background": get("background", False),
        "max_output_tokens": req.max_tokens if req.max_tokens is not None else req.seqs[0].output_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": body.get("prompt"),
        "prompt_cache_options": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "prompt_cache_retention": body.get("prompt_cache_retention"),
        "reasoning": body.get("reasoning"),
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": body.get("top_logprobs"),
        "truncation": get("truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty"),
        "frequency_penalty": body.get("frequency_penalty"),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A response's ``usage``; ``cached_tokens``: the input tokens the prefix cache supplied."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [input_tokens],
            "cached_tokens_per_turn": [cached_tokens],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [output_tokens],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": input_tokens + output_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}


def typed_event(payload: dict[str, Any]) -> bytes:
    """One event as vLLM frames the Responses stream: ``event: <type>`` then ``data: <json>``."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesCall(GenerationCall):
    """One admitted ``POST /v1/responses``: the engine steps of ``GenerationCall``, Responses shapes on the wire."""

    def __init__(self, *args: Any, body: dict[str, Any], prepared: Prepared, store: ResponseStore) -> None:
        super().__init__(*args)
        self._body, self._prep, self._store = body, prepared, store
        self._response_id = prepared.response_id
        self._seq = 0

    def _final(self, emitted: int, text: str, item_id: str) -> dict[str, Any]:
        seq = self._req.seqs[0]
        status = "incomplete" if emitted < seq.output_tokens or seq.finish_reason == "length" else "completed"
        output = [message_item(item_id, text, status)]
        cached = self._gens[0].cached_tokens if self._gens else 0
        response = self._object(status, output, response_usage(self._req.prompt_tokens, emitted, cached))
        if self._prep.store:
            previous = self._store.responses.get(response["id"])
            if previous is None or previous["status"] != "cancelled":
                self._store.put(response, self._prep.messages)
        return response

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(
            self._body,
            self._req,
            response_id=self._response_id,
            created_at=self._created,
            status=status,
            output=output,
            usage=usage,
        )

    async def _whole(self, send: Send) -> None:
        f = self._faults
        emitted = steps = 0
        if f.cut_after == 0:
            await self._cut_now()
        async for _, k in engine_steps(self._gens):
            emitted += k
            steps += 1
            if f.slow_chunk_s:
                await asyncio.sleep(f.slow_chunk_s)
            if f.cut_after is not None and steps >= f.cut_after:
                await self._cut_now()
            if f.error_after is not None and steps >= f.error_after:
                break
        failed = self._failure(steps)
        if failed is not None:
            self._settle("error")
            await send_json(send, failed.body, failed.status)
            return
        seq = self._req.seqs[0]
        emitted = min(emitted, seq.output_tokens)
        text = "".join(wire.pseudo_tokens(seq.seed, emitted))
        response = self._final(emitted, text, f"msg_{uuid.uuid4().hex}")
        self._settle("completed")
        await send_json(send, response)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return typed_event(payload)

    async def _stream(self, send: Send) -> None:
        f, seq = self._faults, self._req.seqs[0]
        headers = [(b"content-type", wire.SSE_CONTENT_TYPE.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        initial = self._object("in_progress", [], None)
        head = self._event("response.created", response=initial) + self._event("response.in_progress", response=initial)
        await send({"type": "http.response.body", "body": head, "more_body": True})
        if f.cut_after == 0:
            await self._cut_now()
        tokens = wire.pseudo_tokens(seq.seed, seq.output_tokens)
        item_id = f"msg_{uuid.uuid4().hex}"
        at: dict[str, Any] = {"output_index": 0, "item_id": item_id, "content_index": 0}
        emitted = chunks = 0
        async for _, k in engine_steps(self._gens):
            start, emitted = emitted, min(emitted + k, seq.output_tokens)
            parts: list[bytes] = []
            if start == 0:
                item = message_item(item_id, "", "in_progress")
                parts.append(self._event("response.output_item.added", output_index=0, item=item))
                parts.append(self._event("response.content_part.added", **at, part=_text_part("")))
            delta = "".join(tokens[start:emitted])
            parts.append(self._event("response.output_text.delta", **at, delta=delta, logprobs=[]))
            if f.slow_chunk_s:
                await asyncio.sleep(f.slow_chunk_s)
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
            chunks += 1
            if f.cut_after is not None and chunks >= f.cut_after:
                await self._cut_now()
            if f.error_after is not None and chunks >= f.error_after:
                break
        if self._failure(chunks) is not None:
            self._settle("error")
            await self._cut_now()  # vLLM's generator raises: the connection drops without a terminal event
        text = "".join(tokens[:emitted])
        tail = [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=_text_part(text)),
        ]
        final = self._final(emitted, text, item_id)
        tail.append(self._event("response.output_item.done", output_index=0, item=final["output"][0]))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        tail.append(self._event(kind, response=final))
        self._settle("completed")
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})


async def run_background(call: ResponsesCall, store: ResponseStore) -> None:
    """A ``background: true`` request: generate to the end off the client's connection, then store the result."""

    async def discard(message: Any) -> None:
        return None

    rid = call._response_id
    try:
        call._gens = call._state.submit(call._req, call._rid, call._task)
        await call._whole(discard)
    except (QueueFull, EngineDead, ValueError):
        response = store.responses.get(rid)
        if response is not None and response["status"] not in ("completed", "cancelled"):
            response["status"] = "failed"
    finally:
        for g in call._gens:
            if g.finished_reason is None:
                g.abort()
        store.tasks.pop(rid, None)


def queued(call: ResponsesCall) -> dict[str, Any]:
    return call._object("queued", [], None)
