"""`dflash-etl show`: one conversation of the embedded default's run through every stage — a kept
row (its supervised tokens marked exactly as its loss mask), a held-out one, a row ingest
quarantined, an unknown id."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from dflash_etl.core.errors import StageError

pytestmark = pytest.mark.slow  # the session's default run


def _dataset(run: Path) -> list[dict]:
    import datasets

    return list(datasets.load_from_disk(str(run / "tokenize" / "dataset")).with_format(None))


def test_a_kept_row_is_followed_to_its_states_and_its_split(default_run_dir, capsys):
    from dflash_etl.cli.main import main
    from dflash_etl.lineage import marked, trace
    from dflash_etl.models.tokenizer import load_tokenizer

    run = default_run_dir
    rows = _dataset(run)
    row = rows[3]
    doc = trace(run, row["id"][:10])  # a prefix is enough
    assert doc["id"] == row["id"] and doc["ingest"]["status"] == "kept"
    assert doc["ingest"]["source_line"].lstrip("\ufeff").startswith("{")
    assert doc["regenerate"]["status"] == "kept" and doc["regenerate"]["turns"]
    (tokenized,) = [r for r in doc["tokenize"]["rows"] if r["row"] == 3]
    assert tokenized["input_ids"] == row["input_ids"] and tokenized["loss_mask"] == row["loss_mask"]
    assert doc["extract"]["status"] == "extracted"
    assert any(e["row"] == 3 for e in doc["extract"]["rows"])
    assert doc["train"]["status"] in ("trained on",
                                      "held out: one of the prompts tau is measured on")
    tok = load_tokenizer(str(Path(__file__).resolve().parents[1] / "data" / "tokenizer"))
    text = marked(tok, row["input_ids"], row["loss_mask"], color=False)
    inside = "".join(part.split("]]")[0] for part in text.split("[[")[1:])
    supervised = "".join(tok.decode([t]) for t, m in zip(row["input_ids"], row["loss_mask"],
                                                         strict=True) if m)
    assert inside == supervised  # the brackets hold the supervised tokens, and only those
    assert main(["show", "--run", str(run), row["id"]]) == 0
    out = capsys.readouterr().out
    assert "[[" in out and "train: " in out and "shard-" in out  # piped: brackets, no colour


def test_a_held_out_row_a_quarantined_line_and_an_unknown_id(default_run_dir, capsys):
    from dflash_etl.cli.main import main
    from dflash_etl.lineage import trace
    from dflash_etl.models.training.evaluation import held_out_ids

    run = default_run_dir
    settings = json.loads((run / "manifest.json").read_text())["stages"]["train"]["settings"]
    ids = [r["id"] for r in _dataset(run)]
    held = sorted(held_out_ids(ids, settings["eval_prompts"], settings["seed"]))[0]
    assert trace(run, held)["train"]["status"].startswith("held out")

    quarantined = pl.read_parquet(run / "ingest" / "quarantine.parquet").row(0, named=True)
    doc = trace(run, f"{Path(quarantined['file']).name}:{quarantined['line']}")
    assert doc["ingest"] == {"status": "quarantined", "reason": quarantined["reason"],
                             "message": quarantined["message"]}

    assert main(["show", "--run", str(run), "ffffffffffffdoesnotexist"]) == 1
    assert "no conversation of this run has that id" in capsys.readouterr().out
    with pytest.raises(StageError, match="has no ingest output"):
        trace(run / "nothing", "abc")


def test_show_says_when_the_source_file_changed_since_ingest(ingest_rows, tmp_path):
    """`show` printed the source file's current line even after the file changed (another row
    by then): it checks the file against the size and hash ingest recorded (reliability issue,
    item 8)."""
    from dflash_etl.lineage import trace

    rows = [{"messages": [{"role": "user", "content": f"question {k}"},
                          {"role": "assistant", "content": f"answer {k}"}]} for k in range(3)]
    run = ingest_rows(rows, "mini")
    doc = trace(run, "rows.jsonl:2")
    assert "question 1" in doc["ingest"]["source_line"] and not doc["ingest"]["source_changed"]
    source = tmp_path / "rows.jsonl"
    source.write_text('{"messages": []}\n' + source.read_text())  # every row one line down
    doc = trace(run, "rows.jsonl:2")
    assert doc["ingest"]["source_line"] is None
    assert "bytes when ingest read it" in doc["ingest"]["source_changed"]
