"""Input checks that belong to the gateway, in-process: sampling values out of range are a 400 ``invalid_value``
naming the field (as OpenAI answers) before any pool sees them; an unknown model's 404 names the models served;
``GET /v1/models`` carries ``x-request-id`` like every other response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from tests.conftest import MODEL, SPEC_ONLY_MODEL, closed_port_url, rules_for

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    app = create_app(Settings(rules=path, api_keys="k1"))
    transport = httpx.ASGITransport(app=app)
    auth = {"authorization": "Bearer k1"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=auth) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "top_p", 5),
        ("/v1/chat/completions", "top_p", -0.1),
        ("/v1/chat/completions", "max_tokens", -5),
        ("/v1/chat/completions", "max_tokens", 0),
        ("/v1/chat/completions", "max_completion_tokens", 0),
        ("/v1/chat/completions", "temperature", -1),
        ("/v1/chat/completions", "temperature", 2.5),
        ("/v1/chat/completions", "n", 0),
        ("/v1/completions", "max_tokens", -5),
        ("/v1/completions", "n", -1),
    ],
)
async def test_out_of_range_is_invalid_value_naming_the_field(
    client: httpx.AsyncClient, path: str, field: str, value: Any
) -> None:
    body = {**CHAT, field: value} if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "x", field: value}
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", field)
    assert f"Invalid '{field}'" in err["message"]
    assert str(value) in err["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize(
    ("field", "value"), [("top_p", 0), ("top_p", 1), ("temperature", 0), ("temperature", 2), ("max_tokens", 1)]
)
async def test_the_bounds_themselves_pass_to_the_pools(client: httpx.AsyncClient, field: str, value: Any) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert r.status_code == 503  # planned and sent on: the pools here refuse connections


async def test_unknown_model_names_the_models_served(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert f"Models served here: {MODEL}, {SPEC_ONLY_MODEL}" in err["message"]


async def test_models_carries_a_request_id(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers={"x-request-id": "abc-1"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-1"
    assert (await client.get("/v1/models")).headers["x-request-id"]
    refused = await client.get("/v1/models", headers={"authorization": "Bearer wrong"})
    assert refused.status_code == 401
    assert refused.headers["x-request-id"]
