"""The console's shell (``GET /admin/ui``) in-process: it answers without the token because it carries no data,
under a strict Content-Security-Policy; every API call its scripts make is refused without the admin token (and
with a client API key); and /admin/state tells it what it needs (changes allowed, TTL defaults, the clock)."""

from __future__ import annotations

import fnmatch
import re
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.admin.app import create_admin_app
from gateway.admin.openapi import openapi
from gateway.admin.ui import ASSETS, CSP
from gateway.runtime.container import Runtime
from tests.app.test_admin import CLIENT_KEY, TOKEN, client_for, make_runtime
from tests.conftest import closed_port_url, rules_for

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "gateway" / "admin" / "static"
CONSOLE_PATHS = {"/admin/ui", "/admin/ui/assets/{name}"}


@pytest.fixture
def app(tmp_path: Path) -> Starlette:
    return create_admin_app(make_runtime(tmp_path), TOKEN)


@pytest.fixture
async def anon(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app, None) as c:
        yield c


def api_templates_in_scripts() -> set[str]:
    """Every admin path the console's scripts name, as a template ("/admin/pools/{}/weight")."""
    found: set[str] = set()
    for name in ASSETS:
        if not name.endswith(".js"):
            continue
        source = (STATIC / name).read_text()
        for m in re.finditer(r"[\"`](/admin/[^\"`]*)[\"`]", source):
            path = re.sub(r"\$\{[^}]*\}", "{}", m.group(1)).split("?")[0]
            if not path.startswith("/admin/ui"):
                found.add(path)
    return found


