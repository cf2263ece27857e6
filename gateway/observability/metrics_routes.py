"""The class controllers' metric families: route-state transitions, the state and share gauges, probes. Declared
here with the gateway's other families; ``gateway.routing.route_events`` records into them. Labels are the class
names of the routing YAML and the controller's states and reasons, so the label sets are bounded by the
configuration."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouteMetrics:
    """The route state's metric families (one set per registry): transitions, state and share gauges, probes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transitions = Counter(
            "specgate_controller_transitions_total",
            "Route-state changes of a traffic class's controller, by reason.",
            ["class", "from", "to", "reason"],
            registry=registry,
        )
        # Every worker runs its own controllers: the merge shows 1 for a state while any live worker has it.
        self.route_state = Gauge(
            "specgate_class_route_state",
            "1 for the traffic class's current route state (speculative, split or standard), 0 for the others.",
            ["class", "state"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.share = Gauge(
            "specgate_class_speculative_share",
            "Share of the traffic class's requests the controller sends to the speculative pool first.",
            ["class"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.probes = Counter(
            "specgate_controller_probes_total",
            "Requests a class controller sent to the speculative pool to measure the class's acceptance (probes).",
            ["class"],
            registry=registry,
        )
        self.probe_share = Gauge(
            "specgate_class_probe_share",
            "Share of the traffic class's requests sent to the speculative pool as probes (0: not probing).",
            ["class"],
            registry=registry,
            multiprocess_mode="livemax",
        )
