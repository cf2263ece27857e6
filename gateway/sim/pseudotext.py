"""Deterministic pseudo-text for simulated answers: ``request_seed`` (a stable seed from a model and request body)
and ``pseudo_tokens`` (word pieces drawn from a fixed vocabulary, with sentence punctuation).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

# --------------------------------------------------------------------------------------------------------------
# Pseudo-text: deterministic word pieces


_WORD_TEXT = (
    "the model of a system that can run on every request and its tokens in the batch while the draft "
    "proposes several tokens at once so the target verifies them in one step which is faster when the "
    "batch is small but slower when the server is saturated because each step then carries more work we "
    "measure latency throughput acceptance and the cost of every kernel under load with careful "
    "experiments across many settings where results depend on temperature and on the kind of task "
)
_WORDS = tuple(_WORD_TEXT.split())
_SPLIT: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "proposes": ("pro", "poses"),
        "verifies": ("ver", "ifies"),
        "saturated": ("satur", "ated"),
        "throughput": ("through", "put"),
        "acceptance": ("accept", "ance"),
        "experiments": ("experi", "ments"),
        "temperature": ("temper", "ature"),
        "settings": ("set", "tings"),
    }
)


def request_seed(model: str, body: dict[str, Any]) -> int:
    """A seed derived from what determines the answer: model, messages / prompt, tools, format, ``seed``."""
    key = [
        model,
        body.get("messages"),
        body.get("prompt"),
        body.get("tools"),
        body.get("response_format"),
        body.get("seed"),
    ]
    digest = hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS, default=str)).digest()
    return int.from_bytes(digest[:8], "big")


def pseudo_tokens(seed: int, n: int) -> list[str]:
    """``n`` tokens of deterministic pseudo-text (a token is one word piece, with its leading space)."""
    rng = random.Random(seed)
    out: list[str] = []
    capital = True
    since_period = 0
    while len(out) < n:
        if since_period > 6 and rng.random() < 0.15:
            out.append(".")
            capital, since_period = True, 0
            continue
        if since_period > 2 and rng.random() < 0.06:
            out.append(",")
            continue
        word = rng.choice(_WORDS)
        pieces = _SPLIT.get(word, (word,))
        first = pieces[0].capitalize() if capital else pieces[0]
        out.append(("" if not out else " ") + first)
        out.extend(pieces[1:])
        capital = False
        since_period += 1
    return out[:n]
