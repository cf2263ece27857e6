"""Routing decisions: pure functions and state machines on plain data (no I/O; time is passed in).

- ``classify``: body + headers + rules → ``RequestFeatures`` and a traffic class; ``responses_features``: the same
  features read from a Responses API body.
- ``prompt_key``: a request's prompt rendered once and cut into chained chunk hashes, for prefix affinity.
- ``plan``: class + live pool views → an ordered attempt ``Plan`` (``plan_route``).
- ``decision``: the two together for one request (``decide``), shared by the proxy and explain.
- ``controller`` / ``route_state``: per-class controllers (hysteresis, hold, guard) and their state for all classes;
  ``class_track``: what the state keeps per class (window counts, the class's seen temperatures), its metrics, and
  what it hands out;
  ``estimate``: a class's expected completion time on a pool.
- ``fairshare``: which tenant gets in at a full pool (priority bands, weighted fair share).
- ``attempts``: the attempt policy: which failures are retryable, the retry budget, outlier ejection.
"""
