"""Which classes go first on a speculative pool: the ones that gain most there.

Each class's controller compares its own costs on the two pools (``gateway.routing.estimate``). Left alone, two
classes can swap places under load: the standard pool queues, so a low-acceptance class (open chat) finds the
speculative pool cheaper and moves a share there; the speculative pool's batch grows, so a high-acceptance class
(JSON, code) finds the standard pool cheaper and spills a share there. Each step is right for the class that takes
it and the pair is wrong for all: the speculative pool now serves the traffic it speeds up least, and the
traffic it speeds up most waits on the standard pool.

So the speculative pool is filled in order of acceptance, as the best fixed splits fill it: a class is
*outranked* on its speculative pool while a speculative-home class there with a clearly higher acceptance rate
(``MARGIN``) is off it by more than ``MIN_OFF`` of its requests and decides by load (its guard not tripped, not
forced, enough samples). An outranked class takes no share onto that pool and hands back what it has there first
(``Controller``); once the better class is back, the others may follow it again.

Pure: standings in, a mapping out (``standing_of`` reads one from a class's controller and last estimate).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config.schema import PoolKind
from gateway.routing.controller import LOAD_REASONS, Controller
from gateway.routing.estimate import Estimate

MARGIN = 0.1  # acceptance rates closer than this are not ordered: one noisy window must not reorder classes
# A share this close to home is the balance steps' noise (they go down to an eighth of share_step), not a class
# pushed off the pool: it does not make the others yield.
MIN_OFF = 0.1


@dataclass(frozen=True, slots=True)
class Standing:
    """One controlled class as the order sees it (from its last round)."""

    name: str
    spec_pool: str
    rate: float | None  # the acceptance rate of its estimate there (measured, last measured or prior)
    share: float  # on the speculative pool
    home: PoolKind
    deciding: bool  # its own load decisions move it: not forced, guard neither tripped nor locked, enough samples


def outranked(standings: Iterable[Standing]) -> dict[str, str]:
    """Class -> the class with the highest rate that outranks it on its speculative pool (absent: none does)."""
    items = list(standings)
    out: dict[str, str] = {}
    for c in items:
        if c.rate is None:
            continue
        best: Standing | None = None
        for h in items:
            if (
                h.name == c.name
                or h.spec_pool != c.spec_pool
                or h.home != "speculative"
                or not h.deciding
                or h.share > 1.0 - MIN_OFF - 1e-9  # off by more than MIN_OFF: a share of 0.9 is not
                or h.rate is None
                or h.rate < c.rate + MARGIN
            ):
                continue
            if best is None or (best.rate is not None and h.rate > best.rate):
                best = h
        if best is not None:
            out[c.name] = best.name
    return out


def standing_of(name: str, spec_pool: str, controller: Controller, spec_estimate: Estimate | None) -> Standing:
    """The class as the order sees it, from its controller's last round and its last speculative estimate: it
    decides by load unless forced, held by its guard, moved last by a safety move, stale or short of samples."""
    snap = controller.snapshot()
    obs = snap.last_observation
    deciding = (
        snap.forced_until is None
        and not snap.guard_tripped
        and not snap.locked
        and snap.last_reason in LOAD_REASONS
        and obs is not None
        and not obs.stale
        and obs.samples >= controller.config.min_samples
    )
    rate = None if spec_estimate is None else spec_estimate.acceptance
    return Standing(name, spec_pool, rate, controller.share, controller.home, deciding)
