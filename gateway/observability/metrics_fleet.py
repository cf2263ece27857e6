"""What the gateway measures of the fleet itself, part of ``GatewayMetrics`` (its base): endpoint health checks,
the scraped pool state, and prefix affinity (what the gateway predicted of each endpoint's prefix cache against
what the servers measured). Labels are pool and endpoint names from the routing YAML."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.observability.fast_child import Counting


class FleetMetrics:
    """The fleet's metric families in the gateway's registry, and ``prefix_sent``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # Endpoint health: each worker runs its own checks, so the merge is the highest value over the live workers
        # (1 while any worker's last check passed; 0 once every worker's last check failed, i.e. within one check
        # interval of the endpoint going down); plain "max" would keep a dead worker's last 1 forever.
        self.endpoint_up = Gauge(
            "specgate_endpoint_healthy",
            "1 when the endpoint's last health check passed.",
            ["pool", "endpoint"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.health_checks = Counter(
            "specgate_health_checks_total",
            "Active health checks by result.",
            ["pool", "result"],
            registry=registry,
        )
        # Scraped pool state (gateway.fleet.scraper). Every worker scrapes for itself, so the merge takes the most
        # recent value of a live worker. Unknown (stale, no drafts in the window) is NaN, never 0.
        self.pool_acceptance = Gauge(
            "specgate_pool_acceptance_ratio",
            "Draft acceptance rate of the pool over the scrape window (accepted / draft tokens); NaN when unknown.",
            ["pool"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.pool_queue_depth = Gauge(
            "specgate_pool_queue_depth",
            "Waiting requests in the pool (scraped vllm:num_requests_waiting, summed); NaN when stale.",
            ["pool"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.pool_batch_size = Gauge(
            "specgate_pool_batch_size",
            "Running requests in the pool (scraped vllm:num_requests_running, summed); NaN when stale.",
            ["pool"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.endpoint_scrape_stale = Gauge(
            "specgate_endpoint_scrape_stale",
            "1 when the endpoint's scraped data is stale (last scrape failed or too old).",
            ["pool", "endpoint"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        # Prefix affinity (gateway.fleet.affinity): what the gateway predicted against what the servers measured.
        self.prefix_predicted_hit_tokens = Counter(
            "specgate_prefix_predicted_hit_tokens",
            "Prompt tokens the gateway expected the endpoint's prefix cache to hold when it sent a request there "
            "(approximate: warm 64-character chunks x 16).",
            ["pool", "endpoint"],
            registry=registry,
        )
        self.prefix_prompt_tokens = Counter(
            "specgate_prefix_prompt_tokens",
            "Prompt tokens the gateway sent to the endpoint and recorded in its prefix index (whole chunks x 16).",
            ["pool", "endpoint"],
            registry=registry,
        )
        self.prefix_measured_hit_ratio = Gauge(
            "specgate_prefix_measured_hit_ratio",
            "The endpoint's prefix-cache hit rate over the scrape window (scraped vllm:prefix_cache_hits / "
            "vllm:prefix_cache_queries deltas); NaN when unknown.",
            ["pool", "endpoint"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.prefix_index_chunks = Gauge(
            "specgate_prefix_index_chunks",
            "Chunks (about 16 tokens each) in the gateway's prefix index of the endpoint.",
            ["pool", "endpoint"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self._prefix: dict[tuple[str, str], tuple[Counting, Counting]] = {}
        self.scrapes = Counter(
            "specgate_scrapes_total",
            "Scrapes of the endpoints' /metrics by result (ok, timeout, error, bad_status, malformed).",
            ["pool", "result"],
            registry=registry,
        )

    def prefix_sent(self, pool: str, endpoint: str, chunks: int, warm_chunks: int) -> None:
        """A prompt recorded in an endpoint's prefix index: its size and the part predicted warm, in chunks of
        about 16 tokens."""
        key = (pool, endpoint)
        children = self._prefix.get(key)
        if children is None:
            children = self._prefix[key] = (
                Counting(self.prefix_prompt_tokens.labels(pool, endpoint)),
                Counting(self.prefix_predicted_hit_tokens.labels(pool, endpoint)),
            )
        children[0].inc(chunks * 16)
        if warm_chunks:
            children[1].inc(warm_chunks * 16)
