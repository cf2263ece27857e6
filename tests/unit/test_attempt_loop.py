"""The real attempt loop (``ProxyExchange``) against scripted in-process pools, over random fault sequences.

Every upstream attempt answers according to a script (one fault per attempt, in order); each byte an attempt
sends is tagged with the attempt's number, so the client's response shows which attempts it contains. Properties:
never more upstream requests than ``max_attempts`` (nor than the retry budget allows), never a byte from two
attempts in one response, nothing sent upstream after the commit point, exactly one response per request, and
the loop's bookkeeping (in-flight counts, budget) back at zero afterwards.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway.config.pool import Pool
from gateway.config.schema import Defaults, OutlierDetection
from gateway.config.schema import RetryBudget as RetryBudgetSpec
from gateway.errors import UpstreamConnectError, UpstreamTimeout, UpstreamUnreachable
from gateway.fleet.h1response import ConnectionBroken
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.upstream import UpstreamResponse
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.forward import ProxyExchange
from gateway.proxy.job import ProxyJob
from gateway.proxy.record import RequestRecord
from gateway.routing.attempts import AttemptPolicy
from gateway.routing.plan import Plan

# What one attempt does. Retryable before the commit point, then terminal (the client gets that attempt).
RETRYABLE = [
    "refused",
    "broken_before_headers",
    "timeout",
    "status_429",
    "status_500",
    "status_502",
    "status_503",
    "status_504",
    "status_401",
    "error_event_first",
    "closed_before_first",
    "not_sse",
    "hang",
]
TERMINAL = ["ok", "cut_after_1", "cut_after_3", "status_400", "status_404", "status_413", "status_422"]
FAULTS = RETRYABLE + TERMINAL
TAG = re.compile(rb'attempt(?:": ?|#)(\d+)')  # {"attempt": 2} in events and bodies, "attempt#2" in messages


class _Content:
    def __init__(self, parts: list[bytes | BaseException]) -> None:
        self._parts = parts

    async def iter_any(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            await asyncio.sleep(0)
            if isinstance(part, BaseException):
                raise part
            yield part


class FakeRaw:
    """A pool's response as the gateway reads it (``gateway.fleet.upstream.RawResponse``)."""

    def __init__(self, status: int, ctype: str, parts: list[bytes | BaseException]) -> None:
        self.status = status
        self.headers = CIMultiDict({"content-type": ctype})
        self.raw_headers = [(b"content-type", ctype.encode())]
        self.content = _Content(parts)
        self._parts = parts
        self.closed = False

    def iter_any(self) -> AsyncIterator[bytes]:
        return self.content.iter_any()

    async def read(self) -> bytes:
        out = b""
        for part in self._parts:
            if isinstance(part, BaseException):
                raise part
            out += part
        return out

    def release(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


def _event(attempt: int, k: int) -> bytes:
    return b"data: " + orjson.dumps({"attempt": attempt, "k": k, "choices": [{"delta": {"content": "x"}}]}) + b"\n\n"


@dataclass
class Script:
    faults: list[str]
    stream: bool
    posts: list[tuple[str, str]] = field(default_factory=list)  # (pool, endpoint) per upstream request
    responses: list[FakeRaw] = field(default_factory=list)

    def next(self, pool: str, ep: EndpointState) -> tuple[int, str]:
        n = len(self.posts)
        self.posts.append((pool, ep.id))
        return n, self.faults[n] if n < len(self.faults) else "ok"


class FakeClient:
    api_key = None
    first_byte_s = 5.0

    def __init__(self, pool: str, script: Script) -> None:
        self.pool = pool
        self.script = script

    async def post(
        self, ep: EndpointState, path: str, body: bytes, headers: dict[str, str], **kw: Any
    ) -> UpstreamResponse:
        n, fault = self.script.next(self.pool, ep)
        stream = self.script.stream
        if fault == "refused":
            raise UpstreamUnreachable(f"cannot reach {ep.id}")
        if fault == "broken_before_headers":
            raise UpstreamConnectError(f"{ep.id} failed before the response")
        if fault == "timeout" or (fault == "hang" and not stream):
            raise UpstreamTimeout(f"no response from {ep.id} within the total timeout")
        if fault == "hang":
            await asyncio.sleep(30)  # the class's TTFT deadline (0.05 s) ends the attempt
        parts: list[bytes | BaseException]
        if fault.startswith("status_"):
            status = int(fault.split("_")[1])
            body = orjson.dumps({"error": {"message": f"attempt#{n}", "code": status}})
            raw = FakeRaw(status, "application/json", [body])
        elif not stream:
            if fault.startswith("cut_after") or fault in ("error_event_first", "closed_before_first"):
                raw = FakeRaw(200, "application/json", [ConnectionBroken("cut")])
            else:  # ok, not_sse
                raw = FakeRaw(200, "application/json", [orjson.dumps({"attempt": n, "choices": []})])
        elif fault == "not_sse":
            raw = FakeRaw(200, "application/json", [orjson.dumps({"attempt": n})])
        elif fault == "error_event_first":
            raw = FakeRaw(200, "text/event-stream", [b'data: {"error": {"message": "boom"}}\n\n', b"data: [DONE]\n\n"])
        elif fault == "closed_before_first":
            raw = FakeRaw(200, "text/event-stream", [b""])
        elif fault.startswith("cut_after"):
            k = int(fault.rsplit("_", 1)[1])
            parts = [_event(n, j) for j in range(k)]
            raw = FakeRaw(200, "text/event-stream", [*parts, ConnectionBroken("cut")])
        else:  # ok
            parts = [_event(n, j) for j in range(3)]
            raw = FakeRaw(200, "text/event-stream", [*parts, b"data: [DONE]\n\n"])
        self.script.responses.append(raw)
        return UpstreamResponse(raw.status, raw)  # type: ignore[arg-type]


def _pools() -> dict[str, PoolState]:
    out = {}
    for name in ("a", "b", "c"):
        spec = Pool.model_validate(
            {
                "name": name,
                "kind": "standard",
                "models": ["m"],
                "endpoints": [{"url": f"http://{name}{i}:8000", "id": f"{name}{i}"} for i in range(2)],
            }
        )
        out[name] = PoolState.from_spec(spec)
    return out


@dataclass
class Outcome:
    status: int
    headers: dict[str, str]
    body: bytes
    messages: list[dict[str, Any]]


async def _run(
    faults: list[str], stream: bool, max_attempts: int, min_retries: int, consecutive: int
) -> tuple[Outcome, Script, dict[str, PoolState], AttemptPolicy]:
    script = Script(faults, stream)
    pools = _pools()
    clients = {name: FakeClient(name, script) for name in pools}
    metrics = GatewayMetrics()
    defaults = Defaults(
        retry_budget=RetryBudgetSpec(ratio=0.0, min_retries=min_retries),
        outlier_detection=OutlierDetection(consecutive_failures=consecutive, base_ejection_s=30, max_ejection_s=300),
    )
    policy = AttemptPolicy(lambda: defaults, metrics)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    job = ProxyJob(
        path="/v1/chat/completions",
        body=orjson.dumps(body),
        client_headers=[("content-type", "application/json")],
        stream=stream,
        plan=Plan(("a", "b", "c"), "preferred", ttft_deadline_s=0.05),
        max_attempts=max_attempts,
        record=RequestRecord("req-1", "/v1/chat/completions", traffic_class="default"),
        extra_headers=[],
        parsed=body if stream else None,
    )
    response = ProxyExchange(
        job,
        pools,
        clients,
        metrics,
        AccessLog(enabled=False),
        random.Random(0),
        policy,  # type: ignore[arg-type]
    )
    messages: list[dict[str, Any]] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await response({"type": "http"}, receive, send)  # type: ignore[arg-type]
    start = [m for m in messages if m["type"] == "http.response.start"]
    assert len(start) == 1, messages
    headers = {k.decode(): v.decode() for k, v in start[0]["headers"]}
    body_bytes = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return Outcome(start[0]["status"], headers, body_bytes, messages), script, pools, policy


def _terminal(fault: str, stream: bool) -> bool:
    """Whether the client gets this attempt's answer. Without a stream, nothing reaches the client before the
    whole body did, so a cut body is retried; an answer that is not SSE is what was asked for."""
    if stream:
        return fault in TERMINAL
    return fault in ("ok", "not_sse") or (fault in TERMINAL and fault.startswith("status_"))


def _expected_posts(faults: list[str], stream: bool, max_attempts: int, min_retries: int) -> int:
    """Attempts stop at the first terminal fault, at max_attempts, when the budget refuses, or out of endpoints."""
    limit = min(max_attempts, 1 + min_retries, 6)
    for i, fault in enumerate([*faults, "ok"][:limit]):
        if _terminal(fault, stream):
            return i + 1
    return limit


def _check(faults: list[str], stream: bool, max_attempts: int, min_retries: int, consecutive: int) -> None:
    out, script, pools, policy = asyncio.run(_run(faults, stream, max_attempts, min_retries, consecutive))
    posts = len(script.posts)

    # Never more upstream requests than max_attempts, nor than the budget allows; each endpoint at most once.
    assert posts <= max_attempts
    assert posts == _expected_posts(faults, stream, max_attempts, min_retries)
    assert len(set(script.posts)) == posts
    assert out.headers["x-specgate-attempts"] == str(posts)

    # Exactly one response, ended once; nothing after the last message.
    bodies = [m for m in out.messages if m["type"] == "http.response.body"]
    assert bodies
    assert not bodies[-1].get("more_body", False)
    assert all(m.get("more_body", False) for m in bodies[:-1])

    # Never a byte from two attempts, and the bytes the client got are from the last attempt sent upstream.
    tags = {int(t) for t in TAG.findall(out.body)}
    last = posts - 1
    fault = script.faults[last] if last < len(script.faults) else "ok"
    if _terminal(fault, stream):
        assert tags == {last}, (fault, out.body)
        if fault.startswith("status_"):
            assert out.status == int(fault.split("_")[1])  # 400/404/413/422 passed through
        elif stream:
            assert out.status == 200
            assert out.body.endswith(b"data: [DONE]\n\n")
            assert out.body.count(b"data: [DONE]") == 1
            if fault.startswith("cut_after"):  # after the commit: an explicit error, then [DONE]; no other pool
                assert b'data: {"error"' in out.body
        else:
            assert out.status == 200
            assert fault in ("ok", "not_sse")
    else:  # the gateway's own 503 (it names the attempts' errors, relays none of their bytes)
        assert out.status == 503
        err = orjson.loads(out.body)["error"]
        assert err["type"] == "service_unavailable"
        # Every attempt is listed by its pool and kind of failure ("pool: ...; ..."), never by endpoint or URL
        # (those are in the log line), and the message ends with the request id.
        listing = err["message"].split(": ", 1)[1].removesuffix(" (request id req-1)")
        assert len(listing.split("; ")) >= posts, err
        assert err["message"].endswith("(request id req-1)")
        assert not re.search(r"\b[abc][01]\b|http://", err["message"]), err
        assert out.headers["retry-after"]

    # Bookkeeping back at zero: endpoint in-flight counts, the budget, every upstream response closed.
    assert all(ep.in_flight == 0 for p in pools.values() for ep in p.endpoints)
    assert (policy.budget.active, policy.budget.retries) == (0, 0)
    assert all(r.closed for r in script.responses)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=7),
    stream=st.booleans(),
    max_attempts=st.integers(1, 6),
    min_retries=st.integers(0, 6),
    consecutive=st.integers(1, 5),
)
def test_random_fault_sequences(
    faults: list[str], stream: bool, max_attempts: int, min_retries: int, consecutive: int
) -> None:
    _check(faults, stream, max_attempts, min_retries, consecutive)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_then_ok(fault: str, stream: bool) -> None:
    _check([fault, "ok"], stream, max_attempts=3, min_retries=3, consecutive=5)


