"""A small, deterministic fake of ``vllm serve`` (vLLM 0.33 wire format) with per-request failure injection.

It is not the simulator (no batching, no speculative-decoding physics): every request produces ``tokens``
tokens named ``tok1 ``, ``tok2 ``, … after ``first_token_delay_s``, one every ``token_delay_s``. What it is
for is the gateway's tests and the demo: it speaks vLLM's shapes (integer ``code`` in error envelopes,
``{"error": "Unauthorized"}`` for a bad key, ``data: {"error": …}`` mid-stream, the ``metrics`` field of
``--per-request-spec-decode-metrics``), its ``/metrics`` gauges follow the real number of requests in flight,
and a request header chooses how this one request fails.

``X-Fake-Behavior`` (comma-separated directives; ``PUT /_fake/behavior`` sets a default for requests without
the header)::

    status=503            answer at once with that status and a vLLM error envelope
    break_after=3         stream: after 3 token chunks the TCP connection is closed mid-body (no [DONE], no
                          terminating chunk); non-stream: the connection is closed without any response
    error_event_after=3   stream: after 3 token chunks ``data: {"error": {...}}`` then ``data: [DONE]``;
                          non-stream: a 500 envelope instead of the completion
    tokens=N              tokens to generate (still capped by max_tokens)
    token_delay=0.05      seconds between tokens
    first_token_delay=1.5 seconds before anything is sent (the response headers included)
    hang=1                never answer (until the client goes away)

Test hooks (never behind ``--api-key``, never recorded): ``GET/DELETE /_fake/requests`` (every other request
received, newest last: method, path, query, headers with lower-case names, parsed JSON body; ``?path=``
filters), ``GET /_fake/stats`` (below), and ``GET/PUT /_fake/behavior`` (``{"default": "status=503" | null,
"health_status": 200}``; ``health_status`` is what ``GET /health`` answers).

Stats count admitted generation/embedding requests, i.e. not those refused with 400/401/404 or an injected
``status=``: ``started``; ``completed`` (the whole response went out, ``error_event_after`` included);
``aborted`` (the client went away first: noticed within a loop tick of the socket closing, whatever the request
was waiting on); ``broken`` (``break_after``); ``in_flight``. A request is booked before its last bytes are
sent, so a client that has read its whole response already sees it counted. In ``/metrics`` a request is
"waiting" until its first token (``first_token_delay``, ``hang``) and "running" after.

The abrupt break closes uvicorn's transport directly (reached through the ASGI ``send`` it hands the app, a
bound method of its RequestResponseCycle): buffered chunks are flushed, then FIN in the middle of the chunked
body. aiohttp then raises ``ClientPayloadError`` (stream) / ``ServerDisconnectedError`` (no response yet);
httpx ``RemoteProtocolError`` ("incomplete chunked read" / "Server disconnected without sending a response").
Under another ASGI server (or httpx's ASGITransport) it raises instead, which makes a server drop the
connection once a response has started.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.sim.wire import (
    SSE_DONE,
    TRANSPORT_KEY,
    VLLM_VERSION,
    model_list,
    remember_transport,
    sse_error,
    stream_usage,
    usage,
)
from gateway.sim.wire import error_body as _error_body
from gateway.sim.wire import sse_event as _sse

__all__ = [
    "BEHAVIOR_HEADER",
    "Behavior",
    "FakeConfig",
    "FakeState",
    "FakeUpstreamServer",
    "create_fake_upstream",
    "fake_state",
    "main",
    "parse_behavior",
    "serve_fake_upstream",
    "spec_decode_metrics",
]

BEHAVIOR_HEADER = "x-fake-behavior"
MAX_MODEL_LEN = 8192
NUM_SPEC_TOKENS = 4  # K of the pretend speculative config, for the per-request ``metrics`` field
EMBEDDING_DIM = 8
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


Outcome = Literal["completed", "aborted", "broken", "error"]
Kind = Literal["chat", "completion", "embedding"]


@dataclass
class FakeConfig:
    models: list[str] = field(default_factory=lambda: ["meta-llama/Llama-3.3-70B-Instruct"])
    name: str = "fake"
    tokens: int = 16
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    embeddings: bool = False
    api_key: str | None = None
    spec_metrics: bool = False

    @property
    def fingerprint(self) -> str:
        return f"fake-{self.name}"


# --------------------------------------------------------------------------------------------------------------
# X-Fake-Behavior


@dataclass(frozen=True, slots=True)
class Behavior:
    status: int | None = None
    break_after: int | None = None
    error_event_after: int | None = None
    tokens: int | None = None
    token_delay: float | None = None
    first_token_delay: float | None = None
    hang: bool = False


def _non_negative_int(key: str, value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"{key} must be >= 0")
    return n


def _non_negative_float(key: str, value: str) -> float:
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{key} must be a finite number >= 0")
    return x


def parse_behavior(header: str | None) -> Behavior:
    """Parse ``X-Fake-Behavior``. Raises ValueError on an unknown directive or a bad value (a typo in a test
    should fail loudly, not silently do nothing)."""
    if header is None or not header.strip():
        return Behavior()
    fields: dict[str, Any] = {}
    for raw in header.split(","):
        part = raw.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        try:
            if key == "hang":
                fields["hang"] = not sep or value.lower() not in ("0", "false", "no", "")
            elif key == "status":
                code = int(value)
                if not 400 <= code <= 599:
                    raise ValueError("status must be 400..599")
                fields["status"] = code
            elif key in ("break_after", "error_event_after", "tokens"):
                fields[key] = _non_negative_int(key, value)
            elif key in ("token_delay", "first_token_delay"):
                fields[key] = _non_negative_float(key, value)
            else:
                raise ValueError("unknown directive")
        except ValueError as exc:
            raise ValueError(f"bad {BEHAVIOR_HEADER} directive {part!r}: {exc}") from None
    return Behavior(**fields)


# --------------------------------------------------------------------------------------------------------------
# State: everything mutable lives here, one instance per app


@dataclass
class _SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=lambda: [0] * NUM_SPEC_TOKENS)


class FakeState:
    """Requests seen, request counters and the Prometheus numbers of one fake upstream."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.requests: list[dict[str, Any]] = []
        self.started = 0
        self.completed = 0
        self.aborted = 0
        self.broken = 0
        self.default_behavior: str | None = None
        self.health_status = 200
        self.waiting: dict[str, int] = dict.fromkeys(config.models, 0)
        self.running: dict[str, int] = dict.fromkeys(config.models, 0)
        self.finished: dict[tuple[str, str], int] = {(m, r): 0 for m in config.models for r in FINISHED_REASONS}
        self.prompt_tokens: dict[str, int] = dict.fromkeys(config.models, 0)
        self.generation_tokens: dict[str, int] = dict.fromkeys(config.models, 0)
        self.spec: dict[str, _SpecCounters] = {m: _SpecCounters() for m in config.models}

    @property
    def in_flight(self) -> int:
        return sum(self.waiting.values()) + sum(self.running.values())

    def stats(self) -> dict[str, int]:
        return {
            "started": self.started,
            "completed": self.completed,
            "aborted": self.aborted,
            "broken": self.broken,
            "in_flight": self.in_flight,
        }

    def record(self, method: str, path: str, query: str, headers: dict[str, str], body: Any) -> None:
        self.requests.append(
            {"method": method, "path": path, "query": query, "headers": headers, "body": body, "time": time.time()}
        )

    def begin(self, model: str) -> None:
        self.started += 1
        self.waiting[model] = self.waiting.get(model, 0) + 1

    def to_running(self, model: str) -> None:
        self.waiting[model] -= 1
        self.running[model] = self.running.get(model, 0) + 1

    def end(
        self,
        model: str,
        *,
        was_running: bool,
        outcome: Outcome,
        finish_reason: str,
        prompt_tokens: int,
        generated: int,
    ) -> None:
        gauge = self.running if was_running else self.waiting
        gauge[model] -= 1
        if outcome in ("completed", "error"):
            self.completed += 1
        elif outcome == "broken":
            self.broken += 1
        else:
            self.aborted += 1
        reason = {"completed": finish_reason, "error": "error"}.get(outcome, "abort")
        self.finished[(model, reason)] = self.finished.get((model, reason), 0) + 1
        self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + prompt_tokens
        self.generation_tokens[model] = self.generation_tokens.get(model, 0) + generated
        if self.config.spec_metrics and generated > 0:
            s = spec_decode_metrics(generated)
            counters = self.spec.setdefault(model, _SpecCounters())
            counters.drafts += s["num_spec_steps"]
            counters.draft_tokens += s["num_draft_tokens"]
            counters.accepted += s["num_accepted_draft_tokens"]
            hist: list[int] = s["acceptance_histogram"]
            for pos in range(NUM_SPEC_TOKENS):
                counters.per_pos[pos] += sum(hist[pos + 1 :])

    def prometheus(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for sample, labels, value in samples:
                rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                lines.append(f"{sample}{{{rendered}}} {float(value)}")

        models = list(dict.fromkeys([*self.config.models, *self.waiting, *self.running]))

        def per_model(name: str, values: dict[str, int]) -> list[tuple[str, dict[str, str], float]]:
            return [(name, {"model_name": m, "engine": "0"}, values.get(m, 0)) for m in models]

        family(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            per_model("vllm:num_requests_running", self.running),
        )
        family(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            per_model("vllm:num_requests_waiting", self.waiting),
        )
        family(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [("vllm:kv_cache_usage_perc", {"model_name": m, "engine": "0"}, 0.0) for m in models],
        )
        family(
            "vllm:request_success",
            "counter",
            "Count of successfully processed requests.",
            [
                (
                    "vllm:request_success_total",
                    {"model_name": m, "engine": "0", "finished_reason": r},
                    self.finished.get((m, r), 0),
                )
                for m in models
                for r in FINISHED_REASONS
            ],
        )
        family(
            "vllm:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            per_model("vllm:prompt_tokens_total", self.prompt_tokens),
        )
        family(
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            per_model("vllm:generation_tokens_total", self.generation_tokens),
        )
        if self.config.spec_metrics:
            spec = {m: self.spec.get(m, _SpecCounters()) for m in models}
            family(
                "vllm:spec_decode_num_drafts",
                "counter",
                "Number of spec decoding drafts.",
                per_model("vllm:spec_decode_num_drafts_total", {m: c.drafts for m, c in spec.items()}),
            )
            family(
                "vllm:spec_decode_num_draft_tokens",
                "counter",
                "Number of draft tokens.",
                per_model("vllm:spec_decode_num_draft_tokens_total", {m: c.draft_tokens for m, c in spec.items()}),
            )
            family(
                "vllm:spec_decode_num_accepted_tokens",
                "counter",
                "Number of accepted tokens.",
                per_model("vllm:spec_decode_num_accepted_tokens_total", {m: c.accepted for m, c in spec.items()}),
            )
            family(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "Accepted tokens per draft position.",
                [
                    (
                        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        {"model_name": m, "engine": "0", "position": str(pos)},
                        c.per_pos[pos],
                    )
                    for m, c in spec.items()
                    for pos in range(NUM_SPEC_TOKENS)
                ],
            )
        return "\n".join(lines) + "\n"


def spec_decode_metrics(completion_tokens: int) -> dict[str, Any]:
    """The deterministic per-request ``metrics.speculative_decoding`` of the fake: K=4, the first token from
    the prefill, then decode steps that accept 2 drafts each (3 tokens a step with the bonus token) and a
    shorter last step. ``acceptance_histogram[i]`` = number of steps that accepted i drafts."""
    decode_tokens = max(0, completion_tokens - 1)
    steps = math.ceil(decode_tokens / 3)
    hist = [0] * (NUM_SPEC_TOKENS + 1)
    if steps:
        hist[2] += steps - 1
        hist[decode_tokens - 3 * (steps - 1) - 1] += 1
    accepted = decode_tokens - steps
    draft_tokens = steps * NUM_SPEC_TOKENS
    return {
        "mean_acceptance_length": (1 + accepted / steps) if steps else None,
        "draft_acceptance_rate": (accepted / draft_tokens) if draft_tokens else None,
        "acceptance_histogram": hist,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": draft_tokens,
        "num_spec_tokens": NUM_SPEC_TOKENS,
    }


# --------------------------------------------------------------------------------------------------------------
# Responses


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def _error(status: int, message: str, type_: str | None = None, param: str | None = None) -> Response:
    return _json(_error_body(status, message, type_, param), status)


class _InjectedBreak(Exception):
    """Raised to make the ASGI server drop the connection when the transport cannot be reached directly."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class _Job:
    kind: Kind
    model: str
    stream: bool
    tokens: int
    finish_reason: str
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: int
    behavior: Behavior
    first_token_delay: float
    token_delay: float
    inputs: list[str] = field(default_factory=list)  # embeddings


class _Generation(Response):
    """The ASGI response of one admitted request: delays, tokens, injected failures, and the bookkeeping of
    how it ended. A watcher on ``receive`` notices the client going away at once (uvicorn reports
    ``http.disconnect`` when the socket closes) and cancels the producer, whatever it was awaiting."""

    def __init__(self, state: FakeState, job: _Job) -> None:
        super().__init__()
        self._state = state
        self._job = job
        self._outcome: Outcome | None = None
        self._broke = False
        self._running = False
        self._generated = 0
        self._transport: Any = None
        kind_prefix = {"chat": "chatcmpl", "completion": "cmpl", "embedding": "embd"}[job.kind]
        self._id = f"{kind_prefix}-{uuid.uuid4().hex}"
        self._created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job, state = self._job, self._state
        self._transport = scope.get(TRANSPORT_KEY)
        state.begin(job.model)
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        worker = asyncio.create_task(self._work(send))
        try:
            done, _ = await asyncio.wait({watcher, worker}, return_when=asyncio.FIRST_COMPLETED)
            if worker not in done:
                # The connection is gone: the client went away, or we broke it on purpose.
                worker.cancel()
                await asyncio.wait({worker})
                self._settle("broken" if self._broke else "aborted")
                return
            await worker
        except _InjectedBreak:
            self._settle("broken")
            raise
        except Exception:
            self._settle("error")
            raise
        finally:
            watcher.cancel()
            worker.cancel()
            self._settle("broken" if self._broke else "aborted")  # no-op when already settled

    def _settle(self, outcome: Outcome) -> None:
        """Book how the request ended, once. Called before the last bytes go out (or before the connection is
        dropped), so a client that has seen the end of its response also sees it in ``/_fake/stats``."""
        if self._outcome is not None:
            return
        self._outcome = outcome
        job = self._job
        self._state.end(
            job.model,
            was_running=self._running,
            outcome=outcome,
            finish_reason=job.finish_reason,
            prompt_tokens=job.prompt_tokens,
            generated=self._generated,
        )

    # -- the producer ------------------------------------------------------------------------------------------

    async def _work(self, send: Send) -> None:
        job = self._job
        if job.first_token_delay:
            await asyncio.sleep(job.first_token_delay)
        if job.behavior.hang:
            await asyncio.Event().wait()  # until the client goes away
        self._state.to_running(job.model)
        self._running = True
        if job.stream:
            await self._stream(send)
        else:
            await self._whole(send)

    async def _break(self) -> None:
        """Drop the TCP connection. uvicorn's transport is closed directly (buffered bytes are flushed, then a
        FIN with the chunked body unfinished); the disconnect watcher then cancels this producer."""
        self._broke = True
        self._settle("broken")
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.close()
            await asyncio.sleep(5.0)  # cancelled long before this by the watcher
        # Another ASGI server: an exception after the response started makes it drop the connection.
        raise _InjectedBreak(f"{BEHAVIOR_HEADER}: connection broken on purpose")

    async def _whole(self, send: Send) -> None:
        job, b = self._job, self._job.behavior
        stop_at = job.tokens
        for limit in (b.break_after, b.error_event_after):
            if limit is not None:
                stop_at = min(stop_at, limit)
        if job.token_delay and stop_at > 1:
            await asyncio.sleep(job.token_delay * (stop_at - 1))
        self._generated = stop_at
        if b.break_after is not None:
            await self._break()
        if b.error_event_after is not None:
            self._settle("error")
            body = _error_body(500, "Injected failure during generation (X-Fake-Behavior).")
            await self._send_whole(send, 500, orjson.dumps(body), "application/json")
            return
        self._settle("completed")
        await self._send_whole(send, 200, orjson.dumps(self._final_body()), "application/json")

    async def _send_whole(self, send: Send, status: int, body: bytes, media_type: str) -> None:
        headers = [(b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, send: Send) -> None:
        job, b = self._job, self._job.behavior
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if job.kind == "chat":
            await emit(_sse(self._chunk("", None, role=True)))
        for i in range(1, job.tokens + 1):
            if b.break_after == i - 1:
                await self._break()
            if b.error_event_after == i - 1:
                await self._stream_error(send)
                return
            if i > 1 and job.token_delay:
                await asyncio.sleep(job.token_delay)
            self._generated = i
            await emit(_sse(self._chunk(_token(i), None)))
        if b.break_after is not None and b.break_after >= job.tokens:
            await self._break()
        if b.error_event_after is not None and b.error_event_after >= job.tokens:
            await self._stream_error(send)
            return
        finish = self._chunk(None, job.finish_reason)
        await emit(_sse(finish))
        if job.include_usage:
            usage_chunk: dict[str, Any] = {
                "id": self._id,
                "object": self._chunk_object(),
                "created": self._created,
                "model": job.model,
                "system_fingerprint": self._state.config.fingerprint,
                "choices": [],
                "usage": self._usage(),
            }
            if self._state.config.spec_metrics:
                usage_chunk["metrics"] = {"speculative_decoding": spec_decode_metrics(job.tokens)}
            await emit(_sse(usage_chunk))
        self._settle("completed")
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})

    async def _stream_error(self, send: Send) -> None:
        self._settle("error")
        error = _error_body(500, "Injected failure during generation (X-Fake-Behavior).")
        await send({"type": "http.response.body", "body": sse_error(error), "more_body": False})

    # -- shapes -----------------------------------------------------------------------------------------------

    def _usage(self) -> dict[str, Any]:
        return stream_usage(self._job.prompt_tokens, self._generated)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self._job.kind == "chat" else "text_completion"

    def _chunk(self, content: str | None, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        """One stream chunk: ``delta`` for chat (``{}`` on the finish chunk), ``text`` for completions."""
        choice: dict[str, Any] = {"index": 0}
        if self._job.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if content is not None:
                delta["content"] = content
            choice["delta"] = delta
        else:
            choice["text"] = content or ""
        choice.update({"logprobs": None, "finish_reason": finish_reason, "stop_reason": None})
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": self._chunk_object(),
            "created": self._created,
            "model": self._job.model,
            "system_fingerprint": self._state.config.fingerprint,
            "choices": [choice],
        }
        if self._job.continuous_usage:
            chunk["usage"] = self._usage()
        return chunk

    def _final_body(self) -> dict[str, Any]:
        job = self._job
        config = self._state.config
        if job.kind == "embedding":
            return {
                "id": self._id,
                "object": "list",
                "created": self._created,
                "model": job.model,
                "data": [
                    {"index": i, "object": "embedding", "embedding": _embedding(text)}
                    for i, text in enumerate(job.inputs)
                ],
                "usage": usage(job.prompt_tokens, 0),
            }
        text = "".join(_token(i) for i in range(1, job.tokens + 1))
        common = {"logprobs": None, "finish_reason": job.finish_reason, "stop_reason": None}
        if job.kind == "chat":
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "tool_calls": [],
                "reasoning": None,
            }
            choice: dict[str, Any] = {"index": 0, "message": message, **common}
        else:
            choice = {"index": 0, "text": text, **common, "prompt_logprobs": None}
        body: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": self._created,
            "model": job.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": config.fingerprint,
            "usage": usage(job.prompt_tokens, self._generated),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        if config.spec_metrics:
            body["metrics"] = {"speculative_decoding": spec_decode_metrics(job.tokens)}
        return body


def _token(i: int) -> str:
    return f"tok{i} "


def _embedding(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(digest[i] - 127.5) / 127.5 for i in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def _words(value: Any) -> int:
    """A deterministic stand-in for a tokenizer: whitespace words in every string found."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(v) for v in value)
    if isinstance(value, dict):
        return sum(_words(v) for k, v in value.items() if k in ("content", "text"))
    return 0


