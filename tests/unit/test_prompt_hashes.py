"""The recent prompts' chunk hashes (``gateway.routing.prompt_hashes``): always the hashes of the whole rendered
prompt, reused for a prompt that repeats or extends a kept one, bounded in prompts and bytes, least recently
used first out."""

from __future__ import annotations

import random
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.prefix_index import CHUNK_CHARS, MAX_PROMPT_CHUNKS, chain_hashes
from gateway.routing.prompt_hashes import MAX_PROBES, PromptHashes
from gateway.routing.prompt_key import prompt_chunks, render_parts, render_prompt


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "epsilon")) for _ in range(n))


def conversation(seed: int, turns: int) -> list[dict[str, Any]]:
    """The bodies of a conversation's turns, each extending the one before (answers, tool calls, tool results)."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 40)}]
    bodies = []
    for t in range(turns):
        messages.append({"role": "user", "content": words(rng, rng.randint(1, 60))})
        bodies.append({"model": "m", "messages": list(messages)})
        if rng.random() < 0.3:
            call = {"id": f"c{t}", "type": "function", "function": {"name": "f", "arguments": words(rng, 5)}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"c{t}", "content": words(rng, 30)})
        messages.append({"role": "assistant", "content": words(rng, rng.randint(1, 80))})
    return bodies


def test_the_parts_join_to_the_rendered_prompt() -> None:
    for body in conversation(1, 6):
        assert "".join(render_parts("chat", body)) == render_prompt("chat", body)
    assert render_parts("completions", {"model": "m", "prompt": [1, 2]}) == []
    assert render_prompt("completions", {"model": "m", "prompt": [1, 2]}) == ""


def test_chain_hashes_continued_from_a_chunk_are_the_rest_of_the_chain() -> None:
    text = words(random.Random(2), 200)
    whole = chain_hashes(text)
    assert whole[:5] + chain_hashes(text, 5, whole[4]) == whole


def test_a_repeated_prompt_gets_the_same_hashes_from_the_kept_one() -> None:
    hashes = PromptHashes()
    body = conversation(3, 1)[0]
    first = hashes.of_request("chat", body)
    assert first == prompt_chunks("chat", body)
    assert hashes.misses == 1
    assert hashes.hits == 0
    assert hashes.of_request("chat", dict(body)) is first  # kept: not hashed again
    assert hashes.hits == 1


def test_each_turn_of_a_conversation_hashes_only_past_the_turn_before() -> None:
    hashes = PromptHashes()
    bodies = conversation(4, 12)
    for body in bodies:
        assert hashes.of_request("chat", body) == prompt_chunks("chat", body)
    assert hashes.misses == 1
    assert hashes.hits == len(bodies) - 1


def test_interleaved_conversations_each_find_their_own_turn() -> None:
    hashes = PromptHashes()
    convs = [conversation(seed, 8) for seed in range(5)]
    for turn in range(8):
        for bodies in convs:
            assert hashes.of_request("chat", bodies[turn]) == prompt_chunks("chat", bodies[turn])
    assert hashes.misses == 5


def test_a_prompt_rendered_elsewhere_is_looked_up_whole() -> None:
    hashes = PromptHashes()
    text = words(random.Random(5), 300)
    assert hashes.of_text(text) == chain_hashes(text)
    assert hashes.of_text(text + " more words") == chain_hashes(text + " more words")  # no parts: hashed whole
    assert hashes.misses == 2
    assert hashes.of_text(text) == chain_hashes(text)
    assert hashes.hits == 1
    assert hashes.of_text("short") == ()
    assert len(hashes) == 2


def test_a_kept_prompt_of_the_same_length_and_end_but_another_start_is_not_taken() -> None:
    hashes = PromptHashes()
    tail = "x" * CHUNK_CHARS
    a, b = "a" * 200 + tail, "b" * 200 + tail
    assert hashes.of_text(a) == chain_hashes(a)
    assert hashes.of_text(b) == chain_hashes(b)  # same key, other text: hashed, and replaces the kept one
    assert len(hashes) == 1
    assert hashes.size == sys.getsizeof(b)


def test_the_earlier_prompt_is_looked_up_at_the_last_parts_only() -> None:
    hashes = PromptHashes()
    messages = [{"role": "user", "content": "q" * 100}]
    hashes.of_request("chat", {"model": "m", "messages": messages})
    many = messages + [{"role": "assistant", "content": "a"}] * MAX_PROBES  # four parts a message
    assert hashes.of_request("chat", {"model": "m", "messages": many}) == prompt_chunks(
        "chat", {"model": "m", "messages": many}
    )
    assert hashes.hits == 0  # the earlier prompt ends too far back: hashed whole
    few = [*messages, {"role": "assistant", "content": "a" * 80}]
    hashes.of_request("chat", {"model": "m", "messages": few})
    assert hashes.hits == 1


def test_memory_is_bounded_in_prompts_and_bytes_least_recent_out_first() -> None:
    small = sys.getsizeof("a" * 2 * CHUNK_CHARS)
    bound = 5 * small
    hashes = PromptHashes(max_prompts=3, max_bytes=bound)
    texts = [chr(ord("a") + i) * (2 * CHUNK_CHARS) for i in range(5)]
    for t in texts[:3]:
        hashes.of_text(t)
    hashes.of_text(texts[0])  # used again: the most recent
    hashes.of_text(texts[3])  # the fourth prompt: the least recent (texts[1]) goes
    assert len(hashes) == 3
    assert hashes.of_text(texts[1])
    assert hashes.misses == 5  # hashed again (it was gone); texts[2] goes
    hits = hashes.hits
    hashes.of_text(texts[0])
    assert hashes.hits == hits + 1  # still kept
    big = "z" * (12 * CHUNK_CHARS)
    hashes.of_text(big)  # over the bytes left: the others go until it fits
    assert hashes.size == sys.getsizeof(big) <= bound
    assert len(hashes) == 1
    huge = "h" * (14 * CHUNK_CHARS)
    assert hashes.of_text(huge) == chain_hashes(huge)  # larger than the bound: hashed, not kept
    assert hashes.size == sys.getsizeof(big)


def test_wide_characters_count_by_their_bytes() -> None:
    hashes = PromptHashes()
    wide = "\U0001f600" * (3 * CHUNK_CHARS)  # four bytes a character
    assert hashes.of_text(wide) == chain_hashes(wide)
    assert hashes.size == sys.getsizeof(wide) > 4 * len(wide)
    hashes.clear()
    assert hashes.size == 0
    assert len(hashes) == 0


def test_a_prompt_over_the_hashed_length_is_cut_as_chain_hashes_cuts_it() -> None:
    hashes = PromptHashes()
    text = "p" * (CHUNK_CHARS * MAX_PROMPT_CHUNKS + 3 * CHUNK_CHARS)
    got = hashes.of_text(text)
    assert len(got) == MAX_PROMPT_CHUNKS
    assert got == chain_hashes(text)
    assert hashes.size == sys.getsizeof(text[: CHUNK_CHARS * MAX_PROMPT_CHUNKS])


@settings(max_examples=40, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    turns=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    max_prompts=st.integers(1, 6),
    max_bytes=st.integers(CHUNK_CHARS, 40 * CHUNK_CHARS),
)
def test_the_hashes_are_always_those_of_the_whole_prompt(
    seeds: list[int], turns: list[int], max_prompts: int, max_bytes: int
) -> None:
    hashes = PromptHashes(max_prompts=max_prompts, max_bytes=max_bytes)
    for seed, turn in zip(seeds, turns, strict=False):
        body = conversation(seed, 6)[turn]
        assert hashes.of_request("chat", body) == prompt_chunks("chat", body)
        assert len(hashes) <= max_prompts
        assert hashes.size <= max_bytes


def test_the_kept_lengths_follow_the_kept_prompts() -> None:
    hashes = PromptHashes(max_prompts=2)
    texts = ["a" * 100, "b" * 100, "c" * 200]
    for t in texts:
        hashes.of_text(t)
    assert hashes._lengths == {100: 1, 200: 1}  # "a" went
    hashes.of_text("d" * 200)
    assert hashes._lengths == {200: 2}
    hashes.clear()
    assert hashes._lengths == {}
