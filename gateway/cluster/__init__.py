"""Cluster mode: several gateway replicas (and ``--workers``) acting as one, through Redis.

- ``lease``: the leader lease (``SET NX PX`` + compare-and-set renew/release).
- ``snapshot``: the fleet snapshot the leader publishes (endpoint health and ejections, pool loads, class shares)
  and how a follower applies it.
- ``node``: one replica's side: its role (leader / follower / local), publishing and following the snapshot, and
  writing and reading the shared counts.
- ``counts``: the shared counts themselves: what one replica contributes (in-flight per endpoint, per-class counts,
  its own ejections), the checks a contribution read back passes, the sums of the others'.
"""
