"""The counts each replica shares with the others: what one replica writes (``Contribution``), the checks a
contribution read back must pass, and the sums of the others' contributions that the runtime applies.

Absolute values, not deltas: a lost write is corrected by the next, nothing drifts (``gateway.cluster.node`` writes
and reads them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

MAX_CONTRIBUTION_BYTES = 256 * 1024  # one replica's counts: a few hundred endpoints and classes
MAX_IN_FLIGHT = 1_000_000  # a replica's in-flight requests on one endpoint, past any real pool's connection cap
MAX_LEFT_S = 86_400.0  # a shared ejection's time left (the YAML's max_ejection_s caps it again when applied)


@dataclass(slots=True)
class Contribution:
    """What one replica last wrote: its wall-clock time, in-flight per ``pool/endpoint``, counts per class."""

    at: float
    in_flight: dict[str, int] = field(default_factory=dict)
    classes: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # requests, drafted, accepted
    ejected: dict[str, float] = field(default_factory=dict)  # its own passive ejections: seconds left

    def encode(self) -> bytes:
        """The field this replica writes in the hash of contributions."""
        return orjson.dumps(
            {"at": self.at, "in_flight": self.in_flight, "classes": self.classes, "ejected": self.ejected}
        )


def parse_contribution(raw: bytes | str) -> Contribution | None:
    """One replica's counts, or None when they are malformed, too large, or out of range (a count that would make
    the fleet look saturated, a negative or endless ejection)."""
    if len(raw) > MAX_CONTRIBUTION_BYTES:
        return None
    try:
        d = orjson.loads(raw)
        at = float(d["at"])
        in_flight = {str(k): int(v) for k, v in d.get("in_flight", {}).items() if int(v) > 0}
        classes = {str(k): (float(v[0]), float(v[1]), float(v[2])) for k, v in d.get("classes", {}).items()}
        ejected = {str(k): float(v) for k, v in d.get("ejected", {}).items() if float(v) > 0}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError):
        return None
    if not math.isfinite(at) or any(n > MAX_IN_FLIGHT for n in in_flight.values()):
        return None
    if any(not (math.isfinite(x) and x >= 0) for v in classes.values() for x in v):
        return None
    if any(not (math.isfinite(x) and x <= MAX_LEFT_S) for x in ejected.values()):
        return None
    return Contribution(at, in_flight, classes, ejected)


def in_flight_sum(others: Iterable[Contribution]) -> dict[str, int]:
    """The replicas' in-flight requests per ``pool/endpoint``, summed."""
    out: dict[str, int] = {}
    for c in others:
        for key, n in c.in_flight.items():
            out[key] = out.get(key, 0) + n
    return out


def longest_ejections(others: Iterable[Contribution]) -> dict[str, float]:
    """The replicas' own ejections per ``pool/endpoint``: the longest time left."""
    out: dict[str, float] = {}
    for c in others:
        for key, left in c.ejected.items():
            out[key] = max(left, out.get(key, 0.0))
    return out


def class_count_sum(others: Iterable[Contribution]) -> dict[str, tuple[float, float, float]]:
    """The replicas' cumulative (requests, draft tokens, accepted tokens) per class, summed."""
    out: dict[str, tuple[float, float, float]] = {}
    for c in others:
        for name, (r, d, a) in c.classes.items():
            r0, d0, a0 = out.get(name, (0.0, 0.0, 0.0))
            out[name] = (r0 + r, d0 + d, a0 + a)
    return out
