"""Benchmark decontamination in ingest: conversations that hold an MT-Bench, GSM8K or HumanEval
item (the real files in ../shared/fixtures/evalsets) are filtered with the benchmark and item
named; re-cased, re-spaced and embedded copies are caught, distinct rows kept, every row counted."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.io.benchmarks import read_benchmark
from dflash_etl.mix.contamination import ContaminationIndex
from dflash_etl.mix.contamination import words as contamination_words
from dflash_etl.stages import ingest, load_config

REPO = Path(__file__).resolve().parents[1]
EVALSETS = REPO.parent / "shared" / "fixtures" / "evalsets"


@pytest.fixture(scope="module")
def evalsets() -> Path:
    if not (EVALSETS / "gsm8k_test.jsonl").is_file():
        pytest.skip(f"{EVALSETS} is absent (the benchmark prompt sets, ../shared/fixtures)")
    return EVALSETS


def _chat(user: str, reply: str = "Here is a careful answer to your question.") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant",
                                                            "content": reply}]}


def test_each_layout_is_read_as_its_items(evalsets):
    gsm8k = read_benchmark(evalsets / "gsm8k_test.jsonl")
    mt_bench = read_benchmark(evalsets / "mt_bench_question.jsonl")
    humaneval = read_benchmark(evalsets / "humaneval.jsonl")
    assert (len(gsm8k), len(mt_bench), len(humaneval)) == (1319, 80, 164)
    assert mt_bench[0].item == "81" and len(mt_bench[0].texts) == 2  # both turns
    assert humaneval[0].item == "HumanEval/0" and "def has_close_elements" in humaneval[0].texts[0]
    assert "<<" not in gsm8k[0].texts[1]  # the calculator notes are dropped from the answer


def test_planted_items_are_filtered_with_the_item_named_and_the_rest_kept(evalsets, tmp_path):
    gsm8k = read_benchmark(evalsets / "gsm8k_test.jsonl")
    mt_bench = read_benchmark(evalsets / "mt_bench_question.jsonl")
    humaneval = read_benchmark(evalsets / "humaneval.jsonl")
    question, solution = gsm8k[5].texts
    turn = mt_bench[3].texts[0]
    planted = {
        "exact": _chat(question),
        "recased": _chat("   ".join(turn.upper().split())),
        "embedded": _chat("Please help me with my homework. " + humaneval[7].texts[0]
                          + "\nThanks a lot, it is due tomorrow."),
        "solution_as_reply": _chat("How would you solve this?", solution),
    }
    clean = {
        "distinct": _chat("What is the capital of France, and why is it famous for its art?"),
        "shares_a_few_words": _chat("Janet likes ducks and eggs; how many does she eat?"),
        "code": _chat("Write a function that reverses a string in Python, with a docstring."),
    }
    rows = [{"id": k, **v} for k, v in {**planted, **clean}.items()]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = ", ".join(f'"{evalsets / n}"' for n in ("gsm8k_test.jsonl", "mt_bench_question.jsonl",
                                                   "humaneval.jsonl"))
    (tmp_path / "pipeline.toml").write_text(
        f'[[sources]]\nname = "mix"\npath = "rows.jsonl"\n\n[ingest]\ndecontaminate = [{files}]\n')
    doc = ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run", progress=False,
                     workers=1)
    total = doc["total"]
    assert total["rows_in"] == len(rows)
    assert total["rows_filtered"] == {"benchmark_contamination": len(planted)}
    assert total["rows_out"] == len(clean)
    found = pl.read_parquet(tmp_path / "run" / "ingest" / "contamination.parquet")
    by_line = {r["line"]: (r["benchmark"], r["item"]) for r in found.to_dicts()}
    lines = {k: n for n, k in enumerate({**planted, **clean}, 1)}
    assert by_line == {lines["exact"]: ("gsm8k_test", "6"),
                       lines["recased"]: ("mt_bench_question", mt_bench[3].item),
                       lines["embedded"]: ("humaneval", "HumanEval/7"),
                       lines["solution_as_reply"]: ("gsm8k_test", "6")}
    kept = pl.read_parquet(tmp_path / "run" / "ingest" / "conversations" / "*.parquet")
    assert sorted(kept["line"].to_list()) == sorted(lines[k] for k in clean)
    assert doc["sources"]["mix"]["contamination"] == {"gsm8k_test": 2,
                                                      "mt_bench_question": 1, "humaneval": 1}
    report = (tmp_path / "run" / "docs" / "index.html").read_text()
    section = report[report.index('data-key="ingest-contamination"'):]
    assert "<td>gsm8k_test</td><td>mix</td><td class=\"num\">2</td>" in section
    assert "HumanEval/7" in section


def test_a_short_item_needs_all_its_words_and_a_missing_file_is_named(tmp_path):
    from dflash_etl.io.benchmarks import BenchmarkItem

    index = ContaminationIndex.build([BenchmarkItem("b", "1", ("Say hi",)),
                                      BenchmarkItem("b", "2", ("Rewrite your previous response. "
                                                               "Start every sentence with A.",))])
    assert index.match(["say hi to everyone"]) is None  # under MIN_WORDS: never matched
    assert index.match(["Now: rewrite your previous response; start every sentence with a!"])[1] \
        == "2"
    assert index.match(["Rewrite your previous response please."]) is None
    (tmp_path / "rows.jsonl").write_text(json.dumps(_chat("hello there")) + "\n")
    (tmp_path / "pipeline.toml").write_text(
        '[[sources]]\nname = "a"\npath = "rows.jsonl"\n[ingest]\ndecontaminate = ["nope.jsonl"]\n')
    with pytest.raises(StageError, match=r"decontaminate: no benchmark file at .*nope\.jsonl"):
        ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run", progress=False,
                   workers=1)


def test_the_batch_prefilter_finds_exactly_what_the_word_search_finds(evalsets):
    """match_many (hashed 8-word prefixes, then the word search on candidates) equals match on
    planted copies (whole, re-cased, split over two messages, cut short of a run) and on the
    real rows of the fixtures, in one batch."""
    items = [it for name in ("mt_bench_question.jsonl", "gsm8k_test.jsonl", "humaneval.jsonl")
             for it in read_benchmark(evalsets / name)]
    index = ContaminationIndex.build(items)
    gsm = next(it for it in items if it.benchmark == "gsm8k_test").texts[0]
    words = contamination_words(gsm)  # as the rule counts them ("Janet's": two)
    planted = [[gsm], [gsm.upper().replace(" ", "  ")], ["Intro. " + gsm + " Thanks!"],
               [" ".join(words[:7]), " ".join(words[7:])],  # a run split over two messages
               [" ".join(words[:12])], ["Say hi"], [""], []]
    real = REPO.parent / "shared" / "fixtures" / "data" / "alpaca.jsonl"
    for line in real.read_text().splitlines()[:400]:
        row = json.loads(line)
        planted.append([str(v) for v in row.values() if isinstance(v, str)])
    expected = [index.match(texts) for texts in planted]
    assert index.match_many(planted) == expected
    assert expected[0] is not None and expected[1] is not None and expected[2] is not None
    assert expected[4] is None  # 12 words: short of a 13-word run
    assert sum(e is not None for e in expected) >= 3
    column = pa.array([[{"role": "user", "content": t} for t in texts] for texts in planted],
                      pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    assert index.match_messages(column) == {k: e for k, e in enumerate(expected) if e}
    restored = pickle.loads(pickle.dumps(index))  # what a worker receives
    assert restored._prefix_hashes is None and restored.match_many(planted) == expected
    with pytest.raises(ValueError, match="at least MIN_WORDS"):
        ContaminationIndex.build(items, ngram=5)
