"""An OTLP gRPC trace receiver that counts and discards what it gets: the collector of ``specgate bench overhead
--tracing`` (``python -m gateway.bench.otlp_sink --port N``). Needs the ``tracing`` extra (gRPC).

It answers ``TraceService/Export`` without decoding the request (a collector's own work, which a deployment runs
on other cores or machines, would otherwise be counted against the gateway on the bench's shared cores): the
bytes are taken as they come and the empty ``ExportTraceServiceResponse`` (zero bytes) goes back. The export
itself (gRPC, HTTP/2, the connection) is the same as to a real collector."""

from __future__ import annotations

import argparse
from concurrent import futures
from typing import Any

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


def serve(port: int) -> None:
    import grpc

    def export(request: bytes, context: Any) -> bytes:
        return b""  # ExportTraceServiceResponse{}: no partial_success, everything accepted

    handler = grpc.method_handlers_generic_handler(SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(export)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)


if __name__ == "__main__":
    main()
