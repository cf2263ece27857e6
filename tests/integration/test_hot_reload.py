"""Hot reload against real sockets: the file watcher of a served gateway, the admin routes, SIGHUP to a serve process.

A valid change takes effect within about two seconds while a stream opened before the swap runs to its end; an
invalid file dropped in place changes nothing and is reported (log, metric, admin 422).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin.app import create_admin_app
from gateway.runtime.container import Runtime
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for, static_routes

pytestmark = pytest.mark.integration

TOKEN = "hot-reload-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}]}  # class "default": std


def _write_atomically(path: Path, rules: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(rules, sort_keys=False))
    os.replace(tmp, path)


def _reloads(base_url: str, result: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    m = re.search(rf'^specgate_config_reload_total\{{result="{result}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _started(server: FakeUpstreamServer) -> int:
    return server.state.stats()["started"]


@pytest.fixture
def admin() -> Iterator[Callable[[Runtime], ServerThread]]:
    started: list[ServerThread] = []

    def start(rt: Runtime) -> ServerThread:
        server = ServerThread(create_admin_app(rt, TOKEN)).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


def test_a_valid_change_takes_effect_without_cutting_a_stream_opened_before(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread]
) -> None:
    spec, std = fake("spec"), fake("std")
    rules = static_routes(rules_for([spec.url], [std.url]))  # no controller: a route change takes effect at once
    gw = gateway(rules)
    rt: Runtime = gw.app.state.runtime  # type: ignore[attr-defined]
    old = rt.live

    first_chunk = threading.Event()
    got: dict[str, Any] = {}

    def stream() -> None:
        headers = {"x-fake-behavior": "tokens=30,token_delay=0.1"}  # about 3 s
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
            got["status"] = r.status_code
            parts = []
            for chunk in r.iter_bytes():
                parts.append(chunk)
                first_chunk.set()
            got["body"] = b"".join(parts)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first_chunk.wait(10)
    assert _started(std) == 1

    # the change: class "default" now prefers the speculative pool; the std pool's timeouts change (a new client)
    new = static_routes(rules_for([spec.url], [std.url]))
    new["classes"][1]["route"] = {"preferred": "spec", "fallback": ["std"]}
    new["pools"][1]["timeouts"]["total_s"] = 25
    spec_before = _started(spec)
    _write_atomically(rt.settings.rules, new)

    def routed_to_spec() -> bool:
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200, r.text
        return _started(spec) > spec_before

    took = _wait_for(routed_to_spec, 4, "the new route in force")
    assert took < 2.5
    assert rt.live is not old
    assert rt.live.clients["std"] is not old.clients["std"]
    assert _reloads(gw.url, "ok") == 1

    t.join(15)
    assert not t.is_alive()
    assert got["status"] == 200
    body: bytes = got["body"]
    assert b"tok30" in body
    assert body.rstrip().endswith(b"data: [DONE]")
    assert std.state.stats()["completed"] >= 1
    assert std.state.stats()["aborted"] == 0
    # the old std client is closed once its stream is over (after the retirer's grace period)
    _wait_for(lambda: rt.reloader.retirer.pending == 0, 6, "the old client closed")


def test_an_invalid_yaml_dropped_in_place_changes_nothing_and_is_reported(
    fake: Callable[..., FakeUpstreamServer],
    gateway: Callable[..., ServerThread],
    admin: Callable[[Runtime], ServerThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec, std = fake("spec"), fake("std")
    gw = gateway(rules_for([spec.url], [std.url]))
    rt: Runtime = gw.app.state.runtime  # type: ignore[attr-defined]
    adm = admin(rt)
    good = rt.live
    path = rt.settings.rules
    text = path.read_text()

    bad = rules_for([spec.url], [std.url])
    bad["defaults"]["max_attempts"] = 0
    bad["pools"][1]["endpoints"][0]["weight"] = -1
    with caplog.at_level(logging.ERROR, logger="specgate"), path.open("r+") as f:  # in place, like an editor
        f.truncate(0)
        f.write(yaml.safe_dump(bad, sort_keys=False))
    with caplog.at_level(logging.ERROR, logger="specgate"):
        _wait_for(lambda: _reloads(gw.url, "invalid") == 1, 4, "the invalid file reported")
    assert rt.live is good
    logged = "\n".join(caplog.messages)
    assert "defaults.max_attempts" in logged
    assert "pools[1].endpoints[0].weight" in logged
    # the last good config keeps serving
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200
    assert _started(std) == 1

    r = httpx.post(f"{adm.url}/admin/reload", headers=AUTH, timeout=10)
    assert r.status_code == 422
    body = r.json()
    assert body["error"]["code"] == "invalid_config"
    assert {e["path"] for e in body["error"]["errors"]} == {"defaults.max_attempts", "pools[1].endpoints[0].weight"}
    config = httpx.get(f"{adm.url}/admin/config", headers=AUTH, timeout=10).json()
    assert config["hash"] == good.digest
    assert config["yaml"] == text
    assert _reloads(gw.url, "invalid") == 2  # the watcher once, the admin once
    audit = httpx.get(f"{adm.url}/admin/audit", headers=AUTH, timeout=10).json()["records"]
    reloads = [(a["actor"].split(":")[0], a["detail"]["result"]) for a in audit if a["action"] == "config_reload"]
    assert reloads == [("watcher", "invalid"), ("admin", "invalid")]  # admin:<token fingerprint>

    # fixed: picked up by the watcher
    path.write_text(text.replace("max_attempts: 2", "max_attempts: 3"))
    _wait_for(lambda: rt.live is not good, 4, "the fixed file loaded")
    assert rt.live.rules.defaults.max_attempts == 3
    assert _reloads(gw.url, "ok") == 1


# -- SIGHUP to a `specgate serve` process ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _wait_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 40  # process start-up on a loaded CI machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"nothing answered on {url}")


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_sighup_reloads_a_serve_process(tmp_path: Path, fake: Callable[..., FakeUpstreamServer]) -> None:
    spec, std = fake("spec"), fake("std")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([spec.url], [std.url]), sort_keys=False))
    port, admin_port = _free_port(), _free_port()
    env = {**os.environ, "SPECGATE_ADMIN_TOKEN": TOKEN, "SPECGATE_LOG_LEVEL": "info"}
    cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", str(admin_port)]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    base, adm = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        _wait_up(f"{base}/health", proc, log)
        _wait_up(f"{adm}/admin/config", proc, log)
        before = httpx.get(f"{adm}/admin/config", headers=AUTH, timeout=5).json()

        # the same file: the watcher never hands it on, so this reload can only come from the signal
        proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: _reloads(base, "unchanged") == 1, 5, "the SIGHUP reload")
        audit = httpx.get(f"{adm}/admin/audit", headers=AUTH, timeout=5).json()["records"]
        assert [(a["actor"], a["detail"]["trigger"]) for a in audit if a["action"] == "config_reload"] == [
            ("signal", "sighup")
        ]

        # a new class: in force (by the signal or the watcher, whichever comes first) and shown by /admin/config
        new = rules_for([spec.url], [std.url])
        new["classes"].insert(1, {"name": "bulk", "when": {"temperature": {"gte": 1.5}}, "route": {"preferred": "std"}})
        _write_atomically(rules, new)
        proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: _reloads(base, "ok") == 1, 5, "the new config loaded")
        after = httpx.get(f"{adm}/admin/config", headers=AUTH, timeout=5).json()
        assert after["hash"] != before["hash"]
        assert after["yaml"] == rules.read_text()
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert f'specgate_config_info{{hash="{after["hash"]}",version="1"}} 1.0' in metrics
        assert before["hash"] not in metrics
        r = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "temperature": 1.8}, timeout=10)
        assert r.headers["x-specgate-class"] == "bulk"
        assert proc.poll() is None  # SIGHUP did not stop it
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "config reload (sighup)" in log.read_text()
