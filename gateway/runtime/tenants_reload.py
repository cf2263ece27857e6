"""Hot reload of the tenants file: watched like the routing YAML (``gateway.runtime.watch.ConfigWatcher``: an
in-place edit, an atomic rename and a Kubernetes Secret update are all seen), and re-read by every reload of the
routing YAML through ``POST /admin/reload`` or SIGHUP.

The new file is validated completely before anything changes; an invalid one is logged (every problem by its path)
and the tenants in force keep serving. A valid one is put in force at once (``Tenancy.update``): keys, priorities,
weights, limits, the waiting room's settings; the tenants that stay keep their requests in flight and counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from gateway.config.tenants import TenantsError, load_tenants_text
from gateway.runtime.live import config_digest
from gateway.runtime.tenants import Tenancy
from gateway.runtime.watch import ConfigWatcher

logger = logging.getLogger("specgate")


class TenantsReloader:
    """Re-reads one tenants file into one ``Tenancy``; ``on_keys`` gets the client keys' digests after a change."""

    def __init__(
        self, path: Path, tenancy: Tenancy, plain_keys: frozenset[str], on_keys: Callable[[frozenset[bytes]], None]
    ) -> None:
        self.path = path
        self.tenancy = tenancy
        self._plain_keys = plain_keys
        self._on_keys = on_keys
        try:
            self.digest = config_digest(path.read_text(encoding="utf-8-sig"))  # the file in force (just loaded)
        except (OSError, UnicodeDecodeError):
            self.digest = ""
        self.reloads = 0  # changes put in force

    def reload(self, trigger: str) -> bool:
        """Read the file; put it in force if it changed and is valid. True when it changed something."""
        try:
            text = self.path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            logger.error("tenants file not reloaded (%s): cannot read %s: %s", trigger, self.path, exc)
            return False
        digest = config_digest(text)
        if digest == self.digest:
            return False
        try:
            spec = load_tenants_text(text, str(self.path))
        except TenantsError as exc:
            logger.error("tenants file not reloaded (%s); the tenants in force keep serving:\n%s", trigger, exc)
            return False
        self.tenancy.update(spec, self._plain_keys)
        self._on_keys(self.tenancy.key_digests)
        self.digest = digest
        self.reloads += 1
        logger.info("tenants file %s reloaded (%s): %d tenants", self.path, trigger, len(spec.tenants))
        return True

    def watcher(self, interval_s: float) -> ConfigWatcher:
        async def changed() -> None:
            self.reload("watch")

        return ConfigWatcher(self.path, changed, lambda: self.digest, interval_s=interval_s)
