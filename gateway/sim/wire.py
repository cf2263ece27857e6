"""vLLM 0.33's wire format, as pure functions: request parsing, response and chunk shapes, errors, SSE framing,
deterministic pseudo-text, the natural output length of a request, and the simulator's own task guess.

Shapes follow vLLM's pydantic models and how its server serialises them (checked against the 0.33.0 wheel):
whole responses are ``model_dump()`` (every field, ``null`` included), stream chunks ``model_dump_json(
exclude_unset=True)`` (only the fields vLLM sets), the final usage chunk (``choices: []``) drops ``null``s, and a
mid-stream error is ``json.dumps`` of the error envelope (with spaces). Under speculative decoding one chunk
carries every token one engine step emitted (1..K+1), as vLLM streams them; the last step's chunk carries the
``finish_reason``.

``guess_task`` is the simulator's own, deliberately simple guess. It must never use the gateway's classifier: a
benchmark whose simulator used the router's classifier would grade the router with its own answer key.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from types import MappingProxyType
from typing import Any, Literal

import orjson

VLLM_VERSION = "0.33.0"
SSE_DONE = b"data: [DONE]\n\n"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'  # vLLM's --api-key middleware answers this, not the envelope
ERROR_TYPES: Mapping[int, str] = MappingProxyType(
    {
        400: "BadRequestError",
        404: "NotFoundError",
        422: "UnprocessableEntityError",
        500: "InternalServerError",
        501: "NotImplementedError",
        503: "Service Unavailable",  # GracefulHTTPError: the status phrase (queue full)
    }
)
QUEUE_FULL_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)
QUEUED_TOKENS_MESSAGE = (
    "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
)
TASKS = ("chat", "code", "summarization", "rag", "extraction", "structured", "tool_use", "math", "creative")

Kind = Literal["chat", "completion"]


# --------------------------------------------------------------------------------------------------------------
# Errors and framing


class WireError(Exception):
    """A request vLLM would refuse: ``status`` and the JSON ``body`` to answer with."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(status, message, type_, param)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or HTTPStatus(status).phrase


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict[str, Any]:
    """vLLM's envelope: ``code`` is the integer HTTP status."""
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": status}}


def model_not_found(model: object, served: Sequence[str]) -> WireError:
    message = f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."
    return WireError(404, message, "NotFoundError", "model")


def queue_full(reason: str = "max_num_queued_reqs") -> WireError:
    """vLLM's QueueOverflowError (``--max-num-queued-reqs``) or MaxQueuedTokensError (``--max-num-queued-tokens``)."""
    return WireError(503, QUEUE_FULL_MESSAGE if reason == "max_num_queued_reqs" else QUEUED_TOKENS_MESSAGE)


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_error(body: dict[str, Any]) -> bytes:
    """A failure mid-stream: the envelope as an event (vLLM renders it with ``json.dumps``), then ``[DONE]``."""
    return b"data: " + json.dumps(body).encode() + b"\n\n" + SSE_DONE


# --------------------------------------------------------------------------------------------------------------
# Response shapes


def system_fingerprint(model: str, speculative_config: str | None) -> str:
    """vLLM's default ``full`` fingerprint: ``vllm-<version>-<8 hex of the config hash>``."""
    digest = hashlib.sha256(f"{model}\0{speculative_config or ''}".encode()).hexdigest()[:8]
    return f"vllm-{VLLM_VERSION}-{digest}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The ``usage`` of a whole response (every field)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def stream_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The ``usage`` of a stream chunk (final usage chunk, and ``continuous_usage_stats`` on completions)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def response_metrics(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The top-level ``metrics`` of a whole response (``PerRequestMetrics.model_dump()``); None without spec."""
    if spec is None:
        return None
    full = {
        **spec,
        "per_step_accepted": spec.get("per_step_accepted"),
        "per_step_drafted": spec.get("per_step_drafted"),
    }
    return {**dict.fromkeys(_TIMING_NULLS), "speculative_decoding": full}


