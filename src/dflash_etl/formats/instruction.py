"""Single-turn layouts: Alpaca, OpenOrca and prompt-only rows."""

from __future__ import annotations

from typing import Any

from dflash_etl.core import schema as S
from dflash_etl.formats.chat import parse_messages
from dflash_etl.formats.common import (
    Conversation,
    Message,
    RowError,
    require_str,
    split_think,
    type_name,
)


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
    return [*head, *_history(row.get("history")), Message("user", prompt), *_reply(output)]


def _history(value: Any) -> list[Message]:
    """LLaMA-Factory's alpaca `history`: earlier [instruction, response] pairs, oldest first."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError(S.Q_WRONG_TYPE, "history: expected a list of [instruction, response] pairs")
    out: list[Message] = []
    for k, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RowError(
                S.Q_WRONG_TYPE, f"history[{k}]: expected an [instruction, response] pair"
            )
        out.append(Message("user", require_str(pair[0], f"history[{k}][0]")))
        out.append(Message("assistant", require_str(pair[1], f"history[{k}][1]")))
    return out


def orca(row: dict[str, Any], conv: Conversation) -> list[Message]:
    system = require_str(row.get("system_prompt"), "system_prompt", allow_none=True)
    question = require_str(row.get("question"), "question")
    response = require_str(row.get("response"), "response", allow_none=True)
    head = [Message("system", system)] if system.strip() else []
    return [*head, Message("user", question), *_reply(response)]


def prompt(row: dict[str, Any], conv: Conversation) -> list[Message]:
    """`prompt` as text, or as a message list (chat-style prompt datasets); a `completion` (or
    `response`) next to it is kept as the reply, so prompt/completion rows lose nothing."""
    value = row.get("prompt")
    key = "completion" if "completion" in row else "response"
    reply = row.get(key)
    if isinstance(value, list):
        messages = parse_messages(value, conv, "prompt")
    elif isinstance(value, str):
        system = row.get("system")
        head = [Message("system", require_str(system, "system"))] if system else []
        messages = [*head, Message("user", value)]
    else:
        raise RowError(
            S.Q_WRONG_TYPE, f"prompt: expected a string or a message list, got {type_name(value)}"
        )
    if isinstance(reply, list):
        return messages + parse_messages(reply, conv, key)
    return messages + _reply(require_str(reply, key, allow_none=True))
