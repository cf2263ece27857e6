"""The code-assistant example YAML classifies the code of a coding assistant as code.

A request that names its language without containing code ("Write a Python function that ...") used to match no
code task rule there and fell to the catch-all class (home standard), where at low load a share of it decoded on
the standard pool: a third of the code-assistant mix's code prompts. Every low-temperature code request of that
mix must land in a class whose home is the draft (speculative) pool.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.bench.mix import load_mix, plan_request
from gateway.config.loader import load_rules_file
from gateway.routing.classify import Classifier

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "routing_rules" / "examples" / "code-assistant.yaml"


@pytest.mark.parametrize(
    "prompt",
    [
        "Write a Python function that parses a CSV export and returns the rows as dicts.",
        "Write a TypeScript helper that debounces a callback.",
        "How do I join two tables in SQL on a nullable column?",
        "Refactor this code so that it handles empty input:\n```python\ndef total(xs):\n    return sum(xs)\n```",
    ],
)
def test_a_request_naming_its_language_is_code(prompt: str) -> None:
    rules = load_rules_file(RULES)
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0.2}
    cls = Classifier(rules).classify("chat", body, None).traffic_class
    assert cls.name == "code-low-temperature"


def test_open_chat_is_not_code() -> None:
    rules = load_rules_file(RULES)
    body = {"model": "m", "messages": [{"role": "user", "content": "How do I prepare for a first week at work?"}]}
    assert Classifier(rules).classify("chat", body, None).traffic_class.name == "other"


def test_every_code_request_of_the_mix_has_a_draft_home() -> None:
    rules = load_rules_file(RULES)
    classifier = Classifier(rules)
    mix = load_mix(ROOT / "bench" / "mixes" / "code-assistant.yaml")
    rng = random.Random(7)
    homes: dict[str, int] = {}
    for _ in range(400):
        planned = plan_request(mix, "m", rng)
        if planned.cls.task != "code":
            continue
        cls = classifier.classify("chat", planned.body, None).traffic_class
        kind = rules.pool(cls.route.preferred).kind
        homes[kind] = homes.get(kind, 0) + 1
    assert homes.get("speculative", 0) > 100
    assert homes.get("standard", 0) == 0
