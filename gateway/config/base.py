"""The building blocks of the routing YAML's models: strict models, YAML numbers, pool kinds, names."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

PoolKind = Literal["speculative", "standard"]
# Which OpenAI API a request came through (its body shape): the values of a class's ``endpoint`` condition.
ApiKind = Literal["chat", "completions", "responses"]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]  # a pool, class or endpoint id


def _int_to_float(v: object) -> object:
    # The models are strict (no "0.5" strings for numbers), and strict mode also refuses an int for a float field:
    # YAML authors write `lte: 512` and `weight: 2`.
    if isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v


Number = Annotated[float, BeforeValidator(_int_to_float)]
OptionalNumber = Annotated[float | None, BeforeValidator(_int_to_float)]  # keeps `minimum` etc. in the JSON schema


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
