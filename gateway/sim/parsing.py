"""Reading a request the way vLLM does: ``parse_request`` (validation, vLLM's error messages, sampling
parameters and one ``SeqPlan`` per output sequence), ``OutputLengths`` (the natural answer length), prompt
token counting, and ``guess_task``, the simulator's own deliberately simple task guess (never the gateway's
classifier).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.sim.framing import (
    Kind,
    WireError,
    model_not_found,
)
from gateway.sim.pseudotext import request_seed
from gateway.sim.request_queue import PRIORITY_MAX, PRIORITY_MIN
from gateway.sim.tokens import chat_prompt_ids, completion_prompt_ids, content_text, token_ids

__all__ = ["OutputLengths", "SeqPlan", "SimRequest", "chat_text", "count_tokens", "guess_task", "parse_request",
           "priority_header", "token_ids"]  # fmt: skip

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


def chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    return "\n".join(content_text(m.get("content")) for m in messages if isinstance(m, dict))


def _completion_prompts(prompt: Any) -> list[tuple[Any, list[int]]]:
    """(prompt, token ids) per prompt: a string, a token id list, or a list of either."""
    if isinstance(prompt, str):
        return [(prompt, completion_prompt_ids(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return [(prompt, completion_prompt_ids(prompt))]
        if all(isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompt):
            return [(p, completion_prompt_ids(p)) for p in prompt]
    raise WireError(400, "prompt must be a string, a list of token ids, or a list of either.", param="prompt")


@dataclass(frozen=True, slots=True)
class SeqPlan:
    """One output sequence: ``n`` per prompt; ``index`` is the choice index."""

    index: int
    seed: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" when the natural length ended it, "length" when a limit did
    prompt_ids: Sequence[int] = ()  # the rendered prompt's token ids (``prompt_tokens`` of them)


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
    priority: int = 0  # the body's `priority` (lower first under --scheduling-policy priority)


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


def _priority(value: Any) -> int:
    """The body's ``priority``: an integer in vLLM's signed 64-bit range (0 when absent or null)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        message = f"priority must be an integer between {PRIORITY_MIN} and {PRIORITY_MAX}."
        raise WireError(400, message, param="priority")
    return value


def priority_header(value: str | None) -> int | None:
    """vLLM's ``X-Vllm-Priority`` header, which overrides the body's ``priority`` when it reads as an integer
    (otherwise it is ignored, as vLLM ignores it; so is a value outside the 64-bit range here)."""
    if value is None or len(value) > 24:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if PRIORITY_MIN <= n <= PRIORITY_MAX else None


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
    priority = _priority(body.get("priority", 0))
    min_tokens = _opt_int(body, "min_tokens", 0) or 0
    if kind == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise WireError(400, "messages: Field required (a non-empty list).", param="messages")
        ids = chat_prompt_ids(body["messages"], body.get("tools"))
        prompts: list[tuple[Any, list[int]]] = [(body["messages"], ids)]
    else:
        if body.get("prompt") is None:
            raise WireError(400, "prompt: Field required.", param="prompt")
        prompts = _completion_prompts(body["prompt"])
    base_seed = request_seed(model, body)
    seqs: list[SeqPlan] = []
    for p, (prompt, ids) in enumerate(prompts):
        prompt_tokens = len(ids)
        if prompt_tokens >= max_model_len:
            raise WireError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
                f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:  # vLLM refuses, never clamps
            raise WireError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
                f"({max_tokens} > {max_model_len} - {prompt_tokens}).",
                param="max_tokens",
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
            seqs.append(SeqPlan(p * n + i, seed, prompt_tokens, max(1, out), reason, ids))
    return SimRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and bool(opts.get("continuous_usage_stats")),
        temperature=1.0 if temperature is None else temperature,
        max_tokens=max_tokens,
        prompt_tokens=sum(len(ids) for _, ids in prompts),
        seqs=tuple(seqs),
        priority=priority,
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
    text = chat_text(body) if "messages" in body else content_text(body.get("prompt"))
    for task, pattern in _TASK_PATTERNS:
        if pattern.search(text):
            return task
    return "chat"
