"""Message lists: OpenAI (role/content, parts, tool_calls), ShareGPT (from/value) and
LLaMA-Factory parts ({type: text|reasoning|tool_call, value}) share one parser, since real
files mix these spellings freely."""

from __future__ import annotations

from typing import Any

import orjson

from dflash_etl.core import schema as S
from dflash_etl.formats.common import (
    Conversation,
    Message,
    RowError,
    map_role,
    parse_call_json,
    parse_openai_tool_calls,
    require_list,
    split_hermes_calls,
    split_think,
    strip_tool_response,
    to_json,
    tool_call,
    type_name,
)
from dflash_etl.formats.pythonic import PythonicError, looks_like_calls, parse_calls

_TEXT_PARTS = ("text", "input_text", "output_text")


def _parts(parts: list[Any], conv: Conversation, where: str) -> tuple[str, str | None, list]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, part in enumerate(parts):
        at = f"{where}.content[{k}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise RowError(S.Q_WRONG_TYPE, f"{at}: expected an object, got {type_name(part)}")
        kind = part.get("type", "text")
        value = part.get("text", part.get("value"))
        if kind in _TEXT_PARTS or kind in ("reasoning", "thinking"):
            if not isinstance(value, str):
                raise RowError(S.Q_WRONG_TYPE, f"{at}: {kind} part without a string value")
            (texts if kind in _TEXT_PARTS else reasoning).append(value)
        elif kind == "tool_call":
            if isinstance(value, dict):
                value = to_json(value, at, S.Q_BAD_TOOL_CALL)
            calls.append(parse_call_json(require_text(value, at), conv, at))
        else:
            raise RowError(
                S.Q_WRONG_TYPE, f"{at}: unsupported content part type {kind!r} (text only)"
            )
    return "".join(texts), ("\n".join(reasoning) if reasoning else None), calls


def require_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RowError(S.Q_WRONG_TYPE, f"{where}: expected a string, got {type_name(value)}")
    return value


def _content(item: dict[str, Any], conv: Conversation,
             where: str) -> tuple[str, str | None, list[dict[str, Any]]]:
    """A message's text, its reasoning and the tool calls among its parts: content/value is
    a string, null, or a list of parts (text, reasoning and tool-call parts)."""
    content: Any = item.get("content")
    if content is None:
        content = item.get("value")
    reasoning = item.get("reasoning_content") or item.get("reasoning") or item.get("thinking")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RowError(S.Q_WRONG_TYPE, f"{where}.reasoning: expected a string")
    calls: list[dict[str, Any]] = []
    if isinstance(content, list):
        content, part_reasoning, calls = _parts(content, conv, where)
        reasoning = reasoning or part_reasoning
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise RowError(S.Q_WRONG_TYPE, f"{where}.content: expected a string or a list of parts, "
                       f"got {type_name(content)}")
    return content, reasoning, calls


def _structured_calls(item: dict[str, Any], conv: Conversation,
                      where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool calls: `tool_calls` (a list, or that list as a JSON
    string) and the legacy single `function_call`."""
    calls: list[dict[str, Any]] = []
    raw_calls = item.get("tool_calls")
    if isinstance(raw_calls, str):
        try:
            raw_calls = orjson.loads(raw_calls)
        except orjson.JSONDecodeError as exc:
            raise RowError(
                S.Q_BAD_TOOL_CALL, f"{where}.tool_calls: invalid JSON ({exc})"
            ) from None
    if raw_calls:
        calls.extend(parse_openai_tool_calls(raw_calls, conv, where))
    legacy = item.get("function_call")
    if isinstance(legacy, dict):
        calls.extend(parse_openai_tool_calls([legacy], conv, f"{where}.function_call"))
    return calls


def parse_message(item: Any, conv: Conversation, where: str) -> Message:
    """One message object in any spelling the formats use -> a canonical Message."""
    if not isinstance(item, dict):
        raise RowError(S.Q_WRONG_TYPE, f"{where}: expected an object, got {type_name(item)}")
    # role/content or from/value; a null in one spelling falls back to the other, since
    # Parquet structs carry every field of the file's schema (null where a row has none)
    raw_role = item.get("role")
    if raw_role is None:
        raw_role = item.get("from")
    if raw_role is None:
        raise RowError(S.Q_MISSING_FIELD, f"{where}: no 'role' (or 'from'); keys: {sorted(item)}")
    role = map_role(raw_role, conv, where)
    content, reasoning, calls = _content(item, conv, where)
    if isinstance(raw_role, str) and raw_role.lower() == "function_call":
        calls.append(parse_call_json(content, conv, where))
        content = ""
    if role == "assistant":
        calls.extend(_structured_calls(item, conv, where))
        if reasoning is None:
            reasoning, content = split_think(content)
        content, hermes = split_hermes_calls(content, conv, where)
        calls.extend(hermes or [])
    elif role == "tool":
        content = strip_tool_response(content)
    tool_call_id = item.get("tool_call_id")
    name = item.get("name")
    return Message(
        role=role,
        content=content,
        reasoning=reasoning or None,
        tool_calls=calls or None,
        tool_call_id=str(tool_call_id) if tool_call_id is not None else None,
        name=name if isinstance(name, str) else None,
    )


def parse_messages(items: Any, conv: Conversation, where: str) -> list[Message]:
    """Parse a message list, folding a bare tool-call turn into the assistant turn before it."""
    out: list[Message] = []
    for k, item in enumerate(require_list(items, where)):
        msg = parse_message(item, conv, f"{where}[{k}]")
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.role == "assistant"
            and msg.role == "assistant"
            and msg.tool_calls
            and not msg.content.strip()
            and msg.reasoning is None
        ):
            prev.tool_calls = (prev.tool_calls or []) + msg.tool_calls
            conv.role_mapping["merged_tool_call_turn"] += 1
            continue
        out.append(msg)
    return out


def pythonic_tool_calls(messages: list[Message], conv: Conversation, where: str) -> None:
    """An assistant reply that is a pythonic call list (`[f(a="v", n=3)]`, ToolACE) becomes
    structured tool calls: always when a tool turn follows (then a list that does not parse
    quarantines the row), else only when every name is one of the row's tools (a reply that
    merely looks like one stays text)."""
    tool_names = {t["function"]["name"] for t in conv.tools or []}
    for k, msg in enumerate(messages):
        if msg.role != "assistant" or msg.tool_calls or not looks_like_calls(msg.content):
            continue
        followed = k + 1 < len(messages) and messages[k + 1].role == "tool"
        try:
            calls = parse_calls(msg.content)
        except PythonicError as exc:
            if followed:
                raise RowError(
                    S.Q_BAD_TOOL_CALL,
                    f"{where} message {k}: the reply looks like a pythonic tool-call list "
                    f"before a tool turn, but {exc}: {msg.content[:120]!r}",
                ) from None
            continue
        if not followed and not all(name in tool_names for name, _ in calls):
            continue
        at = f"{where} message {k}"
        msg.tool_calls = [tool_call(name, args, conv, at, kind="pythonic") for name, args in calls]
        msg.content = ""
        conv.role_mapping["pythonic_tool_calls"] += 1
