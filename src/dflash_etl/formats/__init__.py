"""Source adapters: any supported row layout -> one canonical conversation (or a RowError).

`normalize_row` is the single entry point; it is pure (dict in, dict out) so it can be tested on
real rows, property-tested, and run in worker processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import orjson

from dflash_etl.core import schema as S
from dflash_etl.formats import roles
from dflash_etl.formats.chat import parse_messages, pythonic_tool_calls
from dflash_etl.formats.common import (
    Conversation,
    Message,
    RowError,
    get_path,
    parse_tools,
    to_json,
    tools_from_text,
    type_name,
)
from dflash_etl.formats.glaive import glaive
from dflash_etl.formats.instruction import alpaca, orca, prompt

__all__ = ["RowError", "conversation_id", "detect_format", "normalize_row"]

# The key that identifies each format; explicit formats require it (else format_mismatch).
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "openai": ("messages",),
    "parts": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction",),
    "orca": ("question",),
    "prompt": ("prompt",),
    "glaive": ("chat",),
}


def _is_parts_list(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for msg in messages:
        if isinstance(msg, dict) and isinstance(msg.get("content"), list):
            return any(isinstance(p, dict) and "value" in p for p in msg["content"])
    return False


def detect_format(row: dict[str, Any]) -> str | None:
    """The format of one row, from the keys it carries; None when nothing is recognised."""
    if "messages" in row:
        return "parts" if _is_parts_list(row["messages"]) else "openai"
    if "conversations" in row:
        return "sharegpt"
    if "chat" in row and isinstance(row.get("chat"), str):
        return "glaive"
    if "instruction" in row:
        return "alpaca"
    if "question" in row and ("response" in row or "system_prompt" in row):
        return "orca"
    if "prompt" in row:
        return "prompt"
    return None


def _chat(key: str) -> Callable[[dict[str, Any], Conversation], list[Message]]:
    def parse(row: dict[str, Any], conv: Conversation) -> list[Message]:
        messages = parse_messages(row.get(key), conv, key)
        system = row.get("system")
        if isinstance(system, str) and system.strip() and not any(
            m.role == "system" for m in messages
        ):
            messages.insert(0, Message("system", system))
        if conv.tools is None and messages and messages[0].role == "system":
            conv.tools = tools_from_text(messages[0].content)
        pythonic_tool_calls(messages, conv, key)
        return messages

    return parse


ADAPTERS: dict[str, Callable[[dict[str, Any], Conversation], list[Message]]] = {
    "openai": _chat("messages"),
    "parts": _chat("messages"),
    "sharegpt": _chat("conversations"),
    "alpaca": alpaca,
    "orca": orca,
    "prompt": prompt,
    "glaive": glaive,
}


def _apply_fields(row: dict[str, Any], fields: dict[str, str]) -> dict[str, Any]:
    """[sources.fields]: move user-named (dotted) fields to the keys the adapters read."""
    if not fields:
        return row
    out = dict(row)
    for key, path in fields.items():
        if key == "response":
            continue
        value = get_path(row, path)
        if value is None and key in ("messages", "prompt"):
            raise RowError(
                S.Q_MISSING_FIELD,
                f"[sources.fields] {key} = {path!r}: no such field in this row; "
                f"keys: {sorted(row)[:20]}",
            )
        out[key] = value
    return out


def _response_messages(row: dict[str, Any], path: str, conv: Conversation) -> list[Message]:
    value = get_path(row, path)
    if value is None:
        raise RowError(S.Q_MISSING_FIELD, f"response field {path!r} is missing")
    if isinstance(value, str):
        return [Message("assistant", value)]
    if isinstance(value, dict):
        value = [value]
    return parse_messages(value, conv, path)


def conversation_id(messages: list[dict[str, Any]], tools: str | None) -> str:
    """Stable content hash of the normalized conversation (what dedup compares)."""
    payload = orjson.dumps({"messages": messages, "tools": tools})
    return hashlib.sha256(payload).hexdigest()[:32]


def _check(messages: list[Message]) -> str:
    if not messages:
        raise RowError(S.Q_EMPTY_CONVERSATION, "the conversation has no messages")
    for k, msg in enumerate(messages):
        # a tool that returns nothing is common in agent logs: valid data, kept
        if msg.role == "tool":
            continue
        if not msg.content.strip() and not (msg.role == "assistant" and msg.tool_calls):
            raise RowError(
                S.Q_EMPTY_CONTENT,
                f"message {k} ({msg.role}) has empty content"
                + (" and no tool calls" if msg.role == "assistant" else ""),
            )
    letters = "".join(roles.letter(m.role, bool(m.tool_calls)) for m in messages)
    why = roles.role_order_error(letters)
    if why:
        raise RowError(S.Q_ROLE_ORDER, f"invalid role order: {why}")
    return letters


def _row_format(row: dict[str, Any], fmt: str) -> str:
    """The format that reads the row: the detected one under "auto", else the configured one
    when the row has its field (a mismatch says what the row looks like instead)."""
    detected = detect_format(row)
    if fmt == "auto":
        if detected is None:
            raise RowError(
                S.Q_UNKNOWN_FORMAT,
                f"no recognised conversation field; keys: {sorted(row)[:20]} — set format= or "
                "[sources.fields] messages=...",
            )
        return detected
    if not any(key in row for key in FORMAT_KEYS[fmt]):
        hint = f" (looks like {detected!r})" if detected else ""
        raise RowError(
            S.Q_FORMAT_MISMATCH,
            f"format={fmt!r} expects a {FORMAT_KEYS[fmt][0]!r} field but the row has keys "
            f"{sorted(row)[:20]}{hint} — set format='auto' or the right format",
        )
    return fmt


def _canonical_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the canonical columns (tool calls as JSON text, as the schema stores them)."""
    return [
        {
            "role": m.role,
            "content": m.content,
            "reasoning": m.reasoning,
            "tool_calls": to_json(m.tool_calls, f"message {k} tool_calls", S.Q_BAD_TOOL_CALL)
            if m.tool_calls
            else None,
            "tool_call_id": m.tool_call_id,
            "name": m.name,
        }
        for k, m in enumerate(messages)
    ]


def normalize_row(
    row: Any, fmt: str = "auto", fields: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, int]]:
    """One source row -> (canonical conversation fields, role-mapping counts).

    Raises RowError with a quarantine reason code when the row cannot be used as it is.
    """
    if not isinstance(row, dict):
        raise RowError(S.Q_NOT_AN_OBJECT, f"expected a JSON object, got {type_name(row)}")
    fields = fields or {}
    row = _apply_fields(row, fields)
    fmt = _row_format(row, fmt)
    conv = Conversation(messages=[])
    conv.tools = parse_tools(row.get("tools"))
    messages = ADAPTERS[fmt](row, conv)
    if "response" in fields:
        messages = messages + _response_messages(row, fields["response"], conv)
    letters = _check(messages)
    canonical = _canonical_messages(messages)
    tools = to_json(conv.tools, "tools", S.Q_BAD_TOOLS) if conv.tools else None
    kinds = conv.argument_kinds
    out = {
        "id": conversation_id(canonical, tools),
        "format": fmt,
        "messages": canonical,
        "tools": tools,
        "needs_response": roles.needs_response(letters),
        "tool_arguments": ("mixed" if len(kinds) > 1 else next(iter(kinds))) if kinds else None,
    }
    return out, dict(conv.role_mapping)
