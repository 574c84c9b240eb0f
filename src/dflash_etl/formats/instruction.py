"""Single-turn layouts: Alpaca, OpenOrca and prompt-only rows."""

from __future__ import annotations

from typing import Any

from dflash_etl import schema as S
from dflash_etl.formats.chat import parse_messages
from dflash_etl.formats.common import Conversation, Message, RowError, require_str, split_think


def _reply(text: str) -> list[Message]:
    """An empty output means the row is a prompt that still needs a response, not a reply."""
    if not text.strip():
        return []
    reasoning, content = split_think(text)
    return [Message("assistant", content, reasoning=reasoning)]


def alpaca(row: dict[str, Any], conv: Conversation) -> list[Message]:
    instruction = require_str(row.get("instruction"), "instruction")
    extra = require_str(row.get("input"), "input", allow_none=True)
    output = require_str(row.get("output"), "output", allow_none=True)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    system = row.get("system")
    head = [Message("system", require_str(system, "system"))] if system else []
    return [*head, Message("user", prompt), *_reply(output)]


def orca(row: dict[str, Any], conv: Conversation) -> list[Message]:
    system = require_str(row.get("system_prompt"), "system_prompt", allow_none=True)
    question = require_str(row.get("question"), "question")
    response = require_str(row.get("response"), "response", allow_none=True)
    head = [Message("system", system)] if system.strip() else []
    return [*head, Message("user", question), *_reply(response)]


def prompt(row: dict[str, Any], conv: Conversation) -> list[Message]:
    """`prompt` as text, or as a message list (chat-style prompt datasets)."""
    value = row.get("prompt")
    if isinstance(value, list):
        return parse_messages(value, conv, "prompt")
    if not isinstance(value, str):
        raise RowError(S.Q_WRONG_TYPE, f"prompt: expected a string or a message list, got {value!r}"[:200])
    system = row.get("system")
    head = [Message("system", require_str(system, "system"))] if system else []
    return [*head, Message("user", value)]
