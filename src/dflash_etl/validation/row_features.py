"""The per-row features the tokenized suite validates, computed over a table's flattened
list columns with numpy (no Python loop over rows): lengths, supervised tokens, the longest
supervised run, and the mask's markers (does each reply end on the end of turn, is a
turn-start marker supervised, how long is the longest complete reply); per source, how many
rows' longest reply sits at the source's longest (replies cut at a generation limit pile up
there). Pure: Arrow tables in, polars frames out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from dflash_etl.core.outputs import TokenizedOutput


def longest_runs(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per row, the longest run of 1s in a flattened list column (values, offsets)."""
    n_rows = len(offsets) - 1
    out = np.zeros(n_rows, dtype=np.int32)
    ones = values == 1
    if n_rows == 0 or not ones.any():
        return out
    n = len(ones)
    boundary_start = np.zeros(n, dtype=bool)
    starts_idx = offsets[:-1][(offsets[:-1] >= 0) & (offsets[:-1] < n)]
    boundary_start[starts_idx] = True
    boundary_end = np.zeros(n, dtype=bool)
    ends_idx = offsets[1:] - 1
    boundary_end[ends_idx[(ends_idx >= 0) & (ends_idx < n)]] = True
    prev = np.concatenate([[False], ones[:-1]])
    nxt = np.concatenate([ones[1:], [False]])
    starts = np.flatnonzero(ones & (~prev | boundary_start))
    ends = np.flatnonzero(ones & (~nxt | boundary_end)) + 1
    lengths = ends - starts
    run_rows = np.searchsorted(offsets, starts, side="right") - 1
    rows, first = np.unique(run_rows, return_index=True)
    out[rows] = np.maximum.reduceat(lengths, first)
    return out


