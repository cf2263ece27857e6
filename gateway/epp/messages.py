"""The ext_proc protocol messages (``envoy.service.ext_proc.v3``) the EPP sends back to Envoy.

Request phase: the request headers are answered with CONTINUE (the body follows, buffered), the body with the
destination header (``x-gateway-destination-endpoint: ip:port[,ip:port...]``, first choice first) and the same
list in the dynamic metadata ``envoy.lb`` that Envoy's override-host load balancing reads; a refusal is an
``ImmediateResponse`` with the gateway's OpenAI error envelope. Response phase: the decision headers are added,
and for an answer whose usage is read the response body is asked for (streamed, each chunk answered CONTINUE).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus

from gateway.errors import GatewayError

# Envoy's dynamic metadata namespace its override-host load balancing reads the destination from.
LB_NAMESPACE = "envoy.lb"
_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: HttpHeaders) -> tuple[dict[str, str], str, str]:
    """The request's headers (lower-case names, first value), its method and path (without the query)."""
    found: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        found.setdefault(h.key.lower(), value)
    path = found.get(":path", "/").split("?", 1)[0]
    return found, found.get(":method", "GET"), path


def _mutation(set_headers: Iterable[tuple[str, str]]) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode("latin-1")), append_action=_OVERWRITE)
            for k, v in set_headers
        ]
    )


# The answers below are built in place (``add()`` and attribute paths): passing sub-messages as constructor
# arguments copies each of them, which costs about twice as much per answer.


def _set_all(mutation: HeaderMutation, set_headers: Iterable[tuple[str, str]]) -> None:
    for k, v in set_headers:
        option = mutation.set_headers.add()
        option.append_action = _OVERWRITE
        header = option.header
        header.key = k
        header.raw_value = v.encode("latin-1")


def continue_headers() -> ProcessingResponse:
    """The request headers pass on unchanged (the decision comes with the body)."""
    return ProcessingResponse(request_headers=HeadersResponse())


def _destination(answer: ProcessingResponse, common: CommonResponse, header: str, addresses: list[str]) -> None:
    joined = ",".join(addresses)
    _set_all(common.header_mutation, ((header, joined),))
    answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[header].string_value = joined


def route_on_headers(header: str, addresses: list[str]) -> ProcessingResponse:
    """The destination set in the request headers' answer (a request without a body)."""
    answer = ProcessingResponse()
    _destination(answer, answer.request_headers.response, header, addresses)
    return answer


def route_on_body(header: str, addresses: list[str]) -> ProcessingResponse:
    """The destination set in the (buffered) request body's answer; the body passes on unchanged."""
    answer = ProcessingResponse()
    _destination(answer, answer.request_body.response, header, addresses)
    return answer


def refusal(exc: GatewayError, extra: Iterable[tuple[str, str]] = ()) -> ProcessingResponse:
    """Envoy answers the client itself: the gateway's status, OpenAI error envelope and headers."""
    headers = [("content-type", "application/json"), *exc.headers.items(), *extra]
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=exc.status),
            headers=_mutation(headers),
            body=orjson.dumps(exc.envelope()),
            details=f"specgate_{exc.code or exc.type}",
        )
    )


def decorate_response(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, read_body: bool = False
) -> ProcessingResponse:
    """The response headers with the decision headers added; ``read_body``: Envoy streams this response's body to
    the picker too (``mode_override``, honoured where the filter sets ``allow_mode_override``), for its usage."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    answer = ProcessingResponse()
    answer.response_headers.SetInParent()  # a response-headers answer even with nothing to add
    _set_all(answer.response_headers.response.header_mutation, items)
    if read_body:
        answer.mode_override.CopyFrom(ProcessingMode(response_body_mode=ProcessingMode.STREAMED))
    return answer


def continue_response_headers() -> ProcessingResponse:
    return ProcessingResponse(response_headers=HeadersResponse())


def continue_body() -> ProcessingResponse:
    """A chunk of a streamed request body passes on (the decision waits for its end)."""
    return ProcessingResponse(request_body=BodyResponse())


def continue_response_body() -> ProcessingResponse:
    return ProcessingResponse(response_body=BodyResponse())
