"""What the gateway tells operators about itself.

- ``metrics``: the ``specgate_*`` Prometheus metrics (own registry), those of the fleet itself (health, scraped
  state, prefix affinity) declared in ``metrics_fleet``; ``metrics_workers``: their merge across ``--workers``;
  ``latency_window``: recent latencies for the latency guard's quantiles; ``exemplars``: which latency observations
  carry a trace exemplar (one per bucket per second).
- ``metrics_routes``: the class controllers' (route-state transitions, state, share and probe gauges).
- ``tenant_metrics``: the per-tenant metrics (a tenants file only).
- ``logs``: one JSON line per request and per event.
- ``fast_child``: the metrics' label children the request path updates, without the library's checks on every call.
- ``acceptance``: per-class speculative-decoding acceptance windows, fed by what speculative pools report.
- ``tracing``: OpenTelemetry traces of the proxied requests (``--tracing``): what each request records
  (``tracing``), handed as a record through a pipe (``trace_pipe``) to an export process (``trace_child``) that
  writes its spans as OTLP protobuf (``trace_spans``, ``otlp_wire``) and exports them (``trace_export``).
"""
