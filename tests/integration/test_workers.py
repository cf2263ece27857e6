"""``specgate serve --workers 2`` as a real process tree: /metrics shows the totals of all workers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, rules_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": MODEL, "temperature": 1.0, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
REQUESTS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class Gateway:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, tmp: Path, log: Path) -> None:
        self.proc, self.url, self.tmp, self.log = proc, url, tmp, log

    def metrics_dirs(self) -> list[Path]:
        return sorted(self.tmp.glob("specgate-metrics-*"))

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def gateway_2_workers(tmp_path: Path, fake: Callable[..., FakeUpstreamServer]) -> Iterator[Gateway]:
    spec, std = fake("spec"), fake("std")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([spec.url], [std.url]), sort_keys=False))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_") and "multiproc_dir" not in k.lower()}
    env["TMPDIR"] = str(tmp_path)  # where `serve` makes its private metrics directory, so the test can look in it
    log = tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", "0", "--workers", "2", "--per-worker-state"]  # no default port
    cmd += ["--health-interval", "0.2", "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    gw = Gateway(proc, f"http://127.0.0.1:{port}", tmp_path, log)
    try:
        # Ready on several fresh connections in a row: both workers have finished a health-check round.
        deadline, in_a_row = time.monotonic() + 30, 0  # a loaded CI machine starts 2 workers slowly
        while in_a_row < 6:
            assert proc.poll() is None, f"gateway exited early:\n{gw.output()}"
            assert time.monotonic() < deadline, f"gateway not ready:\n{gw.output()}"
            try:
                ok = httpx.get(f"{gw.url}/ready", timeout=1).status_code == 200
            except httpx.TransportError:
                ok = False
            in_a_row = in_a_row + 1 if ok else 0
            if not ok:
                time.sleep(0.05)
        yield gw
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _requests_by_worker(metrics_dir: Path) -> dict[str, float]:
    """specgate_requests_total per worker, read from each worker's own counter file."""
    out: dict[str, float] = {}
    for f in metrics_dir.glob("counter_*.db"):
        pid = f.stem.split("_")[1]
        for metric in MultiProcessCollector.merge([str(f)]):
            if metric.name == "specgate_requests":
                out[pid] = sum(s.value for s in metric.samples if s.name == "specgate_requests_total")
    return out


def _scrape(url: str) -> tuple[float, list[float]]:
    """Total of specgate_requests_total, and the in-flight samples, from one /metrics on a fresh connection."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total, in_flight = 0.0, []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specgate_requests_total":
                total += s.value
            elif s.name == "specgate_in_flight_requests":
                assert set(s.labels) == {"pool"}, s.labels  # no per-worker ``pid`` label
                in_flight.append(s.value)
    return total, in_flight


def test_every_worker_answers_the_same_totals(gateway_2_workers: Gateway) -> None:
    gw = gateway_2_workers
    [metrics_dir] = gw.metrics_dirs()

    def one(i: int) -> int:
        return httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10).status_code

    # Which worker accepts a connection is the kernel's choice: on a loaded machine one worker can take a whole
    # burst (the other still starting, or not woken in time). Bursts go out until both have served some, so the
    # merge below is checked across two workers' files, not one.
    sent = 0
    deadline = time.monotonic() + 60
    while True:
        with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
            statuses = list(pool.map(one, range(REQUESTS)))
        assert statuses == [200] * REQUESTS
        sent += REQUESTS
        # A request is counted just after its last byte went out: wait until the workers have booked all of them.
        booked = time.monotonic() + 15
        while sum((by_worker := _requests_by_worker(metrics_dir)).values()) < sent and time.monotonic() < booked:
            time.sleep(0.02)
        assert sum(by_worker.values()) == sent
        if len([n for n in by_worker.values() if n > 0]) == 2 or time.monotonic() > deadline:
            break
    # Both workers served some: otherwise a scrape of either worker would show the total or 0 even without merging.
    assert len([n for n in by_worker.values() if n > 0]) == 2, by_worker
    assert not list(metrics_dir.glob(f"*_{gw.proc.pid}.db"))  # the parent (uvicorn's supervisor) writes nothing

    for _ in range(10):
        total, in_flight = _scrape(gw.url)
        assert total == sent
        assert in_flight, "no specgate_in_flight_requests samples"
        assert all(v == 0 for v in in_flight), in_flight

    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(timeout=10) == 0, gw.output()
    assert gw.metrics_dirs() == []  # the private directory is removed at exit
