"""``specgate epp --kube-selector`` as a process: the pools' endpoints become the pods a (fake) Kubernetes API
server lists, reached through a kubeconfig as outside a cluster, and follow a pod that becomes ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.sim.launch import free_port
from tests.conftest import rules_for

pytest.importorskip("kubernetes")

from tests.app.test_epp_kube import PLACEHOLDERS, FakeApi, pod

pytestmark = pytest.mark.integration
TOKEN = "kube-admin-token"


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    fake.thread.start()
    yield fake
    fake.close()


def pools(admin: int) -> dict[str, Any]:
    r = httpx.get(f"http://127.0.0.1:{admin}/admin/state", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5)
    r.raise_for_status()
    state: dict[str, Any] = r.json()["pools"]
    return state


def ids(admin: int, pool: str) -> list[tuple[str, str]]:
    return [(e["id"], e["url"]) for e in pools(admin)[pool]["endpoints"] if e["weight"] > 0]


def wait_for(check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_picker_takes_its_endpoints_from_the_pods(tmp_path: Path, api: FakeApi) -> None:
    api.change("ADDED", pod("spec-a", "10.1.0.1", kind="speculative"))
    api.change("ADDED", pod("std-a", "10.1.0.9", pool="std", ready=False))
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "unused"}}],
        "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
        "current-context": "c",
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules_for(*PLACEHOLDERS)))
    port, admin = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env.update(KUBECONFIG=str(tmp_path / "kubeconfig"), SPECGATE_ADMIN_TOKEN=TOKEN, SPECGATE_LOG_LEVEL="warning")
    cmd = [sys.executable, "-m", "gateway", "epp", "--rules", str(tmp_path / "rules.yaml"), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", str(admin), "--metrics-port", "0"]
    cmd += ["--kube-selector", "app=vllm", "--kube-namespace", "llm", "--kube-port", "8001"]
    with (tmp_path / "epp.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ids(admin, "spec") == [("spec-a", "http://10.1.0.1:8001")])
        assert ids(admin, "std") == []  # no ready pod: the YAML's placeholder, drained
        api.change("MODIFIED", pod("std-a", "10.1.0.9", pool="std"))
        wait_for(lambda: ids(admin, "std") == [("std-a", "http://10.1.0.9:8001")])
        assert set(api.selectors) == {"app=vllm"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "epp.log").read_text()[-2000:]
