"""The ``specgate`` command (typer only): parsing flags, calling into the packages, rendering for a terminal.

- ``main``: the command tree (``build``: every module's ``COMMANDS``, registered one way), and the ``serve``,
  ``epp``, ``validate`` and ``demo`` commands; every heavy import happens inside the command that needs it.
- ``options``: a command's options built from ``Settings``' field declarations (``settings_command``).
- ``serve``: running ``specgate serve``: uvicorn with the client and admin listeners in one loop, or N workers.
- ``epp``: running ``specgate epp``: the Endpoint Picker with its admin and probe listeners.
- ``demo``: ``specgate demo``: the gateway in front of local simulated pools.
- ``admin`` / ``tables``: the on-call commands (pools, weight, drain, force, overrides, audit, reload) and their
  tables; ``explain`` / ``render``: ``specgate explain`` and its tables.
- ``bench`` / ``bench_sweeps``: ``specgate bench …``; ``report``: ``specgate report …``.
- ``console``: the two consoles, ``fail``, and ``Command`` (a command as it is registered).
"""
