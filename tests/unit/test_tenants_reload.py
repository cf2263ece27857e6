"""The tenants file reloaded in place: keys, priorities, weights, limits and the waiting room's settings swapped at
once; a tenant that stays keeps its requests in flight; an invalid file changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.config.tenants import load_tenants_file
from gateway.errors import RateLimited, Unauthorized
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.runtime.tenants import Tenancy
from gateway.runtime.tenants_reload import TenantsReloader
from gateway.store.ratelimit import MemoryRateLimiter

BEFORE = "tenants:\n  - {name: a, keys: [sk-a-old-0001], limits: {max_concurrent: 4}}\n"
AFTER = """
tenants:
  - {name: a, keys: [sk-a-new-0001], priority: -3, weight: 2, limits: {max_concurrent: 1}}
  - {name: b, keys: [sk-b-0000001]}
waiting: {wait_s: 0.5, max_waiting_per_pool: 7}
"""


def test_a_changed_tenants_file_is_put_in_force_and_a_bad_one_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(BEFORE)
    tenancy = Tenancy(load_tenants_file(path), frozenset({"sk-plain-00001"}), TenantMetrics(CollectorRegistry()),
                      MemoryRateLimiter())  # fmt: skip
    keys: list[frozenset[bytes]] = []
    reloader = TenantsReloader(path, tenancy, frozenset({"sk-plain-00001"}), keys.append)
    a = tenancy.identify("Bearer sk-a-old-0001")

    async def run() -> None:
        ticket = await tenancy.admit(a, 0, 0)
        assert reloader.reload("admin") is False  # unchanged
        path.write_text(AFTER)
        assert reloader.reload("watch") is True
        assert tenancy.identify("Bearer sk-a-new-0001") is a  # the same tenant: its request in flight counts
        assert (a.in_flight, a.max_concurrent) == (1, 1)
        with pytest.raises(Unauthorized):
            tenancy.identify("Bearer sk-a-old-0001")
        assert tenancy.identify("Bearer sk-plain-00001").name == "none"
        assert tenancy.identify("Bearer sk-b-0000001").name == "b"
        assert (tenancy.weights["a"].priority, tenancy.weights["a"].weight, tenancy.best) == (-3, 2.0, -3)
        assert (tenancy.waiting_s, tenancy.room_size) == (0.5, 7)
        assert len(keys) == 1
        assert keys[0] == tenancy.key_digests
        with pytest.raises(RateLimited, match="max_concurrent"):
            await tenancy.admit(a, 0, 0)  # its new limit, counting the request admitted before the reload
        ticket.finish("ok", True)
        assert a.in_flight == 0
        path.write_text(AFTER.replace("weight: 2", "weight: -1"))
        assert reloader.reload("watch") is False  # invalid: logged, the tenants in force stay
        assert tenancy.weights["a"].weight == 2.0
        assert reloader.reloads == 1

    asyncio.run(run())