def test_a_retry_refused_by_the_budget_ends_with_the_last_error_and_a_metric() -> None:
    out, script, _, policy = asyncio.run(_run(["status_503", "ok"], True, 3, 0, 5))
    assert len(script.posts) == 1
    assert out.status == 503
    err = orjson.loads(out.body)["error"]
    assert err["code"] == "retry_budget_exhausted"
    assert "HTTP 503" in err["message"]
    value = policy.metrics.registry.get_sample_value(
        "specgate_upstream_attempts_total", {"pool": "b", "result": "budget_exhausted"}
    )
    assert value == 1


def test_attempt_and_fallback_metrics() -> None:
    out, _, _, policy = asyncio.run(_run(["status_429", "hang", "ok"], True, 3, 3, 5))
    assert out.status == 200
    reg = policy.metrics.registry

    def attempts(pool: str, result: str) -> float | None:
        return reg.get_sample_value("specgate_upstream_attempts_total", {"pool": pool, "result": result})

    assert attempts("a", "status_429") == 1
    assert attempts("b", "timeout") == 1
    assert attempts("c", "ok") == 1
    fallbacks = {
        (s.labels["from_pool"], s.labels["to_pool"], s.labels["reason"])
        for m in reg.collect()
        if m.name == "specgate_fallbacks"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert fallbacks == {("a", "b", "status_429"), ("b", "c", "timeout")}
