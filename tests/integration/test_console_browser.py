"""The on-call console in a real headless Chromium, against a real ``specgate serve`` in front of two simulated
vLLM pools: sign in (a client key is refused with a clear message), see both pools and the classes, drain a pool
with a reason and TTL and see the override counting down and the audit record, see routing move, an API refusal
shown verbatim, force a class and remove that override, undrain, a reload refused with every error's YAML path,
and the read-only mode of a gateway without a token. Screenshots go to ``$SPECGATE_TEST_ARTIFACTS/console``
(default ``build/test-artifacts/console``).

Needs Debian's ``chromium`` (``/usr/bin/chromium``; ``.ci/run`` installs it) and the ``playwright`` package (the
dev extra); never ``playwright install``: the browser is the system's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.sim.launch import free_port, wait_for_port
from gateway.sim.server import SimServer
from gateway.sim.state import SimOptions
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, rules_for

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        f"{CHROMIUM} is missing: the console's browser tests need Debian's chromium (apt-get install chromium; "
        ".ci/run installs it)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is missing: pip install -e '.[dev]'"
)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("SPECGATE_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts")) / "console"
TOKEN = "console-browser-token"
CLIENT_KEY = "console-client-key"
SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
CODE = {
    "model": MODEL,
    "temperature": 0.2,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Write a python function that reverses a list."}],
}
TIMEOUT_MS = 20_000  # a loaded CI machine


class Serve:
    """``specgate serve`` as a process, its admin listener on a port of its own."""

    def __init__(self, rules: Path, log: Path, token: str | None) -> None:
        self.rules = rules
        self.port, self.admin_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k != "SPECGATE_ADMIN_TOKEN"}
        env["SPECGATE_LOG_LEVEL"] = "warning"
        env["SPECGATE_API_KEYS"] = CLIENT_KEY  # from the environment: never a command-line flag (``ps``)
        if token is not None:
            env["SPECGATE_ADMIN_TOKEN"] = token
        cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--admin-port", str(self.admin_port)]
        cmd += ["--health-interval", "0.5"]
        self._log = log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(self.admin_port, 60.0)
            wait_for_port(self.port, 60.0)
        except Exception:
            self.stop()
            raise

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}/admin/ui"

    def chat(self, body: dict[str, Any]) -> httpx.Response:
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        return httpx.post(url, json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    common: dict[str, Any] = {"model": MODEL, "port": 0, "time_scale": 0.02, "seed": 3}
    common["output_lengths"] = OutputLengths(median=8, sigma=0)
    spec = SimServer(SimOptions(speculative_config=SPEC, **common)).start()
    std = SimServer(SimOptions(**common)).start()
    yield spec, std
    spec.stop()
    std.stop()


def _serve(tmp: Path, sims: tuple[SimServer, SimServer], token: str | None) -> Iterator[Serve]:
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([sims[0].url], [sims[1].url]), sort_keys=False))
    server = Serve(rules, tmp / "serve.log", token)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, sims: tuple[SimServer, SimServer]) -> Iterator[Serve]:
    yield from _serve(tmp_path_factory.mktemp("console-token"), sims, TOKEN)


@pytest.fixture(scope="module")
def gw_readonly(tmp_path_factory: pytest.TempPathFactory, sims: tuple[SimServer, SimServer]) -> Iterator[Serve]:
    yield from _serve(tmp_path_factory.mktemp("console-readonly"), sims, None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 720})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    sync_api.expect.set_options(timeout=TIMEOUT_MS)
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(str(e)))
    pg.problems = problems
    yield pg
    context.close()


def shot(page: Any, name: str, *, full: bool = True) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    if full:  # from the top, or the sticky header is drawn where the page was scrolled to
        page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / name), full_page=full)


def no_page_errors(page: Any) -> None:
    """Nothing broke in the page, and the Content-Security-Policy blocked nothing it needs (a violation is a console
    error). The 401s of a refused sign-in are the only errors a browser logs by itself."""
    real = [p for p in page.problems if "401" not in p and "status of 4" not in p]
    assert real == []


def confirm(page: Any, reason: str) -> None:
    page.fill("#confirm-reason", reason)
    page.click("#confirm-ok")
    sync_api.expect(page.locator("#confirm")).not_to_be_visible()


def test_sign_in_drain_see_routing_move_force_remove_undrain_and_reload(gw: Serve, page: Any) -> None:
    expect = sync_api.expect
    assert gw.chat(CODE).headers["x-specgate-pool"] == "spec"  # low-temperature code: the speculative pool

    page.goto(gw.ui)
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#main")).to_be_hidden()
    shot(page, "sign-in.png")
    page.fill("#login-token", CLIENT_KEY)  # a client API key is not the admin token
    page.click("#login-form button[type=submit]")
    expect(page.locator("#login-error")).to_have_text("The gateway refused this token: invalid admin token")

    page.fill("#login-token", TOKEN)
    page.fill("#login-actor", "alice")
    page.click("#login-form button[type=submit]")
    spec, std = page.locator('article[data-pool="spec"]'), page.locator('article[data-pool="std"]')
    expect(spec).to_be_visible()
    expect(std).to_be_visible()
    expect(page.locator('tr[data-class="precise"]')).to_be_visible()
    expect(page.locator('tr[data-class="default"]')).to_be_visible()
    expect(page.locator("#mode")).to_have_text("signed in as alice")
    expect(spec.locator("tbody tr")).to_have_count(1)
    expect(spec.locator("tbody")).to_contain_text("healthy")

    # keyboard: a focused button opens its dialog with Enter, Escape cancels, focus comes back across redraws
    drain = spec.get_by_role("button", name="Drain")
    drain.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#confirm")).to_be_visible()
    expect(page.locator("#confirm-reason")).to_be_focused()
    page.wait_for_timeout(2500)  # at least one refresh redraws the pools behind the dialog
    page.keyboard.press("Escape")
    expect(page.locator("#confirm")).not_to_be_visible()
    expect(drain).to_be_focused()
    page.wait_for_timeout(2500)
    expect(drain).to_be_focused()  # a redraw keeps it

    # drain spec: reason and TTL required, the confirmation names the effect
    spec.get_by_role("button", name="Drain").click()
    expect(page.locator("#confirm")).to_be_visible()
    expect(page.locator("#confirm-ttl")).to_have_value("1h")  # the YAML's admin.default_ttl_s
    effect = page.locator("#confirm-effect")
    expect(effect).to_have_text("No new requests to pool spec for 1h; requests in flight finish.")
    page.fill("#confirm-ttl", "30m")
    expect(effect).to_have_text("No new requests to pool spec for 30m; requests in flight finish.")
    page.click("#confirm-ok")
    expect(page.locator("#confirm-error")).to_contain_text("A reason is required")
    shot(page, "drain-dialog.png", full=False)
    page.fill("#confirm-reason", "INC")
    expect(page.locator("#confirm-error")).to_have_text("")  # the warning goes once there is a reason
    confirm(page, "INC-42: spec pool maintenance")
    expect(page.locator("#banner")).to_contain_text("Pool spec drained")
    expect(spec).to_contain_text("INC-42: spec pool maintenance")  # the pool card says why it is drained

    row = page.locator("#overrides tbody tr").filter(has_text="drain pool spec")
    expect(row).to_be_visible()
    expect(row).to_contain_text("INC-42: spec pool maintenance")
    expect(row).to_contain_text("alice (console)")
    expect(row.locator(".countdown")).to_have_text(re.compile(r"^(29m \d\ds|30m) left$"))
    expect(spec.locator("header")).to_contain_text("drained")
    expect(spec.locator(".pool-overrides")).to_contain_text("drain pool spec")
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, "console.png", full=False)  # the one in docs/console.md
    audit = page.locator("#audit tbody tr").filter(has_text="drain").filter(has_text="pool/spec")
    expect(audit.first).to_contain_text("alice (console)")
    expect(audit.first).to_contain_text("INC-42")
    page.fill("#audit-actor", "nobody")
    expect(page.locator("#audit tbody")).to_contain_text("No record matches the filter.")
    page.fill("#audit-actor", "alice")
    expect(audit.first).to_be_visible()

    # routing moved: the same request now lands on the standard pool, and explain says so
    assert gw.chat(CODE).headers["x-specgate-pool"] == "std"
    page.fill("#explain-body", json.dumps(CODE))
    page.click("#explain-form button[type=submit]")
    expect(page.locator('[data-explain="class"]')).to_have_text("precise")
    expect(page.locator('[data-explain="first-pool"]')).to_have_text("std")
    expect(page.locator("#explain-out")).to_contain_text("Live numbers compared")
    page.fill("#explain-body", "{not json")
    page.click("#explain-form button[type=submit]")
    expect(page.locator("#explain-out .error")).to_contain_text("400")
    shot(page, "drained.png")

    # a refusal is shown exactly as the API words it
    expected = httpx.put(
        f"http://127.0.0.1:{gw.admin_port}/admin/pools/spec/endpoints/spec-0/weight",
        json={"weight": -1, "reason": "x"},
        headers={"authorization": f"Bearer {TOKEN}"},
    ).json()["error"]
    spec.get_by_role("button", name="Set the weight of endpoint spec-0").click()
    page.fill("#confirm-weight", "-1")
    page.fill("#confirm-reason", "x")
    page.click("#confirm-ok")
    expect(page.locator("#confirm-error")).to_have_text(f"400 {expected['code']}: {expected['message']}")
    page.click("#confirm-cancel")
    expect(page.locator("#confirm")).not_to_be_visible()

    # force a class, then remove that override from the overrides table
    page.locator('tr[data-class="default"]').get_by_role("button", name="Speculative").click()
    expect(effect).to_contain_text("Requests of class default go to its speculative pool first for 1h")
    confirm(page, "testing the force")
    forced = page.locator("#overrides tbody tr").filter(has_text="class default forced to speculative")
    expect(forced).to_be_visible()
    expect(page.locator('tr[data-class="default"]')).to_contain_text("forced speculative")
    forced.get_by_role("button", name="Remove").click()
    expect(effect).to_contain_text('The override "class default forced to speculative" ends now')
    confirm(page, "done testing")
    expect(forced).to_have_count(0)
    expect(page.locator("#audit tbody tr").filter(has_text="remove").first).to_contain_text("done testing")

    # undrain
    spec.get_by_role("button", name="Undrain").click()
    expect(effect).to_have_text("Pool spec takes new requests again: its drain is removed now.")
    confirm(page, "maintenance over")
    expect(page.locator("#overrides")).to_contain_text("No overrides")
    expect(page.locator("#audit tbody tr").filter(has_text="undrain").first).to_contain_text("maintenance over")
    assert gw.chat(CODE).headers["x-specgate-pool"] == "spec"

    # a reload of a broken YAML: refused, every error listed with its path, nothing changed
    good = gw.rules.read_text()
    broken = yaml.safe_load(good)
    broken["classes"][0]["route"]["fallback"] = ["nope"]
    broken["classes"][1]["route"]["preferred"] = "nah"
    gw.rules.write_text(yaml.safe_dump(broken, sort_keys=False))
    try:
        page.click("#reload-btn")
        expect(effect).to_contain_text("Re-read")
        page.click("#confirm-ok")
        issues = page.locator("#confirm-issues li")
        expect(issues.filter(has_text="classes[0].route.fallback[0]")).to_have_count(1)
        expect(issues.filter(has_text="classes[1].route.preferred")).to_have_count(1)
        refused = "422 invalid_config: 2 problem(s) in the file; nothing changed."
        expect(page.locator("#confirm-error")).to_have_text(refused)
        expect(page.locator("#confirm-error")).not_to_contain_text("classes[0]")  # each error once, in the list
        shot(page, "reload-refused.png", full=False)
        page.click("#confirm-cancel")
    finally:
        gw.rules.write_text(good)
    assert gw.chat(CODE).headers["x-specgate-pool"] == "spec"

    # phone width: one column, still usable
    page.set_viewport_size({"width": 390, "height": 844})
    expect(spec.get_by_role("button", name="Drain")).to_be_visible()
    shot(page, "phone.png")
    page.emulate_media(color_scheme="dark")
    page.set_viewport_size({"width": 1280, "height": 720})
    shot(page, "dark.png", full=False)

    page.click("#logout-btn")
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('specgate.admin.token')") is None
    assert page.context.cookies() == []
    no_page_errors(page)


def test_read_only_without_a_token(gw_readonly: Serve, page: Any) -> None:
    expect = sync_api.expect
    cluster = {"enabled": True, "replica": "r1", "role": "follower", "leader": "r0", "snapshot_age_s": 0.4}

    def as_follower(route: Any) -> None:  # this replica's state as a cluster follower would report it
        state = route.fetch().json()
        assert state["cluster"] == {"enabled": False, "role": "local"}
        route.fulfill(json={**state, "cluster": {**cluster, "stale_after_s": 3.0, "contributions": {}}})

    page.route("**/admin/state", as_follower)
    page.goto(gw_readonly.ui)
    expect(page.locator("#cluster-summary")).to_have_text("cluster: r1 follows r0 · snapshot 0.4s old")
    page.unroute("**/admin/state")
    expect(page.locator("#cluster-summary")).to_have_text("")
    expect(page.locator('article[data-pool="spec"]')).to_be_visible()
    expect(page.locator('article[data-pool="std"]')).to_be_visible()
    # per endpoint, the server's measured prefix-cache hit rate ("–" while the scrapes have not measured one)
    expect(page.locator('article[data-pool="spec"] table.endpoints th', has_text="prefix hits")).to_be_visible()
    hits = page.locator('article[data-pool="spec"] table.endpoints td[data-col="prefix hits"]').first
    expect(hits).to_have_text(re.compile(r"^(–|\d+%)$"))
    expect(page.locator("#login")).to_be_hidden()
    expect(page.locator("#mode")).to_have_text("read-only: no admin token on this gateway")
    expect(page.locator("#reload-btn")).to_be_hidden()
    expect(page.get_by_role("button", name="Drain")).to_have_count(0)
    expect(page.get_by_role("button", name="Remove")).to_have_count(0)
    page.fill("#explain-body", json.dumps(CODE))
    page.click("#explain-form button[type=submit]")
    expect(page.locator('[data-explain="first-pool"]')).to_have_text("spec")
    shot(page, "read-only.png")
    no_page_errors(page)


def test_the_tenants_panel_shows_the_last_minutes_and_the_waiting_room(gw_readonly: Serve, page: Any) -> None:
    expect = sync_api.expect
    limits = {"max_concurrent": None, "requests_per_minute": 600, "tokens_per_minute": None}
    tenants = [
        {
            "name": "flood",
            "priority": 0,
            "weight": 1.0,
            "in_flight": 12,
            "shed": 40,
            "limited": 7,
            "recent": {"window_s": 300.0, "shed": 3, "limited": 0},
            "limits": limits,
            "pools": {"std": {"in_flight": 12, "share": 5.33, "bound": 16}},
            "waiting": {"std": 4},
        },
        {
            "name": "steady",
            "priority": 0,
            "weight": 2.0,
            "in_flight": 2,
            "shed": 0,
            "limited": 0,
            "recent": {"window_s": 300.0, "shed": 0, "limited": 0},
            "limits": None,
            "pools": {"std": {"in_flight": 2, "share": 10.67, "bound": 16}},
            "waiting": {},
        },
    ]

    def with_tenants(route: Any) -> None:  # this gateway's state as one with a tenants file would report it
        route.fulfill(json={**route.fetch().json(), "tenants": tenants})

    page.route("**/admin/state", with_tenants)
    page.goto(gw_readonly.ui)
    flood = page.locator('#tenants tr[data-tenant="flood"]')
    expect(flood).to_contain_text("std: 12 of share 5.3 (bound 16)")
    expect(flood).to_contain_text("above share")
    expect(flood).to_contain_text("4 waiting")
    expect(page.locator("#tenants th", has_text="shed (5 min)")).to_be_visible()
    cells = flood.locator("td")
    expect(cells.nth(4)).to_have_text("3")  # shed in the last 5 minutes, not the 40 since start
    expect(cells.nth(4)).to_have_attribute("title", "40 since start (this process)")
    expect(cells.nth(5)).to_have_text("0")
    steady = page.locator('#tenants tr[data-tenant="steady"]')
    expect(steady).not_to_contain_text("waiting")
    shot(page, "tenants.png")
    no_page_errors(page)
