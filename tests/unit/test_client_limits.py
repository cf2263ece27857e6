"""The depth of a JSON body read from its text (gateway/proxy/json_depth.py) against a walk of the parsed value,
the connection caps' counting (gateway/proxy/connections.py), and the settings of the client limits."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.settings import Settings, SettingsError
from gateway.errors import InvalidJSON
from gateway.proxy.connections import ConnectionGate, Held, client_key
from gateway.proxy.json_depth import check_json_depth, json_depth
from gateway.proxy.limits import client_limits


def walk_depth(value: Any) -> int:
    """The reference: the nesting of arrays and objects, the outermost one counted as 1."""
    if isinstance(value, dict):
        return 1 + max((walk_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((walk_depth(v) for v in value), default=0)
    return 0


# Strings full of what the text reading must see through: brackets, quotes, backslashes, escapes.
tricky = st.text(alphabet=st.sampled_from('[]{}"\\/:,\n\t\x01é a'), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | tricky,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky, inner, max_size=4),
    max_leaves=60,
)


@settings(max_examples=400, deadline=None)
@given(json_values, st.booleans())
def test_the_depth_read_from_the_text_is_the_depth_of_the_value(value: Any, spaced: bool) -> None:
    # Two writers: orjson's compact text, and the standard library's with spaces and \uXXXX escapes.
    raw = json.dumps(value, indent=1).encode() if spaced else orjson.dumps(value)
    assert json_depth(raw) == walk_depth(value)


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"a":"x\\"}',  # an escaped backslash just before the closing quote
        rb'{"a":"\n\\","b":[[1]]}',  # another escape just before an escaped backslash
        rb'{"a":"\\\"]]]]","b":[[[1]]]}',  # escaped backslash, escaped quote, then brackets in the string
        rb'["[","]",[["{"]]]',
        rb'{"\u005b":[]}',
        rb"[[],[[]],[[[]]]]",
    ],
)
def test_escapes_and_brackets_in_strings(raw: bytes) -> None:
    assert json_depth(raw) == walk_depth(orjson.loads(raw))


def test_deep_chains_and_the_limit() -> None:
    for depth in (2, 3, 4, 5, 6, 128, 250):
        raw = b"[" * depth + b"]" * depth
        assert json_depth(raw) == depth
        check_json_depth(raw, depth)
        with pytest.raises(InvalidJSON, match=f"deeper than {depth - 1} levels"):
            check_json_depth(raw, depth - 1)


def test_many_tiny_messages_are_read_fast_and_the_cost_is_linear() -> None:
    """230k messages (a legal 7.9 MB body): the object walk took about 280 ms; the text reading takes a few. The
    bounds are generous (a slow shared machine): what they catch is a return to a per-element Python walk."""
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}] * 230_000})
    started = time.perf_counter()
    check_json_depth(raw, 128)
    assert time.perf_counter() - started < 1.0
    # The worst shape for the peeling passes: many chains just under the limit; still one pass per step.
    chains = (b"[" * 120 + b"]" * 120) * 30_000
    raw = b"[" + b",".join([chains[i : i + 240] for i in range(0, len(chains), 240)]) + b"]"
    started = time.perf_counter()
    assert json_depth(raw) == 121
    assert time.perf_counter() - started < 5.0


def test_gate_caps_in_total_and_per_client_per_port() -> None:
    gate = ConnectionGate(total=3, per_client=2)
    a1, a2 = gate.enter(80, "10.0.0.1"), gate.enter(80, "10.0.0.1")
    assert isinstance(a1, Held)
    assert isinstance(a2, Held)
    assert gate.enter(80, "10.0.0.1") == "connections_per_client"
    b1 = gate.enter(80, "10.0.0.2")
    assert isinstance(b1, Held)
    assert gate.enter(80, "10.0.0.3") == "connections_total"
    assert isinstance(gate.enter(81, "10.0.0.1"), Held)  # another listener counts apart
    gate.leave(a1)
    assert isinstance(gate.enter(80, "10.0.0.3"), Held)
    assert gate.open(80) == 3


def test_gate_releases_everything_and_no_cap_is_zero() -> None:
    gate = ConnectionGate(total=0, per_client=0)
    held = [gate.enter(80, "10.0.0.1") for _ in range(1000)]
    assert all(isinstance(h, Held) for h in held)
    for h in held:
        assert isinstance(h, Held)
        gate.leave(h)
    assert gate.open(80) == 0
    assert gate.clients() == 0
    clone = pickle.loads(pickle.dumps(ConnectionGate(total=5, per_client=1)))  # into each worker process
    assert (clone.total, clone.per_client) == (5, 1)


def test_ipv6_clients_count_per_64_and_mapped_ipv4_as_ipv4() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::2") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert client_key("10.1.2.3") == "10.1.2.3"


def test_client_limit_settings_travel_through_the_environment_and_bad_ones_are_refused() -> None:
    s = Settings(rules=Path("r.yaml"), header_timeout_s=1.5, keep_alive_s=0.25, max_connections=0, body_min_rate=2048)
    assert Settings.from_env(s.to_env()) == s  # what each worker of --workers N reads back
    limits = client_limits(s)
    assert (limits.header_timeout_s, limits.keep_alive_s, limits.max_connections) == (1.5, 0.25, 0)
    assert limits.max_body_bytes == s.max_body_bytes
    bad: list[dict[str, Any]] = [
        {"header_timeout_s": 0},
        {"body_timeout_s": -1},
        {"keep_alive_s": float("nan")},
        {"body_min_rate": 10},
        {"max_connections": -1},
        {"max_connections_per_client": -1},
    ]
    for kw in bad:
        with pytest.raises(SettingsError):
            Settings(rules=Path("r.yaml"), **kw)
