"""specgate as an Endpoint Picker (EPP): Envoy's ext_proc calls it for every request and routes to its answer.

The same runtime as the proxy mode (``gateway.runtime.container.Runtime``: the YAML, classification, pool plan,
controllers, overrides, admission, metrics), without the HTTP proxy: Envoy carries the bytes.

- ``pick``: one request's answer from its headers and body: the endpoints in fallback order, the decision headers,
  or the refusal (a ``GatewayError``) Envoy sends back itself.
- ``messages``: the ext_proc protocol messages (``envoy.service.ext_proc.v3``) built from a pick or a refusal.
- ``exchange``: one ext_proc stream, one HTTP request: its phases, in-flight accounting and its record.
- ``server``: the grpc.aio server: the ExternalProcessor service and the gRPC health service.
- ``tuning``: process settings that must precede gRPC's import (its EventEngine I/O off: less CPU per message).
"""
