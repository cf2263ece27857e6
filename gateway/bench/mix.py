"""Traffic mixes for ``specgate bench load`` and ``specgate bench policies``: a YAML file of request classes.

A mix (``bench/mixes/*.yaml``)::

    name: default
    model: meta-llama/Llama-3.3-70B-Instruct     # optional (default: the caller's)
    send_task_header: false                      # true: send X-Task-Type (else the gateway reads the prompt)
    targets: {ttft_s: 2.0, tpot_s: 0.06}         # goodput: a request meets both (per class overrides below)
    rules: routing_rules/default.yaml            # `bench policies`: the adaptive routing file for this mix
    arrivals: poisson                            # or burst:BASE,PEAK,PERIOD,LENGTH / step:R@S,... with the rates
                                                 #   as multiples of the load point's rate (seconds: wall)
    output_len_median: 80                        # `bench policies`: the simulated answers' median length
    target: {within: 1.1, below_by: 0.1, below_at: [0.5, 0.7]}  # `bench policies`' target for this mix
    classes:
      - name: structured
        weight: 0.6
        task: structured                         # built-in prompts of this task type; X-Sim-Task for the simulator
        temperature: {choice: [0.0, 0.2]}        # a number, null (field left out), {choice: [...], weights: [...]}
        max_tokens: {uniform: [128, 256]}        #   or {uniform: [lo, hi]} (integers for max_tokens)
        stream: 0.5                              # share of streaming requests
        response_format: json_object             # optional
        tools: false                             # true: the request carries a tool definition
        prompts: builtin                         # or {file: prompts.jsonl, field: prompt}
        targets: {ttft_s: 1.0}

A mix with a ``conversations`` block sends multi-turn conversations built from these classes
(``gateway.bench.conversations``).

A JSONL prompt file holds one prompt per line: a JSON string, an object with ``field`` (default ``prompt``) or an
object with ``messages``. Sampling is deterministic for a given ``random.Random``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TASK_TYPES = ("chat", "code", "summarization", "extraction", "rag", "math", "creative", "structured", "tool_use")

_TOPICS = (
    "a regional bakery chain",
    "a hospital's night shift",
    "an open-source database",
    "a city's bike-sharing scheme",
    "a small hydroelectric plant",
    "a university library",
    "a shipping container port",
    "a mobile banking app",
)
_SENTENCES = (
    "Revenue grew by {n} percent over the previous quarter, driven mostly by {t}.",
    "The team behind {t} reported {n} incidents, most of them minor and resolved within a day.",
    "A review of {t} found that {n} of the planned improvements were delivered on time.",
    "Customers of {t} asked for longer opening hours and clearer pricing in {n} survey answers.",
    "Costs at {t} rose because energy prices went up {n} percent and two suppliers changed terms.",
    "The board of {t} approved a budget of {n} million for the next phase of the project.",
)


def _doc(rng: random.Random, sentences: int) -> str:
    topic = rng.choice(_TOPICS)
    return " ".join(rng.choice(_SENTENCES).format(t=topic, n=rng.randint(2, 90)) for _ in range(sentences))


def synthetic_prompt(task: str, rng: random.Random) -> str:
    """A built-in prompt of this task type (words the gateway's and the simulator's task detectors recognise)."""
    topic = rng.choice(_TOPICS)
    n = rng.randint(3, 40)
    if task == "code":
        return rng.choice(
            (
                f"Write a Python function that parses a CSV export from {topic} and returns the rows as dicts.",
                "Refactor this code so that it handles empty input:\n"
                f"```python\ndef total(xs):\n    return sum(xs) / {n}\n```",
                f"Debug this JavaScript function for {topic}: function rate(a, b) {{ return a / b * {n}; }}",
            )
        )
    if task == "structured":
        return f"Return a JSON object with the fields name, city and headcount for {topic} with {n} staff."
    if task == "extraction":
        return f"Extract every number and the entity it belongs to from this text: {_doc(rng, 4)}"
    if task == "summarization":
        return f"Summarize the following report in three sentences.\n\n{_doc(rng, 12)}"
    if task == "rag":
        return (
            f"<context>\n{_doc(rng, 6)}\n</context>\n<context>\n{_doc(rng, 6)}\n</context>\n"
            f"Based on the context above, what happened to costs at {topic}?"
        )
    if task == "math":
        return f"Solve the equation {n}*x + {n + 7} = {3 * n + 1} and explain each step."
    if task == "creative":
        return rng.choice(
            (
                f"Write a short story about the last day at {topic}.",
                f"Write a poem about {topic} at dawn, in {n % 5 + 3} stanzas.",
                f"Brainstorm a playful slogan and a story for {topic}'s anniversary.",
            )
        )
    if task == "tool_use":
        return f"Book a meeting room for {n} people next Tuesday at {topic}."
    return rng.choice(
        (
            f"What should I look at when I compare two job offers from {topic}?",
            f"How do I prepare for a first week at {topic}?",
            f"Give me advice on moving to a town with {topic}.",
        )
    )


@dataclass(frozen=True, slots=True)
class Dist:
    """A value: fixed, a weighted choice (``None`` allowed: leave the field out) or uniform in [lo, hi]."""

    choices: tuple[float | None, ...] = ()
    weights: tuple[float, ...] = ()
    uniform: tuple[float, float] | None = None
    integer: bool = False

    def sample(self, rng: random.Random) -> float | None:
        if self.uniform is not None:
            lo, hi = self.uniform
            return float(rng.randint(int(lo), int(hi))) if self.integer else rng.uniform(lo, hi)
        if len(self.choices) == 1:
            return self.choices[0]
        return rng.choices(self.choices, self.weights or None)[0]

    def mean(self) -> float:
        """Mean over the values that are set (NaN if none is)."""
        if self.uniform is not None:
            return (self.uniform[0] + self.uniform[1]) / 2
        pairs = [(c, w) for c, w in zip(self.choices, self.weights or [1.0] * len(self.choices), strict=True)]
        set_pairs = [(c, w) for c, w in pairs if c is not None]
        total = sum(w for _, w in set_pairs)
        return sum(c * w for c, w in set_pairs) / total if total else math.nan


def parse_dist(raw: Any, where: str, *, integer: bool = False) -> Dist:
    if raw is None or (isinstance(raw, int | float) and not isinstance(raw, bool)):
        return Dist((None if raw is None else float(raw),), integer=integer)
    if isinstance(raw, dict) and "choice" in raw:
        choices = raw["choice"]
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"{where}: choice must be a non-empty list")
        vals = tuple(None if c is None else float(c) for c in choices)
        weights = tuple(float(w) for w in raw.get("weights", ()))
        if weights and (len(weights) != len(vals) or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"{where}: weights must be as many as the choices, >= 0, not all 0")
        return Dist(vals, weights, integer=integer)
    if isinstance(raw, dict) and "uniform" in raw:
        bounds = raw["uniform"]
        if not isinstance(bounds, list) or len(bounds) != 2 or float(bounds[0]) > float(bounds[1]):
            raise ValueError(f"{where}: uniform must be [lo, hi] with lo <= hi")
        return Dist(uniform=(float(bounds[0]), float(bounds[1])), integer=integer)
    raise ValueError(f"{where}: expected a number, null, {{choice: [...]}} or {{uniform: [lo, hi]}}, got {raw!r}")


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float = math.inf
    tpot_s: float = math.inf


def _targets(raw: Any, where: str, base: Targets) -> Targets:
    if raw is None:
        return base
    if not isinstance(raw, dict) or set(raw) - {"ttft_s", "tpot_s"}:
        raise ValueError(f"{where}: targets takes ttft_s and tpot_s")
    return Targets(float(raw.get("ttft_s", base.ttft_s)), float(raw.get("tpot_s", base.tpot_s)))


@dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    weight: float
    task: str
    temperature: Dist
    max_tokens: Dist
    stream: float
    targets: Targets
    response_format: str | None = None
    tools: bool = False
    prompts: tuple[Any, ...] = ()  # from a JSONL file: strings or message lists; empty: built-in
    api: str = "chat"  # chat (POST /v1/chat/completions) | responses (POST /v1/responses)

    def prompt(self, rng: random.Random) -> str | list[dict[str, Any]]:
        if self.prompts:
            p: str | list[dict[str, Any]] = rng.choice(self.prompts)
            return p
        return synthetic_prompt(self.task, rng)


@dataclass(frozen=True, slots=True)
class Target:
    """``bench policies``' target for a mix: adaptive p99 E2E at most ``within`` x the best homogeneous fleet's at
    every load, and (``below_by`` > 0) at least ``below_by`` below it at the loads ``below_at``."""

    within: float = 1.10
    below_by: float = 0.0
    below_at: tuple[float, ...] = ()


def _target(raw: Any) -> Target:
    if raw is None:
        return Target()
    if not isinstance(raw, dict) or set(raw) - {"within", "below_by", "below_at"}:
        raise ValueError("target takes within, below_by, below_at")
    return Target(
        float(raw.get("within", 1.10)),
        float(raw.get("below_by", 0.0)),
        tuple(float(x) for x in raw.get("below_at", ())),
    )


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    classes: tuple[TrafficClass, ...]
    model: str | None = None
    send_task_header: bool = False
    rules: str | None = None
    description: str = ""
    arrivals: str = "poisson"
    output_len_median: float | None = None
    target: Target = field(default_factory=lambda: Target())
    conversations: Any = None  # a multi-turn mix's ``conversations`` block, parsed by ``bench.conversations``

    def arrival_kind(self, rate: float) -> str:
        """The arrival process at ``rate`` requests/s: ``arrivals`` with its rates scaled by ``rate``."""
        name, _, spec = self.arrivals.partition(":")
        if name == "burst":
            base, peak, period, length = spec.split(",")
            return f"burst:{float(base) * rate:g},{float(peak) * rate:g},{period},{length}"
        if name == "step":
            parts = []
            for part in spec.split(","):
                r, _, secs = part.partition("@")
                parts.append(f"{float(r) * rate:g}@{secs}")
            return "step:" + ",".join(parts)
        return self.arrivals

    def pick(self, rng: random.Random) -> TrafficClass:
        return rng.choices(self.classes, [c.weight for c in self.classes])[0]


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send: its class, body, headers."""

    cls: TrafficClass
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def path(self) -> str:
        return "/v1/responses" if self.cls.api == "responses" else "/v1/chat/completions"


