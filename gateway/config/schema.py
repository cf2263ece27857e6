"""The routing YAML, as strict pydantic models.

Parsing is strict (``extra="forbid"`` everywhere, no coercion from strings to numbers); the semantic checks
that need the whole document (pool references, a catch-all class, unique names) live in
``gateway.config.loader``. Field descriptions end up in ``routing_rules/schema.json`` for editors. A pool's block
(endpoints, timeouts, admission) is ``gateway.config.pool``.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import re2
from pydantic import AfterValidator, Field, model_validator

from gateway.config.affinity import PrefixAffinity as PrefixAffinity  # re-exported: prefix affinity in a pool
from gateway.config.base import Name, Number, OptionalNumber, Strict
from gateway.config.base import PoolKind as PoolKind  # re-exported: the YAML's pool kinds
from gateway.config.controller import ControllerConfig as ControllerConfig  # re-exported: a class's block
from gateway.config.controller import balancing_controller
from gateway.config.operations import MetricNames as MetricNames  # re-exported: the scrape's metric names
from gateway.config.operations import Overload as Overload  # re-exported
from gateway.config.operations import Scrape as Scrape  # re-exported
from gateway.config.pool import Pool

TASK_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
# Lower case: the X-Task-Type header is lower-cased before it is compared.
TaskName = Annotated[str, Field(pattern=TASK_PATTERN)]


def re2_options() -> re2.Options:
    """Task-rule patterns run on RE2: linear time whatever the pattern or the text (no ReDoS from client input),
    and a whole rule set is matched in one pass. Case-insensitive; no lookaround, no backreferences."""
    opts = re2.Options()
    opts.case_sensitive = False
    opts.log_errors = False
    return opts


def _compilable(pattern: str) -> str:
    try:
        re2.compile(pattern, re2_options())
    except re2.error as exc:
        detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"invalid regular expression {pattern!r} (RE2 syntax): {detail}") from exc
    return pattern


# Validated one by one, so that an error names the item (``task_rules[3].patterns[1]``) and its line.
Pattern = Annotated[str, AfterValidator(_compilable)]

TextScope = Literal["system", "last_user"]


class Range(Strict):
    """A numeric condition: every bound given must hold. A missing ``max_tokens`` counts as +infinity."""

    lt: OptionalNumber = None
    lte: OptionalNumber = None
    gt: OptionalNumber = None
    gte: OptionalNumber = None

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.lt is None and self.lte is None and self.gt is None and self.gte is None:
            raise ValueError("a range needs at least one of lt, lte, gt, gte")
        if any(b is not None and math.isnan(b) for b in (self.lt, self.lte, self.gt, self.gte)):
            raise ValueError("a range bound must be a number, not NaN (nothing would ever match)")
        lower = max(
            (b for b in (self.gt, self.gte) if b is not None),
            default=-math.inf,
        )
        upper = min(
            (b for b in (self.lt, self.lte) if b is not None),
            default=math.inf,
        )
        strict = (self.gt is not None and self.gt == lower) or (self.lt is not None and self.lt == upper)
        if lower > upper or (strict and lower == upper):
            raise ValueError(f"thresholds out of order: the range is empty (lower {lower}, upper {upper})")
        return self

    def contains(self, x: float) -> bool:
        if self.lt is not None and not x < self.lt:
            return False
        if self.lte is not None and not x <= self.lte:
            return False
        if self.gt is not None and not x > self.gt:
            return False
        return not (self.gte is not None and not x >= self.gte)


class OneOf(Strict):
    """A set condition: the feature's value must be one of ``in``."""

    in_: list[str] = Field(alias="in", min_length=1)


class Conditions(Strict):
    """Conditions of a traffic class; all given must match. No conditions at all makes a catch-all class."""

    temperature: Range | None = Field(None, description="Sampling temperature (missing = defaults.temperature).")
    top_p: Range | None = Field(None, description="Nucleus sampling top_p (missing = defaults.top_p).")
    max_tokens: Range | None = Field(
        None, description="max_tokens or max_completion_tokens; missing = unbounded (+inf)."
    )
    n: Range | None = Field(None, description="Number of choices requested (missing = 1).")
    prompt_tokens: Range | None = Field(None, description="Approximate prompt size in tokens.")
    stream: bool | None = Field(None, description="Whether the client asked for a stream.")
    tools: bool | None = Field(None, description="Whether tools or tool_choice are present.")
    response_format: OneOf | None = Field(
        None, description="response_format.type: text (also when missing), json_object, json_schema, ..."
    )
    model: OneOf | None = Field(None, description="The requested model name.")
    task_type: OneOf | None = Field(None, description="Task type from X-Task-Type or the task rules.")
    endpoint: OneOf | None = Field(None, description="chat, completions or responses (the Responses API).")
    reasoning: OneOf | None = Field(
        None, description="Reasoning effort asked for (reasoning.effort / reasoning_effort): none when absent."
    )

    def is_empty(self) -> bool:
        return all(getattr(self, f) is None for f in type(self).model_fields)


