"""Pre-fill: a generation prompt that leaves a reasoning block open (`<think>\\n`) the
template's turns lack; the reply is what the model writes after that opener."""

from __future__ import annotations

import re
from typing import Any

from dflash_etl.templates.masks.policy import (
    R_GENERATION_PROMPT_MISMATCH,
    R_PREFILL_NEEDS_REASONING,
)
from dflash_etl.templates.masks.prepare import _Prepared

# A reasoning block the generation prompt opens and leaves open (R1 distills, QwQ: "<think>\n").
_OPEN_REASONING_AT_END_RE = re.compile(r"<(?P<tag>think|thinking|thought|reasoning)>\n?\Z")
_OPENER_MAX = 16  # characters: the longest opener it matches, "<reasoning>\n", fits


def _thinking_on_drops_reasoning(
    prep: _Prepared, i: int, prompt: str, variant: dict[str, Any]
) -> bool:
    """A thinking-on variant tried for unrendered reasoning whose prompt opens no reasoning
    block: the row would pair a thinking-on prompt with a reply lacking the reasoning."""
    return (
        any(v is True for v in variant.values())
        and bool(prep.raw_reasoning.get(i))
        and not prep.reasoning_passed.get(i, False)
        and _OPEN_REASONING_AT_END_RE.search(prompt[-_OPENER_MAX:]) is None
    )


def _open_reasoning_prefill(prompt: str, upto: str) -> tuple[int, str] | None:
    """(where the opener starts in `prompt`, its tag) when the prompt ends by opening a reasoning
    block and the turn, rendered as the final one, matches the prompt up to that opener but
    lacks it (the template strips or never renders reasoning)."""
    offset = max(0, len(prompt) - _OPENER_MAX)  # the opener is at the end: search only there
    m = _OPEN_REASONING_AT_END_RE.search(prompt, offset)
    if m is None or not upto.startswith(prompt[: m.start()]):
        return None
    if upto.startswith(f"<{m.group('tag')}>", m.start()):
        return None
    return m.start(), m.group("tag")


def _reply_after_prefill(
    prep: _Prepared,
    i: int,
    prompt: str,
    upto: str,
    opened: tuple[int, str],
    tag: str,
    failures: list[tuple[str, str]],
) -> tuple[str, str] | None:
    """(body, prefill): what the model writes after the pre-filled opener, in the layout
    `inline_reasoning` gives (the rest of the reasoning, the closing tag, a blank line) and then
    the turn as the template renders it (content, end of turn). None after recording why not."""
    start, think = opened
    prefill = prompt[start:]
    rendered = upto[start:]
    reasoning = prep.raw_reasoning.get(i, "")
    if not reasoning:
        dropped = "reasoning_dropped:policy" in prep.normalizations
        failures.append((R_PREFILL_NEEDS_REASONING, (
            f"{tag}: the generation prompt pre-fills {prefill!r}, which the template's turns "
            "lack, and this turn has no reasoning"
            + (" (supervise_reasoning = false drops it)" if dropped else "")
            + ": what the model writes before closing the block is unknown (give the turn its "
            "reasoning, e.g. regenerate it with the target, or use a template or kwarg that "
            "does not open the block)")))
        return None
    if reasoning[:40] in rendered:  # rendered in some other form: joining it again would guess
        failures.append((R_GENERATION_PROMPT_MISMATCH, (
            f"{tag}: the generation prompt pre-fills {prefill!r} but the turn renders its "
            f"reasoning without it: {rendered[:60]!r}")))
        return None
    lead = "" if prefill.endswith("\n") else "\n"
    return f"{lead}{reasoning}\n</{think}>\n\n{rendered}", prefill
