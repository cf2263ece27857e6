"""``RedisStore``: idempotency records shared by every gateway replica, on ``redis.asyncio``.

Record encoding: one Redis **hash** per key (``<prefix><key>``), fields

- ``s``: ``running`` | ``done``
- ``t``: the owner token (kept once done, so that a retried ``complete`` is recognised)
- ``f``: the request fingerprint
- ``r``: the stored response, raw bytes (only once done)

A hash keeps the response binary-safe and unencoded (no base64 inflation, no JSON escaping of a 1 MB SSE
transcript), and lets the scripts touch single fields. Every key carries a TTL (``PEXPIRE``): the lease while
running, ``ttl_ms`` once done, so a crashed gateway never blocks a key for good.

Every operation is one Lua script (registered once, run by ``EVALSHA``, reloaded by redis-py after a Redis
restart flushed the script cache), so each is atomic and one round trip:

- ``claim`` creates the running record unless one exists, else returns the existing record's state, fingerprint
  and response (a replay needs no second round trip), but never a response longer than the caller's cap: what
  Redis holds is not trusted to be what the gateway wrote (``gateway.proxy.idempotency`` validates the rest).
  A record already running under the *same* token answers "claimed": the client retries a command once when the
  connection drops, and a claim that reached Redis before the drop must not be reported back to its own owner as
  someone else's.
- ``extend``, ``complete``, ``release`` compare the owner token and the state before writing (compare-and-set):
  a late finisher whose lease ran out cannot touch the newer claim. ``complete`` by the owner of an already
  completed record answers true without writing (a retried call).

Values kept with ``remember`` are plain strings (``SET … PX``, ``GET``) under the same prefix.

Per owner (the tenant, or the API key's scope; see ``gateway.store.base``): a sorted set per owner and family,
``<prefix>owner:idem:<owner>`` for claims and ``<prefix>owner:val:<owner>`` for remembered values: members the
record keys, scores their write order (one more than the set's highest), written by the script that creates the
record.
Past ``max_owner_records`` the script makes room among that owner's oldest members: a member whose record expired or
was deleted is removed, a completed claim (or any value) is deleted; a running claim is never dropped but moved to
the newest end (it will be dropped, once completed, after those completed before it). One claim looks at no more
than 256 more than it must free; an owner with only running claims there has its new claim refused
(``StoreUnavailable``, as a full ``MemoryStore``).
A record created by another owner (a key that moved with a changed tenants file) is never deleted, only unlisted.
Each set's TTL is renewed on every write (``owner_keep_ms``, at least the longest record TTL in use); records outlive
a set only if kept longer than that, and then merely go uncounted. The caps count records, not bytes: Redis's own
``maxmemory`` bounds the bytes. The scripts touch records named by the set, not passed as keys: one Redis (or a
proxy that keeps a script's keys together), not Redis Cluster, as before.

Failures: any Redis or socket error becomes ``StoreUnavailable`` with the operation in its message; the URL (which
may hold a password) is never part of it. Timeouts are short (``socket_timeout_s``) so that a dead Redis costs a
keyed request half a second, not a stalled worker; a refused connection is retried once at once (a pooled
connection that went stale across a Redis restart), a timeout is not retried.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.store.base import Claimed, ClaimResult, Completed, Running, StoreUnavailable

DEFAULT_PREFIX = "specgate:idem:"
DEFAULT_MAX_OWNER_RECORDS = 10_000
DEFAULT_OWNER_KEEP_MS = 7 * 24 * 3600 * 1000

# KEYS[1] = record, KEYS[2] (optional) = the owner's claim set; ARGV = token, fingerprint, lease_ms, max_bytes,
# max_owner_records, owner_keep_ms, owner. Returns 1 (claimed), 2 (the owner holds max_owner_records running
# claims: refused) or {state, fingerprint, response}, or {state, fingerprint, false, 1} when the response is longer
# than max_bytes (> 0): a record the gateway did not write is never sent back whole. A fingerprint longer than
# 128 bytes (ours are 64) comes back as '-', which matches no request. HSTRLEN first: an oversized field is never
# even copied.
_CLAIM = """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] then
  if rec[1] == 'running' and rec[2] == ARGV[1] then
    return 1
  end
  local fp = '-'
  if redis.call('HSTRLEN', KEYS[1], 'f') <= 128 then
    fp = redis.call('HGET', KEYS[1], 'f')
  end
  local cap = tonumber(ARGV[4]) or 0
  if cap > 0 and redis.call('HSTRLEN', KEYS[1], 'r') > cap then
    return {rec[1], fp, false, 1}
  end
  return {rec[1], fp, redis.call('HGET', KEYS[1], 'r')}
