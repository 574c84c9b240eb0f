"""Shared pieces of the source adapters: row errors, messages, tool calls, reasoning."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from dflash_etl.core import schema as S


class RowError(Exception):
    """A row that cannot become a canonical conversation; `code` is a quarantine reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Source role name -> canonical role. Anything else is quarantined as unknown_role.
ROLE_MAP: dict[str, str] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "tool_response": "tool",
}


@dataclass
class Message:
    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


@dataclass
class Conversation:
    """A conversation in the making; `finish` turns it into a canonical row."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    role_mapping: Counter[str] = field(default_factory=Counter)
    argument_kinds: set[str] = field(default_factory=set)


def map_role(raw_role: Any, conv: Conversation, where: str) -> str:
    if not isinstance(raw_role, str):
        raise RowError(S.Q_WRONG_TYPE, f"{where}: role must be a string, got {type_name(raw_role)}")
    role = ROLE_MAP.get(raw_role.strip().lower())
    if role is None:
        raise RowError(
            S.Q_UNKNOWN_ROLE,
            f"{where}: unknown role {raw_role!r}; known: {sorted(ROLE_MAP)}",
        )
    if raw_role != role:
        conv.role_mapping[f"{raw_role}->{role}"] += 1
    return role


def to_json(value: Any, where: str, code: str = S.Q_WRONG_TYPE) -> str:
    """JSON text of a parsed value; a value JSON cannot hold (an integer beyond 64 bits, bytes or
    a decimal from Parquet) is a row error, not a crash."""
    try:
        return orjson.dumps(value).decode()
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise RowError(code, f"{where}: cannot be written as JSON ({exc})") from None


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def require_str(value: Any, where: str, allow_none: bool = False) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        raise RowError(S.Q_WRONG_TYPE, f"{where}: expected a string, got {type_name(value)}")
    return value


def require_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise RowError(S.Q_WRONG_TYPE, f"{where}: expected a list, got {type_name(value)}")
    return value


_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_think(content: str) -> tuple[str | None, str]:
    """Inline `<think>…</think>` at the start of a reply -> (reasoning, rest).

    Consecutive leading blocks are all taken (their non-empty texts joined), so the rest never
    starts with a think block and normalizing the result again changes nothing.
    """
    if "<think>" not in content:
        return None, content
    parts: list[str] = []
    end = 0
    while (match := _THINK.match(content, end)) is not None:
        parts.append(match.group(1).strip())
        end = match.end()
    if not end:
        return None, content
    return "\n\n".join(p for p in parts if p), content[end:]


def tool_call(name: Any, arguments: Any, conv: Conversation, where: str, call_id: Any = None,
              kind: str | None = None):
    """One canonical tool call; arguments become an object and the source's kind is recorded
    (`kind` names it when the caller parsed the arguments from another spelling)."""
    if not isinstance(name, str) or not name:
        raise RowError(S.Q_BAD_TOOL_CALL, f"{where}: tool call without a function name")
    if isinstance(arguments, str):
        conv.argument_kinds.add("json_string")
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError as exc:
            raise RowError(
                S.Q_BAD_TOOL_CALL, f"{where}: arguments of {name!r} are not valid JSON ({exc})"
            ) from None
    elif arguments is None:
        arguments = {}
    else:
        conv.argument_kinds.add(kind or "object")
    if not isinstance(arguments, dict):
        raise RowError(
            S.Q_BAD_TOOL_CALL,
            f"{where}: arguments of {name!r} must be an object, got {type_name(arguments)}",
        )
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call = {"id": str(call_id), **call}
    return call


def parse_openai_tool_calls(raw: Any, conv: Conversation, where: str) -> list[dict[str, Any]]:
    calls = []
    for k, item in enumerate(require_list(raw, f"{where}.tool_calls")):
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(item, dict):
            raise RowError(S.Q_BAD_TOOL_CALL, f"{at}: expected an object, got {type_name(item)}")
        fn = item.get("function", item)
        if not isinstance(fn, dict):
            raise RowError(S.Q_BAD_TOOL_CALL, f"{at}.function: expected an object")
        calls.append(tool_call(fn.get("name"), fn.get("arguments"), conv, at, item.get("id")))
    return calls


def parse_call_json(text: str, conv: Conversation, where: str) -> dict[str, Any]:
    """A `{"name": ..., "arguments": ...}` tool call written as JSON text."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise RowError(S.Q_BAD_TOOL_CALL, f"{where}: tool call is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise RowError(S.Q_BAD_TOOL_CALL, f"{where}: tool call must be a JSON object")
    return tool_call(obj.get("name"), obj.get("arguments", obj.get("parameters")), conv, where)


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_RESPONSE = re.compile(r"^\s*<tool_response>\s*(.*?)\s*</tool_response>\s*$", re.DOTALL)


def split_hermes_calls(content: str, conv: Conversation, where: str):
    """Hermes `<tool_call>{json}</tool_call>` blocks in a reply -> (text, tool calls)."""
    if "<tool_call>" not in content:
        return content, None
    calls = [parse_call_json(m, conv, where) for m in _HERMES_CALL.findall(content)]
    text = _HERMES_CALL.sub("", content).strip()
    return text, calls or None


def strip_tool_response(content: str) -> str:
    match = _HERMES_RESPONSE.match(content)
    return match.group(1) if match else content


def parse_tools(raw: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    """Tools as a list (or JSON text of one) -> OpenAI specs [{"type": "function", ...}]."""
    if raw is None or raw == "" or raw == []:
        return None
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RowError(S.Q_BAD_TOOLS, f"{where}: not valid JSON ({exc})") from None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise RowError(S.Q_BAD_TOOLS, f"{where}: expected a list of tools, got {type_name(raw)}")
    tools = []
    for k, spec in enumerate(raw):
        if not isinstance(spec, dict):
            raise RowError(S.Q_BAD_TOOLS, f"{where}[{k}]: expected an object")
        if "function" not in spec:
            spec = {"type": "function", "function": spec}
        fn = spec["function"]
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(
                S.Q_BAD_TOOLS, f"{where}[{k}]: a tool needs a function object with a name"
            )
        tools.append(spec)
    return tools or None


def tools_from_text(text: str, max_tries: int = 64) -> list[dict[str, Any]] | None:
    """Tool specs embedded in a system prompt as a JSON list (ToolACE: "Here is a list of
    functions in JSON format ...\n[{"name": ...}]"): the first JSON list in the text whose
    items are all objects with a name; None when there is none."""
    import json

    decoder = json.JSONDecoder()
    pos = text.find("[")
    tries = 0
    while pos != -1 and tries < max_tries:
        tries += 1
        try:
            value, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            pos = text.find("[", pos + 1)
            continue
        if value and isinstance(value, list) and all(
            isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
        ):
            try:
                return parse_tools(value)
            except RowError:
                return None
        pos = text.find("[", end if end > pos else pos + 1)
    return None


def get_path(row: dict[str, Any], dotted: str) -> Any:
    """`a.b.0.c` lookup for [sources.fields]; missing -> None."""
    value: Any = row
    for part in dotted.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value
