"""The attempt policy (pure): retry budget, outlier ejection timing and its guard, result labels, the 503 of an
exhausted request, and the plan's fallback-model and empty-plan answers."""

from __future__ import annotations

import random

import pytest

from gateway.config.pool import Pool
from gateway.config.schema import Defaults, OutlierDetection, Route
from gateway.config.schema import RetryBudget as RetryBudgetSpec
from gateway.errors import UpstreamConnectError, UpstreamTimeout, UpstreamUnreachable
from gateway.fleet.pools import PoolState
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.attempts import (
    AttemptFailure,
    AttemptPolicy,
    PoolStatusError,
    RetryBudget,
    StreamStartError,
    describe_status,
    exhausted,
    failure_result,
    note_failure,
    status_result,
    would_strand,
)
from gateway.routing.plan import PoolView, plan_route

# --- retry budget -------------------------------------------------------------------------------------------


def budget(ratio: float = 0.2, min_retries: int = 3) -> RetryBudget:
    spec = RetryBudgetSpec(ratio=ratio, min_retries=min_retries)
    return RetryBudget(lambda: spec)


def test_budget_floor_allows_min_retries_however_few_requests() -> None:
    b = budget(ratio=0.2, min_retries=3)
    leases = [b.lease() for _ in range(4)]
    assert [lease.try_retry() for lease in leases] == [True, True, True, False]
    assert b.retries == 3


def test_budget_grows_with_active_requests() -> None:
    b = budget(ratio=0.2, min_retries=3)
    leases = [b.lease() for _ in range(50)]  # 0.2 x 50 = 10 concurrent retries
    granted = sum(lease.try_retry() for lease in leases)
    assert granted == 10
    assert b.limit() == 10


def test_closing_a_lease_gives_back_its_request_and_its_retries() -> None:
    b = budget(ratio=0.0, min_retries=1)
    first, second = b.lease(), b.lease()
    assert first.try_retry()
    assert not second.try_retry()  # the one concurrent retry is held by `first`
    first.close()
    first.close()  # idempotent
    assert (b.active, b.retries) == (1, 0)
    assert second.try_retry()
    second.close()
    assert (b.active, b.retries) == (0, 0)
    assert not second.try_retry()  # a closed lease gets nothing


def test_zero_budget_refuses_every_retry() -> None:
    b = budget(ratio=0.0, min_retries=0)
    assert not b.lease().try_retry()


def test_budget_reads_its_spec_on_every_decision() -> None:
    specs = [RetryBudgetSpec(ratio=0.0, min_retries=0)]
    b = RetryBudget(lambda: specs[-1])
    lease = b.lease()
    assert not lease.try_retry()
    specs.append(RetryBudgetSpec(ratio=0.0, min_retries=1))  # a reload
    assert lease.try_retry()


def test_budget_ratio_is_not_lost_to_float_rounding() -> None:
    b = budget(ratio=0.29, min_retries=0)
    for _ in range(100):
        b.lease()
    assert b.limit() == 29  # 0.29 * 100 = 28.999999999999996


# --- outlier ejection ----------------------------------------------------------------------------------------

OUTLIER = OutlierDetection(consecutive_failures=3, base_ejection_s=10, max_ejection_s=60)


def pool(name: str, n: int = 1, models: tuple[str, ...] = ("m",)) -> PoolState:
    spec = Pool.model_validate(
        {
            "name": name,
            "kind": "standard",
            "models": list(models),
            "endpoints": [{"url": f"http://{name}-{i}:8000", "id": f"{name}-{i}"} for i in range(n)],
        }
    )
    return PoolState.from_spec(spec)


def test_ejection_after_consecutive_failures_and_growing_times() -> None:
    a, b = pool("a"), pool("b")
    ep = a.endpoints[0]
    now = 1000.0
    assert note_failure(ep, "HTTP 503", [a, b], OUTLIER, now) is None
    assert note_failure(ep, "HTTP 503", [a, b], OUTLIER, now) is None
    assert note_failure(ep, "HTTP 503", [a, b], OUTLIER, now) == 10  # base x 2^0
    assert ep.ejected
    assert not ep.routable
    assert ep.ejected_until == 1010
    assert a.pick(random.Random(0)) is None

    # A passing health check before the ejection is over changes nothing; after it, the endpoint is back.
    assert not ep.set_health(True, now=1005)
    assert ep.ejected
    assert ep.set_health(True, now=1010)
    assert ep.routable

    # The next ejections in a row: 20, 40, then capped at 60.
    durations = []
    t = 1011.0
    for _ in range(4):
        for _ in range(3):
            d = note_failure(ep, "timeout", [a, b], OUTLIER, t)
        assert d is not None
        durations.append(d)
        t = ep.ejected_until
        assert ep.set_health(True, now=t)
    assert durations == [20, 40, 60, 60]


