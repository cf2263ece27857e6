"""The official OpenAI Python SDK against the gateway, unchanged: sync and async, streaming and not, errors."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, closed_port_url, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "write a python function that reverses a list"}]


@pytest.fixture
def gw(fake: Fake, gateway: Gateway) -> ServerThread:
    return gateway(rules_for([fake("spec").url], [fake("std").url]))


def client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_sync_non_streaming(gw: ServerThread) -> None:
    raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, temperature=0)  # type: ignore[arg-type]
    assert raw.headers["x-specgate-pool"] == "spec"
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert completion.usage.completion_tokens > 0


def test_sync_streaming_with_usage(gw: ServerThread) -> None:
    stream = client(gw).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=6,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_legacy_completions(gw: ServerThread) -> None:
    c = client(gw).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert c.choices[0].text


async def test_async_streaming_and_not(gw: ServerThread) -> None:
    aclient = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    try:
        done = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        assert done.choices[0].message.content
        stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) > 3
    finally:
        await aclient.close()


def test_models_list(gw: ServerThread) -> None:
    ids = [m.id for m in client(gw).models.list()]
    assert MODEL in ids
    assert len(ids) == len(set(ids))


def test_bad_request_error(gw: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(model=MODEL, messages=MESSAGES, temperature="hot")  # type: ignore[arg-type]
    assert info.value.status_code == 400
    assert info.value.param == "temperature"


def test_not_found_error(gw: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(gw).chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.param == "model"
    assert info.value.code == "model_not_found"


def test_api_status_error_for_503(gateway: Gateway) -> None:
    gw = gateway(rules_for([closed_port_url()], [closed_port_url()]))
    with pytest.raises(openai.APIStatusError) as info:
        client(gw).chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.status_code == 503


def test_stream_broken_mid_way_raises_api_error(gw: ServerThread) -> None:
    stream = client(gw).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        extra_headers={"X-Fake-Behavior": "break_after=3"},
    )
    received: list[str] = []

    def consume() -> None:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)

    with pytest.raises(openai.APIError):
        consume()
    assert len(received) == 3  # what came before the break, and never anything after it