def _list_buffers(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    base = offsets[0]
    return values[base:offsets[-1]], offsets - base


def marker_features(ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray,
                    markers: TokenizedOutput | None) -> list[pl.Series]:
    """Per row, the supervised spans whose last token is not the end of turn (a span cut by
    the row's end at seq_length aside), and the supervised turn-start markers: a mask over
    the whole sequence, shifted by a token or without the end of turn shows in them."""
    n_rows = len(offsets) - 1
    on = mask == 1
    row_of = np.repeat(np.arange(n_rows), np.diff(offsets))
    first = np.zeros(len(mask), dtype=bool)  # the first token of each row
    first[offsets[:-1][np.diff(offsets) > 0]] = True
    last = np.zeros(len(mask), dtype=bool)  # the last token of each row
    last[offsets[1:][np.diff(offsets) > 0] - 1] = True
    span_end = on & (~np.concatenate([on[1:], [False]]) | last)
    open_end = np.zeros(n_rows, dtype=np.int64)
    headers = np.zeros(n_rows, dtype=np.int64)
    longest = np.zeros(n_rows, dtype=np.int64)
    final = np.full(n_rows, -1, dtype=np.int64)  # the longest reply's last token
    if markers is not None and markers.end_of_turn_ids:
        cut = last & (np.diff(offsets)[row_of] >= markers.seq_length)  # truncated there
        closed = np.isin(ids, markers.end_of_turn_ids)
        bad = span_end & ~closed & ~cut
        open_end = np.bincount(row_of[bad], minlength=n_rows)
        starts = np.flatnonzero(on & (~np.concatenate([[False], on[:-1]]) | first))
        ends = np.flatnonzero(span_end)  # one per start, in order
        complete = closed[ends] & (ends > starts)
        rows, lengths, ends = row_of[ends[complete]], (ends - starts)[complete], ends[complete]
        order = np.lexsort((lengths, rows))  # by row, then length: each row's longest last
        keep = order[np.r_[rows[order][1:] != rows[order][:-1], True]] if len(order) else order
        longest[rows[keep]] = lengths[keep]
        final[rows[keep]] = ids[ends[keep] - 1]
    if markers is not None and markers.turn_start_ids:
        headers = np.bincount(row_of[on & np.isin(ids, markers.turn_start_ids)],
                              minlength=n_rows)
    return [pl.Series("spans_without_end_of_turn", open_end.astype(np.int32)),
            pl.Series("supervised_turn_starts", headers.astype(np.int32)),
            pl.Series("longest_complete_reply", longest.astype(np.int32)),
            pl.Series("longest_reply_last_token", final)]


MIN_CAPPED_REPLY = 16  # tokens: shorter replies at one length are an answer format, not a cap
MIN_CAPPED_ROWS = 3
MID_TEXT = 0.5  # of the rows at the longest length, ending mid-text: cut, not a fixed format
SPIKE = 4  # rows at the longest length / rows per length just below it: a pile, not a tail
MAX_DECODED = 1000  # of a pile's last tokens decoded: the share is read from these


def capped_replies(rows: pl.DataFrame, ends_mid_text: Callable[[list[int]], list[bool]]
                   ) -> dict[str, dict[str, Any]]:
    """Per source: its longest complete reply (tokens, end of turn aside), how many rows'
    longest reply is exactly that long, how many of those end mid-text (`ends_mid_text` of
    their last tokens, the first MAX_DECODED: a word or a comma, not a full stop, a bracket or
    a code fence), and the
    share of its rows they are where that is a cut (>= MIN_CAPPED_ROWS rows of >=
    MIN_CAPPED_REPLY tokens, SPIKE times the rows per length of the few lengths just below,
    most of them mid-text), else 0. Natural replies thin out towards the longest (a length
    penalty bunches them near it, without a spike at one length); a generator stopped at
    max_new_tokens leaves every longer reply there, cut; templated replies of one length end
    as sentences do."""
    needed = {"source", "longest_complete_reply", "longest_reply_last_token"}
    if not needed <= set(rows.columns) or not rows.height:
        return {}
    length = pl.col("longest_complete_reply")
    at_longest = length == length.max()
    window = pl.max_horizontal(pl.lit(4), length.max() // 10)  # the lengths just below
    grouped = rows.group_by("source").agg(
        pl.len().alias("rows"), length.max().alias("longest"),
        at_longest.sum().alias("at_longest"),
        ((length < length.max()) & (length >= length.max() - window)).sum().alias("below"),
        window.first().alias("window"),
        pl.col("longest_reply_last_token").filter(at_longest).alias("last_tokens"))
    out = {}
    for source, n, longest, at, below, window_, last_tokens in grouped.iter_rows():
        piled = (at >= MIN_CAPPED_ROWS and longest >= MIN_CAPPED_REPLY
                 and at * window_ >= SPIKE * below)
        looked = last_tokens[:MAX_DECODED] if piled else []
        mid_text = sum(ends_mid_text(looked)) if looked else 0
        cut = piled and mid_text >= MID_TEXT * len(looked)
        out[source] = {"longest_reply": int(longest), "rows_at_longest_reply": int(at),
                       "ending_mid_text": int(mid_text), "capped_reply_share": at / n if cut
                       else 0.0}
    return out


def mid_text_endings(tokenizer: Any) -> Callable[[list[int]], list[bool]]:
    """Whether each token, decoded, ends mid-text: a letter, a digit or , ; ( - last."""
    def ends_mid_text(ids: list[int]) -> list[bool]:
        out = []
        for i in ids:
            text = tokenizer.decode([int(i)]).rstrip()
            out.append(bool(text) and (text[-1].isalnum() or text[-1] in ",;(-"))
        return out
    return ends_mid_text


def tokenized_features(table: pa.Table, markers: TokenizedOutput | None = None
                       ) -> pl.DataFrame:
    """One row per training row: identity columns plus mask and length features (and, with
    the output's `markers`, what `marker_features` counts)."""
    names = table.column_names
    keep = [c for c in ("id", "source", "turn", "seq_len") if c in names]
    # combined into buffers of their own: a record batch read from a stream is one allocation,
    # and a column kept zero-copy would keep its batch's token lists alive (a shard per shard)
    out = pl.from_arrow(table.select(keep).combine_chunks()) if keep else pl.DataFrame()
    if not isinstance(out, pl.DataFrame):
        out = out.to_frame()
    cols: list[pl.Series] = []
    if "input_ids" in names:
        _, offsets = _list_buffers(table.column("input_ids"))
        cols.append(pl.Series("n_tokens", np.diff(offsets).astype(np.int32)))
    if "loss_mask" in names:
        values, offsets = _list_buffers(table.column("loss_mask"))
        lengths = np.diff(offsets)
        supervised = np.add.reduceat(values, offsets[:-1], dtype=np.int64) if len(values) else (
            np.zeros(len(lengths), dtype=np.int64))
        supervised = np.where(lengths > 0, supervised, 0)  # reduceat repeats on empty rows
        fraction = np.divide(supervised, lengths, out=np.zeros(len(lengths)), where=lengths > 0)
        cols += [pl.Series("mask_len", lengths.astype(np.int32)),
                 pl.Series("supervised_tokens", supervised.astype(np.int32)),
                 pl.Series("longest_supervised_run", longest_runs(values, offsets)),
                 pl.Series("supervised_fraction", fraction)]
        if "input_ids" in names:
            ids, id_offsets = _list_buffers(table.column("input_ids"))
            same = np.array_equal(id_offsets, offsets)  # else the contract names the mismatch
            cols += marker_features(ids, values, offsets, markers if same else None)
    if not keep:
        return pl.DataFrame(cols)
    return out.with_columns(cols) if cols else out
