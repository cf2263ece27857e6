"""KV cache events over ZMQ, as vLLM 0.33 publishes them (``--kv-events-config``).

The config is vLLM's ``KVEventsConfig`` as JSON: ``enable_kv_cache_events``, ``publisher`` (``"zmq"`` or
``"null"``; by default ``"zmq"`` when events are enabled), ``endpoint`` (``tcp://*:5557``), ``replay_endpoint``
(none), ``buffer_steps`` (10,000), ``hwm`` (100,000), ``max_queue_size`` (100,000), ``topic`` (``""``). Other keys
are refused, as vLLM refuses them.

Wire format (msgpack, as msgspec encodes vLLM's structs):

- one message per engine step that changed the cache: three frames, the topic (UTF-8), the sequence number
  (8 bytes, big-endian, from 0) and the payload;
- the payload is a ``KVEventBatch`` encoded as an ARRAY ``[ts, events, data_parallel_rank]`` (``ts``: Unix time as a
  float; ``data_parallel_rank``: 0);
- each event is a MAP tagged by its class name under ``"type"``, fields in declaration order, fields with a default
  left out while they hold it: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name`` always; then ``extra_keys`` — one nil per block —
  and ``group_idx`` 0; ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ``locality``, ``ownership``,
  ``session_id`` and ``lookahead_token_ids`` stay at their default and are left out), ``BlockRemoved``
  (``block_hashes`` — one hash per event —, ``medium``, then ``group_idx`` 0; ``locality`` and ``ownership``
  left out) and ``AllBlocksCleared`` (no field). Block hashes are unsigned 64-bit integers, ``medium`` is
  ``"GPU"``.

Bind or connect: an endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to
(as vLLM does). The replay socket (a ROUTER, bound) answers a request ``[identity, "", start seq (8 bytes,
big-endian)]`` with every buffered batch from that number on, each as ``[identity, "", topic, seq, payload]``, then
``[identity, "", "", -1 (8 bytes, signed), ""]``; it keeps the last ``buffer_steps`` batches.

A thread owns the sockets; the engine hands it batches through a bounded queue (a full queue drops the batch and
counts it, where vLLM would block its engine).
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

from gateway.sim.prefix_cache import Cleared, Event, Removed, Stored, external_hash

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --------------------------------------------------------------------------------------------------------------
# The structs, field for field as vLLM 0.33 declares them (their order and defaults are the wire format)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's events: encoded as an array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map tagged with the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: Event) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """A prefix-cache event as vLLM reports it."""
    if isinstance(event, Stored):
        return BlockStored(
            block_hashes=[external_hash(h) for h in event.hashes],
            parent_block_hash=None if event.parent is None else external_hash(event.parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
            extra_keys=[None] * len(event.hashes),
            group_idx=0,
        )
    if isinstance(event, Removed):
        return BlockRemoved(block_hashes=[external_hash(event.hash)], medium=MEDIUM_GPU, group_idx=0)
    assert isinstance(event, Cleared)
    return AllBlocksCleared()


def encode_batch(events: Sequence[Event], ts: float, data_parallel_rank: int = 0) -> bytes:
    return msgspec.msgpack.encode(
        KVEventBatch(ts=ts, events=[to_wire(e) for e in events], data_parallel_rank=data_parallel_rank)
    )


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into structs (for subscribers and tests)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


# --------------------------------------------------------------------------------------------------------------
# --kv-events-config


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVEventsConfig:
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise ValueError(f"kv_events_config: unknown key {key!r} (vLLM rejects extra fields)")
        cfg = cls(**raw)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be a boolean")
        if cfg.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null' (got {cfg.publisher!r})")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        if cfg.replay_endpoint is not None and not isinstance(cfg.replay_endpoint, str):
            raise ValueError("kv_events_config.replay_endpoint must be a string")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1")
        return cfg


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# --------------------------------------------------------------------------------------------------------------
# The publisher


class KVEventPublisher:
    """vLLM's ZMQ publisher: a PUB socket, an optional ROUTER for replays, a thread that owns both."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[tuple[float, list[Event]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.published = 0
        self.dropped = 0

    def start(self) -> None:
        """Open the sockets (errors surface here) and start the thread."""
        if self._thread is not None:
            return
        cfg = self.config
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (cfg.buffer_steps + 1))
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {cfg.endpoint} / {cfg.replay_endpoint}: {e}") from e
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """One engine step's events (called on the engine's loop: never blocks)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _run(self) -> None:
        pub, replay = self._pub, self._replay
        assert pub is not None
        seq = 0
        while True:
            if replay is not None and replay.poll(0):
                self._serve_replay(replay)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = encode_batch(events, ts)
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1
            self.published += 1

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
