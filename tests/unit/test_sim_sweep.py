"""The QPS sweep harness (virtual clock): open-loop arrivals, latency per request, the blog's shape at low load."""

from __future__ import annotations

from gateway.sim.sweep import BLOG_RUNS, PUBLISHED, WORKLOADS, render_blog_table, run_point


async def test_speculation_wins_at_low_load_and_the_table_renders() -> None:
    spec_json = BLOG_RUNS[0][1]
    spec = await run_point("llama70b-4xh100", spec_json, WORKLOADS["sharegpt"], 1.0, duration_s=40)
    std = await run_point("llama70b-4xh100", None, WORKLOADS["sharegpt"], 1.0, duration_s=40)
    assert spec.requests == std.requests > 20  # same seed, same arrivals
    assert spec.mean_e2e_s < std.mean_e2e_s / 1.3
    assert spec.mean_acceptance is not None
    assert std.mean_acceptance is None
    table = render_blog_table([("sharegpt", "draft_model", spec), ("sharegpt", None, std)])
    assert f"{PUBLISHED[('sharegpt', 'draft_model')][1]:.2f}" in table


async def test_the_v0_preset_loses_at_high_load_like_the_blog() -> None:
    spec_json = BLOG_RUNS[0][1]
    spec = await run_point("llama70b-4xh100-v0", spec_json, WORKLOADS["sharegpt"], 10.0, duration_s=30)
    std = await run_point("llama70b-4xh100-v0", None, WORKLOADS["sharegpt"], 10.0, duration_s=30)
    assert spec.mean_e2e_s > std.mean_e2e_s
