"""One on-call override (``Override``): a pool or endpoint weight, a drain or a forced class route, with a TTL,
a reason and an actor; its JSON form is the admin API's override object and what the override store holds
(``Override.from_dict`` checks what is read back). One override per kind and target (``Override.key``) is active.

``effective_weight`` is the precedence of an endpoint's weight: a drain of its pool makes it 0; else its
``endpoint_weight`` override; else its pool's ``pool_weight`` override; else the YAML weight. ``unknown_target``
tells an override whose pool, endpoint or class the config does not have.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import orjson

from gateway.admin.protocol import MAX_REASON
from gateway.config.schema import RoutingRules
from gateway.fleet.pools import PoolState
from gateway.overrides.model import MAX_WEIGHT

MAX_NAME = 256  # characters of an override's id, pool, endpoint, class or actor read back from the store
Kind = Literal["pool_weight", "endpoint_weight", "drain", "class_route"]
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclass(frozen=True, slots=True)
class Override:
    """One on-call change; its JSON form (``as_dict``) is the admin API's override object."""

    id: str
    kind: Kind
    pool: str | None
    endpoint: str | None
    class_name: str | None
    value: float | str | None  # weight (weights), "speculative"/"standard" (class_route), None (drain)
    reason: str
    actor: str
    created_at: float  # epoch seconds
    expires_at: float | None  # epoch seconds; None: until removed

    @classmethod
    def create(
        cls,
        kind: Kind,
        *,
        pool: str | None = None,
        endpoint: str | None = None,
        class_name: str | None = None,
        value: float | str | None = None,
        reason: str,
        actor: str,
        ttl_s: float | None,
        now: float | None = None,
    ) -> Override:
        at = time.time() if now is None else now
        expires = None if ttl_s is None else at + ttl_s
        return cls(f"ovr_{secrets.token_hex(6)}", kind, pool, endpoint, class_name, value, reason, actor, at, expires)

    @property
    def key(self) -> str:
        """The target key: one active override per key."""
        return f"{self.kind}|{self.pool or ''}|{self.endpoint or ''}|{self.class_name or ''}"

    @property
    def target(self) -> str:
        if self.class_name is not None:
            return f"class/{self.class_name}"
        if self.endpoint is not None:
            return f"pool/{self.pool}/endpoint/{self.endpoint}"
        return f"pool/{self.pool}"

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "pool": self.pool,
            "endpoint": self.endpoint,
            "class": self.class_name,
            "value": self.value,
            "reason": self.reason,
            "actor": self.actor,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.as_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Override:
        """An override as ``as_dict`` wrote it; ValueError for anything else (what the store holds is checked: the
        kind, the value's type and range, the names' types and lengths, finite times)."""
        kind = d["kind"]
        if kind not in KINDS:
            raise ValueError(f"unknown override kind {str(kind)[:40]!r}")
        value = d.get("value")
        if kind == "class_route" and value not in ("speculative", "standard"):
            raise ValueError(f"class_route value must be speculative or standard, got {str(value)[:40]!r}")
        if kind in ("pool_weight", "endpoint_weight") and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_WEIGHT
        ):
            raise ValueError(f"weight must be a number from 0 to {MAX_WEIGHT:g}, got {str(value)[:40]!r}")
        if kind == "drain" and value is not None:
            raise ValueError("a drain has no value")
        names = {k: d.get(k) for k in ("id", "pool", "endpoint", "class", "actor")}
        for k, v in names.items():
            if not (v is None or isinstance(v, str)) or len(v or "") > MAX_NAME:
                raise ValueError(f"{k!r} must be a string of at most {MAX_NAME} characters")
        reason = d.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise ValueError(f"'reason' must be a string of at most {MAX_REASON} characters")
        created, expires = d["created_at"], d.get("expires_at")
        for t in (created, expires):
            if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t)):
                raise ValueError("created_at and expires_at must be finite numbers")
        if not isinstance(names["id"], str) or created is None:
            raise ValueError("an override needs an id and created_at")
        return cls(
            id=names["id"],
            kind=kind,
            pool=names["pool"],
            endpoint=names["endpoint"],
            class_name=names["class"],
            value=float(value) if isinstance(value, int | float) else value,
            reason=reason,
            actor=names["actor"] or "",
            created_at=float(created),
            expires_at=None if expires is None else float(expires),
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> Override:
        d = orjson.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("an override must be a JSON object")
        return cls.from_dict(d)


# -- effective weights (pure) ----------------------------------------------------------------------------------


def effective_weight(pool: str, endpoint: str, configured: float, active: Mapping[str, Override]) -> float:
    """The endpoint's weight under the active overrides (by key): drain > endpoint_weight > pool_weight > YAML."""
    if f"drain|{pool}||" in active:
        return 0.0
    for key in (f"endpoint_weight|{pool}|{endpoint}|", f"pool_weight|{pool}||"):
        o = active.get(key)
        if o is not None and isinstance(o.value, float):
            return o.value
    return configured


def unknown_target(o: Override, pools: Mapping[str, PoolState], rules: RoutingRules) -> bool:
    """True when the override names a pool, endpoint or class the config does not have."""
    if o.class_name is not None:
        return all(c.name != o.class_name for c in rules.classes)
    pool = pools.get(o.pool or "")
    if pool is None:
        return True
    return o.endpoint is not None and all(e.id != o.endpoint for e in pool.endpoints)
