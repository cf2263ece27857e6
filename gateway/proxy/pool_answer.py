"""What a pool's answer means before the commit point: an answer to relay, or a failed attempt.

Statuses that another pool may answer better are attempt failures (``gateway.routing.attempts``): 429 and 5xx,
with a 429 or a queue-full 503 marked as back-pressure (``gateway.routing.overload``), and 401/403, which say that
the gateway's own key for the pool is refused (the client's key never reaches a pool). Everything else is the answer.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.errors import UpstreamError
from gateway.fleet.pools import PoolState
from gateway.fleet.upstream import UpstreamResponse
from gateway.routing.attempts import CREDENTIAL_STATUS, RETRYABLE_STATUS, PoolStatusError, describe_status
from gateway.routing.overload import busy_status

logger = logging.getLogger("specgate.forward")

# The error body of a failed attempt is small; a pool that stalls on it is not waited for longer than this.
ERROR_BODY_WAIT_S = 0.5


async def check_status(pool: PoolState, resp: UpstreamResponse) -> None:
    """Raise ``PoolStatusError`` when ``resp``'s status is a failed attempt rather than the answer."""
    if resp.status in CREDENTIAL_STATUS:
        logger.error("pool %s refused the gateway's credentials (HTTP %d): check api_key_env", pool.name, resp.status)
        raise PoolStatusError(resp.status, f"pool {pool.name} refused the gateway's credentials (HTTP {resp.status})")
    if resp.status in RETRYABLE_STATUS:
        try:
            async with asyncio.timeout(ERROR_BODY_WAIT_S):
                raw = await resp.read()
        except (UpstreamError, TimeoutError):
            raw = b""
        text = describe_status(resp.status, raw)
        busy = busy_status(resp.status, text, "retry-after" in resp.raw.headers)
        raise PoolStatusError(resp.status, text, busy=busy)
