"""The pools' endpoints from Kubernetes (``gateway.epp.kube``): the official client against a small fake API server
that serves the pods list and a watch stream of their changes, as the API server does (JSON lines over HTTP)."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from gateway.config.settings import Settings
from gateway.runtime.container import Runtime
from tests.conftest import rules_for

kubernetes = pytest.importorskip("kubernetes")

from gateway.epp.kube import KIND_LABEL, POOL_LABEL, KubeEndpoints, PodWatcher  # noqa: E402

NAMESPACE = "llm"
SELECTOR = "app=vllm"
PLACEHOLDERS = (["http://192.0.2.1:8000"], ["http://192.0.2.2:8000"])  # the YAML's, drained while pods exist


def pod(name: str, ip: str, *, kind: str | None = None, pool: str | None = None, ready: bool = True) -> dict[str, Any]:
    labels = {"app": "vllm"}
    if kind:
        labels[KIND_LABEL] = kind
    if pool:
        labels[POOL_LABEL] = pool
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApi:
    """GET /api/v1/namespaces/llm/pods: the list, or (watch=true) the changes from then on, one JSON line each."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.watchers: list[queue.Queue[dict[str, Any] | None]] = []
        self.log: list[tuple[int, dict[str, Any]]] = []  # every change, for a watch from an older version
        self.selectors: list[str] = []
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a watch streams chunks, as the API server does

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path != f"/api/v1/namespaces/{NAMESPACE}/pods":
                    self.send_error(404)
                    return
                api.selectors.append(query.get("labelSelector", ""))
                if query.get("watch") in ("true", "1"):
                    since = int(query.get("resourceVersion") or 0)
                    api.serve_watch(self, since, float(query.get("timeoutSeconds", "5")))
                else:
                    with api.lock:
                        items = list(api.pods.values())
                        body = {
                            "kind": "PodList",
                            "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(api.version)},
                        }
                    body["items"] = items
                    data = json.dumps(body).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def serve_watch(self, handler: BaseHTTPRequestHandler, since: int, timeout_s: float) -> None:
        q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with self.lock:  # the changes after `since` first, as the API server sends them
            for version, event in self.log:
                if version > since:
                    q.put(event)
            self.watchers.append(q)
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        handler.send_header("transfer-encoding", "chunked")
        handler.end_headers()
        try:
            while True:
                try:
                    event = q.get(timeout=min(timeout_s, 5.0))
                except queue.Empty:
                    event = None
                if event is None:
                    handler.wfile.write(b"0\r\n\r\n")
                    handler.wfile.flush()
                    return
                line = json.dumps(event).encode() + b"\n"
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                handler.wfile.flush()
        except OSError:
            return
        finally:
            with self.lock:
                self.watchers.remove(q)

    def change(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(obj["metadata"]["name"], None)
            else:
                self.pods[obj["metadata"]["name"]] = obj
            event = {"type": kind, "object": json.loads(json.dumps(obj))}
            self.log.append((self.version, event))
            for q in self.watchers:
                q.put(event)

    def close(self) -> None:
        with self.lock:
            for q in self.watchers:
                q.put(None)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    fake.thread.start()
    yield fake
    fake.close()


def runtime(tmp_path: Path, **rules: Any) -> Runtime:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for(*PLACEHOLDERS, **rules)))
    return Runtime.from_settings(Settings(rules=path))


def endpoints(rt: Runtime) -> dict[str, list[tuple[str, str, float]]]:
    return {name: [(e.id, e.url, e.weight) for e in p.endpoints] for name, p in rt.live.pools.items()}


