"""The tap on a speculative pool's response that reads its per-request acceptance (``SpecSample``).

vLLM (``--per-request-spec-decode-metrics summary|detailed``) puts ``"metrics": {"speculative_decoding": {...}}``
at the top level of a whole response (null when n > 1), and in a stream only on the final usage chunk
(``choices: []``), which is sent only when ``stream_options.include_usage`` is true. To read it from streams
whose client did not ask for usage, the gateway asks for it upstream (``with_include_usage``) and ``StreamTap``
removes the extra chunk again, so the client sees what it would have seen without the gateway.

Cost on the hot path: nothing for standard pools; for speculative pools one substring search per stream event,
and a JSON parse only of the final usage chunk (and of a whole body that carries the metrics).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.observability.acceptance import SpecSample, sample_from_metrics
from gateway.proxy.wire import is_done_event


def sample_from_body(body: bytes) -> SpecSample | None:
    """A whole (non-streaming) response body; parsed only when it carries the spec-decode metrics."""
    if b'"speculative_decoding"' not in body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return sample_from_metrics(data.get("metrics")) if isinstance(data, dict) else None


_CACHED_TOKENS = re.compile(rb'"cached_tokens" ?: ?(\d{1,12})')


def cached_tokens_of(body: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (chat, completions) or ``usage.input_tokens_details
    .cached_tokens`` (Responses) of a whole response body, found by one search (no parse); None when absent."""
    m = _CACHED_TOKENS.search(body)
    return int(m.group(1)) if m is not None else None


def _usage_cached(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def with_include_usage(
    body: Mapping[str, Any], dumps: Callable[[Mapping[str, Any]], bytes] = orjson.dumps
) -> bytes | None:
    """The request body re-serialised with ``stream_options.include_usage`` on; None when it needs no change.

    None also when the client asked for usage itself (it keeps its usage chunk) or ``stream_options`` is not an
    object (the pool answers that as the client's error). ``continuous_usage_stats`` only takes effect with
    ``include_usage``, so a client that set it without usage gets it turned off, to see no usage on any chunk.
    """
    opts = body.get("stream_options")
    if opts is None:
        new: dict[str, Any] = {"include_usage": True}
    elif isinstance(opts, dict):
        if opts.get("include_usage"):
            return None
        new = {**opts, "include_usage": True}
        if opts.get("continuous_usage_stats"):
            new["continuous_usage_stats"] = False
    else:
        return None
    return dumps({**body, "stream_options": new})


def _event_json(event: bytes) -> Any:
    if not event.startswith(b"data:"):
        return None
    try:
        return orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return None


_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
_FINISHED = (b'"finish_reason":"', b'"finish_reason": "')
# Found iff one of the four markers above is in an event: one scan that most token events fail, instead of four.
_ANY_MARKER = re.compile(rb'"(?:choices": ?\[\]|finish_reason": ?")')


def _is_usage_candidate(event: bytes) -> bool:
    return _EMPTY_CHOICES[0] in event or _EMPTY_CHOICES[1] in event


def _has_finish_reason(event: bytes) -> bool:
    return _FINISHED[0] in event or _FINISHED[1] in event


class StreamTap:
    """Watches the events of a stream from a speculative pool for the final usage chunk.

    It records the chunk's spec-decode metrics in ``sample`` and its cached prompt tokens in ``cached_tokens``.
    With ``strip`` (the gateway asked for the usage chunk, the client did not) the chunk — the event with
    ``"choices":[]`` and ``usage`` right before ``[DONE]`` — is held back and dropped once ``[DONE]`` follows.
    vLLM moves ``system_fingerprint`` from the last token chunk to the usage chunk when usage is on, so while
    stripping the chunk that carries a ``finish_reason`` is held until the next event, and gets the fingerprint
    back if the usage chunk carried one. Every other event passes unchanged, in order.
    """

    __slots__ = ("_held_finish", "_held_usage", "cached_tokens", "sample", "strip")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.sample: SpecSample | None = None
        self.cached_tokens: int | None = None
        self._held_finish: bytes | None = None
        self._held_usage: bytes | None = None

    def feed(self, events: list[bytes]) -> list[bytes]:
        """The events to send now, from the whole events of one read."""
        if not self.strip:
            for event in events:
                if _is_usage_candidate(event):
                    self._observe_usage(event)
            return events
        out: list[bytes] = []
        marked = _ANY_MARKER.search
        for event in events:
            if self._held_usage is None and self._held_finish is None and marked(event) is None:
                out.append(event)  # the usual token event: nothing held, nothing to hold
                continue
            if self._held_usage is not None:
                usage, self._held_usage = self._held_usage, None
                if is_done_event(event):  # the extra chunk, right before [DONE]: dropped
                    self._release_finish(out)
                    out.append(event)
                    continue
                self._release_finish(out)
                out.append(usage)
            if _is_usage_candidate(event):
                data = self._observe_usage(event)
                if data is not None:
                    fingerprint = data.get("system_fingerprint")
                    if isinstance(fingerprint, str) and self._held_finish is not None:
                        self._held_finish = _with_fingerprint(self._held_finish, fingerprint)
                    self._held_usage = event
                    continue
            self._release_finish(out)
            if _has_finish_reason(event):
                self._held_finish = event
            else:
                out.append(event)
        return out

    def flush(self) -> list[bytes]:
        """The stream ended without [DONE]: whatever is held goes out as it came."""
        out: list[bytes] = []
        self._release_finish(out)
        if self._held_usage is not None:
            out.append(self._held_usage)
            self._held_usage = None
        return out

    def _release_finish(self, out: list[bytes]) -> None:
        if self._held_finish is not None:
            out.append(self._held_finish)
            self._held_finish = None

    def _observe_usage(self, event: bytes) -> dict[str, Any] | None:
        """The parsed usage chunk (``choices: []`` and a ``usage`` key), its metrics recorded; else None."""
        data = _event_json(event)
        if not isinstance(data, dict) or data.get("choices") != [] or "usage" not in data:
            return None
        sample = sample_from_metrics(data.get("metrics"))
        if sample is not None:
            self.sample = sample
        self.cached_tokens = _usage_cached(data.get("usage"))
        return data


def _with_fingerprint(event: bytes, fingerprint: str) -> bytes:
    """The token chunk with ``system_fingerprint`` where vLLM puts it (before ``kv_transfer_params``)."""
    data = _event_json(event)
    if not isinstance(data, dict) or "system_fingerprint" in data:
        return event
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "kv_transfer_params":
            out["system_fingerprint"] = fingerprint
        out[key] = value
    out.setdefault("system_fingerprint", fingerprint)
    return b"data: " + orjson.dumps(out) + b"\n\n"
