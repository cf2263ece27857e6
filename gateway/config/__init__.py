"""Configuration: the process settings and the routing YAML.

- ``settings``: flags and ``SPECGATE_*`` variables, resolved once (``Settings``); ``setting_spec``: how one of its
  fields is declared (default, help, bounds, source) and read from its variable.
- ``schema``: the routing YAML as strict pydantic models (``pool``: a pool, its endpoints, timeouts and admission;
  ``operations``: its scrape and overload sections; ``affinity``: the ``prefix_affinity`` block);
  ``checks``: whole-document checks;
  ``loader``: parse + validate with errors that name the YAML path and line; ``jsonschema``: the editor schema.
- ``tenants``: the tenants file (``--tenants-file``): each tenant's keys, priority, share weight and limits.
- ``packaged``: files shipped in the package: ``default_rules.yaml``, the default routing YAML (a copy of the
  repository's ``routing_rules/default.yaml``, kept equal by a test), for ``specgate demo`` and the benchmarks.

The live snapshot built from a loaded YAML, and its hot reload, are in ``gateway.runtime``.
"""
