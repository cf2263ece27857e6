"""Micro-benchmarks of the gateway's hot path, run by hand or from ``specgate bench``; no I/O beyond reading rules.

- ``gateway.bench.classify``: the cost of classifying one request (with and without parsing its JSON body).
"""
