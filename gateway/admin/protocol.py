"""The admin API's contract shared by the server and its clients (the CLI, the console): names and limits only.

Imports nothing of the gateway, so ``specgate pools`` and friends load this and ``admin.client`` and nothing of
the server.
"""

from __future__ import annotations

TOKEN_ENV = "SPECGATE_ADMIN_TOKEN"  # the admin token: the gateway's, and the one the CLI sends as Bearer
URL_ENV = "SPECGATE_ADMIN_URL"
ACTOR_ENV = "SPECGATE_ADMIN_ACTOR"
ACTOR_HEADER = "X-Specgate-Actor"  # who made a change, as the audit log records it
DEFAULT_URL = "http://127.0.0.1:8081"
MAX_REASON = 500  # characters of a change's reason
EXPLAIN_DEFAULT_PATH = "/v1/chat/completions"  # the client path explain assumes when none is given
