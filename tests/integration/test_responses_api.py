"""The Responses API through the gateway with the official OpenAI SDK: real uvicorn, simulated vLLM 0.33 pools
(with their response store on), and for stickiness across replicas a private redis-server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.app import SimOptions
from gateway.sim.faults import Faults
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, RedisServer, ServerThread, rules_for

pytestmark = pytest.mark.integration

SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
CODE = "Write a python function that reverses a list."
SCHEMA = {
    "type": "json_schema",
    "name": "answer",
    "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}, "strict": False}
]


def start(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "model": MODEL,
        "port": 0,
        "time_scale": 0.002,
        "output_lengths": OutputLengths(median=24, sigma=0),
        "enable_responses_store": True,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimServer]]:
    servers = [start(speculative_config=SPEC), start(speculative_config=SPEC), start()]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def clean(sims: list[SimServer]) -> list[SimServer]:
    for s in sims:
        s.update_faults(Faults().to_json())
    return sims


def _rules(sims: list[SimServer]) -> dict[str, Any]:
    rules = rules_for([sims[0].url, sims[1].url], [sims[2].url])
    rules["task_rules"].append({"task": "tool_use", "tools": True})
    rules["classes"].insert(
        0,
        {
            "name": "agents",
            "when": {"endpoint": {"in": ["responses"]}, "tools": True},
            "route": {"preferred": "std", "fallback": ["spec"]},
        },
    )
    return rules


@pytest.fixture
def gw(clean: list[SimServer], gateway: Callable[..., ServerThread]) -> ServerThread:
    return gateway(_rules(clean))


def client(gw: ServerThread, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0, **kw)


def test_create_plain_classified_and_routed(gw: ServerThread) -> None:
    raw = client(gw).responses.with_raw_response.create(model=MODEL, input=CODE, temperature=0.1)
    assert raw.headers["x-specgate-class"] == "precise"
    assert raw.headers["x-specgate-task-type"] == "code"
    assert raw.headers["x-specgate-pool"] == "spec"
    r = raw.parse()
    assert r.id.startswith("resp_")
    assert r.status == "completed"
    assert r.output_text
    assert r.usage is not None
    assert r.usage.output_tokens > 0


def test_create_streamed_typed_events(gw: ServerThread) -> None:
    events = list(client(gw).responses.create(model=MODEL, input="Tell me about the sea.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text


def test_create_json_schema_is_structured(gw: ServerThread) -> None:
    raw = client(gw).responses.with_raw_response.create(
        model=MODEL,
        input="Give me an answer.",
        temperature=0.2,
        text={"format": SCHEMA},  # type: ignore[typeddict-item]
    )
    assert raw.headers["x-specgate-task-type"] == "structured"
    assert raw.headers["x-specgate-class"] == "precise"


def test_create_with_tools_is_tool_use(gw: ServerThread) -> None:
    raw = client(gw).responses.with_raw_response.create(model=MODEL, input="Weather in Oslo?", tools=TOOLS)
    assert raw.headers["x-specgate-class"] == "agents"
    assert raw.headers["x-specgate-task-type"] == "tool_use"
    assert raw.headers["x-specgate-pool"] == "std"


def test_retrieve_and_cancel(gw: ServerThread, clean: list[SimServer]) -> None:
    c = client(gw)
    done = c.responses.create(model=MODEL, input=CODE, temperature=0.1)
    raw = c.responses.with_raw_response.retrieve(done.id)
    assert raw.headers["x-specgate-route"] == "sticky"
    assert raw.parse().output_text == done.output_text
    with pytest.raises(openai.BadRequestError):  # vLLM: only a background response can be cancelled
        c.responses.cancel(done.id)
    for s in clean:  # a background generation that is still running when the cancel arrives
        s.update_faults(Faults(slow_chunk_s=0.5).to_json())
    background = c.responses.create(model=MODEL, input=CODE, temperature=0.1, background=True)
    assert background.status == "queued"
    cancelled = c.responses.cancel(background.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(background.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.retrieve("resp_unknown")
    assert info.value.code == "response_not_found"


def test_store_false_is_not_recorded(gw: ServerThread) -> None:
    c = client(gw)
    r = c.responses.create(model=MODEL, input="hello", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="and then?", previous_response_id=r.id)


def test_other_api_key_cannot_continue(gw: ServerThread) -> None:
    r = client(gw).responses.create(model=MODEL, input="hello")
    other = openai.OpenAI(base_url=gw.url + "/v1", api_key="other", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)


def test_cut_stream_raises_in_the_sdk(gw: ServerThread, clean: list[SimServer]) -> None:
    for s in clean:
        s.update_faults(Faults(cut_after=3).to_json())
    stream = client(gw).responses.create(model=MODEL, input="Tell me about the sea.", stream=True)
    seen: list[str] = []

    def consume() -> None:
        for event in stream:
            seen.append(event.type)

    with pytest.raises(openai.APIError) as info:
        consume()
    assert "stream" in str(info.value.message) or "closed" in str(info.value.message)
    assert seen[0] == "response.created"
    assert seen[-1] == "response.failed"  # the API's own failure event, then the error the SDK raises on
    assert "response.completed" not in seen


def test_idempotency_key_replays_a_streamed_response(gw: ServerThread) -> None:
    c = client(gw)
    key = {"Idempotency-Key": "resp-stream-1"}
    runs = []
    for _ in range(2):
        raw = c.responses.with_raw_response.create(
            model=MODEL, input="Tell me about the sea.", stream=True, extra_headers=key
        )
        runs.append((raw.headers.get("idempotent-replayed"), [e.model_dump() for e in raw.parse()]))
    (first_flag, first), (again_flag, again) = runs
    assert (first_flag, again_flag) == (None, "true")
    assert again == first  # the same events, the same response id: generated once
    assert first[-1]["type"] == "response.completed"
    with httpx.Client(timeout=30) as h:  # the stored transcript is the exact bytes
        body = {"model": MODEL, "input": "x", "stream": True}
        headers = {"Idempotency-Key": "resp-stream-2", "Authorization": "Bearer k"}
        assert h.post(gw.url + "/v1/responses", json=body, headers=headers).content == (
            h.post(gw.url + "/v1/responses", json=body, headers=headers).content
        )


def test_previous_response_id_over_two_replicas_sharing_redis(
    clean: list[SimServer], gateway: Callable[..., ServerThread], redis_server: RedisServer
) -> None:
    replicas = [gateway(_rules(clean), redis_url=redis_server.url) for _ in range(2)]
    prev: str | None = None
    endpoints = set()
    for turn in range(3):
        c = client(replicas[turn % 2])
        kw: dict[str, Any] = {"previous_response_id": prev} if prev else {}
        raw = c.responses.with_raw_response.create(model=MODEL, input=f"{CODE} Turn {turn}.", temperature=0.1, **kw)
        endpoints.add(raw.headers["x-specgate-endpoint"])
        r = raw.parse()
        if prev is not None:
            assert r.previous_response_id == prev
            assert raw.headers["x-specgate-route"] == "sticky"
        prev = r.id
    assert len(endpoints) == 1
    assert client(replicas[0]).responses.retrieve(prev).id == prev
