"""One simulated server's configuration and mutable state: ``SimOptions`` (every knob, frozen; ``specgate sim``
flags map onto it), ``SimState`` (the engine, metrics, fault state and request bookkeeping of one app instance,
the only mutable state the simulator has) and ``sim_state``, which fetches it from an app.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette

from gateway.sim import wire
from gateway.sim.engine import Engine, Generation, GenRequest
from gateway.sim.faults import Faults, FaultState
from gateway.sim.kv_events import KVEventPublisher, KVEventsConfig
from gateway.sim.metrics import VllmMetrics, cache_config_labels
from gateway.sim.physics import AcceptanceModel, DraftCost, SpecConfig, TargetCost
from gateway.sim.presets import get_preset, speculative_kv_fraction
from gateway.sim.request_queue import SchedulingPolicy
from gateway.sim.tokens import answer_ids
from gateway.sim.tracing import SimTracer

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
    enable_responses_store: bool = False  # vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1 (Responses API store)
    api_keys: tuple[str, ...] = ()
    seed: int = 0
    enable_request_id_headers: bool = False
    otlp_traces_endpoint: str | None = None  # vLLM's --otlp-traces-endpoint: an `llm_request` span per request
    preset: str = "llama70b-4xh100"
    time_scale: float = 1.0
    target: TargetCost | None = None  # the target's step cost (default: the preset's)
    draft: DraftCost | None = None  # the proposer's cost (default: the preset's for the method)
    kv_cache_tokens: int | None = None  # a standard server's KV-cache capacity (default: the preset's)
    enable_prefix_caching: bool = True  # vLLM V1's automatic prefix caching (--no-enable-prefix-caching)
    scheduling_policy: SchedulingPolicy = "fcfs"  # vLLM's --scheduling-policy: fcfs, or priority (lower first)
    block_size: int | None = None  # KV block size in tokens (default 16)
    kv_events_config: str | None = None  # JSON, vLLM's KVEventsConfig (KV cache events over ZMQ)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details (cached_tokens) in responses
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
        self.kv_events_config = (
            KVEventsConfig.from_json(options.kv_events_config) if options.kv_events_config else KVEventsConfig()
        )
        self.kv_events = KVEventPublisher(self.kv_events_config) if self.kv_events_config.active else None
        block_size = options.block_size or 16
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        kv_tokens = options.kv_cache_tokens or preset.kv_cache_tokens
        if self.spec is not None:  # the proposer's weights and KV take part of the memory
            kv_tokens = int(kv_tokens * speculative_kv_fraction(preset.name, self.spec.method))
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
            kv_cache_tokens=kv_tokens,
            block_size=block_size,
            enable_prefix_caching=options.enable_prefix_caching,
            on_kv_events=self.kv_events.publish if self.kv_events is not None else None,
            scheduling_policy=options.scheduling_policy,
        )
        self.metrics.set_cache_config(
            cache_config_labels(
                block_size=block_size,
                user_specified_block_size=options.block_size is not None,
                num_gpu_blocks=self.engine.total_blocks,
                enable_prefix_caching=options.enable_prefix_caching,
                max_model_len=self.max_model_len,
            )
        )
        self.acceptance = options.acceptance
        if options.fixed_acceptance is not None and not 0.0 <= options.fixed_acceptance <= 1.0:
            raise ValueError("fixed acceptance must be between 0 and 1")
        self.rng = random.Random(options.seed)
        self.faults = FaultState(options.faults, seed=options.seed)
        self.fingerprint = wire.system_fingerprint(options.model, options.speculative_config)
        self.created = int(time.time())
        self.alive = False
        # OpenTelemetry (--otlp-traces-endpoint), imported only when asked for (gateway.sim.tracing).
        self.tracer: SimTracer | None = None
        if options.otlp_traces_endpoint:
            self.tracer = SimTracer(options.otlp_traces_endpoint)
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
                    prompt_ids=seq.prompt_ids,
                    answer_ids=_answer(seq.seed, req.kind == "chat"),
                    priority=req.priority,
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


def _answer(seed: int, chat: bool) -> Callable[[int], list[int]]:
    """The token ids of a sequence's answer once it has emitted ``n`` tokens (the text a client gets back)."""

    def ids(n: int) -> list[int]:
        return answer_ids("".join(wire.pseudo_tokens(seed, n)), chat=chat)

    return ids


def sim_state(app: Starlette) -> SimState:
    state = app.state.sim
    assert isinstance(state, SimState)
    return state
