"""``specgate serve``'s options and ``Settings``' fields are one thing: every field with a flag has exactly one
option, with the field's default, help text, environment variable and flag name, and a value reaches the same
field by its flag, by its variable and through ``Settings.from_env`` (the workers' path), with the same error when
it is out of bounds. ``specgate epp`` shares the fields it names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

import gateway.cli.serve
from gateway.cli.main import EPP_CHANGES, EPP_SETTINGS, app
from gateway.config.setting_spec import env_name, flag_name, parse_bool, spec_of
from gateway.config.settings import Settings, SettingsError

# A value other than the default for every field with a flag: a field added without one here fails below.
SAMPLE: dict[str, Any] = {
    "host": "127.0.0.2",
    "port": 18080,
    "workers": 3,
    "max_body_bytes": 4096,
    "max_header_bytes": 2048,
    "max_headers": 9,
    "max_json_depth": 12,
    "max_json_containers": 77,
    "parse_workers": 0,
    "max_detached": 5,
    "max_detached_per_client": 2,
    "idempotency_memory_bytes": 128 * 1024 * 1024,
    "idempotency_owner_records": 11,
    "idempotency_owner_bytes": 2 * 1024 * 1024,
    "header_timeout_s": 1.5,
    "body_timeout_s": 2.5,
    "body_min_rate": 2048,
    "keep_alive_s": 7.5,
    "max_connections": 0,
    "max_connections_per_client": 3,
    "api_keys": "k1,k2",
    "api_keys_file": Path("keys.txt"),
    "tenants_file": Path("tenants.yaml"),
    "health_interval_s": 0.5,
    "health_timeout_s": 0.25,
    "log_level": "debug",
    "admin_host": "::1",
    "admin_port": 0,
    "redis_url": "redis://redis:6379/1",
    "cluster": False,
    "per_worker_state": True,
    "tracing": True,
    "trusted_proxies": "10.0.0.0/8",
}


def command_params(name: str) -> dict[str, Any]:
    group = typer.main.get_command(app)
    command = group.commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.param_type_name == "option"}


def flagged() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(Settings) if spec_of(f).source in ("option", "secret")]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """What ``specgate serve`` would start with: ``run_server`` records its settings instead."""
    seen: list[Settings] = []
    monkeypatch.setattr(gateway.cli.serve, "run_server", seen.append)
    for f in dataclasses.fields(Settings):
        monkeypatch.delenv(env_name(f.name), raising=False)
    return seen


def test_every_field_is_declared_with_help() -> None:
    for f in dataclasses.fields(Settings):
        assert spec_of(f).help.strip(), f.name


def test_serve_has_one_option_per_flagged_field_and_nothing_else() -> None:
    params = command_params("serve")
    assert set(params) == {f.name for f in flagged()}
    for f in flagged():
        p, spec = params[f.name], spec_of(f)
        assert p.opts == [flag_name(f.name)], f.name
        assert p.envvar == env_name(f.name), f.name
        assert p.help == spec.help, f.name
        assert p.hidden is (spec.source == "secret"), f.name
        if f.default is dataclasses.MISSING:
            assert p.required, f.name
        else:
            assert p.default == f.default, f.name
    assert params["cluster"].secondary_opts == ["--no-cluster"]  # a switch on by default can be turned off
    assert params["header_timeout_s"].opts == ["--header-timeout"]  # seconds: the flag drops the _s


def test_the_sample_covers_every_flagged_field_with_another_value() -> None:
    assert set(SAMPLE) == {f.name for f in flagged()} - {"rules"}
    for f in flagged():
        if f.name != "rules":
            assert SAMPLE[f.name] != f.default, f.name


def test_defaults(started: list[Settings]) -> None:
    r = CliRunner().invoke(app, ["serve", "--rules", "r.yaml"])
    assert r.exit_code == 0, r.output
    assert started == [Settings(rules=Path("r.yaml"))]


def test_flags_variables_and_from_env_give_the_same_settings(started: list[Settings]) -> None:
    expected = Settings(rules=Path("r.yaml"), **SAMPLE)
    params = command_params("serve")
    argv = ["serve", "--rules", "r.yaml"]
    for name, value in SAMPLE.items():
        if name == "api_keys":
            continue  # never a flag (below)
        if isinstance(value, bool):  # the sample's value is not the default: the switch that sets it
            argv.append(params[name].opts[0] if value else params[name].secondary_opts[0])
        else:
            argv += [params[name].opts[0], str(value)]
    r = CliRunner().invoke(app, argv, env={"SPECGATE_API_KEYS": "k1,k2"})
    assert r.exit_code == 0, r.output
    env = expected.to_env()
    r = CliRunner().invoke(app, ["serve"], env=env)
    assert r.exit_code == 0, r.output
    assert started == [expected, expected]
    assert Settings.from_env(env) == expected


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("port", "0", "port must be 1..65535, got 0"),
        ("admin_port", "70000", "admin_port must be 0 (off) or 1..65535, got 70000"),
        ("max_json_depth", "251", "max_json_depth must be 1..250, got 251"),
        ("idempotency_memory_bytes", "1024", "idempotency_memory_bytes must be >= 64 MiB, got 1024"),
        ("keep_alive_s", "0", "keep_alive_s must be > 0 and <= 3600 seconds, got 0.0"),
        ("body_min_rate", "10", "body_min_rate must be >= 1024 bytes per second, got 10"),
        ("max_connections", "-1", "max_connections must be >= 0 (0: no cap), got -1"),
        ("log_level", "loud", "log_level must be debug|info|warning|error, got 'loud'"),
        ("redis_url", "http://r", "redis_url must start with redis://"),
    ],
)
def test_a_bad_value_gets_the_same_error_by_flag_and_by_variable(
    started: list[Settings], name: str, bad: str, message: str
) -> None:
    flag = command_params("serve")[name].opts[0]
    by_flag = CliRunner().invoke(app, ["serve", "--rules", "r.yaml", flag, bad])
    by_variable = CliRunner().invoke(app, ["serve", "--rules", "r.yaml"], env={env_name(name): bad})
    for r in (by_flag, by_variable):
        assert r.exit_code == 2
        assert message in " ".join(r.output.split()), r.output
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings.from_env({"SPECGATE_RULES": "r.yaml", env_name(name): bad})
    assert started == []


def test_a_secret_is_refused_as_a_flag_and_taken_from_its_variable(started: list[Settings]) -> None:
    r = CliRunner().invoke(app, ["serve", "--rules", "r.yaml", "--api-keys", "sk-secret"])
    assert r.exit_code == 2
    assert "SPECGATE_API_KEYS" in r.output
    assert "sk-secret" not in r.output
    r = CliRunner().invoke(app, ["serve", "--rules", "r.yaml"], env={"SPECGATE_API_KEYS": "sk-secret"})
    assert r.exit_code == 0, r.output
    assert started[0].client_api_keys() == {"sk-secret"}


def test_an_environment_only_setting_has_no_flag(started: list[Settings]) -> None:
    assert "metrics_token" not in command_params("serve")
    r = CliRunner().invoke(app, ["serve", "--rules", "r.yaml"], env={"SPECGATE_METRICS_TOKEN": " scrape "})
    assert r.exit_code == 0, r.output
    assert started[0].metrics_token == "scrape"
    assert "scrape" not in repr(started[0])


def test_one_reading_of_true_and_false() -> None:
    for raw in ("1", "true", "Yes", " on "):
        assert parse_bool(raw) is True
    for raw in ("0", "FALSE", "no", "off"):
        assert parse_bool(raw) is False
    with pytest.raises(ValueError, match="expected true or false"):
        parse_bool("maybe")
    for name in ("cluster", "per_worker_state", "tracing"):
        with pytest.raises(SettingsError, match=env_name(name)):
            Settings.from_env({"SPECGATE_RULES": "r.yaml", env_name(name): "maybe"})


def test_epp_shares_the_fields_it_names() -> None:
    params = command_params("epp")
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    for name in EPP_SETTINGS:
        p, f = params[name], fields[name]
        change = EPP_CHANGES.get(name, {})
        assert p.opts == [flag_name(name)], name
        assert p.envvar == change.get("env", env_name(name)), name
        assert p.help == change.get("help", spec_of(f).help), name
        if f.default is not dataclasses.MISSING:
            assert p.default == change.get("default", f.default), name
    assert params["port"].envvar == "SPECGATE_EPP_PORT"
    assert params["port"].default == 9002
    assert params["api_keys"].hidden
    assert {"metrics_port", "usage_bytes", "kube_selector", "kube_namespace", "kube_port"} <= set(params)


def every_command(group: Any, path: str = "") -> Any:
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from every_command(command, f"{path}{name} ")
        else:
            yield f"{path}{name}", command


def test_an_option_read_from_a_settings_variable_has_the_fields_default() -> None:
    """A command's own option that reads a setting's variable (``specgate demo --port``, ``SPECGATE_PORT``) keeps
    the field's default, or none at all (None: worked out when the command runs, as demo's admin port is)."""
    fields = {env_name(f.name): f for f in dataclasses.fields(Settings)}
    checked = []
    for name, command in every_command(typer.main.get_command(app)):
        if name in ("serve", "epp"):  # built from the fields (above)
            continue
        for p in command.params:
            f = fields.get(p.envvar) if isinstance(p.envvar, str) else None
            if f is None or f.default is dataclasses.MISSING:
                continue
            checked.append(f"{name} {p.name}")
            assert p.default in (None, f.default), f"{name} {p.opts}: default {p.default!r}, the field's {f.default!r}"
    assert "demo port" in checked
