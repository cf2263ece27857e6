"""Process settings: resolved once, from command-line flags or ``SPECGATE_*`` environment variables.

Each field maps to one variable (``SPECGATE_`` + upper-case field name); ``specgate serve`` flags use the
same names. With several workers, the parent writes the resolved settings to the environment and each worker
reads them back with ``Settings.from_env`` (uvicorn starts workers from an import string).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

LogLevel = Literal["debug", "info", "warning", "error"]
ENV_PREFIX = "SPECGATE_"
# The deepest request body the gateway accepts: orjson reads 1024 levels but writes only about 254, and the gateway
# re-serialises bodies (the idempotency fingerprint, the usage option, a fallback model).
MAX_JSON_DEPTH = 250
_INT_FIELDS = frozenset(
    {
        "port",
        "workers",
        "max_body_bytes",
        "admin_port",
        "max_header_bytes",
        "max_headers",
        "max_json_depth",
        "max_json_containers",
        "parse_workers",
        "max_detached",
        "max_detached_per_client",
        "idempotency_memory_bytes",
        "idempotency_owner_records",
        "idempotency_owner_bytes",
        "body_min_rate",
        "max_connections",
        "max_connections_per_client",
    }
)
_FLOAT_FIELDS = frozenset(
    {"health_interval_s", "health_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_s"}
)


class SettingsError(ValueError):
    """A setting out of range or malformed; its message names the setting."""


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


@dataclass(frozen=True, slots=True)
class Settings:
    """The process settings: every ``specgate serve`` flag, each with its ``SPECGATE_*`` variable
    (``from_env``, ``to_env`` for the workers of ``--workers N``). Validated at construction (``SettingsError``);
    immutable. Routing lives in the YAML at ``rules``, not here."""

    rules: Path
    host: str = "0.0.0.0"
    port: int = 8080
    workers: int = 1
    max_body_bytes: int = 8 * 1024 * 1024
    max_header_bytes: int = 64 * 1024  # request line + header lines of one request (gateway/proxy/limits.py)
    max_headers: int = 100  # header fields of one request
    max_json_depth: int = 128  # nesting of a request body's arrays and objects
    max_json_containers: int = 1_000_000  # arrays and objects in one request body
    # Processes that parse request bodies over 1 MiB away from the event loop (gateway/proxy/parse_pool.py), per
    # worker; 0: parsed on the event loop, in steps.
    parse_workers: int = 1
    max_detached: int = 64  # keyed generations left running after their client went, in total
    max_detached_per_client: int = 8  # ... per client scope (bearer token)
    idempotency_memory_bytes: int = 256 * 1024 * 1024  # stored responses of the in-memory idempotency store
    # Per owner (tenant, or API key without tenants), in the store: Idempotency-Key records and, apart, Responses API
    # records (memory and Redis); stored response bytes (memory only; 0: a quarter of idempotency_memory_bytes).
    idempotency_owner_records: int = 10_000
    idempotency_owner_bytes: int = 0
    # Client connections (gateway/proxy/limits.py, docs/limits.md): time bounds before a request reaches the app, and
    # open connections per listener of this process (0: no cap).
    header_timeout_s: float = 30.0  # a request head, from its first byte to its end; past it: 408
    body_timeout_s: float = 30.0  # a request body, at least; past it (and past its size / body_min_rate): 408
    body_min_rate: int = 32 * 1024  # bytes per second a longer body is allowed for
    keep_alive_s: float = 5.0  # a connection with no request on it (new, or between requests); past it: closed
    max_connections: int = 8192  # open client connections of this process, per listener; past it: 503
    max_connections_per_client: int = 512  # ... from one client address (an IPv6 /64); past it: 503
    # Client keys: from SPECGATE_API_KEYS or the keys file only (``specgate serve`` refuses them as a flag, which
    # every user of the machine could read in ``ps``). Kept out of repr.
    api_keys: str = field(default="", repr=False)
    api_keys_file: Path | None = None
    # Tenants (gateway/config/tenants.py): who each client key belongs to, its priority, share weight and limits.
    # A secret like the keys file (it holds keys), never in the routing YAML. None: no tenants, no limits.
    tenants_file: Path | None = None
    # The bearer token that opens /metrics (SPECGATE_METRICS_TOKEN, environment only): for Prometheus, which then
    # needs no client key. None: /metrics follows the client keys (open without keys, a key with them).
    metrics_token: str | None = field(default=None, repr=False)
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    log_level: LogLevel = "info"
    admin_host: str = "127.0.0.1"  # the admin API listener (gateway/admin/app.py); its token is SPECGATE_ADMIN_TOKEN
    admin_port: int = 8081  # 0: no admin listener
    # Idempotency records shared by the replicas (redis:// | rediss:// | unix://); None: in memory, this process
    # only. It may hold a password: kept out of repr, and logged only through gateway.store.redis.redact_url.
    redis_url: str | None = field(default=None, repr=False)
    # With Redis: the replicas elect a leader that scrapes and decides for all (gateway.cluster); False: each
    # replica scrapes and decides alone (overrides and Idempotency-Keys are still shared).
    cluster: bool = True
    # --workers N without redis_url: each worker would keep its own Idempotency-Key records (the same key could run
    # once per worker) and its own overrides. Refused at start-up unless this accepts it explicitly.
    per_worker_state: bool = False
    # OpenTelemetry traces of the proxied requests (the ``tracing`` extra), exported as the standard OTEL_*
    # variables say (gateway/observability/tracing.py). Off: OpenTelemetry is never imported.
    tracing: bool = False
    # Load balancers in front of the gateway, as comma-separated addresses or CIDRs: only a connection from one of
    # them has its X-Forwarded-For kept (and the peer appended); from anyone else the peer's address alone is sent.
    trusted_proxies: str = ""
    # Stand-in endpoints, "pool=URL,pool=URL": each named pool's endpoints in the routing YAML are replaced by that
    # one URL whenever the file is loaded (at start and on every reload), the file itself untouched. ``specgate demo``
    # points the pools at its simulated servers this way, so a user edits and reloads the YAML the demo serves.
    stand_ins: str = ""

    def __post_init__(self) -> None:
        self.stand_in_urls()  # raises SettingsError when malformed
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be 1..65535, got {self.port}")
        if not 0 <= self.admin_port < 65536:
            raise SettingsError(f"admin_port must be 0 (off) or 1..65535, got {self.admin_port}")
        if self.admin_port == self.port:
            raise SettingsError(f"admin_port must differ from port ({self.port}); 0 turns the admin listener off")
        if self.workers < 1:
            raise SettingsError(f"workers must be >= 1, got {self.workers}")
        if self.max_body_bytes < 1024:
            raise SettingsError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise SettingsError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_headers < 8:
            raise SettingsError(f"max_headers must be >= 8, got {self.max_headers}")
        if not 1 <= self.max_json_depth <= MAX_JSON_DEPTH:
            raise SettingsError(f"max_json_depth must be 1..{MAX_JSON_DEPTH}, got {self.max_json_depth}")
        if self.max_json_containers < 1:
            raise SettingsError(f"max_json_containers must be >= 1, got {self.max_json_containers}")
        if not 0 <= self.parse_workers <= 64:
            raise SettingsError(f"parse_workers must be 0..64, got {self.parse_workers}")
        if self.idempotency_memory_bytes < 64 * 1024 * 1024:  # the largest per-record cap the YAML allows
            raise SettingsError(f"idempotency_memory_bytes must be >= 64 MiB, got {self.idempotency_memory_bytes}")
        if self.idempotency_owner_records < 1:
            raise SettingsError(f"idempotency_owner_records must be >= 1, got {self.idempotency_owner_records}")
        if self.idempotency_owner_bytes != 0 and not (
            1024 * 1024 <= self.idempotency_owner_bytes <= self.idempotency_memory_bytes
        ):
            raise SettingsError(
                "idempotency_owner_bytes must be 0 (a quarter of idempotency_memory_bytes) or 1 MiB.."
                f"idempotency_memory_bytes, got {self.idempotency_owner_bytes}"
            )
        if self.max_detached < 0 or self.max_detached_per_client < 0:
            raise SettingsError("max_detached and max_detached_per_client must be >= 0")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise SettingsError(f"{name} must be > 0 and <= 3600 seconds, got {getattr(self, name)}")
        if self.body_min_rate < 1024:
            raise SettingsError(f"body_min_rate must be >= 1024 bytes per second, got {self.body_min_rate}")
        if self.max_connections < 0 or self.max_connections_per_client < 0:
            raise SettingsError("max_connections and max_connections_per_client must be >= 0 (0: no cap)")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise SettingsError("health_interval_s and health_timeout_s must be > 0")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError("redis_url must start with redis://, rediss:// or unix://")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        self.trusted_proxy_networks()  # raises on a malformed entry

    def trusted_proxy_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """``trusted_proxies`` parsed: each entry an address (one host) or a CIDR network."""
        out: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in self.trusted_proxies.split(","):
            entry = entry.strip()
            if not entry:
                continue
            try:
                out.append(ipaddress.ip_network(entry, strict=False))
            except ValueError as exc:
                raise SettingsError(f"trusted_proxies: {entry!r} is not an address or CIDR network ({exc})") from None
        return tuple(out)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        rules = env.get(ENV_PREFIX + "RULES")
        if not rules:
            raise SettingsError("no routing rules: set --rules FILE or SPECGATE_RULES")
        kw: dict[str, object] = {"rules": Path(rules)}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if f.name == "rules" or raw is None or raw == "":
                continue
            try:
                if f.name in _INT_FIELDS:
                    kw[f.name] = int(raw)
                elif f.name in _FLOAT_FIELDS:
                    kw[f.name] = float(raw)
                elif f.name == "cluster":
                    if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError("expected true or false")
                    kw[f.name] = raw.lower() in ("1", "true", "yes", "on")
                elif f.name in ("per_worker_state", "tracing"):
                    kw[f.name] = _flag(raw)
                elif f.name in ("api_keys_file", "tenants_file"):
                    kw[f.name] = Path(raw)
                else:
                    kw[f.name] = raw
            except ValueError as exc:
                raise SettingsError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {exc}") from exc
        return cls(**kw)  # type: ignore[arg-type]

    def stand_in_urls(self) -> dict[str, str]:
        """``stand_ins`` as pool → URL (empty: the YAML's own endpoints)."""
        out: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in self.stand_ins.split(","))):
            pool, sep, url = item.partition("=")
            if not sep or not pool.strip() or not url.strip().startswith(("http://", "https://")):
                raise SettingsError(f"stand_ins must be pool=http://host:port items, comma-separated; got {item!r}")
            out[pool.strip()] = url.strip()
        return out

    def to_env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[ENV_PREFIX + f.name.upper()] = str(v)
        return out

    def shared_state_problem(self) -> str | None:
        """Why these settings must not start: several workers with nothing shared, not accepted explicitly."""
        if self.workers > 1 and self.redis_url is None and not self.per_worker_state:
            return (
                f"--workers {self.workers} without SPECGATE_REDIS_URL (--redis-url): each worker would keep its own "
                "Idempotency-Key records, so one key could run once per worker. Set SPECGATE_REDIS_URL, or accept "
                "per-worker state with --per-worker-state (SPECGATE_PER_WORKER_STATE=1)"
            )
        return None

    def client_api_keys(self) -> frozenset[str]:
        """Client keys from SPECGATE_API_KEYS (comma-separated) and the keys file (one per line, # comments)."""
        keys = {k.strip() for k in self.api_keys.split(",") if k.strip()}
        if self.api_keys_file is not None:
            try:
                text = self.api_keys_file.read_text()
            except OSError as exc:
                raise SettingsError(f"cannot read api keys file {self.api_keys_file}: {exc}") from exc
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.add(line)
        return frozenset(keys)
