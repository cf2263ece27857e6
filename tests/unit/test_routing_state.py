"""RoutingState: controllers fed with synthetic pool views → transitions, metrics and log lines."""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import Any

import orjson
import pytest

from gateway.config.schema import RoutingRules
from gateway.fleet.vllm_metrics import Acceptance, PoolLoadView
from gateway.observability.logs import JsonFormatter
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.routing_state import RoutingState

POOLS: list[dict[str, Any]] = [
    {
        "name": "spec",
        "kind": "speculative",
        "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
        "models": ["m"],
        "endpoints": [{"url": "http://spec:8000"}],
    },
    {"name": "std", "kind": "standard", "models": ["m"], "endpoints": [{"url": "http://std:8000"}]},
]


def rules(controller: dict[str, Any] | None = None, **route: Any) -> RoutingRules:
    ctl = {"window_s": 1, "min_samples": 1, "min_hold_s": 0, "share_step": 1, **(controller or {})}
    return RoutingRules.model_validate(
        {
            "defaults": {"controller": None},  # only "code" has a controller; "default" keeps its static route
            "pools": POOLS,
            "classes": [
                {"name": "code", "when": {"task_type": {"in": ["code"]}}, "route": route, "controller": ctl},
                {"name": "default", "route": {"preferred": "std"}},
            ],
        }
    )


RNG = random.Random(1)


def view(pool: str, *, running: float = 1, waiting: float = 0, tpot: float = 0.01, stale: bool = False) -> PoolLoadView:
    return PoolLoadView(
        pool=pool,
        endpoints=1,
        fresh_endpoints=0 if stale else 1,
        running=None if stale else running,
        waiting=None if stale else waiting,
        kv_usage=None,
        acceptance=None,
        tpot_mean_s=tpot,
        generation_tokens_per_s=None,
    )


CALM = {"spec": view("spec"), "std": view("std")}
FAST = {"spec": view("spec", tpot=0.005), "std": view("std")}  # speculation pays off: half the time per token
BUSY = {"spec": view("spec", running=4, waiting=20), "std": view("std")}


def state(r: RoutingRules, m: GatewayMetrics | None = None) -> tuple[RoutingState, GatewayMetrics]:
    metrics = m or GatewayMetrics()
    return RoutingState(lambda: r, metrics.registry, clock=lambda: 0.0), metrics


def sample(m: GatewayMetrics, name: str, labels: dict[str, str]) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_initial_state_is_the_home_pools_kind_and_classes_without_a_controller_have_none() -> None:
    rs, m = state(rules(preferred="spec", saturated="std"))
    assert rs.state_of("code") == "speculative"
    assert rs.state_of("default") is None
    assert rs.choose("default", RNG) is None
    assert sample(m, "specgate_class_route_state", {"class": "code", "state": "speculative"}) == 1
    assert sample(m, "specgate_class_route_state", {"class": "code", "state": "standard"}) == 0
    home_std, _ = state(rules(preferred="std", saturated="spec"))
    assert home_std.state_of("code") == "standard"


def test_a_load_step_moves_the_class_with_a_metric_and_a_json_log_line(caplog: pytest.LogCaptureFixture) -> None:
    rs, m = state(rules(preferred="spec", saturated="std"))
    rs.choose("code", RNG)
    assert rs.on_scrape_round(1.0, CALM) == []
    rs.choose("code", RNG)
    with caplog.at_level(logging.INFO, logger="specgate.controller"):
        (t,) = rs.on_scrape_round(2.0, BUSY)
    assert (t.from_state, t.to_state, t.reason) == ("speculative", "standard", "load")
    assert rs.state_of("code") == "standard"
    labels = {"class": "code", "from": "speculative", "to": "standard", "reason": "load"}
    assert sample(m, "specgate_controller_transitions_total", labels) == 1
    assert sample(m, "specgate_class_route_state", {"class": "code", "state": "standard"}) == 1
    assert sample(m, "specgate_class_route_state", {"class": "code", "state": "speculative"}) == 0
    (record,) = [r for r in caplog.records if r.name == "specgate.controller"]
    line = orjson.loads(JsonFormatter().format(record))
    assert line["class"] == "code"
    assert (line["from"], line["to"], line["reason"]) == ("speculative", "standard", "load")
    # and back when the load is gone
    rs.choose("code", RNG)
    (back,) = rs.on_scrape_round(3.0, FAST)
    assert (back.to_state, back.reason) == ("speculative", "load_recovered")
    assert rs.snapshot()["code"]["state"] == "speculative"


