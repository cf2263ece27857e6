"""The waiting queue of one simulated engine under vLLM's two scheduling policies (``--scheduling-policy``).

``fcfs`` (the default): a ``deque`` in arrival order; a preempted sequence goes back to its front.
``priority``: ``PriorityQueue``, ordered by the request's ``priority`` (lower value first), then its arrival time,
then its request id, as vLLM's ``PriorityRequestQueue`` orders them. A preempted sequence keeps its place by those
keys (there is no front of the queue to put it back at). ``rank`` is the same key for running sequences: under the
priority policy the one with the largest rank (the lowest priority, the latest arrival) is the one preempted when
the KV cache is full.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal, Protocol

from gateway.sim.sequence import Generation

SchedulingPolicy = Literal["fcfs", "priority"]
POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
PRIORITY_MIN = -(2**63)  # vLLM bounds the body's `priority` to a signed 64-bit integer
PRIORITY_MAX = 2**63 - 1


class WaitingQueue(Protocol):
    """What the engine uses of its waiting queue (a ``deque`` under fcfs)."""

    def append(self, g: Generation, /) -> None: ...
    def appendleft(self, g: Generation, /) -> None: ...
    def popleft(self) -> Generation: ...
    def __getitem__(self, i: int, /) -> Generation: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Generation]: ...


def rank(g: Generation) -> tuple[int, float]:
    """Scheduling order under the priority policy: smaller first; the running sequence with the largest is preempted."""
    return g.request.priority, g.arrival or 0.0


class PriorityQueue:
    """A heap of waiting sequences by (priority, arrival, request id); ``[0]`` is the next to admit."""

    __slots__ = ("_heap", "_seq")

    def __init__(self, items: Iterable[Generation] = ()) -> None:
        self._heap: list[tuple[int, float, str, int, Generation]] = []
        self._seq = itertools.count()  # ties of all three keys: insertion order (never compares two Generations)
        for g in items:
            self.append(g)

    def append(self, g: Generation, /) -> None:
        heapq.heappush(self._heap, (g.request.priority, g.arrival or 0.0, g.request_id, next(self._seq), g))

    appendleft = append  # a preempted sequence is ordered by its keys like any other

    def popleft(self) -> Generation:
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, i: int, /) -> Generation:
        if i != 0 or not self._heap:
            raise IndexError("only the head of a priority queue can be read")
        return self._heap[0][-1]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Generation]:
        """In scheduling order."""
        return (entry[-1] for entry in sorted(self._heap))


def new_queue(policy: SchedulingPolicy, items: Iterable[Generation] = ()) -> WaitingQueue:
    return PriorityQueue(items) if policy == "priority" else deque(items)
