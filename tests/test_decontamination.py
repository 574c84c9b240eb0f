"""Benchmark decontamination in ingest: conversations that hold an MT-Bench, GSM8K or HumanEval
item (the real files in ../shared/fixtures/evalsets) are filtered with the benchmark and item
named; re-cased, re-spaced and embedded copies are caught, distinct rows kept, every row counted."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.io.benchmarks import read_benchmark
from dflash_etl.mix.contamination import NGRAM, ContaminationIndex
from dflash_etl.mix.words import words as contamination_words
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
    assert index.match_conversations(column) == {k: e for k, e in enumerate(expected) if e}
    restored = pickle.loads(pickle.dumps(index))  # what a worker receives
    assert restored._prefix_hashes is None and restored.match_many(planted) == expected
    with pytest.raises(ValueError, match="at least MIN_WORDS"):
        ContaminationIndex.build(items, ngram=5)


def _column(rows: list[list[dict]]) -> pa.Array:
    from dflash_etl.core import schema as S

    return pa.array([[{f.name: m.get(f.name) for f in S.MESSAGE} for m in r] for r in rows],
                    pa.list_(S.MESSAGE))


@pytest.fixture(scope="module")
def index(evalsets) -> ContaminationIndex:
    return ContaminationIndex.build(
        it for name in ("gsm8k_test.jsonl", "humaneval.jsonl", "mt_bench_question.jsonl")
        for it in read_benchmark(evalsets / name))


def test_every_gsm8k_and_humaneval_solution_planted_as_a_reply_is_caught(evalsets, index):
    """Each of the 1319 GSM8K solutions as written in the file (calculator notes and all) and
    each of the 164 HumanEval canonical solutions (bare, and in a code fence) as the reply to an
    unrelated question: every one is caught, as its own benchmark."""
    raw = {n: [json.loads(line) for line in (evalsets / f"{n}.jsonl").read_text().splitlines()]
           for n in ("gsm8k_test", "humaneval")}
    replies = [("gsm8k_test", r["answer"]) for r in raw["gsm8k_test"]]
    replies += [("humaneval", r["canonical_solution"]) for r in raw["humaneval"]]
    replies += [("humaneval", f"Here you go:\n```python\n{r['canonical_solution']}```")
                for r in raw["humaneval"]]
    rows = [[{"role": "user", "content": "Could you show me how you would do it?"},
             {"role": "assistant", "content": reply}] for _, reply in replies]
    found = index.match_conversations(_column(rows))
    missed = [replies[k][1][:80] for k in range(len(rows)) if k not in found]
    assert not missed, f"{len(missed)} of {len(rows)} kept, e.g. {missed[:3]}"
    assert [found[k][0] for k in range(len(rows))] == [bench for bench, _ in replies]
    assert index.match_many([[t["content"] for t in r] for r in rows]) == [
        found[k] for k in range(len(rows))]
    unrelated = [[{"role": "user", "content": "How do I add two numbers?"},
                  {"role": "assistant", "content": "Use `x + y`, or `return x + y`."}],
                 [{"role": "assistant", "content": "return True"}]]
    assert index.match_conversations(_column(unrelated)) == {}


def test_every_rendered_text_is_looked_at(evalsets, index, tmp_path):
    """A GSM8K solution in reasoning_content or an inline <think> block, a GSM8K question in
    tool-call arguments, in a tool's result or in the tool definitions: each filtered by
    ingest; the same conversation without it kept."""
    gsm = json.loads((evalsets / "gsm8k_test.jsonl").read_text().splitlines()[9])
    question, answer = gsm["question"], gsm["answer"]
    call = {"id": "c1", "type": "function",
            "function": {"name": "solve", "arguments": json.dumps({"problem": question})}}
    user = {"role": "user", "content": "Help me with this one, please."}
    rows = {
        "reasoning": [user, {"role": "assistant", "reasoning_content": answer,
                             "content": "The answer is below."}],
        "think": [user, {"role": "assistant", "content": f"<think>{answer}</think>Done."}],
        "tool_call": [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                      {"role": "assistant", "content": "Solved."}],
        "tool_result": [user, {"role": "assistant", "content": "",
                               "tool_calls": [{**call, "function": {"name": "solve",
                                                                    "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": question},
                        {"role": "assistant", "content": "Solved."}],
        "clean": [user, {"role": "assistant", "content": "Sure, what is the problem?"}],
    }
    lines = [{"id": k, "messages": m} for k, m in rows.items()]
    lines.append({"id": "tools", "messages": rows["clean"], "tools": [
        {"type": "function", "function": {"name": "solve", "description": question,
                                          "parameters": {"type": "object"}}}]})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "pipeline.toml").write_text(
        f'[[sources]]\nname = "a"\npath = "rows.jsonl"\n\n[ingest]\n'
        f'decontaminate = ["{evalsets / "gsm8k_test.jsonl"}"]\n')
    doc = ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run", progress=False,
                     workers=1)
    found = pl.read_parquet(tmp_path / "run" / "ingest" / "contamination.parquet")
    names = [line["id"] for line in lines]
    assert sorted(names[n - 1] for n in found["line"]) == sorted(set(names) - {"clean"})
    assert set(found["item"].to_list()) == {"10"}
    assert doc["total"]["rows_out"] == 1
    assert doc["decontamination"] == {"gsm8k_test": {
        "file": str(evalsets / "gsm8k_test.jsonl"), "items": 1319, "indexed": 1319,
        "rows_removed": 5}}
    report = (tmp_path / "run" / "docs" / "index.html").read_text()
    section = report[report.index('data-key="ingest-benchmarks"'):]
    assert "<td>gsm8k_test</td>" in section and '<td class="num">1319</td>' in section


INVISIBLE = "\u200b\u200c\u200d\u2060\u00ad\ufeff\u180e"
LOOKALIKE = {"a": "\u0430", "e": "\u0435", "o": "\u043e", "p": "\u0440", "c": "\u0441",
             "x": "\u0445", "y": "\u0443", "i": "\u0456", "A": "\u0391", "B": "\u0392",
             "E": "\u0395", "H": "\u041d", "K": "\u039a", "M": "\u041c", "O": "\u039f",
             "T": "\u0422", "s": "\u0455", "j": "\u0458", "h": "\u04bb"}


def _disguise(text: str, rng, rate: float) -> str:
    """Invisible characters inside words, look-alike letters, fullwidth letters and digits."""
    out = []
    for ch in text:
        roll = rng.random()
        if roll < rate and ch in LOOKALIKE:
            ch = LOOKALIKE[ch]
        elif roll < 2 * rate and "!" <= ch <= "~":
            ch = chr(ord(ch) + 0xFEE0)  # the fullwidth form
        out.append(ch)
        if rng.random() < rate:
            out.append(rng.choice(INVISIBLE))
    return "".join(out)


def test_invisible_and_look_alike_edits_do_not_hide_an_item(evalsets, index):
    """A property: any item, with any share of its characters disguised (zero-width and other
    format characters inside words, Cyrillic and Greek look-alikes, fullwidth forms), planted as
    a prompt or a reply, is caught as that item; the batch path finds what the word search
    finds."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    items = [it for name in ("gsm8k_test.jsonl", "humaneval.jsonl", "mt_bench_question.jsonl")
             for it in read_benchmark(evalsets / name)]
    items = [it for it in items if len(contamination_words(it.texts[0])) >= NGRAM]

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    @hypothesis.given(st.integers(0, len(items) - 1), st.floats(0.02, 0.5),
                      st.integers(0, 2**32), st.booleans())
    def check(k, rate, seed, as_reply):
        item = items[k]
        text = _disguise(item.texts[0], random.Random(seed), rate)
        assert text != item.texts[0] or rate < 0.05
        turns = ["Please help.", text] if as_reply else [text, "Sure."]
        rows = [[{"role": r, "content": t} for r, t in zip(("user", "assistant"), turns,
                                                             strict=True)]]
        hit = index.match_conversations(_column(rows)).get(0)
        assert hit is not None, text
        assert index.match(turns) == hit
        assert contamination_words(text) == contamination_words(item.texts[0])

    check()



