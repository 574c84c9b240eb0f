"""What every fleet client reads of an OpenAI-compatible server over HTTP, one way for all of
them (regenerate's chat requests, the hidden-states requests of extract and online training):
model lists, a body within a size cap, a JSON object, an HTTP status; anything malformed raises
`Retry` with an excerpt of what the server sent."""

from __future__ import annotations

import json
from typing import Any

REPLY_BYTES_BASE = 65536  # of any reply, beside what its kind adds
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
    """A reply that failed in a way worth retrying (the message says how). `kind`: how the
    server failed, for the breaker (an endless reply, an HTTP status); None: that reply was
    malformed, not the server."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


async def read_capped(response: Any, cap: int, source: str) -> bytes:
    """A response body, or Retry when it runs past `cap` bytes (an endless body); `source`
    says what the cap comes from."""
    parts, size = [], 0
    async for piece in response.aiter_bytes():
        size += len(piece)
        if size > cap:
            raise Retry(f"the reply passed {cap} bytes without ending (the cap from "
                        f"{source}, with margin)", kind="endless reply")
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


def refusal(url: str, status: int, text: str) -> str | None:
    """An HTTP answer's status read the one way every fleet request reads it: None for a reply
    (200), the refusal for a 4xx (the request itself is wrong: no other server would take it),
    Retry for 429, 5xx and anything else that is not a reply."""
    if status == 429 or status >= 500:
        raise Retry(f"HTTP {status}: {excerpt(text)}", kind=f"HTTP {status}")
    if status >= 400:
        return f"{url} refused the request: HTTP {status}: {excerpt(text, 500)}"
    if status != 200:
        raise Retry(f"HTTP {status} is not a reply: {excerpt(text)}", kind=f"HTTP {status}")
    return None
