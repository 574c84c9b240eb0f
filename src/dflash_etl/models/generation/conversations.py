"""The pure conversation transform of the regenerate stage: which turns to (re)generate, the
cache of finished generations, the rounds that ask a backend for each turn on the history so far,
and the accounting of what each conversation keeps or why it is dropped."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_etl.core.accounting import Stats
from dflash_etl.core.rundir import write_text_atomic
from dflash_etl.models.generation.replies import (
    Q_DUMMY_REPLY,
    Q_INSIDE_THINK,
    Backend,
    Reply,
    check_reply,
    dummy_replies,
    reply_parts,
    thinking_mode,
)
from dflash_etl.models.generation.settings import GenerationSettings

F_TOOL_CALLS = "tool_call_turns"  # mode=all cannot re-run tools, so those rows keep nothing
Failure = tuple[str, str, str]  # (quarantine | filter, reason code, message)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages as chat templates read them (tool-call arguments as objects)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning"):
            msg["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            msg["tool_calls"] = json.loads(m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        out.append(msg)
    return out


def cache_key(messages: list[dict[str, Any]], tools: str | None, settings: GenerationSettings,
              model_id: str) -> str:
    sampling = {k: getattr(settings, k) for k in ("max_new_tokens", "temperature", "seed",
                                                   "thinking")}
    if settings.template_kwargs:  # only then: the keys of earlier runs stay valid
        sampling["template_kwargs"] = settings.template_kwargs
    blob = json.dumps([messages, tools, sampling, model_id], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def target_positions(conv: dict[str, Any], mode: str) -> list[int]:
    """Message positions to (re)generate: each assistant turn (mode all) plus the missing reply."""
    positions = [k for k, m in enumerate(conv["messages"]) if m["role"] == "assistant"] \
        if mode == "all" else []
    if conv.get("needs_response"):
        positions.append(len(conv["messages"]))
    return positions


class ReplyCache:
    """Finished generations, appended as JSON lines and flushed per batch. A failed one (the
    template refused, the servers failed) is kept for this run only: a rerun tries it again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if not path.exists():
            return
        text = path.read_bytes()
        whole = text[:text.rfind(b"\n") + 1]  # a line cut by a kill has no newline yet
        good = []
        lines = whole.split(b"\n")[:-1]
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:  # garbled (or not UTF-8): generated again
                continue
            if isinstance(entry, dict) and "key" in entry:
                self.entries[entry["key"]] = entry
                good.append(line.decode("utf-8") + "\n")
        if len(whole) != len(text) or len(good) != len(lines):
            # without the cut or garbled lines: appending after a cut line would glue the next
            # entry to it (lost on the next read), and the published cache would keep the bytes
            write_text_atomic(path, "".join(good))

    def add(self, entries: list[dict[str, Any]]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            for entry in entries:
                if not entry.get("error"):
                    fh.write(json.dumps(entry) + "\n")
                self.entries[entry["key"]] = entry
            fh.flush()
            os.fsync(fh.fileno())


def _generate_round(pending: list[tuple[str, list[dict[str, Any]], Any]], backend: Backend,
                    cache: ReplyCache, settings: GenerationSettings, bar: Any) -> None:
    """Generate every (key, messages, tools) not in the cache, in batches; a key pending twice
    (two conversations with the same history so far) is generated once, so the cache holds one
    line per key however the run was interrupted and resumed."""
    todo: dict[str, tuple[str, list[dict[str, Any]], Any]] = {}
    for p in pending:
        if p[0] not in cache.entries:
            todo.setdefault(p[0], p)  # the first of each key, in pending order
    bar.advance(len(pending) - len(todo))
    size = getattr(backend, "batch_hint", settings.batch_size)
    work = list(todo.values())
    for start in range(0, len(work), size):
        batch = work[start:start + size]
        replies = backend.generate([(messages, tools) for _, messages, tools in batch])
        cache.add([{"key": key, **asdict(reply)}
                   for (key, _, _), reply in zip(batch, replies, strict=True)])
        bar.advance(len(batch))


def _reply_counts() -> dict[str, Any]:
    """Per source: replies generated (kept or not), those dropped with their conversation by
    reason, and per thinking mode the replies and those cut at max_new_tokens."""
    return {"generated_turns": 0, "generated_replies": 0, "dropped_replies": Counter(),
            "replies_by_mode": Counter(), "truncated_by_mode": Counter()}


def truncation(total: dict[str, Any], max_share: float) -> tuple[dict[str, Any], list[str]]:
    """Per thinking mode the share of replies cut at max_new_tokens (finish_reason "length"),
    and a warning for each mode above `max_share`: most thinking-on replies cut short is
    silently lost (or, kept, truncated) data."""
    shares, warnings = {}, []
    for mode, n in sorted(total.get("replies_by_mode", {}).items()):
        cut = total.get("truncated_by_mode", {}).get(mode, 0)
        shares[mode] = {"replies": n, "truncated": cut, "share": round(cut / n, 4) if n else 0.0}
        if n and cut / n > max_share:
            warnings.append(
                f"{cut} of {n} replies with thinking {mode} ({100 * cut / n:.0f}%) stopped at "
                f"max_new_tokens before their end of turn (over max_truncated_share="
                f"{max_share:g}): raise --max-new-tokens"
                + (" (reasoning needs thousands of tokens)" if mode == "on" else ""))
    return shares, warnings


def think_cut_warning(total: dict[str, Any], settings: GenerationSettings) -> list[str]:
    """A warning when replies ended inside their think block (reasoning, no answer): on a
    thinking target the fix is more tokens or no thinking, not the data."""
    cut = int(total.get("quarantine_reasons", {}).get(Q_INSIDE_THINK, 0))
    if not cut:
        return []
    replies = sum(total.get("replies_by_mode", {}).values()) or total.get("rows_in", 0)
    return [f"{cut} of {replies} replies ended inside the think block, reasoning with no "
            f"answer ({Q_INSIDE_THINK}), at max_new_tokens={settings.max_new_tokens}: raise "
            "--max-new-tokens (reasoning needs thousands of tokens) or pass --thinking off"]


@dataclass
class _Conversation:
    """One conversation on its way through the rounds, and what its replies did."""

    conv: dict[str, Any]
    tools: list[Any] | None
    targets: list[int]  # the message positions to (re)generate, in order
    messages: list[dict[str, Any]]
    skip: str | None = None  # filtered before any generation (tool-call turns, mode all)
    failure: Failure | None = None
    done: int = 0  # targets answered
    replies: list[tuple[str, str]] = field(default_factory=list)  # (thinking mode, finish)
    finish: list[str] = field(default_factory=list)  # finish reasons of the kept replies
    turns: list[dict[str, Any]] = field(default_factory=list)
    last_reply: str = ""

    @property
    def waiting(self) -> bool:
        return not (self.skip or self.failure) and self.done < len(self.targets)


def _start(conv: dict[str, Any], mode: str) -> _Conversation:
    has_calls = mode == "all" and any(
        m["role"] == "assistant" and m.get("tool_calls") for m in conv["messages"])
    return _Conversation(conv, json.loads(conv["tools"]) if conv.get("tools") else None,
                         target_positions(conv, mode), list(conv["messages"]),
                         skip=F_TOOL_CALLS if has_calls else None)


def _next_round(state: list[_Conversation], model_id: str, settings: GenerationSettings
                ) -> list[tuple[_Conversation, int, str, list[dict[str, Any]]]]:
    """(conversation, position, cache key, history) of each conversation's next target."""
    slots = []
    for s in state:
        if s.waiting:
            pos = s.targets[s.done]
            history = template_messages(s.messages[:pos])
            slots.append((s, pos, cache_key(history, s.conv.get("tools"), settings, model_id),
                          history))
    return slots


def _take_reply(s: _Conversation, pos: int, entry: dict[str, Any],
                settings: GenerationSettings) -> None:
    """Put the cached reply at `pos` of the conversation, or record why it cannot be kept."""
    reply = Reply(**{k: v for k, v in entry.items() if k != "key"})
    if not reply.error:  # a reply the target wrote, whatever becomes of it below
        s.replies.append((thinking_mode(reply, settings.thinking), reply.finish_reason))
    bad = check_reply(reply, settings)
    if bad:
        s.failure = bad
        return
    content, reasoning = reply_parts(reply, settings.thinking)
    message = {"role": "assistant", "content": content, "reasoning": reasoning,
               "tool_calls": None, "tool_call_id": None, "name": None}
    s.messages = [*s.messages[:pos], message, *s.messages[pos + 1:]]
    s.finish.append(reply.finish_reason)
    s.turns.append({"turn": pos, "finish_reason": reply.finish_reason,
                    "new_tokens": reply.new_tokens, "key": entry["key"]})
    s.last_reply = content
    s.done += 1


def _count_replies(stats: Stats, replies: list[tuple[str, str]]) -> None:
    stats.rows_in += 1
    stats.extra["generated_replies"] += len(replies)
    for mode, reason in replies:
        stats.extra["replies_by_mode"][mode] += 1
        if reason == "length":
            stats.extra["truncated_by_mode"][mode] += 1


def _drop(stats: Stats, s: _Conversation, failure: Failure) -> dict[str, Any] | None:
    """Count a dropped conversation (every reply of it goes with it); its quarantine row, if
    the failure quarantines."""
    kind, code, message = failure
    if s.replies:
        stats.extra["dropped_replies"][code] += len(s.replies)
    if kind == "filter":
        stats.filter(code)
        return None
    stats.quarantine(code)
    conv = s.conv
    return {"source": conv["source"], "file": conv.get("file"), "line": conv.get("line"),
            "reason": code, "message": f"conversation {conv['id']}: {message}",
            "raw": None, "raw_bytes": None}


def _account(state: list[_Conversation], settings: GenerationSettings):
    """(kept, quarantine rows, per-source stats, finish reasons, generated turns) once every
    round is done; a short reply given to many prompts drops its conversations as dummies."""
    answered = {s.conv["id"]: s.last_reply for s in state
                if s.targets and not s.failure and not s.skip}
    dummies = dummy_replies(answered, settings.dummy_min_repeats)
    kept, quarantine, per_source, turns = [], [], {}, []
    finish: Counter[str] = Counter()
    for s in state:
        conv = s.conv
        stats = per_source.setdefault(conv["source"], Stats(extra=_reply_counts()))
        _count_replies(stats, s.replies)
        failure = s.failure
        if conv["id"] in dummies:
            failure = ("quarantine", Q_DUMMY_REPLY,
                       f"reply {answered[conv['id']]!r} was given to at least "
                       f"{settings.dummy_min_repeats} different prompts")
        if s.skip:
            stats.filter(s.skip)
            continue
        if failure:
            if (row := _drop(stats, s, failure)) is not None:
                quarantine.append(row)
            continue
        stats.rows_out += 1
        stats.extra["generated_turns"] += s.done
        finish.update(s.finish)
        turns.extend({"id": conv["id"], **t} for t in s.turns)
        kept.append({**conv, "messages": s.messages,
                     "needs_response": False if s.targets else conv.get("needs_response")})
    return kept, quarantine, per_source, finish, turns


def regenerate_conversations(conversations: list[dict[str, Any]], backend: Backend,
                             cache: ReplyCache, settings: GenerationSettings, bar: Any):
    """Conversations -> (kept, quarantine rows, per-source stats, finish reasons, generated
    turns). Round r generates the r-th target of every conversation on its history so far."""
    state = [_start(conv, settings.mode) for conv in conversations]
    while slots := _next_round(state, backend.model_id, settings):
        _generate_round([(key, history, s.tools) for s, _, key, history in slots], backend,
                        cache, settings, bar)
        for s, pos, key, _ in slots:
            _take_reply(s, pos, cache.entries[key], settings)
    return _account(state, settings)
