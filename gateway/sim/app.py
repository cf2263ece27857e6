"""The simulator's HTTP surface: ``vllm serve`` 0.33 on the wire, a simulated engine underneath, fault injection
and the ``/sim/*`` control API.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not), ``GET /v1/models``,
``GET /health`` and ``GET /ping`` (200 empty; 503 when faulted or the engine is stopped), ``GET /version``,
``GET /metrics``; ``GET /sim/stats``, ``GET/PUT /sim/faults``, ``POST /sim/faults/reset``, ``GET /sim/options``.
``--api-key`` protects ``/v1/*`` only, like vLLM's middleware.

A generation request: parse and validate like vLLM (``wire.parse_request``), draw the injected faults, draw the
request's acceptance from the task (``X-Sim-Task``, else ``wire.guess_task``) and temperature, submit one
``GenRequest`` per output sequence to the engine (``QueueFull`` → 503), then stream one chunk per engine step
(every token that step emitted) or answer once generation ends. A watcher on ``receive`` notices the client going
away at once and aborts the generation, whatever the request was waiting on.

Refusing connections needs the server socket: the app's ``FaultState`` holds a ``faults.ListenerControl``
(``server.SimServer`` plugs itself in) and asks it to stop or resume listening.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.sim import wire
from gateway.sim.engine import Engine, EngineDead, Generation, GenRequest, QueueFull
from gateway.sim.faults import MALFORMED_METRICS, Faults, FaultState, RequestFaults
from gateway.sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.sim.metrics import VllmMetrics
from gateway.sim.physics import AcceptanceModel, DraftCost, SpecConfig, TargetCost
from gateway.sim.presets import get_preset

__all__ = ["SimOptions", "SimState", "create_sim_app", "sim_state"]

TASK_HEADER = "x-sim-task"
_MAX_TRACKED_IDS = 100_000
Outcome = Literal["completed", "aborted", "cut", "rejected", "error"]


@dataclass(frozen=True)
class SimOptions:
    """Every knob of one simulated server. ``specgate sim`` flags map onto it; physics constants and acceptance
    knobs given by name become ``target`` / ``draft`` / ``kv_cache_tokens`` / ``acceptance`` through
    ``server.physics_options`` and ``server.acceptance_model``."""

    model: str = "meta-llama/Llama-3.3-70B-Instruct"
    served_model_names: tuple[str, ...] = ()  # default: (model,)
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None  # default: the preset's
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    speculative_config: str | None = None  # JSON; None = a standard server
    per_request_spec_decode_metrics: Literal["summary", "detailed"] | None = None
    api_keys: tuple[str, ...] = ()
    seed: int = 0
    enable_request_id_headers: bool = False
    preset: str = "llama70b-4xh100"
    time_scale: float = 1.0
    target: TargetCost | None = None  # the target's step cost (default: the preset's)
    draft: DraftCost | None = None  # the proposer's cost (default: the preset's for the method)
    kv_cache_tokens: int | None = None  # KV-cache capacity (default: the preset's)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    fixed_acceptance: float | None = None  # every request gets this acceptance (no draw)
    output_lengths: wire.OutputLengths = field(default_factory=wire.OutputLengths)
    faults: Faults = field(default_factory=Faults)
    log_level: str = "warning"

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)


class SimState:
    """Everything mutable of one simulated server; one per app (``app.state.sim``)."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.spec = SpecConfig.from_json(options.speculative_config) if options.speculative_config else None
        self.preset = preset = get_preset(options.preset)
        self.max_model_len = options.max_model_len or preset.max_model_len
        self.metrics = VllmMetrics(options.names[0], speculative=self.num_spec_tokens, max_model_len=self.max_model_len)
        self.engine = Engine(
            preset,
            self.spec,
            self.metrics,
            time_scale=options.time_scale,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_num_queued_reqs=options.max_num_queued_reqs,
            max_num_queued_tokens=options.max_num_queued_tokens,
            seed=options.seed,
            target=options.target,
            draft=options.draft if self.spec is not None else None,
            kv_cache_tokens=options.kv_cache_tokens,
        )
        self.acceptance = options.acceptance
        if options.fixed_acceptance is not None and not 0.0 <= options.fixed_acceptance <= 1.0:
            raise ValueError("fixed acceptance must be between 0 and 1")
        self.rng = random.Random(options.seed)
        self.faults = FaultState(options.faults, seed=options.seed)
        self.fingerprint = wire.system_fingerprint(options.model, options.speculative_config)
        self.created = int(time.time())
        self.alive = False
        self.generations: OrderedDict[str, int] = OrderedDict()
        self.counts: dict[str, int] = dict.fromkeys(
            ("requests", "generated", "completed", "aborted", "cut", "rejected", "error"), 0
        )

    @property
    def num_spec_tokens(self) -> int | None:
        return None if self.spec is None else int(self.spec.num_speculative_tokens)

    def draw_acceptance(self, temperature: float, task: str) -> float:
        if self.spec is None:
            return 0.0
        if self.options.fixed_acceptance is not None:
            return self.options.fixed_acceptance
        return float(self.acceptance.draw(self.rng, temperature, task, self.spec.method))

    def submit(self, req: wire.SimRequest, request_id: str, task: str) -> list[Generation]:
        """One engine generation per output sequence. Raises QueueFull (nothing stays submitted then)."""
        gens: list[Generation] = []
        try:
            for seq in req.seqs:
                gen_id = request_id if len(req.seqs) == 1 else f"{request_id}-{seq.index}"
                gr = GenRequest(
                    request_id=gen_id,
                    prompt_tokens=seq.prompt_tokens,
                    output_tokens=seq.output_tokens,
                    acceptance=self.draw_acceptance(req.temperature, task),
                    params_max_tokens=req.max_tokens,
                    finish_reason=seq.finish_reason,
                )
                gens.append(self.engine.submit(gr))
        except Exception:
            for g in gens:
                g.abort()
            raise
        self.counts["generated"] += 1
        self.generations[request_id] = self.generations.pop(request_id, 0) + 1
        while len(self.generations) > _MAX_TRACKED_IDS:
            self.generations.popitem(last=False)
        return gens

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "generations": dict(self.generations),
            "requests": dict(self.counts),
            "faults": self.faults.stats(),
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_usage": engine.kv_usage,
            "engine": engine.stats(),
        }


