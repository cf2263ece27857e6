"""An OTLP gRPC trace receiver that counts and discards what it gets: the collector of ``specgate bench overhead
--tracing`` (``python -m gateway.bench.otlp_sink --port N``). Needs the ``tracing`` extra (its OTLP exporter
brings ``opentelemetry-proto`` and ``grpcio``)."""

from __future__ import annotations

import argparse
from concurrent import futures
from typing import Any


def serve(port: int) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)


if __name__ == "__main__":
    main()
