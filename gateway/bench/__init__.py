"""Benchmarks of the gateway's hot path, run by hand or from ``specgate bench``.

- ``gateway.bench.classify``: the CPU cost of classifying one request (with and without parsing its JSON body);
  pure, no I/O beyond reading the routing YAML.
- ``gateway.bench.overhead`` / ``gateway.bench.static_upstream``: the latency the whole gateway adds per request,
  against a static upstream; ``gateway.bench.otlp_sink``: the OTLP receiver of its ``--tracing`` measurement;
  ``gateway.bench.turns``: targets measured in turns, each let settle before the next;
  ``gateway.bench.overhead_distinct``: a new prompt every request, with and without prefix affinity.
- ``gateway.bench.controller`` / ``gateway.bench.controller_report``: the route-state controllers and admission
  control under a load step, against simulated pools, and its report.
- ``gateway.bench.tenants``: a flooding tenant next to a steady one (and a high-priority one) on a simulated pool.
- ``gateway.bench.soak`` / ``gateway.bench.soak_checks``: many concurrent streams for a long time with faults on a
  schedule, and its invariants (one terminal outcome per request, gauges back to 0, flat memory, no busy endpoint
  ejected).
- ``gateway.bench.policies`` (mixes: ``mix``, load: ``load``, report: ``plots``, paired intervals: ``paired`` and
  ``variant``): routing policies across offered loads on simulated pools; ``gateway.bench.fleet``: a policy's
  servers and front, started and stopped; ``gateway.bench.jobs``: policies side by side, and a sweep that stops
  everything it started when interrupted; ``gateway.bench.peer``: the vllm-router peer policies' command line;
  ``gateway.bench.conversations`` / ``gateway.bench.multiturn`` / ``gateway.bench.multiturn_report``: multi-turn
  mixes (the conversation plan, the sweep that sends them with the servers' prefix hit rate, its report);
  ``gateway.bench.prefix_precision``: the gateway's predicted prefix hits against the servers' measured ones;
  ``gateway.bench.capacity`` / ``gateway.bench.capacity_judge``: each policy's sustainable rate of conversations,
  a saturated ceiling and then long holds at a share of it, judged by whether the turn backlog grows.
"""