def test_samples_are_the_class_requests_in_the_window() -> None:
    rs, _ = state(rules({"min_samples": 3, "window_s": 10}, preferred="spec", saturated="std"))
    rs.choose("code", RNG)
    rs.choose("code", RNG)
    assert rs.on_scrape_round(1.0, BUSY) == []  # 2 < 3: no decision
    assert rs.snapshot()["code"]["holding"] == "min_samples"
    rs.choose("code", RNG)
    assert [t.reason for t in rs.on_scrape_round(2.0, BUSY)] == ["load"]
    # 20 s later those requests are out of the window: no decision, even back in the calm
    assert rs.on_scrape_round(30.0, CALM) == []
    assert rs.snapshot()["code"]["last_observation"]["samples"] == 0


def test_stale_or_unscraped_pools_go_to_the_safe_state_never_read_as_zero() -> None:
    rs, m = state(rules(preferred="spec", saturated="std"))
    (t,) = rs.on_scrape_round(1.0, {})  # nothing scraped yet
    assert (t.to_state, t.reason) == ("standard", "stale")
    rs2, _ = state(rules(preferred="spec", saturated="std"))
    (t2,) = rs2.on_scrape_round(1.0, {"spec": view("spec", stale=True), "std": view("std")})
    assert t2.reason == "stale"
    assert (
        sample(m, "specgate_controller_transitions_total", {**_tr("speculative", "standard"), "reason": "stale"}) == 1
    )


def _tr(a: str, b: str) -> dict[str, str]:
    return {"class": "code", "from": a, "to": b}


def test_class_acceptance_comes_from_the_per_class_counters_of_the_window() -> None:
    cfg = {"disable_below": 0.5, "disable_after_windows": 1}
    rs, m = state(rules(cfg, preferred="spec", saturated="std"))
    rs.choose("code", RNG)
    assert rs.on_scrape_round(1.0, CALM) == []  # the guard's first window starts
    m.class_draft_tokens.labels("code").inc(100)
    m.class_accepted_tokens.labels("code").inc(20)
    rs.choose("code", RNG)
    (t,) = rs.on_scrape_round(2.0, CALM)
    assert (t.to_state, t.reason) == ("standard", "acceptance_floor")
    assert rs.snapshot()["code"]["last_observation"]["acceptance"] == pytest.approx(0.2)


def test_an_idle_pool_borrows_the_other_candidates_tpot() -> None:
    rs, _ = state(rules(preferred="spec", saturated="std"))
    rs.choose("code", RNG)
    idle_std = {"spec": view("spec", tpot=0.001), "std": view("std", running=0, tpot=float("nan"))}
    assert rs.on_scrape_round(1.0, idle_std) == []  # with the 30 ms default the idle pool would look faster
    obs = rs.snapshot()["code"]["last_observation"]
    assert obs["std_cost_s"] == pytest.approx(0.001 * 257)


def test_a_reload_without_the_controller_forgets_the_class() -> None:
    current = [rules(preferred="spec", saturated="std")]
    m = GatewayMetrics()
    rs = RoutingState(lambda: current[0], m.registry, clock=lambda: 0.0)
    assert rs.state_of("code") == "speculative"
    plain = rules(preferred="spec", saturated="std").model_copy()
    plain.classes[0] = plain.classes[0].model_copy(update={"controller": None})
    current[0] = plain
    assert rs.on_scrape_round(1.0, CALM) == []
    assert rs.state_of("code") is None
    assert sample(m, "specgate_class_route_state", {"class": "code", "state": "speculative"}) is None