def test_ejection_time_starts_again_after_a_quiet_period() -> None:
    a, b = pool("a"), pool("b")
    ep = a.endpoints[0]
    for _ in range(3):
        note_failure(ep, "x", [a, b], OUTLIER, 0.0)
    assert ep.set_health(True, now=10.0)
    for _ in range(3):
        d = note_failure(ep, "x", [a, b], OUTLIER, 20.0)  # 10 s after the first ejection ended: k = 2
    assert d == 20
    assert ep.set_health(True, now=40.0)
    for _ in range(3):
        d = note_failure(ep, "x", [a, b], OUTLIER, 40.0 + 60.0)  # max_ejection_s quiet: k starts again
    assert d == 10
    assert ep.ejections == 1


def test_a_success_resets_the_count() -> None:
    a, b = pool("a"), pool("b")
    ep = a.endpoints[0]
    for _ in range(2):
        note_failure(ep, "x", [a, b], OUTLIER, 0.0)
    ep.mark_success()
    for _ in range(2):
        assert note_failure(ep, "x", [a, b], OUTLIER, 0.0) is None
    assert not ep.ejected


def test_a_failed_health_check_keeps_it_ejected_and_unhealthy() -> None:
    a, b = pool("a"), pool("b")
    ep = a.endpoints[0]
    for _ in range(3):
        note_failure(ep, "x", [a, b], OUTLIER, 0.0)
    assert not ep.set_health(False, "down", now=100.0)
    assert ep.ejected
    assert not ep.healthy
    assert ep.set_health(True, now=101.0)
    assert ep.routable


def test_never_eject_the_last_routable_endpoint() -> None:
    a, b = pool("a"), pool("b")
    b.endpoints[0].healthy = False  # b is down: a's endpoint is the last one serving "m"
    ep = a.endpoints[0]
    assert would_strand(ep, [a, b])
    for _ in range(10):
        assert note_failure(ep, "x", [a, b], OUTLIER, 0.0) is None
    assert ep.routable
    b.endpoints[0].healthy = True  # once another endpoint serves the model, the next failure ejects
    assert note_failure(ep, "x", [a, b], OUTLIER, 0.0) == 10


def test_the_guard_is_per_model() -> None:
    a = pool("a", n=2, models=("m", "only-a"))
    b = pool("b", models=("m",))
    a.endpoints[1].weight = 0  # drained
    # "m" is still served by b, but "only-a" has no other routable endpoint.
    assert would_strand(a.endpoints[0], [a, b])
    a.endpoints[1].weight = 1
    assert not would_strand(a.endpoints[0], [a, b])


def test_unreachable_marks_unhealthy_and_counts() -> None:
    a, b = pool("a"), pool("b")
    ep = a.endpoints[0]
    note_failure(ep, "refused", [a, b], OUTLIER, 0.0, unreachable=True)
    assert not ep.healthy
    assert ep.consecutive_failures == 1
    assert not ep.ejected


def test_policy_ignores_429_and_sets_the_metrics() -> None:
    a, b = pool("a"), pool("b")
    ep = a.endpoints[0]
    metrics = GatewayMetrics()
    defaults = Defaults(outlier_detection=OUTLIER)
    policy = AttemptPolicy(lambda: defaults, metrics, clock=lambda: 50.0)
    for _ in range(5):
        policy.failed(ep, PoolStatusError(429, "HTTP 429"), [a, b])
    assert ep.consecutive_failures == 0
    policy.answered(ep, 500, [a, b])
    policy.failed(ep, UpstreamTimeout("slow"), [a, b])
    policy.failed(ep, UpstreamUnreachable("refused"), [a, b])
    assert ep.ejected
    assert ep.ejected_until == 60.0
    reg = metrics.registry
    assert reg.get_sample_value("specgate_endpoint_ejected", {"pool": "a", "endpoint": "a-0"}) == 1
    assert reg.get_sample_value("specgate_endpoint_ejections_total", {"pool": "a", "endpoint": "a-0"}) == 1
    policy.answered(ep, 200, [a, b])
    assert ep.consecutive_failures == 0


# --- labels and the 503 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "result"),
    [
        (PoolStatusError(503, "HTTP 503"), "status_5xx"),
        (PoolStatusError(429, "HTTP 429"), "status_429"),
        (PoolStatusError(401, "creds"), "status_4xx"),
        (UpstreamUnreachable("refused"), "connect_error"),
        (UpstreamConnectError("broke"), "connect_error"),
        (UpstreamTimeout("slow"), "timeout"),
        (StreamStartError("error event"), "stream_error_before_first_chunk"),
    ],
)
def test_failure_results(exc: PoolStatusError, result: str) -> None:
    assert failure_result(exc) == result


def test_status_results() -> None:
    assert [status_result(s) for s in (200, 400, 404, 422, 429, 500)] == [
        "ok",
        "status_4xx",
        "status_4xx",
        "status_4xx",
        "status_429",
        "status_5xx",
    ]


