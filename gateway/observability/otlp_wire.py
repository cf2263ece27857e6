"""OTLP trace protobuf, written by hand: the bytes of ``Span``, ``KeyValue`` and ``ExportTraceServiceRequest``
(``opentelemetry/proto/trace/v1/trace.proto``, ``collector/trace/v1/trace_service.proto``), what an OTLP/gRPC
receiver reads like any SDK's export.

Why by hand: building the SDK's span objects and then its protobuf messages costs tens of microseconds per span in
the gateway's one thread; these functions join a few byte strings, and an attribute that repeats (the pool, the
class, the model, the route reason) is encoded once and kept in ``Encoder``'s bounded cache. Only the fields the
gateway's spans use are written; a receiver ignores nothing it needs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# Span.kind
INTERNAL = 1
SERVER = 2
CLIENT = 3
# Span.flags: the W3C trace flags in the low byte, and whether the parent is known to be remote, and is
SPAN_FLAGS_HAS_IS_REMOTE = 0x100
SPAN_FLAGS_IS_REMOTE = 0x200
STATUS_ERROR = b"\x7a\x02\x18\x02"  # Span.status (15) = Status{code (3): STATUS_CODE_ERROR (2)}
TIMES = struct.Struct("<BQBQ")  # Span.start_time_unix_nano (7) and end_time_unix_nano (8), fixed64
_DOUBLE = struct.Struct("<d")
_U64 = (1 << 64) - 1
_BYTE = tuple(bytes((i,)) for i in range(0x80))
CACHE_MAX = 4096  # encoded attributes kept for reuse; the cache is emptied when it is full
Value = str | bool | int | float | Sequence[str] | Sequence[float]


def varint(n: int) -> bytes:
    if n < 0:
        n &= _U64  # int64: two's complement, ten bytes
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message) whose one-byte tag is ``tag``."""
    n = len(payload)
    return bytes((tag, n)) + payload if n < 0x80 else bytes((tag,)) + varint(n) + payload


def any_value(v: Value) -> bytes:
    """An ``AnyValue`` message's bytes."""
    if isinstance(v, str):
        return field(0x0A, v.encode())
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)
    return field(0x2A, b"".join(field(0x0A, any_value(x)) for x in v))  # ArrayValue{values (1)}


def key_value(key: str, v: Value) -> bytes:
    """A ``KeyValue`` as a span's ``attributes`` (9) field."""
    return field(0x4A, field(0x0A, key.encode()) + field(0x12, any_value(v)))


class Encoder:
    """Encodes attributes, with a bounded cache of what repeats from request to request: a block of attributes
    whose values are the same for many requests (pool, class, model, plan, status, ...) is encoded once under a key
    of those values (``block``); the few values that differ per request (ids, durations, token counts) are encoded
    each time, on their key's cached prefix (``number``, ``string``)."""

    __slots__ = ("_cache", "_keys", "_pairs")

    def __init__(self) -> None:
        self._cache: dict[object, bytes] = {}
        self._pairs: dict[object, tuple[bytes, bytes]] = {}
        self._keys: dict[str, bytes] = {}

    def block(self, key: tuple[object, ...], items: Callable[..., Iterable[tuple[str, Value]]], *args: Any) -> bytes:
        """The attributes ``items(*args)`` makes, encoded once per distinct ``key`` (which must determine them)."""
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            got = self._cache[key] = b"".join(key_value(k, v) for k, v in items(*args))
        return got

    def pair(
        self, key: tuple[object, ...], span: Callable[..., tuple[str, int, Iterable[tuple[str, Value]]]], *args: Any
    ) -> tuple[bytes, bytes]:
        """A span's name and kind fields, and its attributes: ``span(*args)`` = (name, kind, attributes), encoded
        once per distinct ``key`` (which must determine them)."""
        got = self._pairs.get(key)
        if got is None:
            if len(self._pairs) >= CACHE_MAX:
                self._pairs.clear()
            name, kind, items = span(*args)
            got = self._pairs[key] = (
                field(0x2A, name.encode()) + bytes((0x30, kind)),
                b"".join(key_value(k, v) for k, v in items),
            )
        return got

    def name_kind(self, name: str, kind: int) -> bytes:
        """A span's ``name`` (5) and ``kind`` (6) fields, from the cache when seen before."""
        key = (name, kind)
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            got = self._cache[key] = field(0x2A, name.encode()) + bytes((0x30, kind))
        return got

    def name(self, name: str) -> bytes:
        """A span's ``name`` (5) field, from the cache when seen before."""
        got = self._cache.get(name)
        if got is None:
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            got = self._cache[name] = field(0x2A, name.encode())
        return got

    def _key(self, key: str) -> bytes:
        got = self._keys.get(key)
        if got is None:
            got = self._keys[key] = field(0x0A, key.encode())  # a fixed set of attribute names: never cleared
        return got

    def number(self, key: str, v: int | float) -> bytes:
        """An int or float attribute (``KeyValue`` as a span's ``attributes`` field)."""
        if isinstance(v, float):  # a double is 9 bytes: the whole prefix is fixed per key
            prefix = self._keys.get(key + "\x00d")
            if prefix is None:
                k = self._key(key)
                prefix = self._keys[key + "\x00d"] = bytes((0x4A, len(k) + 11)) + k + b"\x12\x09\x21"
            return prefix + _DOUBLE.pack(v)
        if 0 <= v < 0x80:  # one byte of varint: the prefix is fixed per key too
            prefix = self._keys.get(key + "\x00i")
            if prefix is None:
                k = self._key(key)
                prefix = self._keys[key + "\x00i"] = bytes((0x4A, len(k) + 4)) + k + b"\x12\x02\x18"
            return prefix + _BYTE[v]
        k = self._key(key)
        value = b"\x18" + varint(v)
        body = k + bytes((0x12, len(value))) + value
        return bytes((0x4A, len(body))) + body if len(body) < 0x80 else b"\x4a" + varint(len(body)) + body

    def string(self, key: str, v: str) -> bytes:
        """A string attribute that differs per request (an id)."""
        body = self._key(key) + field(0x12, field(0x0A, v.encode()))
        return bytes((0x4A, len(body))) + body if len(body) < 0x80 else b"\x4a" + varint(len(body)) + body


