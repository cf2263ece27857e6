"""The audit log: every change to how the gateway routes (a controller transition, an admin action), with why.

``AuditLog`` keeps the latest records in memory (a bounded deque, oldest dropped first) for ``GET /admin/audit``
and logs each one as a JSON line on the ``specgate.audit`` logger (``"event": "audit"``), so a log pipeline keeps
the full history. Not thread-safe: the event loop owns it. With several workers each process has its own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.observability.logs import log_event

logger = logging.getLogger("specgate.audit")

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One change: who did what to which object, and why."""

    at: float  # wall-clock epoch seconds (``time.time()``)
    actor: str  # "controller", "admin", ...
    action: str  # "controller_transition", ...
    target: str  # "class/precise", "pool/spec/endpoint/spec-0", ...
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def now(
        cls, actor: str, action: str, target: str, reason: str, detail: dict[str, Any] | None = None
    ) -> AuditRecord:
        return cls(time.time(), actor, action, target, reason, dict(detail or {}))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class AuditLog:
    """The latest ``capacity`` records, oldest first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._records: deque[AuditRecord] = deque(maxlen=capacity)
        self.total = 0  # records ever appended (the deque keeps the latest ``capacity``)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def capacity(self) -> int:
        cap = self._records.maxlen
        assert cap is not None
        return cap

    def append(self, record: AuditRecord) -> None:
        self._records.append(record)
        self.total += 1
        log_event(logger, "audit", record.as_dict())

    def records(self, limit: int = 100, since: float | None = None) -> list[AuditRecord]:
        """The newest ``limit`` records (after ``since``, epoch seconds, when given), oldest first."""
        if limit <= 0:
            return []
        out: list[AuditRecord] = []
        for rec in reversed(self._records):
            if since is not None and rec.at <= since:
                continue  # not ``break``: the wall clock can step back
            out.append(rec)
            if len(out) >= limit:
                break
        out.reverse()
        return out
