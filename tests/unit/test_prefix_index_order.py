"""One endpoint's prefix index against a plain model of it: every record moves each chunk of the prompt to the
most recent end (its first chunk last of all), the least recent go first past the capacity. The index skips the
moves for a prompt that starts the one it recorded last; the order, the warm counts and the bound must not tell."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.prefix_index import PrefixIndex


class Model:
    """The index as a loop over the chunks, nothing skipped."""

    def __init__(self, capacity: int) -> None:
        self.held: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def record(self, chunks: tuple[int, ...]) -> int:
        warm = 0
        while warm < len(chunks) and chunks[warm] in self.held:
            warm += 1
        for h in reversed(chunks):
            self.held[h] = None
            self.held.move_to_end(h)
        self.evict()
        return warm

    def evict(self) -> None:
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)


def chain(conv: int, n: int) -> tuple[int, ...]:
    """Conversation ``conv``'s first ``n`` chunk hashes (distinct per conversation and position)."""
    return tuple(conv * 1000 + i for i in range(n))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, 4), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("capacity"), st.integers(1, 40), st.just(0), st.just(False)),
        st.tuples(st.just("clear"), st.just(0), st.just(0), st.just(False)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 40), ops=OPS)
def test_the_index_keeps_the_models_order_and_warm_counts(capacity: int, ops: list[tuple[str, int, int, bool]]) -> None:
    index, model = PrefixIndex(capacity, max_chunks=64), Model(capacity)
    last: tuple[int, ...] = ()
    for op, a, b, same in ops:
        if op == "record":
            chunks = last if same else chain(a, b)  # the very same tuple again (a repeat), or another prompt
            last = chunks
            assert index.record(chunks) == model.record(chunks)
        elif op == "capacity":
            index.set_capacity(a)
            model.capacity = a
            model.evict()
        else:
            index.clear()
            model.held.clear()
        assert list(index._chunks) == list(model.held)
        assert len(index) <= index.capacity


def test_a_repeat_after_its_chunks_were_evicted_is_recorded_again() -> None:
    index = PrefixIndex(8)
    prompt = chain(1, 6)
    assert index.record(prompt) == 0
    index.set_capacity(3)  # the last prompt loses its later chunks
    assert len(index) == 3
    index.set_capacity(8)
    assert index.record(prompt) == 3  # its first three were warm; all six are back
    assert len(index) == 6
    assert index.record(prompt) == 6
    index.clear()
    assert index.record(prompt) == 0


def test_a_shorter_start_of_the_last_prompt_is_all_warm_and_moves_nothing() -> None:
    index = PrefixIndex(100)
    index.record(chain(2, 5))
    long = chain(1, 10)
    index.record(long)
    before = list(index._chunks)
    assert index.record(long[:4]) == 4
    assert list(index._chunks) == before  # already the most recent, in order
    assert index.predicted_chunks == 4
