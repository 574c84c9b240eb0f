"""The OpenAI-compatible wire format as the fleet client reads it: model lists, chat-completion
bodies and SSE streams, each read within a size cap and checked; anything malformed raises
`Retry` with an excerpt of what the server sent."""

from __future__ import annotations

import json
from typing import Any

from dflash_etl.models.generation.replies import Reply

# the openai backend reads at most this much of one reply: a server that sends more is broken
REPLY_BYTES_PER_TOKEN = 256  # a JSON body: content and reasoning, escaped, with margin
STREAM_BYTES_PER_CHUNK = 2048  # an SSE chunk carries about one token, plus its JSON envelope
REPLY_BYTES_BASE = 65536
EXCERPT_CHARS = 300  # of a server's text in an error message


def list_models(httpx: Any, url: str, timeout: float, deadline: float) -> list[str]:
    """The model ids `url`/models lists, within `deadline` s in all (a server that trickles its
    answer cannot hang the start); raises httpx's errors, KeyError, TypeError, ValueError."""
    import asyncio

    async def get() -> Any:
        async with asyncio.timeout(deadline), httpx.AsyncClient(timeout=timeout) as client:
            return await client.get(f"{url}/models")

    try:
        response = asyncio.run(get())
    except TimeoutError:
        raise httpx.TimeoutException(f"no complete answer within {deadline:g} s") from None
    response.raise_for_status()
    return [m["id"] for m in response.json()["data"]]


class Retry(Exception):
    """A reply that failed in a way worth retrying (the message says how)."""


async def read_capped(response: Any, cap: int, source: str) -> bytes:
    """A response body, or Retry when it runs past `cap` bytes (an endless body); `source`
    says what the cap comes from."""
    parts, size = [], 0
    async for piece in response.aiter_bytes():
        size += len(piece)
        if size > cap:
            raise Retry(f"the reply passed {cap} bytes without ending (the cap from "
                         f"{source}, with margin)")
        parts.append(piece)
    return b"".join(parts)


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """A server's text for a message: whitespace collapsed, cut at `limit`."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + f"... ({len(text)} chars)")


def text_of(value: Any, data: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise Retry(f"a malformed reply (text that is not a string): {excerpt(data)}")
    return value


def json_object(text: str, what: str, where: str = "") -> dict[str, Any]:
    """A server's JSON object; anything else raises Retry saying `what` it was ("a broken
    stream chunk"), `where` ("HTTP 200, ") and the text's excerpt."""
    try:
        value = json.loads(text)
    except ValueError:
        raise Retry(f"{what} ({where}not JSON): {excerpt(text)}") from None
    if not isinstance(value, dict):
        raise Retry(f"{what} ({where}not an object): {excerpt(text)}")
    return value


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


def refusal(url: str, status: int, text: str) -> str | None:
    """An HTTP answer's status read the one way every fleet request reads it: None for a reply
    (200), the refusal for a 4xx (the request itself is wrong: no other server would take it),
    Retry for 429, 5xx and anything else that is not a reply."""
    if status == 429 or status >= 500:
        raise Retry(f"HTTP {status}: {excerpt(text)}")
    if status >= 400:
        return f"{url} refused the request: HTTP {status}: {excerpt(text, 500)}"
    if status != 200:
        raise Retry(f"HTTP {status} is not a reply: {excerpt(text)}")
    return None


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
