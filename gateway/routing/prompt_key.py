"""A request's prompt as the prefix index sees it: a deterministic rendering, cut into chained chunk hashes. Pure.

The rendering stands in for the chat template (the gateway does not tokenize): what comes first in the prompt
comes first here, and a request that extends an earlier one (the next turn of a conversation, an agent's next tool
call) renders to a text that extends the earlier one's, so it shares its chunk hashes
(``gateway.fleet.prefix_index.chain_hashes``). It never raises: the classifier has already checked the shapes, and
anything unexpected is left out.

- chat: the model, the tools (templates put them in the system block, at the start), then each message in order:
  its role, its text, and its tool calls or tool call id. A non-text part (an image) counts by a hash of it, not
  its bytes.
- completions: the model and the prompt, when it is one string (a batch of prompts or token ids: no key).
- Responses API: the model, the tools, ``instructions``, then ``input`` (a string, or each item: a message's role
  and text, another item's type and text).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from gateway.fleet.prefix_index import chain_hashes
from gateway.routing.classify import ApiKind

_SEP = "\x1e"  # between messages
_ROLE = "\x1f"  # between a role and its text


def _part(part: Any) -> str:
    if not isinstance(part, dict):
        return ""
    text = part.get("text")
    if isinstance(text, str):
        return text
    # An image or audio part: its identity, not its (possibly large) bytes. A digest, not ``hash()``: the text is
    # the same in every process (a large body's prompt is rendered in a parsing process).
    digest = hashlib.blake2b(orjson.dumps(part, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
    return f"<{part.get('type')}:{digest}>"


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part(p) for p in content)
    return ""


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError):
        return ""


def _objects(value: Any) -> Iterator[dict[str, Any]]:
    """The objects of a JSON array (chat's messages, a Responses input); none when it is not an array."""
    return (i for i in value if isinstance(i, dict)) if isinstance(value, list) else iter(())


def _chat(body: Mapping[str, Any], out: list[str]) -> None:
    for m in _objects(body.get("messages")):
        role = m.get("role")
        out += (_SEP, role if isinstance(role, str) else "", _ROLE, _content(m.get("content")))  # joined once
        calls = m.get("tool_calls")
        if calls:
            out.append(_dumps(calls))
        call_id = m.get("tool_call_id")
        if isinstance(call_id, str):
            out.append(call_id)


def _responses(body: Mapping[str, Any], out: list[str]) -> None:
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        out.append(_SEP + "instructions" + _ROLE + instructions)
    raw = body.get("input")
    if isinstance(raw, str):
        out.append(_SEP + "user" + _ROLE + raw)
        return
    for item in _objects(raw):
        role = item.get("role")
        if isinstance(role, str):
            out.append(_SEP + role + _ROLE + _content(item.get("content")))
            continue
        kind = item.get("type")
        text = next((v for k in ("arguments", "output", "text") if isinstance(v := item.get(k), str)), "")
        out.append(_SEP + (kind if isinstance(kind, str) else "") + _ROLE + text)


def render_parts(api: ApiKind, body: Mapping[str, Any]) -> list[str]:
    """The request's prompt as the parts ``render_prompt`` joins (none when it has none the index can use): the
    end of each part is where an earlier, shorter prompt of the same conversation may end."""
    model = body.get("model")
    out: list[str] = [model if isinstance(model, str) else ""]
    if api == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return []
        out.append(_SEP + prompt)
        return out
    tools = body.get("tools")
    if tools:
        out.append(_SEP + "tools" + _ROLE + _dumps(tools))
    if api == "chat":
        _chat(body, out)
    else:
        _responses(body, out)
    return out


def render_prompt(api: ApiKind, body: Mapping[str, Any]) -> str:
    """The request's prompt as one text ('' when it has none the index can use)."""
    return "".join(render_parts(api, body))


def continues(api: ApiKind, body: Mapping[str, Any]) -> bool:
    """The request continues a conversation: its prompt carries an earlier turn's answer (a chat ``assistant`` or
    ``tool`` message; a Responses API input item that is not a user, system or developer message, or a
    ``previous_response_id``). A completions prompt cannot tell: False. Only such a request may go to its warm home
    (``gateway.routing.warm_home``): a new conversation goes by its class."""
    if api == "chat":
        messages = body.get("messages")
        return isinstance(messages, list) and any(
            isinstance(m, dict) and m.get("role") in ("assistant", "tool", "function") for m in messages
        )
    if api == "responses":
        if isinstance(body.get("previous_response_id"), str):
            return True
        raw = body.get("input")
        return isinstance(raw, list) and any(
            isinstance(i, dict) and i.get("role", i.get("type")) not in ("user", "system", "developer", "message")
            for i in raw
        )
    return False


def prompt_chunks(api: ApiKind, body: Mapping[str, Any]) -> tuple[int, ...]:
    """The chained chunk hashes of the request's rendered prompt (empty: nothing to match)."""
    return chain_hashes(render_prompt(api, body))
