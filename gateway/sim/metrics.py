"""vLLM 0.33's Prometheus metrics (V1 engine), exactly: names, types, labels, buckets, ``_total``/``_created``.

Only the series the gateway and the dashboards read are served (vLLM has more). Every series carries
``model_name`` and ``engine`` (``"0"``) except ``vllm:admission_rejections_total`` (``model_name``, ``reason``) and
``vllm:cache_config_info`` (one label per field of vLLM's ``CacheConfig``, in its order, then ``engine``: see
``cache_config_labels``); every label child is created up front, as vLLM does, so a fresh server already shows
zeros. The four ``vllm:spec_decode_*`` counters exist only on a speculative server, with ``position`` 0…K−1.
Latencies are observed in SIMULATED seconds. Registry of its own (never the global default).

The engine observes many values per step; ``observe_n`` adds n equal observations at the cost of one (the inter-token
latency of every sequence in a step is usually the same number).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vllm/v1/metrics/buckets.py
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# Every name served (as exposed, counters with ``_total``); the spec-decode ones only when speculative.
BASE_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:admission_rejections_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
)
SPEC_NAMES = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to ``max_value`` inclusive (vLLM's ``build_1_2_5_buckets``)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


def observe_n(child: Any, value: float, n: int) -> None:
    """``n`` observations of ``value`` on a histogram child, in one update when prometheus_client's layout is the
    one it has had since 0.4 (``_sum``, ``_buckets``, ``_upper_bounds``); otherwise one by one."""
    if n <= 0:
        return
    buckets = getattr(child, "_buckets", None)
    bounds = getattr(child, "_upper_bounds", None)
    total = getattr(child, "_sum", None)
    if n == 1 or buckets is None or bounds is None or total is None:
        for _ in range(n):
            child.observe(value)
        return
    total.inc(value * n)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(n)
            break


def cache_config_labels(
    *,
    block_size: int,
    user_specified_block_size: bool,
    num_gpu_blocks: int,
    enable_prefix_caching: bool,
    max_model_len: int,
) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: every field of vLLM 0.33's ``CacheConfig`` in declaration order,
    ``str()`` of its value on a plain ``vllm serve`` of a dense model (the frontend's copy: after start-up it knows
    ``num_gpu_blocks``, ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency``; the rest are defaults)."""
    tokens = num_gpu_blocks * block_size
    values: dict[str, object] = {
        "block_size": block_size, "user_specified_block_size": user_specified_block_size, "kv_cache_layout": None,
        "prefix_match_unit": None, "gpu_memory_utilization": 0.92, "cache_dtype": "auto", "is_attention_free": False,
        "num_gpu_blocks_override": None, "sliding_window": None, "enable_prefix_caching": enable_prefix_caching,
        "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": 0, "kv_cache_dtype_skip_layers": [],
        "mamba_page_size_padded": None, "skip_page_size_padded": None, "mamba_block_size": None,
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": False, "replayssm_buffer_len": 16, "use_replayssm": False,
        "use_kda_recoverssm": False, "num_gpu_blocks": num_gpu_blocks, "num_cpu_blocks": None,
        "simple_cpu_offload_num_blocks": None, "effective_attention_block_size": None,
        "kv_cache_size_tokens": tokens, "kv_cache_max_concurrency": tokens / max_model_len if max_model_len else None,
        "hash_block_size": None, "cache_hit_alignment_tokens": None, "kv_sharing_fast_prefill": False,
        "swa_bounded_replay": True, "kv_cache_memory_bytes": None, "kv_offloading_size": None,
        "kv_offloading_backend": "native", "_block_size_resolved": True,
    }  # fmt: skip
    return {key: str(value) for key, value in values.items()}


