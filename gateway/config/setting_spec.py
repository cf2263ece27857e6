"""How one process setting is declared: ``setting(default, help, ...)`` on a field of a settings dataclass.

A field declared this way carries everything about it in one place: its type (the annotation), its default, its
help text (the CLI's ``--help``), its bounds (checked by ``check_bounds``), and where it may come from
(``Source``). Its environment variable and its flag follow from its name: ``SPECGATE_`` + the name in upper case,
and ``--`` + the name with dashes, less a trailing ``_s`` (a field in seconds: ``keep_alive_s`` is
``--keep-alive``). ``gateway.cli.options`` builds the command-line options from these fields; ``Settings.from_env``
reads the variables with ``parse``.
"""

from __future__ import annotations

import types
from dataclasses import Field, dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ENV_PREFIX = "SPECGATE_"
MIB = 1024 * 1024

# option:   a command-line flag and its environment variable (the flag wins);
# secret:   the environment variable only; its flag exists to refuse it (a command line shows in ``ps``), hidden;
# env:      the environment variable only, no flag at all;
# internal: set by code (another command, the workers' hand-over), never documented as an input.
Source = Literal["option", "secret", "env", "internal"]


@dataclass(frozen=True, slots=True)
class Spec:
    """What a settings field declares besides its type and default."""

    help: str
    source: Source = "option"
    min: float | None = None  # the smallest value allowed
    above: float | None = None  # or: values must be greater than this
    max: float | None = None
    zero: str = ""  # 0 is also allowed, and means this ("off", "no cap"), even below ``min``
    unit: str = ""  # said after the bounds in the error: "seconds", "bytes per second"
    instead: str = ""  # a secret: where else to put it, said when its flag is refused


def setting(
    default: Any,
    help: str,
    *,
    source: Source = "option",
    min: float | None = None,
    above: float | None = None,
    max: float | None = None,
    zero: str = "",
    unit: str = "",
    instead: str = "",
    repr: bool | None = None,
) -> Any:
    """A settings field: its default and its ``Spec``. Secrets (and, with ``repr=False``, values that may hold
    one) are kept out of ``repr``."""
    spec = Spec(help, source, min, above, max, zero, unit, instead)
    shown = source not in ("secret", "env") if repr is None else repr
    return field(default=default, repr=shown, metadata={"spec": spec})


def required(help: str) -> Any:
    """A settings field without a default: the command refuses to start without it."""
    return field(metadata={"spec": Spec(help)})


def spec_of(f: Field[Any]) -> Spec:
    spec = f.metadata.get("spec")
    if not isinstance(spec, Spec):
        raise TypeError(f"settings field {f.name} is not declared with setting() or required()")
    return spec


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.removesuffix("_s").replace("_", "-")


def parse_bool(raw: str) -> bool:
    """The one reading of a true/false setting from text."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def base_type(hint: Any) -> Any:
    """``X`` of ``X | None``; the hint itself otherwise."""
    if get_origin(hint) in (Union, types.UnionType):
        rest = [a for a in get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def is_optional(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)


def parse(hint: Any, raw: str) -> Any:
    """A setting's value from its environment variable's text (raises ValueError)."""
    kind = base_type(hint)
    if kind is bool:
        return parse_bool(raw)
    if kind in (int, float, Path):
        return kind(raw)
    return raw  # str, or a Literal of strings (checked by check_bounds)


def _amount(value: float) -> str:
    if value >= MIB and value % MIB == 0:
        return f"{int(value // MIB)} MiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _allowed(spec: Spec) -> str:
    """The bounds in words: ``1..65535``, ``>= 1024``, ``> 0 and <= 3600``."""
    if spec.min is not None and spec.max is not None:
        text = f"{_amount(spec.min)}..{_amount(spec.max)}"
    elif spec.min is not None:
        text = f">= {_amount(spec.min)}"
    elif spec.above is not None:
        text = f"> {_amount(spec.above)}" + (f" and <= {_amount(spec.max)}" if spec.max is not None else "")
    else:
        text = f"<= {_amount(spec.max)}" if spec.max is not None else ""
    if spec.zero and spec.min is not None and spec.min > 0:
        text = f"0 ({spec.zero}) or {text}"
    elif spec.zero:
        text += f" (0: {spec.zero})"
    return text + (f" {spec.unit}" if spec.unit else "")


def check_bounds(name: str, hint: Any, spec: Spec, value: Any) -> str | None:
    """Why ``value`` is not allowed for the field ``name``; None when it is."""
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if value not in choices:
            return f"{name} must be {'|'.join(choices)}, got {value!r}"
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if spec.zero and value == 0:
        return None
    low_ok = (spec.min is None or value >= spec.min) and (spec.above is None or value > spec.above)
    if low_ok and (spec.max is None or value <= spec.max):
        return None
    return f"{name} must be {_allowed(spec)}, got {value}"
