"""How close the gateway's approximate prefix index comes to the servers' prefix caches, in the multi-turn bench.

The gateway predicts, per endpoint, how many prompt tokens of each request the endpoint's cache holds
(``specgate_prefix_predicted_hit_tokens_total``: warm 64-character chunks x 16, no tokenizer); each simulated server
counts what it actually hit (``vllm:prefix_cache_hits_total``). Over a measured window the two deltas per endpoint,
and their ratio (predicted / measured), say how far the approximation is from the cache: the most that matching
vLLM's own block hashes could correct.

Per turn, the gateway's prediction is not in the answer, so ``TurnMirror`` replays it in the harness: the same
rendering and chunk hashes (``gateway.routing.prompt_key``) into a ``PrefixIndex`` per endpoint sized from the
server's ``vllm:cache_config_info``, fed each turn in the order the answers arrive (the gateway's measured-hit
correction of the size is not replayed). A turn whose reported cached tokens
(``usage.prompt_tokens_details.cached_tokens``) fall short of that prediction by more than one block is one the
gateway thought warmer than it was. With several gateway processes (each its own indexes) no turn is replayed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.fleet.prefix_index import TOKENS_PER_CHUNK, PrefixIndex
from gateway.routing.classify import ApiKind
from gateway.routing.prompt_key import prompt_chunks

PREDICTED = "specgate_prefix_predicted_hit_tokens_total"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
CACHE_INFO = "vllm:cache_config_info"
BLOCK_TOKENS = 16  # one vLLM block: a shortfall of at most this is rounding, not a wrong prediction
DEFAULT_CHUNKS = 16384  # a mirror's size where the server did not say its cache size


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition: (labels, value)."""
    out: list[tuple[dict[str, str], float]] = []
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        labels: dict[str, str] = {}
        if "{" in head:
            inner = head[head.index("{") + 1 : head.rindex("}")]
            for part in inner.split('",'):
                key, _, val = part.partition("=")
                if key:
                    labels[key.strip()] = val.strip().strip('"')
        try:
            out.append((labels, float(value)))
        except ValueError:
            continue
    return out


def total(text: str, name: str) -> float:
    return sum(v for _, v in samples(text, name))


def predicted_by_endpoint(text: str) -> dict[str, float]:
    """The gateway's predicted hit tokens per endpoint id (summed over pools)."""
    out: dict[str, float] = {}
    for labels, value in samples(text, PREDICTED):
        ep = labels.get("endpoint", "")
        out[ep] = out.get(ep, 0.0) + value
    return out


def cache_chunks(text: str) -> int | None:
    """The server's cache size in 16-token chunks (num_gpu_blocks x block_size / 16), as the gateway sizes its
    index; None where the server does not say."""
    for labels, _ in samples(text, CACHE_INFO):
        try:
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"]) // TOKENS_PER_CHUNK
        except (KeyError, ValueError):
            return None
    return None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative counters at one moment, per endpoint id."""

    predicted: dict[str, float]  # the gateway's predicted hit tokens
    hits: dict[str, float]  # the server's measured hit tokens


async def _get(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as r:
            return await r.text() if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


async def snapshot(session: aiohttp.ClientSession, gateway_url: str, endpoints: Mapping[str, int]) -> Snapshot | None:
    """The gateway's predictions and each server's hits now; None where any of them did not answer."""
    text = await _get(session, f"{gateway_url}/metrics")
    if text is None:
        return None
    hits: dict[str, float] = {}
    for ep, port in endpoints.items():
        sim = await _get(session, f"http://127.0.0.1:{port}/metrics")
        if sim is None:
            return None
        hits[ep] = total(sim, HITS)
    return Snapshot(predicted_by_endpoint(text), hits)


async def capacities(session: aiohttp.ClientSession, endpoints: Mapping[str, int]) -> dict[str, int]:
    """Each server's cache size in chunks (``DEFAULT_CHUNKS`` where it does not say)."""
    out: dict[str, int] = {}
    for ep, port in endpoints.items():
        text = await _get(session, f"http://127.0.0.1:{port}/metrics")
        got = cache_chunks(text) if text is not None else None
        out[ep] = got if got else DEFAULT_CHUNKS
    return out


@dataclass(frozen=True, slots=True)
class EndpointPrecision:
    endpoint: str
    predicted: float  # the gateway's predicted hit tokens over the window
    measured: float  # the server's hit tokens over the window

    @property
    def ratio(self) -> float:
        """Predicted over measured: above 1, the gateway thought the cache warmer than it was."""
        return self.predicted / self.measured if self.measured > 0 else math.nan


def precision(before: Snapshot | None, after: Snapshot | None) -> tuple[EndpointPrecision, ...]:
    """Per endpoint, the window's predicted and measured hit tokens (empty: a snapshot is missing)."""
    if before is None or after is None:
        return ()
    return tuple(
        EndpointPrecision(
            ep,
            after.predicted.get(ep, 0.0) - before.predicted.get(ep, 0.0),
            after.hits[ep] - before.hits.get(ep, 0.0),
        )
        for ep in sorted(after.hits)
    )


def overall(rows: Iterable[EndpointPrecision]) -> EndpointPrecision:
    rows = list(rows)
    return EndpointPrecision("all", sum(r.predicted for r in rows), sum(r.measured for r in rows))


def shortfall(turns: Iterable[tuple[int | None, int | None]], block: int = BLOCK_TOKENS) -> tuple[int, int]:
    """(turns whose cached tokens fell short of the predicted ones by more than ``block``, turns with both known),
    from (predicted, cached) pairs."""
    short = counted = 0
    for predicted, cached in turns:
        if predicted is None or cached is None:
            continue
        counted += 1
        short += predicted - cached > block
    return short, counted


def api_kind(path: str) -> ApiKind:
    if path.endswith("/responses"):
        return "responses"
    return "chat" if path.endswith("/chat/completions") else "completions"


class TurnMirror:
    """The gateway's per-endpoint prefix indexes, replayed in the harness: what the gateway predicted of a turn."""

    def __init__(self, capacity_chunks: Mapping[str, int] | None = None) -> None:
        self._sizes = dict(capacity_chunks or {})
        self._indexes: dict[str, PrefixIndex] = {}

    def record(self, endpoint: str, path: str, body: Mapping[str, Any]) -> int | None:
        """The turn went to ``endpoint``: the tokens predicted warm there (None: no endpoint known)."""
        if not endpoint:
            return None
        index = self._indexes.get(endpoint)
        if index is None:
            size = self._sizes.get(endpoint, DEFAULT_CHUNKS)
            index = self._indexes[endpoint] = PrefixIndex(size, size)
        return index.record(prompt_chunks(api_kind(path), body)) * TOKENS_PER_CHUNK
