"""The response of one generation request: ``GenerationCall`` (an ASGI response that submits the request's
sequences to the engine, streams one chunk per engine step or answers once generation ends, applies the
injected faults, and notices the client going away), with its small JSON, error and disconnect helpers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.sim import wire
from gateway.sim.engine import EngineDead, Generation, QueueFull
from gateway.sim.faults import RequestFaults
from gateway.sim.state import Outcome, SimState

# --------------------------------------------------------------------------------------------------------------
# One generation request


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=wire.JSON_CONTENT_TYPE)


def error_response(exc: wire.WireError) -> Response:
    return json_response(exc.body, exc.status)


async def send_json(send: Send, body: Any, status: int = 200) -> None:
    raw = orjson.dumps(body)
    headers = [(b"content-type", wire.JSON_CONTENT_TYPE.encode()), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Cut(Exception):
    """Raised to make the ASGI server drop the connection when uvicorn's transport is out of reach."""


async def engine_steps(gens: list[Generation]) -> AsyncIterator[tuple[int, int]]:
    """(sequence, tokens emitted by one engine step) from every generation, as the steps happen."""
    if len(gens) == 1:
        async for k in gens[0]:
            yield 0, k
        return
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for k in gen:
                queue.put_nowait((i, k))
        finally:
            queue.put_nowait((i, -1))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, k = await queue.get()
            if k < 0:
                left -= 1
            else:
                yield i, k
    finally:
        for t in tasks:
            t.cancel()


