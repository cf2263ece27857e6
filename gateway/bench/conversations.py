"""Multi-turn traffic for ``specgate bench policies``: conversations with state, planned deterministically (pure).

A mix with a ``conversations`` block sends conversations instead of single requests. Its ``classes`` are the
request classes a turn can take (temperature, max_tokens, tools, response_format, stream); ``conversations``
says how they follow each other::

    conversations:
      system_prompts: {count: 8, tokens: 1500}   # shared system prompts; each conversation opens with one
      documents: {count: 12, tokens: 700}        # shared documents a RAG conversation quotes in its first turn
      turns: {uniform: [3, 10]}                  # turns per conversation
      think_s: {uniform: [5, 20]}                # simulated seconds between an answer and the next turn
      user_tokens: {uniform: [20, 80]}           # the new text of a turn
      kinds:
        - name: assistant
          weight: 0.4
          api: chat                              # or responses: the whole history as `input` items
          first: tool-call                       # the class of the first turn
          next: {chat-turn: 0.7, tool-call: 0.3} # the class of every later turn, drawn per turn
          documents: 0                           # shared documents quoted in the first turn
          tool_result_tokens: null               # agent loops: a tool's output appended to every later turn
          tools: null                            # tool definitions on every turn (null: if the first class has)

Each turn's prompt is the previous turn's prompt, its answer (the server's own text, sent back as an assistant
message) and the new text: a conversation's prefix grows turn by turn, and conversations opening with one system
prompt (or quoting one document) share that prefix. The plan of conversation ``i`` depends only on the seed and
``i`` (never on answers or timing), so every policy of a sweep gets the same conversations. A conversation keeps
its tool definitions on every turn, as a client does (a chat turn after a tool call still carries them): the
template renders them before the messages, so dropping them would change the prompt's first tokens. The Responses API
kind sends the full history as ``input`` items rather than ``previous_response_id``: a follow-up by id only works
on the server holding the earlier response, which a peer router that does not pin conversations cannot promise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from gateway.bench.mix import TOOL, Dist, Mix, TrafficClass, parse_dist

_WORDS = (
    "policy", "customer", "ledger", "schedule", "review", "shipment", "invoice", "contract", "service", "report",
    "account", "window", "budget", "request", "incident", "meeting", "project", "vendor", "release", "support",
    "always", "never", "carefully", "briefly", "politely", "first", "then", "finally", "each", "every",
)  # fmt: skip
MAX_TURNS = 64  # a conversation's turns at most (the spec's bound)
MAX_TEXT_TOKENS = 32_000  # a shared text's or a turn's new text's tokens at most


@dataclass(frozen=True, slots=True)
class ConversationKind:
    name: str
    weight: float
    first: str
    next: tuple[tuple[str, float], ...]
    api: str = "chat"
    documents: int = 0
    tool_result_tokens: Dist | None = None
    tools: bool | None = None  # the tool definitions on every turn (None: when the first turn's class has tools)


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    kinds: tuple[ConversationKind, ...]
    system_prompts: int = 8
    system_tokens: int = 1500
    documents: int = 12
    document_tokens: int = 700
    turns: Dist = field(default_factory=lambda: Dist(uniform=(3.0, 10.0), integer=True))
    think_s: Dist = field(default_factory=lambda: Dist(uniform=(5.0, 20.0)))
    user_tokens: Dist = field(default_factory=lambda: Dist(uniform=(20.0, 80.0), integer=True))


@dataclass(frozen=True, slots=True)
class Turn:
    cls: TrafficClass
    user: str  # the new text of this turn: the question, quoted documents, a tool's output
    think_s: float  # simulated seconds between the previous answer and this turn (0 for the first)
    params: tuple[tuple[str, Any], ...]  # temperature, max_tokens, stream, ... as the body carries them


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    kind: str
    api: str
    system_index: int
    system: str
    turns: tuple[Turn, ...]
    tools: bool = False  # every turn carries the tool definitions


def text_of(tokens: int, rng: random.Random) -> str:
    """Text the simulator's tokenizer counts as ``tokens`` tokens (four characters each)."""
    words: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[: tokens * 4]


def shared_texts(seed: int, count: int, tokens: int, tag: int) -> tuple[str, ...]:
    """``count`` shared texts (system prompts: tag 1, documents: tag 2), the same for a given seed."""
    return tuple(text_of(tokens, random.Random(seed * 1_000_003 + tag * 10_007 + i)) for i in range(count))


