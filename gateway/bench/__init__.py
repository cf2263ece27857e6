"""Benchmarks of the gateway's hot path, run by hand or from ``specgate bench``.

- ``gateway.bench.classify``: the CPU cost of classifying one request (with and without parsing its JSON body);
  pure, no I/O beyond reading the routing YAML.
- ``gateway.bench.overhead`` / ``gateway.bench.static_upstream``: the latency the whole gateway adds per request,
  against a static upstream.
"""