def fill(template: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", template)


async def test_the_shell_answers_without_a_token_under_a_strict_policy(anon: httpx.AsyncClient) -> None:
    r = await anon.get("/admin/ui")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert csp == CSP
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'"
    assert directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"
    assert "unsafe" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"
    assert "set-cookie" not in r.headers
    html = r.text
    # no inline script, style or event handler: the policy would block them
    assert "<script>" not in html
    assert "<style" not in html
    assert re.search(r"\s(style|on[a-z]+)=", html) is None
    for src in re.findall(r'(?:src|href)="(/admin/ui/assets/[^"]+)"', html):
        a = await anon.get(src)
        assert a.status_code == 200, src
        assert a.headers["content-security-policy"] == CSP


async def test_the_shell_carries_no_data(tmp_path: Path) -> None:
    """The same bytes whatever the config and whoever asks: nothing of the fleet is in the page."""
    (tmp_path / "a").mkdir()
    a = make_runtime(tmp_path / "a", rules_for([closed_port_url()], [closed_port_url()]))
    other = rules_for([closed_port_url()], [closed_port_url()])
    other["pools"][0]["name"] = "zebra-pool"
    for c in other["classes"]:
        c["route"] = {k: ("zebra-pool" if v == "spec" else v) for k, v in c["route"].items()}
    other["classes"][0]["route"]["saturated"] = "std"
    other["classes"][1]["route"]["fallback"] = ["zebra-pool"]
    (tmp_path / "b").mkdir()
    b = make_runtime(tmp_path / "b", other)
    pages: list[bytes] = []
    for rt, token in ((a, TOKEN), (b, "another-token")):
        async with client_for(create_admin_app(rt, token), token) as c:
            pages.append((await c.get("/admin/ui")).content)
            for name in ASSETS:
                pages.append((await c.get(f"/admin/ui/assets/{name}")).content)
    half = len(pages) // 2
    assert pages[:half] == pages[half:]
    everything = b"".join(pages)
    for secret in (TOKEN, "another-token", "zebra-pool", a.live.digest, b.live.digest, CLIENT_KEY):
        assert secret.encode() not in everything


async def test_only_the_listed_files_are_served(anon: httpx.AsyncClient) -> None:
    for name, media_type in ASSETS.items():
        r = await anon.get(f"/admin/ui/assets/{name}")
        assert r.status_code == 200
        assert r.headers["content-type"] == media_type
    for bad in ("index.html", "app.py", "..%2Fapp.py", "..%2F..%2F__init__.py", "%2e%2e/app.py", "missing.js"):
        r = await anon.get(f"/admin/ui/assets/{bad}")
        assert r.status_code in (401, 404), bad  # never a file outside the list
        assert "starlette" not in r.text


async def test_every_call_the_console_makes_is_refused_without_the_token(app: Starlette) -> None:
    doc = openapi()
    templates = {re.sub(r"\{[^}]*\}", "{}", p): p for p in doc["paths"]}
    used = api_templates_in_scripts()
    assert {"/admin/state", "/admin/audit", "/admin/pools/{}/drain", "/admin/reload", "/admin/explain"} <= used
    assert used <= set(templates), "the console calls a path the admin API does not describe"
    described = [(p, m) for p, item in doc["paths"].items() for m in item if p not in CONSOLE_PATHS]
    assert {templates[t] for t in used} <= {p for p, _ in described}
    for token in (None, CLIENT_KEY, "wrong-token", f"{TOKEN}x"):
        async with client_for(app, token) as c:
            for path, method in described:
                r = await c.request(method.upper(), fill(path), json={"reason": "x", "ttl": "1m", "weight": 0})
                assert r.status_code == 401, (token, method, path, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer")
    for path in CONSOLE_PATHS:
        assert doc["paths"][path]["get"]["security"] == []


def test_the_scripts_keep_the_token_in_the_tab_and_never_write_html() -> None:
    sources = {name: (STATIC / name).read_text() for name in ASSETS if name.endswith(".js")}
    for name, source in sources.items():
        for banned in (
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
            "localStorage",
            "document.cookie",
            "http://",
            "https://",
        ):
            if banned == "http://" and "www.w3.org/2000/svg" in source:
                source = source.replace('"http://www.w3.org/2000/svg"', "")
            assert banned not in source, (name, banned)
        if name != "api.js":
            assert "fetch(" not in source, f"{name}: calls go through api.js (token, no cookies)"
    api = sources["api.js"]
    assert 'credentials: "omit"' in api
    assert "sessionStorage" in api
    assert "Authorization = `Bearer ${t}`" in api


def test_the_page_files_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["gateway"]
    files = sorted(p.relative_to(ROOT / "gateway").as_posix() for p in STATIC.iterdir())
    assert set(files) == {f"admin/static/{n}" for n in (*ASSETS, "index.html")}
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f


async def test_state_tells_the_console_what_it_may_do(tmp_path: Path) -> None:
    rules = rules_for([closed_port_url()], [closed_port_url()], admin={"default_ttl_s": 1800, "max_ttl_s": 86400})
    rt: Runtime = make_runtime(tmp_path, rules)
    for token, allowed in ((TOKEN, True), (None, False)):
        async with client_for(create_admin_app(rt, token), token) as c:
            state: dict[str, Any] = (await c.get("/admin/state")).json()
        assert state["admin"] == {
            "changes_allowed": allowed,
            "changes_refused": None,
            "default_ttl_s": 1800,
            "max_ttl_s": 86400,
        }
        assert abs(state["now"] - time.time()) < 5
        ep = state["pools"]["spec"]["endpoints"][0]
        assert (ep["ejected"], ep["ejected_for_s"]) == (False, None)
        # never scraped: the hit rate is unknown (null, never 0); the gateway's index of it is empty
        assert (ep["prefix_hit_ratio"], ep["prefix_index_chunks"]) == (None, 0)
    rt.live.pools["spec"].endpoints[0].eject(time.monotonic(), 30, 60)
    async with client_for(create_admin_app(rt, TOKEN)) as c:
        ep = (await c.get("/admin/state")).json()["pools"]["spec"]["endpoints"][0]
    assert ep["ejected"] is True
    assert 25 < ep["ejected_for_s"] <= 30
