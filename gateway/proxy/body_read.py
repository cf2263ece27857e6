"""A POST's JSON body, parsed and checked: on the event loop when small, in a parsing process when large.

A body up to ``LARGE_BODY_BYTES`` with at most ``MANY_BRACKETS`` brackets is parsed here, its arrays and objects
counted and its depth checked (``gateway.proxy.json_depth``): about 10 ms at most. A larger one goes to the
parsing processes (``gateway.runtime.parse_pool``), which send back a ``BodyView`` (``gateway.proxy.body_view``):
its top-level members with stand-ins for the bulky ones, and what the gateway reads of the rest. The event loop
never builds the large body's objects, so a concurrent request does not wait for them. With ``--parse-workers 0``
a large body is parsed here too, in steps with the loop's other work let through between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from gateway.config.settings import Settings
from gateway.fleet.pools import PoolState
from gateway.proxy.body_view import BodyView, Refusal, ViewRequest, summarize
from gateway.proxy.http import parse_object
from gateway.proxy.json_depth import bracket_count, check_json_containers, check_json_depth, check_json_text
from gateway.routing.classify import ApiKind
from gateway.runtime.parse_pool import ParsePool

# Bodies longer than this, or with more brackets, are parsed off the event loop. Tiny containers are what take
# orjson long: 8 MiB of tiny messages parse in about 100 ms, 1 MiB of empty arrays nested 120 deep in 150-300 ms,
# 50,000 brackets of them in about 10 ms.
LARGE_BODY_BYTES = 1 << 20
MANY_BRACKETS = 50_000


async def _let_others_run() -> None:
    """Two turns of the event loop: requests that arrived meanwhile are read (the first) and run (the second)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def read_json(
    raw: bytes,
    settings: Settings,
    pool: ParsePool | None,
    api: ApiKind | None,
    *,
    scan_chars: int,
    fingerprint: tuple[str, str] | None,
    pools: Mapping[str, PoolState],
) -> tuple[dict[str, Any], BodyView | None]:
    """The body parsed (a JSON object, checked), and its view when it was parsed elsewhere (then the dict is the
    view's ``head``: stand-ins for the bulky members, to be read through the view). ``fingerprint`` (method, path):
    the view carries the Idempotency-Key fingerprint; it carries the rendered prompt when one of ``pools`` picks
    endpoints by prefix affinity."""
    brackets = bracket_count(raw)
    if len(raw) <= LARGE_BODY_BYTES and brackets <= MANY_BRACKETS:
        body = parse_object(raw)
        check_json_text(raw, settings.max_json_depth, settings.max_json_containers, brackets)
        return body, None
    if pool is None:
        check_json_containers(raw, settings.max_json_containers)
        await _let_others_run()
        body = parse_object(raw)
        await _let_others_run()
        check_json_depth(raw, settings.max_json_depth)
        await _let_others_run()
        return body, None
    prompt = api is not None and _affinity_wanted(pools)
    req = ViewRequest(api, settings.max_json_depth, settings.max_json_containers, scan_chars, fingerprint, prompt)
    got = await pool.run(summarize, raw, req)
    if isinstance(got, Refusal):
        raise got.error()
    return got.head, got


def _affinity_wanted(pools: Mapping[str, PoolState]) -> bool:
    """Some pool keeps a prefix index (a large body's prompt is then rendered with it): for its endpoint pick, or
    for the warm homes of controlled classes, which hash prompts with one endpoint per pool too."""
    return any(p.affinity.enabled for p in pools.values())
