"""The on-call console: ``GET /admin/ui``, one page of plain HTML, CSS and JavaScript shipped in the package
(``gateway/admin/static/``; no build step, nothing fetched from elsewhere).

The shell carries no data: it is the same bytes for everyone, so it answers without the admin token (a browser
cannot send a Bearer header when it navigates). Everything it shows it fetches from the token-protected routes of
the admin API with ``Authorization: Bearer <token>``; the token is typed once and kept in the tab's
``sessionStorage`` (no cookies, so there is nothing for another site to ride on: no CSRF). A strict
Content-Security-Policy allows only this listener's own scripts, styles and API (no inline script, no eval, no
frames, no forms posting elsewhere)::

    GET /admin/ui                   the page
    GET /admin/ui/assets/{name}     its scripts and stylesheet (a fixed list; anything else is 404)
"""

from __future__ import annotations

from importlib import resources
from types import MappingProxyType

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.errors import NotFound

PAGE = "index.html"
# The files the page loads, and their media types. A fixed map: a request never names a path on disk.
ASSETS = MappingProxyType(
    {
        "console.css": "text/css; charset=utf-8",
        "main.js": "text/javascript; charset=utf-8",
        "api.js": "text/javascript; charset=utf-8",
        "view.js": "text/javascript; charset=utf-8",
        "actions.js": "text/javascript; charset=utf-8",
        "panels.js": "text/javascript; charset=utf-8",
    }
)

CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = MappingProxyType(
    {
        "content-security-policy": CSP,
        "x-content-type-options": "nosniff",
        "x-frame-options": "DENY",
        "referrer-policy": "no-referrer",
        "cross-origin-opener-policy": "same-origin",
        "cross-origin-resource-policy": "same-origin",
        "permissions-policy": "camera=(), microphone=(), geolocation=()",
        "cache-control": "no-cache",  # revalidate: a new gateway version serves new scripts at once
    }
)


def _read(name: str) -> bytes:
    return resources.files("gateway.admin").joinpath("static", name).read_bytes()


def _file(name: str, media_type: str) -> Response:
    return Response(_read(name), 200, headers=dict(SECURITY_HEADERS), media_type=media_type)


async def get_page(request: Request) -> Response:
    return _file(PAGE, "text/html; charset=utf-8")


async def get_asset(request: Request) -> Response:
    name = str(request.path_params["name"])
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"the console has no file {name!r}", param="name", code="not_found")
    return _file(name, media_type)


def ui_routes() -> list[BaseRoute]:
    """The page and its files: public (they carry no data), so the token check lets them through."""
    return [
        Route("/admin/ui", get_page, methods=["GET"]),
        Route("/admin/ui/assets/{name}", get_asset, methods=["GET"]),
    ]
