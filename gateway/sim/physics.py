"""The physics of a simulated vLLM server: cost models, per-step latency, draft acceptance, token sampling. Pure.

The named deployments (presets) built from these cost models live in ``gateway.sim.presets``.

One engine step with continuous batching (a cheap latency model that still reproduces vLLM's published numbers):

- standard step: ``T = δ + γ·N_decode + γ_prefill·N_prefill + α·N_kv + ε``;
- speculative step with K drafts: ``T = T_draft + δ + γ·B·(K+1) + γ_prefill·N_prefill + α·N_kv + ε`` — the target
  verifies B·(K+1) tokens and the proposer pays its own cost (a draft model runs K sequential passes, an EAGLE/MTP
  head one cheap pass, n-gram/suffix lookup next to nothing);
- each decoding sequence then emits ``accepted + 1`` tokens, ``accepted`` SAMPLED from the truncated geometric
  distribution with that request's acceptance ``a`` (never the mean: the mean hides the p99).

Acceptance depends on the request: a base by temperature (0.81/0.71/0.52/0.38 at 0/0.4/0.8/1.0, typical of a draft
model) times a factor per (proposer family, task), clipped, then one draw per request from a Beta distribution
around that mean, so a "good" class still has requests that are bad for speculation.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# ---------------------------------------------------------------------------------------------------------------
# Costs and presets


@dataclass(frozen=True, slots=True)
class TargetCost:
    """The target model's step: ``delta + gamma·N_decode_tokens + gamma_prefill·N_prefill_tokens + alpha·N_kv + eps``.

    ``delta_s``: fixed cost of a forward pass (weights read once); ``gamma_s``: per batched decode/verify token;
    ``gamma_prefill_s``: per prompt token; ``alpha_s``: per KV-cache token read (attention); ``epsilon_s``: CPU
    overhead per step (scheduling, sampling, detokenisation).
    """

    delta_s: float
    gamma_s: float
    gamma_prefill_s: float
    alpha_s: float
    epsilon_s: float

    def step_time(self, n_decode_tokens: int, n_prefill_tokens: int, n_kv: int) -> float:
        return (
            self.delta_s
            + self.gamma_s * n_decode_tokens
            + self.gamma_prefill_s * n_prefill_tokens
            + self.alpha_s * n_kv
            + self.epsilon_s
        )


@dataclass(frozen=True, slots=True)
class DraftCost:
    """The proposer's cost per step that carries K drafts for B decoding sequences.

    ``sequential=True`` (a separate draft model): ``K·(delta + gamma·B + alpha·N_kv)`` — K autoregressive passes.
    ``sequential=False`` (EAGLE/MTP heads, lookup proposers): ``delta + gamma·B·K + alpha·N_kv`` — one pass (or a CPU
    lookup) whose cost grows with the number of drafted tokens. Either way the drafter also ingests this step's
    prompt tokens at ``gamma_prefill_s`` each.
    """

    delta_s: float
    gamma_s: float
    alpha_s: float
    gamma_prefill_s: float = 0.0
    sequential: bool = False

    def step_time(self, k: int, n_decode_seqs: int, n_prefill_tokens: int, n_kv: int) -> float:
        t = self.gamma_prefill_s * n_prefill_tokens
        if k <= 0 or n_decode_seqs <= 0:
            return t
        if self.sequential:
            return t + k * (self.delta_s + self.gamma_s * n_decode_seqs + self.alpha_s * n_kv)
        return t + self.delta_s + self.gamma_s * n_decode_seqs * k + self.alpha_s * n_kv


@dataclass(frozen=True, slots=True)
class Preset:
    """A modelled deployment: the target's cost, a proposer cost per method, and vLLM's capacity limits."""

    name: str
    description: str
    target: TargetCost
    drafts: Mapping[str, DraftCost]
    max_model_len: int
    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def draft_for(self, method: str) -> DraftCost:
        """The proposer cost for a vLLM method name (``deepseek_mtp`` → ``mtp``, ``ngram_gpu`` → ``ngram``, …)."""
        return self.drafts[cost_family(method)]


def step_time(
    model: Preset | TargetCost,
    draft: DraftCost | None,
    k: int,
    n_decode_seqs: int,
    n_prefill_tokens: int,
    n_kv: int,
) -> float:
    """Seconds for one engine step. ``k == 0`` (no speculative config, or a per-batch-size K of 0) is a standard step;
    ``k > 0`` verifies ``n_decode_seqs·(k+1)`` tokens and adds the proposer's cost (none when ``draft`` is None)."""
    target = model.target if isinstance(model, Preset) else model
    if k <= 0:
        return target.step_time(n_decode_seqs, n_prefill_tokens, n_kv)
    t = target.step_time(n_decode_seqs * (k + 1), n_prefill_tokens, n_kv)
    if draft is not None:
        t += draft.step_time(k, n_decode_seqs, n_prefill_tokens, n_kv)
    return t


