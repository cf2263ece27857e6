"""The warm home: a conversation whose prompt prefix is warm on one of its class's two pools goes there first. Pure.

A class controller sends each request of its class to one of two pools (its home, or the other one by load). A
conversation whose class changes between turns (a tool call at temperature 0, then a chat turn at 0.8) would land
on the other pool on the turn that changed class, and that pool's prefix cache does not hold the conversation:
every token of it is prefilled again. So, per request: when the longest warm prefix of the prompt on the other pool
of the plan (the ``warmth`` the fleet computed: the longest start of this prompt held by a routable endpoint's index,
at least the pool's ``min_prefix_tokens``, else 0) is longer than on the pool the controller drew, that pool is the
request's home, its *warm home*: it goes first (route reason ``warm:<kind>``), the drawn pool second.

The warm home loses, and the controller's draw stands, when:

- ``not_eligible``: the draw is not the controller's load decision or its safe state (a probe, the guard, an
  on-call force: those put the class where they do on purpose), or the request does not continue a conversation
  (a new conversation goes by its class: a shared system prompt warm on one pool must not pull every new
  conversation there). A class held at its safe state because its measurements are stale is eligible: the checks
  below use the gateway's own in-flight counts, not the scrapes;
- ``cold``: no pool holds a counted prefix; ``not_longer``: the drawn pool holds at least as long a prefix;
- ``full``: the warm pool is away from the class's home and has as many requests in flight per endpoint as its own
  classes take (``ownership.full_for_visitors``: a visitor never pushes a pool's home classes off it);
- ``saturated``: the warm pool is the class's home and over its in-flight limit with the other pool less loaded
  (``ownership.should_spill``: the spill applies as for any request at home).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.config.schema import Route
from gateway.routing.ownership import PoolLoad, full_for_visitors, should_spill

WarmVerdict = Literal["won", "not_eligible", "cold", "not_longer", "full", "saturated"]


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class WarmHome:
    """The warm-home decision of one request: the pool it would go to (None: no pool is warm), that pool's warm
    prefix and the drawn pool's (approximate tokens), and the verdict (``won``: it goes first)."""

    pool: str | None
    warm_tokens: int
    drawn_pool: str
    drawn_tokens: int
    verdict: WarmVerdict

    @property
    def won(self) -> bool:
        return self.verdict == "won"


def warm_home(
    route: Route,
    drawn: str,
    other: str,
    warmth: Mapping[str, int],
    pools: Mapping[str, PoolLoad],
    *,
    eligible: bool,
    away_limit: int | None,
    speeds: Mapping[str, float] | None = None,
) -> WarmHome:
    """Whether the request goes to ``other`` (the plan's other controller pool) instead of ``drawn`` (the pool the
    controller drew) because its prefix is warmer there. ``warmth``: pool → counted warm tokens (0 or absent:
    cold). ``away_limit``: the visitor limit of the class's pool away from home (``ownership.visitor_limit``)."""
    here, there = warmth.get(drawn, 0), warmth.get(other, 0)

    def verdict(v: WarmVerdict) -> WarmHome:
        return WarmHome(other if there > 0 else None, there, drawn, here, v)

    if not eligible:
        return verdict("not_eligible")
    if there <= 0:
        return verdict("cold")
    if there <= here:
        return verdict("not_longer")
    if other == route.preferred:
        saturated = pools.get(route.saturated) if route.saturated is not None else None
        home = pools.get(other)
        if home is not None and should_spill(route, home, saturated, speeds):
            return verdict("saturated")
    elif full_for_visitors(pools.get(other), away_limit):
        return verdict("full")
    return verdict("won")
