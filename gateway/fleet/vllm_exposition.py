"""vLLM's Prometheus text → one ``VllmSample``. Pure: no I/O.

``parse_vllm_metrics`` reads one exposition with prometheus_client's text parser (never by splitting strings) into a
``VllmSample``, summed over the ``engine`` and ``model_name`` labels. The names read come from the YAML's
``scrape.metric_names`` (vLLM 0.33 defaults). prometheus_client's parser names a counter FAMILY without ``_total``
and its SAMPLE with it (an exposition without ``# TYPE`` lines keeps the sample name as the family name), so names
are matched on samples, and a counter is found whichever spelling the YAML uses.

The prefix-cache counters (queries and hits, in tokens) are read as the other counters; the cache's size is
``num_gpu_blocks`` x ``block_size`` from the labels of the ``vllm:cache_config_info`` info gauge (summed over
engines), which sizes the endpoint's prefix index (``gateway.fleet.prefix_index``).

The samples feed the endpoint and pool loads (``gateway.fleet.vllm_metrics``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.config.schema import MetricNames

MAX_POSITIONS = 64  # a per-position label beyond this is ignored (K is small; a bad label must not allocate much)


class MetricsFormatError(ValueError):
    """The /metrics body could not be read as Prometheus text, or lacks the running/waiting gauges."""


@dataclass(frozen=True, slots=True)
class VllmSample:
    """One /metrics scrape, summed over engines and models. Counters are cumulative; None = not in the text."""

    running: float
    waiting: float
    kv_usage: float | None = None  # the MAX over engines: the fullest engine is the one that preempts first
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    accepted_per_pos: tuple[float, ...] = ()
    generation_tokens: float | None = None
    tpot_sum: float | None = None
    tpot_count: float | None = None
    out_sum: float | None = None  # output tokens of the finished requests (the histogram's _sum) ...
    out_count: float | None = None  # ... and how many finished (its _count)
    created: float | None = None  # latest ``<generation_tokens>_created``: changes when the server restarts
    prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_hits: float | None = None  # ... and found there
    cache_tokens: int | None = None  # num_gpu_blocks x block_size of vllm:cache_config_info, summed over engines


_SUMMED = (
    "running",
    "waiting",
    "drafts",
    "draft_tokens",
    "accepted",
    "generation_tokens",
    "tpot_sum",
    "tpot_count",
    "out_sum",
    "out_count",
    "prefix_queries",
    "prefix_hits",
)


def _sample_fields(names: MetricNames) -> dict[str, str]:
    """Exposition sample name → VllmSample field."""
    out: dict[str, str] = {
        names.running: "running",
        names.waiting: "waiting",
        names.kv_usage: "kv_usage",
        names.tpot + "_sum": "tpot_sum",
        names.tpot + "_count": "tpot_count",
        names.request_generation_tokens + "_sum": "out_sum",
        names.request_generation_tokens + "_count": "out_count",
    }
    out[names.cache_config_info] = "cache_config"
    for fld in ("drafts", "draft_tokens", "accepted", "accepted_per_pos", "generation_tokens"):
        base = str(getattr(names, fld)).removesuffix("_total")
        out[base] = fld
        out[base + "_total"] = fld
    for fld, name in (("prefix_queries", names.prefix_cache_queries), ("prefix_hits", names.prefix_cache_hits)):
        base = name.removesuffix("_total")
        out[base] = fld
        out[base + "_total"] = fld
    out[names.generation_tokens.removesuffix("_total") + "_created"] = "created"
    return out


def parse_vllm_metrics(text: str, names: MetricNames) -> VllmSample:
    """Read one vLLM exposition. Raises ``MetricsFormatError`` on unparsable text or missing running/waiting."""
    wanted = _sample_fields(names)
    sums: dict[str, float] = {}
    kv: float | None = None
    created: float | None = None
    per_pos: dict[int, float] = {}
    cache_tokens: int | None = None
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                fld = wanted.get(s.name)
                if fld is None or not math.isfinite(s.value):
                    continue
                if fld == "kv_usage":
                    kv = s.value if kv is None else max(kv, s.value)
                elif fld == "created":
                    created = s.value if created is None else max(created, s.value)
                elif fld == "cache_config":
                    size = _cache_tokens(s.labels)
                    if size is not None:
                        cache_tokens = size + (cache_tokens or 0)
                elif fld == "accepted_per_pos":
                    pos = s.labels.get("position", "")
                    if pos.isdecimal() and int(pos) < MAX_POSITIONS:
                        per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + s.value
                else:
                    sums[fld] = sums.get(fld, 0.0) + s.value
    except Exception as exc:  # the parser raises ValueError, but also IndexError/KeyError on some garbage
        raise MetricsFormatError(f"unparsable Prometheus text: {type(exc).__name__}: {exc}") from exc
    if "running" not in sums or "waiting" not in sums:
        raise MetricsFormatError(f"no {names.running} / {names.waiting} in the exposition (check scrape.metric_names)")
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return VllmSample(
        running=sums["running"],
        waiting=sums["waiting"],
        kv_usage=kv,
        drafts=sums.get("drafts"),
        draft_tokens=sums.get("draft_tokens"),
        accepted=sums.get("accepted"),
        accepted_per_pos=positions,
        generation_tokens=sums.get("generation_tokens"),
        tpot_sum=sums.get("tpot_sum"),
        tpot_count=sums.get("tpot_count"),
        out_sum=sums.get("out_sum"),
        out_count=sums.get("out_count"),
        created=created,
        prefix_queries=sums.get("prefix_queries"),
        prefix_hits=sums.get("prefix_hits"),
        cache_tokens=cache_tokens,
    )


MAX_CACHE_TOKENS = 1 << 40  # a label beyond this is garbage, not a cache size


def _cache_tokens(labels: Mapping[str, str]) -> int | None:
    """num_gpu_blocks x block_size from the labels of vllm:cache_config_info; None when either is missing or odd."""
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if not (blocks.isdecimal() and size.isdecimal()) or len(blocks) > 12 or len(size) > 6:
        return None
    tokens = int(blocks) * int(size)
    return tokens if 0 < tokens <= MAX_CACHE_TOKENS else None


def parse_vllm_metrics_bytes(body: bytes, names: MetricNames) -> VllmSample:
    """``parse_vllm_metrics`` of a raw body (UTF-8); for ``asyncio.to_thread``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MetricsFormatError(f"/metrics is not UTF-8: {exc}") from exc
    return parse_vllm_metrics(text, names)