class TaskRule(Strict):
    """Assigns a task type. Rules are tried in order; every given part must match; the first match wins."""

    task: TaskName
    response_format: OneOf | None = Field(None, description="Match on response_format.type.")
    tools: bool | None = Field(None, description="Match when tools/tool_choice are (not) present.")
    patterns: list[Pattern] = Field(
        default_factory=list,
        description="Regular expressions in RE2 syntax (case-insensitive; no lookaround; \\b is an ASCII word "
        "boundary); any one found in the scoped text matches.",
    )
    scope: list[TextScope] = Field(
        default_factory=lambda: list[TextScope](("system", "last_user")),
        min_length=1,
        description="Which texts the patterns look at: the system prompt and/or the last user message.",
    )

    @model_validator(mode="after")
    def _not_empty(self) -> TaskRule:
        if self.response_format is None and self.tools is None and not self.patterns:
            raise ValueError("a task rule needs at least one of response_format, tools, patterns")
        return self


class Saturation(Strict):
    """When the preferred pool counts as saturated, so the class goes to ``route.saturated``."""

    max_inflight_per_endpoint: int | None = Field(
        None, gt=0, description="Gateway in-flight requests per routable endpoint of the preferred pool."
    )


class Route(Strict):
    preferred: Name = Field(description="The pool this class goes to normally.")
    saturated: Name | None = Field(None, description="The pool to use while the preferred one is saturated.")
    fallback: list[Name] = Field(
        default_factory=list, description="Ordered pools to try when the chosen pool fails before the commit."
    )
    saturation: Saturation = Field(default_factory=Saturation)
    ttft_deadline_s: OptionalNumber = Field(
        None,
        gt=0,
        description="Streams: an attempt with no first event within this many seconds moves on to the next pool "
        "(default: the pool's timeouts.first_byte_s). Non-streaming answers are bounded by total_s only.",
    )
    fallback_model: str | None = Field(
        None,
        min_length=1,
        description="A fallback pool that does not serve the requested model may serve this model instead (the "
        "body's model is rewritten for that attempt; header x-specgate-model). Off (null) by default: another "
        "model's answer is not equivalent.",
    )
    pin: PoolKind | None = Field(
        None,
        description="Never send this class to a pool of the other kind (e.g. for quality reasons): pools of the "
        "other kind are left out of its plans, and no controller moves it. None: any pool serving the model may "
        "take it when that is clearly faster (with a controller block or defaults.controller).",
    )


class TrafficClass(Strict):
    name: Name
    description: str | None = None
    when: Conditions = Field(default_factory=Conditions)
    route: Route
    controller: ControllerConfig | None = Field(
        None,
        description="Live speculative/standard controller; none = defaults.controller, or the static route above "
        "without one.",
    )
    require_idempotency_key: bool = Field(
        False, description="Answer 400 to requests of this class without an Idempotency-Key header."
    )


class Idempotency(Strict):
    """Requests with an ``Idempotency-Key`` header (``gateway.proxy.idempotency``): the stored response's lifetime, the
    claim's lease, and what a repeat or an unreachable store gets."""

    ttl_s: Number = Field(86400.0, gt=0, description="How long a completed response is kept for replay.")
    lease_s: Number = Field(
        30.0, gt=0, description="Lease of a running claim, renewed every lease_s/3 while the request runs."
    )
    on_running: Literal["reject", "wait"] = Field(
        "reject", description="A repeat while the first request runs: 409 (reject), or wait and replay (wait)."
    )
    wait_timeout_s: Number = Field(60.0, gt=0, description="on_running wait: 409 after waiting this long.")
    store_unavailable: Literal["refuse", "proceed"] = Field(
        "refuse", description="Keyed requests while the store is unreachable: 503 (refuse), or run without a key."
    )
    max_response_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest response stored for replay; a larger one leaves the key used, and its replays get 410 "
        "idempotency_response_not_stored (never a second generation).",
    )


class Admin(Strict):
    """On-call overrides through the admin API (``gateway.overrides.manager``): how long a change lasts without an
    explicit
    ``ttl``, and the longest ``ttl`` accepted ("never" is always accepted when asked for explicitly)."""

    default_ttl_s: Number = Field(3600.0, gt=0, description="Lifetime of an override sent without a ttl.")
    max_ttl_s: Number = Field(604800.0, gt=0, description="Longest ttl an override may ask for (except 'never').")

    @model_validator(mode="after")
    def _ordered(self) -> Admin:
        if self.default_ttl_s > self.max_ttl_s:
            raise ValueError(
                f"thresholds out of order: default_ttl_s {self.default_ttl_s} > max_ttl_s {self.max_ttl_s}"
            )
        return self


class RetryBudget(Strict):
    """Process-wide cap on retries (Envoy's retry budget): retries in progress may not exceed ``ratio`` x the
    requests in progress, or ``min_retries``, whichever is larger. A retry refused by it ends the request (503)."""

    ratio: Number = Field(0.2, ge=0, le=1, description="Share of the active requests that may be retries at once.")
    min_retries: int = Field(3, ge=0, description="Concurrent retries always allowed, however few requests run.")


