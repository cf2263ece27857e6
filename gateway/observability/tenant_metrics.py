"""Per-tenant metrics (only when a tenants file is configured). The ``tenant`` label takes the names of the tenants
file and ``none`` (keys without a tenant), so the label set is bounded by the configuration."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "specgate_tenant_requests_total",
            "Requests per tenant and outcome (the outcomes of specgate_requests_total, and limited).",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.shed = Counter(
            "specgate_tenant_shed_total",
            "Requests of the tenant shed by admission control (503 overloaded).",
            ["tenant"],
            registry=registry,
        )
        self.limited = Counter(
            "specgate_tenant_limited_total",
            "Requests of the tenant refused by its own limits (429), by limit: requests, tokens, concurrent.",
            ["tenant", "limit"],
            registry=registry,
        )
        self.tokens = Counter(
            "specgate_tenant_tokens_total",
            "Tokens charged to the tenant's tokens-per-minute budget (the answer's usage where known, else the "
            "reservation).",
            ["tenant"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "specgate_tenant_in_flight_requests",
            "Requests of the tenant in flight in the gateway.",
            ["tenant"],
            registry=registry,
            multiprocess_mode="livesum",
        )
