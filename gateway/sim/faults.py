"""Fault injection for the simulator: what is injected (``Faults``, immutable, from flags or JSON) and the live
state of one server (``FaultState``: the current faults, the random draws, the timer of a temporary refusal).

Faults and what they do (all off by default)::

    error_rate=0.1, error_status=503   that fraction of generation requests is answered at once with that status
                                       and vLLM's error envelope (never reaches the engine)
    hang_s=2.0                         wait that many (wall) seconds before the request reaches the engine and
                                       before anything is sent; hang=true waits until the client goes away
    hang_rate=1.0                      the fraction of requests that hang
    cut_after=3                        stream: after 3 token chunks the TCP connection is closed mid-body (no
                                       [DONE]); non-stream: closed without any response after 3 engine steps
    cut_rate=1.0                       the fraction of requests that are cut
    error_after=3                      stream: after 3 token chunks ``data: {"error": …}`` then ``[DONE]`` (how
                                       vLLM reports a failure mid-stream); non-stream: a 500 envelope after 3 steps
    slow_chunk_s=0.05                  extra (wall) seconds before each chunk (each engine step, non-stream too)
    refuse_connections=true            the server stops listening (connection refused) and closes idle
                                       keep-alive connections; in-flight requests finish. false listens again.
    refuse_for_s=1.0                   with refuse_connections: listen again after that many seconds (the
                                       control API is unreachable while refusing)
    metrics="malformed" | "missing"    /metrics answers unparsable text, or 404
    health_status=503                  /health (and /ping) answer that status

Runtime: ``GET /sim/faults``, ``PUT /sim/faults`` with any subset of the fields (merged into the current
faults), ``POST /sim/faults/reset`` (everything off); in process, ``server.SimServer.update_faults(patch)`` from
another thread (it works while the server refuses connections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, Literal, Protocol

MetricsMode = Literal["ok", "malformed", "missing"]
METRICS_MODES: tuple[MetricsMode, ...] = ("ok", "malformed", "missing")

MALFORMED_METRICS = (
    b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{engine="0",model_name="\n'
    b"this is not the prometheus text format {{{\n"
)


def _rate(name: str, value: Any) -> float:
    x = _number(name, value)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be between 0 and 1")
    return x


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number")
    return float(value)


def _seconds(name: str, value: Any) -> float:
    x = _number(name, value)
    if x < 0:
        raise ValueError(f"{name} must be >= 0")
    return x


def _status(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599:
        raise ValueError(f"{name} must be an HTTP status (100..599)")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false")
    return value


@dataclass(frozen=True, slots=True)
class Faults:
    error_rate: float = 0.0
    error_status: int = 500
    hang: bool = False
    hang_s: float = 0.0
    hang_rate: float = 1.0
    cut_after: int | None = None
    cut_rate: float = 1.0
    error_after: int | None = None
    slow_chunk_s: float = 0.0
    refuse_connections: bool = False
    refuse_for_s: float | None = None
    metrics: MetricsMode = "ok"
    health_status: int = 200

    def __post_init__(self) -> None:
        _rate("error_rate", self.error_rate)
        if not 400 <= _status("error_status", self.error_status) <= 599:
            raise ValueError("error_status must be 400..599")
        _flag("hang", self.hang)
        _seconds("hang_s", self.hang_s)
        _rate("hang_rate", self.hang_rate)
        _rate("cut_rate", self.cut_rate)
        for name in ("cut_after", "error_after"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or null")
        _seconds("slow_chunk_s", self.slow_chunk_s)
        _flag("refuse_connections", self.refuse_connections)
        if self.refuse_for_s is not None:
            _seconds("refuse_for_s", self.refuse_for_s)
        if self.metrics not in METRICS_MODES:
            raise ValueError(f"metrics must be one of {', '.join(METRICS_MODES)}")
        _status("health_status", self.health_status)

    @classmethod
    def from_json(cls, data: Any) -> Faults:
        """Faults from a JSON object (every field optional). Raises ValueError on an unknown field or bad value."""
        return cls().merged(data)

    def merged(self, patch: Any) -> Faults:
        """These faults with the fields of a JSON object replaced. Raises ValueError."""
        if not isinstance(patch, dict):
            raise ValueError("faults must be a JSON object")
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(patch) - known)
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        try:
            return dataclasses.replace(self, **patch)
        except TypeError as exc:  # pragma: no cover - names are checked above
            raise ValueError(str(exc)) from None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def active(self) -> bool:
        return self != Faults()


@dataclass(frozen=True, slots=True)
class RequestFaults:
    """What happens to one generation request, drawn at admission."""

    error_status: int | None = None
    hang_s: float = 0.0
    hang_forever: bool = False
    cut_after: int | None = None
    error_after: int | None = None
    slow_chunk_s: float = 0.0


class ListenerControl(Protocol):
    """What owns the listening socket (``server.SimServer``): stop listening (refuse) or listen again."""

    async def set_listening(self, listening: bool) -> None: ...


class FaultState:
    """The faults in force on one server, the random draws that apply them to requests, and the listening
    socket's state (through a ``ListenerControl``, when the server provides one)."""

    def __init__(self, faults: Faults | None = None, *, seed: int = 0) -> None:
        self.faults = faults if faults is not None else Faults()
        self.listener: ListenerControl | None = None
        self.listening = True
        self._rng = random.Random(seed ^ 0xFA17)
        self._timer: asyncio.Task[None] | None = None
        self.injected_errors = 0
        self.hangs = 0
        self.cuts = 0

    async def apply(self, faults: Faults) -> Faults:
        """Make ``faults`` current; stop or resume listening as ``refuse_connections`` asks (and listen again
        after ``refuse_for_s``). Raises ValueError when refusing is asked of a server that cannot."""
        if faults.refuse_connections and self.listener is None:
            raise ValueError("refuse_connections needs the simulator's own server (specgate sim / SimServer)")
        self.faults = faults
        self.close()
        await self._sync_listening()
        if faults.refuse_connections and faults.refuse_for_s is not None:
            self._timer = asyncio.create_task(self._listen_again_after(faults.refuse_for_s))
        return faults

    async def _sync_listening(self) -> None:
        want = not self.faults.refuse_connections
        if self.listener is not None and want != self.listening:
            await self.listener.set_listening(want)
            self.listening = want

    async def _listen_again_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._timer = None
        self.faults = dataclasses.replace(self.faults, refuse_connections=False, refuse_for_s=None)
        await self._sync_listening()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def draw(self) -> RequestFaults:
        f = self.faults
        if not (
            f.error_rate or f.hang or f.hang_s or f.cut_after is not None or f.error_after is not None or f.slow_chunk_s
        ):
            return _NO_FAULTS
        rng = self._rng
        if f.error_rate and rng.random() < f.error_rate:
            self.injected_errors += 1
            return RequestFaults(error_status=f.error_status)
        hang = (f.hang or f.hang_s > 0) and rng.random() < f.hang_rate
        cut = f.cut_after is not None and rng.random() < f.cut_rate
        self.hangs += hang
        self.cuts += cut
        return RequestFaults(
            hang_s=f.hang_s if hang else 0.0,
            hang_forever=hang and f.hang,
            cut_after=f.cut_after if cut else None,
            error_after=f.error_after,
            slow_chunk_s=f.slow_chunk_s,
        )

    def stats(self) -> dict[str, Any]:
        return {
            "injected_errors": self.injected_errors,
            "hangs": self.hangs,
            "cuts": self.cuts,
            "listening": self.listening,
        }


_NO_FAULTS = RequestFaults()


def parse_metrics_mode(value: str) -> MetricsMode:
    if value not in METRICS_MODES:
        raise ValueError(f"metrics fault must be one of {', '.join(METRICS_MODES)}")
    return value