def plan_request(mix: Mix, model: str, rng: random.Random) -> Planned:
    cls = mix.pick(rng)
    prompt = cls.prompt(rng)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body: dict[str, Any] = {"model": model, "messages": messages}
    temp = cls.temperature.sample(rng)
    if temp is not None:
        body["temperature"] = round(temp, 3)
    mt = cls.max_tokens.sample(rng)
    if mt is not None:
        body["max_tokens"] = int(mt)
    if rng.random() < cls.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    else:
        body["stream"] = False
    if cls.response_format:
        body["response_format"] = {"type": cls.response_format}
    if cls.tools:
        body["tools"] = [TOOL]
    if cls.api == "responses":
        body = _as_responses(body)
    headers = {"x-sim-task": cls.task}  # the simulator's ground truth for acceptance; vLLM ignores it
    if mix.send_task_header:
        headers["x-task-type"] = cls.task
    return Planned(cls, body, headers)


def _as_responses(chat: dict[str, Any]) -> dict[str, Any]:
    """The same request for the Responses API: ``input`` items, ``max_output_tokens``, ``text.format``."""
    body: dict[str, Any] = {"model": chat["model"], "input": chat["messages"], "stream": chat["stream"]}
    if "temperature" in chat:
        body["temperature"] = chat["temperature"]
    if "max_tokens" in chat:
        body["max_output_tokens"] = chat["max_tokens"]
    if "response_format" in chat:
        body["text"] = {"format": chat["response_format"]}
    return body


TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "book_room",
        "description": "Book a meeting room.",
        "parameters": {
            "type": "object",
            "properties": {"people": {"type": "integer"}, "day": {"type": "string"}},
            "required": ["people", "day"],
        },
    },
}


def _load_prompts(raw: Any, base: Path, where: str) -> tuple[Any, ...]:
    if raw in (None, "builtin"):
        return ()
    if isinstance(raw, str):
        raw = {"file": raw}
    if not isinstance(raw, dict) or "file" not in raw:
        raise ValueError(f"{where}: prompts is 'builtin' or {{file: path.jsonl, field: prompt}}")
    path = Path(raw["file"])
    if not path.is_absolute():
        path = base / path
    key = str(raw.get("field", "prompt"))
    out: list[Any] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if isinstance(item, dict) and isinstance(item.get("messages"), list):
            out.append(item["messages"])
        elif isinstance(item, dict) and isinstance(item.get(key), str):
            out.append(item[key])
        elif isinstance(item, str):
            out.append(item)
        else:
            raise ValueError(f"{path}:{n}: expected a string, {{{key!r}: ...}} or {{'messages': [...]}}")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return tuple(out)


def parse_mix(data: Any, base: Path = Path(".")) -> Mix:
    """A mix from its parsed YAML; ``base``: where relative prompt files are (the mix file's folder)."""
    if not isinstance(data, dict) or not isinstance(data.get("classes"), list) or not data["classes"]:
        raise ValueError("a mix needs a non-empty 'classes' list")
    targets = _targets(data.get("targets"), "targets", Targets())
    classes = []
    for i, raw in enumerate(data["classes"]):
        where = f"classes[{i}]"
        if not isinstance(raw, dict) or not raw.get("name"):
            raise ValueError(f"{where}: needs a name")
        task = str(raw.get("task", "chat"))
        if task not in TASK_TYPES:
            raise ValueError(f"{where}: task {task!r} is not one of {', '.join(TASK_TYPES)}")
        weight = float(raw.get("weight", 1.0))
        stream = float(raw.get("stream", 0.0))
        if weight < 0 or not 0.0 <= stream <= 1.0:
            raise ValueError(f"{where}: weight must be >= 0 and stream a share in [0, 1]")
        api = str(raw.get("api", "chat"))
        if api not in ("chat", "responses"):
            raise ValueError(f"{where}: api must be chat or responses, got {api!r}")
        classes.append(
            TrafficClass(
                name=str(raw["name"]),
                weight=weight,
                task=task,
                temperature=parse_dist(raw.get("temperature"), f"{where}.temperature"),
                max_tokens=parse_dist(raw.get("max_tokens", 256), f"{where}.max_tokens", integer=True),
                stream=stream,
                targets=_targets(raw.get("targets"), f"{where}.targets", targets),
                response_format=raw.get("response_format"),
                tools=bool(raw.get("tools", False)),
                prompts=_load_prompts(raw.get("prompts"), base, f"{where}.prompts"),
                api=api,
            )
        )
    if sum(c.weight for c in classes) <= 0:
        raise ValueError("the classes' weights sum to 0")
    return Mix(
        name=str(data.get("name", "mix")),
        classes=tuple(classes),
        model=data.get("model"),
        send_task_header=bool(data.get("send_task_header", False)),
        rules=data.get("rules"),
        description=str(data.get("description", "")),
        arrivals=_arrivals(data.get("arrivals", "poisson")),
        output_len_median=None if data.get("output_len_median") is None else float(data["output_len_median"]),
        target=_target(data.get("target")),
        conversations=data.get("conversations"),
    )


