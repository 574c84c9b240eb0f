"""Chat completions as the openai backend reads them: a completion body or SSE stream chunks,
each checked (the HTTP reading every fleet client shares is models/http.py)."""

from __future__ import annotations

import json
from typing import Any

from dflash_etl.models.generation.replies import Reply
from dflash_etl.models.http import Retry, excerpt, json_object, text_of

# the openai backend reads at most this much of one reply: a server that sends more is broken
REPLY_BYTES_PER_TOKEN = 256  # a JSON body: content and reasoning, escaped, with margin
STREAM_BYTES_PER_CHUNK = 2048  # an SSE chunk carries about one token, plus its JSON envelope


def stream_choice(data: str) -> dict[str, Any] | None:
    """The first choice of one SSE chunk; None for a chunk without choices (a usage chunk)."""
    chunk = json_object(data, "a broken stream chunk")
    if "error" in chunk:
        raise Retry(f"the server reported an error mid-stream: {excerpt(data)}")
    choices = chunk.get("choices")
    if not choices:
        return None
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise Retry(f"a broken stream chunk (choices): {excerpt(data)}")
    return choices[0]


def reply_from_completion(text: str) -> Reply:
    """A chat-completion body; anything malformed raises Retry with the body's excerpt."""
    try:
        data = json.loads(text)
    except ValueError:
        raise Retry(f"a malformed reply (HTTP 200, not JSON): {excerpt(text)}") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise Retry(f"a malformed reply (HTTP 200, no choices): {excerpt(text)}")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not isinstance(message, dict | None):
        raise Retry(f"a malformed reply (HTTP 200, choices[0].message): {excerpt(text)}")
    message = message or {}
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Reply(text_of(message.get("content"), text), text_of(choice.get("finish_reason"), text)
                 or "stop", tokens if isinstance(tokens, int) else 0,
                 text_of(message.get("reasoning_content") or message.get("reasoning"), text)
                 or None)
