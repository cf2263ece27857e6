"""``GatewayApp``'s direct way to the proxy routes answers exactly as Starlette's stack would, errors included."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import BadRequest
from gateway.proxy.app import GatewayApp, Handler, exception_handlers


class _StartsThenFails(Response):
    """Sends its headers, then raises."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(b"")
        self.exc = exc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        raise self.exc


def _handler(behaviour: str) -> Handler:
    async def handler(request: Request) -> Response:
        if behaviour == "ok":
            return Response(b"hello", 201, headers={"x-b": "2"})
        if behaviour == "gateway_error":
            raise BadRequest("bad thing", code="bad")
        if behaviour == "http_404":
            raise HTTPException(404)
        if behaviour == "http_418":
            raise HTTPException(418, "teapot")
        if behaviour == "client_gone":
            raise ClientDisconnect()
        if behaviour == "bug":
            raise ValueError("boom")
        if behaviour == "started_then_gateway_error":
            return _StartsThenFails(BadRequest("late"))
        if behaviour == "started_then_bug":
            return _StartsThenFails(ValueError("late boom"))
        raise AssertionError(behaviour)

    return handler


BEHAVIOURS = [
    "ok",
    "gateway_error",
    "http_404",
    "http_418",
    "client_gone",
    "bug",
    "started_then_gateway_error",
    "started_then_bug",
]


def _apps(behaviour: str) -> tuple[GatewayApp, Starlette]:
    handler = _handler(behaviour)
    routes = [Route("/v1/chat/completions", handler, methods=["POST"])]
    direct = GatewayApp({"/v1/chat/completions": handler}, routes=routes, exception_handlers=exception_handlers())
    plain = Starlette(routes=routes, exception_handlers=exception_handlers())
    return direct, plain


async def _call(
    app: Starlette, root_path: str = "", path: str = "/v1/chat/completions"
) -> tuple[Scope, list[Message], Exception | None]:
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": root_path,
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1234),
        "server": ("gw", 80),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    try:
        await app(scope, receive, send)
    except Exception as exc:
        return scope, sent, exc
    return scope, sent, None


def _same_error(a: Exception | None, b: Exception | None) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    if a is not None and b is not None:
        assert type(a.__cause__) is type(b.__cause__)


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
async def test_direct_route_answers_as_starlette_does(behaviour: str) -> None:
    direct, plain = _apps(behaviour)
    d_scope, d_sent, d_err = await _call(direct)
    p_scope, p_sent, p_err = await _call(plain)
    assert "endpoint" not in d_scope  # the direct way: Starlette's router never saw it
    assert p_scope["endpoint"] is not None
    assert d_sent == p_sent
    _same_error(d_err, p_err)


async def test_error_envelopes_on_the_direct_route() -> None:
    _, sent, err = await _call(_apps("bug")[0])
    assert isinstance(err, ValueError)  # raised again, for the server's log
    assert sent[0]["status"] == 500
    assert b'"type":"internal_error"' in sent[1]["body"]
    _, sent, err = await _call(_apps("gateway_error")[0])
    assert err is None
    assert sent[0]["status"] == 400
    _, sent, err = await _call(_apps("client_gone")[0])
    assert err is None
    assert sent[0]["status"] == 499


async def test_a_root_path_goes_through_starlette() -> None:
    scope, sent, err = await _call(_apps("ok")[0], root_path="/gw", path="/gw/v1/chat/completions")
    assert "endpoint" in scope
    assert err is None
    assert sent[0]["status"] == 201


async def test_an_app_built_differently_goes_through_starlette() -> None:
    """The direct way in mirrors Starlette's stack only for the app create_app builds: with debug pages, a body
    limit, middleware or no last-resort handler, every request takes Starlette's path."""
    direct = _apps("ok")[0]
    scope, _sent, _err = await _call(direct)
    assert "endpoint" not in scope  # the direct way in: the router never saw it
    handler = _handler("ok")
    routes = [Route("/v1/chat/completions", handler, methods=["POST"])]
    handlers = exception_handlers()
    variants = [
        GatewayApp({"/v1/chat/completions": handler}, routes=routes, exception_handlers=handlers, debug=True),
        GatewayApp({"/v1/chat/completions": handler}, routes=routes, exception_handlers=handlers, max_body_size=10**6),
        GatewayApp(
            {"/v1/chat/completions": handler},
            routes=routes,
            exception_handlers={k: v for k, v in handlers.items() if k is not Exception},
        ),
    ]
    for app in variants:
        scope, sent, err = await _call(app)
        assert "endpoint" in scope
        assert err is None
        assert sent[0]["status"] == 201


def test_the_gateway_as_built_takes_the_direct_way() -> None:
    from pathlib import Path

    from gateway.config.settings import Settings
    from gateway.proxy.app import create_app

    app = create_app(Settings(rules=Path(__file__).resolve().parents[2] / "routing_rules" / "default.yaml"))
    assert isinstance(app, GatewayApp)
    assert app._direct_ok()
