"""The fault matrix, end to end: the gateway (real uvicorn) in front of two simulated vLLM pools (real uvicorn, the
simulator's fault injection). The speculative pool is faulted, the standard pool is healthy; the request is a
low-temperature code request, so the class ``precise`` tries ``spec`` first and falls back to ``std``.

For each fault the client's outcome must be the expected one: before the commit point the request succeeds on the
other pool; after it the stream ends with an explicit error event and ``[DONE]``, never a second generation. Every
request gets exactly one terminal response (one HTTP response, one ``[DONE]``, one role chunk, one request in the
gateway's metrics), and the simulators' ``/sim/stats`` (generations per request id) prove that no request was
generated after its commit point: the pool that served it generated it once, and the other pool only for an
attempt that failed before the commit.

Run with ``-s`` to see the matrix (fault → client outcome, attempts, generations per pool); it is also written to
``fault_matrix.md`` in pytest's base temporary directory.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.sim.app import SimOptions
from gateway.sim.faults import Faults
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, SPEC_ONLY_MODEL, ServerThread, poll, rules_for

pytestmark = pytest.mark.integration

Gateway = Callable[..., ServerThread]
SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
CODE_REQ: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0.1,
    "messages": [{"role": "user", "content": "write a python function that adds two numbers"}],
}
TTFT_DEADLINE_S = 0.5
TOTAL_S = 1.5  # bounds a non-streaming attempt (it has no first token before it is done)


@dataclass
class Row:
    fault: str
    stream: bool
    outcome: str
    status: int
    attempts: str
    pool: str
    spec_generations: int
    std_generations: int

    def line(self) -> str:
        mode = "stream" if self.stream else "non-stream"
        return (
            f"| {self.fault} | {mode} | {self.status} {self.outcome} | {self.attempts} | {self.pool} | "
            f"{self.spec_generations} | {self.std_generations} |"
        )


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Row]]:
    rows: list[Row] = []
    yield rows
    lines = [
        "| fault (on spec) | mode | client outcome | attempts | served by | generations spec | generations std |",
        "|---|---|---|---|---|---|---|",
        *(r.line() for r in rows),
    ]
    text = "\n".join(lines)
    Path(tmp_path_factory.getbasetemp(), "fault_matrix.md").write_text(text + "\n")
    print("\n\nFAULT MATRIX\n" + text)


def start_sim(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "port": 0,
        "time_scale": 0.01,
        "output_lengths": OutputLengths(median=40, sigma=0),
        "seed": 1,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    spec = start_sim(speculative_config=SPEC, fixed_acceptance=0.6, served_model_names=(MODEL, SPEC_ONLY_MODEL))
    std = start_sim()
    yield spec, std
    spec.stop()
    std.stop()


@pytest.fixture
def faulty(sims: tuple[SimServer, SimServer]) -> Iterator[tuple[SimServer, SimServer]]:
    yield sims
    for sim in sims:
        sim.update_faults(Faults().to_json())


def matrix_rules(spec_url: str, std_url: str, **defaults: Any) -> dict[str, Any]:
    rules = rules_for([spec_url], [std_url])
    rules["defaults"].update(defaults)
    for pool in rules["pools"]:
        pool["timeouts"] = {"connect_s": 0.5, "first_byte_s": 1.0, "total_s": TOTAL_S}
    rules["classes"][0]["route"]["ttft_deadline_s"] = TTFT_DEADLINE_S
    return rules


def sim_stats(sim: SimServer) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(sim.url + "/sim/stats", timeout=5).json()
    return body


def generations(sim: SimServer, request_id: str) -> int:
    return int(sim_stats(sim)["generations"].get(request_id, 0))


def metric(gw: ServerThread, name: str, *labels: str) -> float:
    total = 0.0
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(cond: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    return poll(cond, timeout_s)


@dataclass
class Seen:
    status: int
    headers: httpx.Headers
    body: bytes

    @property
    def events(self) -> list[bytes]:
        return [e for e in self.body.split(b"\n\n") if e]


def send(gw: ServerThread, request_id: str, stream: bool) -> Seen:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={**CODE_REQ, "stream": stream},
        headers={"X-Request-Id": request_id},
        timeout=15,
    )
    return Seen(r.status_code, r.headers, r.content)


def one_terminal_response(seen: Seen, stream: bool) -> str:
    """The response is one whole answer or one explicit failure; returns what the client saw."""
    if stream and seen.status == 200:
        events = seen.events
        assert events[-1] == b"data: [DONE]", events[-3:]
        assert sum(e == b"data: [DONE]" for e in events) == 1
        assert sum(b'"role":"assistant"' in e for e in events) == 1  # one generation's opening, never two
        errors = [i for i, e in enumerate(events) if e.startswith(b'data: {"error"')]
        if errors:
            assert errors == [len(events) - 2]  # only right before [DONE]
            return "stream broken after the commit: error event + [DONE]"
        assert b'"finish_reason":"length"' in seen.body or b'"finish_reason":"stop"' in seen.body
        return "complete stream"
    body = orjson.loads(seen.body)
    if seen.status == 200:
        assert body["choices"][0]["message"]["content"]
        return "complete answer"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return f"error {body['error']['code']}"


# fault name → (faults on spec, stream → expected: (served by, outcome starts with, spec generations, std gens))
CASES: dict[str, dict[str, Any]] = {
    "connect refused": {"refuse_connections": True},
    "503 before headers": {"error_rate": 1.0, "error_status": 503},
    "429": {"error_rate": 1.0, "error_status": 429},
    "hang before first token": {"hang": True},
    "cut before first chunk": {"cut_after": 0},
    "cut after 3 chunks": {"cut_after": 3},
    "error event after 3 chunks": {"error_after": 3},
    "slow stream (within deadlines)": {"slow_chunk_s": 0.02},
    "slow first chunk (past deadlines)": {"slow_chunk_s": 2.0},
}


def expected(fault: str, stream: bool) -> tuple[str, int, int]:
    """(pool that serves the client, spec generations, std generations) for this fault."""
    if fault == "slow stream (within deadlines)":
        return "spec", 1, 0
    if stream and fault in ("cut after 3 chunks", "error event after 3 chunks"):
        return "spec", 1, 0  # committed: the client gets spec's partial stream and an explicit error
    generated_on_spec = fault in (
        "cut before first chunk",
        "cut after 3 chunks",
        "error event after 3 chunks",
        "slow first chunk (past deadlines)",
    )
    return "std", int(generated_on_spec), 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
@pytest.mark.parametrize("fault", list(CASES))
def test_fault_matrix(
    fault: str, stream: bool, faulty: tuple[SimServer, SimServer], gateway: Gateway, matrix: list[Row]
) -> None:
    spec, std = faulty
    gw = gateway(matrix_rules(spec.url, std.url), health_interval_s=60)  # one health round, before the fault
    aborted_before = sim_stats(spec)["requests"]["aborted"]
    spec.update_faults(CASES[fault])
    slug = re.sub(r"[^a-z0-9]+", "-", fault)  # request ids the gateway keeps as they are
    request_id = f"matrix-{slug}-{'stream' if stream else 'whole'}-{time.monotonic_ns()}"

    seen = send(gw, request_id, stream)
    spec.update_faults(Faults().to_json())  # listening again, so that /sim/stats can be read

    outcome = one_terminal_response(seen, stream)
    pool, spec_gens, std_gens = expected(fault, stream)
    assert seen.status == 200, seen.body[:500]
    assert seen.headers["x-specgate-pool"] == pool
    attempts = int(seen.headers["x-specgate-attempts"])
    assert attempts == (1 if pool == "spec" else 2)
    if pool == "spec" and stream and fault != "slow stream (within deadlines)":
        assert outcome.startswith("stream broken after the commit")
    else:
        assert outcome.startswith("complete")

    # /sim/stats: generations per pool for this request id. The serving pool generated it once; the other one
    # only for an attempt that failed before the commit point, never after it.
    got = (generations(spec, request_id), generations(std, request_id))
    assert got == (spec_gens, std_gens)
    assert sum(got) <= attempts
    # An abandoned attempt is cancelled upstream: the simulator saw its client go away.
    if fault in ("hang before first token", "slow first chunk (past deadlines)"):
        assert wait_until(lambda: sim_stats(spec)["requests"]["aborted"] > aborted_before)
    # Exactly one terminal response: one request in the gateway's metrics, nothing left in flight.
    assert wait_until(lambda: metric(gw, "specgate_requests_total") == 1)
    assert wait_until(lambda: metric(gw, "specgate_in_flight_requests") == 0)
    assert metric(gw, "specgate_upstream_attempts_total") == attempts
    if pool == "std":
        assert metric(gw, "specgate_fallbacks_total", 'from_pool="spec"', 'to_pool="std"') == 1
    matrix.append(Row(fault, stream, outcome, seen.status, str(attempts), pool, *got))


def test_endpoint_restart(gateway: Gateway, sims: tuple[SimServer, SimServer], matrix: list[Row]) -> None:
    """The spec endpoint restarts: a stream in flight on it breaks after its commit (error event + [DONE], no
    second generation), requests during the downtime go to std, and the endpoint is used again once back."""
    _, std = sims
    slow = {"slow_chunk_s": 0.02}
    spec = start_sim(speculative_config=SPEC, fixed_acceptance=0.6, output_lengths=OutputLengths(median=600, sigma=0))
    port = spec.port
    spec.update_faults(slow)
    try:
        gw = gateway(matrix_rules(spec.url, std.url), health_interval_s=0.2)
        tag = time.monotonic_ns()
        ids = {k: f"restart-{k}-{tag}" for k in ("in-flight", "down", "back")}

        # A: a stream in flight on spec when it goes away.
        chunks: list[bytes] = []
        result: dict[str, Any] = {}

        def read_stream() -> None:
            with httpx.stream(
                "POST",
                gw.url + "/v1/chat/completions",
                json={**CODE_REQ, "stream": True},
                headers={"X-Request-Id": ids["in-flight"]},
                timeout=15,
            ) as r:
                result["status"], result["headers"] = r.status_code, r.headers
                for chunk in r.iter_bytes():
                    chunks.append(chunk)

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert wait_until(lambda: len(chunks) >= 3)
        spec.stop()  # in-flight responses get uvicorn's one-second grace, then their connections are cut
        old_stats = spec.state.stats()  # what /sim/stats said last (the server is gone)
        reader.join(10)
        seen_a = Seen(result["status"], result["headers"], b"".join(chunks))
        outcome_a = one_terminal_response(seen_a, True)
        assert seen_a.headers["x-specgate-pool"] == "spec"
        assert outcome_a.startswith("stream broken after the commit")

        # B: during the downtime.
        seen_b = send(gw, ids["down"], True)
        outcome_b = one_terminal_response(seen_b, True)
        assert seen_b.status == 200
        assert seen_b.headers["x-specgate-pool"] == "std"
        assert outcome_b == "complete stream"

        # The endpoint comes back on the same address; the health checks bring it back into rotation.
        spec = start_sim(speculative_config=SPEC, fixed_acceptance=0.6, port=port)
        runtime: Any = gw._server.config.app.state.runtime  # type: ignore[attr-defined]
        ep = runtime.live.pools["spec"].endpoints[0]
        assert wait_until(lambda: ep.routable, 5.0)
        seen_c = send(gw, ids["back"], True)
        outcome_c = one_terminal_response(seen_c, True)
        assert seen_c.headers["x-specgate-pool"] == "spec"
        assert seen_c.headers["x-specgate-attempts"] == "1"

        new_stats = sim_stats(spec)
        std_stats = sim_stats(std)

        def gens(stats: dict[str, Any], key: str) -> int:
            return int(stats["generations"].get(ids[key], 0))

        assert (gens(old_stats, "in-flight"), gens(new_stats, "in-flight"), gens(std_stats, "in-flight")) == (1, 0, 0)
        assert (gens(old_stats, "down"), gens(new_stats, "down"), gens(std_stats, "down")) == (0, 0, 1)
        assert (gens(new_stats, "back"), gens(std_stats, "back")) == (1, 0)
        assert wait_until(lambda: metric(gw, "specgate_requests_total") == 3)
        for key, seen, outcome, stats in (
            ("in-flight", seen_a, outcome_a, old_stats),
            ("down", seen_b, outcome_b, old_stats),
            ("back", seen_c, outcome_c, new_stats),
        ):
            matrix.append(
                Row(
                    f"endpoint restart ({key})",
                    True,
                    outcome,
                    seen.status,
                    seen.headers["x-specgate-attempts"],
                    seen.headers["x-specgate-pool"],
                    gens(stats, key),
                    gens(std_stats, key),
                )
            )
    finally:
        spec.stop()


def test_consecutive_failures_eject_and_health_checks_bring_back(
    faulty: tuple[SimServer, SimServer], gateway: Gateway, matrix: list[Row]
) -> None:
    spec, std = faulty
    # The ejection outlasts the third request even on a slow machine (it must still be in force then), and ends
    # soon enough after the faults clear for the health checks to bring the endpoint back within the wait below.
    outlier = {"consecutive_failures": 2, "base_ejection_s": 3.0, "max_ejection_s": 10}
    rules = matrix_rules(spec.url, std.url, outlier_detection=outlier)
    rules["pools"][0]["models"] = [MODEL]  # else spec is the last endpoint serving SPEC_ONLY_MODEL: never ejected
    gw = gateway(rules, health_interval_s=0.1)
    spec.update_faults({"error_rate": 1.0, "error_status": 503})
    seen = [send(gw, f"eject-{i}-{time.monotonic_ns()}", False) for i in range(3)]
    assert [s.status for s in seen] == [200, 200, 200]
    assert [s.headers["x-specgate-pool"] for s in seen] == ["std", "std", "std"]
    assert [s.headers["x-specgate-attempts"] for s in seen] == ["2", "2", "1"]  # ejected after the 2nd
    assert metric(gw, "specgate_endpoint_ejected", 'endpoint="spec-0"') == 1
    assert metric(gw, "specgate_endpoint_ejections_total", 'endpoint="spec-0"') == 1
    matrix.append(Row("503 x3, ejection after 2", False, "complete answer x3", 200, "2, 2, 1", "std", 0, 3))

    spec.update_faults(Faults().to_json())
    assert wait_until(lambda: metric(gw, "specgate_endpoint_ejected", 'endpoint="spec-0"') == 0, 15.0)
    back = send(gw, f"eject-back-{time.monotonic_ns()}", False)
    assert back.headers["x-specgate-pool"] == "spec"


def test_retry_refused_by_the_budget(faulty: tuple[SimServer, SimServer], gateway: Gateway, matrix: list[Row]) -> None:
    spec, std = faulty
    gw = gateway(matrix_rules(spec.url, std.url, retry_budget={"ratio": 0.0, "min_retries": 0}))
    spec.update_faults({"error_rate": 1.0, "error_status": 503})
    request_id = f"budget-{time.monotonic_ns()}"
    seen = send(gw, request_id, False)
    assert seen.status == 503
    assert seen.headers["retry-after"]
    err = orjson.loads(seen.body)["error"]
    assert err["code"] == "retry_budget_exhausted"
    assert "spec: HTTP 503" in err["message"]
    assert metric(gw, "specgate_upstream_attempts_total", 'result="budget_exhausted"') == 1
    got = (generations(spec, request_id), generations(std, request_id))
    assert got == (0, 0)
    matrix.append(Row("503, retry budget 0", False, "error retry_budget_exhausted", 503, "1", "-", *got))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_fallback_to_another_model_only_when_the_class_allows_it(
    stream: bool, faulty: tuple[SimServer, SimServer], gateway: Gateway, matrix: list[Row]
) -> None:
    """SPEC_ONLY_MODEL is served by spec alone; std serves MODEL. With spec down, the class may fall back to std
    only with ``route.fallback_model`` (the body's model is rewritten, and the response says so)."""
    spec, std = faulty
    body = {**CODE_REQ, "model": SPEC_ONLY_MODEL, "stream": stream}
    spec.update_faults({"error_rate": 1.0, "error_status": 503})

    strict = gateway(matrix_rules(spec.url, std.url))
    r = httpx.post(strict.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 503  # off by default: another model's answer is not the same answer
    assert r.headers["x-specgate-attempts"] == "1"

    rules = matrix_rules(spec.url, std.url)
    rules["classes"][0]["route"]["fallback_model"] = MODEL
    allowed = gateway(rules)
    request_id = f"fallback-model-{'stream' if stream else 'whole'}-{time.monotonic_ns()}"
    r = httpx.post(allowed.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}, timeout=10)
    seen = Seen(r.status_code, r.headers, r.content)
    outcome = one_terminal_response(seen, stream)
    assert r.status_code == 200
    assert r.headers["x-specgate-pool"] == "std"
    assert r.headers["x-specgate-model"] == MODEL
    assert MODEL.encode() in r.content  # the pool answered for the model it was asked for
    spec.update_faults(Faults().to_json())
    got = (generations(spec, request_id), generations(std, request_id))
    assert got == (0, 1)
    matrix.append(Row("503 + fallback_model", stream, outcome, 200, r.headers["x-specgate-attempts"], "std", *got))