def sim_state(app: Starlette) -> SimState:
    state = app.state.sim
    assert isinstance(state, SimState)
    return state


# --------------------------------------------------------------------------------------------------------------
# One generation request


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=wire.JSON_CONTENT_TYPE)


def _error(exc: wire.WireError) -> Response:
    return _json(exc.body, exc.status)


async def _send_json(send: Send, body: Any, status: int = 200) -> None:
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


async def _steps(gens: list[Generation]) -> AsyncIterator[tuple[int, int]]:
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


class _GenerationCall(Response):
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
            await _send_json(send, error.body, error.status)
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
        async for i, k in _steps(self._gens):
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
            await _send_json(send, failed.body, failed.status)
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
        )
        self._settle("completed")
        await _send_json(send, body)

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
        async for i, k in _steps(self._gens):
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
            tail.append(wire.sse_event(shapes.usage_chunk(sum(emitted), self._spec_metrics())))
        tail.append(wire.SSE_DONE)
        self._settle("completed")
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})


# --------------------------------------------------------------------------------------------------------------
# The app


class _SimApp(Starlette):
    """Starlette, plus what must happen outermost: reach uvicorn's transport (to cut connections), check
    ``--api-key`` like vLLM (``/v1`` paths, OPTIONS exempt), echo ``X-Request-Id`` when enabled."""

    sim: SimState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        wire.remember_transport(scope, send)
        options = self.sim.options
        if options.api_keys and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            auth = _header(scope, b"authorization") or ""
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or token not in options.api_keys:
                unauthorized = Response(wire.UNAUTHORIZED_BODY, 401, media_type=wire.JSON_CONTENT_TYPE)
                await unauthorized(scope, receive, send)
                return
        if options.enable_request_id_headers:
            request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
            inner = send

            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())],
                    }
                await inner(message)

            send = send_with_id
        await super().__call__(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def create_sim_app(options: SimOptions) -> Starlette:
    """A simulated ``vllm serve``. The engine starts and stops with the app's lifespan."""
    state = SimState(options)
    served = options.names

    async def parse_body(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise wire.WireError(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise wire.WireError(400, "The request body must be a JSON object.")
        return body

    async def generate(request: Request, kind: wire.Kind) -> Response:
        state.counts["requests"] += 1
        try:
            body = await parse_body(request)
            req = wire.parse_request(
                kind, body, served=served, max_model_len=state.max_model_len, lengths=options.output_lengths
            )
        except wire.WireError as exc:
            return _error(exc)
        faults = state.faults.draw()
        if faults.error_status is not None:
            state.counts["error"] += 1
            return _error(wire.WireError(faults.error_status, "Injected failure (simulator fault injection)."))
        if not state.alive:
            return _error(wire.WireError(500, "The engine is not running."))
        task = (request.headers.get(TASK_HEADER) or "").strip().lower() or wire.guess_task(body)
        request_id = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex
        return _GenerationCall(state, req, str(request_id), task, faults)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def models(request: Request) -> Response:
        return _json(
            wire.model_list(served, created=state.created, max_model_len=state.max_model_len, root=options.model)
        )

    async def health(request: Request) -> Response:
        status = state.faults.faults.health_status
        if not state.alive or state.engine.dead:
            status = 503
        return Response(b"", status_code=status)

    async def version(request: Request) -> Response:
        return _json({"version": wire.VLLM_VERSION})

    async def metrics(request: Request) -> Response:
        mode = state.faults.faults.metrics
        if mode == "missing":
            return _json({"detail": "Not Found"}, 404)
        if mode == "malformed":
            return Response(MALFORMED_METRICS, media_type=METRICS_CONTENT_TYPE)
        engine = state.engine
        state.metrics.set_scheduler(engine.running, engine.waiting, engine.kv_usage)
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def sim_stats(request: Request) -> Response:
        return _json(state.stats())

    async def sim_faults(request: Request) -> Response:
        if request.method == "PUT":
            try:
                patch = orjson.loads(await request.body())
                await state.faults.apply(state.faults.faults.merged(patch))
            except (orjson.JSONDecodeError, ValueError) as exc:
                return _error(wire.WireError(400, str(exc)))
        return _json(state.faults.faults.to_json())

    async def sim_faults_reset(request: Request) -> Response:
        await state.faults.apply(Faults())
        return _json(state.faults.faults.to_json())

    async def sim_options(request: Request) -> Response:
        shown = dataclasses.replace(options, api_keys=("<redacted>",) * len(options.api_keys))
        raw = orjson.dumps(shown, default=lambda o: dict(o) if isinstance(o, Mapping) else str(o))
        return Response(raw, media_type=wire.JSON_CONTENT_TYPE)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _json({"detail": "Not Found"}, 404)

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _json({"detail": "Method Not Allowed"}, 405)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncGenerator[None, None]:
        await state.engine.start()
        state.alive = True
        try:
            yield
        finally:
            state.alive = False
            state.faults.close()
            await state.engine.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/faults", sim_faults, methods=["GET", "PUT"]),
        Route("/sim/faults/reset", sim_faults_reset, methods=["POST"]),
        Route("/sim/options", sim_options, methods=["GET"]),
    ]
    app = _SimApp(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    app.sim = state
    app.state.sim = state
    return app