def _arrivals(raw: Any) -> str:
    """Checked now, so that a bad mix fails before any server starts (the numbers as ``bench.load`` reads them)."""
    kind = str(raw)
    name, _, spec = kind.partition(":")
    try:
        if name == "burst":
            base, peak, period, length = (float(x) for x in spec.split(","))
            if period <= 0 or not 0 < length <= period or base < 0 or peak < 0:
                raise ValueError
            return kind
        if name == "step":
            for part in spec.split(","):
                r, at, secs = part.partition("@")
                if not at or float(r) < 0 or float(secs) <= 0:
                    raise ValueError
            return kind
    except ValueError:
        pass
    else:
        if name in ("poisson", "constant"):
            return kind
    raise ValueError(
        f"arrivals {kind!r}: expected poisson, constant, burst:BASE,PEAK,PERIOD,LENGTH or step:RATE@SECONDS,... "
        "(rates as multiples of the load point's rate)"
    )


def load_mix(spec: str | Path, mixes_dir: Path = Path("bench/mixes")) -> Mix:
    """A mix by file path, or by name from ``bench/mixes`` (``default`` → ``bench/mixes/default.yaml``)."""
    path = Path(spec)
    if not path.exists() and (mixes_dir / f"{spec}.yaml").exists():
        path = mixes_dir / f"{spec}.yaml"
    if not path.exists():
        raise ValueError(f"mix {spec!r}: no such file (nor {mixes_dir / f'{spec}.yaml'})")
    return parse_mix(yaml.safe_load(path.read_text()), path.parent)
