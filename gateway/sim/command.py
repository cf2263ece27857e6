"""``specgate sim``: one simulated vLLM server from the command line, its flags mirroring ``vllm serve`` wherever
vLLM has the flag; the physics, acceptance, output-length and fault options grouped in the help by panel."""

from __future__ import annotations

from typing import Annotated

import typer

from gateway.sim.app import SimOptions
from gateway.sim.faults import Faults, parse_metrics_mode
from gateway.sim.presets import preset_names
from gateway.sim.request_queue import POLICIES
from gateway.sim.server import SimServer
from gateway.sim.tuning import acceptance_model, acceptance_overrides, physics_options
from gateway.sim.wire import OutputLengths

_PHYSICS = "Physics (override the preset)"
_ACCEPT = "Acceptance"
_LENGTH = "Output length"
_FAULTS = "Fault injection (also at runtime: PUT /sim/faults)"
_SIM = "Simulator"


def sim_command(
    model: Annotated[
        str, typer.Argument(help="Model name, as `vllm serve <model>` (served name unless --served-model-name).")
    ] = "meta-llama/Llama-3.3-70B-Instruct",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 = any free port).")] = 8000,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="Name(s) the model is served under (repeatable); the first labels /metrics."),
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the preset's).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Largest running batch (default: the preset's).")] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Token budget of one engine step (default: the preset's).")
    ] = None,
    max_num_queued_reqs: Annotated[
        int | None, typer.Option(help="Unfinished requests (waiting + running) above which vLLM answers 503.")
    ] = None,
    max_num_queued_tokens: Annotated[
        int | None, typer.Option(help="Prompt tokens still in prefill above which vLLM answers 503.")
    ] = None,
    speculative_config: Annotated[
        str | None,
        typer.Option(
            help='Speculative decoding, as vLLM: \'{"method": "eagle3", "num_speculative_tokens": 4}\'. '
            "None = a standard server."
        ),
    ] = None,
    per_request_spec_decode_metrics: Annotated[
        str | None,
        typer.Option(help="summary | detailed: per-request `metrics.speculative_decoding` in responses."),
    ] = None,
    api_key: Annotated[
        list[str] | None, typer.Option(help="Bearer key(s) required on /v1/* (repeatable); a bad key gets 401.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of every random draw (acceptance, tokens per step, faults).")] = 0,
    enable_request_id_headers: Annotated[
        bool, typer.Option("--enable-request-id-headers", help="Echo X-Request-Id on responses.")
    ] = False,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Automatic prefix caching (on by default, as in vLLM V1): a prompt's cached blocks skip prefill.",
        ),
    ] = True,
    block_size: Annotated[int | None, typer.Option(help="KV cache block size in tokens (default 16).", min=1)] = None,
    scheduling_policy: Annotated[
        str,
        typer.Option(
            help="fcfs (arrival order) | priority: the body's `priority` orders the queue (lower first, then arrival)"
            " and the lowest-priority running request is the one preempted when the KV cache is full.",
        ),
    ] = "fcfs",
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            help='KV cache events over ZMQ, as vLLM: \'{"enable_kv_cache_events": true, "publisher": "zmq", '
            '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'.'
        ),
    ] = None,
    enable_prompt_tokens_details: Annotated[
        bool,
        typer.Option("--enable-prompt-tokens-details", help="usage.prompt_tokens_details.cached_tokens in responses."),
    ] = False,
    otlp_traces_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Export an OpenTelemetry `llm_request` span per request over OTLP gRPC, as vLLM does "
            "(needs specgate[tracing]), e.g. http://collector:4317.",
        ),
    ] = None,
    enable_responses_store: Annotated[
        bool,
        typer.Option(
            "--enable-responses-store",
            help="Keep Responses API answers in memory (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1): "
            "previous_response_id, retrieve, cancel and background work.",
        ),
    ] = False,
    preset: Annotated[
        str, typer.Option(help="Modelled deployment: " + " | ".join(preset_names()) + ".", rich_help_panel=_SIM)
    ] = "llama70b-4xh100",
    time_scale: Annotated[
        float, typer.Option(help="Wall seconds per simulated second (0.1 = ten times faster).", rich_help_panel=_SIM)
    ] = 1.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.", rich_help_panel=_SIM)] = "warning",
    delta_s: Annotated[
        float | None, typer.Option(help="Target δ: fixed seconds per step.", rich_help_panel=_PHYSICS)
    ] = None,
    gamma_s: Annotated[
        float | None, typer.Option(help="Target γ: seconds per batched decode/verify token.", rich_help_panel=_PHYSICS)
    ] = None,
    gamma_prefill_s: Annotated[
        float | None, typer.Option(help="Target seconds per prompt (prefill) token.", rich_help_panel=_PHYSICS)
    ] = None,
    alpha_s: Annotated[
        float | None, typer.Option(help="Target α: seconds per KV-cache token read.", rich_help_panel=_PHYSICS)
    ] = None,
    epsilon_s: Annotated[
        float | None, typer.Option(help="Target ε: CPU overhead per step.", rich_help_panel=_PHYSICS)
    ] = None,
    draft_delta_s: Annotated[
        float | None, typer.Option(help="Proposer fixed seconds per pass.", rich_help_panel=_PHYSICS)
    ] = None,
    draft_gamma_s: Annotated[
        float | None,
        typer.Option(help="Proposer seconds per sequence (per draft token for heads).", rich_help_panel=_PHYSICS),
    ] = None,
    draft_alpha_s: Annotated[
        float | None, typer.Option(help="Proposer seconds per KV-cache token.", rich_help_panel=_PHYSICS)
    ] = None,
    draft_gamma_prefill_s: Annotated[
        float | None, typer.Option(help="Proposer seconds per prompt token.", rich_help_panel=_PHYSICS)
    ] = None,
    kv_cache_tokens: Annotated[
        int | None, typer.Option(help="KV-cache capacity in tokens.", rich_help_panel=_PHYSICS)
    ] = None,
    acceptance: Annotated[
        float | None,
        typer.Option(help="Give every request this acceptance (no draw by task/temperature).", rich_help_panel=_ACCEPT),
    ] = None,
    acceptance_points: Annotated[
        str | None,
        typer.Option(
            help="Base acceptance by temperature, T:A pairs (default 0:0.81,0.4:0.71,0.8:0.52,1:0.38,1.5:0.2,2:0.1).",
            rich_help_panel=_ACCEPT,
        ),
    ] = None,
    acceptance_floor: Annotated[
        float | None, typer.Option(help="Lowest base acceptance at high temperature (0.10).", rich_help_panel=_ACCEPT)
    ] = None,
    acceptance_concentration: Annotated[
        float | None,
        typer.Option(
            help="κ of the per-request Beta draw around the mean (12; 0 = every request gets the mean).",
            rich_help_panel=_ACCEPT,
        ),
    ] = None,
    task_factor: Annotated[
        list[str] | None,
        typer.Option(
            help="Acceptance factor per proposer family and task, e.g. lookup.summarization=1.1 (repeatable).",
            rich_help_panel=_ACCEPT,
        ),
    ] = None,
    method_factor: Annotated[
        list[str] | None,
        typer.Option(help="Acceptance factor per method, e.g. eagle=0.95 (repeatable).", rich_help_panel=_ACCEPT),
    ] = None,
    output_len_median: Annotated[
        float, typer.Option(help="Median natural answer length in tokens (lognormal).", rich_help_panel=_LENGTH)
    ] = 200.0,
    output_len_sigma: Annotated[
        float, typer.Option(help="σ of the lognormal (0 = always the median).", rich_help_panel=_LENGTH)
    ] = 0.6,
    output_len_min: Annotated[int, typer.Option(help="Shortest natural answer.", rich_help_panel=_LENGTH)] = 1,
    output_len_max: Annotated[int, typer.Option(help="Longest natural answer.", rich_help_panel=_LENGTH)] = 4096,
    fault_error_rate: Annotated[
        float,
        typer.Option(help="Fraction of requests answered at once with --fault-error-status.", rich_help_panel=_FAULTS),
    ] = 0.0,
    fault_error_status: Annotated[int, typer.Option(help="Status of injected errors.", rich_help_panel=_FAULTS)] = 500,
    fault_hang: Annotated[
        bool, typer.Option("--fault-hang", help="Never answer (until the client leaves).", rich_help_panel=_FAULTS)
    ] = False,
    fault_hang_s: Annotated[
        float, typer.Option(help="Wall seconds to wait before the first token.", rich_help_panel=_FAULTS)
    ] = 0.0,
    fault_hang_rate: Annotated[
        float, typer.Option(help="Fraction of requests that hang.", rich_help_panel=_FAULTS)
    ] = 1.0,
    fault_cut_after: Annotated[
        int | None,
        typer.Option(help="Close the connection after N token chunks (no [DONE]).", rich_help_panel=_FAULTS),
    ] = None,
    fault_error_after: Annotated[
        int | None,
        typer.Option(
            help="After N token chunks: an error event, then [DONE] (stream) or a 500.", rich_help_panel=_FAULTS
        ),
    ] = None,
    fault_cut_rate: Annotated[float, typer.Option(help="Fraction of requests cut.", rich_help_panel=_FAULTS)] = 1.0,
    fault_slow_chunk_s: Annotated[
        float, typer.Option(help="Extra wall seconds before each chunk.", rich_help_panel=_FAULTS)
    ] = 0.0,
    fault_refuse_connections: Annotated[
        bool,
        typer.Option("--fault-refuse-connections", help="Do not listen (connection refused).", rich_help_panel=_FAULTS),
    ] = False,
    fault_refuse_for_s: Annotated[
        float | None,
        typer.Option(help="With --fault-refuse-connections: listen after N seconds.", rich_help_panel=_FAULTS),
    ] = None,
    fault_metrics: Annotated[
        str,
        typer.Option(help="/metrics: ok | malformed (unparsable) | missing (404).", rich_help_panel=_FAULTS),
    ] = "ok",
    fault_health_status: Annotated[int, typer.Option(help="Status of GET /health.", rich_help_panel=_FAULTS)] = 200,
) -> None:
    """A simulated `vllm serve` (vLLM 0.33 wire format, speculative-decoding physics, fault injection; no GPU)."""
    physics = {
        key: value
        for key, value in {
            "delta_s": delta_s,
            "gamma_s": gamma_s,
            "gamma_prefill_s": gamma_prefill_s,
            "alpha_s": alpha_s,
            "epsilon_s": epsilon_s,
            "draft_delta_s": draft_delta_s,
            "draft_gamma_s": draft_gamma_s,
            "draft_alpha_s": draft_alpha_s,
            "draft_gamma_prefill_s": draft_gamma_prefill_s,
            "kv_cache_tokens": kv_cache_tokens,
        }.items()
        if value is not None
    }
    if scheduling_policy not in POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(POLICIES)}", param_hint="--scheduling-policy")
    if per_request_spec_decode_metrics not in (None, "summary", "detailed"):
        raise typer.BadParameter("must be summary or detailed", param_hint="--per-request-spec-decode-metrics")
    try:
        faults = Faults(
            error_rate=fault_error_rate,
            error_status=fault_error_status,
            hang=fault_hang,
            hang_s=fault_hang_s,
            hang_rate=fault_hang_rate,
            cut_after=fault_cut_after,
            cut_rate=fault_cut_rate,
            error_after=fault_error_after,
            slow_chunk_s=fault_slow_chunk_s,
            refuse_connections=fault_refuse_connections,
            refuse_for_s=fault_refuse_for_s,
            metrics=parse_metrics_mode(fault_metrics),
            health_status=fault_health_status,
        )
        options = SimOptions(
            model=model,
            served_model_names=tuple(served_model_name or ()),
            host=host,
            port=port,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_queued_reqs=max_num_queued_reqs,
            max_num_queued_tokens=max_num_queued_tokens,
            speculative_config=speculative_config,
            per_request_spec_decode_metrics=per_request_spec_decode_metrics,  # type: ignore[arg-type]
            api_keys=tuple(api_key or ()),
            seed=seed,
            enable_request_id_headers=enable_request_id_headers,
            enable_responses_store=enable_responses_store,
            enable_prefix_caching=enable_prefix_caching,
            block_size=block_size,
            scheduling_policy=scheduling_policy,
            kv_events_config=kv_events_config,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            otlp_traces_endpoint=otlp_traces_endpoint,
            preset=preset,
            time_scale=time_scale,
            acceptance=acceptance_model(
                acceptance_overrides(
                    acceptance_points, acceptance_floor, acceptance_concentration, task_factor, method_factor
                )
            ),
            **physics_options(preset, speculative_config, physics),
            fixed_acceptance=acceptance,
            output_lengths=OutputLengths(output_len_median, output_len_sigma, output_len_min, output_len_max),
            faults=faults,
            log_level=log_level,
        )
        server = SimServer(options, loop="uvloop", http="httptools")
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"specgate sim: {options.names[0]} on {server.url} (preset {preset}, time scale {time_scale})", err=True)
    server.run()
