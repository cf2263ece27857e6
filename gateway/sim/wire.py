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

This module holds the response and chunk shapes and re-exports the rest: errors, SSE framing and constants from
``framing``, request parsing, output lengths and ``guess_task`` from ``parsing``, pseudo-text from ``pseudotext``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.sim.framing import (
    ERROR_TYPES,
    JSON_CONTENT_TYPE,
    QUEUE_FULL_MESSAGE,
    QUEUED_TOKENS_MESSAGE,
    SSE_CONTENT_TYPE,
    SSE_DONE,
    TASKS,
    TRANSPORT_KEY,
    UNAUTHORIZED_BODY,
    VLLM_VERSION,
    Kind,
    WireError,
    error_body,
    error_type,
    model_not_found,
    queue_full,
    remember_transport,
    sse_error,
    sse_event,
)
from gateway.sim.parsing import (
    OutputLengths,
    SeqPlan,
    SimRequest,
    chat_text,
    count_tokens,
    guess_task,
    parse_request,
    priority_header,
    token_ids,
)
from gateway.sim.pseudotext import pseudo_tokens, request_seed

__all__ = [
    "ERROR_TYPES",
    "JSON_CONTENT_TYPE",
    "QUEUED_TOKENS_MESSAGE",
    "QUEUE_FULL_MESSAGE",
    "SSE_CONTENT_TYPE",
    "SSE_DONE",
    "TASKS",
    "TRANSPORT_KEY",
    "UNAUTHORIZED_BODY",
    "VLLM_VERSION",
    "ChoiceResult",
    "ChunkShapes",
    "Kind",
    "OutputLengths",
    "SeqPlan",
    "SimRequest",
    "WireError",
    "chat_text",
    "completion_body",
    "count_tokens",
    "error_body",
    "error_type",
    "guess_task",
    "model_list",
    "model_not_found",
    "parse_request",
    "priority_header",
    "pseudo_tokens",
    "queue_full",
    "remember_transport",
    "request_seed",
    "response_metrics",
    "sse_error",
    "sse_event",
    "stream_usage",
    "system_fingerprint",
    "token_ids",
    "usage",
]


# --------------------------------------------------------------------------------------------------------------
# Response shapes


def system_fingerprint(model: str, speculative_config: str | None) -> str:
    """vLLM's default ``full`` fingerprint: ``vllm-<version>-<8 hex of the config hash>``."""
    digest = hashlib.sha256(f"{model}\0{speculative_config or ''}".encode()).hexdigest()[:8]
    return f"vllm-{VLLM_VERSION}-{digest}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """The ``usage`` of a whole response (every field). ``cached_tokens`` (given with
    ``--enable-prompt-tokens-details``): the prompt tokens the prefix cache supplied."""
    details = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


def stream_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """The ``usage`` of a stream chunk (final usage chunk, and ``continuous_usage_stats`` on completions); the final
    one carries ``prompt_tokens_details`` (nulls dropped) when ``cached_tokens`` is given."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


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
    cached_tokens: int | None = None,
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
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
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

    def usage_chunk(
        self, completion_tokens: int, spec: dict[str, Any] | None = None, cached_tokens: int | None = None
    ) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: ``choices: []``, the usage, the spec metrics."""
        u = stream_usage(self.prompt_tokens, completion_tokens, cached_tokens)
        chunk = {**self._head(), "choices": [], "usage": u}
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
