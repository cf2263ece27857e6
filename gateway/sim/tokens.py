"""The simulator's tokenizer and chat template: deterministic token ids for prompts and answers (pure).

A stand-in for a real tokenizer that keeps the two properties prefix caching depends on: the same text always
gives the same ids, and a conversation's next turn starts with exactly the tokens of the turn before plus its
answer.

- ``token_ids(text)``: one id per four characters, from a CRC-32 of those characters (low 16 bits).
- ``chat_prompt_ids(body)``: the chat template's rendering of a chat body: the tools (as JSON) first, then each
  message as a header of three tokens (start, role, end of header), its content's ids and an end-of-turn token,
  then the generation prompt (the header of an assistant turn). ``3 + Σ (4 + content tokens) + tool tokens``
  ids in all: the count ``usage.prompt_tokens`` reports.
- ``answer_ids(text)``: the ids a chat answer adds to the conversation: its text's ids and the end-of-turn token,
  so that ``prompt + answer`` of one turn is the start of the next turn's rendering (whose messages carry the
  answer back as an assistant message). ``completion_ids`` is the same without the end-of-turn token.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import orjson

START_HEADER = 128006  # Llama 3's <|start_header_id|>, <|end_header_id|>, <|eot_id|>
END_HEADER = 128007
END_OF_TURN = 128009
_ROLES = {"system": 9125, "user": 882, "assistant": 78191, "tool": 23799, "developer": 9125, "ipython": 23799}


def token_ids(text: str) -> list[int]:
    """One id per four characters of ``text`` (``(len + 3) // 4`` of them), each from a CRC-32 of its characters."""
    raw = text.encode()
    if len(raw) == len(text):  # ASCII: slice the bytes (faster)
        return [zlib.crc32(raw[i : i + 4]) & 0xFFFF for i in range(0, len(raw), 4)]
    return [zlib.crc32(text[i : i + 4].encode()) & 0xFFFF for i in range(0, len(text), 4)]


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the ``text`` of each part joined by spaces."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _header(role: Any) -> list[int]:
    role_id = _ROLES.get(role) if isinstance(role, str) else None
    if role_id is None:
        role_id = token_ids(str(role))[0] if role else 0
    return [START_HEADER, role_id, END_HEADER]


def chat_prompt_ids(messages: Sequence[Any], tools: Any = None) -> list[int]:
    """The rendered chat prompt's ids (see the module's docstring for the layout)."""
    ids: list[int] = token_ids(orjson.dumps(tools).decode()) if tools else []
    for m in messages:
        if not isinstance(m, dict):
            continue
        ids += _header(m.get("role"))
        ids += token_ids(content_text(m.get("content")))
        ids.append(END_OF_TURN)
    ids += _header("assistant")
    return ids


def completion_prompt_ids(prompt: str | list[int]) -> list[int]:
    """A completions prompt's ids: a token id list as given, a string tokenized (at least one id)."""
    if isinstance(prompt, list):
        return list(prompt)
    return token_ids(prompt) or [0]


def answer_ids(text: str, *, chat: bool) -> list[int]:
    """The ids an answer adds to its sequence: the text's ids, and the end-of-turn token for a chat answer."""
    ids = token_ids(text)
    if chat:
        ids.append(END_OF_TURN)
    return ids
