"""The routing YAML's operational sections as strict pydantic models: ``scrape`` (with the vLLM metric names it
reads) and ``overload``. Part of ``gateway.config.schema``'s document; apart because they say how the gateway
watches and protects itself, not where a request goes."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from gateway.config.base import Number, OptionalNumber, Strict

PROMETHEUS_NAME = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
MetricName = Annotated[str, Field(pattern=PROMETHEUS_NAME)]


class MetricNames(Strict):
    """The vLLM metric names the scraper reads (vLLM 0.33 defaults); override them for other vLLM versions.

    Counters may be written with or without the ``_total`` suffix; histograms by their base name (without
    ``_sum`` / ``_count``). Series are summed over the ``engine`` and ``model_name`` labels."""

    running: MetricName = Field("vllm:num_requests_running", description="Gauge: requests in the running batch.")
    waiting: MetricName = Field("vllm:num_requests_waiting", description="Gauge: queued requests (queue depth).")
    kv_usage: MetricName = Field("vllm:kv_cache_usage_perc", description="Gauge: KV-cache usage, 0..1.")
    drafts: MetricName = Field("vllm:spec_decode_num_drafts", description="Counter: draft rounds.")
    draft_tokens: MetricName = Field("vllm:spec_decode_num_draft_tokens", description="Counter: draft tokens.")
    accepted: MetricName = Field("vllm:spec_decode_num_accepted_tokens", description="Counter: accepted draft tokens.")
    accepted_per_pos: MetricName = Field(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        description="Counter with a `position` label: accepted draft tokens per draft position.",
    )
    generation_tokens: MetricName = Field("vllm:generation_tokens", description="Counter: generated tokens.")
    tpot: MetricName = Field(
        "vllm:request_time_per_output_token_seconds", description="Histogram: time per output token (seconds)."
    )
    request_generation_tokens: MetricName = Field(
        "vllm:request_generation_tokens", description="Histogram: output tokens of each finished request."
    )
    prefix_cache_queries: MetricName = Field(
        "vllm:prefix_cache_queries", description="Counter: prompt tokens looked up in the prefix cache."
    )
    prefix_cache_hits: MetricName = Field(
        "vllm:prefix_cache_hits", description="Counter: prompt tokens found in the prefix cache."
    )
    cache_config_info: MetricName = Field(
        "vllm:cache_config_info",
        description="Info gauge whose labels block_size and num_gpu_blocks size the endpoint's prefix index.",
    )


class Scrape(Strict):
    """Scraping every endpoint's ``/metrics`` and ``/health`` (queue depth, batch size, KV usage, acceptance)."""

    interval_s: Number = Field(2.0, gt=0, description="Seconds between scrape rounds.")
    timeout_s: Number = Field(1.0, gt=0, description="Timeout of one scrape request (/metrics or /health).")
    stale_after_s: OptionalNumber = Field(
        None, gt=0, description="A sample older than this is stale (never read as 0); default 3 x interval_s."
    )
    window_s: Number = Field(60.0, gt=0, description="Sliding window for acceptance and TPOT (counter deltas).")
    metric_names: MetricNames = Field(default_factory=MetricNames)

    @model_validator(mode="after")
    def _ordered(self) -> Scrape:
        if self.timeout_s > self.interval_s:
            raise ValueError(f"thresholds out of order: timeout_s {self.timeout_s} > interval_s {self.interval_s}")
        if self.stale_after_s is not None and self.stale_after_s <= self.interval_s:
            raise ValueError(
                f"thresholds out of order: stale_after_s {self.stale_after_s} must exceed interval_s {self.interval_s}"
            )
        if self.window_s < 2 * self.interval_s:
            raise ValueError(
                f"window_s {self.window_s} must be at least 2 x interval_s ({2 * self.interval_s}): a window needs "
                "two scrapes"
            )
        return self

    @property
    def stale_after(self) -> float:
        return self.stale_after_s if self.stale_after_s is not None else 3 * self.interval_s


class Overload(Strict):
    """Overload handling (``gateway.routing.overload``, ``gateway.proxy.stall``): what a shed request is told, and
    how long a client that reads nothing may hold a stream."""

    retry_after_s: int = Field(
        1, ge=1, le=3600, description="Retry-After (seconds) of a request shed or refused because every pool is busy."
    )
    client_send_timeout_s: Number = Field(
        30.0,
        gt=0,
        le=3600,
        description="A client that accepts no bytes for this long is cut off: its connection is closed, the upstream "
        "request cancelled (a keyed one runs to its end and is stored), its connection slot freed.",
    )
