"""``specgate demo``'s admin token and banner (the demo as a process: tests/integration/test_demo.py)."""

from __future__ import annotations

from pathlib import Path

from gateway.admin.protocol import ACTOR_ENV, TOKEN_ENV, URL_ENV
from gateway.cli.demo import banner, demo_admin_token, specgate_command

RULES = {
    "pools": [
        {"name": "speculative", "kind": "speculative", "models": ["m"]},
        {"name": "standard", "kind": "standard", "models": ["m"]},
    ]
}


def test_without_a_token_the_demo_makes_one_for_its_gateway() -> None:
    environ: dict[str, str] = {}
    token, generated = demo_admin_token(environ)
    assert generated
    assert environ[TOKEN_ENV] == token  # what the gateway's admin listener reads
    assert len(token) >= 32
    assert demo_admin_token({})[0] != token  # random, not a fixed demo password


def test_a_token_of_the_user_is_kept() -> None:
    environ = {TOKEN_ENV: " mine "}
    assert demo_admin_token(environ) == ("mine", False)
    assert environ[TOKEN_ENV] == " mine "


def test_the_banner_exports_the_made_up_token_and_the_admin_url() -> None:
    text = banner(RULES, {"speculative": 9001, "standard": 9002}, 8080, 8081, "tok-123", Path("rules.yaml"))
    assert f"  export {URL_ENV}=http://127.0.0.1:8081\n" in text
    assert f"  export {TOKEN_ENV}=tok-123 " in text
    assert "specgate weight speculative 0.5" in text


def test_the_banner_never_prints_a_token_of_the_user() -> None:
    text = banner(RULES, {"speculative": 9001, "standard": 9002}, 8080, 8081, None, Path("rules.yaml"))
    assert f"export {TOKEN_ENV}" not in text
    assert f"export {URL_ENV}=http://127.0.0.1:8081" in text


def test_the_banner_names_the_console_the_actor_and_the_command_that_runs() -> None:
    text = banner(
        RULES, {"speculative": 9001, "standard": 9002}, 8080, 8081, None, Path("r.yaml"), ".venv/bin/specgate"
    )
    assert "http://127.0.0.1:8081/admin/ui" in text
    assert f"export {ACTOR_ENV}=" in text
    assert "  .venv/bin/specgate pools\n" in text
    assert "| .venv/bin/specgate explain -" in text


def test_the_command_is_the_path_unless_the_path_finds_this_specgate() -> None:
    shown = specgate_command({"PATH": "/nowhere"})  # a path to this specgate (or python -m gateway)
    assert shown != "specgate"
    assert shown.endswith(("specgate", "-m gateway"))
