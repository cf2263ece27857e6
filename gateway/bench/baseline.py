"""``specgate bench baseline``: the latency baseline taken before a rollout, written to ``baseline_metrics.json``.

Sends a fixed set of prompts (built in, or ``--prompts`` in the usual ``eval_prompts.json`` shape:
``[{"text": ..., "max_tokens": ...}, ...]``) as streaming chat completions at temperature 0, ``--requests`` in all
(the prompts in turn) with at most ``--concurrency`` in flight, to the gateway or straight to a vLLM server or
``specgate sim``. The file keeps the field names common baseline scripts write, so such a weekly script and
``specgate report weekly`` read it; p99 and the fields after ``avg_tokens_per_sec`` are additions.

Field → what it measures, and its vLLM 0.33 counterpart (server side; the client's numbers add the network):

- ``ttft_p50_ms`` / ``ttft_p95_ms`` / ``ttft_p99_ms``: request sent → first content chunk
  (``vllm:time_to_first_token_seconds``).
- ``tpot_p50_ms`` / ... : (last chunk − first chunk) / (output tokens − 1), requests with more than one token
  (``vllm:request_time_per_output_token_seconds``: decode time / (generated tokens − 1)). Output tokens are the
  final usage chunk's ``completion_tokens`` (``stream_options.include_usage``); counting content chunks (as simple
  scripts do) under speculative decoding undercounts (one engine step, one chunk, can carry several accepted tokens) and
  so overstates TPOT. Without usage the chunk count is used (``token_count_source``).
- ``e2e_p50_ms`` / ... : request sent → stream end (``vllm:e2e_request_latency_seconds``; the gateway's
  ``specgate_request_duration_seconds``, which ``report weekly`` compares against these).
- ``total_tokens``: output tokens of the successful requests (``vllm:generation_tokens_total``'s increase).
- ``avg_tokens_per_sec``: the usual definition, total_tokens / Σ E2E (per-request generation speed);
  ``throughput_tokens_per_sec``: total_tokens / wall-clock time of the run (what the server delivered).
- ``by_class``: through the gateway, the same E2E/TTFT/TPOT percentiles per ``x-specgate-class``.

Percentiles use the usual scripts' rule: p50 the median, pN the value at index ``int(n × N/100)`` of the sorted list.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPTS: tuple[tuple[str, int], ...] = (
    ("Write a Python function that returns the n-th Fibonacci number iteratively.", 256),
    ("Summarise in three sentences: the quick brown fox jumps over the lazy dog, again and again, until dusk.", 128),
    ("Return a JSON object with the keys name, age and city for a fictional person.", 128),
    ("Explain the difference between a process and a thread to a new programmer.", 256),
    ("Translate into French: The meeting is moved to Thursday at ten in the morning.", 64),
    ("List five practical tips for writing clear commit messages.", 256),
    ("Write a SQL query that returns the ten customers with the highest total order value.", 192),
    ("What are the trade-offs of caching database query results in memory?", 256),
)


class BaselineError(RuntimeError):
    """The run could not produce a baseline (nothing reachable, every request failed)."""


@dataclass(frozen=True, slots=True)
class Result:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tpot_s: float | None = None
    tokens: int = 0
    from_usage: bool = False
    traffic_class: str | None = None
    error: str = ""


def load_prompts(path: Path | None) -> list[tuple[str, int]]:
    """The built-in prompts, or a JSON list of ``{"text", "max_tokens"?}`` (the usual eval_prompts.json)."""
    if path is None:
        return list(PROMPTS)
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of {{'text', 'max_tokens'}} objects")
    out = []
    for i, item in enumerate(data):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}: item {i} has no text")
        max_tokens = item.get("max_tokens", 256) if isinstance(item, dict) else 256
        out.append((text, int(max_tokens)))
    return out


def percentile(values: Sequence[float], pct: float) -> float:
    """The usual scripts' rule: sorted(values)[int(n × pct/100)], the median for 50."""
    if pct == 50:
        return statistics.median(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def _ms(values: Sequence[float], pct: float) -> float | None:
    return round(percentile(values, pct) * 1000, 1) if values else None


async def _one(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    chunks, usage_tokens = 0, None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            cls = r.headers.get("x-specgate-class")
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                return Result(False, e2e_s=time.perf_counter() - start, error=f"{r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Result(False, e2e_s=time.perf_counter() - start, error=str(event["error"])[:200])
                if event.get("usage") and event["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
    except (httpx.HTTPError, ValueError) as exc:
        return Result(False, e2e_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else chunks
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return Result(
        True,
        ttft_s=None if first is None else first - start,
        e2e_s=end - start,
        tpot_s=tpot,
        tokens=tokens,
        from_usage=usage_tokens is not None,
        traffic_class=cls,
    )


def _percentiles(results: Sequence[Result]) -> dict[str, float | None]:
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    tpot = [r.tpot_s for r in results if r.tpot_s is not None]
    e2e = [r.e2e_s for r in results]
    out: dict[str, float | None] = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for pct in (50, 95, 99):
            out[f"{name}_p{pct}_ms"] = _ms(values, pct)
    return out


def summarise(results: Sequence[Result], *, wall_s: float, url: str, model: str, concurrency: int) -> dict[str, Any]:
    """The baseline file's content (the common fields first)."""
    ok = [r for r in results if r.ok]
    if not ok:
        errors = sorted({r.error for r in results})[:3]
        raise BaselineError(f"every request failed ({len(results)}): {'; '.join(errors)}")
    p = _percentiles(ok)
    total_tokens = sum(r.tokens for r in ok)
    sum_e2e = sum(r.e2e_s for r in ok)
    out: dict[str, Any] = {
        "ttft_p50_ms": p["ttft_p50_ms"],
        "ttft_p95_ms": p["ttft_p95_ms"],
        "tpot_p50_ms": p["tpot_p50_ms"],
        "tpot_p95_ms": p["tpot_p95_ms"],
        "e2e_p50_ms": p["e2e_p50_ms"],
        "e2e_p95_ms": p["e2e_p95_ms"],
        "total_tokens": total_tokens,
        "avg_tokens_per_sec": round(total_tokens / sum_e2e, 1) if sum_e2e > 0 else None,
        "ttft_p99_ms": p["ttft_p99_ms"],
        "tpot_p99_ms": p["tpot_p99_ms"],
        "e2e_p99_ms": p["e2e_p99_ms"],
        "throughput_tokens_per_sec": round(total_tokens / wall_s, 1) if wall_s > 0 else None,
        "requests": len(results),
        "successful_requests": len(ok),
        "errors": len(results) - len(ok),
        "concurrency": concurrency,
        "duration_s": round(wall_s, 3),
        "token_count_source": "usage" if all(r.from_usage for r in ok) else "chunks",
        "model": model,
        "url": url,
        "temperature": 0.0,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    classes = sorted({r.traffic_class for r in ok if r.traffic_class})
    if classes:
        out["by_class"] = {
            c: {"requests": len(rs), **_percentiles(rs)}
            for c in classes
            for rs in [[r for r in ok if r.traffic_class == c]]
        }
    return out


async def _first_model(http: httpx.AsyncClient, url: str) -> str:
    try:
        r = await http.get(f"{url}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BaselineError(f"no --model given and {url}/v1/models did not name one: {exc}") from exc


async def run_baseline(
    url: str,
    *,
    model: str | None = None,
    requests: int = 24,
    concurrency: int = 1,
    prompts: Sequence[tuple[str, int]] = PROMPTS,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run the baseline; the dict written to baseline_metrics.json. BaselineError when nothing succeeded."""
    if requests < 1 or concurrency < 1:
        raise ValueError("--requests and --concurrency must be at least 1")
    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=limits) as http:
        model = model or await _first_model(http, url)
        queue = list(range(requests))
        results: list[Result] = []

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                text, max_tokens = prompts[i % len(prompts)]
                results.append(await _one(http, url, model, text, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
        wall = time.perf_counter() - start
    return summarise(results, wall_s=wall, url=url, model=model, concurrency=concurrency)


def _text(value: Any) -> str:
    return "no data" if value is None else str(value)


def render(baseline: dict[str, Any]) -> str:
    rows: list[tuple[str, ...]] = [("", "p50", "p95", "p99")]
    for name in ("ttft", "tpot", "e2e"):
        rows.append((name.upper() + " ms", *(_text(baseline.get(f"{name}_p{p}_ms")) for p in (50, 95, 99))))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    lines.append(
        f"{baseline['successful_requests']}/{baseline['requests']} ok, {baseline['total_tokens']} tokens, "
        f"{baseline['avg_tokens_per_sec']} tokens/s per request, {baseline['throughput_tokens_per_sec']} tokens/s "
        f"in all (concurrency {baseline['concurrency']}, model {baseline['model']})"
    )
    return "\n".join(lines)
