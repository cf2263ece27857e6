"""How much one classification costs: ``bench_classify(rules)`` over a realistic mix of request bodies.

Two measurements over the same bodies, after a warm-up pass:

- *classify only*: ``Classifier.classify`` on bodies already parsed;
- *parse + classify*: ``orjson.loads`` of the raw JSON bytes, then ``classify``, as the gateway does per request.

The clock is read once per batch of ``batch`` requests (``time.perf_counter_ns``), so the timer's own cost does not
dominate: the mean is the total time over all requests, and p50 / p99 are percentiles of the per-request cost of
each batch (batch time divided by its size). ``python -m gateway.bench.classify RULES.yaml [N]`` prints the table.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.bench.load import percentile
from gateway.config.loader import load_rules_file
from gateway.config.schema import RoutingRules
from gateway.routing.classify import ApiKind, Classifier

_FILLER = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but all can more "
    "request model latency token server queue batch answer question system user value result report customer "
    "order invoice account data table record field document section page paragraph meeting project team plan "
    "week month year price market product feature service client issue change update error message file"
)
_WORDS = tuple(_FILLER.split())
# Phrases that the task rules of a typical routing YAML look for, with the share of prompts that carry one.
_TASK_PHRASES = (
    ("Write a Python function that parses this log line.", 0.16),
    ("Fix the bug in this code:\n```python\ndef f(x):\n    return x +\n```", 0.06),
    ("Summarize the following document in five bullet points.", 0.12),
    ("Extract all named entities (people, places, companies) from the text below.", 0.06),
    ("Based on the context below, answer the question. <context>", 0.10),
    ("Solve the equation 3x + 7 = 22 and explain each step.", 0.04),
    ("Write a short poem about the sea at night.", 0.08),
)
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a senior software engineer. Answer with code when you can.",
    "You are a careful analyst. Answer only from the documents you are given.",
    "You are a support agent for an online shop. Be concise and polite.",
)
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order_status",
            "description": "Look up the status of a customer's order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Full-text search in the knowledge base.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]
_TEMPERATURES = (None, None, 0.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 1.0, 1.0, 1.2)
_MAX_TOKENS = (None, None, None, 16, 64, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-request cost in nanoseconds."""

    mean_ns: float
    p50_ns: float
    p99_ns: float


@dataclass(frozen=True, slots=True)
class ClassifyBenchResult:
    """What ``bench_classify`` measured; ``render()`` gives the table that ``main`` prints."""

    n: int
    batch: int
    mean_body_bytes: float
    classify_only: Timing
    parse_and_classify: Timing
    classes: tuple[tuple[str, int], ...]
    """Class name and request count, most frequent first."""
    tasks: tuple[tuple[str, int], ...]
    """Task type and request count, most frequent first."""

    def render(self) -> str:
        lines = [
            f"classification cost per request: {self.n} requests (mean body {self.mean_body_bytes / 1024:.1f} KiB), "
            f"clock read per batch of {self.batch}",
            f"  {'':<18}{'mean':>12}{'p50':>12}{'p99':>12}",
        ]
        for label, t in (("classify only", self.classify_only), ("parse + classify", self.parse_and_classify)):
            lines.append(f"  {label:<18}{_us(t.mean_ns):>12}{_us(t.p50_ns):>12}{_us(t.p99_ns):>12}")
        for title, counts in (("classes", self.classes), ("task types", self.tasks)):
            lines.append(f"{title}:")
            lines.extend(f"  {name:<30}{count:>7}  {100 * count / self.n:5.1f}%" for name, count in counts)
        return "\n".join(lines)


