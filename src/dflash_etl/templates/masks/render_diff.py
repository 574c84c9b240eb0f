"""Render diff: one row for the whole conversation when every turn's prompt + reply sits
unchanged in the full render."""

from __future__ import annotations

from typing import Any

from dflash_etl.templates.masks.generation import _check_generation_mask
from dflash_etl.templates.masks.per_turn import _spans_in, _Turn
from dflash_etl.templates.masks.prepare import _Masking
from dflash_etl.templates.masks.renders import _render_prefix
from dflash_etl.templates.masks.rows import _RowPlan
from dflash_etl.templates.probe_record import STRATEGY_GENERATION, STRATEGY_RENDER_DIFF


def _single_row(
    masking: _Masking, turns: list[_Turn], base: dict[str, Any], strategy: str
) -> _RowPlan | str:
    """One row holding every target turn, if each prompt+reply is a prefix of the full render.

    The full render is first made with the last turn's generation-prompt kwargs (it is then the
    render that turn's reply came from, already made), else with the base kwargs alone: any text
    that holds every turn's prompt and reply in place is an exact row.
    """
    probe, prep = masking.probe, masking.prep
    if any(t.append_eos for t in turns):
        return "turns need an appended eos (no end-of-turn marker): one row per turn instead"
    if any(t.prefill for t in turns):
        return "replies continue a pre-filled reasoning opener the full render lacks: per turn"
    kw = {**probe.render_kwargs, **base}
    tries = [kw]
    if turns[-1].index == len(prep.messages) - 1 and turns[-1].kwargs:
        tries.insert(0, {**kw, **turns[-1].kwargs})
    why = ""
    for full_kw in tries:
        full = _render_prefix(masking.tokenizer, prep, len(prep.messages), False, full_kw,
                              masking.template)
        spans = _spans_in(full, turns)
        if isinstance(spans, str):
            why = spans
            continue
        text = full[: spans[-1][1]]
        norms = list(prep.normalizations)
        if base:
            norms.append("render_kwargs:" + ",".join(f"{k}={v}" for k, v in base.items()))
        for t in turns:
            norms.extend(n for n in t.notes if n not in norms)
        turn_id = -1 if len(turns) > 1 else turns[0].ordinal
        if strategy == STRATEGY_GENERATION:
            _check_generation_mask(masking, full_kw, spans, text, [t.index for t in turns])
        name = STRATEGY_GENERATION if strategy == STRATEGY_GENERATION else STRATEGY_RENDER_DIFF
        return _RowPlan(text, spans, [t.reply for t in turns], False, turn_id, norms, name)
    return why