def _prompt_tokens(kind: Kind, body: dict[str, Any]) -> int:
    if kind == "chat":
        messages = body.get("messages") or []
        return max(1, sum(4 + _words(m) for m in messages if isinstance(m, dict)))
    prompt = body.get("prompt" if kind == "completion" else "input")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return max(1, sum(len(p) for p in prompt))
    return max(1, _words(prompt))


# --------------------------------------------------------------------------------------------------------------
# The app


class _FakeApp(Starlette):
    """Starlette, plus what has to happen outermost: reach uvicorn's transport (for the abrupt break), record
    every request with its body, and check ``--api-key`` like vLLM's middleware (``/v1`` paths only)."""

    fake: FakeState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        remember_transport(scope, send)

        chunks: list[bytes] = []
        gone = False
        while True:
            message = await receive()
            if message["type"] != "http.request":
                gone = True
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not path.startswith("/_fake/"):
            parsed: Any = None
            if body:
                try:
                    parsed = orjson.loads(body)
                except orjson.JSONDecodeError:
                    parsed = None
            query = scope.get("query_string", b"").decode("latin-1")
            self.fake.record(scope["method"], path, query, headers, parsed)
        if gone:
            return

        key = self.fake.config.api_key
        protected = key is not None and path.startswith("/v1") and scope["method"] != "OPTIONS"
        if protected and headers.get("authorization") != f"Bearer {key}":
            await _json({"error": "Unauthorized"}, 401)(scope, receive, send)
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await super().__call__(scope, replay, send)


