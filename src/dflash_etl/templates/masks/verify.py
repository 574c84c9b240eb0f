"""Verification: every row re-checked from its ids before it is returned (fail closed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

    def fail(msg: str) -> None:
        raise MaskRefused(R_MASK_VERIFICATION_FAILED, msg)

    n = len(row.input_ids)
    try:
        mask_bytes = bytes(row.loss_mask)
    except (TypeError, ValueError):
        mask_bytes = b"\x02"
    if len(row.loss_mask) != n or mask_bytes.translate(None, b"\x00\x01"):
        fail("loss_mask is not a 0/1 list as long as input_ids")
    runs = _runs(row.loss_mask)
    if not runs:
        fail("no supervised tokens")
    if len(row.char_spans) != len(row.expected):
        fail("row metadata is inconsistent")
    if len(runs) != len(row.expected) and not (row.truncated and len(runs) < len(row.expected)):
        fail(f"{len(runs)} supervised spans, expected {len(row.expected)}")
    if encoded is None:
        encoded = _encode_row(tokenizer, row.text, row.split_at)
    ids = encoded.ids
    ref = ids + ([row.input_ids[-1]] if row.eos_appended and len(ids) < n else [])
    if row.eos_appended and not row.truncated and len(ids) + 1 != n:
        fail("row has an appended eos but is not text + eos")
    if ref[:n] != row.input_ids or (not row.truncated and len(ref) != n):
        fail("input_ids are not the tokenization of the rendered text")
    for j, (a, b) in enumerate(runs):
        got = _decode(tokenizer, row.input_ids[a:b])
        want = row.expected[j]
        last_cut = row.truncated and j == len(runs) - 1 and b == n
        if last_cut:
            if not want.startswith(got.rstrip("\ufffd")):
                fail(f"truncated span {j} decodes to {got[:60]!r}, not a prefix of the reply")
        elif got != want:
            fail(f"span {j} decodes to {got[:80]!r} but the reply is {want[:80]!r}")
        if tag_twice := duplicated_think(got):
            raise MaskRefused(R_DUPLICATED_THINK, f"span {j} holds {tag_twice!r} twice: "
                              f"{got[:80]!r}")
        s, e = row.char_spans[j]
        if a == 0:
            fail(f"span {j} starts at the first token: no prompt before the reply")
        if (start := encoded.span(a)[0]) != s:
            fail(f"span {j}: first supervised token starts at char {start}, reply at {s}")
        if encoded.span(a - 1)[1] > s:
            fail(f"span {j}: the last prompt token runs into the reply")
        if b < len(encoded) and not last_cut and encoded.span(b)[0] < e:
            fail(f"span {j}: the first token after the turn starts inside the reply")
        if row.loss_mask[a - 1] != 0 or (b < n and row.loss_mask[b] != 0):
            fail(f"span {j}: boundary tokens are supervised")
    if row.prefill:
        _verify_prefill(row, tokenizer, runs, fail)


def _verify_prefill(
    row: TokenizedRow, tokenizer: Any, runs: list[tuple[int, int]], fail: Callable[[str], None]
) -> None:
    """A reply supervised after a pre-filled reasoning opener: the prompt tokens end with the
    opener (the model saw it), the reply does not open the block again, and it closes it."""
    m = _OPEN_REASONING_AT_END_RE.search(row.prefill)
    if m is None or m.start() != 0:
        fail(f"pre-fill {row.prefill!r} is not a reasoning opener")
        return
    close = f"</{m.group('tag')}>"
    window = len(row.prefill) + 4  # tokens enough to hold the opener's characters
    for j, (a, b) in enumerate(runs):
        if not _decode(tokenizer, row.input_ids[max(0, a - window):a]).endswith(row.prefill):
            fail(f"span {j}: the prompt does not end with the pre-fill {row.prefill!r}")
        got = _decode(tokenizer, row.input_ids[a:b])
        if got.lstrip().startswith(row.prefill.strip()):
            fail(f"span {j} opens the pre-filled block again: {got[:60]!r}")
        cut = row.truncated and j == len(runs) - 1 and b == len(row.input_ids)
        if not cut and got.count(close) != 1:
            fail(f"span {j} does not close the pre-filled block exactly once with {close!r}")
