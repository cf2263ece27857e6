"""GatewayMetrics with several workers (prometheus_client multiprocess mode), in-process.

prometheus_client chooses where values live when it is imported; a gateway worker is a fresh interpreter started
with PROMETHEUS_MULTIPROC_DIR set, so each stand-in worker here gets the value class such a worker gets, under a
pid of its own. The real process tree is in tests/integration/test_workers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.settings import Settings
from gateway.observability.metrics import GatewayMetrics, multiprocess_dir
from gateway.proxy.app import create_app, create_app_from_env
from tests.conftest import rules_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: bytes | str) -> Samples:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _gauge_files(path: Path, pid: int) -> list[str]:
    return sorted(f.stem.rsplit("_", 1)[0] for f in path.glob(f"gauge_*_{pid}.db"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()  # exited and reaped
    return proc.pid


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "prometheus"
    path.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
    yield path
    values.close_all_multiprocess_files()


@pytest.fixture
def worker(shared: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], GatewayMetrics]:
    """The metrics of a worker with that pid: values in files under ``shared``, /metrics merged from all.

    Values are created when a label set is first used, with the value class of that moment: use one worker's
    metrics before starting the next.
    """

    def start(pid: int) -> GatewayMetrics:
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: pid))
        m = GatewayMetrics()
        m.share_across_workers(str(shared))
        return m

    return start


def _traffic(m: GatewayMetrics, requests: int, in_flight: int, healthy: bool) -> None:
    for _ in range(requests):
        m.observe_request("precise", "spec", "ok", 0.2, 0.05, 0.001)
    m.in_flight.labels("spec").inc(in_flight)
    m.endpoint_up.labels("spec", "spec-0").set(1 if healthy else 0)
    m.health_checks.labels("spec", "ok").inc()


def test_every_worker_renders_the_merge_of_all(worker: Callable[[int], GatewayMetrics]) -> None:
    a = worker(os.getppid())  # two processes that exist
    _traffic(a, requests=3, in_flight=2, healthy=False)
    b = worker(os.getpid())
    _traffic(b, requests=4, in_flight=5, healthy=True)
    for m in (a, b):
        s = _samples(m.render())
        assert _value(s, "specgate_requests_total", **{"class": "precise", "pool": "spec", "outcome": "ok"}) == 7
        assert _value(s, "specgate_request_duration_seconds_count", **{"class": "precise", "pool": "spec"}) == 7
        assert _value(s, "specgate_health_checks_total", pool="spec", result="ok") == 2
        assert _value(s, "specgate_in_flight_requests", pool="spec") == 7  # livesum, no pid label
        assert _value(s, "specgate_endpoint_healthy", pool="spec", endpoint="spec-0") == 1  # livemax


def test_merged_names_and_labels_are_those_of_one_process(worker: Callable[[int], GatewayMetrics]) -> None:
    single = GatewayMetrics()  # its own registry: the value class pytest imported (in memory)
    _traffic(single, requests=1, in_flight=1, healthy=True)
    m = worker(os.getpid())
    _traffic(m, requests=1, in_flight=1, healthy=True)
    expected = {k for k in _samples(single.render()) if not k[0].endswith("_created")}  # no _created in files
    assert set(_samples(m.render())) == expected


def test_a_worker_that_exits_takes_its_gauges_and_leaves_its_counts(
    worker: Callable[[int], GatewayMetrics],
) -> None:
    a = worker(os.getppid())
    _traffic(a, requests=3, in_flight=2, healthy=True)
    b = worker(os.getpid())
    _traffic(b, requests=4, in_flight=5, healthy=False)
    b.worker_exited()  # b is this process: its lifespan shutdown
    s = _samples(a.render())
    assert _value(s, "specgate_requests_total", **{"class": "precise", "pool": "spec", "outcome": "ok"}) == 7
    assert _value(s, "specgate_in_flight_requests", pool="spec") == 2
    assert _value(s, "specgate_endpoint_healthy", pool="spec", endpoint="spec-0") == 1


def test_a_worker_killed_without_shutdown_is_forgotten_at_the_next_scrape(
    worker: Callable[[int], GatewayMetrics], shared: Path
) -> None:
    dead = _dead_pid()
    killed = worker(dead)
    _traffic(killed, requests=3, in_flight=2, healthy=True)  # it died with 2 requests in flight
    alive = worker(os.getpid())
    _traffic(alive, requests=4, in_flight=1, healthy=False)
    s = _samples(alive.render())
    assert _value(s, "specgate_requests_total", **{"class": "precise", "pool": "spec", "outcome": "ok"}) == 7
    assert _value(s, "specgate_in_flight_requests", pool="spec") == 1
    assert _value(s, "specgate_endpoint_healthy", pool="spec", endpoint="spec-0") == 0
    assert not list(shared.glob(f"gauge_*_{dead}.db"))
    assert list(shared.glob(f"counter_{dead}.db"))


async def test_the_worker_factory_merges_and_withdraws_its_gauges_at_shutdown(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])))
    for k, v in Settings(rules=path, workers=2, health_interval_s=60).to_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())  # a worker: real pid
    app = create_app_from_env()
    metrics: GatewayMetrics = app.state.runtime.metrics
    assert metrics.shared_dir == str(shared)
    async with app.starlette.router.lifespan_context(app.starlette):
        metrics.in_flight.labels("spec").inc()
        # livesum: in-flight requests; livemin: specgate_store_up (gateway/store/health.py); livemax:
        # specgate_config_info (gateway/runtime/reload.py)
        assert _gauge_files(shared, os.getpid()) == ["gauge_livemax", "gauge_livemin", "gauge_livesum"]
    assert _gauge_files(shared, os.getpid()) == []


def test_single_process_mode_keeps_its_own_registry(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Values in memory (prometheus_client imported without the variable): nothing to merge, even if it is set now.
    assert multiprocess_dir() is None
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    assert multiprocess_dir() == str(shared)
    # create_app (what `serve` runs with one worker) never merges, whatever the environment says.
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])))
    app = create_app(Settings(rules=path))
    assert app.state.runtime.metrics.shared_dir is None
