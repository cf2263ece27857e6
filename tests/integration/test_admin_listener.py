"""``specgate serve`` with its admin listener: both listen in one process, a signal stops both."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.cli.serve import AdminSetupError, build_listeners, is_loopback
from gateway.config.settings import Settings, SettingsError
from gateway.proxy.app import create_app
from tests.conftest import MODEL, closed_port_url, rules_for

pytestmark = pytest.mark.integration

TOKEN = "listener-test-token"
CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _wait(url: str, proc: subprocess.Popen[bytes], headers: dict[str, str] | None = None) -> httpx.Response:
    deadline = time.monotonic() + 40  # process start-up on a loaded CI machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}")
        try:
            return httpx.get(url, headers=headers, timeout=1)
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"nothing answered on {url}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_runs_both_listeners_and_a_signal_stops_both(tmp_path: Path, sig: signal.Signals) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    port, admin_port = _free_port(), _free_port()
    env = {**os.environ, "SPECGATE_ADMIN_TOKEN": TOKEN, "SPECGATE_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", str(admin_port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert _wait(f"http://127.0.0.1:{port}/health", proc).status_code == 200
        admin = f"http://127.0.0.1:{admin_port}"
        auth = {"authorization": f"Bearer {TOKEN}"}
        assert _wait(f"{admin}/admin/state", proc).status_code == 401
        state = _wait(f"{admin}/admin/state", proc, auth).json()
        assert set(state["pools"]) == {"spec", "std"}
        r = httpx.post(f"{admin}/admin/explain", json=CODE, headers=auth, timeout=5)
        assert r.json()["traffic_class"]["name"] == "precise"
        # the admin app is not on the client port, and the client app not on the admin port
        assert httpx.get(f"http://127.0.0.1:{port}/admin/state", headers=auth).status_code == 404
        assert httpx.get(f"{admin}/health", headers=auth).status_code == 404
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -sig), out.decode()
    for p in (port, admin_port):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=1)


def _app(tmp_path: Path, **settings: Any) -> tuple[Any, Settings]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    s = Settings(rules=rules, host="127.0.0.1", **settings)
    return create_app(s), s


COMMON = {"host": "127.0.0.1", "port": 1, "log_config": None, "access_log": False}


def test_admin_listener_setup_problems_fail_before_serving(tmp_path: Path) -> None:
    app, s = _app(tmp_path, admin_host="0.0.0.0", admin_port=_free_port())
    with pytest.raises(AdminSetupError, match="needs a token"):
        build_listeners(app, s, COMMON, environ={})
    app, s = _app(tmp_path, api_keys="k1", admin_port=_free_port())
    with pytest.raises(AdminSetupError, match="differ from every client API key"):
        build_listeners(app, s, COMMON, environ={"SPECGATE_ADMIN_TOKEN": "k1"})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        app, s = _app(tmp_path, admin_port=busy.getsockname()[1])
        with pytest.raises(AdminSetupError, match="cannot listen for the admin API"):
            build_listeners(app, s, COMMON, environ={})
    app, s = _app(tmp_path, admin_port=0)
    assert build_listeners(app, s, COMMON, environ={}).admin is None
    listeners = build_listeners(*_app(tmp_path, admin_port=_free_port()), COMMON, environ={"SPECGATE_ADMIN_TOKEN": "t"})
    assert listeners.admin is not None
    assert listeners.admin_socket is not None
    listeners.admin_socket.close()


def test_admin_settings() -> None:
    with pytest.raises(SettingsError, match="admin_port must differ"):
        Settings(rules=Path("x"), port=9000, admin_port=9000)
    with pytest.raises(SettingsError, match="admin_port"):
        Settings(rules=Path("x"), admin_port=70000)
    env = Settings(rules=Path("x"), admin_host="::1", admin_port=0).to_env()
    assert Settings.from_env(env).admin_port == 0
    assert "SPECGATE_ADMIN_TOKEN" not in env  # the token is never a setting
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "example.org")] == [
        True,
        True,
        True,
        False,
        False,
    ]
