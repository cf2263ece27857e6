"""The simulator's physics: step time, the worked example's shape, token sampling, acceptance, --speculative-config."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from gateway.sim.physics import (
    AcceptanceModel,
    DraftCost,
    SpecConfig,
    TargetCost,
    decode_speedup,
    mean_emitted,
    sample_accepted,
    step_time,
)
from gateway.sim.presets import get_preset, preset_names

T = TargetCost(delta_s=0.01, gamma_s=1e-4, gamma_prefill_s=2e-4, alpha_s=1e-8, epsilon_s=1e-3)


def test_standard_step_is_delta_gamma_alpha_epsilon() -> None:
    # δ + γ·N_decode + γ_prefill·N_prefill + α·N_kv + ε
    assert step_time(T, None, 0, 8, 100, 50_000) == pytest.approx(0.01 + 8e-4 + 0.02 + 5e-4 + 1e-3)


def test_speculative_step_verifies_b_times_k_plus_one_and_pays_the_draft() -> None:
    draft = DraftCost(delta_s=2e-3, gamma_s=1e-5, alpha_s=1e-9, sequential=True)
    b, k, n_kv = 8, 4, 50_000
    target = 0.01 + 1e-4 * b * (k + 1) + 1e-8 * n_kv + 1e-3
    drafting = k * (2e-3 + 1e-5 * b + 1e-9 * n_kv)
    assert step_time(T, draft, k, b, 0, n_kv) == pytest.approx(target + drafting)
    head = DraftCost(delta_s=2.1e-3, gamma_s=8.4e-7, alpha_s=2.4e-9)  # one pass: δ + γ·B·K + α·N_kv
    assert step_time(T, head, k, b, 0, n_kv) == pytest.approx(target + 2.1e-3 + 8.4e-7 * b * k + 2.4e-9 * n_kv)
    # K=0 (a per-batch-size schedule turned speculation off) is exactly a standard step
    assert step_time(T, draft, 0, b, 0, n_kv) == step_time(T, None, 0, b, 0, n_kv)


def test_presets() -> None:
    assert {"llama70b-4xh100", "llama8b-h100"} <= set(preset_names())
    p70 = get_preset("llama70b-4xh100")
    assert p70.target.delta_s == pytest.approx(14e-3)
    assert 60e-6 <= p70.target.gamma_s <= 80e-6
    assert p70.target.gamma_prefill_s == pytest.approx(80e-6)
    assert p70.target.alpha_s == pytest.approx(2.4e-8)
    assert p70.target.epsilon_s == pytest.approx(1.2e-3)
    assert 2e-3 <= p70.drafts["draft_model"].delta_s <= 3e-3
    p8 = get_preset("llama8b-h100")
    # fitted: 3.93e-8·N_kv + 2.10e-5·N_batched + 5.89 ms, overhead 1.21 ms
    assert step_time(p8, None, 0, 10, 0, 10_000) == pytest.approx(3.93e-8 * 1e4 + 2.1e-5 * 10 + 5.89e-3 + 1.21e-3)
    assert p70.draft_for("deepseek_mtp") is p70.drafts["mtp"]
    assert p70.draft_for("ngram_gpu") is p70.drafts["ngram"]
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("gpt-5")
    with pytest.raises(TypeError):
        p70.drafts["ngram"] = p70.drafts["eagle"]  # type: ignore[index]


def test_worked_example_shape_70b() -> None:
    """Published: K=4, a=0.7, 1,500-token contexts: 1.60× at 1, 1.43× at 16, 1.15× at 64, ≈1.0× at 128, 0.89× at 256."""
    p = get_preset("llama70b-4xh100")
    published = {1: 1.60, 16: 1.43, 64: 1.15, 128: 1.0, 256: 0.89}
    got = {b: decode_speedup(p, "draft_model", 4, 0.7, b, 1500) for b in published}
    for b, want in published.items():
        assert got[b] == pytest.approx(want, abs=0.04), (b, got[b])
    speedups = [got[b] for b in sorted(got)]
    assert speedups == sorted(speedups, reverse=True)
    assert got[256] < 1.0 < got[64]
    # higher acceptance moves the crossover to larger batches, lower acceptance to smaller ones
    assert (
        decode_speedup(p, "draft_model", 4, 0.5, 64, 1500) < 1.0 < decode_speedup(p, "draft_model", 4, 0.8, 128, 1500)
    )


def test_mean_emitted_formula() -> None:
    assert mean_emitted(0.7, 4) == pytest.approx((1 - 0.7**5) / 0.3)
    assert mean_emitted(0.0, 4) == 1.0
    assert mean_emitted(1.0, 4) == 5.0


def test_sample_accepted_is_truncated_geometric() -> None:
    rng = random.Random(7)
    a, k, n = 0.7, 4, 100_000
    counts = [0] * (k + 1)
    for _ in range(n):
        counts[sample_accepted(rng, a, k)] += 1
    emitted = [j + 1 for j, c in enumerate(counts) for _ in range(c)]
    mean = statistics.fmean(emitted)
    se = statistics.pstdev(emitted) / math.sqrt(n)
    assert abs(mean - mean_emitted(a, k)) < 4 * se
    pmf = [a**j * (1 - a) for j in range(k)] + [a**k]
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, pmf, strict=True))
    assert chi2 < 18.47  # χ²(df=4) at p=0.001
    assert counts[0] / n == pytest.approx(1 - a, abs=0.01)  # the sample is not the mean: every value occurs


def test_sample_accepted_edges() -> None:
    rng = random.Random(1)
    assert {sample_accepted(rng, 0.0, 4) for _ in range(100)} == {0}
    assert {sample_accepted(rng, 1.0, 4) for _ in range(100)} == {4}
    assert sample_accepted(rng, 0.9, 0) == 0


def test_acceptance_by_temperature() -> None:
    m = AcceptanceModel()
    assert [m.base(t) for t in (0.0, 0.4, 0.8, 1.0)] == pytest.approx([0.81, 0.71, 0.52, 0.38])
    assert m.base(0.2) == pytest.approx(0.76)  # interpolated
    grid = [m.base(i / 20) for i in range(61)]  # 0 … 3.0
    assert all(x >= y for x, y in itertools.pairwise(grid))
    assert m.base(3.0) == m.floor > 0
    means = [m.mean(t / 10, "code", "eagle3") for t in range(21)]
    assert all(x >= y for x, y in itertools.pairwise(means))


def test_acceptance_by_task_and_method() -> None:
    m = AcceptanceModel()
    # ngram: good only where the output repeats the prompt
    for task in ("summarization", "rag", "extraction"):
        assert m.mean(0.0, task, "ngram") > 0.8
    assert m.mean(0.0, "chat", "ngram") < 0.4
    assert m.mean(0.0, "creative", "ngram") < m.mean(0.0, "chat", "ngram")
    assert m.mean(0.0, "summarization", "suffix") > m.mean(0.0, "chat", "suffix")
    # learned drafters: code / structured / tool_use / extraction over creative
    for method in ("draft_model", "eagle", "eagle3", "mtp"):
        creative = m.mean(0.0, "creative", method)
        for task in ("code", "structured", "tool_use", "extraction"):
            assert m.mean(0.0, task, method) > creative + 0.1
    assert m.mean(0.3, "no-such-task", "eagle3") == m.mean(0.3, "chat", "eagle3")
    assert m.mean(0.0, "chat", "deepseek_mtp") == m.mean(0.0, "chat", "mtp")
    values = [
        m.mean(t / 4, task, meth) for t in range(9) for task in ("chat", "structured") for meth in ("eagle", "ngram")
    ]
    assert all(0.01 <= v <= 0.97 for v in values)
    boosted = AcceptanceModel(task_factors={"model": {"chat": 5.0}, "lookup": {}})
    assert boosted.mean(0.0, "chat", "eagle3") == 0.97  # clipped


def test_acceptance_draw_is_beta_around_the_mean() -> None:
    m = AcceptanceModel()
    rng = random.Random(3)
    mean = m.mean(0.0, "code", "eagle3")
    draws = [m.draw(rng, 0.0, "code", "eagle3") for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(mean, abs=0.01)
    kappa = m.concentration
    assert statistics.pstdev(draws) == pytest.approx(math.sqrt(mean * (1 - mean) / (kappa + 1)), rel=0.15)
    assert sum(d < 0.7 for d in draws) / len(draws) > 0.02  # a "good" class (mean 0.89) still has bad requests
    assert max(draws) <= m.draw_max
    fixed = AcceptanceModel(concentration=0)
    assert {fixed.draw(rng, 0.4, "chat", "eagle") for _ in range(10)} == {fixed.mean(0.4, "chat", "eagle")}


def test_spec_config_parses_like_vllm() -> None:
    c = SpecConfig.from_json('{"method": "eagle3", "num_speculative_tokens": 4, "model": "yuhuili/EAGLE3-x"}')
    assert (c.method, c.num_speculative_tokens, c.model) == ("eagle3", 4, "yuhuili/EAGLE3-x")
    assert c.k_for_batch(1) == c.k_for_batch(1000) == 4
    assert c.family == "model"
    ng = SpecConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (ng.prompt_lookup_max, ng.prompt_lookup_min, ng.family) == (5, 5, "lookup")
    ng2 = SpecConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (ng2.prompt_lookup_max, ng2.prompt_lookup_min) == (4, 4)
    assert SpecConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 2}').method == "ngram"
    assert SpecConfig.from_json('{"model": "org/qwama-0.5b", "num_speculative_tokens": 4}').method == "draft_model"
    eagle = SpecConfig.from_json('{"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 4}')
    assert eagle.method == "eagle"
    assert SpecConfig.from_json('{"method": "deepseek_mtp", "num_speculative_tokens": 1}').method == "mtp"
    adaptive = (
        '{"method": "mtp", "num_speculative_tokens": 2, "enable_adaptive_verification": true, "max_model_len": 9}'
    )
    parsed = SpecConfig.from_json(adaptive)
    assert parsed.enable_adaptive_verification is True
    assert parsed.extra == {"max_model_len": 9}  # a valid vLLM key the simulator does not use


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 32}', "num_speculative_tokens_per"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "speculative_model": "x"}', "unknown key"),
        ('{"method": "eagle", "num_speculative_tokens": 4, "model": "m", "tensor_parallel_size": 1}', "draft_tensor"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2, "model": "m"}', "method"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "without speculative model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6, "prompt_lookup_max": 3}', "<="),
        ('{"method": "ngram", "num_speculative_tokens": 2, "enable_adaptive_verification": "yes"}', "boolean"),
        ('{"method": "ngram", "num_speculative_tokens": 4', "JSON"),
        ("[1, 2]", "object"),
    ],
)
def test_spec_config_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpecConfig.from_json(text)


def test_num_speculative_tokens_per_batch_size() -> None:
    c = SpecConfig.from_json(
        '{"method": "eagle3", "model": "m", "num_speculative_tokens": 3,'
        ' "num_speculative_tokens_per_batch_size": [[65, 128, 1], [1, 64, 3], [129, 512, 0]]}'
    )
    assert c.num_speculative_tokens_per_batch_size == ((1, 64, 3), (65, 128, 1), (129, 512, 0))
    assert [c.k_for_batch(n) for n in (0, 1, 64, 65, 128, 129, 512, 4096)] == [3, 3, 3, 1, 1, 0, 0, 0]
    gap = SpecConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 2,'
        ' "num_speculative_tokens_per_batch_size": [[1, 16, 5], [32, 64, 1]]}'
    )
    assert [gap.k_for_batch(n) for n in (1, 16, 17, 31, 32, 65)] == [2, 2, 2, 2, 1, 1]  # capped at K, gaps carried


@pytest.mark.parametrize(
    "schedule",
    ["[[2, 64, 3]]", "[[1, 64, 3], [64, 128, 1]]", "[[1, 64, -1]]", "[[1, 0, 3]]", "[[5, 1, 3]]", "[]", "[[1, 2]]"],
)
def test_per_batch_size_schedule_rejected(schedule: str) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        SpecConfig.from_json(
            f'{{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": {schedule}}}'
        )
