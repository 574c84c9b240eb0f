"""The per-row features the tokenized suite validates, computed over a table's flattened
list columns with numpy (no Python loop over rows): lengths, supervised tokens, the longest
supervised run, and the mask's markers (does each reply end on the end of turn, is a
turn-start marker supervised). Pure: Arrow tables in, polars frames out."""

from __future__ import annotations

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
    last = np.zeros(len(mask), dtype=bool)  # the last token of each row
    last[offsets[1:][np.diff(offsets) > 0] - 1] = True
    span_end = on & (~np.concatenate([on[1:], [False]]) | last)
    open_end = np.zeros(n_rows, dtype=np.int64)
    headers = np.zeros(n_rows, dtype=np.int64)
    if markers is not None and markers.end_of_turn_ids:
        cut = last & (np.diff(offsets)[row_of] >= markers.seq_length)  # truncated there
        bad = span_end & ~np.isin(ids, markers.end_of_turn_ids) & ~cut
        open_end = np.bincount(row_of[bad], minlength=n_rows)
    if markers is not None and markers.turn_start_ids:
        headers = np.bincount(row_of[on & np.isin(ids, markers.turn_start_ids)],
                              minlength=n_rows)
    return [pl.Series("spans_without_end_of_turn", open_end.astype(np.int32)),
            pl.Series("supervised_turn_starts", headers.astype(np.int32))]


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
