"""The HTTP side of the admin CLI: one call to the admin API, its answer, or an ``AdminFailure`` with the exit code
scripts can rely on (``EXIT_*``). No typer, no rich: the commands in ``gateway.cli.admin`` print.

Each change the CLI makes is built by a ``*_call`` function as a ``Call`` (method, path, the OpenAPI path template,
body), so the tests can check every body the CLI sends against the OpenAPI request schemas.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from gateway.admin.protocol import ACTOR_HEADER, MAX_REASON, TOKEN_ENV

EXIT_OK = 0  # the operation was done (or the answer printed)
EXIT_REFUSED = 1  # the admin API refused or failed it (4xx/5xx other than 401/403): its message is printed
EXIT_USAGE = 2  # a usage error, or the admin API cannot be reached at --url
EXIT_AUTH = 3  # authentication failed (401/403): the message says what to set

CLASS_ROUTES = ("speculative", "standard", "auto")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


class AdminFailure(Exception):
    """The call did not succeed: ``message`` for the user, ``exit_code`` for scripts, ``data`` the JSON answer."""

    def __init__(self, message: str, exit_code: int, data: dict[str, Any] | None = None, status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.data = data
        self.status = status  # the HTTP status; 0 when there was no answer


@dataclass(frozen=True, slots=True)
class Call:
    """One admin API request: method, concrete path, the OpenAPI path template it instantiates, body and query."""

    method: str
    path: str  # the concrete path, segments percent-encoded
    template: str  # the OpenAPI path template it instantiates ("/admin/pools/{pool}/weight")
    body: dict[str, Any] | None = None
    params: dict[str, str] | None = None


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h', '1d' → seconds (> 0). Raises ``ValueError`` with a message for the user."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration: use seconds or a number with s, m, h or d (e.g. 30m)")
    seconds = float(m.group(1)) * _UNITS[(m.group(2) or "s").lower()]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r}: a duration must be more than 0 seconds")
    return seconds


def parse_ttl(text: str | None) -> float | int | str | None:
    """``--ttl`` for the request body: None (omitted: the YAML default), "never" (until removed) or seconds."""
    if text is None:
        return None
    if text.strip().lower() == "never":
        return "never"
    seconds = parse_duration(text)
    return int(seconds) if seconds == int(seconds) else seconds


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: a duration ago ('30m'), an epoch number ('1767225600') or an ISO time ('2026-01-01T03:00')."""
    stripped = text.strip()
    try:
        value = float(stripped)
    except ValueError:
        pass
    else:
        if math.isfinite(value) and value > 1e6:  # an epoch; a small bare number is a duration in seconds
            return value
    try:
        return (time.time() if now is None else now) - parse_duration(stripped)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(stripped).timestamp()
    except ValueError:
        raise ValueError(
            f"{text!r}: use a duration ago (30m), an epoch time or an ISO time (2026-01-01T03:00)"
        ) from None


def check_reason(reason: str) -> str:
    reason = reason.strip()
    if not reason:
        raise ValueError("--reason must not be empty: say why, for whoever reads the audit log")
    if len(reason) > MAX_REASON:
        raise ValueError(f"--reason is {len(reason)} characters; at most {MAX_REASON}")
    return reason


def _seg(name: str) -> str:
    return quote(name, safe="")


def _with_ttl(body: dict[str, Any], ttl: str | None) -> dict[str, Any]:
    value = parse_ttl(ttl)
    if value is not None:
        body["ttl"] = value
    return body


def weight_call(target: str, weight: float, ttl: str | None, reason: str) -> Call:
    """``POOL`` or ``POOL/ENDPOINT`` → the pool-weight or endpoint-weight change."""
    pool, sep, endpoint = target.partition("/")
    if not pool or (sep and not endpoint) or "/" in endpoint:
        raise ValueError(f"{target!r}: expected POOL or POOL/ENDPOINT")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"weight must be a number >= 0, got {weight}")
    body = _with_ttl({"weight": int(weight) if weight == int(weight) else weight, "reason": check_reason(reason)}, ttl)
    if sep:
        return Call(
            "PUT",
            f"/admin/pools/{_seg(pool)}/endpoints/{_seg(endpoint)}/weight",
            "/admin/pools/{pool}/endpoints/{endpoint}/weight",
            body,
        )
    return Call("PUT", f"/admin/pools/{_seg(pool)}/weight", "/admin/pools/{pool}/weight", body)


