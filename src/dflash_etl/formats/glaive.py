"""Glaive function-calling v2: a `system` string plus one `chat` string with
USER: / ASSISTANT: / FUNCTION RESPONSE: markers, `<functioncall>` and `<|endoftext|>`."""

from __future__ import annotations

import json
import re
from typing import Any

from dflash_etl.core import schema as S
from dflash_etl.formats.common import (
    Conversation,
    Message,
    RowError,
    parse_tools,
    require_str,
    split_think,
    tool_call,
)

_TURN = re.compile(r"(?:^|\s)(USER|ASSISTANT|FUNCTION RESPONSE):\s?")
_ROLE = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
# Glaive writes the arguments as a single-quoted JSON string: {"name": .., "arguments": '{..}'}
_CALL = re.compile(
    r"<functioncall>\s*\{\s*\"name\"\s*:\s*\"([^\"]+)\"\s*,\s*\"arguments\"\s*:\s*"
    r"(?:'(.*)'|(\{.*\}))\s*\}\s*$",
    re.DOTALL,
)


def _assistant(text: str, conv: Conversation, where: str) -> Message:
    reasoning, text = split_think(text)  # inline <think>, as in every other format
    if "<functioncall>" not in text:
        return Message("assistant", text.strip(), reasoning=reasoning)
    head, _, call_text = text.partition("<functioncall>")
    match = _CALL.match("<functioncall>" + call_text.strip())
    if match is None:
        raise RowError(
            S.Q_BAD_TOOL_CALL, f"{where}: cannot parse <functioncall> {call_text[:80]!r}"
        )
    name, quoted, bare = match.groups()
    call = tool_call(name, quoted if quoted is not None else bare, conv, where)
    return Message("assistant", head.strip(), reasoning=reasoning, tool_calls=[call])


def glaive(row: dict[str, Any], conv: Conversation) -> list[Message]:
    chat = require_str(row.get("chat"), "chat")
    system = require_str(row.get("system"), "system", allow_none=True).strip()
    system = system.removeprefix("SYSTEM:").strip()
    pieces = _TURN.split(chat)
    if len(pieces) < 3 or pieces[0].strip():
        raise RowError(
            S.Q_UNPARSEABLE_CHAT,
            "chat: expected 'USER: … ASSISTANT: …' turns; starts with " + repr(chat[:60]),
        )
    messages = [Message("system", system)] if system else []
    for k in range(1, len(pieces), 2):
        marker, text = pieces[k], pieces[k + 1].replace("<|endoftext|>", "").strip()
        role = _ROLE[marker]
        if role != marker.lower():
            conv.role_mapping[f"{marker}->{role}"] += 1
        if role == "assistant":
            messages.append(_assistant(text, conv, f"chat turn {k // 2}"))
        else:
            messages.append(Message(role, text))
    if conv.tools is None and system:
        conv.tools = _tools_from_system(system)
    return messages


def _tools_from_system(system: str) -> list[dict[str, Any]] | None:
    """Glaive embeds the function specs as JSON objects in the system prompt (one after another
    when there are several); recover them when they parse."""
    decoder = json.JSONDecoder()
    specs: list[Any] = []
    pos = system.find("{")
    while pos != -1:
        try:
            obj, end = decoder.raw_decode(system, pos)
        except ValueError:
            pos = system.find("{", pos + 1)
            continue
        specs.append(obj)
        pos = system.find("{", end)
    try:
        return parse_tools(specs)
    except RowError:
        return None
