"""The fleet snapshot the leader publishes and every other replica routes on: plain JSON-able data.

What it carries: per endpoint (``pool/id``) its health, last error and ejection (as the time left, since monotonic
clocks differ between hosts); per pool the scraped load view; per controlled class its route state and share.
``build`` reads it off the leader's structures; ``apply_endpoints`` / ``load_views`` / ``class_shares`` turn it
back into what a follower's structures hold (``class_controllers``: the leader's controller snapshots, shown by
a follower's admin API). Endpoints, pools and classes a replica does not have (a rollout
with another config) are skipped, and the ones it has that the snapshot lacks keep their own state.

What Redis holds is checked, not trusted (anyone who can write to it could publish a snapshot): a snapshot larger
than ``MAX_SNAPSHOT_BYTES`` is not read; an ejection is taken for at most the YAML's
``outlier_detection.max_ejection_s`` (a longer one is cut and reported); at most
``outlier_detection.max_ejection_percent`` of a pool's endpoints (at least one) are ejected at once, and never the
last routable endpoint of a model; a scraped queue counts as fresh for at most ``max_fresh_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.vllm_metrics import Acceptance, PoolLoadView
from gateway.routing.attempts import would_strand
from gateway.routing.controller_rules import ControllerState

VERSION = 1
MAX_SNAPSHOT_BYTES = 4 * 1024 * 1024  # a snapshot read from Redis larger than this is ignored (and counted)
_STATES: frozenset[str] = frozenset({"speculative", "split", "standard"})


def build(
    *,
    leader: str,
    seq: int,
    at: float,
    now: float,
    config: str,
    pools: Iterable[PoolState],
    views: Mapping[str, PoolLoadView],
    classes: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The snapshot as a dict. ``at``: wall-clock time (seconds since the epoch) it was taken; ``now``: the
    leader's monotonic clock, to turn ejection deadlines into time left."""
    endpoints: dict[str, Any] = {}
    for pool in pools:
        for e in pool.endpoints:
            endpoints[f"{pool.name}/{e.id}"] = {
                "healthy": e.healthy,
                "error": e.last_error,
                "ejected": e.ejected,
                "ejected_for_s": max(0.0, e.ejected_until - now) if e.ejected else 0.0,
                # the scraped queue, for overload's busy test on every replica (time left, as for ejections)
                "waiting": e.queue_waiting,
                "queue_fresh_for_s": max(0.0, e.queue_fresh_until - now),
            }
    return {
        "v": VERSION,
        "leader": leader,
        "seq": seq,
        "at": at,
        "config": config,
        "endpoints": endpoints,
        "pools": {name: _view_dict(v) for name, v in views.items()},
        "classes": {
            name: {"state": c["state"], "share": c["share"], "controller": c}
            for name, c in classes.items()
            if c.get("state") in _STATES and isinstance(c.get("share"), int | float)
        },
    }


def _view_dict(v: PoolLoadView) -> dict[str, Any]:
    d = asdict(v)
    for key, value in list(d.items()):  # NaN is not JSON: unknown is null
        if isinstance(value, float) and not math.isfinite(value):
            d[key] = None
    return d


def may_eject(e: EndpointState, pool: PoolState, pools: Iterable[PoolState], max_percent: float) -> bool:
    """Whether ``e`` may be ejected on another replica's word: its pool has fewer than ``max_percent`` of its
    endpoints (at least one) ejected, and no model would be left without a routable endpoint."""
    allowed = max(1, math.floor(len(pool.endpoints) * max_percent / 100.0 + 1e-9))
    if sum(1 for x in pool.endpoints if x.ejected) >= allowed:
        return False
    return not would_strand(e, pools)


