"""``specgate bench soak`` in small (a minute, 40 streams): real simulated pools, the gateway as a process,
concurrent streams with faults on a compressed schedule (cut streams, hangs, 503s, a server restart) and a share of
clients that stop reading. The checks are the soak's own (``Report.check``): every request exactly one terminal
outcome (by request id, against the gateway's access log), no stream without its end, in-flight gauges back to 0,
RSS flat after warm-up (the run's default 10%), no ejection outside a fault window."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.bench.soak import _Soak, run_soak
from gateway.bench.soak_checks import Report, Sample, SoakConfig
from gateway.sim.launch import StandIn
from tests.conftest import closed_port_url

pytestmark = pytest.mark.integration


def test_soak_for_a_minute_keeps_every_invariant() -> None:
    # The fault windows, the warm-up and the ejection allowance are fractions of the duration or follow the
    # faults as they happen, so a slow machine makes the run do less, not fail: no check is a wall-clock deadline.
    cfg = SoakConfig(streams=40, duration_s=60, stall_share=0.05, send_timeout_s=1.0)
    report = run_soak(cfg)
    print(report.render())
    assert not report.problems, report.render()
    assert report.sent > 100
    assert report.outcomes["ok"] > report.sent // 2
    assert report.outcomes["stalled_cut"] > 0  # clients that stopped reading were cut off by the send deadline
    assert {name for _, _, name in report.windows} >= {"cut", "hang", "503", "restart"}


def test_the_checks_can_fail() -> None:
    r = Report(SoakConfig(duration_s=10))
    r.sent, r.counted, r.final_in_flight = 10, 9, 2
    r.outcomes["broken"] = 1
    r.windows = [(1.0, 2.0, "cut")]
    r.ejected_at = [9.0]
    r.samples = [Sample(0.0, 1000, 20, 0, 0, 0), Sample(10.0, 1200, 80, 0, 0, 0)]
    r.answered = {"a", "b", "c"}
    r.failed = {"d"}
    r.logged.update({"a": 2, "b": 1, "x": 1})  # a twice, c missing, x never sent; 4 lines, 9 counted
    r.log_read = True
    r.check()
    kinds = ("more than once", "no client sent", "missing from", "access log has", "[DONE]", "in-flight", "RSS", "fds")
    for kind in (*kinds, "outside every fault window"):
        assert any(kind in p for p in r.problems), (kind, r.problems)
    assert len(r.problems) == 9


def test_client_side_failures_may_be_unseen_by_the_gateway_and_effects_outlast_a_window() -> None:
    r = Report(SoakConfig(duration_s=10, effect_s=5.0))
    r.sent, r.counted, r.final_in_flight = 3, 2, 0
    r.answered, r.failed = {"a", "b"}, {"c"}  # c was refused before the gateway read it
    r.logged.update({"a": 1, "b": 1})
    r.log_read = True
    r.windows = [(1.0, 2.0, "restart")]
    r.ejected_at = [6.5]  # within effect_s of the window's end
    r.check()
    assert r.problems == []
    r.log_read = False
    r.problems = []
    r.check()
    assert len(r.problems) == 1
    assert "not made" in r.problems[0]  # an unread log is a failure, never a pass


def test_a_fault_that_cannot_be_turned_off_is_one_of_the_runs_problems() -> None:
    port = int(closed_port_url().rsplit(":", 1)[1])
    soak = _Soak(SoakConfig(), "http://127.0.0.1:9", 0, [StandIn("std", port, [])], None)

    async def reset() -> bool:
        async with aiohttp.ClientSession() as session:
            return await soak.sim_faults(session, soak.stand_ins[0], "POST", "/sim/faults/reset", None)

    assert asyncio.run(reset()) is False
    assert len(soak.report.problems) == 1
    assert "/sim/faults/reset on std's server failed" in soak.report.problems[0]
