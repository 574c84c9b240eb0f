"""A planned row (its text, reply spans, what each must decode to) made a TokenizedRow:
encoded, masked, truncated, verified."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_etl.templates.masks.encoding import _encode_row, _Encoded, _longest_run, _pieces
from dflash_etl.templates.masks.policy import (
    R_EXCEEDS_SEQ_LENGTH,
    R_TOKEN_STRADDLES_BOUNDARY,
    R_TOO_FEW_SUPERVISED,
    MaskPolicy,
    MaskRefused,
    TokenizedRow,
)
from dflash_etl.templates.masks.verify import verify_row
from dflash_etl.templates.probe_record import TemplateProbe


@dataclass
class _RowPlan:
    """A row before tokenization: its text, the reply spans in it and what each must decode to."""

    text: str
    spans: list[tuple[int, int]]
    expected: list[str]
    append_eos: bool
    turn: int
    norms: list[str]
    strategy: str
    split_at: int | None = None  # per-turn rows: prompt and reply are encoded apart here
    prefill: str = ""  # see TokenizedRow.prefill

    def pieces(self) -> tuple[str, ...]:
        return _pieces(self.text, self.split_at)


def _build_row(
    tokenizer: Any,
    plan: _RowPlan,
    probe: TemplateProbe,
    policy: MaskPolicy,
    encoded: _Encoded | None = None,
) -> TokenizedRow:
    """Encode the row text (unless `encoded` is given), mark tokens starting inside spans,
    truncate, verify."""
    text, spans, append_eos = plan.text, plan.spans, plan.append_eos
    if encoded is None:
        encoded = _encode_row(tokenizer, text, plan.split_at, policy.seq_length)
    ids = encoded.ids
    if encoded.kept_chars is not None:  # a cut text: a reply past the tokens kept is not seen
        spans = [span for span in spans if span[0] < encoded.kept_chars]
    mask = _span_mask(encoded, spans, text)
    exp = list(plan.expected)
    if append_eos:
        ids = [*ids, int(probe.eos_fallback_id)]  # type: ignore[arg-type]
        mask.append(1)
        exp[-1] = exp[-1] + str(probe.eos_fallback_token)
    row = TokenizedRow(
        ids, mask, plan.turn, list(plan.norms), plan.strategy, text, list(spans), exp, append_eos,
        False, plan.split_at, prefill=plan.prefill,
    )
    _fit_seq_length(row, policy, cut=encoded.kept_chars is not None)
    longest = _longest_run(row.loss_mask)
    if longest < policy.min_supervised_tokens:
        raise MaskRefused(
            R_TOO_FEW_SUPERVISED,
            f"longest supervised run is {longest} tokens < {policy.min_supervised_tokens}",
        )
    verify_row(row, tokenizer, encoded)
    return row


def _span_mask(encoded: _Encoded, spans: list[tuple[int, int]], text: str) -> list[int]:
    """1 for each token starting inside a reply span; a token straddling a span's edge is a
    refusal (it would be half prompt, half reply)."""
    mask = [0] * len(encoded.ids)
    for s, e in spans:
        first = encoded.first_at_or_after(s)
        end = encoded.first_at_or_after(e)
        for boundary, t in ((s, first - 1), (e, end - 1)):
            # the only token that can straddle a boundary is the last one starting before it
            if t >= 0 and (a_b := encoded.span(t))[0] < boundary < a_b[1]:
                a, b = a_b
                raise MaskRefused(
                    R_TOKEN_STRADDLES_BOUNDARY,
                    f"token {t} {text[a:b]!r} straddles the reply boundary at char {boundary}",
                )
        mask[first:end] = [1] * (end - first)
    return mask


def _fit_seq_length(row: TokenizedRow, policy: MaskPolicy, cut: bool = False) -> None:
    """Cut a row longer than seq_length on the right, or refuse it (`truncation = "drop"`).
    `cut`: its text was cut before encoding, and it has more tokens than it says."""
    n = len(row.input_ids)
    if policy.seq_length is None or n <= policy.seq_length:
        return
    tokens = f"{n}+" if cut else str(n)
    if policy.truncation == "drop":
        raise MaskRefused(R_EXCEEDS_SEQ_LENGTH,
                          f"{tokens} tokens > seq_length {policy.seq_length}")
    row.normalizations.append(f"truncated_right:{tokens}->{policy.seq_length}")
    row.input_ids = row.input_ids[: policy.seq_length]
    row.loss_mask = row.loss_mask[: policy.seq_length]
    row.truncated = True
