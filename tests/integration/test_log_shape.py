"""``specgate serve``'s stderr: every line one JSON object of one shape (``ts``, ``level``, ``logger``, ``event``,
the event's fields as fields), uvicorn's own lines included and naming their listener, each event once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import yaml

from gateway.sim.launch import free_port
from tests.conftest import MODEL, closed_port_url, rules_for


def test_every_line_has_one_shape_and_uvicorn_names_its_listener(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    port, admin_port = free_port(), free_port()
    env = {**os.environ, "SPECGATE_ADMIN_TOKEN": "t" * 32, "SPECGATE_LOG_LEVEL": "info"}
    cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", str(admin_port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{admin_port}/admin/state", timeout=1)
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, "serve exited"
                assert time.monotonic() < deadline, "serve did not start"
                time.sleep(0.1)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=10).status_code == 503
        time.sleep(0.5)  # the access log is written out every 0.2 s
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [orjson.loads(raw) for raw in err.splitlines() if raw.strip()]
    assert lines, "nothing logged"
    for line in lines:
        assert list(line)[:4] == ["ts", "level", "logger", "event"], line
        assert line["ts"].endswith("Z")
    uvicorn = [line for line in lines if line["logger"].startswith("uvicorn")]
    started = [line for line in uvicorn if "Started server process" in line.get("message", "")]
    assert sorted(line.get("listener") for line in started) == ["admin", "client"], uvicorn
    (request,) = [line for line in lines if line["event"] == "request"]
    assert (request["logger"], request["status"], request["path"]) == ("specgate.access", 503, "/v1/chat/completions")
    assert not any(isinstance(line.get("message"), str) and line["message"].startswith("{") for line in lines)