def test_an_idle_pool_keeps_its_last_measured_tpot() -> None:
    rs, _ = state(rules(preferred="spec", saturated="std"))
    rs.on_scrape_round(1.0, {"spec": view("spec", tpot=0.004), "std": view("std", tpot=0.01)})
    rs.on_scrape_round(2.0, {"spec": view("spec", running=0, tpot=float("nan")), "std": view("std", tpot=0.01)})
    obs = rs.snapshot()["code"]["last_observation"]
    assert obs["spec_cost_s"] == pytest.approx(0.004 * 257)
    assert obs["std_cost_s"] == pytest.approx(0.01 * 257)


def test_a_split_class_sends_its_share_to_the_speculative_pool_with_a_gauge_and_a_step_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rs, m = state(rules({"share_step": 0.25}, preferred="spec", saturated="std"))
    rs.choose("code", RNG)
    (t,) = rs.on_scrape_round(1.0, BUSY)
    assert (t.from_state, t.to_state, t.share) == ("speculative", "split", 0.75)
    assert sample(m, "specgate_class_route_state", {"class": "code", "state": "split"}) == 1
    assert sample(m, "specgate_class_speculative_share", {"class": "code"}) == 0.75
    picks = [rs.choose("code", RNG) for _ in range(4000)]
    assert all(p is not None and p.state == "split" and p.share == 0.75 for p in picks)
    spec_share = sum(1 for p in picks if p is not None and p.pick == "speculative") / len(picks)
    assert spec_share == pytest.approx(0.75, abs=0.03)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specgate.controller"):
        assert rs.on_scrape_round(2.0, BUSY) == []  # a step within split: not a transition
    assert sample(m, "specgate_class_speculative_share", {"class": "code"}) == 0.5
    (record,) = [r for r in caplog.records if r.name == "specgate.controller"]
    line = orjson.loads(JsonFormatter().format(record))
    assert (line["event"], line["share_from"], line["share"], line["reason"]) == ("controller_step", 0.75, 0.5, "load")
    # explain-style lookups do not count toward the samples
    before = rs.snapshot()["code"]["last_observation"]["samples"]
    rs.choose("code", RNG, count=False)
    rs.on_scrape_round(2.5, CALM)
    assert rs.snapshot()["code"]["last_observation"]["samples"] == before


def test_the_latency_guard_reads_the_class_p95_on_its_speculative_pool() -> None:
    asked: list[tuple[str, str, float]] = []

    def p95(cls: str, pool: str, since: float) -> float | None:
        asked.append((cls, pool, since))
        return 9.0

    cfg = {"latency_regression_pct": 20, "baseline_p95_s": 3.0, "disable_after_windows": 1, "window_s": 1}
    m = GatewayMetrics()
    seen: list[Any] = []
    rs = RoutingState(
        lambda: rules(cfg, preferred="spec", saturated="std"),
        m.registry,
        clock=lambda: 0.0,
        latency_p95=p95,
        on_transition=seen.append,
    )
    rs.choose("code", RNG)
    assert rs.on_scrape_round(1.0, CALM) == []
    rs.choose("code", RNG)
    (t,) = rs.on_scrape_round(2.0, CALM)
    assert (t.to_state, t.reason) == ("standard", "latency_regression")
    assert asked[-1] == ("code", "spec", 1.0)  # the class, its speculative pool, the window
    assert seen == [t]  # the audit hook


def test_gateway_latency_window_p95() -> None:
    m = GatewayMetrics()
    for i in range(100):
        m.observe_request("code", "spec", "ok", (i + 1) / 100, None, None)
    m.observe_request("code", "spec", "upstream_error", 50.0, None, None)  # failures do not count
    assert m.latency_p95("code", "spec", since=0.0) == pytest.approx(0.95)
    assert m.latency_p95("code", "std", since=0.0) is None
    assert m.latency_p95("code", "spec", since=float("inf")) is None