def apply_endpoints(
    snapshot: Mapping[str, Any],
    pools: Iterable[PoolState],
    now: float,
    *,
    max_ejection_s: float = 300.0,
    max_ejection_percent: float = 50.0,
    max_fresh_s: float = 60.0,
    suspect: list[str] | None = None,
) -> list[EndpointState]:
    """Set health, ejection and scraped queue of the endpoints the snapshot knows; returns those whose health
    changed. An ejection this replica has and the snapshot lacks is kept until it ends (the leader ends an ejection
    only once its time is over, so the two agree within the lag), so a follower's own ejection is not lost to the
    next snapshot. The bounds of the module docstring apply; what was cut is described in ``suspect``."""
    known = snapshot.get("endpoints")
    if not isinstance(known, dict):
        return []
    pools = list(pools)
    changed: list[EndpointState] = []
    for pool in pools:
        for e in pool.endpoints:
            s = known.get(f"{pool.name}/{e.id}")
            if not isinstance(s, dict):
                continue
            healthy = bool(s.get("healthy"))
            if healthy != e.healthy:
                changed.append(e)
            e.healthy = healthy
            error = s.get("error")
            e.last_error = error if isinstance(error, str) else None
            if s.get("ejected") is True:
                left = max(0.0, _num(s.get("ejected_for_s")) or 0.0)
                if left > max_ejection_s and suspect is not None:
                    suspect.append(f"{pool.name}/{e.id} ejected for {left:.3g}s, cut to {max_ejection_s:g}s")
                until = now + min(left, max_ejection_s)
                if e.ejected:
                    e.ejected_until = max(until, e.ejected_until)
                elif may_eject(e, pool, pools, max_ejection_percent):
                    e.ejected, e.ejected_until = True, until
            elif not (e.ejected and now < e.ejected_until):
                e.ejected, e.ejected_until, e.ejected_here = False, 0.0, False
            waiting, fresh = _num(s.get("waiting")), _num(s.get("queue_fresh_for_s"))
            if waiting is not None and fresh is not None and waiting >= 0:
                e.note_queue(waiting, now + min(max(fresh, 0.0), max_fresh_s))
    return changed


def load_views(snapshot: Mapping[str, Any]) -> dict[str, PoolLoadView]:
    """The leader's pool views; a malformed entry is left out (that pool reads as unknown, never as 0)."""
    out: dict[str, PoolLoadView] = {}
    pools = snapshot.get("pools")
    if not isinstance(pools, dict):
        return out
    for name, d in pools.items():
        try:
            acc = d.get("acceptance")
            acceptance = None
            if isinstance(acc, dict):
                acceptance = Acceptance(
                    rate=float(acc["rate"]),
                    mean_length=float(acc["mean_length"]),
                    per_position=tuple(float(x) for x in acc.get("per_position", ())),
                    drafts=float(acc["drafts"]),
                )
            out[name] = PoolLoadView(
                pool=str(name),
                endpoints=int(d["endpoints"]),
                fresh_endpoints=int(d["fresh_endpoints"]),
                running=_num(d.get("running")),
                waiting=_num(d.get("waiting")),
                kv_usage=_num(d.get("kv_usage")),
                acceptance=acceptance,
                tpot_mean_s=_num(d.get("tpot_mean_s")),
                generation_tokens_per_s=_num(d.get("generation_tokens_per_s")),
                output_tokens_mean=_num(d.get("output_tokens_mean")),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def class_shares(snapshot: Mapping[str, Any]) -> dict[str, tuple[ControllerState, float]]:
    """Each controlled class's (route state, speculative share) as the leader's controller has it."""
    out: dict[str, tuple[ControllerState, float]] = {}
    classes = snapshot.get("classes")
    if not isinstance(classes, dict):
        return out
    for name, c in classes.items():
        if not isinstance(c, dict):
            continue
        state, share = c.get("state"), c.get("share")
        if state in _STATES and isinstance(share, int | float) and 0.0 <= share <= 1.0:
            out[str(name)] = (state, float(share))
    return out


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def class_controllers(snapshot: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each controlled class's controller snapshot as the leader has it (what /admin/state and explain show)."""
    classes = snapshot.get("classes")
    if not isinstance(classes, dict):
        return {}
    return {
        str(name): dict(c["controller"])
        for name, c in classes.items()
        if isinstance(c, dict) and isinstance(c.get("controller"), dict)
    }
