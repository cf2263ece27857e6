"""The ``specgate`` command (typer only): parsing flags, calling into the packages, rendering for a terminal.

- ``main``: the command tree; every heavy import happens inside the command that needs it.
- ``serve``: ``specgate serve``: uvicorn with the client and admin listeners in one loop, or N workers.
- ``demo``: ``specgate demo``: the gateway in front of local simulated pools.
- ``admin`` / ``render``: the on-call commands (pools, weight, drain, force, overrides, audit, reload, explain) and
  their tables.
- ``console``: the two consoles and ``fail``.
"""