def test_a_benchmark_file_with_nothing_to_look_for_is_an_error_naming_its_counts(tmp_path):
    """An empty file, or one whose items are all under MIN_WHOLE words, would turn
    decontamination off without a word: an error naming the file and its counts. A Chinese
    benchmark has words (one per Han character) and is looked for; two files of one name are
    refused; a file past MAX_ITEMS rows is an error, not cut short."""
    from dflash_etl.io import benchmarks

    (tmp_path / "rows.jsonl").write_text(
        json.dumps(_chat("小明有五个苹果，他吃了两个，又买了三个。请问他现在有几个苹果？")) + "\n"
        + json.dumps(_chat("hello there, how are you today my friend?")) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"prompt": "Say hi"}) + "\n")
    problem = "小明有五个苹果，他吃了两个，又买了三个。请问他现在有几个苹果？"
    (tmp_path / "zh.jsonl").write_text(json.dumps({"prompt": problem}) + "\n")

    def run(files: list[str]) -> dict:
        listed = ", ".join(f'"{f}"' for f in files)
        (tmp_path / "pipeline.toml").write_text(
            f'[[sources]]\nname = "a"\npath = "rows.jsonl"\n[ingest]\ndecontaminate = [{listed}]\n')
        return ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run",
                          progress=False, workers=1, force=True)

    with pytest.raises(StageError, match=r"nothing to look for in .*empty\.jsonl \(0 items, 0 "
                                         r"of 3 words or more\); .*tiny\.jsonl \(1 items, 0 of"):
        run(["zh.jsonl", "empty.jsonl", "tiny.jsonl"])
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "zh.jsonl").write_text((tmp_path / "zh.jsonl").read_text())
    with pytest.raises(StageError, match="two benchmark files are named 'zh'"):
        run(["zh.jsonl", "sub/zh.jsonl"])
    doc = run(["zh.jsonl"])
    assert doc["total"]["rows_filtered"] == {"benchmark_contamination": 1}
    assert doc["decontamination"]["zh"]["indexed"] == 1
    (tmp_path / "many.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n" * 2 + "{}\n" * 3)
    original = benchmarks.MAX_ITEMS
    benchmarks.MAX_ITEMS = 2
    try:
        with pytest.raises(StageError, match=r"many\.jsonl holds 4 rows, past the 2"):
            read_benchmark(tmp_path / "many.jsonl")
    finally:
        benchmarks.MAX_ITEMS = original
