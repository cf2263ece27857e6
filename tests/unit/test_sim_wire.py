"""The simulator's wire shapes (vLLM 0.33), pseudo-text determinism, request parsing, the task guess, faults."""

from __future__ import annotations

import ast
import asyncio
import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.sim import wire
from gateway.sim.faults import Faults, FaultState, RequestFaults
from gateway.sim.metrics import SpecStats

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
SERVED = (MODEL, "alias")
LENGTHS = wire.OutputLengths()
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}


def parse(kind: wire.Kind, body: dict[str, Any], max_model_len: int = 8192) -> wire.SimRequest:
    return wire.parse_request(kind, body, served=SERVED, max_model_len=max_model_len, lengths=LENGTHS)


def spec_metrics() -> dict[str, Any]:
    stats = SpecStats(4, 3, 12, 6, [1, 0, 1, 0, 1])
    return stats.to_dict()


# --------------------------------------------------------------------------------------------------------------
# Errors and framing


def test_error_envelopes() -> None:
    assert wire.error_body(400, "bad", param="input_tokens") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "input_tokens", "code": 400}
    }
    assert wire.error_body(503, "x")["error"]["type"] == "Service Unavailable"
    assert wire.error_body(418, "x")["error"]["type"] == "I'm a Teapot"
    exc = wire.model_not_found("nope", SERVED)
    assert exc.status == 404
    assert exc.body["error"] == {
        "message": f"The model `nope` does not exist. Valid aliases: {MODEL}, alias.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    full = wire.queue_full()
    assert (full.status, full.body["error"]["code"], full.body["error"]["type"]) == (503, 503, "Service Unavailable")
    assert orjson.loads(wire.UNAUTHORIZED_BODY) == {"error": "Unauthorized"}


def test_sse_framing() -> None:
    assert wire.sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert wire.SSE_DONE == b"data: [DONE]\n\n"
    raw = wire.sse_error(wire.error_body(500, "boom"))
    first, done, rest = raw.split(b"\n\n")
    assert first.startswith(b"data: {")
    assert json.loads(first[len(b"data: ") :])["error"]["code"] == 500
    assert (done, rest) == (b"data: [DONE]", b"")


# --------------------------------------------------------------------------------------------------------------
# Response and chunk shapes


def test_chat_completion_shape() -> None:
    spec = spec_metrics()
    body = wire.completion_body(
        "chat",
        response_id="chatcmpl-r1",
        created=1,
        model=MODEL,
        choices=[wire.ChoiceResult(0, "Hi there", "stop")],
        prompt_tokens=10,
        completion_tokens=2,
        fingerprint="vllm-0.33.0-abcd1234",
        spec=spec,
    )
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Hi there"
    assert "tool_calls" not in choice["message"]  # vLLM drops an empty tool_calls list
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 12,
        "completion_tokens": 2,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    sd = body["metrics"]["speculative_decoding"]
    assert sd["num_spec_steps"] == 3
    assert sd["num_accepted_draft_tokens"] == 6
    assert sd["mean_acceptance_length"] == pytest.approx(3.0)
    assert sd["draft_acceptance_rate"] == pytest.approx(0.5)
    assert sd["num_spec_tokens"] == 4
    assert sd["per_step_accepted"] is None


def test_text_completion_shape_without_metrics() -> None:
    body = wire.completion_body(
        "completion",
        response_id="cmpl-r1",
        created=1,
        model=MODEL,
        choices=[wire.ChoiceResult(0, "x", "length")],
        prompt_tokens=1,
        completion_tokens=1,
        fingerprint=None,
    )
    assert body["object"] == "text_completion"
    assert body["metrics"] is None
    assert "prompt_logprobs" not in body
    assert body["choices"][0]["text"] == "x"
    assert body["choices"][0]["prompt_logprobs"] is None


def shapes(kind: wire.Kind, *, include_usage: bool = False, continuous: bool = False) -> wire.ChunkShapes:
    return wire.ChunkShapes(kind, "chatcmpl-r1", 1, MODEL, 7, include_usage, continuous, "vllm-0.33.0-abcd1234")


def test_chat_chunks() -> None:
    s = shapes("chat")
    role = s.role_chunk()
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert role["object"] == "chat.completion.chunk"
    assert "usage" not in role
    tok = s.token_chunk(" a b c")
    assert tok["choices"][0]["delta"] == {"content": " a b c"}
    assert tok["choices"][0]["finish_reason"] is None
    assert "stop_reason" not in tok["choices"][0]
    assert "system_fingerprint" not in tok
    last = s.token_chunk(" d", finish_reason="stop")
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["system_fingerprint"] == "vllm-0.33.0-abcd1234"  # the terminal chunk, without include_usage


def test_usage_chunks() -> None:
    s = shapes("chat", include_usage=True, continuous=True)
    last = s.token_chunk(" d", finish_reason="length", completion_tokens=5)
    assert "system_fingerprint" not in last  # the usage chunk carries it instead
    assert last["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 12,
        "completion_tokens": 5,
        "completion_tokens_details": None,
    }
    final = s.usage_chunk(5, spec_metrics())
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 7, "total_tokens": 12, "completion_tokens": 5}
    assert set(final["metrics"]) == {"speculative_decoding"}
    assert None not in final.values()
    assert "metrics" not in s.usage_chunk(5)
    text = shapes("completion", include_usage=True, continuous=True)
    chunk = text.token_chunk("abc", completion_tokens=1)
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == "abc"
    assert chunk["usage"] == {"prompt_tokens": 7, "total_tokens": 8, "completion_tokens": 1}


