"""Process settings of ``specgate epp`` that must be in place before gRPC is imported.

``GRPC_EXPERIMENTS``: gRPC's C core moves socket I/O, listening and polling to its EventEngine by default; in
grpc.aio every completion then crosses from an EventEngine thread to the event loop's thread, a context switch
and a GIL hand-over per message. The older poller does the I/O on the poller thread that grpc.aio runs anyway:
measured through Envoy, about a seventh less of the picker's CPU per request for the same answers. An operator's
own ``GRPC_EXPERIMENTS`` is left as it is (these switches go away when gRPC drops the old path; they are then
ignored and the default applies).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

GRPC_EXPERIMENTS = "-event_engine_for_all_other_endpoints,-event_engine_listener"


def prefer_poller_io(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn gRPC's EventEngine I/O off for this process unless the environment says otherwise; False when gRPC
    was imported already (too late: the core reads its experiments once) or ``GRPC_EXPERIMENTS`` is set."""
    if "grpc" in sys.modules or "GRPC_EXPERIMENTS" in environ:
        return False
    environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
    return True
