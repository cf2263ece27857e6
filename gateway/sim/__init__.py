"""The vLLM simulator: vLLM 0.33 on the wire, speculative-decoding physics underneath (``specgate sim``).

- ``physics``: cost models, the per-step latency model, acceptance by temperature/task/method, token sampling (pure).
- ``presets``: the modelled deployments (``--preset``).
- ``engine``: one engine loop per server: continuous batching on a simulated clock (``time_scale``); ``batch``: its
  step mechanics (scheduling, emission, preemption, KV blocks); ``sequence``: ``GenRequest`` / ``Generation``.
- ``metrics``: vLLM's Prometheus metrics, exact names, types, labels and buckets.
- ``wire`` / ``app`` / ``faults``: the HTTP surface of ``vllm serve``, fault injection, the ``/sim/*`` control API;
  ``wire`` re-exports ``framing``, ``parsing`` and ``pseudotext``; ``app`` uses ``state`` (``SimOptions``,
  ``SimState``) and ``call`` (one generation request).
- ``responses``: the Responses API (``/v1/responses``, retrieve, cancel, the in-process response store).
- ``tracing``: vLLM's ``llm_request`` OpenTelemetry span per request (``--otlp-traces-endpoint``).
- ``server`` / ``command`` / ``tuning``: running it (``SimServer``), the ``specgate sim`` command, and the
  physics/acceptance overrides by name.

It shares nothing with the proxy but utilities.
"""
