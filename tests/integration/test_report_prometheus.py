"""``specgate bench baseline`` and ``specgate report weekly`` against a real Prometheus server.

A simulated speculative pool (low acceptance, so the class's acceptance guard trips: a controller transition), a
simulated standard pool, the gateway in front of them, and Debian's ``prometheus`` binary scraping all three every
second on loopback (temp storage). The baseline is measured through the gateway, more traffic is sent, and the
weekly report over the last 5 minutes must carry plausible numbers: acceptance between 0 and 1 per pool and class,
a row per class, the transition counted, a speedup against the baseline.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gateway.cli.main import app
from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, ServerThread, poll, rules_for

pytestmark = pytest.mark.integration

SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
CODE = {"model": MODEL, "messages": [{"role": "user", "content": "Write a python function."}], "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 1.0}


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if found is None:
        pytest.skip(
            "the prometheus server is not installed (CI: tools/install-ci-tools.sh; locally: apt-get install "
            "prometheus)"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    common: dict[str, Any] = {"model": MODEL, "port": 0, "time_scale": 0.02, "seed": 3}
    common["output_lengths"] = OutputLengths(median=60, sigma=0)
    spec = SimServer(
        SimOptions(speculative_config=SPEC, fixed_acceptance=0.5, per_request_spec_decode_metrics="summary", **common)
    ).start()
    std = SimServer(SimOptions(**common)).start()
    yield spec, std
    spec.stop()
    std.stop()


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, list[tuple[str, dict[str, str]]]]) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [{"targets": [t], "labels": labels} for t, labels in entries],
                }
                for job, entries in targets.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        args = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self._log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 40  # process start-up on a loaded CI machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not become ready")

    def value(self, expr: str) -> float | None:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}).json()
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def guarded_rules(spec_url: str, std_url: str) -> dict[str, Any]:
    rules = rules_for([spec_url], [std_url], scrape={"interval_s": 0.25, "timeout_s": 0.25, "window_s": 1.0})
    rules["classes"][0]["controller"] = {
        "window_s": 0.5,
        "min_samples": 1,
        "safe_state": "speculative",
        "disable_below": 0.5,  # a = 0.5 with K = 4 is a rate of about 0.23: the guard trips
        "disable_after_windows": 1,
        "max_changes_per_hour": 60,
    }
    return rules


def gateway_transitions(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specgate_controller_transitions_total"
    )


def test_baseline_and_weekly_report_against_a_real_prometheus(
    sims: tuple[SimServer, SimServer], gateway: Callable[..., ServerThread], tmp_path: Path
) -> None:
    binary = prometheus_binary()
    spec, std = sims
    gw = gateway(guarded_rules(spec.url, std.url), health_interval_s=0.5, health_timeout_s=2.0)
    host = lambda url: url.removeprefix("http://")  # noqa: E731
    prom = Prometheus(
        binary,
        tmp_path,
        {
            "specgate": [(host(gw.url), {})],
            "vllm": [(host(spec.url), {"pool": "spec"}), (host(std.url), {"pool": "std"})],
        },
    )
    try:
        prom.wait_ready()
        assert poll(lambda: prom.value('count(up{job="vllm"} == 1)') == 2.0, 10), "targets never came up"

        # Phase 1: the baseline, measured through the gateway
        baseline_file = tmp_path / "baseline_metrics.json"
        runner = CliRunner()
        result = runner.invoke(
            app,
            [
                "bench",
                "baseline",
                "--url",
                gw.url,
                "--requests",
                "8",
                "--concurrency",
                "2",
                "--out",
                str(baseline_file),
            ],
        )
        assert result.exit_code == 0, result.output
        baseline = json.loads(baseline_file.read_text())
        for field in ("ttft", "tpot", "e2e"):
            for p in (50, 95, 99):
                assert baseline[f"{field}_p{p}_ms"] > 0, field
        assert baseline["ttft_p50_ms"] <= baseline["e2e_p50_ms"]
        assert baseline["total_tokens"] > 0
        assert baseline["avg_tokens_per_sec"] > 0
        assert baseline["throughput_tokens_per_sec"] > 0
        assert (baseline["successful_requests"], baseline["errors"]) == (8, 0)
        assert baseline["model"] == MODEL
        assert baseline["token_count_source"] == "usage"
        assert set(baseline["by_class"]) <= {"precise", "default"}

        # more traffic: the precise class drafts with low acceptance until its guard moves it off. The guard counts
        # whole windows (0.5 s here) with requests in them, so the traffic is spread over ~2 s: the simulated servers
        # answer in ~20 ms, and one burst would fit inside a single window.
        answers = []
        with httpx.Client(timeout=30) as http, ThreadPoolExecutor(4) as pool:
            for _ in range(8):
                bodies = [CODE, CODE, CHAT]
                answers += list(pool.map(lambda b: http.post(f"{gw.url}/v1/chat/completions", json=b), bodies))
                time.sleep(0.25)
        assert all(a.status_code == 200 for a in answers)
        assert poll(lambda: gateway_transitions(gw.url) >= 1, 5), "the acceptance guard never tripped"
        expected = gateway_transitions(gw.url)
        # Prometheus has seen the transitions and the drafts
        assert poll(
            lambda: (
                prom.value("sum(specgate_controller_transitions_total)") == expected
                and (prom.value("sum(specgate_class_draft_tokens_total)") or 0) > 0
            ),
            10,
        )
        time.sleep(2.5)  # a few more scrapes, so every rate has two samples after the traffic

        # Phase 7: the weekly report over the last 5 minutes
        out = tmp_path / "report.json"
        args = ["report", "weekly", "--prometheus", prom.url, "--baseline", str(baseline_file), "--range", "5m"]
        result = runner.invoke(app, [*args, "--window", "10s", "--format", "json", "--out", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        pools = {p["pool"]: p["accept_ratio"] for p in report["pools"]}
        assert set(pools) == {"spec"}  # only the speculative server has spec-decode counters
        for stats in (pools["spec"], report["accept_ratio"]):
            assert 0 < stats["current_avg"] < 0.5
            assert 0 < stats["min"] <= stats["current_avg"] <= stats["max"] < 1
        classes = {c["class"]: c for c in report["classes"]}
        assert set(classes) == {"precise", "default"}
        precise = classes["precise"]
        assert 0 < precise["accept_ratio"]["current_avg"] < 0.5
        assert precise["requests"] >= 16
        assert precise["current_e2e_p50_ms"] > 0
        assert precise["e2e_p50_speedup"] > 0
        assert classes["default"]["accept_ratio"]["current_avg"] is None  # never drafted: no data, not 0
        assert report["controller_transition_total"] == round(expected)
        assert report["fallback_count"] >= 1  # the guard's acceptance_floor move
        assert any(t["reason"] == "acceptance_floor" for t in report["controller_transitions"])
        assert report["speedup"]["baseline_e2e_p50_ms"] == baseline["e2e_p50_ms"]
        assert report["speedup"]["e2e_p50_speedup"] > 0
        assert report["pool_fallback_total"] == 0
        recs = {(r["scope"], r["target"], r["severity"]) for r in report["recommendations"]}
        assert ("pool", "spec", "critical") in recs or ("pool", "spec", "warning") in recs

        markdown = runner.invoke(app, [*args, "--window", "10s"])
        assert markdown.exit_code == 0, markdown.output
        assert "| spec |" in markdown.output
        assert "## Recommendations" in markdown.output
    finally:
        prom.stop()