def _us(ns: float) -> str:
    return f"{ns / 1000:.2f} µs"


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One generated request: the parsed body and the same body as the JSON bytes a client would send."""

    endpoint: ApiKind
    body: dict[str, Any]
    raw: bytes
    task_header: str | None


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:chars]


def _prompt_text(rng: random.Random, chars: int) -> str:
    """Filler text of about ``chars`` characters, with a task phrase at the start for some prompts."""
    r = rng.random()
    for phrase, share in _TASK_PHRASES:
        if r < share:
            return phrase + "\n" + _text(rng, max(0, chars - len(phrase) - 1))
        r -= share
    return _text(rng, chars)


def _chat_body(rng: random.Random, model: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        messages.append({"role": rng.choice(("system", "system", "developer")), "content": rng.choice(_SYSTEM_PROMPTS)})
    turns = rng.randint(1, 6 - len(messages))
    for i in range(turns):
        last = i == turns - 1
        role = "user" if (turns - 1 - i) % 2 == 0 else "assistant"
        chars = rng.randint(50, 4000)
        text = _prompt_text(rng, chars) if last else _text(rng, chars)
        content: Any = text
        if role == "user" and rng.random() < 0.1:  # multimodal: content as a list of parts
            content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
        messages.append({"role": role, "content": content})
    body: dict[str, Any] = {"model": model, "messages": messages}
    _sampling(rng, body)
    if rng.random() < 0.15:
        body["tools"] = _TOOLS
        body["tool_choice"] = "auto"
    if rng.random() < 0.12:
        body["response_format"] = rng.choice(
            ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "r", "schema": {}}})
        )
    if rng.random() < 0.05:
        body["n"] = 2
    return body


def _completion_body(rng: random.Random, model: str) -> dict[str, Any]:
    r = rng.random()
    prompt: Any
    if r < 0.7:
        prompt = _prompt_text(rng, rng.randint(50, 4000))
    elif r < 0.85:
        prompt = [_prompt_text(rng, rng.randint(50, 1000)) for _ in range(rng.randint(2, 4))]
    else:
        prompt = [rng.randrange(128_000) for _ in range(rng.randint(10, 1000))]
    body: dict[str, Any] = {"model": model, "prompt": prompt}
    _sampling(rng, body)
    return body


def _sampling(rng: random.Random, body: dict[str, Any]) -> None:
    temperature = rng.choice(_TEMPERATURES)
    if temperature is not None:
        body["temperature"] = temperature
    max_tokens = rng.choice(_MAX_TOKENS)
    if max_tokens is not None:
        body["max_completion_tokens" if rng.random() < 0.5 else "max_tokens"] = max_tokens
    if rng.random() < 0.2:
        body["top_p"] = rng.choice((0.9, 0.95, 1.0))
    body["stream"] = rng.random() < 0.7
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}


def make_requests(rules: RoutingRules, n: int, seed: int = 0) -> list[BenchRequest]:
    """``n`` request bodies (about 9 in 10 chat, the rest legacy completions) for the models the rules serve."""
    rng = random.Random(seed)
    models = list(dict.fromkeys(m for p in rules.pools for m in p.models))
    out: list[BenchRequest] = []
    for _ in range(n):
        model = rng.choice(models)
        endpoint: ApiKind = "chat" if rng.random() < 0.9 else "completions"
        body = _chat_body(rng, model) if endpoint == "chat" else _completion_body(rng, model)
        header = rng.choice(("code", "summarization", "Creative")) if rng.random() < 0.05 else None
        out.append(BenchRequest(endpoint, body, orjson.dumps(body), header))
    return out


def _time(requests: Sequence[BenchRequest], batch: int, one: Callable[[BenchRequest], object]) -> Timing:
    """Run ``one`` over every request, reading the clock once per batch; per-request cost statistics."""
    clock = time.perf_counter_ns
    per_request: list[float] = []
    total = 0
    for start in range(0, len(requests), batch):
        chunk = requests[start : start + batch]
        t0 = clock()
        for r in chunk:
            one(r)
        elapsed = clock() - t0
        total += elapsed
        per_request.append(elapsed / len(chunk))
    per_request.sort()
    return Timing(total / len(requests), percentile(per_request, 0.50), percentile(per_request, 0.99))


def bench_classify(rules: RoutingRules, *, n: int = 20000, seed: int = 0, batch: int = 100) -> ClassifyBenchResult:
    """Measure classification of ``n`` generated requests against ``rules`` (see the module docstring)."""
    if n < 1 or batch < 1:
        raise ValueError("n and batch must be positive")
    classifier = Classifier(rules)
    requests = make_requests(rules, n, seed)
    batch = min(batch, n)

    def classify_only(r: BenchRequest) -> object:
        return classifier.classify(r.endpoint, r.body, r.task_header)

    def parse_and_classify(r: BenchRequest) -> object:
        return classifier.classify(r.endpoint, orjson.loads(r.raw), r.task_header)

    # Warm-up: one untimed pass over every request (parse + classify), which also counts classes and task types.
    classes: Counter[str] = Counter()
    tasks: Counter[str] = Counter()
    for r in requests:
        c = classifier.classify(r.endpoint, orjson.loads(r.raw), r.task_header)
        classes[c.traffic_class.name] += 1
        tasks[c.features.task_type] += 1

    only = _time(requests, batch, classify_only)
    parsed = _time(requests, batch, parse_and_classify)
    return ClassifyBenchResult(
        n=n,
        batch=batch,
        mean_body_bytes=sum(len(r.raw) for r in requests) / n,
        classify_only=only,
        parse_and_classify=parsed,
        classes=tuple(classes.most_common()),
        tasks=tuple(tasks.most_common()),
    )


def run(rules_path: str, n: int = 20000) -> ClassifyBenchResult:
    """Load a routing YAML (``RulesError`` if it is broken) and benchmark classification against it."""
    return bench_classify(load_rules_file(rules_path), n=n)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m gateway.bench.classify RULES.yaml [N]", file=sys.stderr)
        return 2
    result = run(args[0], int(args[1]) if len(args) == 2 else 20000)
    print(result.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
