"""A generated reply: what every backend returns, how its text splits into content and
reasoning, and the checks that decide whether a conversation may keep it (empty, truncated,
stuck in a loop, dummy-like, reasoning leaking into content with thinking off)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from dflash_etl.models.generation.settings import GenerationSettings

# Reason codes
Q_EMPTY_RESPONSE = "empty_response"
Q_INSIDE_THINK = "reply_inside_think_block"  # reasoning only: the answer never came
Q_DUMMY_REPLY = "dummy_reply"
Q_REASONING_LEAK = "reasoning_in_content"
Q_GENERATION_FAILED = "generation_failed"  # the template refused, or the server failed
Q_DEGENERATE = "degenerate_repetition"  # a reply stuck in a loop (greedy decoding's failure)
# a reply holding a lone UTF-16 surrogate (a server's broken escape): no Unicode text at all
Q_INVALID_UNICODE = "invalid_unicode_reply"
F_TRUNCATED = "truncated_response"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)
DUMMY_MAX_CHARS = 40
NGRAM_N = 4  # word n-grams of the repetition check
NGRAM_MIN_WORDS = 40  # shorter replies are not judged by their n-grams


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" | "length" (or whatever the server said)
    new_tokens: int
    reasoning: str | None = None  # when the server returns it separately (reasoning parsers)
    error: str | None = None  # the request could not be rendered or served
    # the rendered generation prompt ended with an opening think tag (Qwen3.6 with thinking on:
    # `<think>\n`), so the text starts inside the reasoning; None: unknown (a server rendered it)
    think_open: bool | None = None


Request = tuple[list[dict[str, Any]], list[Any] | None]  # (messages, tools)


class Backend(Protocol):
    model_id: str

    def generate(self, requests: list[Request]) -> list[Reply]: ...


def split_reasoning(text: str, think_open: bool | None = None) -> tuple[str, str | None]:
    """(content, reasoning) of a reply's text. A leading <think>..</think> block is reasoning.
    When the generation prompt opened the block (`think_open`), the text up to the first
    </think> is reasoning (all of it when the block never closes: a reply cut short). When that
    is unknown (a server rendered the prompt), a </think> with no <think> before it can only
    close a block the prompt opened, and splits the same way."""
    close = text.find(THINK_CLOSE)
    opened = text.find(THINK_OPEN)
    if think_open and not text.lstrip().startswith(THINK_OPEN):
        if close < 0:
            return "", text.strip() or None
        return text[close + len(THINK_CLOSE):].strip(), text[:close].strip() or None
    if think_open is None and close >= 0 and not 0 <= opened < close:
        return text[close + len(THINK_CLOSE):].strip(), text[:close].strip() or None
    m = THINK_RE.match(text)
    if not m:
        return text.strip(), None
    return text[m.end():].strip(), m.group(1).strip() or None


def reply_parts(reply: Reply, thinking: str = "keep") -> tuple[str, str | None]:
    """(content, reasoning) of a reply; the server's separate reasoning wins where given (its
    text is then the content, perhaps after a leading think block). With thinking off no prompt
    opened a block: a stray </think> stays in the content, where check_reply finds the leak."""
    if reply.reasoning and reply.reasoning.strip():
        return split_reasoning(reply.text, False)[0], reply.reasoning.strip()
    return split_reasoning(reply.text, False if thinking == "off" else reply.think_open)


def repetition(text: str, settings: GenerationSettings) -> str | None:
    """Why `text` is stuck in a loop, or None: its tail repeats one short cycle
    (`linlinlin`), or most of its word n-grams are repeats (a sentence said over and over)."""
    text = text.rstrip()
    size = settings.repeat_tail_chars
    if size and len(text) >= size:
        tail = text[-size:]
        for p in range(1, min(settings.repeat_max_cycle, size // 2) + 1):
            if tail[p:] == tail[:-p]:  # periodic with period p
                return (f"degenerate repetition: its last {size} characters repeat the "
                        f"{p}-character cycle {tail[-p:]!r}: ...{tail[-60:]!r}")
    words = text.split()
    if settings.ngram_repeat_max < 1 and len(words) >= NGRAM_MIN_WORDS:
        grams = Counter(tuple(words[k:k + NGRAM_N]) for k in range(len(words) - NGRAM_N + 1))
        total = sum(grams.values())
        repeated = 1 - len(grams) / total
        if repeated > settings.ngram_repeat_max:
            top = " ".join(grams.most_common(1)[0][0])
            return (f"degenerate repetition: {repeated:.0%} of its {total} {NGRAM_N}-word "
                    f"sequences are repeats (ngram_repeat_max={settings.ngram_repeat_max:g}); "
                    f"most common {top!r}: {text[:80]!r}...")
    return None


def check_reply(reply: Reply, settings: GenerationSettings) -> tuple[str, str, str] | None:
    """(kind, code, message) when a reply must not be kept; kind is quarantine or filter. A loop
    is told before truncation: a looping reply usually runs to max_new_tokens, and the loop is
    the news."""
    if reply.error:
        return ("quarantine", Q_GENERATION_FAILED, reply.error)
    for text in (reply.text, reply.reasoning or ""):
        if (at := _lone_surrogate(text)) is not None:
            return ("quarantine", Q_INVALID_UNICODE,
                    f"the reply holds a lone UTF-16 surrogate at character {at} "
                    f"(U+{ord(text[at]):04X}): the server sent text that is not valid Unicode")
    content, reasoning = reply_parts(reply, settings.thinking)
    for part in (content, reasoning or ""):
        if loop := repetition(part, settings):
            return ("quarantine", Q_DEGENERATE, loop)
    if reply.finish_reason == "length" and not settings.keep_truncated:
        return ("filter", F_TRUNCATED,
                f"stopped at max_new_tokens={settings.max_new_tokens} before the end of turn")
    if not content and not reasoning:
        return ("quarantine", Q_EMPTY_RESPONSE, "the model returned an empty reply")
    if not content and reply.think_open and not reply.reasoning and THINK_CLOSE not in reply.text:
        return ("quarantine", Q_INSIDE_THINK, "the reply ended inside the think block the "
                f"generation prompt opened: reasoning, no answer (max_new_tokens="
                f"{settings.max_new_tokens}: raise --max-new-tokens, or --thinking off)")
    if settings.thinking == "off" and ("<think>" in content or "</think>" in content):
        return ("quarantine", Q_REASONING_LEAK,
                "thinking is off but the reply contains think markup")
    return None


def _lone_surrogate(text: str) -> int | None:
    """The position of the first character UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def dummy_replies(replies: dict[str, str], min_repeats: int) -> set[str]:
    """Keys whose reply is a short text the model gave to at least `min_repeats` different
    prompts ("OK.", "Sure!"): the signature of padded or collapsed data."""
    norm = {k: " ".join(v.split()).lower() for k, v in replies.items()}
    counts = Counter(v for v in norm.values() if len(v) <= DUMMY_MAX_CHARS)
    repeated = {v for v, n in counts.items() if n >= min_repeats}
    return {k for k, v in norm.items() if v in repeated}


def thinking_mode(reply: Reply, thinking: str) -> str:
    """on | off: whether the reply was written with thinking on (the setting, or with `keep`
    what the prompt or the reply shows: a think block opened by the prompt, a leading
    `<think>`, reasoning returned apart)."""
    if thinking in ("on", "off"):
        return thinking
    started = reply.think_open or reply.reasoning or reply.text.lstrip().startswith(THINK_OPEN)
    return "on" if started else "off"
