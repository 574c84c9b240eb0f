"""Verification: every row re-checked from its ids before it is returned (fail closed)."""

from __future__ import annotations

from typing import Any, NoReturn

from dflash_etl.templates.masks.encoding import _decode, _encode_row, _Encoded, _runs
from dflash_etl.templates.masks.policy import (
    R_DUPLICATED_THINK,
    R_MASK_VERIFICATION_FAILED,
    MaskRefused,
    TokenizedRow,
    duplicated_think,
)
from dflash_etl.templates.masks.prefill import _OPEN_REASONING_AT_END_RE


def verify_row(
    row: TokenizedRow,
    tokenizer: Any,
    encoded: _Encoded | None = None,
) -> None:
    """Re-check a row from its ids: spans decode to the replies, boundaries sit where they should.

    `encoded` is the text's encoding when the caller has just computed it; otherwise the text is
    encoded again. Raises MaskRefused(mask_verification_failed) on any mismatch.
    """
    runs = _supervised_runs(row)
    if encoded is None:
        encoded = _encode_row(tokenizer, row.text, row.split_at)
    _check_ids(row, encoded)
    for j in range(len(runs)):
        _check_span(row, tokenizer, encoded, runs, j)
    if row.prefill:
        _verify_prefill(row, tokenizer, runs)


def _fail(msg: str) -> NoReturn:
    raise MaskRefused(R_MASK_VERIFICATION_FAILED, msg)


def _supervised_runs(row: TokenizedRow) -> list[tuple[int, int]]:
    """The mask's supervised runs, if the mask is 0/1, as long as the ids, and has a run per
    reply (fewer only where truncation cut the row)."""
    n = len(row.input_ids)
    try:
        mask_bytes = bytes(row.loss_mask)
    except (TypeError, ValueError):
        mask_bytes = b"\x02"
    if len(row.loss_mask) != n or mask_bytes.translate(None, b"\x00\x01"):
        _fail("loss_mask is not a 0/1 list as long as input_ids")
    runs = _runs(row.loss_mask)
    if not runs:
        _fail("no supervised tokens")
    if len(row.char_spans) != len(row.expected):
        _fail("row metadata is inconsistent")
    if len(runs) != len(row.expected) and not (row.truncated and len(runs) < len(row.expected)):
        _fail(f"{len(runs)} supervised spans, expected {len(row.expected)}")
    return runs


def _check_ids(row: TokenizedRow, encoded: _Encoded) -> None:
    """The row's ids are its text's tokens (then the appended eos, if any; cut if truncated)."""
    n = len(row.input_ids)
    ids = encoded.ids
    ref = ids + ([row.input_ids[-1]] if row.eos_appended and len(ids) < n else [])
    if row.eos_appended and not row.truncated and len(ids) + 1 != n:
        _fail("row has an appended eos but is not text + eos")
    if ref[:n] != row.input_ids or (not row.truncated and len(ref) != n):
        _fail("input_ids are not the tokenization of the rendered text")


def _check_span(
    row: TokenizedRow, tokenizer: Any, encoded: _Encoded, runs: list[tuple[int, int]], j: int
) -> None:
    """Supervised run j decodes to reply j (a prefix of it where truncation cut the row), holds
    no think tag twice, and its first and last tokens sit exactly on the reply's edges."""
    a, b = runs[j]
    n = len(row.input_ids)
    got = _decode(tokenizer, row.input_ids[a:b])
    want = row.expected[j]
    last_cut = row.truncated and j == len(runs) - 1 and b == n
    if last_cut:
        if not want.startswith(got.rstrip("\ufffd")):
            _fail(f"truncated span {j} decodes to {got[:60]!r}, not a prefix of the reply")
    elif got != want:
        _fail(f"span {j} decodes to {got[:80]!r} but the reply is {want[:80]!r}")
    if tag_twice := duplicated_think(got):
        raise MaskRefused(R_DUPLICATED_THINK, f"span {j} holds {tag_twice!r} twice: "
                          f"{got[:80]!r}")
    s, e = row.char_spans[j]
    if a == 0:
        _fail(f"span {j} starts at the first token: no prompt before the reply")
    if (start := encoded.span(a)[0]) != s:
        _fail(f"span {j}: first supervised token starts at char {start}, reply at {s}")
    if encoded.span(a - 1)[1] > s:
        _fail(f"span {j}: the last prompt token runs into the reply")
    if b < len(encoded) and not last_cut and encoded.span(b)[0] < e:
        _fail(f"span {j}: the first token after the turn starts inside the reply")
    if row.loss_mask[a - 1] != 0 or (b < n and row.loss_mask[b] != 0):
        _fail(f"span {j}: boundary tokens are supervised")


def _verify_prefill(row: TokenizedRow, tokenizer: Any, runs: list[tuple[int, int]]) -> None:
    """A reply supervised after a pre-filled reasoning opener: the prompt tokens end with the
    opener (the model saw it), the reply does not open the block again, and it closes it."""
    m = _OPEN_REASONING_AT_END_RE.search(row.prefill)
    if m is None or m.start() != 0:
        _fail(f"pre-fill {row.prefill!r} is not a reasoning opener")
    close = f"</{m.group('tag')}>"
    window = len(row.prefill) + 4  # tokens enough to hold the opener's characters
    for j, (a, b) in enumerate(runs):
        if not _decode(tokenizer, row.input_ids[max(0, a - window):a]).endswith(row.prefill):
            _fail(f"span {j}: the prompt does not end with the pre-fill {row.prefill!r}")
        got = _decode(tokenizer, row.input_ids[a:b])
        if got.lstrip().startswith(row.prefill.strip()):
            _fail(f"span {j} opens the pre-filled block again: {got[:60]!r}")
        cut = row.truncated and j == len(runs) - 1 and b == len(row.input_ids)
        if not cut and got.count(close) != 1:
            _fail(f"span {j} does not close the pre-filled block exactly once with {close!r}")