def mean_emitted(a: float, k: int) -> float:
    """Expected tokens per sequence per speculative step: ``(1 − a^(K+1)) / (1 − a)`` (accepted drafts + bonus)."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def decode_speedup(preset: Preset, method: str, k: int, a: float, batch: int, context: int) -> float:
    """Steady-state decode throughput of speculative over standard at ``batch`` sequences of ``context`` tokens, using
    the MEAN acceptance length: the analytic shape the engine should reproduce (tests, README tables)."""
    n_kv = batch * context
    standard = step_time(preset, None, 0, batch, 0, n_kv)
    spec = step_time(preset, preset.draft_for(method), k, batch, 0, n_kv)
    return mean_emitted(a, k) * standard / spec


def sample_accepted(rng: random.Random, a: float, k: int) -> int:
    """Draft tokens accepted in one step: position i is accepted with probability ``a`` while every earlier one was,
    stop at the first rejection, at most ``k`` (truncated geometric). The step emits this plus one bonus token."""
    n = 0
    rand = rng.random
    while n < k and rand() < a:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# --speculative-config, as vLLM 0.33 parses it

_MTP_TYPES = frozenset(
    {
        "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp",
        "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp",
        "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "bailing_hybrid_v3_mtp", "minimax_m3_mtp",
        "bailing_hybrid_mtp", "mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "step5_mtp", "hy_v3_mtp",
        "hy_v4_mtp", "gemma4_mtp", "inkling_mtp", "glm5_next_mtp",
    }
)  # fmt: skip
METHODS = frozenset(
    {"ngram", "[ngram]", "draft_model", "suffix", "custom_class", "eagle", "eagle3", "extract_hidden_states"}
    | {"ngram_gpu", "dflash", "dspark"}
    | _MTP_TYPES
)
# vLLM 0.33's SpeculativeConfig fields a user may set (it forbids any other key). The simulator uses the first
# eight; the rest are accepted and kept in ``SpecConfig.extra``.
_USED_KEYS = frozenset(
    {
        "method", "num_speculative_tokens", "model", "draft_tensor_parallel_size", "prompt_lookup_max",
        "prompt_lookup_min", "num_speculative_tokens_per_batch_size", "enable_adaptive_verification",
    }
)  # fmt: skip
_OTHER_KEYS = frozenset(
    {
        "enforce_eager", "quantization", "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len",
        "revision", "code_revision", "index_share_for_mtp_iteration", "disable_padded_drafter_batch",
        "disable_eagle_block_drop", "disable_lookahead_block_hashes", "draft_lm_head_quantization",
        "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob", "draft_load_config", "rejection_sample_method",
        "synthetic_acceptance_rates", "synthetic_acceptance_length", "draft_sample_method", "dspark_draft_topk",
        "xpress_topc", "fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k",
    }
)  # fmt: skip
_REMOVED = MappingProxyType(
    {
        "disable_by_batch_size": "was removed from vLLM; use num_speculative_tokens_per_batch_size, e.g. "
        "[[1, 64, 3], [65, 128, 1], [129, 512, 0]]",
        "tensor_parallel_size": "is not a valid argument in the speculative_config; pass draft_tensor_parallel_size",
        "acceptance_method": "was removed from vLLM (V0 only)",
    }
)


def cost_family(method: str) -> str:
    """Which proposer cost a vLLM method uses (the keys of ``Preset.drafts``)."""
    if method in _MTP_TYPES:
        return "mtp"
    return {
        "[ngram]": "ngram",
        "ngram_gpu": "ngram",
        "dspark": "dflash",
        "custom_class": "draft_model",
        "extract_hidden_states": "eagle3",
    }.get(method, method)


def acceptance_family(method: str) -> str:
    """``lookup`` (n-gram/suffix: copies from the context) or ``model`` (a learned drafter)."""
    return "lookup" if cost_family(method) in ("ngram", "suffix") else "model"


def _int(d: Mapping[str, Any], key: str, minimum: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"speculative_config.{key} must be an integer >= {minimum} (got {v!r})")
    return v


def _schedule(raw: Any) -> tuple[tuple[int, int, int], ...]:
    """Validate ``num_speculative_tokens_per_batch_size`` as vLLM does (inclusive ranges, first starts at 1)."""
    key = "speculative_config.num_speculative_tokens_per_batch_size"
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{key} must be a non-empty list of [range_start, range_end, num_speculative_tokens]")
    out: list[tuple[int, int, int]] = []
    for entry in raw:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ValueError(f"{key}: each entry must be [range_start, range_end, num_speculative_tokens]: {entry!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in entry):
            raise ValueError(f"{key}: entries must be integers: {entry!r}")
        lo, hi, k = entry
        if lo <= 0 or hi <= 0:
            raise ValueError(f"{key}: batch-size range ({lo}, {hi}) must be positive")
        if lo > hi:
            raise ValueError(f"{key}: range start must be <= end in {entry!r}")
        if k < 0:
            raise ValueError(f"{key}: num_speculative_tokens must be >= 0 in {entry!r}")
        out.append((lo, hi, k))
    out.sort()
    prev_end = 0
    for lo, hi, _ in out:
        if lo <= prev_end:
            raise ValueError(f"{key}: batch-size ranges must not overlap")
        prev_end = hi
    if out[0][0] != 1:
        raise ValueError(f"{key}: the first batch-size range must start at 1")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """``vllm serve --speculative-config '<json>'`` as vLLM 0.33 accepts it (unknown keys rejected)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    enable_adaptive_verification: bool = False
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_json(cls, text: str) -> SpecConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SpecConfig:
        for key in raw:
            if key in _REMOVED:
                raise ValueError(f"speculative_config: {key!r} {_REMOVED[key]}")
            if key not in _USED_KEYS and key not in _OTHER_KEYS:
                raise ValueError(f"speculative_config: unknown key {key!r} (vLLM rejects extra fields)")
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError("speculative_config.model must be a string")
        method = raw.get("method")
        if method is None:  # vLLM infers it from the model
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"speculative_config.method {method!r} is not one of {', '.join(sorted(METHODS))}")
        if method == "draft_model" and model:  # vLLM's detection from the draft's name
            low = model.lower()
            detect = (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark"))
            for needle, detected in detect:
                if needle in low:
                    method = detected
                    break
        if method in _MTP_TYPES:
            method = "mtp"
        if method == "[ngram]":
            method = "ngram"
        k = _int(raw, "num_speculative_tokens", 1)
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens must be provided (an integer > 0)")
        if model is None and method in ("draft_model", "eagle", "eagle3", "dflash"):
            raise ValueError("num_speculative_tokens was provided but without speculative model")
        if method == "custom_class" and model is None:
            raise ValueError("method='custom_class' requires 'model' to contain the custom proposer module path")
        tp = _int(raw, "draft_tensor_parallel_size", 1)
        lmax, lmin = _int(raw, "prompt_lookup_max", 1), _int(raw, "prompt_lookup_min", 1)
        if method in ("ngram", "ngram_gpu"):
            lmax, lmin = lmax or lmin or 5, lmin or lmax or 5
            if lmin > lmax:
                raise ValueError(f"prompt_lookup_min={lmin} must be <= prompt_lookup_max={lmax}")
        sched_raw = raw.get("num_speculative_tokens_per_batch_size")
        sched = None if sched_raw is None else _schedule(sched_raw)
        adaptive = raw.get("enable_adaptive_verification", False)
        if not isinstance(adaptive, bool):
            raise ValueError("speculative_config.enable_adaptive_verification must be a boolean")
        extra = MappingProxyType({key: v for key, v in raw.items() if key in _OTHER_KEYS})
        return cls(method, k, model, tp, lmax, lmin, sched, adaptive, extra)

    def k_for_batch(self, n: int) -> int:
        """K for a step that schedules ``n`` requests: vLLM's dense lookup (gaps and the tail carry the previous
        range's K forward; never more than ``num_speculative_tokens``)."""
        k_max = self.num_speculative_tokens
        if self.num_speculative_tokens_per_batch_size is None:
            return k_max
        n = max(n, 1)
        last = k_max
        for lo, hi, k in self.num_speculative_tokens_per_batch_size:
            if n < lo:
                break
            last = k
            if n <= hi:
                break
        return min(k_max, last)

    @property
    def family(self) -> str:
        return acceptance_family(self.method)


# ---------------------------------------------------------------------------------------------------------------
# Acceptance

TASKS = ("chat", "code", "summarization", "extraction", "rag", "math", "creative", "structured", "tool_use")

_TASK_FACTORS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        # n-gram/suffix copy spans of the context: they shine where the output repeats the prompt (a summary quotes
        # its article, RAG its passages, code edits the file, extraction its fields) and fail on open text.
        "lookup": MappingProxyType(
            {
                "summarization": 1.10, "rag": 1.06, "extraction": 1.05, "code": 0.95, "tool_use": 0.70,
                "structured": 0.65, "math": 0.50, "chat": 0.40, "creative": 0.30,
            }
        ),
        # A learned drafter predicts the target's distribution: easiest on low-entropy output (syntax, schemas,
        # JSON arguments), hardest on creative text.
        "model": MappingProxyType(
            {
                "structured": 1.12, "code": 1.10, "tool_use": 1.10, "extraction": 1.08, "math": 1.02,
                "summarization": 1.00, "rag": 1.00, "chat": 0.95, "creative": 0.80,
            }
        ),
    }
)  # fmt: skip
_METHOD_FACTORS: Mapping[str, float] = MappingProxyType(
    {"eagle": 0.95, "eagle3": 1.0, "mtp": 1.05, "draft_model": 1.0, "dflash": 1.0, "ngram": 1.0, "suffix": 1.05}
)


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    """Per-request draft acceptance ``a``: ``base(temperature) × task factor × method factor``, clipped, then drawn.

    ``temperature_points``: the piecewise-linear base (the published points, extended above 1.0 down to ``floor``).
    ``task_factors[family][task]`` with family ``lookup`` (ngram, suffix) or ``model`` (draft model, EAGLE, MTP…);
    an unknown task counts as ``chat``. ``concentration`` κ of the per-request Beta(κ·m, κ·(1−m)); κ → ∞ (or 0)
    gives every request the mean. Draws are capped at ``draw_max``.
    """

    temperature_points: tuple[tuple[float, float], ...] = (
        (0.0, 0.81),
        (0.4, 0.71),
        (0.8, 0.52),
        (1.0, 0.38),
        (1.5, 0.20),
        (2.0, 0.10),
    )
    floor: float = 0.10
    task_factors: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: _TASK_FACTORS)
    method_factors: Mapping[str, float] = field(default_factory=lambda: _METHOD_FACTORS)
    clip_min: float = 0.01
    clip_max: float = 0.97
    concentration: float = 12.0
    draw_max: float = 0.99

    def base(self, temperature: float) -> float:
        pts = self.temperature_points
        t = max(0.0, temperature)
        if t <= pts[0][0]:
            return max(self.floor, pts[0][1])
        for (t0, a0), (t1, a1) in itertools.pairwise(pts):
            if t <= t1:
                return max(self.floor, a0 + (a1 - a0) * (t - t0) / (t1 - t0))
        return max(self.floor, pts[-1][1])

    def mean(self, temperature: float, task: str, method: str) -> float:
        factors = self.task_factors.get(acceptance_family(method), {})
        f = factors.get(task, factors.get("chat", 1.0))
        m = self.base(temperature) * f * self.method_factors.get(cost_family(method), 1.0)
        return min(self.clip_max, max(self.clip_min, m))

    def draw(self, rng: random.Random, temperature: float, task: str, method: str) -> float:
        m = self.mean(temperature, task, method)
        kappa = self.concentration
        if kappa <= 0 or kappa == float("inf"):
            return m
        return min(self.draw_max, max(0.0, rng.betavariate(m * kappa, (1.0 - m) * kappa)))
