"""``GatewayApp``: the proxy POSTs go to a plain ASGI exchange, answering exactly as Starlette's stack would (errors
included); everything else goes to Starlette."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config.settings import Settings
from gateway.errors import BadRequest
from gateway.proxy import front as front_module
from gateway.proxy.app import PROXY_ROUTES, GatewayApp, create_app
from gateway.proxy.front import ProxyRoute
from gateway.proxy.http import exception_handlers
from gateway.proxy.intake import classified

RULES = Path(__file__).resolve().parents[2] / "routing_rules" / "default.yaml"
PATH = "/v1/chat/completions"


class _StartsThenFails(Response):
    """Sends its headers, then raises."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(b"")
        self.exc = exc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        raise self.exc


def _answer(behaviour: str) -> ASGIApp:
    """What the proxy route's front half does: return the app that answers, or raise."""
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


BEFORE_START = ["ok", "gateway_error", "http_404", "http_418", "client_gone", "bug"]
AFTER_START = ["started_then_gateway_error", "started_then_bug"]


def _apps(behaviour: str, monkeypatch: pytest.MonkeyPatch) -> tuple[GatewayApp, Starlette]:
    """The dispatcher with ``behaviour`` as its proxy route's front half, and a plain Starlette app routing the same
    behaviour through its router, middleware and the gateway's exception handlers."""

    async def admit(rt: Any, route: ProxyRoute, scope: Scope, receive: Receive) -> ASGIApp:
        assert route.path == PATH
        return _answer(behaviour)

    async def endpoint(request: Request) -> Response:
        answer = _answer(behaviour)
        assert isinstance(answer, Response)
        return answer

    monkeypatch.setattr(front_module, "admit", admit)
    others = Starlette(routes=[Route("/health", endpoint, methods=["GET"])], exception_handlers=exception_handlers())
    dispatcher = GatewayApp(None, [ProxyRoute(PATH, "chat", classified)], others)  # type: ignore[arg-type]
    plain = Starlette(routes=[Route(PATH, endpoint, methods=["POST"])], exception_handlers=exception_handlers())
    return dispatcher, plain


async def _call(
    app: ASGIApp, root_path: str = "", path: str = PATH, method: str = "POST"
) -> tuple[Scope, list[Message], Exception | None]:
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
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


@pytest.mark.parametrize("behaviour", BEFORE_START)
async def test_the_proxy_route_answers_as_starlette_does(behaviour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher, plain = _apps(behaviour, monkeypatch)
    d_scope, d_sent, d_err = await _call(dispatcher)
    p_scope, p_sent, p_err = await _call(plain)
    assert "endpoint" not in d_scope  # Starlette's router never saw it
    assert p_scope["endpoint"] is not None
    assert d_sent == p_sent
    assert type(d_err) is type(p_err)
    assert str(d_err) == str(p_err)


@pytest.mark.parametrize("behaviour", AFTER_START)
async def test_an_error_after_the_start_goes_to_the_server(behaviour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing more can be sent once the response started: the exception goes to the server (which logs it and
    closes the connection), as with Starlette, which raises a RuntimeError in its place for a handled class."""
    dispatcher, plain = _apps(behaviour, monkeypatch)
    _, d_sent, d_err = await _call(dispatcher)
    _, p_sent, p_err = await _call(plain)
    assert d_sent == p_sent == [{"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]}]
    assert p_err is not None
    assert isinstance(d_err, BadRequest | ValueError)
    assert str(d_err).startswith("late")


async def test_error_envelopes_on_the_proxy_route(monkeypatch: pytest.MonkeyPatch) -> None:
    _, sent, err = await _call(_apps("bug", monkeypatch)[0])
    assert isinstance(err, ValueError)  # raised again, for the server's log
    assert sent[0]["status"] == 500
    assert b'"type":"internal_error"' in sent[1]["body"]
    assert b"boom" not in sent[1]["body"]
    _, sent, err = await _call(_apps("gateway_error", monkeypatch)[0])
    assert err is None
    assert sent[0]["status"] == 400
    _, sent, err = await _call(_apps("client_gone", monkeypatch)[0])
    assert err is None
    assert sent[0]["status"] == 499


async def test_another_method_on_a_proxy_path_is_405_as_starlette_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher, plain = _apps("ok", monkeypatch)
    for method in ("GET", "HEAD", "PUT", "DELETE"):
        _, d_sent, d_err = await _call(dispatcher, method=method)
        _, p_sent, p_err = await _call(plain, method=method)
        assert d_err is None
        assert p_err is None
        assert d_sent == p_sent
        assert d_sent[0]["status"] == 405
        assert (b"allow", b"POST") in d_sent[0]["headers"]
        assert b'"code":"method_not_allowed"' in d_sent[1]["body"]


async def test_a_root_path_is_stripped_as_the_router_does(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher = _apps("ok", monkeypatch)[0]
    scope, sent, err = await _call(dispatcher, root_path="/gw", path="/gw" + PATH)
    assert "endpoint" not in scope  # the exchange, not the router
    assert err is None
    assert sent[0]["status"] == 201
    for root, path in [("/gw", "/gwx" + PATH), ("/gw", PATH + "/x")]:  # not under the mount point, or deeper
        scope, sent, err = await _call(dispatcher, root_path=root, path=path)
        assert sent[0]["status"] == 404
    scope, sent, err = await _call(dispatcher, root_path="/gw", path="/gw/health", method="GET")
    assert scope["endpoint"] is not None  # everything else: Starlette
    assert sent[0]["status"] == 201


async def test_everything_else_goes_to_starlette(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher = _apps("ok", monkeypatch)[0]
    scope, sent, _ = await _call(dispatcher, path="/health", method="GET")
    assert scope["endpoint"] is not None
    assert sent[0]["status"] == 201
    scope, sent, _ = await _call(dispatcher, path="/v1/nope")
    assert "app" in scope  # Starlette saw it: its 404, rendered by the same handlers
    assert sent[0]["status"] == 404
    assert b'"code":"unknown_route"' in sent[1]["body"]


def test_the_gateway_as_built_forwards_the_table_of_proxy_routes() -> None:
    app = create_app(Settings(rules=RULES))
    assert isinstance(app, GatewayApp)
    assert set(app.proxy_routes) == {r.path for r in PROXY_ROUTES}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= set(app.proxy_routes)
    assert app.state.runtime is app.runtime
    starlette_paths = {getattr(r, "path", None) for r in app.starlette.routes}
    assert not starlette_paths & set(app.proxy_routes)  # one way in per path: they cannot answer differently
