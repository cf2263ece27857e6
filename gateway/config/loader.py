"""Load the routing YAML: parse, validate, check the whole document; every error names its YAML path and line.

Three stages, each collecting every problem it finds before giving up:

1. YAML (PyYAML's safe loader). Syntax errors keep their line; duplicate mapping keys, which PyYAML would
   silently resolve to the last value, are reported.
2. The pydantic schema (``gateway.config.schema``). Its errors are rewritten for humans, with paths like
   ``classes[2].route.fallback[0]`` (alias names, e.g. ``in``).
3. Semantic checks that need the whole document (``gateway.config.checks.semantic_issues``): pool references,
   unique names, the catch-all class, known task types and condition values.

The line of an error comes from the composed YAML node tree, walked along the error's path as deep as it goes.
"""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from gateway.config.base import NAME_PATTERN
from gateway.config.checks import Loc, format_path, semantic_issues
from gateway.config.schema import RoutingRules

_MERGE_TAG = "tag:yaml.org,2002:merge"
_EXPECTED = {
    "float_type": "a number",
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_SHAPE_HINTS = {
    "Range": "a range such as {lte: 0.5} (keys lt, lte, gt, gte)",
    "OneOf": "a set such as {in: [code, rag]}",
}
_MAX_LISTED = 14


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a routing YAML: where (path and line) and what."""

    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        at = f" (line {self.line})" if self.line is not None else ""
        return f"{where}{self.message}{at}"


class RulesError(Exception):
    """A routing YAML that cannot be used; ``issues`` holds every problem found, in line order."""

    def __init__(self, issues: Sequence[ConfigIssue], source: str) -> None:
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        super().__init__(self.issues, source)  # args in signature order, so that it pickles

    def __str__(self) -> str:
        return "\n".join(f"{self.source}: {issue}" for issue in self.issues)


# ---------------------------------------------------------------------------------------------- public API


def load_rules_file(path: str | os.PathLike[str]) -> RoutingRules:
    """Read and load a routing YAML file; raises ``RulesError`` naming the file."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise RulesError([ConfigIssue("", f"cannot read the file: {reason}")], source) from exc
    except UnicodeDecodeError as exc:
        raise RulesError([ConfigIssue("", f"the file is not UTF-8 text: {exc.reason}")], source) from exc
    return load_rules_text(text, source)


def load_rules_text(text: str, source: str = "<string>", stand_ins: Mapping[str, str] | None = None) -> RoutingRules:
    """Parse, validate and check a routing YAML document; raises ``RulesError`` with every issue found.
    ``stand_ins``: pool → URL, that pool's endpoints replaced by one endpoint there (``Settings.stand_ins``)."""
    try:
        root, data, issues = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise RulesError([_yaml_issue(exc)], source) from exc
    if stand_ins and isinstance(data, dict):
        data = with_stand_ins(data, stand_ins)

    if root is None or not isinstance(data, dict):
        got = "an empty document" if root is None else _kind(data)
        line = root.start_mark.line + 1 if root is not None else None
        message = f"the top level must be a mapping (pools, classes, ...), got {got}"
        issues.append(ConfigIssue("", message, line))
        raise RulesError(_in_line_order(issues), source)

    try:
        rules = RoutingRules.model_validate(data)
    except ValidationError as exc:
        issues.extend(_pydantic_issue(err, root) for err in exc.errors(include_url=False))
        raise RulesError(_in_line_order(issues), source) from exc

    issues.extend(ConfigIssue(format_path(loc), msg, _line_of(root, loc)) for loc, msg in semantic_issues(rules))
    issues.extend(ConfigIssue(format_path(loc), msg, _line_of(root, loc)) for loc, msg in pool_key_issues(rules))
    if issues:
        raise RulesError(_in_line_order(issues), source)
    return rules


def pool_key_issues(rules: RoutingRules, environ: Mapping[str, str] | None = None) -> list[tuple[Loc, str]]:
    """Pool keys (the values of ``api_key_env``) that cannot be sent as one header line: a control character
    (CR, LF, NUL, ...) inside the key would be written into the upstream request head. Surrounding whitespace is
    fine (a key read from a secret file often ends in a newline; the client strips it)."""
    env = os.environ if environ is None else environ
    out: list[tuple[Loc, str]] = []
    for i, pool in enumerate(rules.pools):
        if not pool.api_key_env:
            continue
        value = env.get(pool.api_key_env, "").strip()
        bad = next((c for c in value if ord(c) < 0x20 or ord(c) == 0x7F), None)
        if bad is not None:
            out.append(
                (
                    ("pools", i, "api_key_env"),
                    f"the value of ${pool.api_key_env} contains a control character ({bad!r}): a pool key must be "
                    "one line of visible characters",
                )
            )
    return out


def summary(rules: RoutingRules) -> str:
    """One line for ``specgate validate``: pools with their endpoint counts, classes, task rules, models."""
    pools = ", ".join(f"{p.name}: {_plural(len(p.endpoints), 'endpoint')}" for p in rules.pools)
    models = ", ".join(dict.fromkeys(m for p in rules.pools for m in p.models))
    return (
        f"ok: {_plural(len(rules.pools), 'pool')} ({pools}), {_plural(len(rules.classes), 'class')}, "
        f"{_plural(len(rules.task_rules), 'task rule')}, models: {models}"
    )


# ---------------------------------------------------------------------------------------------- YAML


def with_stand_ins(data: dict[str, Any], stand_ins: Mapping[str, str]) -> dict[str, Any]:
    """A parsed routing document whose pools named in ``stand_ins`` have one endpoint each, at that URL (id
    ``<pool>-sim-0``, no API key): the demo's simulated servers, put in without rewriting the file."""
    pools = data.get("pools")
    if not isinstance(pools, list):
        return data
    out = []
    for pool in pools:
        name = pool.get("name") if isinstance(pool, dict) else None
        if isinstance(name, str) and name in stand_ins:
            pool = {k: v for k, v in pool.items() if k != "api_key_env"}
            pool["endpoints"] = [{"url": stand_ins[name], "weight": 1, "id": f"{name}-sim-0"}]
        out.append(pool)
    return {**data, "pools": out}


def _parse_yaml(text: str) -> tuple[yaml.Node | None, Any, list[ConfigIssue]]:
    """Compose the node tree (for lines and duplicate keys), then construct the data from it: one parse."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None, []
        duplicates = _duplicate_keys(root)  # first: construction flattens `<<` merges into the tree in place
        return root, loader.construct_document(root), duplicates
    finally:
        loader.dispose()


def _yaml_issue(exc: yaml.YAMLError) -> ConfigIssue:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        problem = exc.problem or "syntax error"
        where = f"line {exc.context_mark.line + 1}" if exc.context_mark is not None else ""
        if exc.context and problem.startswith("but "):  # one sentence split in two: "expected X" "but found Y"
            message = f"{exc.context} {problem}" + (f" (from {where})" if where else "")
        elif exc.context:
            message = f"{problem} ({exc.context}" + (f", {where})" if where else ")")
        else:
            message = problem
        line = exc.problem_mark.line + 1
        if any(sign in message for sign in _INDENTATION_SIGNS):
            message += (
                f"; usually the indentation of line {line} or the line above it: keys of one mapping start in the "
                "same column, list items under their key, spaces only"
            )
        return ConfigIssue("", f"invalid YAML: {message}", line)
    return ConfigIssue("", f"invalid YAML: {exc}")


# What PyYAML says when a line is indented wrong (a key too deep or not deep enough, a tab).
_INDENTATION_SIGNS = (
    "mapping values are not allowed",
    "expected <block end>",
    "could not find expected ':'",
    "found character '\\t'",
    "did not find expected key",
)


def _duplicate_keys(root: yaml.Node) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    visited: set[int] = set()  # aliases share nodes; visit each once
    stack: list[tuple[yaml.Node, Loc]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                    stack.append((value, loc))
                    continue
                child = (*loc, key.value)
                seen = first.setdefault((key.tag, key.value), key)
                if seen is not key:
                    message = f'duplicate key "{key.value}" (first on line {seen.start_mark.line + 1})'
                    issues.append(ConfigIssue(format_path(child), message, key.start_mark.line + 1))
                stack.append((value, child))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*loc, i)) for i, item in enumerate(node.value))
    return issues


def _line_of(root: yaml.Node, loc: Loc) -> int:
    """The line of the deepest node along ``loc``: a mapping entry's key line, a list item's first line."""
    node: yaml.Node = root
    line = root.start_mark.line + 1
    for part in loc:
        entry = _entry(node, part)
        if entry is None:
            break
        key, node = entry
        line = key.start_mark.line + 1
    return line


def _entry(node: yaml.Node, part: str | int) -> tuple[yaml.Node, yaml.Node] | None:
    """(the node that marks the place, the value node) for one path step, following ``<<`` merges."""
    if isinstance(node, yaml.SequenceNode):
        if isinstance(part, int) and 0 <= part < len(node.value):
            item: yaml.Node = node.value[part]
            return item, item
        return None
    if not isinstance(node, yaml.MappingNode):
        return None
    merged: list[yaml.Node] = []
    found: tuple[yaml.Node, yaml.Node] | None = None
    for key, value in node.value:  # the last match, as in the constructed dict (merged keys come first)
        if isinstance(key, yaml.ScalarNode) and key.tag == _MERGE_TAG:
            merged.extend(value.value if isinstance(value, yaml.SequenceNode) else [value])
        elif isinstance(key, yaml.ScalarNode) and key.value == str(part):
            found = key, value
    if found is not None:
        return found
    for source in merged:  # a tree whose merges were not flattened by construction
        found = _entry(source, part)
        if found is not None:
            return found
    return None


def _in_line_order(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    return sorted(issues, key=lambda i: i.line if i.line is not None else 1 << 30)


# ---------------------------------------------------------------------------------------------- pydantic


def _pydantic_issue(err: ErrorDetails, root: yaml.Node) -> ConfigIssue:
    loc: Loc = tuple(err["loc"])
    if err["type"] == "invalid_key":
        return ConfigIssue(
            format_path(loc[:-1]), f"keys must be strings, got {_show(err['input'])}", _line_of(root, loc)
        )
    return ConfigIssue(format_path(loc), _message(err, loc), _line_of(root, loc))


def _message(err: ErrorDetails, loc: Loc) -> str:
    kind, msg, value = err["type"], err["msg"], err.get("input")
    ctx: dict[str, Any] = err.get("ctx", {})
    if kind == "missing":
        return "required field missing"
    if kind == "extra_forbidden":
        return _unknown_field(loc)
    if kind in _EXPECTED:
        expected = _SHAPE_HINTS.get(ctx.get("class_name", ""), _EXPECTED[kind])
        return f"expected {expected}, got {_describe(value)}"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "assertion_error":
        return msg.removeprefix("Assertion failed, ")
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == NAME_PATTERN:
        return (
            f"invalid name {_show(value)}: use letters, digits and _ . - "
            "(start with a letter or digit, at most 63 characters)"
        )
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), "?")
        return f"must be {_BOUNDS[kind]} {bound}, got {_show(value)}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected', 'one of the allowed values')}, got {_show(value)}"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"must have at least {n} item{'s' if n != 1 else ''}"
    return msg


def _unknown_field(loc: Loc) -> str:
    name = str(loc[-1])
    message = f'unknown field "{name}"'
    model = _model_at(loc[:-1])
    if model is None:
        return message
    allowed = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(name, allowed, n=1)
    if close:
        message += f'; did you mean "{close[0]}"?'
    if len(allowed) <= _MAX_LISTED:
        message += f" (allowed: {', '.join(allowed)})"
    return message


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The schema model that validates the value at ``loc`` (to list a mapping's allowed fields)."""
    tp: Any = RoutingRules
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(part, int):
            if typing.get_origin(tp) is not list:
                return None
            tp = typing.get_args(tp)[0]
            continue
        if typing.get_origin(tp) is not None or not (isinstance(tp, type) and issubclass(tp, BaseModel)):
            return None
        field = next((f for n, f in tp.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        tp = field.annotation
    tp = _unwrap(tp)
    if typing.get_origin(tp) is None and isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return None


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``X | None``."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _describe(value: object) -> str:
    """``a string "2"``, ``a mapping``: the YAML type, and the value when it is a scalar."""
    if isinstance(value, list | dict) or value is None:
        return _kind(value)
    return f"{_kind(value)} {_show(value)}"


def _show(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word}es" if word.endswith("ss") else f"{n} {word}s"
