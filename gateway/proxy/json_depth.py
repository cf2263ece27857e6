"""How deeply a request body nests its arrays and objects, read from its raw bytes in a few passes that run in C.

The gateway re-serialises request bodies (the idempotency fingerprint, the usage option of a stream to a
speculative pool, a fallback model), and orjson writes only about 254 levels of the 1024 it reads, so bodies
nested deeper than ``--max-json-depth`` are refused. Walking the parsed object in Python costs about a
microsecond per array or object: 280 ms for a legal 8 MiB chat body of 230k tiny messages, all of it on the event
loop. ``check_json_depth`` reads the depth from the text instead, with bytes methods only (count, replace,
translate, split), each one pass over the body; only what is left after peeling the innermost levels is walked
element by element. Linear in the body's size for every input.

It reads text that orjson has already accepted as JSON (so brackets are balanced and strings well formed):

1. without backslashes the escapes are gone: ``\\\\`` pairs first (an escaped backslash), then ``\\"`` (an escaped
   quote); what stays of other escapes (``\\n``) is dropped with everything else in step 2;
2. only the brackets and the quotes are kept;
3. strings are dropped: empty ones (now ``""``) by one replace; the few that held brackets by a split on the quote;
4. ``{}`` become ``[]``, and the innermost pairs are peeled (``[]`` replaced by nothing) a few times: each pass
   takes one level off every branch; the rest, if any, is counted with a running sum.
"""

from __future__ import annotations

from array import array
from itertools import accumulate

from gateway.errors import InvalidJSON

_STRUCTURE = b'[]{}"'
_DROP = bytes(b for b in range(256) if b not in _STRUCTURE)  # translate's delete: all but brackets and quotes
_FOLD = bytes.maketrans(b"{}", b"[]")
_STEPS = bytes.maketrans(b"[]", b"\x01\xff")  # +1 / -1 as signed bytes
_PEELS = 4  # innermost levels taken off by replace before the running sum


def _brackets(raw: bytes) -> bytes:
    """The brackets of ``raw`` outside its strings, ``{}`` folded into ``[]`` (steps 1 to 3 and the fold)."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = raw.translate(None, _DROP).replace(b'""', b"")
    if b'"' in s:  # strings holding brackets: between the quotes, every other piece is inside a string
        s = b"".join(s.split(b'"')[::2])
    return s.translate(_FOLD)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw``, valid JSON text (a bare scalar: 0)."""
    s = _brackets(raw)
    depth = 0
    while s and depth < _PEELS:
        s = s.replace(b"[]", b"")
        depth += 1
    if s:
        depth += max(accumulate(array("b", s.translate(_STEPS))))
    return depth


def check_json_depth(raw: bytes, limit: int) -> None:
    """Raise 400 ``invalid_json`` when ``raw`` (a body orjson has parsed) nests deeper than ``limit``. A body with
    no more brackets than ``limit`` (most bodies) is decided by two counts."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    if json_depth(raw) > limit:
        raise InvalidJSON(f"request body nests arrays and objects deeper than {limit} levels")


def bracket_count(raw: bytes) -> int:
    """The ``{`` and ``[`` in ``raw``, strings included: at least its number of arrays and objects."""
    return raw.count(b"{") + raw.count(b"[")


def check_json_text(raw: bytes, max_depth: int, max_containers: int, n: int) -> None:
    """``check_json_containers`` and ``check_json_depth`` of a body orjson has parsed, ``n`` its
    ``bracket_count``."""
    if n > max_containers and _brackets(raw).count(b"[") > max_containers:
        raise InvalidJSON(f"request body holds more than {max_containers} arrays and objects")
    if n > max_depth and json_depth(raw) > max_depth:
        raise InvalidJSON(f"request body nests arrays and objects deeper than {max_depth} levels")


def check_json_containers(raw: bytes, limit: int) -> None:
    """Raise 400 ``invalid_json`` when ``raw`` holds more than ``limit`` arrays and objects. Checked on the text
    before it is parsed: parsing millions of tiny containers takes orjson about a second for 8 MiB. Two counts
    decide most bodies (brackets inside strings count too, so the count can only be too high); past ``limit`` the
    brackets outside strings are counted. Text that is not JSON may be counted wrongly, and is refused either way."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    if _brackets(raw).count(b"[") > limit:
        raise InvalidJSON(f"request body holds more than {limit} arrays and objects")
