"""The fake upstream's configuration and the ``X-Fake-Behavior`` header: ``FakeConfig`` (what ``--name``,
``--tokens``, … set), ``Behavior`` and ``parse_behavior`` (the per-request failure directives), and the small
constants and literal types the other fake-upstream modules share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

BEHAVIOR_HEADER = "x-fake-behavior"


Outcome = Literal["completed", "aborted", "broken", "error"]
Kind = Literal["chat", "completion", "embedding"]


@dataclass
class FakeConfig:
    models: list[str] = field(default_factory=lambda: ["meta-llama/Llama-3.3-70B-Instruct"])
    name: str = "fake"
    tokens: int = 16
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    embeddings: bool = False
    api_key: str | None = None
    spec_metrics: bool = False

    @property
    def fingerprint(self) -> str:
        return f"fake-{self.name}"


# --------------------------------------------------------------------------------------------------------------
# X-Fake-Behavior


@dataclass(frozen=True, slots=True)
class Behavior:
    status: int | None = None
    break_after: int | None = None
    error_event_after: int | None = None
    tokens: int | None = None
    token_delay: float | None = None
    first_token_delay: float | None = None
    hang: bool = False


def _non_negative_int(key: str, value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"{key} must be >= 0")
    return n


def _non_negative_float(key: str, value: str) -> float:
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{key} must be a finite number >= 0")
    return x


def parse_behavior(header: str | None) -> Behavior:
    """Parse ``X-Fake-Behavior``. Raises ValueError on an unknown directive or a bad value (a typo in a test
    should fail loudly, not silently do nothing)."""
    if header is None or not header.strip():
        return Behavior()
    fields: dict[str, Any] = {}
    for raw in header.split(","):
        part = raw.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        try:
            if key == "hang":
                fields["hang"] = not sep or value.lower() not in ("0", "false", "no", "")
            elif key == "status":
                code = int(value)
                if not 400 <= code <= 599:
                    raise ValueError("status must be 400..599")
                fields["status"] = code
            elif key in ("break_after", "error_event_after", "tokens"):
                fields[key] = _non_negative_int(key, value)
            elif key in ("token_delay", "first_token_delay"):
                fields[key] = _non_negative_float(key, value)
            else:
                raise ValueError("unknown directive")
        except ValueError as exc:
            raise ValueError(f"bad {BEHAVIOR_HEADER} directive {part!r}: {exc}") from None
    return Behavior(**fields)