end
if KEYS[2] then
  local cap = tonumber(ARGV[5])
  local excess = redis.call('ZCARD', KEYS[2]) - cap + 1
  if excess > 0 then
    local top = tonumber(redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]) or 0
    for _, k in ipairs(redis.call('ZRANGE', KEYS[2], 0, excess + 255)) do
      if excess <= 0 then break end
      local r = redis.call('HMGET', k, 's', 'o')
      if r[1] == 'running' and r[2] == ARGV[7] then
        top = top + 1
        redis.call('ZADD', KEYS[2], top, k)
      else
        if r[1] == 'done' and r[2] == ARGV[7] then
          redis.call('DEL', k)
        end
        redis.call('ZREM', KEYS[2], k)
        excess = excess - 1
      end
    end
    if excess > 0 then
      return 2
    end
  end
  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  redis.call('ZADD', KEYS[2], (tonumber(last[2]) or 0) + 1, KEYS[1])
  if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[6]) then
    redis.call('PEXPIRE', KEYS[2], ARGV[6])
  end
  redis.call('HSET', KEYS[1], 'o', ARGV[7])
end
redis.call('HSET', KEYS[1], 's', 'running', 't', ARGV[1], 'f', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] = value, KEYS[2] = the owner's value set; ARGV = value, ttl_ms, max_owner_records, owner_keep_ms.
# The owner's oldest values beyond the cap are deleted (never the one just written).
_REMEMBER = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
redis.call('ZADD', KEYS[2], (tonumber(last[2]) or 0) + 1, KEYS[1])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess > 0 then
  for _, k in ipairs(redis.call('ZRANGE', KEYS[2], 0, excess)) do
    if excess <= 0 then break end
    if k ~= KEYS[1] then
      redis.call('DEL', k)
      redis.call('ZREM', KEYS[2], k)
      excess = excess - 1
    end
  end
end
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return 1
"""

# KEYS[1] = record; ARGV = token, lease_ms. Returns 1 when renewed.
_EXTEND = """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] == 'running' and rec[2] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] = record; ARGV = token, response, ttl_ms. Returns 1 when stored (or already stored by this token).
_COMPLETE = """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[2] ~= ARGV[1] then
  return 0
end
if rec[1] == 'running' then
  redis.call('HSET', KEYS[1], 's', 'done', 'r', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if rec[1] == 'done' then
  return 1
end
return 0
"""

