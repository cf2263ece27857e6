"""gateway.bench.conversations: the multi-turn generator (determinism, growing prompts, class changes, shared
prefixes, the Responses API form) and the peer policies' command line and checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.bench import peer
from gateway.bench.conversations import (
    Conversation,
    parse_conversations,
    plan_conversations,
    spec_of,
    turn_request,
)
from gateway.bench.mix import load_mix, parse_mix
from gateway.bench.multiturn import conversation_capacity
from gateway.bench.points import Setup
from gateway.bench.policies import check_policies
from gateway.sim.parsing import count_tokens
from gateway.sim.tokens import answer_ids, chat_prompt_ids

ROOT = Path(__file__).resolve().parents[2]
MIXES = ROOT / "bench" / "mixes"


def _plan(name: str = "multiturn", seed: int = 7, n: int = 60, first: int = 0) -> list[Conversation]:
    mix = load_mix(name, MIXES)
    spec = spec_of(mix)
    assert spec is not None
    return plan_conversations(spec, mix.classes, seed, n, first)


def _answers(conv: Conversation) -> list[str]:
    return [f"answer {t} of conversation {conv.index}: " + "words " * (10 + t) for t in range(len(conv.turns))]


def test_the_same_seed_plans_the_same_conversations_and_another_seed_others() -> None:
    assert _plan(seed=7) == _plan(seed=7)
    assert _plan(seed=7) != _plan(seed=8)
    # conversation i does not depend on how many were planned before it: a slice plans the same ones
    assert _plan(n=60)[40:] == _plan(n=20, first=40)
    convs = _plan()
    assert {c.kind for c in convs} == {"assistant", "agent", "rag"}
    assert all(3 <= len(c.turns) <= 10 for c in convs)
    assert all(c.turns[0].think_s == 0 and all(5 <= t.think_s <= 20 for t in c.turns[1:]) for c in convs)


def test_every_turn_is_the_last_turn_plus_its_answer_plus_new_text() -> None:
    for conv in _plan(n=12):
        answers = _answers(conv)
        previous: list[int] | None = None
        sizes = []
        for t in range(len(conv.turns)):
            _, body, _ = turn_request(conv, t, answers[:t], "m")
            ids = chat_prompt_ids(body["messages"], body.get("tools"))
            sizes.append(len(ids))
            if previous is not None:
                # the simulator's rendering of turn t starts with turn t-1's prompt and its answer: a warm server
                # prefills only the new user text
                assert ids[: len(previous)] == previous
            previous = ids + answer_ids(answers[t], chat=True)
        assert sizes == sorted(sizes)
        assert sizes[-1] > sizes[0]


def test_the_class_changes_between_turns_and_the_tools_stay() -> None:
    convs = [c for c in _plan(n=80) if c.kind == "assistant"]
    assert convs
    changed = 0
    for conv in convs:
        first = turn_request(conv, 0, [], "m")[1]
        assert first["temperature"] == 0.0
        assert first["tools"]
        for t in range(1, len(conv.turns)):
            body = turn_request(conv, t, _answers(conv)[:t], "m")[1]
            assert body["tools"] == first["tools"]  # the client keeps its tool definitions
            if conv.turns[t].cls.name == "chat-turn":
                assert body["temperature"] == 0.8
                assert body["stream"] is True
                changed += 1
    assert changed > len(convs)  # most assistant conversations go on as chat at T=0.8


def test_conversations_share_system_prompts_and_documents() -> None:
    convs = _plan(n=80)
    systems = {c.system_index: c.system for c in convs}
    assert len(systems) == 8  # 8 shared system prompts, each of 1,500 tokens
    assert all(count_tokens(s) == 1500 for s in systems.values())
    for c in convs:
        assert c.system == systems[c.system_index]
    rag = [c for c in convs if c.kind == "rag"]
    docs = [d for c in rag for d in c.turns[0].user.split("</document>")[:-1]]
    assert len(docs) == 2 * len(rag)
    assert len(set(docs)) < len(docs)
    agent = [c for c in convs if c.kind == "agent"]
    assert all("<tool_result>" in t.user for c in agent for t in c.turns[1:])  # the loop's context grows


def test_the_responses_kind_sends_the_whole_history_as_input_items() -> None:
    conv = next(c for c in _plan("multiturn-responses", n=20) if len(c.turns) >= 3)
    answers = _answers(conv)
    path, body, headers = turn_request(conv, 2, answers[:2], "m")
    assert path == "/v1/responses"
    assert "previous_response_id" not in body
    assert "messages" not in body
    roles = [m["role"] for m in body["input"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert body["input"][2]["content"] == answers[0]
    assert "max_output_tokens" in body
    assert headers["x-sim-task"] == conv.turns[2].cls.task


def test_bad_conversation_blocks_are_refused_with_a_reason() -> None:
    names = {"a", "b"}
    good: dict[str, Any] = {"kinds": [{"name": "k", "first": "a", "next": {"b": 1}}]}
    assert parse_conversations(good, names).kinds[0].next == (("b", 1.0),)
    cases = [
        ({"kinds": []}, "kinds"),
        ({"kinds": [{"name": "k", "first": "z"}]}, "not one of the mix's classes"),
        ({**good, "turns": {"uniform": [1, 500]}}, "turns"),
        ({**good, "system_prompts": {"count": 0}}, "at least 1"),
        ({**good, "bogus": 1}, "unknown keys"),
        ({"kinds": [{"name": "k", "first": "a", "api": "grpc"}]}, "api"),
    ]
    for raw, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_conversations(raw, names)
    mix = parse_mix({"classes": [{"name": "a"}], "conversations": {"kinds": [{"name": "k", "first": "nope"}]}})
    with pytest.raises(ValueError, match="nope"):
        spec_of(mix)
    assert spec_of(load_mix("default", MIXES)) is None


def test_capacity_counts_only_the_new_text_of_a_warm_turn() -> None:
    mix = load_mix("multiturn", MIXES)
    spec = spec_of(mix)
    assert spec is not None
    small, how = conversation_capacity(mix, spec, Setup().fleet_from("1+1"))
    big, _ = conversation_capacity(mix, spec, Setup().fleet_from("2+2"))
    assert big == pytest.approx(2 * small)
    assert "of which" in how
    assert "turns per conversation" in how


def test_peer_command_line_and_a_missing_router(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = peer.router_command("/bin/vr", "peer-round-robin", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 5, 6)
    assert cmd[:1] == ["/bin/vr"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert cmd[cmd.index("--port") + 1] == "5"
    assert cmd[cmd.index("--prometheus-port") + 1] == "6"
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    monkeypatch.setattr(peer, "router_binary", lambda: None)
    with pytest.raises(peer.PeerUnavailable, match="pip install"):
        check_policies(("adaptive", "peer-cache-aware"))
    check_policies(("adaptive", "standard"))  # no peer asked for: no router needed
    with pytest.raises(ValueError, match="unknown policies"):
        check_policies(("adaptive", "envoy"))