class GenerationCall(Response):
    """The ASGI response of one admitted generation request: faults, engine steps, chunks, bookkeeping."""

    def __init__(
        self, state: SimState, req: wire.SimRequest, request_id: str, task: str, faults: RequestFaults
    ) -> None:
        super().__init__()
        self._state, self._req, self._rid, self._task, self._faults = state, req, request_id, task, faults
        self._gens: list[Generation] = []
        self._outcome: Outcome | None = None
        self._cut = False
        self._transport: Any = None
        self._response_id = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{request_id}"
        self._created = int(time.time())
        self.trace_headers: dict[str, str] | None = None  # set when the server exports traces (sim.tracing)
        self.top_p: float | None = None
        self._arrival_ns = time.time_ns()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._transport = scope.get(wire.TRANSPORT_KEY)
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        worker = asyncio.create_task(self._work(send))
        try:
            done, _ = await asyncio.wait({watcher, worker}, return_when=asyncio.FIRST_COMPLETED)
            if worker not in done:  # the connection is gone: the client left, or we cut it
                worker.cancel()
                await asyncio.wait({worker})
                return
            await worker
        except _Cut:
            raise
        except Exception:
            self._settle("error")
            raise
        finally:
            watcher.cancel()
            worker.cancel()
            for g in self._gens:
                if g.finished_reason is None:
                    g.abort()
            self._settle("cut" if self._cut else "aborted")
            tracer = self._state.tracer
            if tracer is not None and self.trace_headers is not None:
                tracer.request_span(
                    self.trace_headers,
                    request_id=self._rid,
                    req=self._req,
                    gens=self._gens,
                    arrival_ns=self._arrival_ns,
                    top_p=self.top_p,
                )

    def _settle(self, outcome: Outcome) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self._state.counts[outcome] += 1

    async def _work(self, send: Send) -> None:
        f = self._faults
        if f.hang_forever:
            await asyncio.Event().wait()  # until the client goes away
        if f.hang_s:
            await asyncio.sleep(f.hang_s)
        try:
            self._gens = self._state.submit(self._req, self._rid, self._task)
        except (QueueFull, EngineDead, ValueError) as exc:
            self._settle("rejected")
            if isinstance(exc, QueueFull):
                error = wire.queue_full(exc.reason)
            elif isinstance(exc, EngineDead):
                error = wire.WireError(500, "EngineCore encountered an issue. See stack trace for the root cause.")
            else:
                error = wire.WireError(400, str(exc))
            await send_json(send, error.body, error.status)
            return
        if self._req.stream:
            await self._stream(send)
        else:
            await self._whole(send)

    async def _cut_now(self) -> None:
        """Drop the TCP connection: uvicorn's transport closes (buffered bytes flushed, then FIN mid-body)."""
        self._cut = True
        self._settle("cut")
        for g in self._gens:
            if g.finished_reason is None:
                g.abort()
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.close()
            await asyncio.sleep(5.0)  # the disconnect watcher cancels this first
        raise _Cut("connection cut on purpose (fault injection)")

    def _cached_tokens(self) -> int | None:
        """``prompt_tokens_details.cached_tokens`` (with ``--enable-prompt-tokens-details``): the prompt tokens the
        prefix cache supplied (of the request's prompt; the last prompt's for a completions batch)."""
        if not self._state.options.enable_prompt_tokens_details or not self._gens:
            return None
        return self._gens[0 if self._req.kind == "chat" else -1].cached_tokens

    def _spec_metrics(self) -> dict[str, Any] | None:
        state, level = self._state, self._state.options.per_request_spec_decode_metrics
        if level is None or state.num_spec_tokens is None or len(self._gens) != 1:
            return None
        return self._gens[0].spec.to_dict(detailed=level == "detailed")

    async def _whole(self, send: Send) -> None:
        req, f = self._req, self._faults
        emitted = [0] * len(req.seqs)
        steps = 0
        if f.cut_after == 0:
            await self._cut_now()
        async for i, k in engine_steps(self._gens):
            emitted[i] += k
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
        choices = [
            wire.ChoiceResult(
                seq.index,
                "".join(wire.pseudo_tokens(seq.seed, min(n, seq.output_tokens))),
                self._finish_reason(j, n),
            )
            for j, (seq, n) in enumerate(zip(req.seqs, emitted, strict=True))
        ]
        body = wire.completion_body(
            req.kind,
            response_id=self._response_id,
            created=self._created,
            model=req.model,
            choices=choices,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=sum(emitted),
            fingerprint=self._state.fingerprint,
            spec=self._spec_metrics(),
            cached_tokens=self._cached_tokens(),
        )
        self._settle("completed")
        await send_json(send, body)

    def _finish_reason(self, j: int, emitted: int) -> str:
        seq, reason = self._req.seqs[j], self._gens[j].finished_reason
        if emitted >= seq.output_tokens:
            return seq.finish_reason
        return reason or seq.finish_reason

    def _failure(self, chunks: int) -> wire.WireError | None:
        """An engine failure, or the injected one (``error_after``): the generation ends with a 500 error."""
        after = self._faults.error_after
        if after is not None and chunks >= after:
            for g in self._gens:
                if g.finished_reason is None:
                    g.abort()
            return wire.WireError(500, "Injected failure during generation (simulator fault injection).")
        for g in self._gens:
            if g.finished_reason == "error":
                return wire.WireError(500, "The engine failed while generating this request.")
        return None

    async def _stream(self, send: Send) -> None:
        req, f = self._req, self._faults
        shapes = wire.ChunkShapes(
            kind=req.kind,
            response_id=self._response_id,
            created=self._created,
            model=req.model,
            prompt_tokens=req.prompt_tokens,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            fingerprint=self._state.fingerprint,
        )
        headers = [(b"content-type", wire.SSE_CONTENT_TYPE.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if f.cut_after == 0:
            await self._cut_now()
        texts = [wire.pseudo_tokens(seq.seed, seq.output_tokens) for seq in req.seqs]
        emitted = [0] * len(req.seqs)
        finished = [False] * len(req.seqs)
        chunks = 0
        async for i, k in engine_steps(self._gens):
            seq = req.seqs[i]
            parts: list[bytes] = []
            if req.kind == "chat" and emitted[i] == 0:
                parts.append(wire.sse_event(shapes.role_chunk(seq.index)))
            start = emitted[i]
            emitted[i] = min(start + k, seq.output_tokens)
            finish = seq.finish_reason if emitted[i] >= seq.output_tokens else None
            finished[i] = finish is not None
            text = "".join(texts[i][start : emitted[i]])
            chunk = shapes.token_chunk(text, index=seq.index, finish_reason=finish, completion_tokens=emitted[i])
            parts.append(wire.sse_event(chunk))
            if f.slow_chunk_s:
                await asyncio.sleep(f.slow_chunk_s)
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
            chunks += 1
            if f.cut_after is not None and chunks >= f.cut_after:
                await self._cut_now()
            if f.error_after is not None and chunks >= f.error_after:
                break
        failed = self._failure(chunks)
        if failed is not None:
            self._settle("error")
            await send({"type": "http.response.body", "body": wire.sse_error(failed.body), "more_body": False})
            return
        tail: list[bytes] = []
        for j, seq in enumerate(req.seqs):
            if not finished[j]:  # the engine ended it early: an empty chunk with the reason
                reason = self._finish_reason(j, emitted[j])
                tail.append(wire.sse_event(shapes.token_chunk("", index=seq.index, finish_reason=reason)))
        if req.include_usage:
            tail.append(wire.sse_event(shapes.usage_chunk(sum(emitted), self._spec_metrics(), self._cached_tokens())))
        tail.append(wire.SSE_DONE)
        self._settle("completed")
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
