"""vLLM's automatic prefix caching, as bookkeeping: block hashes chained over token ids, reference counts, and
least-recently-used eviction of the cached blocks no running sequence holds (pure; the engine owns the memory).

Hashing is vLLM's default (``--prefix-caching-hash-algo sha256``): a block's hash is the SHA-256 of the pickle
(protocol 5) of ``(parent hash, tuple of the block's token ids, None)``, the first block's parent being
``NONE_HASH``. Here that seed is fixed (the SHA-256 of the pickled string ``"vllm-none-hash"``) so runs repeat;
vLLM draws a random one per process when ``PYTHONHASHSEED`` is unset and hashes its value when set. Only full
blocks are hashed, so a block's hash names the whole prefix up to its end: change one early token and every later
block's hash changes. KV events carry the low 64 bits of a hash as an unsigned integer (``external_hash``), as
vLLM does by default.

``PrefixCache`` holds every cached block's reference count (how many running sequences use it). A block nobody
holds stays cached in free KV memory, in ``free`` order (least recently used first); the engine calls
``evict(free_blocks)`` after it allocates, and the oldest such blocks go until they fit in the free memory left,
as vLLM's free block queue hands out the least recently freed block first. A sequence releases its blocks deepest
first, so of one chain the tail is evicted before its head. Every change is also recorded as an event
(``Stored``, ``Removed``, ``Cleared``) for the KV event publisher, when ``record_events`` is on.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

NONE_HASH = bytes.fromhex("066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198")
_PROTOCOL = 5
_LOW_64 = (1 << 64) - 1


def block_hash(parent: bytes | None, ids: Sequence[int]) -> bytes:
    """The hash of one full block: SHA-256 of the pickled ``(parent or NONE_HASH, tuple(ids), None)``."""
    raw = pickle.dumps((parent or NONE_HASH, tuple(ids), None), protocol=_PROTOCOL)
    return hashlib.sha256(raw).digest()


def chain_hashes(
    ids: Sequence[int], block_size: int, *, start_block: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """The hashes of the full blocks of ``ids`` from block ``start_block`` on, chained from ``parent`` (the hash
    of block ``start_block - 1``; None for the first block)."""
    out: list[bytes] = []
    for i in range(start_block, len(ids) // block_size):
        parent = block_hash(parent, ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def external_hash(h: bytes) -> int:
    """A block hash as KV events carry it: the low 64 bits, unsigned (vLLM's default integer block hashes)."""
    return int.from_bytes(h, "big") & _LOW_64


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks newly cached, in chain order: ``parent`` is the hash of the block before the first (None at the
    start of a prompt); ``token_ids`` are the blocks' tokens, ``block_size`` each."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """One cached block evicted."""

    hash: bytes


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every cached block dropped."""


Event = Stored | Removed | Cleared


class PrefixCache:
    """The cached blocks of one engine: reference counts, the free ones in LRU order, and the events."""

    def __init__(self, block_size: int, *, record_events: bool = False) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.record_events = record_events
        self._refs: dict[bytes, int] = {}
        self._free: OrderedDict[bytes, None] = OrderedDict()  # ref 0, least recently used first
        self.events: list[Event] = []

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, h: bytes) -> bool:
        return h in self._refs

    @property
    def free(self) -> int:
        """Cached blocks that no sequence holds (they sit in free KV memory)."""
        return len(self._free)

    def refs(self, h: bytes) -> int:
        return self._refs.get(h, 0)

    def lru_order(self) -> list[bytes]:
        """The free cached blocks, next to be evicted first."""
        return list(self._free)

    def match(self, hashes: Sequence[bytes], max_blocks: int) -> tuple[int, int]:
        """The longest cached prefix of ``hashes`` (at most ``max_blocks``): (blocks, how many of them are free)."""
        n = from_free = 0
        refs = self._refs
        for h in hashes[: max(0, max_blocks)]:
            r = refs.get(h)
            if r is None:
                break
            n += 1
            if r == 0:
                from_free += 1
        return n, from_free

    def acquire(self, hashes: Sequence[bytes]) -> int:
        """A sequence holds these cached blocks (every one must be cached). Returns how many left free memory."""
        taken = 0
        refs, free = self._refs, self._free
        for h in hashes:
            r = refs[h]
            if r == 0:
                del free[h]
                taken += 1
            refs[h] = r + 1
        return taken

    def release(self, hashes: Sequence[bytes]) -> int:
        """A sequence lets go of these blocks (deepest first into the LRU order). Returns how many became free."""
        freed = 0
        refs, free = self._refs, self._free
        for h in reversed(hashes):
            r = refs.get(h)
            if r is None or r == 0:
                continue
            refs[h] = r - 1
            if r == 1:
                free[h] = None
                freed += 1
        return freed

    def adopt(self, hashes: Sequence[bytes], ids: Sequence[int], first_block: int, parent: bytes | None) -> int:
        """A sequence's own computed blocks ``first_block …`` (hashes ``hashes``, the first one's parent
        ``parent``; ``ids`` the sequence's tokens from its start) become cached blocks it holds. A block already
        cached (computed twice) is shared instead and the sequence's copy is dropped. Returns how many of the
        sequence's blocks so return to free memory (the copies of blocks other sequences hold; a copy of a free
        cached block just takes that block's place)."""
        refs, free = self._refs, self._free
        freed = 0
        run: list[bytes] = []
        run_start, run_parent = first_block, parent
        prev = parent
        for j, h in enumerate(hashes):
            r = refs.get(h)
            if r is None:
                if not run:
                    run_start, run_parent = first_block + j, prev
                run.append(h)
                refs[h] = 1
            else:
                self._stored(run, run_start, run_parent, ids)
                run = []
                if r == 0:
                    del free[h]
                else:
                    freed += 1
                refs[h] = r + 1
            prev = h
        self._stored(run, run_start, run_parent, ids)
        return freed

    def _stored(self, run: list[bytes], start: int, parent: bytes | None, ids: Sequence[int]) -> None:
        if not run or not self.record_events:
            return
        bs = self.block_size
        tokens = tuple(ids[start * bs : (start + len(run)) * bs])
        self.events.append(Stored(tuple(run), parent, tokens, bs))

    def evict(self, free_blocks: int) -> int:
        """Evict least recently used free cached blocks until at most ``free_blocks`` remain. Returns how many."""
        free, refs = self._free, self._refs
        n = 0
        while len(free) > max(0, free_blocks):
            h, _ = free.popitem(last=False)
            del refs[h]
            n += 1
            if self.record_events:
                self.events.append(Removed(h))
        return n

    def clear(self) -> bool:
        """Drop every cached block (vLLM's reset_prefix_cache); refused (False) while a sequence holds one."""
        if len(self._free) != len(self._refs):
            return False
        self._refs.clear()
        self._free.clear()
        if self.record_events:
            self.events.append(Cleared())
        return True

    def drop_all(self) -> None:
        """The engine stopped: forget everything, held or not."""
        had = bool(self._refs)
        self._refs.clear()
        self._free.clear()
        if had and self.record_events:
            self.events.append(Cleared())

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events
