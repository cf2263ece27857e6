"""Following a vLLM server's KV cache events (``--kv-events-config``, ZMQ) to keep its prefix index honest.

vLLM publishes, per engine step that changed its prefix cache, a batch of events on a ZMQ PUB socket: three frames
(topic, an 8-byte big-endian sequence number from 0, a msgpack payload ``[ts, events, data_parallel_rank]``), each
event a map tagged ``"type"``: ``BlockStored`` (``block_hashes``, ``block_size``, …), ``BlockRemoved``
(``block_hashes``) and ``AllBlocksCleared``. An endpoint whose YAML entry names its publisher (``kv_events:
tcp://host:5557``) is followed by one SUB socket per gateway process.

What the gateway does with them, and why no more: its index (``gateway.fleet.prefix_index``) holds hashes of
character chunks of the prompts it sent, not vLLM's block hashes (those chain the model's token ids, so matching
them needs the served model's tokenizer and chat template on the request path). So the events correct the index
where no tokens are needed:

- ``AllBlocksCleared`` (a cache reset), or a sequence number that goes back (the server restarted and counts from
  0 again): the index is emptied at once, instead of at the next scrape that sees the counters go down.
- The live block count (stored minus removed) bounds the index: the server cannot hold more of this gateway's
  chunks than it holds blocks. The count is only known when the gateway has seen every event since an empty cache
  (the stream's first batch is sequence 0, or since a clear); joining a running server, or a gap in the sequence
  (a slow subscriber's dropped batches), leaves it unknown until the next clear, and the bound is then lifted.

Bounds: a message over ``MAX_MESSAGE_BYTES`` is dropped by ZMQ itself; a payload that does not decode as a batch,
or holds over ``MAX_EVENTS`` events, is counted as malformed and skipped; the live set holds at most
``MAX_LIVE_BLOCKS`` hashes (past that the count is unknown). A publisher that is down or unreachable costs a socket
that ZMQ keeps reconnecting in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.prefix_index import TOKENS_PER_CHUNK
from gateway.periodic import run_every

logger = logging.getLogger("specgate.kv_events")

MAX_MESSAGE_BYTES = 16 << 20  # a step's batch is a few KB; ZMQ drops anything larger before it is read
MAX_EVENTS = 100_000  # events in one batch
MAX_LIVE_BLOCKS = 4_000_000  # hashes tracked per endpoint (an 80 GB GPU holds a few hundred thousand blocks)
RECONCILE_S = 1.0  # how often the set of followed endpoints is brought in line with the YAML


@dataclass(slots=True)
class CacheTracker:
    """One endpoint's cache as its events tell it (pure: no sockets). ``apply`` takes a batch and says what the
    index must do."""

    live: set[int] = field(default_factory=set)
    known: bool = False  # the live set is the server's whole cache (every event seen since it was empty)
    last_seq: int | None = None
    block_size: int = 16

    def apply(self, seq: int, events: Sequence[Any]) -> str | None:
        """One batch. Returns ``"clear"`` when the index must be emptied, else None; ``live_chunks`` then bounds it.
        Raises ValueError on a malformed batch, before changing anything."""
        parsed = [_parse_event(e) for e in events]
        action: str | None = None
        if self.last_seq is not None and seq <= self.last_seq:  # the publisher started over: the server restarted
            self.live.clear()
            self.known = seq == 0
            action = "clear"
        elif self.last_seq is None:
            self.known = seq == 0
        elif seq != self.last_seq + 1:  # batches were lost: the count is no longer the server's
            self.known = False
            self.live.clear()
        self.last_seq = seq
        for kind, hashes, size in parsed:
            if kind == "AllBlocksCleared":
                self.live.clear()
                self.known = True
                action = "clear"
            elif kind == "BlockStored":
                self.block_size = size or self.block_size
                if self.known:
                    self.live.update(hashes)
                    if len(self.live) > MAX_LIVE_BLOCKS:
                        self.live.clear()
                        self.known = False
            elif kind == "BlockRemoved" and self.known:
                self.live.difference_update(hashes)
        return action

    @property
    def live_chunks(self) -> int | None:
        """The most of the index's chunks the server can hold now (None: unknown)."""
        if not self.known:
            return None
        return len(self.live) * self.block_size // TOKENS_PER_CHUNK