def plan_conversation(
    spec: ConversationSpec,
    classes: dict[str, TrafficClass],
    seed: int,
    index: int,
    systems: tuple[str, ...],
    documents: tuple[str, ...],
) -> Conversation:
    """Conversation ``index`` of the sweep with ``seed``: its kind, system prompt, turns and their classes."""
    rng = random.Random(seed * 7_919 + index)
    kind = rng.choices(spec.kinds, [k.weight for k in spec.kinds])[0]
    system_index = rng.randrange(len(systems))
    n = max(1, min(MAX_TURNS, int(spec.turns.sample(rng) or 1)))
    turns = []
    for t in range(n):
        if t == 0:
            name = kind.first
        else:
            names, weights = zip(*kind.next, strict=True)
            name = rng.choices(names, weights)[0]
        cls = classes[name]
        parts = []
        if t == 0 and kind.documents and documents:
            picked = rng.sample(range(len(documents)), min(kind.documents, len(documents)))
            parts += [f"<document>\n{documents[i]}\n</document>" for i in sorted(picked)]
        if t > 0 and kind.tool_result_tokens is not None:
            size = int(kind.tool_result_tokens.sample(rng) or 0)
            parts.append(f"<tool_result>\n{text_of(size, rng)}\n</tool_result>")
        parts.append(text_of(int(spec.user_tokens.sample(rng) or 1), rng))
        think = 0.0 if t == 0 else max(0.0, float(spec.think_s.sample(rng) or 0.0))
        turns.append(Turn(cls, "\n".join(parts), think, _params(cls, rng)))
    tools = classes[kind.first].tools if kind.tools is None else kind.tools
    return Conversation(index, kind.name, kind.api, system_index, systems[system_index], tuple(turns), tools)


def _params(cls: TrafficClass, rng: random.Random) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    temp = cls.temperature.sample(rng)
    if temp is not None:
        out.append(("temperature", round(temp, 3)))
    mt = cls.max_tokens.sample(rng)
    if mt is not None:
        out.append(("max_tokens", int(mt)))
    out.append(("stream", rng.random() < cls.stream))
    return tuple(out)


def plan_conversations(
    spec: ConversationSpec, classes: tuple[TrafficClass, ...], seed: int, n: int, first: int = 0
) -> list[Conversation]:
    """The sweep's conversations ``first`` … ``first + n - 1`` (the same list for every policy)."""
    by_name = {c.name: c for c in classes}
    systems = shared_texts(seed, spec.system_prompts, spec.system_tokens, 1)
    documents = shared_texts(seed, spec.documents, spec.document_tokens, 2)
    return [plan_conversation(spec, by_name, seed, i, systems, documents) for i in range(first, first + n)]


def turn_request(
    conv: Conversation, t: int, answers: list[str], model: str, *, send_task_header: bool = False
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Turn ``t``'s path, body and headers: the system prompt, every earlier turn with its answer, the new text."""
    turn = conv.turns[t]
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}]
    for prev, answer in zip(conv.turns[:t], answers, strict=True):
        messages.append({"role": "user", "content": prev.user})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": turn.user})
    params = dict(turn.params)
    headers = {"x-sim-task": turn.cls.task}
    if send_task_header:
        headers["x-task-type"] = turn.cls.task
    if conv.api == "responses":
        body: dict[str, Any] = {"model": model, "input": messages, "stream": params["stream"]}
        if "temperature" in params:
            body["temperature"] = params["temperature"]
        if "max_tokens" in params:
            body["max_output_tokens"] = params["max_tokens"]
        if turn.cls.response_format:
            body["text"] = {"format": {"type": turn.cls.response_format}}
        if conv.tools:
            fn = TOOL["function"]
            body["tools"] = [{"type": "function", "name": fn["name"], "parameters": fn["parameters"]}]
        return "/v1/responses", body, headers
    body = {"model": model, "messages": messages, **params}
    if params["stream"]:
        body["stream_options"] = {"include_usage": True}
    if turn.cls.response_format:
        body["response_format"] = {"type": turn.cls.response_format}
    if conv.tools:
        body["tools"] = [TOOL]
    return "/v1/chat/completions", body, headers


def mean_turns(spec: ConversationSpec) -> float:
    return spec.turns.mean()


# ---------------------------------------------------------------------------------------------------------------
# Parsing


