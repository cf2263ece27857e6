"""Validating what an operator sends for an override (the admin routes' input): ``parse_ttl`` (seconds, a
duration like "30m", or "never"), ``parse_reason`` and ``parse_weight``, each raising ``InvalidParameter``
that names the parameter, and their limits (``MAX_REASON``, ``MAX_WEIGHT``).
"""

from __future__ import annotations

import math
import re
from types import MappingProxyType

from gateway.admin.protocol import MAX_REASON
from gateway.errors import InvalidParameter

_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = MappingProxyType({"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0})


# -- input parsing (the admin routes' validation; every error names its parameter) ------------------------------


def parse_ttl(raw: object, *, default_s: float, max_s: float) -> float | None:
    """Seconds (a number, or "90s" / "30m" / "2h" / "1d"); "never": until removed (None); missing: ``default_s``."""
    if raw is None:
        return default_s
    seconds: float
    if isinstance(raw, str) and raw.strip().lower() == "never":
        return None
    if isinstance(raw, bool):
        raise InvalidParameter("'ttl' must be seconds or a duration like '30m', not a boolean", param="ttl")
    if isinstance(raw, int | float):
        seconds = float(raw)
    elif isinstance(raw, str) and (m := _TTL.match(raw.lower())) is not None:
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        message = f"'ttl' must be seconds or a duration like '90s', '30m', '2h', '1d', or 'never'; got {raw!r}"
        raise InvalidParameter(message, param="ttl")
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidParameter(f"'ttl' must be more than 0 seconds, got {raw!r}", param="ttl")
    if seconds > max_s:
        message = f"'ttl' is at most {max_s:g}s (admin.max_ttl_s); send 'never' to keep it until removed"
        raise InvalidParameter(message, param="ttl")
    return seconds


def parse_reason(raw: object) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidParameter("'reason' is required: say why (a ticket, an incident, a sentence)", param="reason")
    if len(raw) > MAX_REASON:
        raise InvalidParameter(f"'reason' is at most {MAX_REASON} characters, got {len(raw)}", param="reason")
    return raw.strip()


MAX_WEIGHT = 1e6  # weights are relative; a huge one would make the pick's weight total overflow to inf


def parse_weight(raw: object) -> float:
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int | float)
        or not math.isfinite(raw)
        or not 0 <= raw <= MAX_WEIGHT
    ):
        raise InvalidParameter(
            f"'weight' must be a number from 0 to {MAX_WEIGHT:g} (0: no new requests), got {raw!r}", param="weight"
        )
    return float(raw)