async def until(check: Callable[[], bool], timeout_s: float = 15) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_pods_become_the_pools_endpoints(tmp_path: Path, api: FakeApi) -> None:
    api.change("ADDED", pod("spec-a", "10.1.0.1", kind="speculative"))
    api.change("ADDED", pod("std-a", "10.1.0.9", pool="std"))  # the pool named outright
    api.change("ADDED", pod("starting", "10.1.0.5", kind="speculative", ready=False))
    rt = runtime(tmp_path)
    config = kubernetes.client.Configuration()
    config.host = api.url
    watcher = PodWatcher(kubernetes.client.ApiClient(config), NAMESPACE, SELECTOR, asyncio.get_running_loop())
    sync = KubeEndpoints(rt, watcher, 8000)
    watcher.start()
    task = asyncio.create_task(sync.run())
    try:
        await until(lambda: endpoints(rt)["spec"] == [("spec-a", "http://10.1.0.1:8000", 1.0)])
        assert endpoints(rt)["std"] == [("std-a", "http://10.1.0.9:8000", 1.0)]
        assert set(api.selectors) == {SELECTOR}
        first = rt.live.pools["spec"].endpoints[0]
        first.in_flight = 3  # a request on it: its state must survive the next change

        api.change("MODIFIED", pod("starting", "10.1.0.5", kind="speculative"))  # now ready
        await until(lambda: len(endpoints(rt)["spec"]) == 2)
        assert [e[0] for e in endpoints(rt)["spec"]] == ["spec-a", "starting"]
        assert rt.live.pools["spec"].endpoints[0] is first  # the same state object
        assert first.in_flight == 3

        api.change("DELETED", pod("spec-a", "10.1.0.1", kind="speculative"))
        api.change("MODIFIED", pod("std-a", "10.1.0.9", pool="std", ready=False))
        await until(lambda: [e[0] for e in endpoints(rt)["spec"]] == ["starting"])
        await until(lambda: endpoints(rt)["std"] == [("std-0", "http://192.0.2.2:8000", 0.0)])  # drained
        assert rt.live.rules.pool("spec").speculative is not None  # the rest of the pool is the YAML's
    finally:
        watcher.stop()
        api.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_reload_of_the_yaml_gets_the_pods_again(tmp_path: Path, api: FakeApi) -> None:
    api.change("ADDED", pod("spec-a", "10.1.0.1", kind="speculative"))
    rt = runtime(tmp_path)
    config = kubernetes.client.Configuration()
    config.host = api.url
    watcher = PodWatcher(kubernetes.client.ApiClient(config), NAMESPACE, SELECTOR, asyncio.get_running_loop())
    sync = KubeEndpoints(rt, watcher, 9000)
    watcher.start()
    task = asyncio.create_task(sync.run())
    try:
        await until(lambda: endpoints(rt)["spec"] == [("spec-a", "http://10.1.0.1:9000", 1.0)])
        path = tmp_path / "rules.yaml"
        rules = rules_for(*PLACEHOLDERS, defaults={"max_attempts": 3})
        path.write_text(yaml.safe_dump(rules))
        result = await rt.reload("admin")
        assert result.result == "ok"
        assert rt.live.rules.defaults.max_attempts == 3
        await until(lambda: endpoints(rt)["spec"] == [("spec-a", "http://10.1.0.1:9000", 1.0)])
        assert rt.live.rules.defaults.max_attempts == 3  # the new YAML, with the pods
    finally:
        watcher.stop()
        api.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_pods_without_a_pool_are_left_out() -> None:
    from gateway.config.loader import load_rules_text
    from gateway.epp.kube import PodEndpoint, assign, unassigned

    rules = load_rules_text(yaml.safe_dump(rules_for(*PLACEHOLDERS)))
    pods = {
        "a": PodEndpoint("a", "10.0.0.1", None, "speculative"),
        "b": PodEndpoint("b", "10.0.0.2", None, None),  # no label
        "c": PodEndpoint("c", "10.0.0.3", "nope", None),  # a pool the YAML does not have
        "d": PodEndpoint("d", "fd00::4", "std", None),
    }
    out = assign(rules, pods, 8000)
    assert [(e.id, e.url) for e in out.pool("spec").endpoints] == [("a", "http://10.0.0.1:8000")]
    assert [(e.id, e.url) for e in out.pool("std").endpoints] == [("d", "http://[fd00::4]:8000")]
    assert unassigned(rules, pods) == ["b", "c"]