def fake_state(app: Starlette) -> FakeState:
    """The in-memory state of an app made by ``create_fake_upstream`` (same object as ``app.state.fake``)."""
    state = app.state.fake
    assert isinstance(state, FakeState)
    return state


def create_fake_upstream(config: FakeConfig) -> Starlette:
    state = FakeState(config)

    def behavior_of(request: Request) -> Behavior:
        header = request.headers.get(BEHAVIOR_HEADER)
        return parse_behavior(header if header is not None else state.default_behavior)

    async def parse_json(request: Request) -> dict[str, Any] | Response:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"Invalid JSON body: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.", "BadRequestError")
        return body

    def resolve_model(body: dict[str, Any]) -> str | Response:
        model = body.get("model")
        if model is None:
            return config.models[0]
        if not isinstance(model, str) or model not in config.models:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model

    async def admit(request: Request, kind: Kind) -> Response:
        parsed = await parse_json(request)
        if isinstance(parsed, Response):
            return parsed
        body = parsed
        try:
            behavior = behavior_of(request)
        except ValueError as exc:
            return _error(400, str(exc), "BadRequestError")
        if behavior.status is not None:
            return _error(behavior.status, f"Injected {behavior.status} (X-Fake-Behavior).")
        model = resolve_model(body)
        if isinstance(model, Response):
            return model
        stream = body.get("stream") is True
        stream_options = body.get("stream_options")
        if stream_options is not None and not stream:
            return _error(
                400, "Stream options can only be defined when `stream=True`.", "BadRequestError", "stream_options"
            )
        if stream_options is not None and not isinstance(stream_options, dict):
            return _error(400, "stream_options must be an object.", "BadRequestError", "stream_options")
        options: dict[str, Any] = stream_options or {}
        inputs: list[str] = []
        if kind == "chat" and not isinstance(body.get("messages"), list):
            return _error(400, "Field required: messages", "BadRequestError", "messages")
        if kind == "completion" and body.get("prompt") is None:
            return _error(400, "Field required: prompt", "BadRequestError", "prompt")
        if kind == "embedding":
            raw_input = body.get("input")
            if raw_input is None:
                return _error(400, "Field required: input", "BadRequestError", "input")
            items = raw_input if isinstance(raw_input, list) and not _is_token_list(raw_input) else [raw_input]
            inputs = [i if isinstance(i, str) else orjson.dumps(i).decode() for i in items]
            stream = False
        max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return _error(400, "max_tokens must be at least 1.", "BadRequestError", "max_tokens")
        natural = behavior.tokens if behavior.tokens is not None else config.tokens
        tokens = natural if max_tokens is None else min(natural, max_tokens)
        job = _Job(
            kind=kind,
            model=model,
            stream=stream,
            tokens=0 if kind == "embedding" else tokens,
            finish_reason="length" if max_tokens is not None and max_tokens < natural else "stop",
            include_usage=bool(options.get("include_usage")),
            continuous_usage=bool(options.get("include_usage")) and bool(options.get("continuous_usage_stats")),
            prompt_tokens=_prompt_tokens(kind, body),
            behavior=behavior,
            first_token_delay=(
                behavior.first_token_delay if behavior.first_token_delay is not None else config.first_token_delay_s
            ),
            token_delay=behavior.token_delay if behavior.token_delay is not None else config.token_delay_s,
            inputs=inputs,
        )
        return _Generation(state, job)

    async def chat_completions(request: Request) -> Response:
        return await admit(request, "chat")

    async def completions(request: Request) -> Response:
        return await admit(request, "completion")

    async def embeddings(request: Request) -> Response:
        if not config.embeddings:
            return _error(404, "The model does not support Embeddings API", "NotFoundError")
        return await admit(request, "embedding")

    async def models(request: Request) -> Response:
        return _json(model_list(config.models, created=state.created, max_model_len=MAX_MODEL_LEN))

    async def health(request: Request) -> Response:
        return Response(b"", status_code=state.health_status)

    async def version(request: Request) -> Response:
        return _json({"version": VLLM_VERSION})

    async def metrics(request: Request) -> Response:
        return Response(state.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def fake_requests(request: Request) -> Response:
        if request.method == "DELETE":
            state.requests.clear()
            return Response(b"", status_code=204)
        path = request.query_params.get("path")
        return _json([r for r in state.requests if path is None or r["path"] == path])

    async def fake_stats(request: Request) -> Response:
        return _json(state.stats())

    async def fake_behavior(request: Request) -> Response:
        if request.method == "PUT":
            parsed = await parse_json(request)
            if isinstance(parsed, Response):
                return parsed
            if "default" in parsed:
                default = parsed["default"]
                try:
                    parse_behavior(default)
                except (ValueError, AttributeError) as exc:
                    return _error(400, str(exc), "BadRequestError", "default")
                state.default_behavior = default
            if "health_status" in parsed:
                status = parsed["health_status"]
                if not isinstance(status, int) or not 100 <= status <= 599:
                    return _error(400, "health_status must be an HTTP status.", "BadRequestError", "health_status")
                state.health_status = status
        return _json({"default": state.default_behavior, "health_status": state.health_status})

    async def not_found(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            return _json({"detail": "Method Not Allowed"}, 405)
        return _json({"detail": "Not Found"}, 404)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/_fake/requests", fake_requests, methods=["GET", "DELETE"]),
        Route("/_fake/stats", fake_stats, methods=["GET"]),
        Route("/_fake/behavior", fake_behavior, methods=["GET", "PUT"]),
    ]
    app = _FakeApp(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.fake = state
    app.state.fake = state
    return app


def _is_token_list(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(t, int) for t in value)


# --------------------------------------------------------------------------------------------------------------
# Running it


def serve_fake_upstream(config: FakeConfig, host: str, port: int) -> None:
    """Serve a fake upstream with uvicorn until interrupted (blocking)."""
    uvicorn.run(
        create_fake_upstream(config),
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,  # hung requests must not hold up Ctrl-C
    )


class FakeUpstreamServer:
    """A fake upstream on a real socket, served by uvicorn in a background thread (for tests)::

    with FakeUpstreamServer(FakeConfig(name="spec")) as fake:
        ... fake.url ...        # "http://127.0.0.1:<port>"
        fake.state.stats()
    """

    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config if config is not None else FakeConfig()
        self.app = create_fake_upstream(self.config)
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        uv_config = uvicorn.Config(self.app, log_level="warning", log_config=None, lifespan="off", access_log=False)
        self._server = uvicorn.Server(uv_config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> FakeState:
        return fake_state(self.app)

    def start(self, timeout_s: float = 10.0) -> FakeUpstreamServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"fake-upstream-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake upstream on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop at once: requests still in flight (hung ones included) are cancelled, not waited for."""
        self._server.should_exit = True
        self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> FakeUpstreamServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A small deterministic fake of `vllm serve` for tests and demos.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="fake", help="system_fingerprint becomes fake-<name>")
    parser.add_argument("--model", action="append", dest="models", help="served model name (repeatable)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds before the first byte")
    parser.add_argument("--embeddings", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--spec-metrics", action="store_true", help="per-request speculative decoding metrics")
    args = parser.parse_args(argv)
    config = FakeConfig(
        name=args.name,
        tokens=args.tokens,
        token_delay_s=args.token_delay,
        first_token_delay_s=args.first_token_delay,
        embeddings=args.embeddings,
        api_key=args.api_key,
        spec_metrics=args.spec_metrics,
    )
    if args.models:
        config.models = list(args.models)
    serve_fake_upstream(config, args.host, args.port)


if __name__ == "__main__":
    main()