def span_field(body: bytes) -> bytes:
    """A ``Span`` message's bytes (``body``) as a ``ScopeSpans.spans`` (2) field."""
    n = len(body)
    if n < 0x80:
        return bytes((0x12, n)) + body
    if n < 0x4000:
        return bytes((0x12, (n & 0x7F) | 0x80, n >> 7)) + body
    return b"\x12" + varint(n) + body


def span_flags(flags: int, error: bool) -> bytes:
    """A span's ``status`` (15, only when it failed) and ``flags`` (16) fields."""
    return (STATUS_ERROR if error else b"") + b"\x85\x01" + struct.pack("<I", flags)


def span(
    trace_id: bytes,
    span_id: bytes,
    parent_id: bytes | None,
    name: bytes,
    kind: int,
    start_ns: int,
    end_ns: int,
    attributes: bytes,
    *,
    error: bool = False,
    trace_state: bytes = b"",
    flags: int = 1,
) -> bytes:
    """One ``Span`` message as a ``ScopeSpans.spans`` (2) field. ``name``: the encoded name field (``field(0x2A,
    name)``, cached by the caller); ``attributes``: the joined ``key_value`` fields."""
    parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id]
    if trace_state:
        parts.append(field(0x1A, trace_state))
    if parent_id is not None:
        parts += (b"\x22\x08", parent_id)
    parts += (name, b"\x30", bytes((kind,)), TIMES.pack(0x39, start_ns, 0x41, end_ns), attributes)
    if error:
        parts.append(STATUS_ERROR)
    parts += (b"\x85\x01", struct.pack("<I", flags))  # Span.flags (16), fixed32
    body = b"".join(parts)
    return b"\x12" + varint(len(body)) + body


def request(resource_and_scope: tuple[bytes, bytes], spans: Sequence[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of ``spans`` (``span`` results) under one resource and scope:
    ``resource_and_scope`` = (the encoded ``Resource`` field of ``ResourceSpans``, the encoded ``scope`` field of
    ``ScopeSpans``), made once by ``resource_fields``."""
    resource, scope = resource_and_scope
    scope_spans = scope + b"".join(spans)
    resource_spans = resource + b"\x12" + varint(len(scope_spans)) + scope_spans
    return b"\x0a" + varint(len(resource_spans)) + resource_spans


def resource_fields(attributes: Sequence[tuple[str, str]], scope_name: str, scope_version: str) -> tuple[bytes, bytes]:
    """The fixed parts of every export: ``ResourceSpans.resource`` (1) and ``ScopeSpans.scope`` (1)."""
    res = b"".join(field(0x0A, field(0x0A, k.encode()) + field(0x12, any_value(v))) for k, v in attributes)
    scope = field(0x0A, scope_name.encode()) + field(0x12, scope_version.encode())
    return field(0x0A, res), field(0x0A, scope)