def drain_call(pool: str, ttl: str | None, reason: str) -> Call:
    body = _with_ttl({"reason": check_reason(reason)}, ttl)
    return Call("POST", f"/admin/pools/{_seg(pool)}/drain", "/admin/pools/{pool}/drain", body)


def undrain_call(pool: str, reason: str) -> Call:
    body = {"reason": check_reason(reason)}
    return Call("POST", f"/admin/pools/{_seg(pool)}/undrain", "/admin/pools/{pool}/undrain", body)


def force_call(klass: str, route: str, ttl: str | None, reason: str) -> Call:
    if route not in CLASS_ROUTES:
        raise ValueError(f"route must be one of {', '.join(CLASS_ROUTES)}, got {route!r}")
    body = _with_ttl({"route": route, "reason": check_reason(reason)}, ttl)
    return Call("PUT", f"/admin/classes/{_seg(klass)}/route", "/admin/classes/{class}/route", body)


def remove_override_call(override_id: str, reason: str) -> Call:
    params = {"reason": check_reason(reason)}
    return Call("DELETE", f"/admin/overrides/{_seg(override_id)}", "/admin/overrides/{id}", params=params)


def audit_call(limit: int | None, since: float | None) -> Call:
    params: dict[str, str] = {}
    if limit is not None:
        params["limit"] = str(limit)
    if since is not None:
        params["since"] = repr(since)
    return Call("GET", "/admin/audit", "/admin/audit", params=params)


def get_call(path: str) -> Call:
    return Call("GET", path, path)


def _error(data: Any) -> dict[str, Any]:
    e = data.get("error") if isinstance(data, dict) else None
    return e if isinstance(e, dict) else {}


@dataclass(frozen=True, slots=True)
class AdminClient:
    """The admin API's HTTP client for the on-call commands: ``send`` a ``Call`` with the token and actor,
    get its JSON answer or an ``AdminFailure`` that says what went wrong."""

    url: str
    token: str | None
    timeout_s: float = 10.0
    actor: str | None = None

    def send(self, call: Call) -> dict[str, Any]:
        """The JSON answer of a 2xx; anything else raises ``AdminFailure``."""
        headers = {"accept": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        if self.actor:
            headers[ACTOR_HEADER] = self.actor
        content = None if call.body is None else orjson.dumps(call.body)
        if content is not None:
            headers["content-type"] = "application/json"
        try:
            r = httpx.request(
                call.method,
                self.url.rstrip("/") + call.path,
                params=call.params,
                content=content,
                headers=headers,
                timeout=self.timeout_s,
            )
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            raise AdminFailure(f"bad --url {self.url!r}: {exc}", EXIT_USAGE) from exc
        except httpx.HTTPError as exc:
            raise AdminFailure(
                f"cannot reach the admin API at {self.url}: {exc or type(exc).__name__}. "
                "Is the gateway running with --admin-port? Check --url (or SPECGATE_ADMIN_URL).",
                EXIT_USAGE,
            ) from exc
        return self._answer(r)

    def _answer(self, r: httpx.Response) -> dict[str, Any]:
        try:
            data = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            data = None
        body = data if isinstance(data, dict) else None
        error = _error(data)
        message = str(error["message"]) if error.get("message") else None
        if r.status_code in (401, 403):
            message = self._auth_message(r.status_code, message, error.get("code"))
            raise AdminFailure(message, EXIT_AUTH, body, r.status_code)
        if r.status_code >= 400:
            if message is None:
                if r.status_code in (404, 405):  # no envelope: not a specgate admin API at all
                    raise AdminFailure(
                        f"{self.url} answered {r.status_code} without a specgate error: "
                        "is this the gateway's admin port (--admin-port)? Check --url.",
                        EXIT_USAGE,
                        body,
                        r.status_code,
                    )
                message = r.text[:300].strip() or r.reason_phrase
            raise AdminFailure(f"the admin API answered {r.status_code}: {message}", EXIT_REFUSED, body, r.status_code)
        if body is None:
            message = f"{self.url} did not answer like a specgate admin API: check --url"
            raise AdminFailure(message, EXIT_USAGE, None, r.status_code)
        return body

    def _auth_message(self, status: int, message: str | None, code: Any) -> str:
        said = f"the admin API answered {status}: {message or 'not authorised'}. "
        if status == 403 and code == "admin_token_not_set":
            return said + (
                f"The gateway refuses changes until it runs with {TOKEN_ENV} set: set it on the gateway and "
                f"restart, and set the same value here."
            )
        if status == 403:
            return said + f"Check that {TOKEN_ENV} is the gateway's admin token."
        if self.token is None:
            return said + f"Set {TOKEN_ENV} to the gateway's admin token."
        return said + f"{TOKEN_ENV} is not the gateway's admin token: check it (and --url)."


# --- reading the answers (plain text; the CLI adds the tables) -------------------------------------------------


def error_details(data: dict[str, Any] | None) -> list[str]:
    """Path-named errors an answer may list (a refused reload): ``errors`` in the envelope or beside it."""
    if not isinstance(data, dict):
        return []
    e = data.get("error")
    items = (e.get("errors") if isinstance(e, dict) else None) or data.get("errors") or []
    lines: list[str] = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict):
            where = item.get("path") or item.get("loc") or item.get("param")
            if where and item.get("line") is not None:
                where = f"{where} (line {item['line']})"
            what = item.get("message") or item.get("msg") or orjson.dumps(item).decode()
            lines.append(f"{where}: {what}" if where else str(what))
        else:
            lines.append(str(item))
    return lines


