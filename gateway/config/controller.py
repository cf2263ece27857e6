"""A traffic class's ``controller:`` block (``gateway.routing.controller`` runs it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config.base import Number, OptionalNumber, Strict

PROBE_CAP = 0.05  # the largest probe share a YAML may ask for
SafeState = Literal["speculative", "standard", "home"]


class ControllerConfig(Strict):
    """The class's route-state controller (``gateway.routing.controller``): the share of the class's requests sent
    to the speculative pool instead of the standard one, from live measurements, with hysteresis, a hold time, a
    change cap and the fallback guard. The ratios compare the class's expected completion time on its HOME pool
    (``route.preferred``) with the other kind's pool: a speculative-home class leaves the speculative pool when that
    is clearly slower, a standard-home class moves onto it when it is clearly faster, and each comes back the same
    way. Queue and batch limits are per fresh endpoint of the speculative pool, whatever the home."""

    window_s: Number = Field(30.0, gt=0, description="Observation window; the guard counts one window per window_s.")
    min_samples: int = Field(20, ge=1, description="Samples (class requests) in a window before any decision.")
    exit_margin: Number = Field(
        1.25,
        gt=0,
        description="Move a share of the class away from its home pool when the class's expected completion time "
        "there > the other pool's x this ratio.",
    )
    enter_margin: Number = Field(
        0.9,
        gt=0,
        description="Move a share back home when the home pool's expected completion time < the other pool's x this "
        "ratio (below exit_margin).",
    )
    balance_margin: OptionalNumber = Field(
        None,
        ge=1,
        description="Once a share of the class is away from home, it moves on toward the pool whose expected "
        "completion time is lower by more than this ratio, in either direction, instead of staying anywhere "
        "within enter_margin..exit_margin: the share settles near where the two pools' times balance. Leaving "
        "home still needs exit_margin. None (or share_step 1, whole-class moves): enter_margin brings it back.",
    )
    acceptance_weight: Number = Field(
        0.5,
        ge=0,
        description="The speculative pool's expected completion time is divided by 1 + acceptance_weight x the "
        "class's last measured acceptance rate before the comparison, a bonus on top of the acceptance already in the "
        "estimate (no measurement: no bonus). 0: the estimate alone decides.",
    )
    max_queue_enter: OptionalNumber = Field(None, ge=0, description="Come back only with at most this queue.")
    max_queue_exit: OptionalNumber = Field(None, ge=0, description="Leave above this queue if standard is faster.")
    max_batch_enter: OptionalNumber = Field(None, ge=0, description="Come back only with at most this batch.")
    max_batch_exit: OptionalNumber = Field(None, ge=0, description="Leave above this batch if standard is faster.")
    share_step: Number = Field(
        0.25,
        gt=0,
        le=1,
        description="The class's share of requests on the speculative pool moves in steps of this size, at most one "
        "per window_s, and settles where the pools' delays balance; 1 moves the class as a whole.",
    )
    probe_share: Number = Field(
        0.02,
        ge=0,
        le=PROBE_CAP,
        description="While the class has no measured acceptance, sits wholly on the standard pool and the "
        "speculative pool has headroom (no queue, batch within max_batch_enter), this share of its requests goes to "
        f"the speculative pool to measure it (at most {PROBE_CAP}); 0: no probes.",
    )
    prior_acceptance: OptionalNumber = Field(
        None,
        ge=0,
        le=1,
        description="The acceptance RATE assumed until the class's own is measured; none: from the class's "
        "temperature band (0.81 / 0.71 / 0.52 / 0.38 per-token acceptance at temperature 0 / 0.4 / 0.8 / 1.0).",
    )
    output_tokens: Number = Field(
        256.0, gt=0, description="Output tokens of a typical request of the class, for the completion-time estimate."
    )
    load_impact: Number = Field(
        1.0,
        ge=0,
        le=4,
        description="Weight of the time a request adds to the requests already running on a pool (a longer step "
        "for each of them while it runs, measured per pool) in the comparison; 1 counts it in full (what every "
        "request waits, together), 0 compares the class's own expected times only.",
    )
    min_hold_s: Number = Field(60.0, ge=0, description="No load-driven change within this long of the last one.")
    max_changes_per_hour: int = Field(6, ge=1, description="Cap on automatic state changes in any hour.")
    safe_state: SafeState = Field(
        "standard",
        description="State while measurements are missing or stale: a pool kind, or home (the class's "
        "route.preferred: its static route).",
    )
    disable_below: OptionalNumber = Field(
        None,
        ge=0,
        le=1,
        description="Acceptance floor of the guard, as vLLM's acceptance RATE = Δaccepted / Δdraft_tokens "
        "(= E[accepted]/K under the truncated geometric), not the per-position acceptance a: a = 0.5 with K = 5 "
        "is a rate of about 0.19. None: no acceptance guard.",
    )
    disable_after_windows: int = Field(
        3, ge=1, description="Consecutive windows below the floor (or with regressed p95) that trip the guard."
    )
    latency_regression_pct: OptionalNumber = Field(
        None, gt=0, description="Trip the guard when p95 on the speculative pool exceeds the baseline by this %."
    )
    baseline_p95_s: OptionalNumber = Field(None, gt=0, description="Recorded baseline p95 latency of the class.")
    reenable_after_s: Number = Field(600.0, ge=0, description="The guard's condition must be gone this long.")
    max_reenables_per_day: int = Field(
        3, ge=0, description="Re-enables in 24 h; the next trip locks the class off until a person unlocks it."
    )

    @model_validator(mode="after")
    def _ordered(self) -> ControllerConfig:
        if not self.enter_margin < self.exit_margin:
            raise ValueError(
                f"thresholds out of order: enter_margin {self.enter_margin} must be below exit_margin "
                f"{self.exit_margin} (hysteresis)"
            )
        if self.balance_margin is not None and not self.balance_margin < self.exit_margin:
            raise ValueError(
                f"thresholds out of order: balance_margin {self.balance_margin} must be below exit_margin "
                f"{self.exit_margin} (leaving home needs the most)"
            )
        for what in ("queue", "batch"):
            enter, exit_ = getattr(self, f"max_{what}_enter"), getattr(self, f"max_{what}_exit")
            if (enter is None) != (exit_ is None):
                raise ValueError(f"max_{what}_enter and max_{what}_exit go together: give both or neither")
            if enter is not None and not enter < exit_:
                raise ValueError(
                    f"thresholds out of order: max_{what}_enter {enter} must be below max_{what}_exit {exit_}"
                )
        return self


def balancing_controller() -> ControllerConfig:
    """The controller of every class when the YAML says nothing (no ``defaults.controller`` key): home + a share
    onto the other kind's pool while that is clearly faster for the class, settling where the two balance, and back.
    The estimate alone decides (no acceptance bonus), and without measurements the class keeps its static route
    (``safe_state: home``)."""
    return ControllerConfig(acceptance_weight=0.0, safe_state="home", balance_margin=1.05)