# KEYS[1] = record; ARGV = token. Returns 1 when the running record was deleted.
_RELEASE = """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] == 'running' and rec[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``: the only form of a Redis URL that may be logged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _record(raw: Any) -> Running | Completed | None:
    """Decode the ``[state, fingerprint, response(, oversize)]`` reply of the claim script or ``HMGET``."""
    if not isinstance(raw, list | tuple) or len(raw) < 3:
        raise StoreUnavailable(f"redis returned an unexpected reply: {str(raw)[:100]!r}")
    state, fingerprint, response = raw[0], raw[1], raw[2]
    if state is None:
        return None
    fp = fingerprint.decode("utf-8", "replace") if isinstance(fingerprint, bytes) else str(fingerprint or "")
    if state == b"done":
        if len(raw) > 3 and raw[3] == 1:
            return Completed(fp, b"", oversize=True)
        return Completed(fp, response if isinstance(response, bytes) else b"")
    return Running(fp)


def connection_pool(
    url: str, *, max_connections: int, socket_timeout_s: float, health_check_interval_s: int, client_name: str
) -> tuple[aioredis.BlockingConnectionPool, str]:
    """A bounded pool with short timeouts and one quick reconnect, and where it points (for error messages, never
    with the password). Shared by the idempotency and the override stores."""
    try:
        pool: aioredis.BlockingConnectionPool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=health_check_interval_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            client_name=client_name,
        )
    except ValueError as exc:
        raise ValueError(f"invalid redis url {redact_url(url)!r}: {exc}") from None
    kw = pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
    return pool, str(where)


class RedisStore:
    """The shared store: see the module docstring for the record encoding and the scripts."""

    name = "redis"

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        where: str = "redis",
        max_owner_records: int = DEFAULT_MAX_OWNER_RECORDS,
        owner_keep_ms: int = DEFAULT_OWNER_KEEP_MS,
    ) -> None:
        if max_owner_records < 1:
            raise ValueError(f"max_owner_records must be >= 1, got {max_owner_records}")
        self._client = client
        self._prefix = prefix
        self._owner_max = max_owner_records
        self._owner_keep_ms = max(1, owner_keep_ms)
        self._where = where  # for messages: host:port/db, never the password
        self._claim = client.register_script(_CLAIM)
        self._extend = client.register_script(_EXTEND)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)
        self._remember = client.register_script(_REMEMBER)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        socket_timeout_s: float = 0.5,
        prefix: str = DEFAULT_PREFIX,
        max_connections: int = 128,
        health_check_interval_s: int = 10,
        max_owner_records: int = DEFAULT_MAX_OWNER_RECORDS,
        owner_keep_ms: int = DEFAULT_OWNER_KEEP_MS,
    ) -> RedisStore:
        """A store on its own bounded connection pool. Nothing connects yet: the first command (or ``ping``) does.

        ``BlockingConnectionPool`` waits at most ``socket_timeout_s`` for a free connection rather than opening an
        unbounded number of them when Redis is slow. ``health_check_interval_s``: a connection idle longer than
        that is PINGed before use, so one broken while idle is replaced instead of failing a request.
        """
        pool, where = connection_pool(
            url,
            max_connections=max_connections,
            socket_timeout_s=socket_timeout_s,
            health_check_interval_s=health_check_interval_s,
            client_name="specgate",
        )
        return cls(
            aioredis.Redis(connection_pool=pool),
            prefix=prefix,
            where=where,
            max_owner_records=max_owner_records,
            owner_keep_ms=owner_keep_ms,
        )

    def _unavailable(self, op: str, exc: BaseException) -> StoreUnavailable:
        detail = str(exc).strip() or "no detail"
        return StoreUnavailable(f"redis {op} failed ({self._where}): {type(exc).__name__}: {detail}")

    async def _run(self, op: str, script: Any, key: str | list[str], *args: str | int | bytes) -> Any:
        keys = [self._prefix + k for k in ([key] if isinstance(key, str) else key)]
        try:
            return await script(keys=keys, args=list(args))
        except (RedisError, OSError) as exc:  # TimeoutError is an OSError
            raise self._unavailable(op, exc) from exc

    async def claim(
        self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0, owner: str = ""
    ) -> ClaimResult:
        token = secrets.token_hex(16)
        keys = [key, "owner:idem:" + owner] if owner else key
        raw = await self._run(
            "claim",
            self._claim,
            keys,
            token,
            fingerprint,
            int(lease_ms),
            max(0, int(max_bytes)),
            self._owner_max,
            self._owner_keep_ms,
            owner,
        )
        if raw == 1:
            return Claimed(token)
        if raw == 2:
            raise StoreUnavailable(f"redis: this owner holds {self._owner_max} running claims (max_owner_records)")
        rec = _record(raw)
        if rec is None:  # cannot happen with the script above; a protocol error if it does
            raise StoreUnavailable(f"redis claim returned an unexpected reply: {raw!r}")
        return rec

    async def extend(self, key: str, token: str, *, lease_ms: int) -> bool:
        return bool(await self._run("extend", self._extend, key, token, int(lease_ms)))

    async def complete(self, key: str, token: str, response: bytes, *, ttl_ms: int) -> bool:
        return bool(await self._run("complete", self._complete, key, token, bytes(response), int(ttl_ms)))

    async def release(self, key: str, token: str) -> bool:
        return bool(await self._run("release", self._release, key, token))

    async def get(self, key: str) -> Running | Completed | None:
        try:
            raw = await self._client.hmget(self._prefix + key, ["s", "f", "r"])
        except (RedisError, OSError) as exc:
            raise self._unavailable("get", exc) from exc
        return _record(raw)

    async def remember(self, key: str, value: bytes, *, ttl_ms: int, owner: str = "") -> None:
        if owner:
            ttl = max(1, int(ttl_ms))
            await self._run(
                "remember",
                self._remember,
                [key, "owner:val:" + owner],
                bytes(value),
                ttl,
                self._owner_max,
                max(ttl, self._owner_keep_ms),
            )
            return
        try:
            await self._client.set(self._prefix + key, bytes(value), px=max(1, int(ttl_ms)))
        except (RedisError, OSError) as exc:
            raise self._unavailable("remember", exc) from exc

    async def recall(self, key: str) -> bytes | None:
        try:
            raw = await self._client.get(self._prefix + key)
        except (RedisError, OSError) as exc:
            raise self._unavailable("recall", exc) from exc
        if raw is None:
            return None
        return raw if isinstance(raw, bytes) else str(raw).encode()

    async def forget(self, key: str) -> bool:
        try:
            return bool(await self._client.delete(self._prefix + key))
        except (RedisError, OSError) as exc:
            raise self._unavailable("forget", exc) from exc

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as exc:
            raise self._unavailable("ping", exc) from exc

    async def close(self) -> None:
        try:
            await self._client.aclose()
            await self._client.connection_pool.aclose()
        except (RedisError, OSError):  # closing a dead connection: nothing left to do
            pass