def test_model_list() -> None:
    body = wire.model_list(SERVED, created=5, max_model_len=4096, root=MODEL)
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == list(SERVED)
    first = body["data"][0]
    assert (first["owned_by"], first["max_model_len"], first["root"], first["parent"]) == ("vllm", 4096, MODEL, None)
    assert first["permission"][0]["object"] == "model_permission"


# --------------------------------------------------------------------------------------------------------------
# Determinism and lengths


def test_pseudo_text_is_deterministic() -> None:
    seed = wire.request_seed(MODEL, CHAT)
    assert seed == wire.request_seed(MODEL, dict(reversed(list(CHAT.items()))))
    assert seed != wire.request_seed(MODEL, {**CHAT, "seed": 1})
    assert seed != wire.request_seed("alias", CHAT)
    tokens = wire.pseudo_tokens(seed, 50)
    assert len(tokens) == 50
    assert tokens == wire.pseudo_tokens(seed, 50)
    assert wire.pseudo_tokens(seed, 20) == tokens[:20]
    assert tokens[0][0].isupper()
    assert not tokens[0].startswith(" ")
    assert all(t for t in tokens)
    assert wire.pseudo_tokens(seed + 1, 50) != tokens


def test_output_length_distribution() -> None:
    lengths = wire.OutputLengths(median=200, sigma=0.6, minimum=5, maximum=1000)
    values = [lengths.natural(s) for s in range(2000)]
    assert values == [lengths.natural(s) for s in range(2000)]
    assert min(values) >= 5
    assert max(values) <= 1000
    assert 170 <= sorted(values)[1000] <= 230
    assert wire.OutputLengths(median=50, sigma=0).natural(3) == 50


def test_parse_caps_and_finish_reason() -> None:
    fixed = wire.OutputLengths(median=100, sigma=0)
    req = wire.parse_request("chat", CHAT, served=SERVED, max_model_len=8192, lengths=fixed)
    assert [(s.output_tokens, s.finish_reason) for s in req.seqs] == [(100, "stop")]
    assert req.temperature == 1.0  # missing temperature means 1.0
    capped = wire.parse_request(
        "chat", {**CHAT, "max_completion_tokens": 10}, served=SERVED, max_model_len=8192, lengths=fixed
    )
    assert [(s.output_tokens, s.finish_reason) for s in capped.seqs] == [(10, "length")]
    assert capped.max_tokens == 10
    prompt = "word " * 100  # 125 tokens
    ctx = wire.parse_request("completion", {"prompt": prompt}, served=SERVED, max_model_len=150, lengths=fixed)
    assert ctx.model == MODEL
    assert ctx.seqs[0].output_tokens == 150 - ctx.prompt_tokens
    assert ctx.seqs[0].finish_reason == "length"
    eos = wire.parse_request(
        "completion",
        {"prompt": "x", "max_tokens": 300, "ignore_eos": True},
        served=SERVED,
        max_model_len=8192,
        lengths=fixed,
    )
    assert (eos.seqs[0].output_tokens, eos.seqs[0].finish_reason) == (300, "length")


