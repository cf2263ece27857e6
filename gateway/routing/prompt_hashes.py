"""Recent prompts and their chunk hashes, so that a prompt that repeats or extends one of them hashes only its new part.

Hashing a rendered prompt (``gateway.fleet.prefix_index.chain_hashes``) costs about 0.2 us per 64-character chunk,
in Python, on every request that prefix affinity or a warm home weighs: the largest part of what affinity adds to
a request. Most prompts start with an earlier prompt of the gateway's: the next turn of a conversation renders to
the previous turn's text followed by the new messages, an agent's next call to its previous call's text, a retried
or repeated request to the same text. The chain hash of a chunk covers that chunk and every one before it, so the
hashes of such a prompt's first chunks are the earlier prompt's: ``PromptHashes`` keeps the latest prompts (their
text and hashes) and hashes only the chunks past the longest one it finds at the start of a new prompt. The result
is always the one ``chain_hashes`` gives for the whole text (the same function, continued from the earlier chain's
last hash); only the time differs.

Finding the earlier prompt: it ended where one of the new prompt's rendered parts ends (a message, its role, its
text: ``gateway.routing.prompt_key.render_parts``), so the ends of the last ``MAX_PROBES`` parts are looked up, the
whole prompt first. A prompt is kept under its length and its last ``CHUNK_CHARS`` characters; a candidate counts
only when the new prompt starts with its whole text (one ``str.startswith``, in C). A large body's prompt, rendered
in a parsing process without its parts, is looked up whole only.

Bounded: at most ``max_prompts`` prompts and ``max_bytes`` of their texts (``sys.getsizeof``: the texts are the
rendered prompts themselves, kept alive; their hashes take about 40 bytes a chunk more); the least recently used
goes first. Per process, event loop only.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from gateway.fleet.prefix_index import CHUNK_CHARS, MAX_PROMPT_CHUNKS, chain_hashes
from gateway.routing.classify import ApiKind
from gateway.routing.prompt_key import render_parts

MAX_PROBES = 24  # part ends looked up for an earlier prompt (a turn with parallel tool calls adds ~5 a call)
MAX_TEXT = CHUNK_CHARS * MAX_PROMPT_CHUNKS  # characters hashed at most (the rest of a prompt is ignored)
DEFAULT_MAX_PROMPTS = 4096
DEFAULT_MAX_BYTES = 8 << 20  # of texts (and about 5 MB of hashes with them, for 1-byte characters)


class PromptHashes:
    """The chunk hashes of rendered prompts, reusing those of a recent prompt the new one starts with (module
    docstring). Not thread-safe."""

    __slots__ = ("_bytes", "_lengths", "_recent", "hits", "max_bytes", "max_prompts", "misses")

    def __init__(self, max_prompts: int = DEFAULT_MAX_PROMPTS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_prompts = max(1, max_prompts)
        self.max_bytes = max(1, max_bytes)
        # (length, last CHUNK_CHARS characters) -> (text, its chunk hashes), least recently used first
        self._recent: OrderedDict[tuple[int, str], tuple[str, tuple[int, ...]]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # kept prompts by length: an end no kept prompt has is not looked up
        self._bytes = 0
        self.hits = 0  # prompts that found an earlier one (whole or a start), cumulative
        self.misses = 0

    def __len__(self) -> int:
        return len(self._recent)

    @property
    def size(self) -> int:
        """Bytes of the kept texts (``sys.getsizeof``)."""
        return self._bytes

    def of_request(self, api: ApiKind, body: Mapping[str, Any]) -> tuple[int, ...]:
        """``prompt_chunks(api, body)``: the chained chunk hashes of the request's rendered prompt."""
        parts = render_parts(api, body)
        return self._hashes("".join(parts), parts)

    def of_text(self, text: str) -> tuple[int, ...]:
        """``chain_hashes(text)`` for a prompt rendered elsewhere (no parts: only the whole text is looked up)."""
        return self._hashes(text, None)

    def _hashes(self, text: str, parts: list[str] | None) -> tuple[int, ...]:
        if len(text) < CHUNK_CHARS:
            return ()
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT]
        recent = self._recent
        key = (len(text), text[-CHUNK_CHARS:])
        got = recent.get(key)
        if got is not None and got[0] == text:  # the same prompt again
            recent.move_to_end(key)
            self.hits += 1
            return got[1]
        earlier = () if parts is None else self._earlier(text, parts)
        if earlier:
            self.hits += 1
            hashes = earlier + chain_hashes(text, len(earlier), earlier[-1])
        else:
            self.misses += 1
            hashes = chain_hashes(text)
        self._keep(key, text, hashes)
        return hashes

    def _earlier(self, text: str, parts: list[str]) -> tuple[int, ...]:
        """The hashes of the longest kept prompt that ``text`` starts with and that ends where one of its last
        ``MAX_PROBES`` parts ends (empty: none)."""
        recent, lengths = self._recent, self._lengths
        ends = list(accumulate(map(len, parts)))
        last = len(text)
        probes = 0
        for end in reversed(ends):
            if end >= last:  # the whole text was looked up; an empty part ends where the one before it does
                continue
            if end < CHUNK_CHARS or probes >= MAX_PROBES:
                break
            last = end
            probes += 1
            if end not in lengths:
                continue
            key = (end, text[end - CHUNK_CHARS : end])
            got = recent.get(key)
            if got is not None and text.startswith(got[0]):
                recent.move_to_end(key)
                return got[1]
        return ()

    def _keep(self, key: tuple[int, str], text: str, hashes: tuple[int, ...]) -> None:
        recent = self._recent
        old = recent.pop(key, None)
        if old is not None:
            self._forget(old[0])
        size = sys.getsizeof(text)
        if size > self.max_bytes:
            return
        recent[key] = (text, hashes)
        self._bytes += size
        self._lengths[len(text)] = self._lengths.get(len(text), 0) + 1
        while len(recent) > self.max_prompts or self._bytes > self.max_bytes:
            _, (gone, _) = recent.popitem(last=False)
            self._forget(gone)

    def _forget(self, text: str) -> None:
        self._bytes -= sys.getsizeof(text)
        n = self._lengths[len(text)] - 1
        if n:
            self._lengths[len(text)] = n
        else:
            del self._lengths[len(text)]

    def clear(self) -> None:
        self._recent.clear()
        self._lengths.clear()
        self._bytes = 0
