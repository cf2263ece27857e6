"""Two real gateway processes (``python -m gateway serve`` with an admin listener) sharing one private redis-server,
in front of fake vLLM pools: an override made through one replica is in force on the other within a second, a TTL
override expires on both and is audited once, overrides survive a restart of both gateways, and a drain lets an
open stream finish. Plus the Redis override store's own contract."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway.overrides.store import RedisOverrideStore
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, RedisServer, rules_for

pytestmark = pytest.mark.integration

TOKEN = "replicas-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}
REASON = {"reason": "integration test"}
Fake = Callable[..., FakeUpstreamServer]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class Gateway:
    """One ``specgate serve`` process with its admin listener; ``restart()`` keeps its ports."""

    def __init__(self, name: str, rules: Path, redis_url: str, log: Path) -> None:
        self.name = name
        self.port, self.admin_port = _free_port(), _free_port()
        self._rules, self._redis_url, self._log = rules, redis_url, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> Gateway:
        env = {**os.environ, "SPECGATE_ADMIN_TOKEN": TOKEN, "SPECGATE_LOG_LEVEL": "warning"}
        cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(self._rules), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--admin-port", str(self.admin_port), "--redis-url", self._redis_url]
        cmd += ["--health-interval", "0.2", "--health-timeout", "0.5"]
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 40  # process start-up on a loaded CI machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}: {self._log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.name} did not get ready: {self._log.read_text()[-3000:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def state(self) -> dict[str, Any]:
        r = httpx.get(f"{self.admin}/admin/state", headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def change(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.request(method, f"{self.admin}{path}", json=body, headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def audit(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.admin}/admin/audit?limit=1000", headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        records: list[dict[str, Any]] = r.json()["records"]
        return records

    def pool_of(self, body: dict[str, Any]) -> str:
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        return r.headers["x-specgate-pool"]

    def spec_weight(self) -> float:
        return float(self.state()["pools"]["spec"]["endpoints"][0]["effective_weight"])


def wait_for(check: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until ``check()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s")
        time.sleep(step_s)
    return time.monotonic() - start


@pytest.fixture
def replicas(
    redis_server: RedisServer, fake: Fake, tmp_path: Path
) -> Iterator[tuple[Gateway, Gateway, FakeUpstreamServer]]:
    spec = fake("spec", tokens=20, token_delay_s=0.05)
    std = fake("std", tokens=4)
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([spec.url], [std.url])))
    a = Gateway("a", rules, redis_server.url, tmp_path / "a.log")
    b = Gateway("b", rules, redis_server.url, tmp_path / "b.log")
    try:
        a.start()
        b.start()
        yield a, b, spec
    finally:
        a.stop()
        b.stop()


def test_a_weight_flipped_through_a_changes_routing_on_b_within_a_second(
    replicas: tuple[Gateway, Gateway, FakeUpstreamServer],
) -> None:
    a, b, _ = replicas
    assert b.pool_of(CODE) == "spec"
    a.change("PUT", "/admin/pools/spec/weight", {"weight": 0, "ttl": "10m", **REASON})
    took = wait_for(lambda: b.spec_weight() == 0.0, 1.0)
    assert took < 1.0
    assert {b.pool_of(CODE) for _ in range(3)} == {"std"}
    # and back, through B this time
    b.change("PUT", "/admin/classes/precise/route", {"route": "standard", **REASON})
    [o] = [x for x in b.state()["overrides"] if x["kind"] == "class_route"]
    wait_for(lambda: any(x["id"] == o["id"] for x in a.state()["overrides"]), 1.0)
    b.change("DELETE", f"/admin/overrides/{a.state()['overrides'][0]['id']}", {})
    wait_for(lambda: a.spec_weight() == 1.0, 1.0)


def test_a_ttl_override_expires_on_both_and_is_audited_once(
    replicas: tuple[Gateway, Gateway, FakeUpstreamServer],
) -> None:
    a, b, _ = replicas
    o = a.change("POST", "/admin/pools/spec/drain", {"ttl": "2s", **REASON})["override"]
    wait_for(lambda: b.spec_weight() == 0.0, 1.0)
    assert a.spec_weight() == 0.0
    assert b.pool_of(CODE) == "std"
    wait_for(lambda: a.spec_weight() == 1.0 and b.spec_weight() == 1.0, 4.0, step_s=0.1)
    assert a.state()["overrides"] == []
    assert b.state()["overrides"] == []
    assert b.pool_of(CODE) == "spec"
    time.sleep(0.6)  # both replicas had their expiry tick
    for gw in (a, b):
        expiries = [r for r in gw.audit() if r["action"] == "expire"]
        assert [r["detail"]["override"]["id"] for r in expiries] == [o["id"]], gw.name
    assert [r["action"] for r in a.audit() if r["target"] == "pool/spec"] == ["drain", "expire"]


def test_restarting_both_gateways_keeps_the_overrides(replicas: tuple[Gateway, Gateway, FakeUpstreamServer]) -> None:
    a, b, _ = replicas
    w = a.change("PUT", "/admin/pools/spec/endpoints/spec-0/weight", {"weight": 0, "ttl": "1h", **REASON})
    f = a.change("PUT", "/admin/classes/default/route", {"route": "speculative", "ttl": "never", **REASON})
    ids = {w["override"]["id"], f["override"]["id"]}
    a.stop()
    b.stop()
    a.start()
    b.start()
    for gw in (a, b):
        state = gw.state()
        assert {o["id"] for o in state["overrides"]} == ids, gw.name
        assert state["pools"]["spec"]["endpoints"][0]["effective_weight"] == 0.0
        assert next(c for c in state["classes"] if c["name"] == "default")["forced_route"] == "speculative"
        assert gw.pool_of(CODE) == "std"  # spec's only endpoint has weight 0
    assert any(r["action"] == "class_route" for r in b.audit())  # the audit survived too


def test_a_drain_lets_an_open_stream_finish(replicas: tuple[Gateway, Gateway, FakeUpstreamServer]) -> None:
    a, b, spec = replicas
    body = {**CODE, "stream": True}
    with httpx.Client(timeout=20) as client, client.stream("POST", f"{b.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["x-specgate-pool"] == "spec"
        chunks = r.iter_text()
        first = next(chunks)
        assert first.startswith("data:")
        a.change("POST", "/admin/pools/spec/drain", REASON)
        wait_for(lambda: b.spec_weight() == 0.0, 1.0)
        assert b.pool_of(CODE) == "std"  # a new request while the stream is still open
        rest = "".join(chunks)
    text = first + rest
    assert text.rstrip().endswith("data: [DONE]")
    assert '"error"' not in text
    assert text.count("data:") >= 20
    assert spec.state.aborted == 0


# -- the Redis override store ----------------------------------------------------------------------------------


async def test_redis_override_store_contract(redis_server: RedisServer) -> None:
    one = RedisOverrideStore.from_url(redis_server.url, prefix="t:")
    two = RedisOverrideStore.from_url(redis_server.url, prefix="t:")
    one.audit_capacity = 3
    try:
        assert await one.put("k", "id1", b"one") is None
        assert await two.put("k", "id2", b"two") == b"one"
        assert await one.list_overrides() == [b"two"]
        assert await one.delete("k", "id1") is None
        results = await asyncio.gather(one.delete("k", "id2"), two.delete("k", "id2"))
        assert sorted(results, key=lambda x: x is None) == [b"two", None]  # exactly one deleter wins
        for i in range(5):
            await one.append_audit(100.0 + i, orjson.dumps({"i": i}))
        assert [orjson.loads(x)["i"] for x in await two.audit(10)] == [2, 3, 4]
        assert [orjson.loads(x)["i"] for x in await two.audit(10, since=102.5)] == [3, 4]
        assert await two.audit_counts() == (3, 5)
        changes = two.changes()
        await anext(changes)  # subscribed
        await one.notify()
        async with asyncio.timeout(2):
            await anext(changes)
        await changes.aclose()  # type: ignore[attr-defined]
    finally:
        await one.close()
        await two.close()
