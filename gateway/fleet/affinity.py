"""Prefix affinity: which endpoint of a pool gets a request whose prompt may be warm on one of them.

The rule (``PoolState.pick`` applies it before its power of two choices):

1. Each candidate endpoint's warm prefix is the number of chunks at the start of the prompt that its index
   (``gateway.fleet.prefix_index``) holds. A warm prefix shorter than ``min_prefix_tokens`` does not count.
2. An endpoint is over the load bound when its in-flight requests per unit of weight exceed the least-loaded
   candidate's x (1 + ``load_slack``) + ``load_margin`` (as vllm-router's balance thresholds compare the busiest
   with the idlest): a shared system prompt, warm everywhere it went, must not make one hot server. Measured
   against the least loaded, not the mean: with the mean, one idle endpoint among eight whose prompt is warm on
   the other seven would never be over-ruled (the seven never pass 1.25x a mean they make themselves). With the
   defaults a warm endpoint keeps taking its prompts until it holds 1.25x the idlest one's load plus 4.
3. The endpoint with the longest counted warm prefix within the bound wins (equal prefixes: the less loaded one).
   None: the pool's least-loaded pick decides (a cold prompt, or every warm endpoint over the bound).

Nothing here does I/O; the loads are the gateway's own in-flight counts of this process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from gateway.config.affinity import PrefixAffinity
from gateway.fleet.prefix_index import TOKENS_PER_CHUNK, PrefixIndex

Verdict = Literal["warm", "cold", "over_bound"]


class Candidate(Protocol):
    """What the rule reads of an endpoint (``gateway.fleet.pools.EndpointState``)."""

    @property
    def id(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def weight(self) -> float: ...
    @property
    def prefixes(self) -> PrefixIndex: ...


E = TypeVar("E", bound=Candidate)


def load_of(ep: Candidate) -> float:
    """In-flight requests per unit of weight (the pick's measure of load)."""
    return ep.in_flight / ep.weight


def load_bound(loads: Sequence[float], cfg: PrefixAffinity) -> float:
    """The most load a warm endpoint may carry and still be preferred."""
    return min(loads) * (1.0 + cfg.load_slack) + cfg.load_margin


def min_chunks(cfg: PrefixAffinity) -> int:
    return max(1, -(-cfg.min_prefix_tokens // TOKENS_PER_CHUNK))


def warm_pick(cands: Sequence[E], chunks: Sequence[int], cfg: PrefixAffinity) -> E | None:
    """The warm endpoint within the load bound with the longest counted prefix; None: no such endpoint."""
    need = min_chunks(cfg)
    if len(chunks) < need:
        return None
    loads = [load_of(e) for e in cands]
    bound = load_bound(loads, cfg)
    best: E | None = None
    best_warm, best_load = 0, 0.0
    for ep, load in zip(cands, loads, strict=True):
        if load > bound:
            continue
        warm = ep.prefixes.match(chunks)
        if warm < need:
            continue
        if best is None or warm > best_warm or (warm == best_warm and load < best_load):
            best, best_warm, best_load = ep, warm, load
    return best


@dataclass(frozen=True, slots=True)
class Warmth:
    """One candidate endpoint as the affinity rule sees it (for ``explain``)."""

    endpoint: str
    warm_tokens: int  # approximate: warm chunks x 16
    counted: bool  # at least min_prefix_tokens
    load: float  # in-flight per weight
    over_bound: bool
    index_chunks: int
    index_capacity: int
    capacity_source: str  # default | scraped


def assess(
    cands: Sequence[Candidate], chunks: Sequence[int], cfg: PrefixAffinity
) -> tuple[list[Warmth], str | None, Verdict]:
    """Every candidate's warmth and load, the endpoint ``warm_pick`` chooses (None: the least-loaded pick
    decides) and why: warm (it holds the longest counted prefix within the bound), cold (no endpoint holds a
    counted prefix), over_bound (the ones that do are over the load bound)."""
    need = min_chunks(cfg)
    loads = [load_of(e) for e in cands]
    bound = load_bound(loads, cfg) if cands else 0.0
    rows = [
        Warmth(
            endpoint=e.id,
            warm_tokens=(warm := e.prefixes.match(chunks)) * TOKENS_PER_CHUNK,
            counted=warm >= need,
            load=load,
            over_bound=load > bound,
            index_chunks=len(e.prefixes),
            index_capacity=e.prefixes.capacity,
            capacity_source=e.prefixes.source,
        )
        for e, load in zip(cands, loads, strict=True)
    ]
    chosen = warm_pick(cands, chunks, cfg) if len(cands) > 1 else None
    if chosen is not None:
        return rows, chosen.id, "warm"
    return rows, None, "over_bound" if any(r.counted for r in rows) else "cold"
