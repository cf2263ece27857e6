"""A command's options built from a settings dataclass (``gateway.config.settings.Settings``).

``settings_command(Settings, names)`` turns a function ``body(settings, **own_options)`` into a typer command
whose options are, first, the named settings fields (flag, environment variable, default, type and help text
all from the field's declaration) and then the function's own. The command builds the settings (a
``SettingsError`` becomes an error message and exit 2) and hands them to the body. A command that gives a shared
field another meaning changes just that (``changes``: ``specgate epp``'s ``--port`` is the gRPC port, with its
own default and variable).

Fields by source (``gateway.config.setting_spec.Source``): ``option``: a flag and its variable; ``secret``: a hidden
flag refused on the command line (every user of the machine reads it in ``ps``), so only its variable works;
``env``: read from its variable by the command, no flag; ``internal``: neither.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import Annotated, Any, Literal, cast, get_origin, get_type_hints

import typer

from gateway.cli.console import fail
from gateway.config.setting_spec import base_type, env_name, flag_name, is_optional, spec_of
from gateway.config.settings import SettingsError, env_values

Body = Callable[..., None]


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option of a settings field."""

    name: str
    flag: str
    env: str
    default: Any  # inspect.Parameter.empty: the option is required
    kind: Any  # the type typer parses the flag as
    help: str
    secret: bool = False
    instead: str = ""  # a secret: where else it may go, said when its flag is refused


def cli_type(hint: Any) -> Any:
    """The type a flag is parsed as: the field's own, except a Literal, read as text and checked by the settings
    (so that a bad value gets the same error from the flag and from the variable)."""
    kind = base_type(hint)
    if get_origin(kind) is Literal:
        kind = str
    return kind | None if is_optional(hint) else kind


def options_of(cls: type[Any], names: Sequence[str] | None = None) -> list[Option]:
    """The options of ``cls``'s fields with a flag (``option`` and ``secret``), in declaration order; only
    ``names`` when given."""
    hints = get_type_hints(cls)
    out: list[Option] = []
    for f in fields(cls):
        spec = spec_of(f)
        if spec.source not in ("option", "secret") or (names is not None and f.name not in names):
            continue
        out.append(
            Option(
                name=f.name,
                flag=flag_name(f.name),
                env=env_name(f.name),
                default=inspect.Parameter.empty if f.default is MISSING else f.default,
                kind=cli_type(hints[f.name]),
                help=spec.help,
                secret=spec.source == "secret",
                instead=spec.instead,
            )
        )
    return out


def _refuse_on_command_line(option: Option) -> Callable[[typer.Context, typer.CallbackParam, Any], Any]:
    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        source = ctx.get_parameter_source(param.name or "")
        if source is not None and source.name == "COMMANDLINE":
            instead = f", {option.instead}" if option.instead else ""
            raise fail(
                f"{option.flag} on the command line is refused: every user of this machine can read it in `ps`. "
                f"Set {option.env} in the environment{instead}"
            )
        return value

    return check


def parameter(option: Option) -> inspect.Parameter:
    """The typer parameter of ``option``: ``--flag`` (a true-by-default switch: ``--flag/--no-flag``)."""
    decl = option.flag
    if option.kind is bool and option.default is True:
        decl = f"{option.flag}/--no-{option.flag.removeprefix('--')}"
    info = typer.Option(
        decl,
        envvar=option.env,
        help=option.help,
        hidden=option.secret,
        callback=_refuse_on_command_line(option) if option.secret else None,
    )
    annotation = cast(Any, Annotated)[option.kind, info]
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default, annotation=annotation)


def settings_command(
    cls: type[Any], names: Sequence[str] | None = None, changes: Mapping[str, Mapping[str, Any]] | None = None
) -> Callable[[Body], Body]:
    """Decorate ``body(settings, **own)``: the command with the options of ``cls``'s fields ``names`` (all when
    None; each changed as ``changes[name]`` says: ``default``, ``env``, ``help``, ``instead``), then ``body``'s
    own."""
    hints = get_type_hints(cls)
    names = [f.name for f in fields(cls)] if names is None else names
    unknown = (set(names) | set(changes or {})) - set(hints)
    if unknown:  # a misspelt name would otherwise drop its option without a word
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}")
    options = [replace(o, **(changes or {}).get(o.name, {})) for o in options_of(cls, names)]
    from_env = [f.name for f in fields(cls) if f.name in names and spec_of(f).source == "env"]

    def wrap(body: Body) -> Body:
        own = [p for p in inspect.signature(body, eval_str=True).parameters.values() if p.name != "settings"]

        def command(**values: Any) -> None:
            given: dict[str, Any] = {}
            for o in options:
                value = values.pop(o.name)
                given[o.name] = None if value == "" and is_optional(hints[o.name]) else value
            try:
                given.update(env_values(cls, from_env, os.environ))
                settings = cls(**given)
            except SettingsError as exc:
                raise fail(str(exc)) from exc
            body(settings, **values)

        params = [parameter(o) for o in options] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__name__, command.__qualname__, command.__doc__ = body.__name__, body.__qualname__, body.__doc__
        command.__module__ = body.__module__
        return command

    return wrap
