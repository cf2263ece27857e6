"""The EPP's side of one ext_proc stream, in process: the messages Envoy would send, the answers it gets back."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf.struct_pb2 import Struct

from gateway.config.settings import Settings
from gateway.epp.exchange import Exchange
from gateway.epp.pick import DESTINATION_HEADER, address
from gateway.runtime.container import Runtime
from tests.conftest import MODEL, rules_for

SPEC = ["http://10.0.0.11:8000", "http://10.0.0.12:8000"]
STD = ["http://10.0.0.21:8000"]
CODE = {"model": MODEL, "temperature": 0.1, "messages": [{"role": "user", "content": "def add(a, b): in python"}]}


@pytest.fixture
def rt(tmp_path: Path) -> Runtime:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for(SPEC, STD, defaults={"max_attempts": 3, "controller": None})))
    return Runtime.from_settings(Settings(rules=path, max_body_bytes=4096))


def headers(*pairs: tuple[str, str], end: bool = False) -> ProcessingRequest:
    hm = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return ProcessingRequest(request_headers=HttpHeaders(headers=hm, end_of_stream=end))


def post(path: str = "/v1/chat/completions") -> ProcessingRequest:
    return headers((":method", "POST"), (":path", path), ("x-request-id", "req-1"))


def body(data: bytes, end: bool = True) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=end))


def response(status: int, served: str | None) -> ProcessingRequest:
    hm = HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
    req = ProcessingRequest(response_headers=HttpHeaders(headers=hm))
    if served is not None:
        attrs = Struct()
        attrs.update({"upstream.address": served})
        req.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    return req


def set_headers(answer: ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(answer, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def in_flight(rt: Runtime) -> dict[str, int]:
    return {e.id: e.in_flight for p in rt.live.pools.values() for e in p.endpoints if e.in_flight}


def test_a_request_gets_its_endpoints_in_fallback_order_then_the_decision_headers(rt: Runtime) -> None:
    ex = Exchange(rt)
    first = ex.on(post())
    assert first is not None
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers  # CONTINUE: the body decides
    answer = ex.on(body(orjson.dumps(CODE)))
    assert answer is not None
    listed = set_headers(answer, "request_body")[DESTINATION_HEADER].split(",")
    # The speculative pool first (its two endpoints take turns with the fallback pool), cut to max_attempts.
    assert len(listed) == 3
    assert listed[0] in {address(u) for u in SPEC}
    assert listed[1] == address(STD[0])
    assert answer.dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == ",".join(listed)
    assert in_flight(rt) == {f"spec-{SPEC.index('http://' + listed[0])}": 1}
    # Envoy fell back to the standard endpoint: the headers and the in-flight count follow it.
    decorated = ex.on(response(200, address(STD[0])))
    assert decorated is not None
    added = set_headers(decorated, "response_headers")
    assert added["x-specgate-pool"] == "std"
    assert added["x-specgate-endpoint"] == "std-0"
    assert added["x-specgate-class"] == "precise"
    assert added["x-request-id"] == "req-1"
    assert in_flight(rt) == {"std-0": 1}
    ex.close()
    assert in_flight(rt) == {}


def test_a_request_without_body_is_decided_on_its_headers(rt: Runtime) -> None:
    ex = Exchange(rt)
    answer = ex.on(headers((":method", "GET"), (":path", "/v1/models"), end=True))
    assert answer is not None
    listed = set_headers(answer, "request_headers")[DESTINATION_HEADER].split(",")
    assert listed
    ex.close()
    assert in_flight(rt) == {}


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{nope", 400, "invalid_json"),
        (b"x" * 5000, 413, None),
        (orjson.dumps({**CODE, "model": "other"}), 404, None),
    ],
)
def test_refusals_are_immediate_responses_with_the_envelope(
    rt: Runtime, raw: bytes, status: int, code: str | None
) -> None:
    ex = Exchange(rt)
    ex.on(post())
    answer = ex.on(body(raw))
    assert answer is not None
    assert answer.WhichOneof("response") == "immediate_response"
    immediate = answer.immediate_response
    assert immediate.status.code == status
    error = orjson.loads(immediate.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    ex.close()
    assert in_flight(rt) == {}


def test_a_streamed_body_is_kept_until_its_end_and_bounded(rt: Runtime) -> None:
    ex = Exchange(rt)
    ex.on(post())
    raw = orjson.dumps(CODE)
    chunk = ex.on(body(raw[:10], end=False))
    assert chunk is not None
    assert chunk.WhichOneof("response") == "request_body"
    assert not chunk.request_body.response.header_mutation.set_headers
    answer = ex.on(body(raw[10:]))
    assert answer is not None
    assert DESTINATION_HEADER in set_headers(answer, "request_body")
    ex.close()
    big = Exchange(rt)
    big.on(post())
    big.on(body(b" " * 3000, end=False))
    over = big.on(body(b" " * 3000, end=False))
    assert over is not None
    assert over.immediate_response.status.code == 413


def test_a_drained_pool_is_left_out(rt: Runtime) -> None:
    for ep in rt.live.pools["spec"].endpoints:
        ep.weight = 0
    ex = Exchange(rt)
    ex.on(post())
    answer = ex.on(body(orjson.dumps(CODE)))
    assert answer is not None
    assert set_headers(answer, "request_body")[DESTINATION_HEADER] == address(STD[0])
    ex.close()


async def test_grpc_server_answers_health_and_process(tmp_path: Path) -> None:
    """Over a real gRPC channel: every endpoint refuses connections, so once a health round has run the picker is
    NOT_SERVING and a request is answered 503 by the picker itself."""
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway.epp.server import SERVICE, EppServer
    from tests.conftest import closed_port_url

    path = tmp_path / "dead.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    rt = Runtime.from_settings(Settings(rules=path, health_interval_s=0.1, health_timeout_s=0.5))
    server = EppServer(rt, "127.0.0.1", 0)
    await server.start()
    try:
        for _ in range(500):  # the first health round (bounded: 10 s)
            if rt.health.rounds > 0:
                break
            await asyncio.sleep(0.02)
        assert rt.health.rounds > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            got = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
            call = ExternalProcessorStub(channel).Process(iter([post(), body(orjson.dumps(CODE))]), timeout=5)
            answers = [a async for a in call]
            assert [a.WhichOneof("response") for a in answers] == ["request_headers", "immediate_response"]
            assert answers[1].immediate_response.status.code == 503
            assert orjson.loads(answers[1].immediate_response.body)["error"]["code"] == "no_capacity"
    finally:
        await server.stop(grace_s=0.5)