_TIMING_NULLS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")
_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")
_CHAT_CHOICE_NULLS = ("stop_reason", "token_ids", "routed_experts", "weight_versions")
_TEXT_CHOICE_NULLS = (
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
    "weight_versions",
)


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str | None


def completion_body(
    kind: Kind,
    *,
    response_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceResult],
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str | None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole ``chat.completion`` / ``text_completion`` response."""
    rendered: list[dict[str, Any]] = []
    for c in choices:
        if kind == "chat":
            message = {"role": "assistant", "content": c.text, **dict.fromkeys(_MESSAGE_NULLS)}
            choice = {"index": c.index, "message": message, "logprobs": None, "finish_reason": c.finish_reason}
            rendered.append({**choice, **dict.fromkeys(_CHAT_CHOICE_NULLS)})
        else:
            choice = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            rendered.append({**choice, **dict.fromkeys(_TEXT_CHOICE_NULLS)})
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": rendered,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage(prompt_tokens, completion_tokens),
    }
    if kind == "chat":
        body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=response_metrics(spec))
    return body


@dataclass(frozen=True, slots=True)
class ChunkShapes:
    """The chunks of one stream (``chat.completion.chunk`` or ``text_completion``), as vLLM serialises them."""

    kind: Kind
    response_id: str
    created: int
    model: str
    prompt_tokens: int
    include_usage: bool
    continuous_usage: bool
    fingerprint: str | None

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _head(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": self.object, "created": self.created, "model": self.model}

    def _continuous(self, completion_tokens: int) -> dict[str, Any]:
        u = stream_usage(self.prompt_tokens, completion_tokens)
        if self.kind == "chat":
            u["completion_tokens_details"] = None
        return u

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """Chat only: the first chunk, sent once the prefill is done."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunk = {**self._head(), "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = self._continuous(0)
        chunk.update(prompt_token_ids=None, prompt_text=None)
        return chunk

    def token_chunk(
        self, text: str, *, index: int = 0, finish_reason: str | None = None, completion_tokens: int = 0
    ) -> dict[str, Any]:
        """The tokens of one engine step; the last step's chunk carries the finish reason."""
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.kind == "completion" or finish_reason is not None:
            choice["stop_reason"] = None
        if self.kind == "completion":
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        if self.kind == "completion" or finish_reason is not None:
            choice["weight_versions"] = None
        chunk = {**self._head(), "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = self._continuous(completion_tokens)
        if finish_reason is not None and not self.include_usage and self.fingerprint is not None:
            chunk["system_fingerprint"] = self.fingerprint
        chunk["kv_transfer_params"] = None
        return chunk

    def usage_chunk(self, completion_tokens: int, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: ``choices: []``, the usage, the spec metrics."""
        chunk = {**self._head(), "choices": [], "usage": stream_usage(self.prompt_tokens, completion_tokens)}
        if self.fingerprint is not None:
            chunk["system_fingerprint"] = self.fingerprint
        if spec is not None:
            chunk["metrics"] = {"speculative_decoding": spec}
        return chunk


def model_list(models: Sequence[str], *, created: int, max_model_len: int, root: str | None = None) -> dict[str, Any]:
    """``GET /v1/models``."""
    data = []
    for m in models:
        perm_id = "modelperm-" + hashlib.sha256(m.encode()).hexdigest()[:32]
        permission = {
            "id": perm_id,
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        data.append(
            {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root or m,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [permission],
            }
        )
    return {"object": "list", "data": data}


# --------------------------------------------------------------------------------------------------------------
# Pseudo-text: deterministic word pieces


_WORD_TEXT = (
    "the model of a system that can run on every request and its tokens in the batch while the draft "
    "proposes several tokens at once so the target verifies them in one step which is faster when the "
    "batch is small but slower when the server is saturated because each step then carries more work we "
    "measure latency throughput acceptance and the cost of every kernel under load with careful "
    "experiments across many settings where results depend on temperature and on the kind of task "
)
_WORDS = tuple(_WORD_TEXT.split())
_SPLIT: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "proposes": ("pro", "poses"),
        "verifies": ("ver", "ifies"),
        "saturated": ("satur", "ated"),
        "throughput": ("through", "put"),
        "acceptance": ("accept", "ance"),
        "experiments": ("experi", "ments"),
        "temperature": ("temper", "ature"),
        "settings": ("set", "tings"),
    }
)


def request_seed(model: str, body: dict[str, Any]) -> int:
    """A seed derived from what determines the answer: model, messages / prompt, tools, format, ``seed``."""
    key = [
        model,
        body.get("messages"),
        body.get("prompt"),
        body.get("tools"),
        body.get("response_format"),
        body.get("seed"),
    ]
    digest = hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS, default=str)).digest()
    return int.from_bytes(digest[:8], "big")


def pseudo_tokens(seed: int, n: int) -> list[str]:
    """``n`` tokens of deterministic pseudo-text (a token is one word piece, with its leading space)."""
    rng = random.Random(seed)
    out: list[str] = []
    capital = True
    since_period = 0
    while len(out) < n:
        if since_period > 6 and rng.random() < 0.15:
            out.append(".")
            capital, since_period = True, 0
            continue
        if since_period > 2 and rng.random() < 0.06:
            out.append(",")
            continue
        word = rng.choice(_WORDS)
        pieces = _SPLIT.get(word, (word,))
        first = pieces[0].capitalize() if capital else pieces[0]
        out.append(("" if not out else " ") + first)
        out.extend(pieces[1:])
        capital = False
        since_period += 1
    return out[:n]


# --------------------------------------------------------------------------------------------------------------
# Output length and request parsing


@dataclass(frozen=True, slots=True)
class OutputLengths:
    """The natural length of an answer (where the model would stop by itself): lognormal around ``median``."""

    median: float = 200.0
    sigma: float = 0.6
    minimum: int = 1
    maximum: int = 4096

    def natural(self, seed: int) -> int:
        rng = random.Random(seed ^ 0x5EED_1E46)
        x = self.median if self.sigma <= 0 else rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.minimum, min(self.maximum, round(x)))


def count_tokens(text: str) -> int:
    """A tokenizer stand-in: about four characters a token."""
    return (len(text) + 3) // 4


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    return "\n".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))


def _chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = [m for m in body["messages"] if isinstance(m, dict)]
    total = 3 + sum(4 + count_tokens(_content_text(m.get("content"))) for m in messages)
    if body.get("tools"):
        total += count_tokens(orjson.dumps(body["tools"]).decode())
    return total


def _completion_prompts(prompt: Any) -> list[tuple[Any, int]]:
    """(prompt, token count) per prompt: a string, a token id list, or a list of either."""
    if isinstance(prompt, str):
        return [(prompt, max(1, count_tokens(prompt)))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return [(prompt, len(prompt))]
        if all(isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompt):
            return [(p, max(1, count_tokens(p)) if isinstance(p, str) else len(p)) for p in prompt]
    raise WireError(400, "prompt must be a string, a list of token ids, or a list of either.", param="prompt")


@dataclass(frozen=True, slots=True)
class SeqPlan:
    """One output sequence: ``n`` per prompt; ``index`` is the choice index."""

    index: int
    seed: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" when the natural length ended it, "length" when a limit did


@dataclass(frozen=True, slots=True)
class SimRequest:
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    temperature: float
    max_tokens: int | None
    prompt_tokens: int  # usage.prompt_tokens (each prompt once)
    seqs: tuple[SeqPlan, ...]


def _opt_number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireError(400, f"{key} must be a number.", param=key)
    return float(value)


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WireError(400, f"{key} must be an integer >= {minimum}.", param=key)
    return value


def parse_request(
    kind: Kind, body: dict[str, Any], *, served: Sequence[str], max_model_len: int, lengths: OutputLengths
) -> SimRequest:
    """Validate a chat/completions body like vLLM and plan its output. Raises WireError."""
    model = body.get("model")
    if model is None or model == "":
        model = served[0]
    if not isinstance(model, str) or model not in served:
        raise model_not_found(model, served)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise WireError(400, "stream_options must be an object.", param="stream_options")
    if options is not None and not stream:
        raise WireError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    opts: dict[str, Any] = options or {}
    include_usage = bool(opts.get("include_usage"))
    temperature = _opt_number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise WireError(400, "temperature must be non-negative.", param="temperature")
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = _opt_int(body, "n", 1) or 1
    min_tokens = _opt_int(body, "min_tokens", 0) or 0
    if kind == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise WireError(400, "messages: Field required (a non-empty list).", param="messages")
        prompts: list[tuple[Any, int]] = [(body["messages"], _chat_prompt_tokens(body))]
    else:
        if body.get("prompt") is None:
            raise WireError(400, "prompt: Field required.", param="prompt")
        prompts = _completion_prompts(body["prompt"])
    base_seed = request_seed(model, body)
    seqs: list[SeqPlan] = []
    for p, (prompt, prompt_tokens) in enumerate(prompts):
        if prompt_tokens >= max_model_len:
            raise WireError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
                f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        prompt_seed = base_seed if len(prompts) == 1 else request_seed(model, {**body, "prompt": prompt})
        for i in range(n):
            seed = (prompt_seed + i * 0x9E3779B97F4A7C15) % (1 << 64)
            natural = max(lengths.natural(seed), min_tokens)
            limit = max_model_len - prompt_tokens
            if max_tokens is not None:
                limit = min(limit, max_tokens)
            if body.get("ignore_eos") is True:
                natural = limit
            out, reason = (natural, "stop") if natural < limit else (limit, "length")
            seqs.append(SeqPlan(p * n + i, seed, prompt_tokens, max(1, out), reason))
    return SimRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and bool(opts.get("continuous_usage_stats")),
        temperature=1.0 if temperature is None else temperature,
        max_tokens=max_tokens,
        prompt_tokens=sum(t for _, t in prompts),
        seqs=tuple(seqs),
    )


# --------------------------------------------------------------------------------------------------------------
# The simulator's own task guess (never the gateway's classifier)


_TASK_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (task, re.compile(pattern, re.IGNORECASE))
    for task, pattern in (
        ("summarization", r"\bsummar|\btl;?dr\b|\bcondense\b|\bkey points\b|\bin (?:one|two|three) sentences?\b"),
        ("rag", r"\bcontext:|\bbased on the (?:following|above|provided)|\baccording to the (?:document|passage)"),
        ("extraction", r"\bextract|\bpull out\b|\blist all\b|\bfind all\b|\bnamed entit"),
        ("code", r"```|\bdef \w+\(|\bfunction\b|\bpython\b|\bjavascript\b|\brefactor|\bcompile|\bbug\b|\bcode\b"),
        ("math", r"\bsolve\b|\bcalculate\b|\bequation\b|\bprove\b|\bintegral\b|\d+\s*[-+*/^]\s*\d+"),
        ("creative", r"\bstory\b|\bpoem\b|\bhaiku\b|\blyrics\b|\bfiction\b|\bimagine\b|\bcreative\b"),
    )
)


def guess_task(body: dict[str, Any]) -> str:
    """The simulator's guess of a request's task when no ``X-Sim-Task`` header gives the truth."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema"):
        return "structured"
    if body.get("structured_outputs") or body.get("guided_json"):
        return "structured"
    if body.get("tools"):
        return "tool_use"
    text = chat_text(body) if "messages" in body else _content_text(body.get("prompt"))
    for task, pattern in _TASK_PATTERNS:
        if pattern.search(text):
            return task
    return "chat"


TRANSPORT_KEY = "specgate.transport"


def remember_transport(scope: MutableMapping[str, Any], send: Any) -> None:
    """Keep uvicorn's transport in the scope, so that a fault can break the connection abruptly.

    uvicorn hands the app its RequestResponseCycle.send, a bound method whose owner holds the transport; closing it
    mid-body is what a crashed server looks like to a client (no chunked terminator, no [DONE])."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None and callable(getattr(transport, "close", None)):
        scope[TRANSPORT_KEY] = transport
