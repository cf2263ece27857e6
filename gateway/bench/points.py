"""What a policy sweep is made of: the policies and their routing files, how the simulated servers run
(``Setup``), and one measured load point (``Point``). Shared by the sweep and its report."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gateway.bench.load import Summary
from gateway.sim.launch import PRESET
from gateway.sim.physics import DraftCost, TargetCost
from gateway.sim.presets import get_preset
from gateway.sim.wire import OutputLengths

POLICIES = (
    "standard", "speculative", "nginx", "adaptive", "peer-cache-aware", "peer-round-robin", "peer-cache-aware-mixed",
    "adaptive-no-affinity",
)  # fmt: skip
DEFAULT_POLICIES = POLICIES[:4]  # the peers (``bench.peer``) and the variant run only when asked for
LABELS = {
    "standard": "all standard",
    "speculative": "all speculative",
    "nginx": "NGINX temperature rule",
    "adaptive": "specgate adaptive",
    "peer-cache-aware": "vllm-router cache_aware, standard fleet",
    "peer-round-robin": "vllm-router round_robin, standard fleet",
    "peer-cache-aware-mixed": "vllm-router cache_aware, mixed fleet",
    "adaptive-no-affinity": "specgate adaptive, no prefix affinity",
}
POLICY_FILES = {
    "standard": "bench/policies/standard-only.yaml",
    "speculative": "bench/policies/speculative-only.yaml",
    "nginx": "bench/policies/nginx-seed.yaml",
    "peer-cache-aware": "bench/policies/standard-only.yaml",
    "peer-round-robin": "bench/policies/standard-only.yaml",
}
DEFAULT_LOADS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.1)
FIRST_WARMUP = 3  # a sweep's first load point warms up this many times as long (the controllers start from home)


@dataclass(frozen=True, slots=True)
class Setup:
    """How the simulated servers run."""

    time_scale: float = 0.5
    max_num_seqs: int = 32
    scale: int = 8  # a batch of max_num_seqs stands for one of max_num_seqs × scale
    output_median: float = 80.0
    output_sigma: float = 0.5
    duration_s: float = 12.0  # wall seconds of arrivals per load point (per repeat)
    seed: int = 7
    repeats: int = 3  # runs per load point with their own arrivals; percentiles over all their requests
    controller_time_scale: float | None = 0.1  # the controllers' time constants x this (None: time_scale)
    min_requests: int = 200  # measured requests per point at least: low loads get more runs than ``repeats``
    warmup_s: float = 12.0  # wall seconds of arrivals at a load point's rate before its first measured run
    spec_servers: int = 1  # the mixed fleet: speculative servers ...
    std_servers: int = 1  # ... and standard ones; a homogeneous fleet gets as many servers in all
    gateway_workers: int = 1  # gateway processes on one port (each its own prefix indexes, as separate replicas)

    @property
    def servers(self) -> int:
        return self.spec_servers + self.std_servers

    @property
    def fleet(self) -> str:
        return f"{self.spec_servers}+{self.std_servers}"

    @property
    def lengths(self) -> OutputLengths:
        return OutputLengths(self.output_median, self.output_sigma)

    def costs(self, method: str | None) -> tuple[TargetCost, DraftCost | None]:
        """The simulated servers' target and (with a speculative ``method``) drafter costs: the preset's, every
        per-token cost x ``scale`` (the fixed per-step costs as they are)."""
        p = get_preset(PRESET)
        f, t = self.scale, p.target
        target = replace(t, gamma_s=t.gamma_s * f, gamma_prefill_s=t.gamma_prefill_s * f, alpha_s=t.alpha_s * f)
        if method is None:
            return target, None
        d = p.draft_for(method)
        return target, replace(d, gamma_s=d.gamma_s * f, alpha_s=d.alpha_s * f, gamma_prefill_s=d.gamma_prefill_s * f)

    def fleet_from(self, text: str) -> Setup:
        """This setup with the mixed fleet ``SPEC+STD`` (e.g. ``2+1``); ValueError when it is not that."""
        spec_n, plus, std_n = text.partition("+")
        if not plus or not spec_n.strip().isdigit() or not std_n.strip().isdigit() or min(int(spec_n), int(std_n)) < 1:
            raise ValueError(f"--fleet: expected SPEC+STD servers such as 2+1, got {text!r}")
        return replace(self, spec_servers=int(spec_n), std_servers=int(std_n))


@dataclass(frozen=True, slots=True)
class Point:
    policy: str
    load: float  # fraction of capacity
    rate_rps: float  # offered, simulated requests per second
    summary: Summary  # all classes
    per_class: tuple[Summary, ...]
    wall_s: float
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU share of one core during the point
    e2e_s: tuple[float, ...] = ()  # every request's E2E (simulated s; inf: failed), in the order sent
    lag: float = float("nan")  # the worst server's late-step time, as a share of the point's simulated time
