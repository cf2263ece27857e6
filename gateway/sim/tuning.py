"""Physics and acceptance overridden by name: ``physics_options`` (target and proposer constants and
``kv_cache_tokens`` as ``SimOptions`` fields; ``PHYSICS_KEYS`` lists the names), ``acceptance_model`` (an
``AcceptanceModel`` with fields replaced and factors merged), and the parsers of the ``specgate sim`` flags that
carry them (``KEY=VALUE`` pairs, temperature points).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import typer

from gateway.sim.physics import AcceptanceModel, SpecConfig
from gateway.sim.presets import get_preset


def _pairs(values: list[str] | None, flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=flag)
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a number", param_hint=flag) from None
    return out


def _points(text: str | None) -> tuple[tuple[float, float], ...] | None:
    if text is None:
        return None
    try:
        pts = tuple((float(t), float(a)) for t, _, a in (p.partition(":") for p in text.split(",") if p.strip()))
    except ValueError:
        raise typer.BadParameter("expected T:A,T:A,… e.g. 0:0.81,0.4:0.71", param_hint="--acceptance-points") from None
    if len(pts) < 2 or [t for t, _ in pts] != sorted({t for t, _ in pts}):
        raise typer.BadParameter(
            "need two or more points with increasing temperatures", param_hint="--acceptance-points"
        )
    return pts


_TARGET_KEYS = ("delta_s", "gamma_s", "gamma_prefill_s", "alpha_s", "epsilon_s")
_DRAFT_KEYS = ("draft_delta_s", "draft_gamma_s", "draft_alpha_s", "draft_gamma_prefill_s")
PHYSICS_KEYS = (*_TARGET_KEYS, *_DRAFT_KEYS, "kv_cache_tokens")


def physics_options(preset: str, speculative_config: str | None, overrides: Mapping[str, float]) -> dict[str, Any]:
    """``SimOptions`` fields for physics constants overridden by name: the target's (``delta_s`` …), the
    proposer's of the configured method (``draft_delta_s`` …), ``kv_cache_tokens``. Raises ValueError."""
    unknown = sorted(set(overrides) - set(PHYSICS_KEYS))
    if unknown:
        raise ValueError(f"unknown physics constant(s): {', '.join(unknown)} (known: {', '.join(PHYSICS_KEYS)})")
    base = get_preset(preset)
    target: dict[str, Any] = {k: float(v) for k, v in overrides.items() if k in _TARGET_KEYS}
    draft: dict[str, Any] = {k.removeprefix("draft_"): float(v) for k, v in overrides.items() if k in _DRAFT_KEYS}
    out: dict[str, Any] = {}
    if target:
        out["target"] = dataclasses.replace(base.target, **target)
    if draft:
        if speculative_config is None:
            raise ValueError("proposer constants (draft_*) need --speculative-config")
        method = SpecConfig.from_json(speculative_config).method
        out["draft"] = dataclasses.replace(base.draft_for(method), **draft)
    if "kv_cache_tokens" in overrides:
        out["kv_cache_tokens"] = int(overrides["kv_cache_tokens"])
    return out


def acceptance_model(overrides: Mapping[str, Any]) -> AcceptanceModel:
    """``AcceptanceModel`` with fields replaced; ``task_factors`` ({family: {task: x}}) and ``method_factors`` are
    merged into the defaults. Raises ValueError on an unknown field."""
    base = AcceptanceModel()
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(base)})
    if unknown:
        raise ValueError(f"unknown acceptance field(s): {', '.join(unknown)}")
    changes = dict(overrides)
    if "task_factors" in changes:
        merged = {family: dict(tasks) for family, tasks in base.task_factors.items()}
        for family, tasks in changes["task_factors"].items():
            merged.setdefault(family, {}).update(tasks)
        changes["task_factors"] = MappingProxyType({f: MappingProxyType(t) for f, t in merged.items()})
    if "method_factors" in changes:
        changes["method_factors"] = MappingProxyType({**base.method_factors, **changes["method_factors"]})
    return dataclasses.replace(base, **changes)


def acceptance_overrides(
    points: str | None,
    floor: float | None,
    concentration: float | None,
    task_factors: list[str] | None,
    method_factors: list[str] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if (pts := _points(points)) is not None:
        out["temperature_points"] = pts
    if floor is not None:
        out["floor"] = floor
    if concentration is not None:
        out["concentration"] = concentration
    nested: dict[str, dict[str, float]] = {}
    for key, value in _pairs(task_factors, "--task-factor").items():
        family, dot, task = key.partition(".")
        if not dot or family not in ("lookup", "model"):
            raise typer.BadParameter("expected lookup.TASK=X or model.TASK=X", param_hint="--task-factor")
        nested.setdefault(family, {})[task] = value
    if nested:
        out["task_factors"] = nested
    if method_factors:
        out["method_factors"] = _pairs(method_factors, "--method-factor")
    return out