def _int(raw: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or not lo <= raw <= hi:
        raise ValueError(f"{where}: expected an integer in [{lo}, {hi}], got {raw!r}")
    return raw


def _shared(raw: Any, where: str, default: tuple[int, int]) -> tuple[int, int]:
    if raw is None:
        return default
    if not isinstance(raw, dict) or set(raw) - {"count", "tokens"}:
        raise ValueError(f"{where}: takes count and tokens")
    return (
        _int(raw.get("count", default[0]), f"{where}.count", 0, 1000),
        _int(raw.get("tokens", default[1]), f"{where}.tokens", 1, MAX_TEXT_TOKENS),
    )


def _bounded(d: Dist, where: str, lo: float, hi: float) -> Dist:
    values = [*(d.uniform or ()), *(c for c in d.choices if c is not None)]
    if not values or min(values) < lo or max(values) > hi:
        raise ValueError(f"{where}: every value must be in [{lo:g}, {hi:g}]")
    return d


def spec_of(mix: Mix) -> ConversationSpec | None:
    """The mix's conversations (None: a single-request mix); ValueError when its block is malformed."""
    if mix.conversations is None:
        return None
    return parse_conversations(mix.conversations, {c.name for c in mix.classes})


def parse_conversations(raw: Any, class_names: set[str]) -> ConversationSpec:
    """A mix's ``conversations`` block, checked against the mix's class names."""
    if not isinstance(raw, dict) or not isinstance(raw.get("kinds"), list) or not raw["kinds"]:
        raise ValueError("conversations: needs a non-empty 'kinds' list")
    known = {"system_prompts", "documents", "turns", "think_s", "user_tokens", "kinds"}
    if set(raw) - known:
        raise ValueError(f"conversations: unknown keys {sorted(set(raw) - known)}")
    sys_n, sys_tokens = _shared(raw.get("system_prompts"), "conversations.system_prompts", (8, 1500))
    doc_n, doc_tokens = _shared(raw.get("documents"), "conversations.documents", (12, 700))
    if sys_n < 1:
        raise ValueError("conversations.system_prompts.count: at least 1")
    kinds = []
    for i, k in enumerate(raw["kinds"]):
        where = f"conversations.kinds[{i}]"
        if not isinstance(k, dict) or not k.get("name") or "first" not in k:
            raise ValueError(f"{where}: needs a name and a first class")
        nxt = k.get("next") or {str(k["first"]): 1.0}
        if not isinstance(nxt, dict) or any(float(w) < 0 for w in nxt.values()) or sum(map(float, nxt.values())) <= 0:
            raise ValueError(f"{where}.next: a map of class name to weight (>= 0, not all 0)")
        for name in [k["first"], *nxt]:
            if str(name) not in class_names:
                raise ValueError(f"{where}: class {name!r} is not one of the mix's classes")
        api = str(k.get("api", "chat"))
        if api not in ("chat", "responses"):
            raise ValueError(f"{where}.api: chat or responses, got {api!r}")
        tool = k.get("tool_result_tokens")
        tools = k.get("tools")
        if tools is not None and not isinstance(tools, bool):
            raise ValueError(f"{where}.tools: true or false")
        kinds.append(
            ConversationKind(
                name=str(k["name"]),
                weight=float(k.get("weight", 1.0)),
                first=str(k["first"]),
                next=tuple((str(n), float(w)) for n, w in nxt.items()),
                api=api,
                documents=_int(k.get("documents", 0), f"{where}.documents", 0, max(doc_n, 0)),
                tool_result_tokens=None
                if tool is None
                else _bounded(parse_dist(tool, f"{where}.tool_result_tokens", integer=True), where, 0, MAX_TEXT_TOKENS),
                tools=tools,
            )
        )
    if sum(k.weight for k in kinds) <= 0 or min(k.weight for k in kinds) < 0:
        raise ValueError("conversations.kinds: weights >= 0, not all 0")
    where = "conversations"
    return ConversationSpec(
        kinds=tuple(kinds),
        system_prompts=sys_n,
        system_tokens=sys_tokens,
        documents=doc_n,
        document_tokens=doc_tokens,
        turns=_bounded(parse_dist(raw.get("turns", {"uniform": [3, 10]}), f"{where}.turns", integer=True),
                       f"{where}.turns", 1, MAX_TURNS),
        think_s=_bounded(parse_dist(raw.get("think_s", {"uniform": [5, 20]}), f"{where}.think_s"),
                         f"{where}.think_s", 0, 3600),
        user_tokens=_bounded(parse_dist(raw.get("user_tokens", {"uniform": [20, 80]}), f"{where}.user_tokens",
                                        integer=True), f"{where}.user_tokens", 1, MAX_TEXT_TOKENS),
    )  # fmt: skip
