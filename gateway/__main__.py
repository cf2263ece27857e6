"""``python -m gateway`` is the ``specgate`` command."""

from gateway.cli.main import main

main()
