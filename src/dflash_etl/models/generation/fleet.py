"""The openai backend: regenerate's chat completions over one OpenAI-compatible server or a
fleet of them serving one model. The fleet itself (health, probes, least-loaded balancing,
failover, the breaker, retries and per-attempt deadlines) is models/fleet.py's, shared with the
hidden-states client of extract and online training; here is what is chat's: the body, the
reply (JSON or an SSE stream, within caps) and the model's identity for the reply cache."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from dflash_etl.core.rundir import sha256_file
from dflash_etl.models.fleet import BREAK_AFTER, Fleet
from dflash_etl.models.generation.completions import (
    REPLY_BYTES_PER_TOKEN,
    STREAM_BYTES_PER_CHUNK,
    reply_from_completion,
    stream_choice,
)
from dflash_etl.models.generation.replies import Reply, Request
from dflash_etl.models.generation.settings import GenerationSettings, render_kwargs
from dflash_etl.models.http import (
    EXCERPT_CHARS,
    REPLY_BYTES_BASE,
    Retry,
    excerpt,
    read_capped,
    refusal,
    text_of,
)

__all__ = ["BREAK_AFTER", "OpenAIBackend"]


class OpenAIBackend(Fleet):
    """Any OpenAI-compatible chat-completions server (vLLM serve, SGLang), or several serving
    one model (the fleet client, models/fleet.py): the server applies the chat template.
    Replies come back in request order; a request no server answered is a Reply with its
    error (the row's generation_failed)."""

    route = "/chat/completions"
    client_name = "openai"

    def __init__(self, settings: GenerationSettings) -> None:
        super().__init__(settings, settings.served_model)
        self.settings: GenerationSettings = settings
        name = self.served_model
        self.batch_hint = settings.concurrency * 4 * len(self.servers)  # requests per flush
        # the model's identity, never which or how many servers answer: the cache keys (and a
        # rerun's reuse of them) are the same with one server or a fleet
        files = sorted(p for p in Path(settings.model).iterdir() if p.is_file()) \
            if Path(settings.model).is_dir() else []
        identity = [name, *(sha256_file(p) for p in files if p.suffix in (".json", ".jinja"))]
        self.model_id = hashlib.sha256("\x00".join(identity).encode()).hexdigest()

    def payload(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_model, "messages": messages,
            "max_tokens": self.settings.max_new_tokens,
            "temperature": self.settings.temperature, "seed": self.settings.seed,
            "stream": self.settings.stream}
        if tools:
            body["tools"] = tools
        kwargs = render_kwargs(self.settings)
        if kwargs:  # vLLM / SGLang pass these to the template
            body["chat_template_kwargs"] = kwargs
        return body

    def generate(self, requests: list[Request]) -> list[Reply]:
        return self.send([self.payload(*request) for request in requests])

    def _failed(self, problem: str) -> Reply:
        return Reply("", "", 0, error=problem)

    async def _attempt(self, client: Any, url: str, body: dict[str, Any]) -> Reply:
        """One request; raises Retry for a failure worth retrying."""
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            if status == 200 and body["stream"]:
                return await self._streamed(response)
            text = (await read_capped(response, self._byte_cap(False), self._cap_source)
                    ).decode("utf-8", "replace")
        refused = refusal(url, status, text)
        return Reply("", "", 0, error=refused) if refused else reply_from_completion(text)

    @property
    def _cap_source(self) -> str:
        return f"max_new_tokens={self.settings.max_new_tokens}"

    def _byte_cap(self, stream: bool) -> int:
        per = STREAM_BYTES_PER_CHUNK if stream else REPLY_BYTES_PER_TOKEN
        return REPLY_BYTES_BASE + per * self._chunk_cap()

    def _chunk_cap(self) -> int:
        return 2 * self.settings.max_new_tokens + 16

    async def _streamed(self, response: Any) -> Reply:
        """An SSE stream read to its [DONE] (or finish_reason), within caps on its chunks and
        bytes; anything else (a chunk that is not JSON, an error event, a stream that stops
        early or never) raises Retry with what the server sent."""
        content, reasoning, finish, chunks, done = [], [], "", 0, False
        other: list[str] = []  # lines that are not events (an HTML page), for the message
        cap, chunk_cap, size, buffer = self._byte_cap(True), self._chunk_cap(), 0, b""
        async for piece in response.aiter_bytes():
            size += len(piece)
            if size > cap:
                raise Retry(f"the stream passed {cap} bytes without ending (the cap from "
                            f"max_new_tokens={self.settings.max_new_tokens}, with margin)",
                            kind="endless reply")
            *lines, buffer = (buffer + piece).split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    if line and sum(map(len, other)) < EXCERPT_CHARS:
                        other.append(line)
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                choice = stream_choice(data)
                if choice is None:  # a chunk without choices (usage): nothing to add
                    continue
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    raise Retry(f"a broken stream chunk (delta is not an object): "
                                 f"{excerpt(data)}")
                content.append(text_of(delta.get("content"), data))
                reasoning.append(text_of(delta.get("reasoning_content")
                                       or delta.get("reasoning"), data))
                finish = text_of(choice.get("finish_reason"), data) or finish
                chunks += 1
                if finish:  # choice 0's last chunk: what may follow (usage, [DONE]) adds nothing
                    done = True
                    break
                if chunks > chunk_cap:
                    raise Retry(f"the stream passed {chunk_cap} chunks without ending (the "
                                f"cap from max_new_tokens={self.settings.max_new_tokens}, "
                                "with margin)", kind="endless reply")
            if done:
                break
        if not done:
            sent = " ".join([*other, buffer.decode("utf-8", "replace")]).strip()
            raise Retry("the stream ended before [DONE] or a finish_reason after "
                         f"{chunks} chunks" + (f"; the server sent: {excerpt(sent)}"
                                              if sent else ""))
        return Reply("".join(content), finish or "stop", chunks, "".join(reasoning) or None)
