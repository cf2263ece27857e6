"""A pool of the routing YAML, as strict pydantic models: its endpoints (URL, weight, id, KV event publisher), its
timeouts, what its vLLM runs with, and its admission control. Part of ``gateway.config.schema.RoutingRules``.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.affinity import PrefixAffinity
from gateway.config.base import Name, Number, PoolKind, Strict

SpecMethod = Literal["ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix", "dflash"]


class Timeouts(Strict):
    connect_s: Number = Field(2.0, gt=0, description="TCP connect timeout to an endpoint.")
    first_byte_s: Number = Field(60.0, gt=0, description="Until the response headers / first byte arrive.")
    total_s: Number = Field(600.0, gt=0, description="Whole request, streaming included.")

    @model_validator(mode="after")
    def _ordered(self) -> Timeouts:
        if not self.connect_s <= self.first_byte_s <= self.total_s:
            raise ValueError(
                "thresholds out of order: need connect_s <= first_byte_s <= total_s, got "
                f"{self.connect_s} / {self.first_byte_s} / {self.total_s}"
            )
        return self


class Speculative(Strict):
    """Informational: what the pool's vLLM runs with (``--speculative-config``)."""

    method: SpecMethod
    num_speculative_tokens: int = Field(gt=0)
    draft_model: str | None = None


class Endpoint(Strict):
    url: str = Field(
        description="Base URL of one vLLM server, e.g. http://vllm-spec-0:8000",
        json_schema_extra={"pattern": "^https?://[^/?#]+"},  # for editors; the validator below decides
    )
    weight: Number = Field(1.0, ge=0, description="Relative weight; 0 = drained.")
    id: Name | None = Field(None, description="Stable id (default: host:port of the URL).")
    kv_events: str | None = Field(
        None,
        description="The server's KV cache event publisher (vLLM --kv-events-config endpoint), e.g. "
        "tcp://vllm-spec-0:5557: the gateway follows cache resets, restarts and the live block count to keep its "
        "prefix index honest. Off when not given.",
        json_schema_extra={"pattern": "^tcp://[^/?#]+:[0-9]+$"},
    )

    @field_validator("kv_events")
    @classmethod
    def _zmq_tcp(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"kv_events must be tcp://host:port (the server's publisher), got {v!r}")
        if parts.hostname == "*":
            raise ValueError(f"kv_events names the server to connect to, not a bind address: {v!r}")
        return v.rstrip("/")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint url must be http(s)://host[:port], got {v!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"endpoint url must not carry a query or fragment, got {v!r}")
        return v.rstrip("/")

    @property
    def endpoint_id(self) -> str:
        if self.id is not None:
            return self.id
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"


class Admission(Strict):
    """Admission control of one pool (``gateway.routing.overload``): the gateway admits at most
    routable endpoints x (``max_num_seqs`` + ``max_waiting_per_endpoint``) requests in flight to the pool; a request
    beyond that goes to another planned pool with room, or is answered 503 ``overloaded`` with ``Retry-After`` at
    once, so overload waits in one bounded, visible place instead of piling up timeouts."""

    enabled: bool = Field(True, description="Shed beyond the bound (needs the pool's max_num_seqs).")
    max_waiting_per_endpoint: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="Requests per routable endpoint admitted beyond max_num_seqs (they wait in vLLM's queue or for "
        "a connection); default max_num_seqs / 2 (at least 1).",
    )


class Pool(Strict):
    name: Name
    kind: PoolKind
    speculative: Speculative | None = Field(None, description="Required for kind speculative.")
    models: list[str] = Field(min_length=1, description="Model names this pool serves (as in /v1/models).")
    endpoints: list[Endpoint] = Field(min_length=1)
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the pool's API key (sent as Bearer).",
    )
    timeouts: Timeouts = Field(default_factory=Timeouts)
    max_connections: int = Field(256, gt=0, description="Connection pool size per endpoint.")
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Largest non-streaming answer (and largest decoded body of a compressed one) the gateway reads "
        "from the pool; past it the attempt fails (502, or the error event after the commit point).",
    )
    max_event_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest single server-sent event of a stream; past it the stream fails as above.",
    )
    max_num_seqs: int | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description="What each endpoint's vLLM runs at once (its --max-num-seqs): sizes admission control and tells "
        "a busy endpoint from a broken one. Unset: no admission bound for the pool.",
    )
    admission: Admission = Field(default_factory=Admission, description="Admission control (load shedding).")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="The pool's vLLM --scheduling-policy. priority: the gateway sets each request's body `priority` "
        "to its tenant's (tenants file; lower = served first); fcfs: the body's priority is left as the client "
        "sent it.",
    )
    prefix_affinity: PrefixAffinity | None = Field(
        None, description="Prefix-cache affinity of the endpoint pick in this pool (default: defaults.prefix_affinity)."
    )

    @model_validator(mode="after")
    def _kind_matches(self) -> Pool:
        if self.kind == "speculative" and self.speculative is None:
            raise ValueError("a speculative pool needs a `speculative` block (method, num_speculative_tokens)")
        if self.kind == "standard" and self.speculative is not None:
            raise ValueError("a standard pool must not have a `speculative` block")
        if self.admission.max_waiting_per_endpoint is not None and self.max_num_seqs is None:
            raise ValueError("admission.max_waiting_per_endpoint needs the pool's max_num_seqs (the bound adds to it)")
        return self
