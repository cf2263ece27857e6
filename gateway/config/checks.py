"""Semantic checks of routing rules: what the schema alone cannot see because it needs the whole document.

Referenced pools exist (and a route does not name one pool twice), pool / class / endpoint names are unique,
exactly the last class is a catch-all, a class with a controller has a pool of the other kind than its home, a pin
matches its route, a ``route.fallback_model`` is served by one of the class's fallback pools, and condition values
(task types, endpoints, response_format types, models) are ones a request can actually have. Each problem comes
as (path, message); the loader adds lines.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from typing import get_args

from gateway.config.base import ApiKind
from gateway.config.schema import RoutingRules

Loc = tuple[str | int, ...]

BUILTIN_TASK_TYPES = frozenset(
    {"chat", "code", "summarization", "extraction", "rag", "math", "creative", "structured", "tool_use"}
)
ENDPOINTS: frozenset[str] = frozenset(get_args(ApiKind))
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema", "structural_tag", "regex", "grammar"})
_MAX_LISTED = 12


def format_path(loc: Iterable[str | int]) -> str:
    """``("classes", 2, "route", "fallback", 0)`` → ``classes[2].route.fallback[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def unknown(what: str, value: str, known: Iterable[str]) -> str:
    """``unknown pool "std"; did you mean "standard"?`` or, with no close match, the known values."""
    options = sorted(known)
    message = f'unknown {what} "{value}"'
    close = difflib.get_close_matches(value, options, n=1)
    if close:
        return f'{message}; did you mean "{close[0]}"?'
    if len(options) <= _MAX_LISTED:
        return f"{message} (known: {', '.join(options)})"
    return message


def semantic_issues(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    """Every problem that needs the whole document, as (path, message), in document order per check."""
    yield from _unique_names(rules)
    yield from _pool_references(rules)
    yield from _catch_all(rules)
    yield from _condition_values(rules)
    yield from _controller_pools(rules)
    yield from _fallback_model(rules)


def _unique_names(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    pools: dict[str, int] = {}
    for i, pool in enumerate(rules.pools):
        j = pools.setdefault(pool.name, i)
        if j != i:
            yield ("pools", i, "name"), f'duplicate pool name "{pool.name}" (also pools[{j}])'
    classes: dict[str, int] = {}
    for i, cls in enumerate(rules.classes):
        j = classes.setdefault(cls.name, i)
        if j != i:
            yield ("classes", i, "name"), f'duplicate class name "{cls.name}" (also classes[{j}])'
    endpoints: dict[str, Loc] = {}
    for i, pool in enumerate(rules.pools):
        for k, ep in enumerate(pool.endpoints):
            eid = ep.endpoint_id
            here: Loc = ("pools", i, "endpoints", k)
            first = endpoints.setdefault(eid, here)
            if first != here:
                field = "id" if ep.id is not None else "url"
                yield (*here, field), f'duplicate endpoint id "{eid}" (also {format_path(first)})'


def _pool_references(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    names = {p.name for p in rules.pools}
    for i, cls in enumerate(rules.classes):
        route, base = cls.route, ("classes", i, "route")
        if route.preferred not in names:
            yield (*base, "preferred"), unknown("pool", route.preferred, names)
        if route.saturated is not None:
            if route.saturated not in names:
                yield (*base, "saturated"), unknown("pool", route.saturated, names)
            elif route.saturated == route.preferred:
                message = f'"{route.saturated}" is route.preferred itself; name another pool'
                yield (*base, "saturated"), message
        if route.saturation.max_inflight_per_endpoint is not None and route.saturated is None:
            yield (*base, "saturation"), "has no effect without route.saturated"
        seen: dict[str, int] = {}
        for k, pool in enumerate(route.fallback):
            loc: Loc = (*base, "fallback", k)
            if pool not in names:
                yield loc, unknown("pool", pool, names)
            elif pool == route.preferred:
                yield loc, f'"{pool}" is route.preferred itself; a fallback must be another pool'
            elif seen.setdefault(pool, k) != k:
                yield loc, f'duplicate fallback pool "{pool}" (also fallback[{seen[pool]}])'
    if rules.embeddings_pool is not None and rules.embeddings_pool not in names:
        yield ("embeddings_pool",), unknown("pool", rules.embeddings_pool, names)


def _catch_all(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    catch_all = next((i for i, c in enumerate(rules.classes) if c.when.is_empty()), None)
    if catch_all is None:
        last = len(rules.classes) - 1
        yield (
            ("classes", last, "when"),
            f'the last class ("{rules.classes[last].name}") must be a catch-all (no `when` conditions), '
            "so that every request has a class",
        )
        return
    name = rules.classes[catch_all].name
    for j in range(catch_all + 1, len(rules.classes)):
        yield (
            ("classes", j),
            f'class "{rules.classes[j].name}" is unreachable: it comes after the catch-all class "{name}" '
            f"(classes[{catch_all}]); the catch-all must be the last class",
        )


def _condition_values(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    tasks = BUILTIN_TASK_TYPES | {r.task for r in rules.task_rules} | {rules.defaults.task_type}
    models = {m for p in rules.pools for m in p.models}
    for i, rule in enumerate(rules.task_rules):
        if rule.response_format is not None:
            for k, v in enumerate(rule.response_format.in_):
                if v not in RESPONSE_FORMATS:
                    loc: Loc = ("task_rules", i, "response_format", "in", k)
                    yield loc, unknown("response_format type", v, RESPONSE_FORMATS)
    for i, cls in enumerate(rules.classes):
        base: Loc = ("classes", i, "when")
        checks = (
            ("task_type", "task type", tasks),
            ("endpoint", "endpoint", ENDPOINTS),
            ("response_format", "response_format type", RESPONSE_FORMATS),
            ("model", "model", models),
        )
        for field, what, known in checks:
            condition = getattr(cls.when, field)
            if condition is None:
                continue
            for k, v in enumerate(condition.in_):
                if v in known:
                    continue
                if field == "model":
                    yield (*base, field, "in", k), f'no pool serves model "{v}" (served: {", ".join(sorted(known))})'
                else:
                    yield (*base, field, "in", k), unknown(what, v, known)


def _controller_pools(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    """A class with a controller (its own block or ``defaults.controller``) needs a pool of the other kind than its
    home to move a share to; a pinned class has nothing to balance, so a controller block on it is a mistake; and a
    pin must name the kind of every pool of its route."""
    kinds = {p.name: p.kind for p in rules.pools}
    for i, cls in enumerate(rules.classes):
        route = cls.route
        names = [route.preferred] + ([route.saturated] if route.saturated else []) + list(route.fallback)
        if route.pin is not None:
            if cls.controller is not None:
                yield (
                    ("classes", i, "controller"),
                    f"a class pinned to {route.pin} pools (route.pin) has no other pool to move to: drop its "
                    "controller block or its pin",
                )
            off = [n for n in names if kinds.get(n) not in (None, route.pin)]
            if off:
                yield (
                    ("classes", i, "route", "pin"),
                    f"the class is pinned to {route.pin} pools but its route names "
                    + ", ".join(f'"{n}" ({kinds[n]})' for n in off),
                )
            continue
        if rules.controller_of(cls) is None or route.preferred not in kinds:
            continue  # an unknown preferred pool is reported by _pool_references
        implicit = cls.controller is None and "controller" not in rules.defaults.model_fields_set
        if rules.controller_pools(cls) is None and not implicit:  # the built-in default balances where it can
            home = kinds[route.preferred]
            yield (
                ("classes", i, "controller" if cls.controller is not None else "route"),
                f'a class with a controller needs a pool of the other kind than its home "{route.preferred}" '
                f"({home}) to move a share to; there is none (pin the class with route.pin: {home}, or add a pool)",
            )


def _fallback_model(rules: RoutingRules) -> Iterator[tuple[Loc, str]]:
    """``route.fallback_model`` is used on the class's fallback pools that do not serve the requested model: at
    least one of them must serve it, or it never takes effect."""
    served = {p.name: set(p.models) for p in rules.pools}
    for i, cls in enumerate(rules.classes):
        route = cls.route
        if route.fallback_model is None:
            continue
        if not any(route.fallback_model in served.get(name, ()) for name in route.fallback):
            yield (
                ("classes", i, "route", "fallback_model"),
                f'no pool in route.fallback serves "{route.fallback_model}" '
                f"(fallback: {', '.join(route.fallback) or 'none'})",
            )
