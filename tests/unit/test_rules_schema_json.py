"""routing_rules/schema.json: generated from the pydantic models and kept in sync with them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.jsonschema import generate_schema, render_schema

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = ROOT / "routing_rules" / "schema.json"
REGENERATE = "python -m gateway.config.jsonschema > routing_rules/schema.json"


def test_schema_json_is_in_sync() -> None:
    assert SCHEMA_FILE.is_file(), f"routing_rules/schema.json is missing; create it with: {REGENERATE}"
    on_disk = SCHEMA_FILE.read_text(encoding="utf-8")
    assert on_disk == render_schema(), (
        f"routing_rules/schema.json is out of date with gateway/config/schema.py; regenerate it with: {REGENERATE}"
    )


def test_schema_header_and_aliases() -> None:
    schema = generate_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "specgate routing rules"
    assert list(schema)[:2] == ["$schema", "title"]
    assert {"pools", "classes"} <= set(schema["required"])
    one_of = schema["$defs"]["OneOf"]
    assert "in" in one_of["properties"]
    assert "in_" not in one_of["properties"]
    assert all(d.get("additionalProperties") is False for d in schema["$defs"].values() if "properties" in d)


def test_render_is_stable_json_with_a_trailing_newline() -> None:
    text = render_schema()
    assert text == render_schema()
    assert text.endswith("}\n")
    assert not text.endswith("\n\n")
    assert json.loads(text) == generate_schema()


def test_module_main_prints_the_schema() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.config.jsonschema"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == render_schema()


SHIPPED = [ROOT / "routing_rules" / "default.yaml", *sorted((ROOT / "routing_rules" / "examples").glob("*.yaml"))]


@pytest.mark.parametrize("source", SHIPPED, ids=lambda p: p.name)
def test_shipped_yaml_validates_against_the_json_schema(source: Path) -> None:
    """What an editor would check as a platform team types (needs the optional `jsonschema` package)."""
    jsonschema = pytest.importorskip("jsonschema")
    document: Any = yaml.safe_load(source.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))).validate(document)
