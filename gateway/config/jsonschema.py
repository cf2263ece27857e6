"""JSON Schema of the routing YAML, generated from the pydantic models, for editors.

``routing_rules/schema.json`` is this module's output, kept in sync by a test. Regenerate it with::

    python -m gateway.config.jsonschema > routing_rules/schema.json

A YAML file opts in with a first line ``# yaml-language-server: $schema=<path to schema.json>``. The schema
checks each field; the checks that need the whole document (pool references, the catch-all class, unique
names) are only in ``specgate validate``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from gateway.config.schema import RoutingRules

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
TITLE = "specgate routing rules"


def generate_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a routing YAML document, with the YAML's names (``in``, not ``in_``)."""
    body = RoutingRules.model_json_schema(by_alias=True)
    body.pop("title", None)
    return {"$schema": SCHEMA_DIALECT, "title": TITLE, **body}


def render_schema() -> str:
    """``generate_schema()`` as stable JSON text: indent 2, keys in the models' order, a trailing newline."""
    return json.dumps(generate_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_schema())
