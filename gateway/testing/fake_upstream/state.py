"""Everything mutable of one fake upstream, one instance per app: ``FakeState`` (requests seen, the started /
completed / aborted / broken counters, the Prometheus gauges and counters and their ``/metrics`` text) and
``spec_decode_metrics``, the deterministic per-request speculative-decoding numbers it books and reports.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.testing.fake_upstream.behavior import FakeConfig, Outcome

NUM_SPEC_TOKENS = 4  # K of the pretend speculative config, for the per-request ``metrics`` field
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


# --------------------------------------------------------------------------------------------------------------
# State: everything mutable lives here, one instance per app


@dataclass
class _SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=lambda: [0] * NUM_SPEC_TOKENS)


class FakeState:
    """Requests seen, request counters and the Prometheus numbers of one fake upstream."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.requests: list[dict[str, Any]] = []
        self.started = 0
        self.completed = 0
        self.aborted = 0
        self.broken = 0
        self.default_behavior: str | None = None
        self.health_status = 200
        self.waiting: dict[str, int] = dict.fromkeys(config.models, 0)
        self.running: dict[str, int] = dict.fromkeys(config.models, 0)
        self.finished: dict[tuple[str, str], int] = {(m, r): 0 for m in config.models for r in FINISHED_REASONS}
        self.prompt_tokens: dict[str, int] = dict.fromkeys(config.models, 0)
        self.generation_tokens: dict[str, int] = dict.fromkeys(config.models, 0)
        self.spec: dict[str, _SpecCounters] = {m: _SpecCounters() for m in config.models}

    @property
    def in_flight(self) -> int:
        return sum(self.waiting.values()) + sum(self.running.values())

    def stats(self) -> dict[str, int]:
        return {
            "started": self.started,
            "completed": self.completed,
            "aborted": self.aborted,
            "broken": self.broken,
            "in_flight": self.in_flight,
        }

    def record(self, method: str, path: str, query: str, headers: dict[str, str], body: Any) -> None:
        self.requests.append(
            {"method": method, "path": path, "query": query, "headers": headers, "body": body, "time": time.time()}
        )

    def begin(self, model: str) -> None:
        self.started += 1
        self.waiting[model] = self.waiting.get(model, 0) + 1

    def to_running(self, model: str) -> None:
        self.waiting[model] -= 1
        self.running[model] = self.running.get(model, 0) + 1

    def end(
        self,
        model: str,
        *,
        was_running: bool,
        outcome: Outcome,
        finish_reason: str,
        prompt_tokens: int,
        generated: int,
    ) -> None:
        gauge = self.running if was_running else self.waiting
        gauge[model] -= 1
        if outcome in ("completed", "error"):
            self.completed += 1
        elif outcome == "broken":
            self.broken += 1
        else:
            self.aborted += 1
        reason = {"completed": finish_reason, "error": "error"}.get(outcome, "abort")
        self.finished[(model, reason)] = self.finished.get((model, reason), 0) + 1
        self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + prompt_tokens
        self.generation_tokens[model] = self.generation_tokens.get(model, 0) + generated
        if self.config.spec_metrics and generated > 0:
            s = spec_decode_metrics(generated)
            counters = self.spec.setdefault(model, _SpecCounters())
            counters.drafts += s["num_spec_steps"]
            counters.draft_tokens += s["num_draft_tokens"]
            counters.accepted += s["num_accepted_draft_tokens"]
            hist: list[int] = s["acceptance_histogram"]
            for pos in range(NUM_SPEC_TOKENS):
                counters.per_pos[pos] += sum(hist[pos + 1 :])

    def prometheus(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for sample, labels, value in samples:
                rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                lines.append(f"{sample}{{{rendered}}} {float(value)}")

        models = list(dict.fromkeys([*self.config.models, *self.waiting, *self.running]))

        def per_model(name: str, values: dict[str, int]) -> list[tuple[str, dict[str, str], float]]:
            return [(name, {"model_name": m, "engine": "0"}, values.get(m, 0)) for m in models]

        family(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            per_model("vllm:num_requests_running", self.running),
        )
        family(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            per_model("vllm:num_requests_waiting", self.waiting),
        )
        family(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [("vllm:kv_cache_usage_perc", {"model_name": m, "engine": "0"}, 0.0) for m in models],
        )
        family(
            "vllm:request_success",
            "counter",
            "Count of successfully processed requests.",
            [
                (
                    "vllm:request_success_total",
                    {"model_name": m, "engine": "0", "finished_reason": r},
                    self.finished.get((m, r), 0),
                )
                for m in models
                for r in FINISHED_REASONS
            ],
        )
        family(
            "vllm:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            per_model("vllm:prompt_tokens_total", self.prompt_tokens),
        )
        family(
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            per_model("vllm:generation_tokens_total", self.generation_tokens),
        )
        if self.config.spec_metrics:
            spec = {m: self.spec.get(m, _SpecCounters()) for m in models}
            family(
                "vllm:spec_decode_num_drafts",
                "counter",
                "Number of spec decoding drafts.",
                per_model("vllm:spec_decode_num_drafts_total", {m: c.drafts for m, c in spec.items()}),
            )
            family(
                "vllm:spec_decode_num_draft_tokens",
                "counter",
                "Number of draft tokens.",
                per_model("vllm:spec_decode_num_draft_tokens_total", {m: c.draft_tokens for m, c in spec.items()}),
            )
            family(
                "vllm:spec_decode_num_accepted_tokens",
                "counter",
                "Number of accepted tokens.",
                per_model("vllm:spec_decode_num_accepted_tokens_total", {m: c.accepted for m, c in spec.items()}),
            )
            family(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "Accepted tokens per draft position.",
                [
                    (
                        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        {"model_name": m, "engine": "0", "position": str(pos)},
                        c.per_pos[pos],
                    )
                    for m, c in spec.items()
                    for pos in range(NUM_SPEC_TOKENS)
                ],
            )
        return "\n".join(lines) + "\n"


def spec_decode_metrics(completion_tokens: int) -> dict[str, Any]:
    """The deterministic per-request ``metrics.speculative_decoding`` of the fake: K=4, the first token from
    the prefill, then decode steps that accept 2 drafts each (3 tokens a step with the bonus token) and a
    shorter last step. ``acceptance_histogram[i]`` = number of steps that accepted i drafts."""
    decode_tokens = max(0, completion_tokens - 1)
    steps = math.ceil(decode_tokens / 3)
    hist = [0] * (NUM_SPEC_TOKENS + 1)
    if steps:
        hist[2] += steps - 1
        hist[decode_tokens - 3 * (steps - 1) - 1] += 1
    accepted = decode_tokens - steps
    draft_tokens = steps * NUM_SPEC_TOKENS
    return {
        "mean_acceptance_length": (1 + accepted / steps) if steps else None,
        "draft_acceptance_rate": (accepted / draft_tokens) if draft_tokens else None,
        "acceptance_histogram": hist,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": draft_tokens,
        "num_spec_tokens": NUM_SPEC_TOKENS,
    }