@dataclass(slots=True)
class SpecStats:
    """One request's speculative decoding (vLLM's ``RequestSpecDecodeMetrics``)."""

    num_spec_tokens: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # entry i: steps that accepted i drafts
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step including the bonus token; None before any."""
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        """vLLM's payload: ``mean_acceptance_length`` 1.0 and ``draft_acceptance_rate`` 0.0 when nothing was drafted."""
        out: dict[str, Any] = {
            "mean_acceptance_length": self.mean_acceptance_length or 1.0,
            "draft_acceptance_rate": self.draft_acceptance_rate or 0.0,
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_spec_steps": self.num_spec_steps,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
        }
        if detailed and self.per_step_accepted:
            out["per_step_accepted"] = list(self.per_step_accepted)
            out["per_step_drafted"] = list(self.per_step_drafted)
        return out


class VllmMetrics:
    """The ``/metrics`` of one simulated ``vllm serve``. ``speculative``: K (num_speculative_tokens) or None."""

    def __init__(
        self, model_name: str, *, speculative: int | None = None, max_model_len: int = 8192, engine: str = "0"
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.num_spec_tokens = speculative
        r = self.registry
        lab = ["model_name", "engine"]
        lv = (model_name, engine)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, lab, registry=r, multiprocess_mode="mostrecent").labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, lab, registry=r).labels(*lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            [*lab, "reason"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._engine = engine
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*lab, "finished_reason"], registry=r
        )
        self.success = {reason: success.labels(*lv, reason) for reason in FINISHED_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.admission_rejections = {reason: rejections.labels(model_name, reason) for reason in ADMISSION_REASONS}
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        lat = REQUEST_LATENCY_BUCKETS
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", lat
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", lat
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", lat
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", lat
        )
        self.spec_drafts: Any = None
        self.spec_draft_tokens: Any = None
        self.spec_accepted: Any = None
        self.spec_accepted_per_pos: list[Any] = []
        if speculative is not None:
            self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*lab, "position"],
                registry=r,
            )
            self.spec_accepted_per_pos = [per_pos.labels(*lv, str(p)) for p in range(speculative)]

    @property
    def names(self) -> tuple[str, ...]:
        """The metric names served, as they appear in the exposition."""
        return BASE_NAMES + (SPEC_NAMES if self.num_spec_tokens is not None else ())

    def set_scheduler(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_capacity.set(waiting)
        self.waiting_deferred.set(0)
        self.kv_usage.set(kv_usage)

    def set_cache_config(self, labels: Mapping[str, str]) -> None:
        """``vllm:cache_config_info``: a gauge at 1 whose labels describe the KV cache (``cache_config_labels``)."""
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*labels, "engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        info.labels(*labels.values(), self._engine).set(1)

    def observe_prefix_cache(self, queries: int, hits: int) -> None:
        """A request's prefix-cache lookup at its first admission (tokens queried, tokens found)."""
        self.prefix_cache_queries.inc(queries)
        if hits:
            self.prefix_cache_hits.inc(hits)

    def reject(self, reason: str) -> None:
        """An admission rejected by ``--max-num-queued-reqs`` (or ``--max-num-queued-tokens``)."""
        self.admission_rejections[reason].inc()

    def observe_spec(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        """One step's speculative counters (``per_pos[i]``: drafts whose position i was accepted)."""
        if self.spec_drafts is None or drafts == 0:
            return
        self.spec_drafts.inc(drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted.inc(accepted)
        for counter, n in zip(self.spec_accepted_per_pos, per_pos, strict=False):
            if n:
                counter.inc(n)

    def observe_finished(
        self,
        reason: str,
        *,
        e2e: float,
        queued: float | None,
        prefill: float | None,
        decode: float | None,
        inference: float | None,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int | None,
    ) -> None:
        """A request left the engine (vLLM's ``update_from_finished_request``); phases it never reached are skipped."""
        self.success[reason].inc()
        self.e2e.observe(e2e)
        if queued is not None:
            self.queue_time.observe(queued)
        if prefill is not None:
            self.prefill_time.observe(prefill)
        if inference is not None:
            self.inference_time.observe(inference)
        if decode is not None:
            self.decode_time.observe(decode)
            # vLLM: decode time / (tokens − 1), 0 when the request made a single token
            self.tpot.observe(decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