def _parse_event(event: Any) -> tuple[str, list[int], int | None]:
    if not isinstance(event, dict):
        raise ValueError("an event is not a map")
    kind = event.get("type")
    if not isinstance(kind, str):
        raise ValueError("an event has no type")
    hashes = event.get("block_hashes") or []
    if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
        raise ValueError("block_hashes is not a list of integers")
    size = event.get("block_size")
    if size is not None and (not isinstance(size, int) or not 1 <= size <= 1024):
        raise ValueError("block_size is not a block size")
    return kind, hashes, size


def decode(payload: bytes) -> list[Any]:
    """A batch's events; ValueError when the payload is not ``[ts, events, rank]`` with a bounded event list."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    if len(batch[1]) > MAX_EVENTS:
        raise ValueError(f"over {MAX_EVENTS} events in one batch")
    return batch[1]


def apply_to(ep: EndpointState, tracker: CacheTracker, seq: int, events: Sequence[Any]) -> str | None:
    """Apply a batch to the tracker and its outcome to the endpoint's prefix index."""
    action = tracker.apply(seq, events)
    if action == "clear":
        ep.prefixes.clear()
    ep.prefixes.bound_live(tracker.live_chunks)
    return action


class KvEventFollower:
    """One SUB socket per followed endpoint (``EndpointState.kv_events``), brought in line with the live pools every
    ``RECONCILE_S``; each socket's batches go to its endpoint's index."""

    def __init__(self, pools: Callable[[], Iterable[PoolState]], registry: CollectorRegistry | None = None) -> None:
        self._pools = pools
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        self.batches = Counter(
            "specgate_kv_event_batches",
            "KV event batches received from the pools' servers, by result: applied, clear (a cache reset or a "
            "restart emptied the endpoint's prefix index), gap (batches lost: the live block count is unknown "
            "until the next clear), malformed (skipped).",
            ["pool", "endpoint", "result"],
            registry=registry,
        )

    def _wanted(self) -> dict[tuple[str, str, str], EndpointState]:
        return {(e.pool, e.id, e.kv_events): e for p in self._pools() for e in p.endpoints if e.kv_events}

    def reconcile(self) -> None:
        wanted = self._wanted()
        for key in [k for k in self._tasks if k not in wanted]:
            self._tasks.pop(key).cancel()
        for key, ep in wanted.items():
            task = self._tasks.get(key)
            if task is None or task.done():
                self._tasks[key] = asyncio.create_task(self._follow(ep, key[2]), name=f"specgate-kv-{ep.id}")

    async def run(self) -> None:
        await run_every(self._reconcile_round, lambda: RECONCILE_S, what="KV event follower", log=logger)

    async def _reconcile_round(self) -> None:
        self.reconcile()

    async def _follow(self, ep: EndpointState, address: str) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: an endpoint's publisher is its own
        sock.setsockopt(zmq.LINGER, 0)
        tracker = CacheTracker()
        try:
            sock.connect(address)
            while True:
                frames = await sock.recv_multipart()
                result = "malformed"
                if len(frames) == 3 and len(frames[1]) == 8:
                    seq = int.from_bytes(frames[1], "big")
                    with contextlib.suppress(ValueError):
                        before = tracker.last_seq
                        action = apply_to(ep, tracker, seq, decode(frames[2]))
                        gap = before is not None and seq > before + 1
                        result = action or ("gap" if gap else "applied")
                self.batches.labels(ep.pool, ep.id, result).inc()
        except zmq.ZMQError as exc:
            logger.warning("KV events of %s/%s (%s): %s", ep.pool, ep.id, address, exc)
        finally:
            ep.prefixes.bound_live(None)  # no longer followed: the count is unknown from now on
            sock.close(linger=0)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
