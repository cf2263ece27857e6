"""What prompt prefixes the gateway sent to one endpoint: an approximate picture of its vLLM prefix cache.

vLLM keeps the KV blocks of recent prompts (16 tokens each, identified by a hash chain over their tokens) and skips
the prefill of the cached blocks at the start of a new prompt. The gateway does not tokenize, so it approximates:

- ``chain_hashes`` cuts the rendered prompt (``gateway.routing.prompt_key``) into chunks of ``CHUNK_CHARS``
  characters (about 16 tokens at 4 characters a token, one vLLM block) and hashes them in a chain, each hash
  covering its chunk and every chunk before it. A prompt that extends an earlier one (the next turn of a
  conversation) shares the earlier one's chunk hashes; a prompt that differs anywhere differs from there on. Only
  whole chunks count; at most ``MAX_PROMPT_CHUNKS`` from the start are hashed.
- The hash is Python's own (a tuple of the parent hash and the chunk's text): about 5x cheaper than blake2b on
  the hot path, and salted per process, which suits an index that lives in one process.
- ``PrefixIndex`` holds one endpoint's chunk hashes in least-recently-used order, bounded by a capacity in chunks
  (from the endpoint's scraped ``num_gpu_blocks`` x ``block_size``, a configured default until then, never over
  ``max_index_tokens``). A prompt's chunks are recorded last chunk first, so a prompt's first chunks are always more
  recent than its later ones: eviction eats prefixes from their end, as vLLM's does, and the chunks present for
  a prompt are always a prefix of it. That makes ``match`` a binary search (about 10 lookups for an 8k-token
  prompt).
- The scraped hit counters correct the capacity (``observe_hits``): when the server hits much less than the index
  predicted, its cache holds less than the index thinks (other traffic, answers taking blocks), and the capacity
  shrinks; it grows back while the prediction holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

CHUNK_CHARS = 64  # characters per chunk: ~16 tokens at 4 characters a token, one vLLM block
TOKENS_PER_CHUNK = 16
MAX_PROMPT_CHUNKS = 16384  # a prompt's first 1 MiB of characters (~262k tokens) is hashed, the rest ignored
MIN_SCALE = 0.125  # the measured correction never shrinks an index below this share of its size
MIN_PREDICTED_FOR_CORRECTION = 4096  # predicted hit tokens between two scrapes before the counters correct anything


def chain_hashes(text: str, start: int = 0, parent: int = 0) -> tuple[int, ...]:
    """The chain of chunk hashes of a rendered prompt (whole chunks only, at most ``MAX_PROMPT_CHUNKS``). One
    comprehension, no loop body in Python: it runs on every request of a class with a controller. ``start`` and
    ``parent``: the hashes from chunk ``start`` on, chained to ``parent`` (the hash of chunk ``start - 1``), for a
    prompt whose first ``start`` chunks were hashed before (``gateway.routing.prompt_hashes``)."""
    end = min(len(text) // CHUNK_CHARS, MAX_PROMPT_CHUNKS) * CHUNK_CHARS
    return tuple(
        [(parent := hash((parent, text[i : i + CHUNK_CHARS]))) for i in range(start * CHUNK_CHARS, end, CHUNK_CHARS)]
    )


class PrefixIndex:
    """One endpoint's recently sent prompt chunks, LRU, at most ``capacity`` chunks. Not thread-safe (the event
    loop's)."""

    __slots__ = (
        "_chunks",
        "_last",
        "_since_scrape",
        "base_capacity",
        "live_chunks",
        "max_chunks",
        "predicted_chunks",
        "scale",
        "source",
    )

    def __init__(self, capacity_chunks: int = 16384, max_chunks: int | None = None) -> None:
        self._chunks: OrderedDict[int, None] = OrderedDict()
        self._last: tuple[int, ...] = ()  # the prompt recorded last: its chunks are the most recent, in order
        self.max_chunks = max(1, capacity_chunks if max_chunks is None else max_chunks)
        self.base_capacity = max(1, min(capacity_chunks, self.max_chunks))
        self.source = "default"  # where base_capacity comes from: default | scraped
        self.scale = 1.0  # the measured correction (MIN_SCALE..1)
        self.predicted_chunks = 0  # warm chunks of every prompt recorded here (the predicted hits), cumulative
        self._since_scrape = 0  # predicted chunks since the last observe_hits
        self.live_chunks: int | None = None  # the server's cached blocks now, from its KV events (None: unknown)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def capacity(self) -> int:
        cap = max(1, int(self.base_capacity * self.scale))
        return cap if self.live_chunks is None else max(1, min(cap, self.live_chunks))

    def match(self, chunks: Sequence[int]) -> int:
        """How many chunks at the start of ``chunks`` are warm here (the present ones are always a prefix)."""
        held = self._chunks
        if not chunks or chunks[0] not in held:
            return 0
        lo, hi = 1, len(chunks)  # chunks[:lo] are present; find the first absent one in [lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if chunks[mid] in held:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def record(self, chunks: Sequence[int]) -> int:
        """The prompt was sent here: its chunks become the most recent (its first chunk last of all). Returns how
        many of them were warm before (the predicted hit, in chunks)."""
        n, last = len(chunks), self._last
        if chunks is last or (n <= len(last) and n and last[n - 1] == chunks[n - 1] and last[:n] == chunks):
            # the start of the prompt recorded last (a repeat): its chunks are the most recent already, in the
            # order the loop below would leave them; nothing moves
            warm = n
        else:
            warm = self.match(chunks)
            held = self._chunks
            # the warm chunks are the first ``warm`` ones (the present ones are a prefix), the rest are new: the new
            # ones enter last first, then the warm ones move to the end last first (the order one loop would leave)
            if warm < n:
                held.update(dict.fromkeys(reversed(chunks[warm:])))
            move = held.move_to_end
            for h in reversed(chunks[:warm]):
                move(h)
            self._last = tuple(chunks)
            if warm < n:
                self._evict()
        self.predicted_chunks += warm
        self._since_scrape += warm
        return warm

    def clear(self) -> None:
        """The server restarted (or reset its cache): nothing is warm any more."""
        self._chunks.clear()
        self._last = ()
        self._since_scrape = 0

    def configure(self, default_chunks: int, max_chunks: int) -> None:
        """The YAML's sizes (at start and on every reload): the default until a scrape sizes it, and the ceiling."""
        self.max_chunks = max(1, max_chunks)
        if self.source == "default":
            self.base_capacity = default_chunks
        self.base_capacity = max(1, min(self.base_capacity, self.max_chunks))
        self._evict()

    def set_capacity(self, chunks: int) -> None:
        """The endpoint's scraped cache size (num_gpu_blocks x block_size, in chunks), within the ceiling."""
        self.base_capacity = max(1, min(chunks, self.max_chunks))
        self.source = "scraped"
        self._evict()

    def bound_live(self, chunks: int | None) -> None:
        """The server's KV events say it holds ``chunks`` chunks' worth of blocks now (None: unknown): the index
        holds no more than that."""
        self.live_chunks = chunks
        if chunks is not None and len(self._chunks) > chunks:
            self._evict()

    def observe_hits(self, measured_hit_tokens: float) -> None:
        """A scrape's increase of the server's prefix-cache hits (tokens) since the last one: shrink the index when
        the server hit less than half of what it predicted, grow it back when it hit most of it."""
        predicted = self._since_scrape * TOKENS_PER_CHUNK
        self._since_scrape = 0
        if predicted < MIN_PREDICTED_FOR_CORRECTION or measured_hit_tokens < 0:
            return
        ratio = measured_hit_tokens / predicted
        if ratio < 0.5:
            self.scale = max(MIN_SCALE, self.scale * 0.75)
            self._evict()
        elif ratio >= 0.8:
            self.scale = min(1.0, self.scale * 1.25)

    def _evict(self) -> None:
        held, cap = self._chunks, self.capacity
        if len(held) <= cap:
            return
        while len(held) > cap:
            held.popitem(last=False)
        if len(held) < len(self._last):  # the last prompt lost chunks: no longer whole at the end
            self._last = ()
