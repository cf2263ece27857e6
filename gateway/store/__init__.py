"""Shared state of the gateway: the ``Store`` protocol and its in-memory and Redis implementations.

- ``base``: the ``Store`` protocol: Idempotency-Key claims with owner tokens and leases, stored responses.
- ``memory`` / ``redis``: one process, or every replica through Redis.
- ``ratelimit``: the tenants' requests- and tokens-per-minute buckets (GCRA), in memory or in Redis.
- ``health``: which store a process uses (``build_store``) and whether it can be reached now.
"""
