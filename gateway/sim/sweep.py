"""Open-loop QPS sweeps of one simulated server, with and without speculative decoding.

Reproduces the shape of the vLLM blog's measurement of speculative decoding under load: Llama-3-70B on 4×H100, K=4,
end-to-end latency at QPS 1, 2, 4, 8, 10, for a draft model on ShareGPT-like chat and for ngram on
CNN/DailyMail-like summarisation. Arrivals are Poisson in simulated time (open loop: the offered load does not drop
when the server slows down). The engine runs in-process on its simulated clock, so a sweep takes (simulated duration
× time scale) of wall time per point.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from dataclasses import dataclass

from gateway.sim.engine import Engine, GenRequest
from gateway.sim.metrics import VllmMetrics
from gateway.sim.physics import AcceptanceModel, SpecConfig
from gateway.sim.presets import get_preset


@dataclass(frozen=True, slots=True)
class Workload:
    """Request sizes (lognormal around a mean) and the task/temperature that set the acceptance."""

    name: str
    prompt_mean: float
    output_mean: float
    sigma: float
    task: str
    temperature: float

    def sample(self, rng: random.Random) -> tuple[int, int]:
        def draw(mean: float) -> int:
            mu = math.log(mean) - self.sigma**2 / 2
            return max(1, round(rng.lognormvariate(mu, self.sigma)))

        return draw(self.prompt_mean), draw(self.output_mean)


# ShareGPT conversations (the blog's draft-model run) and CNN/DailyMail articles to summarise (its ngram run).
WORKLOADS = {
    "sharegpt": Workload("sharegpt", prompt_mean=230, output_mean=165, sigma=0.6, task="chat", temperature=0.0),
    "cnn_dailymail": Workload(
        "cnn_dailymail", prompt_mean=900, output_mean=165, sigma=0.4, task="summarization", temperature=0.0
    ),
}

# Read from the blog's charts: end-to-end seconds at QPS 1, 2, 4, 8, 10.
PUBLISHED = {
    ("sharegpt", "draft_model"): {1: 1.65, 2: 1.75, 4: 2.27, 8: 3.4, 10: 4.8},
    ("sharegpt", None): {1: 2.55, 2: 2.6, 4: 2.95, 8: 3.5, 10: 3.43},
    ("cnn_dailymail", "ngram"): {1: 0.97, 2: 1.23, 4: 1.8, 8: 10.7},
    ("cnn_dailymail", None): {1: 2.75, 2: 2.95, 4: 3.78, 8: 5.75},
}


@dataclass(frozen=True, slots=True)
class PointResult:
    qps: float
    speculative: bool
    requests: int
    mean_e2e_s: float
    p50_e2e_s: float
    p99_e2e_s: float
    mean_acceptance: float | None


async def run_point(
    preset_name: str,
    spec_json: str | None,
    workload: Workload,
    qps: float,
    *,
    duration_s: float = 120.0,
    time_scale: float = 0.05,
    seed: int = 0,
    virtual_clock: bool = True,
) -> PointResult:
    """Offer Poisson arrivals at ``qps`` for ``duration_s`` simulated seconds; latency of every request.

    On the virtual clock (default) simulated time jumps from event to event: exact and fast, with no harness in
    the measurement. ``virtual_clock=False`` runs on the wall clock at ``time_scale`` instead."""
    preset = get_preset(preset_name)
    spec = SpecConfig.from_json(spec_json) if spec_json else None
    metrics = VllmMetrics(model_name="sim", speculative=spec.num_speculative_tokens if spec else None)
    engine = Engine(preset, spec, metrics, time_scale=time_scale, seed=seed, virtual_clock=virtual_clock)
    accept = AcceptanceModel()
    rng = random.Random(seed)
    await engine.start()
    latencies: list[float] = []
    accepted: list[float] = []

    async def consume(gen_req: GenRequest) -> None:
        gen = engine.submit(gen_req)
        async for _ in gen:
            pass
        if gen.finished is not None and gen.arrival is not None:
            latencies.append(gen.finished - gen.arrival)
        if gen.spec.draft_acceptance_rate is not None:
            accepted.append(gen.spec.draft_acceptance_rate)

    tasks: list[asyncio.Task[None]] = []
    try:
        t = 0.0
        i = 0
        while True:
            t += rng.expovariate(qps)
            if t > duration_s:
                break
            await engine.sleep_until(t)
            prompt, output = workload.sample(rng)
            a = accept.draw(rng, workload.temperature, workload.task, spec.method if spec else "draft_model")
            req = GenRequest(f"r{i}", prompt_tokens=prompt, output_tokens=output, acceptance=a)
            tasks.append(asyncio.create_task(consume(req)))
            i += 1
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await engine.stop()
    latencies.sort()
    return PointResult(
        qps=qps,
        speculative=spec is not None,
        requests=len(latencies),
        mean_e2e_s=statistics.fmean(latencies) if latencies else math.nan,
        p50_e2e_s=latencies[len(latencies) // 2] if latencies else math.nan,
        p99_e2e_s=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else math.nan,
        mean_acceptance=statistics.fmean(accepted) if accepted else None,
    )


def render_blog_table(rows: list[tuple[str, str | None, PointResult]]) -> str:
    """Simulated mean E2E next to the blog's figure for each (workload, method, QPS)."""
    head = f"{'workload':<15}{'method':<13}{'QPS':>5}{'sim mean E2E':>14}{'sim p99':>9}{'blog':>7}{'accept':>8}{'n':>6}"
    lines = [head, "-" * len(head)]
    for wname, method, r in rows:
        blog = PUBLISHED.get((wname, method), {}).get(int(r.qps))
        acc = f"{r.mean_acceptance:.2f}" if r.mean_acceptance is not None else "-"
        lines.append(
            f"{wname:<15}{method or 'none':<13}{r.qps:>5g}{r.mean_e2e_s:>12.2f} s{r.p99_e2e_s:>7.2f} s"
            f"{(f'{blog:.2f}' if blog is not None else '-'):>7}{acc:>8}{r.requests:>6}"
        )
    return "\n".join(lines)


# The blog's configurations: a 0.5B draft model (Qwama-0.5B) and ngram prompt lookup, K=4 both.
BLOG_RUNS: tuple[tuple[str, str | None], ...] = (
    ("sharegpt", '{"method": "draft_model", "model": "turboderp/Qwama-0.5B-Instruct", "num_speculative_tokens": 4}'),
    ("sharegpt", None),
    ("cnn_dailymail", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'),
    ("cnn_dailymail", None),
)


async def blog_sweep(
    preset: str = "llama70b-4xh100", qps: tuple[float, ...] = (1, 2, 4, 8, 10), duration_s: float = 120.0
) -> list[tuple[str, str | None, PointResult]]:
    rows: list[tuple[str, str | None, PointResult]] = []
    for wname, spec_json in BLOG_RUNS:
        method = SpecConfig.from_json(spec_json).method if spec_json else None
        for q in qps:
            if wname == "cnn_dailymail" and q > 8:
                continue  # the blog stops at QPS 8 there
            r = await run_point(preset, spec_json, WORKLOADS[wname], q, duration_s=duration_s)
            rows.append((wname, method, r))
    return rows
