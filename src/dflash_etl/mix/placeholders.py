"""Placeholder replies in the data a user brings: one short text ("OK.", "Sure!") given as the
assistant's reply to many different prompts — the signature of a file padded with dummy
replies so that prompt-only rows pass a format check. A drafter trained on them learns to
predict "OK." after any prompt, and nothing downstream notices: the rows are well formed, the
masks cover the reply, the loss falls. Pure: polars frames in, frames out.

A reply counts when it is non-empty, at most MAX_CHARS characters once lower-cased and its
whitespace collapsed, and the same text ends up as a reply in at least `min_repeats`
conversations and `min_share` of all of them. Real short replies repeat too, but rarely at a
few percent of a dataset; a classifier's labels do, and are kept with `placeholder_replies =
"keep"` (still counted and warned).
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

MAX_CHARS = 40  # as regenerate's dummy-reply check (models/generation/replies.py)
MIN_REPEATS = 3  # conversations, at the least, whatever the share
RAW_MAX_CHARS = 4096  # a reply longer than this before normalizing is not looked at


def row_short_replies(messages: Any) -> pa.Array:
    """Per row of the Arrow `messages` column, its distinct short non-empty assistant replies,
    normalized (an empty list when none): what a work item keeps for the whole-dataset count,
    so the driver reads these few strings, not every message again. pyarrow only: it runs in
    forked workers, where polars' thread pool would deadlock."""
    messages = messages.combine_chunks() if isinstance(messages, pa.ChunkedArray) else messages
    flat = pc.list_flatten(messages)
    rows = pc.list_parent_indices(messages)
    content = flat.field("content")
    # long texts are never normalized: a placeholder is short before its spaces are collapsed
    keep = pc.and_(pc.equal(flat.field("role"), "assistant"),
                   pc.less_equal(pc.utf8_length(content), RAW_MAX_CHARS))
    keep = pc.fill_null(keep, False)
    text = pc.utf8_trim_whitespace(pc.replace_substring_regex(
        pc.utf8_lower(pc.filter(content, keep)), r"\s+", " "))
    length = pc.utf8_length(text)
    short = pc.and_(pc.greater(length, 0), pc.less_equal(length, MAX_CHARS))
    found: list[list[str]] = [[] for _ in range(len(messages))]
    for row, reply in zip(pc.filter(pc.filter(rows, keep), short).to_pylist(),
                          pc.filter(text, short).to_pylist(), strict=True):
        if reply not in found[row]:
            found[row].append(reply)
    return pa.array(found, pa.list_(pa.string()))


def short_replies(rows: pl.LazyFrame) -> pl.LazyFrame:
    """(_unit, _line, id, source, reply) per conversation and short reply, from a unit file's
    `_replies` (row_short_replies)."""
    return (rows.select("_unit", "_line", "id", "source", reply="_replies").explode("reply")
            .drop_nulls("reply"))


def placeholder_texts(replies: pl.DataFrame, conversations: int, min_repeats: int,
                      min_share: float) -> pl.DataFrame:
    """The reply texts given to at least `min_repeats` different conversations (ids: a
    conversation repeated is dedup's) and `min_share` of the `conversations`: (reply,
    conversations), most frequent first."""
    floor = max(min_repeats, int(min_share * conversations + 0.999999))
    return (replies.group_by("reply").agg(conversations=pl.col("id").n_unique())
            .filter(pl.col("conversations") >= floor)
            .sort(["conversations", "reply"], descending=[True, False]))


def placeholder_warning(texts: pl.DataFrame, rows: int, min_share: float, kept: bool) -> str:
    """What the stage says: the texts, how many conversations, and what to do."""
    shown = ", ".join(f"{text!r} x{n}" for text, n in texts.head(5).iter_rows())
    if kept:
        return (f"{rows} conversations have a reply given to many prompts ({shown}): kept "
                "([ingest] placeholder_replies = \"keep\")")
    return (f"{rows} conversations filtered placeholder_reply: a short reply given to "
            f"{min_share:.0%} or more of the conversations ({shown}) is a file padded with "
            "dummy replies, and a drafter trained on it learns to say it after any prompt. "
            "Give those prompts without a reply (regenerate --mode missing answers them with "
            "the target), or set [ingest] placeholder_replies = \"keep\" if they are real "
            "replies; the rows: placeholders.parquet")
