"""The response of one admitted generation or embedding request: ``FakeGeneration`` (an ASGI response that
sleeps, emits tokens, injects the requested failure, notices the client going away and books how it ended in
``FakeState``), its ``Job`` description, the JSON/error response helpers and the deterministic token,
embedding and prompt-token helpers.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.sim.wire import (
    SSE_DONE,
    TRANSPORT_KEY,
    sse_error,
    stream_usage,
    usage,
)
from gateway.sim.wire import error_body as _error_body
from gateway.sim.wire import sse_event as _sse
from gateway.testing.fake_upstream.behavior import BEHAVIOR_HEADER, Behavior, Kind, Outcome
from gateway.testing.fake_upstream.state import FakeState, spec_decode_metrics

EMBEDDING_DIM = 8


# --------------------------------------------------------------------------------------------------------------
# Responses


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None) -> Response:
    return json_response(_error_body(status, message, type_, param), status)


class _InjectedBreak(Exception):
    """Raised to make the ASGI server drop the connection when the transport cannot be reached directly."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Job:
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


class FakeGeneration(Response):
    """The ASGI response of one admitted request: delays, tokens, injected failures, and the bookkeeping of
    how it ended. A watcher on ``receive`` notices the client going away at once (uvicorn reports
    ``http.disconnect`` when the socket closes) and cancels the producer, whatever it was awaiting."""

    def __init__(self, state: FakeState, job: Job) -> None:
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


def count_prompt_tokens(kind: Kind, body: dict[str, Any]) -> int:
    if kind == "chat":
        messages = body.get("messages") or []
        return max(1, sum(4 + _words(m) for m in messages if isinstance(m, dict)))
    prompt = body.get("prompt" if kind == "completion" else "input")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return max(1, sum(len(p) for p in prompt))
    return max(1, _words(prompt))
