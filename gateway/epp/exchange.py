"""One ext_proc stream: one HTTP request through Envoy, from its headers to the end of its response.

Request headers -> CONTINUE (or, for a request without a body, the decision at once); request body (buffered by
Envoy, ``processing_mode.request_body_mode: BUFFERED``) -> the decision: the destination list or a refusal;
response headers -> the decision headers, naming the pool and endpoint that answered (Envoy's
``upstream.address`` attribute, so a fallback shows) and, for a speculative pool's answer that carries usage,
the response body asked for (``gateway.epp.usage``: acceptance and cached tokens, as proxy mode reads them). The
endpoint counts one request in flight from the decision
until the stream ends, and the request's record (metrics, access log line) is finished then, once.
"""

from __future__ import annotations

import time

from envoy.service.ext_proc.v3.external_processor_pb2 import HttpHeaders, ProcessingRequest, ProcessingResponse

from gateway.epp import messages
from gateway.epp.pick import DESTINATION_HEADER, Pick, pick
from gateway.epp.usage import UsageReader
from gateway.errors import GatewayError, PayloadTooLarge
from gateway.fleet.pools import EndpointState, PoolState
from gateway.observability.metrics import Outcome
from gateway.proxy.headers import request_id
from gateway.proxy.outcome import outcome_of, relayed
from gateway.proxy.record import RequestRecord
from gateway.runtime.container import Runtime

UPSTREAM_ADDRESS = "upstream.address"


def served_address(request: ProcessingRequest) -> str | None:
    """The ``upstream.address`` Envoy reports with the response headers (``response_attributes``), if any."""
    for attrs in request.attributes.values():
        field = attrs.fields.get(UPSTREAM_ADDRESS)
        if field is not None and field.string_value:
            return str(field.string_value)
    return None


class Exchange:
    """The EPP's side of one request. ``on`` answers each message Envoy sends; ``close`` runs once at the end."""

    def __init__(self, rt: Runtime, usage_bytes: int = 0) -> None:
        self.rt = rt
        self.usage_bytes = usage_bytes  # 0: the response body is never read
        self.usage: UsageReader | None = None
        self.record: RequestRecord | None = None
        self.headers: dict[str, str] = {}
        self.method = "GET"
        self.path = "/"
        self.body: list[bytes] = []
        self.size = 0
        self.picked: Pick | None = None
        self.holding: tuple[PoolState, EndpointState] | None = None  # the endpoint counted in flight
        self.refused: Outcome | None = None
        self.status = 0

    def on(self, request: ProcessingRequest) -> ProcessingResponse | None:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(request.request_headers)
        if kind == "request_body":
            return self._request_body(request.request_body.body, request.request_body.end_of_stream)
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            if self.usage is not None:
                self.usage.feed(request.response_body.body, request.response_body.end_of_stream)
            return messages.continue_response_body()
        return None  # trailers and anything newer: not subscribed to (processing_mode SKIP)

    def _request_headers(self, http: HttpHeaders) -> ProcessingResponse:
        self.headers, self.method, self.path = messages.header_map(http)
        self.record = RequestRecord(request_id(self.headers.get("x-request-id")), self.path)
        if http.end_of_stream:  # no body follows: decide on the headers alone
            return self._decide(b"", on_body=False)
        return messages.continue_headers()

    def _request_body(self, chunk: bytes, end: bool) -> ProcessingResponse:
        self.size += len(chunk)
        limit = self.rt.settings.max_body_bytes
        if self.size > limit:
            return self._refuse(PayloadTooLarge(f"request body is over {limit} bytes"))
        self.body.append(chunk)
        if not end:  # a streamed body: keep it until its end (bounded by max_body_bytes)
            return messages.continue_body()
        raw = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        return self._decide(raw, on_body=True)

    def _decide(self, raw: bytes, *, on_body: bool) -> ProcessingResponse:
        rec = self.record
        assert rec is not None
        try:
            p = pick(self.rt, self.method, self.path, self.headers, raw, rec)
        except GatewayError as exc:
            return self._refuse(exc)
        self.picked = p
        rec.route_reason = p.route_reason
        first = p.endpoints[0]
        self._hold(p.pools[p.addrs[0]], first)
        rec.upstream_start = time.perf_counter()
        addresses = p.addresses()
        if on_body:
            return messages.route_on_body(DESTINATION_HEADER, addresses)
        return messages.route_on_headers(DESTINATION_HEADER, addresses)

    def _refuse(self, exc: GatewayError) -> ProcessingResponse:
        rec = self.record
        extra: list[tuple[str, str]] = []
        if rec is not None:
            rec.status, rec.error = exc.status, exc.message
            extra.append(("x-request-id", rec.request_id))
        self.refused = outcome_of(exc)
        if exc.code == "overloaded":
            planned = rec.traffic_class if rec is not None else "none"
            self.rt.metrics.shed.labels(planned, "none", "admission").inc()
        return messages.refusal(exc, extra)

    def _hold(self, pool: PoolState, ep: EndpointState) -> None:
        self._release()
        ep.in_flight += 1
        self.rt.metrics.pool_in_flight(pool.name).inc(1)
        self.holding = (pool, ep)

    def _release(self) -> None:
        if self.holding is not None:
            pool, ep = self.holding
            ep.in_flight -= 1
            self.rt.metrics.pool_in_flight(pool.name).dec()
            self.holding = None

    def _response_headers(self, request: ProcessingRequest) -> ProcessingResponse:
        http = request.response_headers
        for h in http.headers.headers:
            if h.key == ":status":
                value = h.raw_value.decode("latin-1") if h.raw_value else h.value
                self.status = int(value) if value.isdigit() else 0
                break
        p, rec = self.picked, self.record
        if p is None or rec is None:
            return messages.continue_response_headers()
        rec.status = self.status
        rec.upstream_first = time.perf_counter()
        served = served_address(request)
        pool_ep = p.served(served) if served is not None else None
        if pool_ep is None and self.holding is not None:
            pool_ep = self.holding
        out: list[tuple[str, str]] = [("x-request-id", rec.request_id), *p.headers]
        if pool_ep is not None:
            pool, ep = pool_ep
            if self.holding is not None and self.holding[1] is not ep:
                self._hold(pool, ep)  # Envoy fell back to another endpoint of the list
            rec.pool, rec.endpoint = pool.name, ep.id
            out += [("x-specgate-pool", pool.name), ("x-specgate-endpoint", ep.id)]
            if self.usage_bytes and p.usage and self.status == 200 and pool.spec.kind == "speculative":
                self.usage = UsageReader(p.stream, self.usage_bytes)
        return messages.decorate_response(out, read_body=self.usage is not None)

    def close(self) -> None:
        """The stream ended (the request is over, or Envoy gave up on it): release and record, once."""
        self._release()
        rec = self.record
        if rec is None:
            return
        if self.usage is not None:
            rec.spec, rec.cached_tokens = self.usage.sample, self.usage.cached_tokens
        if self.refused is not None:
            rec.finish(self.refused, self.rt.metrics, self.rt.access_log)
        elif self.status:  # the time to first token is not seen here (the response body is not read)
            rec.finish(relayed(self.status), self.rt.metrics, self.rt.access_log)
        else:
            rec.finish("client_disconnect", self.rt.metrics, self.rt.access_log)
