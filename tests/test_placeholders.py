"""A file padded with dummy replies ("OK." after every prompt) is caught by looking at the
replies: filtered placeholder_reply, listed, warned with what to do (it trained silently)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.mix.placeholders import placeholder_texts, row_short_replies, short_replies
from dflash_etl.stages import ingest, load_config


def _conversation(prompt: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": reply}]}


def _ingest(tmp_path, rows: list[dict], **overrides) -> dict:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pipeline.toml").write_text('[[sources]]\nname = "mine"\npath = "rows.jsonl"\n')
    return ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run", progress=False,
                      workers=1, **overrides)


REAL = [_conversation(f"What is {a} + {a}?", f"{a} + {a} = {2 * a}, since doubling {a} gives "
                      f"{2 * a}.") for a in range(40)] + [
    _conversation("Say yes.", "Yes."), _conversation("Agree?", "yes.")]  # twice: not a pattern
PADDED = [_conversation(f"Write a story about {w}.", r) for w, r in zip(
    ["cats", "dogs", "rain", "ships", "tea", "maps", "snow", "bees", "owls", "salt"],
    ["OK.", "ok.", " OK. ", "OK.", "OK.", "OK.", "Ok.", "OK.", "OK.", "OK."], strict=True)]


def test_a_file_padded_with_ok_replies_is_caught_listed_and_said(tmp_path):
    doc = _ingest(tmp_path, REAL + PADDED)
    total = doc["total"]
    assert total["rows_filtered"] == {"placeholder_reply": 10}
    assert total["rows_out"] == len(REAL)
    listed = pl.read_parquet(tmp_path / "run" / "ingest" / "placeholders.parquet")
    assert sorted(listed["line"].to_list()) == list(range(len(REAL) + 1, len(REAL) + 11))
    assert set(listed["reply"].to_list()) == {"ok."}
    assert listed.columns == ["id", "file", "line", "source", "reply"]
    warning = next(w for w in doc["warnings"] if "placeholder_reply" in w)
    assert "10 conversations filtered placeholder_reply" in warning and "'ok.' x10" in warning
    assert "regenerate --mode missing" in warning and 'placeholder_replies = "keep"' in warning
    kept = pl.read_parquet(tmp_path / "run" / "ingest" / "conversations" / "*.parquet")
    assert not any(m["content"].strip().lower() == "ok." for msgs in kept["messages"]
                   for m in msgs if m["role"] == "assistant")


def test_keep_keeps_them_and_still_says_so(tmp_path):
    doc = _ingest(tmp_path, REAL + PADDED, placeholder_replies="keep")
    assert doc["total"]["rows_out"] == len(REAL) + len(PADDED)
    assert any("10 conversations have a reply given to many prompts ('ok.' x10): kept" in w
               for w in doc["warnings"])


def test_a_source_of_placeholders_only_is_an_error_naming_them(tmp_path):
    with pytest.raises(StageError, match="placeholder"):
        _ingest(tmp_path, PADDED)


def test_the_threshold_is_a_share_and_at_least_three():
    rows = pl.DataFrame({"_unit": [0] * 7, "_line": list(range(7)), "source": ["s"] * 7,
                         "id": ["a", "b", "c", "d", "e", "f", "e"],
                         "messages": [[{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": reply}]
                                      for reply in ["Sure!", "sure!", "SURE!", "No.", "No.",
                                                    "x" * 41, "No."]]})
    rows = rows.with_columns(_replies=pl.from_arrow(row_short_replies(
        rows["messages"].to_arrow())))  # what a work item keeps of each row
    replies = short_replies(rows.lazy()).collect()
    assert sorted(replies["reply"].to_list()) == ["no.", "no.", "no.", "sure!", "sure!", "sure!"]
    # "no." three times, but twice in one conversation repeated (id e): two conversations
    assert placeholder_texts(replies, 7, 3, 0.01).rows() == [("sure!", 3)]
    assert placeholder_texts(replies, 400, 3, 0.01).rows() == []  # 3 of 400 is under 1%