def local_time(epoch: Any) -> str:
    if not isinstance(epoch, int | float) or isinstance(epoch, bool) or not math.isfinite(epoch):
        return "–"
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def expires_text(epoch: Any, now: float | None = None) -> str:
    """'in 29m59s (03:41:00)', 'never (until removed)'."""
    if epoch is None:
        return "never (until removed)"
    if not isinstance(epoch, int | float) or isinstance(epoch, bool) or not math.isfinite(epoch):
        return "–"
    left = int(epoch - (time.time() if now is None else now))
    clock = local_time(epoch)[11:]
    if left <= 0:
        return f"expired ({clock})"
    h, rest = divmod(left, 3600)
    span = f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"
    return f"in {span} ({clock})"


def describe_target(o: dict[str, Any]) -> str:
    if o.get("class") is not None:
        return f"class {o['class']}"
    if o.get("endpoint") is not None:
        return f"endpoint {o.get('pool')}/{o['endpoint']}"
    return f"pool {o.get('pool')}"


def number_text(value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "–"
    return str(int(value)) if value == int(value) else f"{value:.2f}"


def describe_value(o: dict[str, Any]) -> str:
    if o.get("kind") == "drain":
        return "drained"
    if o.get("kind") == "class_route":
        return f"route {o.get('value')}"
    return f"weight {number_text(o.get('value'))}"


def ejected(endpoint: dict[str, Any]) -> bool | None:
    """``ejected`` when the state says; else derived (routable = healthy, weight > 0, not ejected); None: unknown."""
    if isinstance(endpoint.get("ejected"), bool):
        return bool(endpoint["ejected"])
    weight = endpoint.get("effective_weight", endpoint.get("weight"))
    if endpoint.get("healthy") is not True or not isinstance(weight, int | float) or weight <= 0:
        return None
    routable = endpoint.get("routable")
    return None if not isinstance(routable, bool) else not routable


def detail_text(detail: Any, width: int = 80) -> str:
    """An audit record's detail in a table cell: an override as its id and value, anything else as compact JSON."""
    if not detail:
        return ""
    if isinstance(detail, dict) and isinstance(detail.get("override"), dict):
        o = detail["override"]
        until = "removed" if o.get("expires_at") is None else local_time(o.get("expires_at"))
        text = f"{o.get('id')}: {describe_value(o)}, until {until}"
        replaced = detail.get("replaced")
        if isinstance(replaced, dict):
            text += f" (replaced {replaced.get('id')})"
        return text
    text = orjson.dumps(detail, option=orjson.OPT_NON_STR_KEYS).decode()
    return text if len(text) <= width else text[: width - 1] + "…"
