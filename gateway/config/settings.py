"""Process settings: resolved once, from command-line flags or ``SPECGATE_*`` environment variables.

Each field is declared once (``gateway.config.setting_spec.setting``): type, default, help text, bounds, and
whether it has a flag. Its variable is ``SPECGATE_`` + the upper-case field name; ``specgate serve``'s flags are
built from the fields (``gateway.cli.options``). With several workers, the parent writes the resolved settings
to the environment and each worker reads them back with ``Settings.from_env`` (uvicorn starts workers from an
import string).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_type_hints

from gateway.config.setting_spec import MIB, check_bounds, env_name, parse, required, setting, spec_of

LogLevel = Literal["debug", "info", "warning", "error"]
# The deepest request body the gateway accepts: orjson reads 1024 levels but writes only about 254, and the gateway
# re-serialises bodies (the idempotency fingerprint, the usage option, a fallback model).
MAX_JSON_DEPTH = 250
_API_KEYS_INSTEAD = "or put the keys in a file (one per line) for --api-keys-file (SPECGATE_API_KEYS_FILE)"


class SettingsError(ValueError):
    """A setting out of range or malformed; its message names the setting."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The process settings: every ``specgate serve`` flag, each with its ``SPECGATE_*`` variable
    (``from_env``, ``to_env`` for the workers of ``--workers N``). Each field is declared once, with ``setting``:
    default, help text, bounds, source (``gateway.config.setting_spec``); the CLI's options are built from these
    declarations. Validated at construction (``SettingsError``); immutable. Routing lives in the YAML at ``rules``,
    not here."""

    rules: Path = required("Routing YAML file.")
    host: str = setting("0.0.0.0", "Address to listen on.")
    port: int = setting(8080, "Client port.", min=1, max=65535)
    workers: int = setting(1, "Worker processes.", min=1)
    max_body_bytes: int = setting(8 * MIB, "Largest accepted request body.", min=1024)
    # request line + header lines of one request (gateway/proxy/limits.py)
    max_header_bytes: int = setting(64 * 1024, "Largest request head (request line + headers); past it: 431.", min=1024)
    max_headers: int = setting(100, "Most header fields in one request; past it: 431.", min=8)
    max_json_depth: int = setting(
        128, f"Deepest nesting of a request body (<= {MAX_JSON_DEPTH}); past it: 400.", min=1, max=MAX_JSON_DEPTH
    )
    max_json_containers: int = setting(1_000_000, "Most arrays and objects in one request body; past it: 400.", min=1)
    # gateway/proxy/parse_pool.py; 0: parsed on the event loop, in steps
    parse_workers: int = setting(
        1,
        "Processes (per worker) that parse request bodies over 1 MiB off the event loop; 0: on the loop.",
        min=0,
        max=64,
    )
    max_detached: int = setting(
        64,
        "Keyed generations kept running after their client left, in total; past it they are cancelled.",
        min=0,
    )
    max_detached_per_client: int = setting(8, "The same, per client (bearer token).", min=0)
    # at least the largest per-record cap the YAML allows
    idempotency_memory_bytes: int = setting(
        256 * MIB,
        "Stored responses of the in-memory Idempotency-Key store, together; the oldest go first.",
        min=64 * MIB,
    )
    # Per owner, in memory and in Redis; the bytes in memory only, checked against idempotency_memory_bytes below.
    idempotency_owner_records: int = setting(
        10_000,
        "Idempotency-Key records, and apart Responses API records, kept per tenant (or per API key without "
        "tenants); past it that owner's own oldest completed go first.",
        min=1,
    )
    idempotency_owner_bytes: int = setting(
        0,
        "Stored responses of the in-memory store per tenant (or API key); 0: a quarter of --idempotency-memory-bytes.",
    )
    # Client connections (gateway/proxy/limits.py, docs/limits.md): time bounds before a request reaches the app, and
    # open connections per listener of this process.
    header_timeout_s: float = setting(
        30.0,
        "Seconds for a request head, from its first byte; past it: 408, connection closed.",
        above=0,
        max=3600,
        unit="seconds",
    )
    body_timeout_s: float = setting(
        30.0,
        "Seconds a request body may take (a larger body: its size / --body-min-rate); past it: 408.",
        above=0,
        max=3600,
        unit="seconds",
    )
    body_min_rate: int = setting(
        32 * 1024, "Bytes per second a large request body must keep up.", min=1024, unit="bytes per second"
    )
    keep_alive_s: float = setting(
        5.0,
        "Seconds a connection may wait for its next request (or its first); then it is closed.",
        above=0,
        max=3600,
        unit="seconds",
    )
    max_connections: int = setting(
        8192,
        "Open connections per listener of each worker process; past it: 503 (0: no cap).",
        min=0,
        zero="no cap",
    )
    max_connections_per_client: int = setting(
        512,
        "The same, from one client address (IPv6: one /64); past it: 503 (0: no cap).",
        min=0,
        zero="no cap",
    )
    # A flag would show the keys to every user of the machine (``ps``): refused on the command line.
    api_keys: str = setting(
        "",
        "Client API keys, comma-separated (none = open); from SPECGATE_API_KEYS only.",
        source="secret",
        instead=_API_KEYS_INSTEAD,
    )
    api_keys_file: Path | None = setting(None, "File with one client API key per line (or SPECGATE_API_KEYS).")
    # gateway/config/tenants.py. A secret like the keys file (it holds keys), never in the routing YAML.
    tenants_file: Path | None = setting(
        None, "Tenants YAML: each tenant's client keys, priority, share weight and limits (docs/tenants.md)."
    )
    # None: /metrics follows the client keys (open without keys, a key with them).
    metrics_token: str | None = setting(
        None, "The bearer token that opens /metrics, for Prometheus (no client key needed).", source="env"
    )
    health_interval_s: float = setting(5.0, "Seconds between checks.", above=0)
    health_timeout_s: float = setting(2.0, "Health check timeout.", above=0)
    log_level: LogLevel = setting("info", "debug | info | warning | error.")
    # the admin API listener (gateway/admin/app.py)
    admin_host: str = setting("127.0.0.1", "Admin API address (token: SPECGATE_ADMIN_TOKEN).")
    admin_port: int = setting(8081, "Admin API port (0: off).", min=1, max=65535, zero="off")
    # redis:// | rediss:// | unix://. It may hold a password: kept out of repr, and logged only through
    # gateway.store.redis.redact_url.
    redis_url: str | None = setting(
        None,
        "Redis shared by the replicas (Idempotency-Key records, on-call overrides, the audit log), e.g. "
        "redis://host:6379/0 (none: in memory, this process only).",
        repr=False,
    )
    # gateway.cluster; overrides and Idempotency-Keys are shared either way.
    cluster: bool = setting(
        True,
        "With --redis-url: one elected replica scrapes and runs the controllers for all (default); "
        "--no-cluster: each replica on its own.",
    )
    # Without it, --workers N without redis_url is refused at start-up (one Idempotency-Key could run per worker).
    per_worker_state: bool = setting(
        False, "Accept --workers N without Redis: each worker keeps its own idempotency records and overrides."
    )
    # gateway/observability/tracing.py. Off: OpenTelemetry is never imported.
    tracing: bool = setting(
        False,
        "OpenTelemetry traces of the proxied requests (needs specgate[tracing]), exported as the OTEL_* "
        "variables say: OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER(_ARG), OTEL_SERVICE_NAME.",
    )
    # From anyone else the peer's address alone is sent as X-Forwarded-For.
    trusted_proxies: str = setting(
        "",
        "Load balancers in front, comma-separated addresses or CIDRs (e.g. 10.0.0.0/8): only their "
        "X-Forwarded-For is kept and appended to; from any other peer the pools see the peer's address alone.",
    )
    # The file itself is untouched: ``specgate demo`` points the pools at its simulated servers this way, so a user
    # edits and reloads the YAML the demo serves.
    stand_ins: str = setting(
        "",
        "Stand-in endpoints, pool=URL,pool=URL: each named pool's endpoints in the routing YAML are replaced by "
        "that one URL whenever the file is loaded (at start and on every reload).",
        source="internal",
    )

    def __post_init__(self) -> None:
        self.stand_in_urls()  # raises SettingsError when malformed
        hints = get_type_hints(Settings)
        for f in fields(self):
            problem = check_bounds(f.name, hints[f.name], spec_of(f), getattr(self, f.name))
            if problem is not None:
                raise SettingsError(problem)
        if self.admin_port == self.port:
            raise SettingsError(f"admin_port must differ from port ({self.port}); 0 turns the admin listener off")
        if self.idempotency_owner_bytes != 0 and not (
            MIB <= self.idempotency_owner_bytes <= self.idempotency_memory_bytes
        ):
            raise SettingsError(
                "idempotency_owner_bytes must be 0 (a quarter of idempotency_memory_bytes) or 1 MiB.."
                f"idempotency_memory_bytes, got {self.idempotency_owner_bytes}"
            )
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError("redis_url must start with redis://, rediss:// or unix://")
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
        """The settings from the ``SPECGATE_*`` variables (an empty one is unset): how each worker of
        ``--workers N`` gets its parent's."""
        env = os.environ if environ is None else environ
        if not env.get(env_name("rules")):
            raise SettingsError("no routing rules: set --rules FILE or SPECGATE_RULES")
        return cls(**env_values(cls, [f.name for f in fields(cls)], env))

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
                out[env_name(f.name)] = str(v)
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


def env_values(cls: type[Any], names: list[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields ``names`` of the settings dataclass ``cls`` that ``environ`` sets (a blank variable is unset),
    parsed by their declared type. Raises ``SettingsError`` naming the variable."""
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for name in names:
        raw = environ.get(env_name(name), "").strip()
        if not raw:
            continue
        try:
            out[name] = parse(hints[name], raw)
        except ValueError as exc:
            raise SettingsError(f"{env_name(name)}={raw!r}: {exc}") from exc
    return out
