"""The simplest possible pass-through proxy, as a baseline for ``specgate bench overhead``.

Starlette + uvicorn (uvloop, httptools), one upstream, no classification, no headers work, no metrics: what a
proxy costs before it does anything useful. ``--client`` picks the upstream HTTP client, so the same run shows
what httpx's default transport costs against aiohttp's (the reason ``gateway.fleet.upstream`` uses aiohttp).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

import aiohttp
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

Client = Literal["aiohttp", "httpx"]


def create_minimal_proxy(upstream: str, client: Client) -> Starlette:
    url = upstream.rstrip("/") + "/v1/chat/completions"
    holder: dict[str, object] = {}  # per app instance, filled by the lifespan

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if client == "aiohttp":
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
            holder["c"] = session
            yield
            await session.close()
        else:
            hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))
            holder["c"] = hx
            yield
            await hx.aclose()

    async def aiohttp_handler(request: Request) -> Response:
        session = holder["c"]
        assert isinstance(session, aiohttp.ClientSession)
        body = await request.body()
        resp = await session.post(url, data=body, headers={"content-type": "application/json"})
        ctype = resp.headers.get("content-type", "application/json")
        if ctype.startswith("text/event-stream"):

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:
                    resp.release()

            return StreamingResponse(relay(), resp.status, media_type=ctype)
        data = await resp.read()
        resp.release()
        return Response(data, resp.status, media_type=ctype)

    async def httpx_handler(request: Request) -> Response:
        hx = holder["c"]
        assert isinstance(hx, httpx.AsyncClient)
        body = await request.body()
        req = hx.build_request("POST", url, content=body, headers={"content-type": "application/json"})
        resp = await hx.send(req, stream=True)
        ctype = resp.headers.get("content-type", "application/json")
        if ctype.startswith("text/event-stream"):

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(relay(), resp.status_code, media_type=ctype)
        data = await resp.aread()
        await resp.aclose()
        return Response(data, resp.status_code, media_type=ctype)

    handler = aiohttp_handler if client == "aiohttp" else httpx_handler
    return Starlette(routes=[Route("/v1/chat/completions", handler, methods=["POST"])], lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description="minimal pass-through proxy (benchmark baseline)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    args = parser.parse_args()
    app = create_minimal_proxy(args.upstream, args.client)
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
