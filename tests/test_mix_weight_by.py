"""[ingest] weight_by: the sources' weights as shares of rows (ingest samples conversations) or
of supervised tokens, the quantity the drafter trains on (tokenize, which counts them, leaves
conversations out). Two sources whose replies differ ~10x in length: by rows they take the
asked shares of rows and very different shares of supervised tokens; by supervised tokens the
reverse. Every row stays accounted for, and the shares in stats.json match the dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.mix.shares import plan_supervised_mix
from dflash_etl.stages import ingest, parse_config, tokenize

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer"
WORDS = ["river", "stone", "light", "cloud", "garden", "window", "paper", "music", "bread",
         "autumn", "market", "candle", "mountain", "letter", "harbor", "silver", "forest"]
WEIGHTS = {"short": 1.0, "long": 3.0}  # asked: 25% / 75%


def _rows(name: str, n: int, reply_words: tuple[int, int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        reply = " ".join(rng.choice(WORDS, size=int(rng.integers(*reply_words))))
        rows.append({"messages": [{"role": "user", "content": f"{name} question {k}: describe it"},
                                  {"role": "assistant", "content": reply}]})
    return rows


def _run(base: Path, weight_by: str) -> Path:
    sources = {"short": _rows("short", 200, (3, 8), 1), "long": _rows("long", 120, (40, 90), 2)}
    for name, rows in sources.items():
        (base / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config({
        "run": {"workers": 1, "seed": 3},
        "sources": [{"name": n, "path": f"{n}.jsonl", "weight": w} for n, w in WEIGHTS.items()],
        "ingest": {"weight_by": weight_by}}, base)
    ingest.run(config, base / "run", progress=False)
    tokenize.run(config, base / "run", progress=False, workers=1, model=str(TOKENIZER),
                 seq_length=512)
    return base / "run"


def _dataset(run: Path) -> list[dict]:
    import datasets

    return datasets.load_from_disk(str(run / "tokenize" / "dataset")).with_format(None).to_list()


def _shares(rows: list[dict], key: str) -> dict[str, float]:
    count = {n: sum((sum(r["loss_mask"]) if key == "supervised" else 1)
                    for r in rows if r["source"] == n) for n in WEIGHTS}
    total = sum(count.values())
    return {n: c / total for n, c in count.items()}


def _accounted(run: Path) -> None:
    for stage in ("ingest", "tokenize"):
        doc = json.loads((run / stage / "stats.json").read_text())
        for s in doc["sources"].values():
            assert s["rows_in"] == (s["rows_out"] + s["rows_quarantined"]
                                    + sum(s["rows_filtered"].values()))
    ingest_doc = json.loads((run / "ingest" / "stats.json").read_text())
    tokenize_doc = json.loads((run / "tokenize" / "stats.json").read_text())
    for name in WEIGHTS:  # every conversation ingest wrote is one tokenize reads
        assert tokenize_doc["sources"][name]["rows_in"] == ingest_doc["sources"][name]["rows_out"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return {by: _run(tmp_path_factory.mktemp(by), by) for by in ("rows", "supervised_tokens")}


def test_by_rows_the_rows_take_the_weights_and_the_supervised_tokens_do_not(runs):
    run = runs["rows"]
    rows = _dataset(run)
    by_rows, by_supervised = _shares(rows, "rows"), _shares(rows, "supervised")
    # ingest samples whole conversations (one row each here): the shares are exact to a row
    assert abs(by_rows["short"] - 0.25) <= 1 / len(rows)
    assert by_supervised["short"] < 0.06  # ~10x shorter replies: a few % of what is learned
    mix = json.loads((run / "tokenize" / "stats.json").read_text())["learning_mix"]
    assert mix["short"]["asked_row_share"] == 0.25 and "asked_supervised_share" not in mix["short"]
    _accounted(run)


def test_by_supervised_tokens_the_supervised_tokens_take_the_weights(runs):
    """The tolerance: the scarcest source is kept whole and another's kept tokens miss its
    target by at most half of one of its conversations (the mix keeps or leaves whole
    conversations: the prefix closest to the target), so each share is within half the largest
    conversation's supervised tokens / the weighted total (here about 1%)."""
    run = runs["supervised_tokens"]
    rows = _dataset(run)
    supervised = _shares(rows, "supervised")
    largest = max(sum(r["loss_mask"]) for r in rows)
    total = sum(sum(r["loss_mask"]) for r in rows)
    tolerance = largest / 2 / total
    assert tolerance < 0.02
    for name, weight in WEIGHTS.items():
        assert abs(supervised[name] - weight / sum(WEIGHTS.values())) <= tolerance, supervised
    doc = json.loads((run / "tokenize" / "stats.json").read_text())
    mix, plan = doc["learning_mix"], doc["mix"]["sources"]
    for key in ("rows_written", "tokens", "supervised_tokens"):
        assert abs(sum(m[f"{key}_share"] for m in mix.values()) - 1) < 1e-3
    for name in WEIGHTS:  # stats.json: what the dataset holds, the shares asked and reached
        mine = [r for r in rows if r["source"] == name]
        assert mix[name]["rows_written"] == len(mine) == doc["sources"][name]["rows_written"]
        assert mix[name]["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in mine)
        assert mix[name]["tokens"] == sum(len(r["input_ids"]) for r in mine)
        assert mix[name]["asked_supervised_share"] == plan[name]["asked_share"]
        assert abs(mix[name]["achieved_supervised_share"] - supervised[name]) < 1e-6
        assert plan[name]["supervised_kept"] == mix[name]["supervised_tokens"]
        assert "asked_row_share" not in mix[name]
    assert doc["mix"]["max_share_error"] <= tolerance
    # train's split counts per source the supervised tokens it trains on (held-out rows aside)
    from dflash_etl.stages import train

    trained, _, split = train._split(rows, train.TrainSettings(eval_prompts=4))
    for name in WEIGHTS:
        assert split[name].extra["supervised_tokens"] == sum(
            sum(r["loss_mask"]) for r in trained if r["source"] == name) > 0
    # ingest kept the weighted sources whole; tokenize left conversations out of the long one
    ingest_doc = json.loads((run / "ingest" / "stats.json").read_text())
    assert ingest_doc["mix"]["weight_by"] == "supervised_tokens"
    assert not ingest_doc["sources"]["long"]["rows_filtered"].get("mix_weight")
    left_out = doc["sources"]["long"]["rows_filtered"]["mix_weight"]
    assert left_out == plan["long"]["conversations_left_out"] > 0
    assert len({r["id"] for r in rows if r["source"] == "long"}) == 120 - left_out
    assert "short" not in doc["mix"]["sources"] or not doc["sources"]["short"][
        "rows_filtered"].get("mix_weight")  # the scarce source is kept whole
    _accounted(run)
    from dflash_etl.report import build_docs

    page = (build_docs(run) / "index.html").read_text()
    share = mix["long"]["achieved_supervised_share"]
    assert f"75.0% of supervised tokens ({share:.1%})" in page


def test_the_supervised_mix_is_deterministic_and_changing_weights_redoes_tokenize(runs, tmp_path):
    first = _dataset(runs["supervised_tokens"])
    again = _dataset(_run(tmp_path, "supervised_tokens"))
    assert [r["id"] for r in first] == [r["id"] for r in again]
    conversations = pl.DataFrame({"id": [f"c{k}" for k in range(40)],
                                  "source": ["a"] * 20 + ["b"] * 20,
                                  "supervised": [5] * 20 + [50] * 20})
    ids, plan = plan_supervised_mix(conversations, {"a": 1.0, "b": 1.0}, 0)
    assert plan["a"]["conversations_kept"] == 20 and plan["b"]["conversations_kept"] == 2
    assert plan["a"]["achieved_share"] == plan["b"]["achieved_share"] == 0.5 and len(ids) == 18
    same, _ = plan_supervised_mix(conversations.reverse(), {"a": 1.0, "b": 1.0}, 0)
    assert sorted(same) == sorted(ids)  # the order the rows come in does not matter
    # other weights, the same ingest output: tokenize is redone, not skipped
    config = parse_config({
        "run": {"workers": 1, "seed": 3},
        "sources": [{"name": n, "path": f"{n}.jsonl", "weight": w}
                    for n, w in {"short": 1.0, "long": 1.0}.items()],
        "ingest": {"weight_by": "supervised_tokens"}}, tmp_path)
    ingest.run(config, tmp_path / "run", progress=False)
    doc = tokenize.run(config, tmp_path / "run", progress=False, workers=1, model=str(TOKENIZER),
                       seq_length=512)
    assert not doc.get("skipped") and doc["mix"]["sources"]["long"]["asked_share"] == 0.5


def test_a_weighted_source_without_supervised_tokens_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]})
        + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "no reply yet"}) + "\n")
    config = parse_config({
        "run": {"workers": 1},
        "sources": [{"name": "a", "path": "a.jsonl", "weight": 1.0},
                    {"name": "b", "path": "b.jsonl", "weight": 1.0}],
        "ingest": {"weight_by": "supervised_tokens"}}, tmp_path)
    ingest.run(config, tmp_path / "run", progress=False)
    with pytest.raises(StageError, match=r"weighted source\(s\) \['b'\] have no supervised"):
        tokenize.run(config, tmp_path / "run", progress=False, workers=1, model=str(TOKENIZER))
