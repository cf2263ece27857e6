"""Usage and spec-decode acceptance read from a response body that Envoy streams to the picker.

Only asked for where it carries something (a speculative pool's answer: ``Exchange`` turns the response body phase
on for it with a ``mode_override``), and bounded: a whole (non-streaming) body is kept up to ``limit`` bytes and
parsed once at its end; in a stream each complete SSE event is looked at as in proxy mode (``StreamTap``: one
substring search per event, a JSON parse only of the final usage chunk), and only the unfinished last event is
held, up to ``limit`` bytes. Past the bound the reader stops looking; the bytes still pass through Envoy.
"""

from __future__ import annotations

from gateway.observability.acceptance import SpecSample
from gateway.proxy.stream_tap import StreamTap, cached_tokens_of, sample_from_body

_EVENT_END = b"\n\n"


class UsageReader:
    """Reads one response body, chunk by chunk: ``sample`` (spec decode) and ``cached_tokens`` once known."""

    __slots__ = ("_held", "_parts", "_size", "_tap", "cached_tokens", "gave_up", "limit", "sample", "stream")

    def __init__(self, stream: bool, limit: int) -> None:
        self.stream, self.limit = stream, limit
        self.sample: SpecSample | None = None
        self.cached_tokens: int | None = None
        self.gave_up = False  # the bound was reached: nothing more is read
        self._tap = StreamTap(strip=False) if stream else None
        self._parts: list[bytes] = []
        self._held = b""
        self._size = 0

    def feed(self, chunk: bytes, end: bool) -> None:
        if self.gave_up:
            return
        if self._tap is not None:
            self._feed_events(chunk, end)
            return
        self._size += len(chunk)
        if self._size > self.limit:
            self._give_up()
            return
        self._parts.append(chunk)
        if end:
            body = b"".join(self._parts)
            self._parts = []
            self.sample = sample_from_body(body)
            self.cached_tokens = cached_tokens_of(body)

    def _feed_events(self, chunk: bytes, end: bool) -> None:
        assert self._tap is not None
        data = self._held + chunk if self._held else chunk
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            complete, rest = b"", data
        else:
            complete, rest = data[: cut + 2], data[cut + 2 :]
        if complete:
            self._tap.feed([e + _EVENT_END for e in complete.split(_EVENT_END) if e.strip()])
        if end and rest.strip():
            self._tap.feed([rest])
            rest = b""
        if len(rest) > self.limit:
            self._give_up()
            return
        self._held = rest
        self.sample, self.cached_tokens = self._tap.sample, self._tap.cached_tokens

    def _give_up(self) -> None:
        self.gave_up = True
        self._parts, self._held = [], b""
