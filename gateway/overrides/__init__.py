"""On-call overrides: weights, drains and forced class routes, each with a TTL and a reason, shared by replicas.

- ``model``: validating operator input (TTL, weight, reason).
- ``override``: ``Override`` (one override, its JSON form and checks) and the effective-weight precedence.
- ``manager``: ``OverrideManager``: the overrides in force, applied to pools and classes, expired on time.
- ``store``: where overrides and the audit log live (memory, or Redis with pub/sub to every replica).
- ``audit``: the audit log records (admin changes, expiries, controller transitions).
"""
