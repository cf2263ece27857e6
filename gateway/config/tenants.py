"""The tenants file (``--tenants-file`` / ``SPECGATE_TENANTS_FILE``): who the client keys belong to, and each
tenant's priority, share weight and limits.

It holds client keys, so it is a secret like the keys file and lives apart from the routing YAML (which is meant to
be committed). Read at start-up (a problem stops the start with every issue named by its path) and reloaded when
it changes (``gateway.runtime.tenants_reload``)::

    tenants:
      - name: search              # the label of its metrics and log lines
        keys: [sk-search-1]       # its client keys (each key belongs to one tenant)
        priority: 0               # lower = more important, as vLLM's --scheduling-policy priority
        weight: 3                 # its share of a full pool's in-flight requests, relative to the others
        allow_priority_header: false
        limits:
          max_concurrent: 64
          requests_per_minute: 600
          tokens_per_minute: 200000
          reserve_output_tokens: 1024   # reserved when a request sets no max_tokens
    waiting:                      # at a full pool: wait for a slot, best priority and fair share first
      wait_s: 2
      max_waiting_per_pool: 256
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field, StringConstraints, ValidationError, model_validator

from gateway.config.base import Number, Strict
from gateway.config.checks import format_path

# The label of requests whose key belongs to no tenant (or that came without one): never a configured name.
NO_TENANT = "none"
MAX_TENANTS = 1000
MAX_KEYS_PER_TENANT = 1000
PRIORITY_BOUND = 1_000_000

TenantName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]
ClientKey = Annotated[str, StringConstraints(min_length=8, max_length=512, pattern=r"^[\x21-\x7e]+$")]


class TenantLimits(Strict):
    """A tenant's limits; unset: no limit of that kind."""

    max_concurrent: int | None = Field(None, gt=0, le=1_000_000, description="Requests in flight at once.")
    requests_per_minute: int | None = Field(None, gt=0, le=100_000_000, description="Requests admitted per minute.")
    tokens_per_minute: int | None = Field(
        None,
        gt=0,
        le=100_000_000_000,
        description="Tokens per minute: the prompt's estimate plus the output tokens it may generate are reserved "
        "at admission, and corrected by the answer's usage when it ends.",
    )
    reserve_output_tokens: int = Field(
        1024, gt=0, le=10_000_000, description="Output tokens reserved for a request that sets no max_tokens."
    )


class Tenant(Strict):
    name: TenantName
    keys: list[ClientKey] = Field(min_length=1, max_length=MAX_KEYS_PER_TENANT)
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND, description="Lower = more important.")
    weight: Number = Field(1.0, gt=0, le=1000, description="Share weight under overload.")
    allow_priority_header: bool = Field(
        False, description="The tenant may set its requests' priority with the x-specgate-priority header."
    )
    limits: TenantLimits = Field(default_factory=TenantLimits)

    @property
    def limited(self) -> bool:
        lim = self.limits
        return lim.requests_per_minute is not None or lim.tokens_per_minute is not None


class Waiting(Strict):
    """The waiting room of a full pool (``gateway.runtime.waiting_room``): how long a request that would be shed
    waits for a slot, and how many may wait per pool in each process. ``wait_s: 0``: shed at once."""

    wait_s: Number = Field(
        2.0, ge=0, le=60, description="Longest wait for a slot of a full pool before the request is shed (503)."
    )
    max_waiting_per_pool: int = Field(
        256, ge=0, le=100_000, description="Waiters per pool; a better-ranked arrival sheds the worst one."
    )


class TenantsFile(Strict):
    tenants: list[Tenant] = Field(min_length=1, max_length=MAX_TENANTS)
    waiting: Waiting = Field(default_factory=Waiting)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        names: set[str] = set()
        keys: dict[str, str] = {}
        for t in self.tenants:
            if t.name == NO_TENANT:
                raise ValueError(f"tenant name {NO_TENANT!r} is reserved (the label of keys without a tenant)")
            if t.name in names:
                raise ValueError(f"tenant {t.name!r} is defined twice")
            names.add(t.name)
            for k in t.keys:
                if k in keys:  # never echo the key itself
                    raise ValueError(f"a key of tenant {t.name!r} is also a key of tenant {keys[k]!r}")
                keys[k] = t.name
        return self


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message names the file and every problem's path."""


def load_tenants_text(text: str, source: str) -> TenantsFile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TenantsError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TenantsError(f"{source}: the top level must be a mapping with `tenants:`")
    try:
        return TenantsFile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False, include_input=False):
            where = format_path(tuple(err["loc"]))
            lines.append(f"{source}: {where}: {err['msg']}" if where else f"{source}: {err['msg']}")
        raise TenantsError("\n".join(lines)) from None


def load_tenants_file(path: Path) -> TenantsFile:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsError(f"cannot read the tenants file {path}: {exc}") from None
    return load_tenants_text(text, str(path))