def test_describe_status_uses_the_pools_message() -> None:
    assert describe_status(503, b'{"error": {"message": "queue full", "code": 503}}') == "HTTP 503 (queue full)"
    assert describe_status(502, b'{"object": "error", "message": "bad"}') == "HTTP 502 (bad)"
    assert describe_status(504, b"<html>gateway timeout</html>") == "HTTP 504"
    assert describe_status(503, b"") == "HTTP 503"


def test_exhausted_lists_every_attempt() -> None:
    failures = [
        AttemptFailure("spec", "spec-0", PoolStatusError(503, "HTTP 503"), "status_5xx"),
        AttemptFailure("std", "std-0", UpstreamTimeout("no first event"), "timeout"),
    ]
    err = exhausted(failures)
    assert err.status == 503
    assert err.code == "upstream_timeout"
    assert "spec/spec-0: HTTP 503" in err.message
    assert "std/std-0: no first event" in err.message
    assert err.headers["retry-after"] == "2"
    assert "x-should-retry" not in err.headers
    refused = exhausted(failures[:1], budget_refused=True)
    assert refused.code == "retry_budget_exhausted"
    assert "retry budget" in refused.message


def test_exhausted_by_credentials_says_do_not_retry() -> None:
    failures = [AttemptFailure("spec", "spec-0", PoolStatusError(401, "refused creds"), "status_4xx")]
    assert exhausted(failures).headers["x-should-retry"] == "false"


# --- the plan ------------------------------------------------------------------------------------------------


def view(name: str, models: tuple[str, ...] = ("m",), routable: int = 1, drained: bool = False) -> PoolView:
    return PoolView(name, "standard", frozenset(models), routable, 0, drained)


def test_fallback_model_is_off_by_default() -> None:
    r = Route.model_validate({"preferred": "spec", "fallback": ["std", "small"]})
    plan = plan_route(r, "m", {"spec": view("spec"), "std": view("std"), "small": view("small", ("s",))})
    assert plan.pools == ("spec", "std")
    assert plan.models == ()
    assert plan.model_for("std") is None


def test_fallback_model_only_on_pools_without_the_model_and_last() -> None:
    r = Route.model_validate({"preferred": "spec", "fallback": ["small", "std"], "fallback_model": "s"})
    pools = {"spec": view("spec", ("m", "s")), "std": view("std"), "small": view("small", ("s",))}
    plan = plan_route(r, "m", pools)
    assert plan.pools == ("spec", "std", "small")  # the same model first, another model last
    assert plan.model_for("small") == "s"
    assert plan.model_for("spec") is None  # serves "m": never rewritten
    assert plan.model_for("std") is None


def test_fallback_model_is_not_used_by_the_preferred_pool() -> None:
    r = Route.model_validate({"preferred": "spec", "fallback": ["std"], "fallback_model": "s"})
    plan = plan_route(r, "m", {"spec": view("spec", ("s",)), "std": view("std", routable=0)})
    assert plan.empty


def test_ttft_deadline_is_carried_by_the_plan() -> None:
    r = Route.model_validate({"preferred": "spec", "ttft_deadline_s": 1.5})
    assert plan_route(r, "m", {"spec": view("spec")}).ttft_deadline_s == 1.5


def test_empty_plan_should_not_be_retried_when_nothing_can_change() -> None:
    r = Route.model_validate({"preferred": "spec", "fallback": ["std"]})
    drained = plan_route(r, "m", {"spec": view("spec", routable=0, drained=True), "std": view("std", ("x",))})
    assert drained.empty
    assert dict(drained.skipped) == {"spec": "drained", "std": "model not served"}
    assert drained.unavailable().headers["x-should-retry"] == "false"
    down = plan_route(r, "m", {"spec": view("spec", routable=0), "std": view("std", routable=0)})
    err = down.unavailable()
    assert err.status == 503
    assert err.headers["retry-after"] == "5"
    assert "x-should-retry" not in err.headers


async def test_a_health_round_ends_ejections_that_would_leave_a_model_without_endpoints() -> None:
    from gateway.config.pool import Pool
    from gateway.fleet.health import HealthChecker
    from gateway.fleet.pools import PoolState
    from gateway.observability.metrics import GatewayMetrics

    spec = Pool.model_validate(
        {"name": "p", "kind": "standard", "models": ["m"], "endpoints": [{"url": "http://a:1"}, {"url": "http://b:1"}]}
    )
    pool = PoolState.from_spec(spec)
    a, b = pool.endpoints
    a.eject(0.0, 300.0, 600.0)  # ejected while b was fine
    b.healthy = False  # then b failed its checks; a passes, but its ejection runs for minutes
    checker = HealthChecker(lambda: [pool], GatewayMetrics(), interval_s=1.0, timeout_s=1.0)
    checker._unstrand([pool])
    assert a.routable
    # with another routable endpoint for the model the ejection stands
    a.eject(0.0, 300.0, 600.0)
    b.healthy = True
    checker._unstrand([pool])
    assert not a.routable
