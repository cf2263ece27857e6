"""What the gateway shows to whom, against real servers: /metrics behind the client keys (or its own token), error
bodies that name no endpoint and quote no pool but carry the request id, client keys never on the command line, and
a token-less admin listener that answers only its own Host names (DNS rebinding)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import MODEL, ServerThread, rules_for

pytestmark = pytest.mark.integration

Gateway = Callable[..., ServerThread]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
GARBAGE = b"SPEAKING NO HTTP \x00\x01 at all\r\n\r\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class GarbageUpstream:
    """Healthy to the gateway's probes (/health, /metrics), garbage bytes for anything else."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                length = next(
                    (int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length"), 0
                )
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                if path in ("/health", "/metrics"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                self.answered += 1
                conn.sendall(GARBAGE)
                return
        except OSError:
            return
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)


@pytest.fixture
def garbage() -> Iterator[Callable[[], GarbageUpstream]]:
    started: list[GarbageUpstream] = []

    def start() -> GarbageUpstream:
        server = GarbageUpstream()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


# -- /metrics ------------------------------------------------------------------------------------------------------


def test_metrics_follow_the_client_keys(fake: Callable[..., object], gateway: Gateway) -> None:
    std = fake("std")
    url = std.url  # type: ignore[attr-defined]
    keyed = gateway(rules_for([url], [url]), api_keys="tenant-a,tenant-b")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "tenant-a"}):
        r = httpx.get(keyed.url + "/metrics", headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        assert "specgate_" not in r.text
    r = httpx.get(keyed.url + "/metrics", headers={"authorization": "Bearer tenant-b"})
    assert r.status_code == 200
    assert "specgate_requests_total" in r.text
    # /health and /ready stay open: the load balancer probes them without a key
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/ready").status_code == 200

    # A metrics token: Prometheus's own bearer, and a client key no longer opens /metrics.
    scraped = gateway(rules_for([url], [url]), api_keys="tenant-a", metrics_token="scrape-me")
    assert httpx.get(scraped.url + "/metrics", headers={"authorization": "Bearer tenant-a"}).status_code == 401
    r = httpx.get(scraped.url + "/metrics", headers={"authorization": "Bearer scrape-me"})
    assert r.status_code == 200
    assert "specgate_requests_total" in r.text
    r = httpx.post(scraped.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer scrape-me"})
    assert r.status_code == 401  # the metrics token is no client key

    # An open gateway (no keys, no token) keeps an open /metrics.
    open_gw = gateway(rules_for([url], [url]))
    assert httpx.get(open_gw.url + "/metrics").status_code == 200


# -- error bodies --------------------------------------------------------------------------------------------------


def test_a_503_after_garbage_names_no_endpoint_and_carries_the_request_id(
    garbage: Callable[[], GarbageUpstream], gateway: Gateway, capfd: pytest.CaptureFixture[str]
) -> None:
    spec, std = garbage(), garbage()
    gw = gateway(rules_for([spec.url], [std.url]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "trace-me-42"}, timeout=30)
    assert r.status_code == 503, r.text
    assert spec.answered + std.answered == 2  # both pools were tried and answered garbage
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("service_unavailable", "upstream_unavailable")
    message = err["message"]
    assert message.endswith("(request id trace-me-42)"), message
    assert r.headers["x-request-id"] == "trace-me-42"
    for secret in ("spec-0", "std-0", spec.url, std.url, str(spec.port), str(std.port), "SPEAKING", "Error"):
        assert secret not in message, (secret, message)
    assert "spec: " in message
    assert "std: " in message

    # The access log line of the same request id says what the client was not told.
    logged = ""
    deadline = time.monotonic() + 10  # the access log is written in batches by a background task
    while time.monotonic() < deadline:
        logged += capfd.readouterr().err
        line = next((x for x in logged.splitlines() if '"request_id":"trace-me-42"' in x), None)
        if line is not None:
            break
        time.sleep(0.1)
    assert line is not None, logged
    assert "spec-0" in line
    assert "std-0" in line
    assert "malformed response" in line

    # A stream: the same 503 before anything was sent.
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
    assert r.status_code == 503
    assert "spec-0" not in r.text
    assert spec.url not in r.text
    assert r.json()["error"]["message"].endswith(f"(request id {r.headers['x-request-id']})")


def test_client_refusals_carry_the_request_id(fake: Callable[..., object], gateway: Gateway) -> None:
    std = fake("std")
    url = std.url  # type: ignore[attr-defined]
    gw = gateway(rules_for([url], [url]), api_keys="k1")
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{not json", headers={"authorization": "Bearer k1"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].endswith(f"(request id {r.headers['x-request-id']})")


# -- keys and the admin listener, on a real `specgate serve` ------------------------------------------------------


def _rules(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([url], [url])))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env.update(SPECGATE_LOG_LEVEL="warning", **extra)
    return env


def test_api_keys_on_the_command_line_are_refused(tmp_path: Path, fake: Callable[..., object]) -> None:
    rules = _rules(tmp_path, fake("std").url)  # type: ignore[attr-defined]
    cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--port", str(_free_port())]
    cmd += ["--admin-port", str(_free_port())]
    done = subprocess.run([*cmd, "--api-keys", "sk-visible-in-ps"], env=_env(), capture_output=True, timeout=60)
    assert done.returncode == 2
    said = (done.stdout + done.stderr).decode()
    assert "SPECGATE_API_KEYS" in said, said
    assert "--api-keys-file" in said, said
    assert "sk-visible-in-ps" not in said


def _wait(url: str, proc: subprocess.Popen[bytes], **kw: object) -> httpx.Response:
    deadline = time.monotonic() + 60  # process start-up on a loaded machine
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited with {proc.returncode}"
        try:
            return httpx.get(url, timeout=2, **kw)  # type: ignore[arg-type]
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"nothing answered on {url}")


def test_keys_from_the_environment_and_an_admin_listener_that_checks_host(
    tmp_path: Path, fake: Callable[..., object]
) -> None:
    rules = _rules(tmp_path, fake("std").url)  # type: ignore[attr-defined]
    port, admin_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", str(admin_port)]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=_env(SPECGATE_API_KEYS="env-key"), stdout=out, stderr=subprocess.STDOUT)
    try:
        gw, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        assert _wait(gw + "/health", proc).status_code == 200
        # the keys came from the environment
        assert httpx.get(gw + "/v1/models").status_code == 401
        assert httpx.get(gw + "/v1/models", headers={"authorization": "Bearer env-key"}).status_code == 200
        assert httpx.get(gw + "/metrics").status_code == 401
        assert httpx.get(gw + "/metrics", headers={"authorization": "Bearer env-key"}).status_code == 200

        # no admin token: loopback only, and only under its own names
        for host in ("evil.example", f"evil.example:{admin_port}", "127.0.0.1.evil.example", "localhost.:1"):
            r = _wait(admin + "/admin/state", proc, headers={"host": host})
            assert r.status_code == 421, (host, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_host"
            assert err["type"] == "invalid_request_error"
            assert "pools" not in r.json()
        assert httpx.get(admin + "/admin/ui", headers={"host": "evil.example"}).status_code == 421
        for host in (f"127.0.0.1:{admin_port}", f"localhost:{admin_port}", "localhost", "[::1]:9999"):
            r = httpx.get(admin + "/admin/state", headers={"host": host}, timeout=5)
            assert r.status_code == 200, (host, r.text)
        assert "pools" in httpx.get(admin + "/admin/state", timeout=5).json()  # httpx's own Host: 127.0.0.1:port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "env-key" not in log.read_text(errors="replace")
