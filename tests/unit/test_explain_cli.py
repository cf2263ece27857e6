"""``specgate explain FILE`` against a real admin listener (uvicorn in a thread), and its exit codes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from typer.testing import CliRunner

from gateway.admin.app import create_admin_app
from gateway.cli.main import app
from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.runtime.container import Runtime
from tests.conftest import MODEL, ServerThread, closed_port_url, rules_for, static_routes

TOKEN = "admin-cli-token"
CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "SPECGATE_ADMIN_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("admin-cli")
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(static_routes(rules_for([closed_port_url()], [closed_port_url()]))))
    rt: Runtime = create_app(Settings(rules=path, api_keys="client-key")).state.runtime
    server = ServerThread(create_admin_app(rt, TOKEN)).start()
    yield server.url
    server.stop()


@pytest.fixture
def request_file(tmp_path: Path) -> Path:
    f = tmp_path / "req.json"
    f.write_bytes(orjson.dumps(CODE))
    return f


def invoke(args: list[str], env: dict[str, str] | None = None, stdin: bytes | None = None) -> Any:
    return CliRunner().invoke(app, ["explain", *args], env=ENV if env is None else env, input=stdin)


def test_explain_prints_class_live_numbers_and_plan(admin_url: str, request_file: Path) -> None:
    r = invoke([str(request_file), "--url", admin_url])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "class precise" in out
    assert "task code (from rule)" in out
    assert "controller none (static route)" in out
    assert "live pools" in out
    assert "plan (max 2 attempts)" in out
    assert "stale (no fresh scrape): spec, std" in out  # nothing scraped: shown as unknown, never 0
    words = [line.split() for line in out.splitlines()]
    assert ["spec", "preferred", "1/1", "0", "–", "–", "–", "–", "–", "–"] in words
    assert ["1", "spec", "speculative", "preferred"] in words
    assert ["2", "std", "standard", "alternate"] in words


def test_explain_json_and_headers_and_stdin(admin_url: str) -> None:
    body = orjson.dumps({"model": MODEL, "temperature": 0.1, "messages": [{"role": "user", "content": "hi"}]})
    r = invoke(["-", "--url", admin_url, "--json", "-H", "X-Task-Type: code"], stdin=body)
    assert r.exit_code == 0, r.output
    d = orjson.loads(r.stdout)
    assert (d["task_type"], d["task_source"], d["traffic_class"]["name"]) == ("code", "header", "precise")
    r = invoke(
        ["-", "--url", admin_url, "--json", "--path", "/v1/completions"], stdin=b'{"model": "x", "prompt": "hi"}'
    )
    assert r.exit_code == 1  # the admin API answered 404 model_not_found
    assert "The model `x` does not exist" in r.output


def test_admin_api_errors_exit_1_and_auth_errors_3_with_their_message(
    admin_url: str, request_file: Path, tmp_path: Path
) -> None:
    r = invoke([str(request_file), "--url", admin_url], env={"COLUMNS": "200"})
    assert r.exit_code == 3
    assert "401" in r.output
    assert "set SPECGATE_ADMIN_TOKEN" in r.output
    r = invoke([str(request_file), "--url", admin_url], env={**ENV, "SPECGATE_ADMIN_TOKEN": "wrong"})
    assert r.exit_code == 3
    assert "invalid admin token" in r.output
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps({**CODE, "model": "nope"}))
    r = invoke([str(bad), "--url", admin_url])
    assert r.exit_code == 1
    assert "The model `nope` does not exist" in r.output


def test_usage_and_connection_problems_exit_2(request_file: Path, tmp_path: Path) -> None:
    r = invoke([str(request_file), "--url", closed_port_url()])
    assert r.exit_code == 2
    assert "--admin-port" in r.output
    assert "--url" in r.output
    r = invoke([str(tmp_path / "missing.json")])
    assert r.exit_code == 2
    assert "cannot read" in r.output
    r = invoke([str(request_file), "-H", "no-colon"])
    assert r.exit_code == 2
    assert "NAME:VALUE" in r.output
