"""Generation tags: a template whose `{% generation %}` blocks mark the replies; HF's assistant
mask from them is cross-checked against the render diff."""

from __future__ import annotations

from typing import Any

from dflash_etl.templates.masks.encoding import _runs
from dflash_etl.templates.masks.per_turn import _spans_in, _Turn, _TurnAttempt
from dflash_etl.templates.masks.policy import R_MASK_VERIFICATION_FAILED, MaskRefused
from dflash_etl.templates.masks.prepare import _Masking
from dflash_etl.templates.masks.renders import _hf_assistant_mask, _tagged_turns
from dflash_etl.templates.masks.rows import _RowPlan
from dflash_etl.templates.probe_record import STRATEGY_GENERATION


def _generation_row(
    masking: _Masking, targets: list[int], ordinals: dict[int, int]
) -> _RowPlan | None:
    """The one-row plan of a {% generation %}-tag template from one render of the conversation.

    Each tag block marks a reply; the text before it must end with the generation prompt (what
    the model sees before it generates), and the reply is checked as every render-diff reply is
    (its end-of-turn marker, the message's content in it, no duplicated think markup). None when
    any of that does not hold: the caller then plans as before (render diff + HF's mask)."""
    probe, prep = masking.probe, masking.prep
    if probe.thinking_kwargs or not probe.prefix_stable or not probe.generation_prompt:
        return None
    tagged = _tagged_turns(masking.tokenizer, probe, prep, masking.template, targets)
    if tagged is None:
        return None
    full, found = tagged
    turns: list[_Turn] = []
    for i, prompt, upto in found:
        turn = _TurnAttempt(masking, i, ordinals[i]).turn(prompt, upto, {})
        if turn is None or turn.append_eos or turn.prefill:  # an eos or a pre-fill: the full path
            return None
        turns.append(turn)
    spans = _spans_in(full, turns)
    if isinstance(spans, str):
        return None
    norms = list(prep.normalizations)
    for t in turns:
        norms.extend(n for n in t.notes if n not in norms)
    turn_id = -1 if len(turns) > 1 else turns[0].ordinal
    return _RowPlan(full[: spans[-1][1]], spans, [t.reply for t in turns], False, turn_id, norms,
                    STRATEGY_GENERATION)


def _check_generation_mask(
    masking: _Masking,
    kw: dict[str, Any],
    spans: list[tuple[int, int]],
    text: str,
    indices: list[int],
) -> None:
    """HF's {% generation %} mask must cover the render-diff replies of the supervised turns
    (`indices`: with turns = "last" HF still marks every turn), with or without the end-of-turn
    marker (the policy's `include_eot` decides that, not the tags)."""
    tokenizer, prep = masking.tokenizer, masking.prep
    ids, mask = _hf_assistant_mask(tokenizer, prep, kw, masking.template)
    got = [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in _runs(mask)]
    if len(got) == len(prep.assistant_idx):
        got = [g for g, i in zip(got, prep.assistant_idx, strict=True) if i in indices]
    want = [text[s:e] for s, e in spans]
    eot = masking.probe.eot_text.strip()

    def bare(reply: str) -> str:
        reply = reply.strip()
        return reply.removesuffix(eot).rstrip() if eot else reply

    if len(got) != len(want) or any(
        w.strip() and g.strip() and g.strip() not in w and bare(g) != bare(w)
        for g, w in zip(got, want, strict=False)
    ):
        raise MaskRefused(
            R_MASK_VERIFICATION_FAILED,
            f"{{% generation %}} mask spans {got!r} disagree with the render diff {want!r}",
        )
