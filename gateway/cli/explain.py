"""``specgate explain FILE``: why a request would go where it goes, asked of a running gateway's admin API
(``POST /admin/explain``) and printed as tables (``gateway.cli.render``); nothing is sent to any model server.

FILE holds the request body exactly as a client would POST it (``-``: standard input). The exit codes are the
on-call commands' (``gateway.cli.admin``): 1 the admin API refused, 2 a usage error or it cannot be reached,
3 authentication failed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import httpx
import orjson
import typer

from gateway.admin.protocol import DEFAULT_URL, EXPLAIN_DEFAULT_PATH, TOKEN_ENV
from gateway.cli.console import Command, fail, out
from gateway.cli.render import render


def _headers(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise fail(f"--header {pair!r}: expected NAME:VALUE (e.g. 'X-Task-Type: code')", 2)
        out[name.strip()] = value.strip()
    return out


def _read(file: Path) -> bytes:
    if str(file) == "-":
        return sys.stdin.buffer.read()
    try:
        return file.read_bytes()
    except OSError as exc:
        raise fail(f"cannot read {file}: {exc.strerror or exc}", 2) from exc


def fetch_explanation(
    url: str, path: str, body: bytes, headers: dict[str, str], token: str | None, timeout_s: float
) -> httpx.Response:
    sent = {"content-type": "application/json", **headers}
    if token:
        sent["authorization"] = f"Bearer {token}"
    return httpx.post(
        url.rstrip("/") + "/admin/explain", params={"path": path}, content=body, headers=sent, timeout=timeout_s
    )


def explain_command(
    file: Annotated[Path, typer.Argument(help="JSON request body, as a client would send it ('-': stdin).")],
    url: Annotated[str, typer.Option(envvar="SPECGATE_ADMIN_URL", help="The gateway's admin API.")] = DEFAULT_URL,
    path: Annotated[str, typer.Option(help="The client path the request would go to.")] = EXPLAIN_DEFAULT_PATH,
    header: Annotated[
        list[str] | None,
        typer.Option("--header", "-H", help="A request header, NAME:VALUE (e.g. 'X-Task-Type: code'); repeatable."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the admin API's raw JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the admin API.")] = 10.0,
) -> None:
    """Why a request would go where it goes: class, controller state, live pool numbers, and the attempt plan.
    Sends nothing to any model server. Token: SPECGATE_ADMIN_TOKEN."""
    headers = _headers(header or [])
    body = _read(file)
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    try:
        r = fetch_explanation(url, path, body, headers, token, timeout)
    except httpx.InvalidURL as exc:
        raise fail(f"bad --url {url!r}: {exc}", 2) from exc
    except httpx.HTTPError as exc:
        raise fail(
            f"cannot reach the admin API at {url}: {exc or type(exc).__name__}. "
            "Is the gateway running with --admin-port? Check --url.",
            2,
        ) from exc
    try:
        data = orjson.loads(r.content)
    except orjson.JSONDecodeError:
        data = None
    if r.status_code >= 400:
        e = data.get("error") if isinstance(data, dict) else None
        message = e.get("message") if isinstance(e, dict) else r.text[:300] or f"HTTP {r.status_code}"
        hint = ""
        if r.status_code == 401:
            hint = f" (set {TOKEN_ENV} to the gateway's admin token)" if token is None else f" (check {TOKEN_ENV})"
        code = 3 if r.status_code in (401, 403) else 1  # the same exit codes as the other admin commands
        raise fail(f"the admin API answered {r.status_code}: {message}{hint}", code)
    if not isinstance(data, dict):
        raise fail(f"{url} did not answer like a specgate admin API (check --url)", 2)
    if as_json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    render(data, out)


COMMANDS: tuple[Command, ...] = (
    Command("explain", explain_command, "Why a request would go where it goes: asks a running gateway's admin API."),
)