def test_parse_n_and_prompt_lists() -> None:
    req = parse("chat", {**CHAT, "n": 3, "temperature": 0.2})
    assert [s.index for s in req.seqs] == [0, 1, 2]
    assert len({s.seed for s in req.seqs}) == 3
    assert req.temperature == 0.2
    multi = parse("completion", {"prompt": ["one two", "three four five six"], "n": 2})
    assert [s.index for s in multi.seqs] == [0, 1, 2, 3]
    assert multi.prompt_tokens == sum({s.prompt_tokens for s in multi.seqs})
    ids = parse("completion", {"prompt": [1, 2, 3, 4]})
    assert ids.prompt_tokens == 4


@pytest.mark.parametrize(
    ("kind", "body", "status", "param"),
    [
        ("chat", {**CHAT, "model": "nope"}, 404, "model"),
        ("chat", {"model": MODEL}, 400, "messages"),
        ("completion", {"model": MODEL}, 400, "prompt"),
        ("chat", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ("chat", {**CHAT, "temperature": -1}, 400, "temperature"),
        ("chat", {**CHAT, "n": "2"}, 400, "n"),
        ("completion", {"prompt": "x " * 50}, 400, "input_tokens"),
    ],
)
def test_parse_errors(kind: wire.Kind, body: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(wire.WireError) as info:
        parse(kind, body, max_model_len=20)
    assert info.value.status == status
    assert info.value.body["error"]["param"] == param
    assert info.value.body["error"]["code"] == status


def test_stream_options() -> None:
    req = parse(
        "chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )
    assert (req.stream, req.include_usage, req.continuous_usage) == (True, True, True)
    plain = parse("chat", {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert (plain.include_usage, plain.continuous_usage) == (False, False)


# --------------------------------------------------------------------------------------------------------------
# The task guess


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.parametrize(
    ("body", "task"),
    [
        (chat("hi", response_format={"type": "json_object"}), "structured"),
        (chat("hi", tools=[{"type": "function", "function": {"name": "f"}}]), "tool_use"),
        (chat("Summarize this article: the cat sat."), "summarization"),
        (chat("Context: the sky is blue.\nQuestion: what colour is it?"), "rag"),
        (chat("Extract every date from this text"), "extraction"),
        (chat("Fix the bug in this python function"), "code"),
        (chat("```js\nlet x = 1\n```"), "code"),
        (chat("Solve 12 * 7 for me"), "math"),
        (chat("Write a poem about the sea"), "creative"),
        (chat("How are you today?"), "chat"),
        ({"prompt": "def add(a, b):"}, "code"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "tl;dr please"}]}]}, "summarization"),
    ],
)
def test_guess_task(body: dict[str, Any], task: str) -> None:
    assert wire.guess_task(body) == task
    assert task in wire.TASKS


def test_tasks_match_physics_and_wire_never_imports_the_gateway_classifier() -> None:
    from gateway.sim import physics

    assert set(wire.TASKS) == set(physics.TASKS)
    for module in ("wire.py", "app.py", "faults.py", "server.py"):
        tree = ast.parse((Path(wire.__file__).parent / module).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m.startswith(("gateway.routing.classify", "gateway.config"))}, module


# --------------------------------------------------------------------------------------------------------------
# Faults


def test_faults_validation_and_merge() -> None:
    f = Faults.from_json({"error_rate": 0.5, "error_status": 503})
    assert (f.error_rate, f.error_status) == (0.5, 503)
    assert f.merged({"cut_after": 3}).cut_after == 3
    assert f.merged({"cut_after": 3}).error_rate == 0.5
    assert Faults().active is False
    assert f.active is True
    for bad in ({"nope": 1}, {"error_rate": 2}, {"error_status": 200}, {"metrics": "weird"}, {"hang": 1}):
        with pytest.raises(ValueError, match=r"must|unknown"):
            Faults.from_json(bad)
    assert orjson.loads(orjson.dumps(f.to_json()))["error_status"] == 503


