"""What the gateway tells operators about itself.

- ``metrics``: the ``specgate_*`` Prometheus metrics (own registry; multiprocess-aware with ``--workers``).
- ``tenant_metrics``: the per-tenant metrics (a tenants file only).
- ``logs``: one JSON line per request and per event.
- ``acceptance``: per-class speculative-decoding acceptance windows, fed by what speculative pools report.
- ``tracing``: OpenTelemetry spans of each proxied request (``--tracing``), written as OTLP protobuf by
  ``otlp_wire`` and exported by ``trace_export``.
"""
