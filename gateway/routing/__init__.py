"""Routing decisions: pure functions and state machines on plain data (no I/O; time is passed in).

- ``classify``: body + headers + rules → ``RequestFeatures`` and a traffic class; ``responses_features``: the same
  features read from a Responses API body.
- ``prompt_key``: a request's prompt rendered once and cut into chained chunk hashes, for prefix affinity.
- ``plan``: class + live pool views → an ordered attempt ``Plan`` (``plan_route``).
- ``decision``: the two together for one request (``decide``), shared by the proxy and explain.
- ``controller_rules``: a class controller's decision as an ordered tuple of named pure rules (``RULES``);
  ``controller``: one class's controller, which feeds the rules and applies their verdict; ``routing_state``: every
  controlled class's controller, fed by the scrape rounds; ``class_track``: what the state keeps per class (window
  counts, the class's seen temperatures, its observation of its two pools) and what it hands out; ``route_events``:
  what a route change leaves behind (metrics, a log line, the audit's callback);
  ``ownership``: who owns the speculative pool (the order of the classes on it, the visitor limit, the spill);
  ``estimate``: a class's expected completion time and cost on a pool.
- ``fairshare``: which tenant gets in at a full pool (priority bands, weighted fair share).
- ``attempts``: the attempt policy: which failures are retryable, the retry budget, outlier ejection.
"""
