"""Stand-in endpoints (``Settings.stand_ins``): the demo's simulated servers replace the named pools' endpoints
whenever the YAML is loaded, the file itself untouched, so the file a user edits is the one served and reloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.loader import load_rules_text
from gateway.config.packaged import DEFAULT_RULES
from gateway.config.settings import Settings, SettingsError


def test_the_named_pools_get_one_endpoint_at_the_url() -> None:
    text = DEFAULT_RULES.read_text()
    plain = load_rules_text(text)
    names = [p.name for p in plain.pools]
    stood = load_rules_text(text, stand_ins={names[0]: "http://127.0.0.1:9"})
    first = next(p for p in stood.pools if p.name == names[0])
    assert [(e.url, e.id) for e in first.endpoints] == [("http://127.0.0.1:9", f"{names[0]}-sim-0")]
    assert first.api_key_env is None
    other = next(p for p in stood.pools if p.name == names[1])
    assert other.endpoints == next(p for p in plain.pools if p.name == names[1]).endpoints


def test_the_setting_parses_and_refuses_malformed_items() -> None:
    s = Settings(rules=Path("x.yaml"), stand_ins="spec=http://127.0.0.1:1, std=http://127.0.0.1:2")
    assert s.stand_in_urls() == {"spec": "http://127.0.0.1:1", "std": "http://127.0.0.1:2"}
    assert Settings(rules=Path("x.yaml")).stand_in_urls() == {}
    for bad in ("spec", "spec=ftp://x", "=http://x"):
        with pytest.raises(SettingsError, match="stand_ins"):
            Settings(rules=Path("x.yaml"), stand_ins=bad)
    assert Settings.from_env({"SPECGATE_RULES": "x.yaml", "SPECGATE_STAND_INS": "a=http://h:1"}).stand_ins
