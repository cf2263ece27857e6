"""The distinct-prompt rows of ``specgate bench overhead``: the wrk script sends the overhead rows' body with a
number of its own at the start of the prompt, the affinity rules give every pool two endpoints, and the table
says what affinity adds over the plain gateway."""

from __future__ import annotations

from pathlib import Path

import orjson
import yaml

from gateway.bench.overhead_distinct import DistinctRow, _affinity_rules, distinct_script, render_distinct
from gateway.config.loader import load_rules_text


def test_the_script_puts_a_number_at_the_start_of_the_user_message(tmp_path: Path) -> None:
    script = tmp_path / "d.lua"
    distinct_script(script, 300)
    text = script.read_text()
    head = text.split("local head = '", 1)[1].split("'\n", 1)[0]
    tail = text.split("local tail = '", 1)[1].split("'\n", 1)[0]
    body = orjson.loads(f"{head}12-34 {tail}")
    assert body["messages"][1]["content"].startswith("Summarise the following text in two sentences: 12-34 lorem")
    assert body["stream"] is False
    assert "request = function()" in text


def test_the_affinity_rules_have_two_endpoints_a_pool_and_load() -> None:
    doc = _affinity_rules("http://127.0.0.1:9")
    rules = load_rules_text(yaml.safe_dump(doc, sort_keys=False))
    assert [len(p.endpoints) for p in rules.pools] == [2, 2]


def test_the_table_gives_affinitys_cpu_over_the_plain_gateway() -> None:
    row = DistinctRow(
        32,
        {"minimal-aiohttp": 5000.0, "specgate": 4000.0, "specgate-affinity": 3500.0},
        {"minimal-aiohttp": 150.0, "specgate": 200.0, "specgate-affinity": 240.0},
        {"minimal-aiohttp": 1.0, "specgate": 0.8, "specgate-affinity": 0.7},
        {"minimal-aiohttp": 0, "specgate": 0, "specgate-affinity": 0},
    )
    text = render_distinct([row], (1.0, 2.0, 3.0))
    assert "+40 us/request over specgate" in text
    assert "load average 1.00 2.00 3.00" in text
    assert "0.70" in text