async def test_fault_draws_and_listening() -> None:
    state = FaultState(Faults(error_rate=0.25, error_status=502), seed=1)
    draws = [state.draw() for _ in range(4000)]
    errors = sum(d.error_status == 502 for d in draws)
    assert 800 < errors < 1200
    assert state.stats()["injected_errors"] == errors
    await state.apply(Faults(cut_after=2, cut_rate=0.5, slow_chunk_s=0.1))
    cut = [state.draw() for _ in range(1000)]
    assert 400 < sum(d.cut_after == 2 for d in cut) < 600
    assert all(d.slow_chunk_s == 0.1 for d in cut)
    assert all(d.error_status is None for d in cut)
    await state.apply(Faults())
    assert state.draw() == RequestFaults()

    with pytest.raises(ValueError, match="needs the simulator's own server"):
        await state.apply(Faults(refuse_connections=True))  # nothing owns a socket here

    calls: list[bool] = []

    class Listener:
        async def set_listening(self, listening: bool) -> None:
            calls.append(listening)

    state.listener = Listener()
    await state.apply(Faults(refuse_connections=True, refuse_for_s=0.01))
    assert calls == [False]
    assert state.listening is False
    await asyncio.sleep(0.05)
    assert calls == [False, True]
    assert state.faults.refuse_connections is False
    assert state.stats()["listening"] is True


# --------------------------------------------------------------------------------------------------------------
# The command line


def test_physics_and_acceptance_overrides() -> None:
    from gateway.sim.physics import AcceptanceModel
    from gateway.sim.presets import get_preset
    from gateway.sim.tuning import acceptance_model, physics_options

    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    out = physics_options("llama8b-h100", spec, {"delta_s": 0.01, "draft_delta_s": 0.002, "kv_cache_tokens": 1000})
    base = get_preset("llama8b-h100")
    assert out["target"].delta_s == 0.01
    assert out["target"].gamma_s == base.target.gamma_s
    assert out["draft"].delta_s == 0.002
    assert out["draft"].gamma_s == base.draft_for("ngram").gamma_s
    assert out["kv_cache_tokens"] == 1000
    assert physics_options("llama8b-h100", None, {}) == {}
    with pytest.raises(ValueError, match="unknown physics"):
        physics_options("llama8b-h100", None, {"beta_s": 1.0})
    with pytest.raises(ValueError, match="need --speculative-config"):
        physics_options("llama8b-h100", None, {"draft_delta_s": 1.0})

    model = acceptance_model({"concentration": 0.0, "task_factors": {"lookup": {"chat": 0.5}}})
    default = AcceptanceModel()
    assert model.task_factors["lookup"]["chat"] == 0.5
    assert model.task_factors["lookup"]["rag"] == default.task_factors["lookup"]["rag"]
    assert model.draw(random.Random(0), 0.0, "chat", "ngram") == model.mean(0.0, "chat", "ngram")
    with pytest.raises(ValueError, match="unknown acceptance"):
        acceptance_model({"kappa": 1})


def test_sim_command_help_documents_every_flag() -> None:
    import inspect

    import typer
    from typer.testing import CliRunner

    from gateway.sim.command import sim_command

    app = typer.Typer()
    app.callback()(lambda: None)
    app.command("sim")(sim_command)
    result = CliRunner().invoke(app, ["sim", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for name in inspect.signature(sim_command).parameters:
        if name != "model":
            assert f"--{name.replace('_', '-')}" in result.output, name
    for vllm_flag in ("--served-model-name", "--max-num-seqs", "--speculative-config", "--api-key", "--seed"):
        assert vllm_flag in result.output


def test_prompt_plus_max_tokens_over_the_context_is_a_400_as_vllm_answers() -> None:
    prompt = "word " * 100
    tokens = parse("completion", {"prompt": prompt}, max_model_len=8192).prompt_tokens
    with pytest.raises(wire.WireError) as info:
        parse("completion", {"prompt": prompt, "max_tokens": 8192}, max_model_len=8192)
    assert info.value.status == 400
    assert info.value.body["error"]["param"] == "max_tokens"
    assert info.value.body["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 8192. This model's maximum context length is 8192 "
        f"tokens and your request has {tokens} input tokens (8192 > 8192 - {tokens})."
    )
    fits = parse("completion", {"prompt": prompt, "max_tokens": 8192 - tokens}, max_model_len=8192)
    assert fits.max_tokens == 8192 - tokens
    with pytest.raises(wire.WireError):
        parse("chat", {**CHAT, "max_completion_tokens": 100_000_000})