class OutlierDetection(Strict):
    """Passive ejection of an endpoint after consecutive failed attempts; it comes back once its ejection has
    expired and an active health check passes. The k-th ejection in a row lasts base_ejection_s x 2^(k-1), at
    most max_ejection_s; k starts again after max_ejection_s without an ejection."""

    consecutive_failures: int = Field(5, ge=1, description="Failed attempts in a row that eject the endpoint.")
    base_ejection_s: Number = Field(30.0, gt=0, description="Length of the first ejection.")
    max_ejection_s: Number = Field(
        300.0,
        gt=0,
        description="Longest ejection; also the quiet time that resets k, and the longest ejection taken from "
        "another replica (the cluster snapshot, the shared counts).",
    )
    max_ejection_percent: Number = Field(
        50.0,
        ge=0,
        le=100,
        description="Of each pool's endpoints, the share (at least one) that may be ejected at once on another "
        "replica's word (the cluster snapshot, the shared counts); never the last routable endpoint of a model.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> OutlierDetection:
        if self.base_ejection_s > self.max_ejection_s:
            raise ValueError(
                f"thresholds out of order: base_ejection_s {self.base_ejection_s} > max_ejection_s "
                f"{self.max_ejection_s}"
            )
        return self


class Defaults(Strict):
    temperature: Number = Field(1.0, ge=0, description="Assumed when a request has no temperature (OpenAI: 1.0).")
    top_p: Number = Field(1.0, ge=0, le=1, description="Assumed when a request has no top_p.")
    task_type: TaskName = Field("chat", description="Task type when no header and no task rule applies.")
    chars_per_token: Number = Field(4.0, gt=0, description="For the approximate prompt size.")
    task_scan_chars: int = Field(
        16384, ge=256, description="Task-rule patterns see at most this many characters of a text (head and tail)."
    )
    max_attempts: int = Field(2, ge=1, le=10, description="Attempts per request across pools (before commit).")
    retry_budget: RetryBudget = Field(default_factory=RetryBudget, description="Process-wide cap on retries.")
    outlier_detection: OutlierDetection = Field(
        default_factory=OutlierDetection, description="Passive ejection of endpoints that keep failing."
    )
    controller: ControllerConfig | None = Field(
        default_factory=balancing_controller,
        description="The controller of every class that has no controller block of its own and no route.pin. Left "
        "out: a balancing controller (home + spill both ways by expected completion time, static route while "
        "measurements are missing); null: such classes keep their static route.",
    )
    prefix_affinity: PrefixAffinity = Field(
        default_factory=PrefixAffinity,
        description="Prefix-cache affinity of the endpoint pick inside a pool, for every pool without its own block.",
    )


class RoutingRules(Strict):
    """The whole routing YAML."""

    version: Literal[1] = 1
    defaults: Defaults = Field(default_factory=Defaults)
    pools: list[Pool] = Field(min_length=1)
    embeddings_pool: Name | None = Field(None, description="Pool that serves POST /v1/embeddings.")
    task_rules: list[TaskRule] = Field(default_factory=list)
    classes: list[TrafficClass] = Field(min_length=1, description="First match wins; the last is a catch-all.")
    scrape: Scrape = Field(default_factory=Scrape, description="Scraping of the endpoints' /metrics and /health.")
    idempotency: Idempotency = Field(default_factory=Idempotency, description="Idempotency-Key handling.")
    admin: Admin = Field(default_factory=Admin, description="On-call overrides through the admin API.")
    overload: Overload = Field(default_factory=Overload, description="Load shedding and stalled clients.")

    def controller_of(self, cls: TrafficClass) -> ControllerConfig | None:
        """The class's controller config: its own block, else ``defaults.controller``; none for a pinned class."""
        if cls.route.pin is not None:
            return None
        return cls.controller if cls.controller is not None else self.defaults.controller

    def controller_pools(self, cls: TrafficClass) -> tuple[str, str] | None:
        """(speculative pool, standard pool) a controller of the class moves it between: its home
        (``route.preferred``) and the first pool of the other kind among route.saturated, route.fallback, then every
        pool in order. None when the home is unknown or no pool of the other kind exists."""
        kinds = {p.name: p.kind for p in self.pools}
        home = kinds.get(cls.route.preferred)
        if home is None:
            return None
        names = ([cls.route.saturated] if cls.route.saturated else []) + list(cls.route.fallback) + list(kinds)
        away = next((n for n in names if kinds.get(n) not in (None, home)), None)
        if away is None:
            return None
        return (cls.route.preferred, away) if home == "speculative" else (away, cls.route.preferred)

    def affinity_of(self, pool: Pool) -> PrefixAffinity:
        """The pool's prefix affinity: its own block, else ``defaults.prefix_affinity``."""
        return pool.prefix_affinity if pool.prefix_affinity is not None else self.defaults.prefix_affinity

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)