def test_the_controller_sees_the_window_mean_of_the_delays_not_one_noisy_scrape() -> None:
    rs, _ = state(rules({"window_s": 4, "share_step": 0.25}, preferred="spec", saturated="std"))
    spiky = {"spec": view("spec", running=4, waiting=3), "std": view("std")}  # one scrape caught a burst
    for t in (1.0, 2.0, 3.0):
        rs.choose("code", RNG)
        assert rs.on_scrape_round(t, CALM) == []
    rs.choose("code", RNG)
    assert rs.on_scrape_round(4.0, spiky) == []  # alone it reads 1.75 x standard's delay: over the exit margin
    obs = rs.snapshot()["code"]["last_observation"]
    assert obs["spec_cost_s"] == pytest.approx((3 * 0.01 * 257 + (3 * 2.56 / 4 + 0.01 + 2.56)) / 4)
    # a sustained burst moves it
    for t in (5.0, 6.0, 7.0):
        rs.choose("code", RNG)
        rs.on_scrape_round(t, spiky)
    assert rs.state_of("code") == "split"
    # stale data is not averaged away: it acts at once
    (t,) = rs.on_scrape_round(8.0, {"spec": view("spec", stale=True), "std": view("std")})
    assert t.reason == "stale"


def test_without_per_request_acceptance_the_pools_counters_stand_in() -> None:
    """The Responses API: vLLM reports no per-request acceptance, so a class that ran on its speculative pool and
    drafted nothing in the gateway's per-class counters is judged by the pool's scraped rate; a class that did not
    run there (no p95 on the speculative pool) stays unknown."""
    # prior_acceptance as the pool's: the estimate alone moves nothing here (a lower prior than the pool's rate would
    # make the speculative pool look slower for this class)
    cfg = {"disable_below": 0.5, "disable_after_windows": 1, "prior_acceptance": 0.3}
    poor = {"spec": replace(view("spec"), acceptance=Acceptance(0.3, 2.2, (0.3,), 100.0)), "std": view("std")}
    for ran_there, expected in ((True, 0.3), (False, None)):
        rs = RoutingState(
            lambda: rules(cfg, preferred="spec", saturated="std"),
            GatewayMetrics().registry,
            clock=lambda: 0.0,
            latency_p95=lambda cls, pool, since, ran=ran_there: 1.0 if ran else None,  # type: ignore[misc]
        )
        rs.choose("code", RNG)
        assert rs.on_scrape_round(1.0, poor) == []
        rs.choose("code", RNG)
        out = rs.on_scrape_round(2.0, poor)
        assert rs.snapshot()["code"]["last_observation"]["acceptance"] == expected
        assert [(t.to_state, t.reason) for t in out] == ([("standard", "acceptance_floor")] if ran_there else [])


def test_a_class_with_less_acceptance_yields_the_speculative_pool_to_one_with_more() -> None:
    ctl = {"window_s": 1, "min_samples": 1, "min_hold_s": 0, "share_step": 0.25, "balance_margin": 1.05}
    r = RoutingRules.model_validate(
        {
            "defaults": {"controller": ctl},
            "pools": POOLS,
            "classes": [
                {  # it cannot come back this minute (min_hold_s): it stays partly off the speculative pool
                    "name": "json",
                    "when": {"temperature": {"lte": 0.1}},
                    "route": {"preferred": "spec"},
                    "controller": {**ctl, "min_hold_s": 60},
                },
                {"name": "chat", "route": {"preferred": "std"}},
            ],
        }
    )
    rs, _ = state(r)
    rs._classes["json"].controller._share = 0.75  # json spilled a share off the speculative pool, by load
    rs._classes["json"].controller._last_reason = "load"
    rs._classes["chat"].controller._share = 0.25  # while chat took one onto it
    queued_std = {"spec": view("spec", running=4), "std": view("std", running=4, waiting=8)}
    for t in (1.0, 2.5, 4.0):  # the first round gives the standings (acceptance from the temperature priors)
        rs.choose("json", RNG, temperature=0.0)
        rs.choose("chat", RNG, temperature=0.9)
        rs.on_scrape_round(t, queued_std)
    chat = rs.snapshot()["chat"]
    assert chat["share"] == 0.0  # the speculative pool is still cheaper for chat, but json gains more there
    last = rs._classes["chat"].controller.snapshot().last_observation
    assert last is not None
    assert last.outranked_by == "json"
    json_last = rs._classes["json"].controller.snapshot().last_observation
    assert json_last is not None
    assert json_last.outranked_by is None
    assert rs.snapshot()["json"]["share"] == 0.75
