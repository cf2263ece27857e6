"""The running process: the config in force, its hot reload, and the container that wires everything.

- ``live``: ``LiveConfig``: everything built from one routing YAML (rules, classifier, pools, clients), swapped whole.
- ``reload``: triggers (file watch, SIGHUP, admin), validation first, one reference swap, old clients retired.
- ``watch``: a config file on disk: read as text, its signature, ``ConfigWatcher`` polling it for a new content.
- ``retire``: ``ClientRetirer``: closes the clients of a replaced config once nothing uses them.
- ``detached``: ``DetachedBudget``: caps the keyed generations kept running after their client went away.
- ``tenants``: ``Tenancy``: who a client key belongs to, the tenant's limits at admission, its requests per pool.
- ``container``: ``Runtime``: settings, live config, metrics, store, overrides, controllers and background tasks.
"""
