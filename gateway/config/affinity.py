"""The routing YAML's ``prefix_affinity`` block (``defaults.prefix_affinity``, overridable per pool): how the endpoint
pick inside a pool prefers the endpoint whose prefix cache already holds the start of the prompt
(``gateway.fleet.affinity``). Part of ``gateway.config.schema``'s document."""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import Number, Strict

MAX_INDEX_CHUNKS = 1 << 20  # hard ceiling of one endpoint's index (about 130 MB at ~128 bytes a chunk)


class PrefixAffinity(Strict):
    """Prefix-cache affinity inside a pool: a request goes to the endpoint that holds the longest start of its
    prompt (as far as the gateway's index of what it sent there knows), unless that endpoint's load is past
    ``load_slack`` / ``load_margin`` above the least-loaded endpoint's; the least loaded endpoint otherwise."""

    enabled: bool = Field(True, description="Prefer the endpoint with the longest warm prefix of the prompt.")
    min_prefix_tokens: int = Field(
        256,
        ge=16,
        le=1_000_000,
        description="A warm prefix shorter than this (approximate tokens, 4 characters each) does not count: a short "
        "shared system prompt alone must not pin every conversation to one endpoint.",
    )
    load_slack: Number = Field(
        0.25,
        ge=0,
        le=100,
        description="A warm endpoint is passed over when its in-flight requests per weight exceed the least-loaded "
        "routable endpoint's x (1 + load_slack) + load_margin: no hot server from a shared prefix.",
    )
    load_margin: Number = Field(
        4.0, ge=0, le=100_000, description="The absolute part of the load bound (requests per unit of weight)."
    )
    default_capacity_tokens: int = Field(
        262_144,
        ge=1024,
        le=MAX_INDEX_CHUNKS * 16,
        description="The prefix-cache size assumed for an endpoint until its /metrics gives num_gpu_blocks x "
        "block_size (vllm:cache_config_info).",
    )
    max_index_tokens: int = Field(
        2_097_152,
        ge=1024,
        le=MAX_INDEX_CHUNKS * 16,
        description="The most prompt tokens one endpoint's index remembers, whatever its scraped cache size: bounds "
        "the gateway's memory (about 8 bytes of hash and 120 of bookkeeping per 16 tokens).",
    )
