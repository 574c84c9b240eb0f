"""Near-duplicate removal in ingest ([ingest] near_dedup): a planted set of near-copies is found
with precision >= 0.99 and recall >= 0.95 against brute-force Jaccard at the default threshold;
a shared system prompt alone does not make two conversations duplicates; every row accounted."""

from __future__ import annotations

import html
import itertools
import json
import random

import polars as pl
import pytest

from dflash_etl.mix.near_dedup import shingles, text_of
from dflash_etl.stages import ingest, load_config

TOPICS = ["rivers", "volcanoes", "bread", "chess", "tides", "glaciers", "bees", "comets",
          "bridges", "forests", "deserts", "whales", "orchids", "typhoons", "castles", "robots",
          "spices", "lighthouses", "caves", "violins"]
SYSTEM = ("You are a meticulous assistant. Always answer in full sentences, cite your "
          "reasoning, avoid speculation, keep a friendly tone, and prefer concrete examples "
          "over abstractions whenever the question allows it. ") * 3


def _prompt(rng: random.Random, topic: str) -> str:
    words = [rng.choice(["explain", "describe", "compare", "list", "summarize", "discuss"])]
    words += [f"{topic}", "in", "detail"]
    words += [rng.choice(["history", "science", "economics", "culture", "future", "risks",
                          "benefits", "myths", "records", "tools", "people", "places"])
              for _ in range(70)]
    return " ".join(words) + "."


def _planted(seed: int = 0) -> list[dict]:
    """Per topic a distinct prompt and three near-copies of it (case, spacing and punctuation
    changed; a sentence added; a sentence's worth cut), then a templated family that differs in
    one number; every row under the same long system prompt."""
    rng = random.Random(seed)
    rows = []
    for topic in TOPICS:
        base = _prompt(rng, topic)
        rows.append({"system": SYSTEM, "user": base})
        rows += [{"system": SYSTEM, "user": text} for text in (
            "  ".join(base.upper().split()).replace(".", " !"),
            base + " Please also add one short example sentence for clarity.",
            " ".join(base.split()[:-6]) + ".")]
    for n in range(5):
        rows.append({"system": SYSTEM, "user": "Order number " + str(1000 + n) + " was shipped "
                     "to the warehouse in the north district with twelve boxes of spare parts "
                     "and a signed delivery note for the customer service team to review."})
    return rows


def _conv(row: dict) -> dict:
    return {"messages": [{"role": "system", "content": row["system"]},
                         {"role": "user", "content": row["user"]},
                         # a reply of its own: one text for every prompt is a placeholder
                         {"role": "assistant", "content": f"A careful answer: {row['user']}"}]}


def _jaccard(a: str, b: str, n: int = 3) -> float:
    x, y = set(shingles(a, n)), set(shingles(b, n))
    return len(x & y) / len(x | y)


def test_planted_near_copies_are_found_like_brute_force_jaccard(tmp_path):
    rows = _planted()
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(_conv(r)) + "\n" for r in rows))
    (tmp_path / "pipeline.toml").write_text(
        '[[sources]]\nname = "mix"\npath = "rows.jsonl"\n\n[ingest]\nnear_dedup = true\n')
    doc = ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run",
                     progress=False, workers=1)
    total = doc["total"]
    removed = pl.read_parquet(tmp_path / "run" / "ingest" / "near_duplicates.parquet")
    assert total["rows_in"] == len(rows)
    assert total["rows_out"] + total["rows_filtered"].get("near_duplicate", 0) == len(rows)
    # brute force: a row is a near-duplicate when an earlier row is at Jaccard >= 0.8
    texts = [text_of(_conv(r)["messages"], "prompt") for r in rows]
    truth = {k for k in range(len(rows))
             if any(_jaccard(texts[j], texts[k]) >= 0.8 for j in range(k))}
    found = {line - 1 for line in removed["line"].to_list()}
    assert len(truth) >= 3 * len(TOPICS)  # the planted copies are near-duplicates indeed
    precision = len(found & truth) / len(found)
    recall = len(found & truth) / len(truth)
    assert precision >= 0.99 and recall >= 0.95, (precision, recall, truth - found)
    kept = pl.read_parquet(tmp_path / "run" / "ingest" / "conversations" / "*.parquet")
    assert set(removed["kept_id"].to_list()) <= set(kept["id"].to_list())
    # distinct prompts that share the long system prompt are all kept
    bases = [k for k in range(0, 4 * len(TOPICS), 4)]
    assert all(b + 1 in set(kept["line"].to_list()) for b in bases)
    assert all(_jaccard(texts[a], texts[b]) < 0.8 for a, b in itertools.combinations(bases, 2))
    # the report shows the clusters, the removals per source and the least alike pair, with
    # the removed row's source line and the kept row's text
    report = (tmp_path / "run" / "docs" / "index.html").read_text()
    section = report[report.index('data-key="ingest-near-duplicates"'):]
    clusters = removed["kept_id"].n_unique()
    assert f"{removed.height} rows removed in {clusters} clusters" in section
    least = removed.sort("similarity").row(0, named=True)
    assert f"{least['similarity']:.3f}" in section
    kept_text = _conv(rows[kept.filter(pl.col("id") == least["kept_id"])["line"][0] - 1])
    assert html.escape(kept_text["messages"][1]["content"][:60]) in section
    assert html.escape(json.dumps(_conv(rows[least["line"] - 1]))[:60]) in section


def test_scope_conversation_sees_the_shared_system_prompt(tmp_path):
    """With every message compared, two short distinct questions under one long system prompt
    are near-duplicates: why the default scope is the user turns."""
    system = " ".join(f"rule{k} applies" for k in range(80))  # long, and no two alike
    rows = [{"system": system, "user": "What is a river?"},
            {"system": system, "user": "Why do bees dance?"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(_conv(r)) + "\n" for r in rows))
    for scope, expected in (("prompt", 2), ("conversation", 1)):
        (tmp_path / "pipeline.toml").write_text(
            '[[sources]]\nname = "a"\npath = "rows.jsonl"\n\n[ingest]\nnear_dedup = true\n'
            f'near_dedup_scope = "{scope}"\n')
        doc = ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / f"run-{scope}",
                         progress=False, workers=1)
        assert doc["total"]["rows_out"] == expected, scope


def test_vectorised_shingles_are_the_word_shingles_and_ties_keep_the_earliest():
    """gram_hashes gives one hash per shingle of shingles() (same count of distinct ones, short
    texts one whole gram, none for a text without words); near_duplicates keeps the first of
    identical signatures and names the earliest kept row at a tie."""
    import numpy as np

    from dflash_etl.mix.near_dedup import band_keys, candidates, near_duplicates, signatures
    from dflash_etl.mix.ngrams import gram_hashes, word_hashes

    rng = random.Random(3)
    texts = [_prompt(rng, t) for t in TOPICS[:5]] + ["Two words", "!!!", "", "a b c"]
    hashes, counts = word_hashes(texts)
    grams, per_text = gram_hashes(hashes, counts, 3, whole_short=True)
    start = 0
    for text, n in zip(texts, per_text.tolist(), strict=True):
        mine = grams[start:start + n]
        start += n
        assert len(set(mine.tolist())) == len(shingles(text, 3)), text
    assert per_text[-4:].tolist() == [1, 0, 0, 1]
    assert gram_hashes(*word_hashes(["a b c"]), 3)[0][0] != \
        gram_hashes(*word_hashes(["c b a"]), 3)[0][0]
    base = texts[0]
    rows = [texts[1], base, base.upper(), base + " extra words here", texts[2], "!!!"]
    digests, has = signatures(rows, 3)
    assert has.tolist() == [True] * 5 + [False]
    keys = band_keys(digests)
    chosen = candidates(keys, has)
    assert chosen.tolist() == [1, 2, 3]
    pairs = near_duplicates(keys[chosen], digests[chosen], 0.8)
    assert [(r, k) for r, k, _ in pairs] == [(1, 0), (2, 0)]  # both of row 1 (base), kept
    assert pairs[0][2] == 1.0 and 0.8 <= pairs[1][2] < 1.0
    twins = np.stack([digests[1]] * 3)
    assert [(r, k) for r, k, _ in near_duplicates(band_keys(twins), twins, 0.8)] == \
        [(1, 0), (2, 0)]


def test_word_hashes_run_in_a_worker_forked_from_a_busy_polars_parent():
    """The local executor forks its workers from a driver that has used polars; polars' thread
    pool does not survive a fork (a worker hashing words with polars hung for good), so the
    workers' hashing must not need it."""
    import subprocess
    import sys

    script = """
import os, sys
import polars as pl
import pytest
from dflash_etl.mix.ngrams import word_hashes
frame = pl.DataFrame({"k": list(range(200_000)), "v": [str(i) for i in range(200_000)]})
for _ in range(5):
    frame.group_by(pl.col("k") % 97).agg(pl.col("v").str.len_chars().sum())
pid = os.fork()
if pid == 0:
    hashes, counts = word_hashes(["Hello there, World!"] * 5000)
    os._exit(0 if counts.sum() == 15000 else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_the_batch_words_are_the_rule_s_words_and_arrow_rows_sign_as_text_of():
    """split_words (a byte table over the Arrow buffer) gives exactly words.py's words of
    each text, whatever the text holds: Unicode letters, the two characters whose lower case is
    ASCII (U+0130, the Kelvin sign), Han characters, invisible ones, digits, words that touch
    a text's ends, null and empty texts; word_hashes hashes each word by its bytes;
    message_signatures of a `messages` column equals signatures of text_of, both scopes."""
    import numpy as np
    import pyarrow as pa

    from dflash_etl.core import schema as S
    from dflash_etl.mix.near_dedup import message_signatures, signatures
    from dflash_etl.mix.ngrams import split_words, word_hashes
    from dflash_etl.mix.words import words

    rng = random.Random(5)
    alphabet = ("abcXYZ0189 ,.\n\t-_'\u0130\u212a\u00e9\u2019\u00df\u00c5\u03a3\u4e2d"
                "\u200b\u00ad\uff21\u0430\u0301\u3042\ufb01")
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
             for _ in range(3000)]
    texts += ["", "!!!", "a", "end\u0130", "\u212a", "Caf\u00e9 au LAIT", "x" * 300]
    found = split_words(texts)
    dictionary = found.dictionary.to_pylist()
    assert [dictionary[i] for i in found.ids] == [w for t in texts for w in words(t)]
    assert found.counts.tolist() == [len(words(t)) for t in texts]
    assert split_words(pa.array([None, "A b"])).counts.tolist() == [0, 2]
    hashes, counts = word_hashes(["one two one", "two"])
    assert counts.tolist() == [3, 1] and hashes[0] == hashes[2] and hashes[1] == hashes[3]
    rows = [_conv(row)["messages"] for row in _planted()[:30]]
    rows += [[{"role": "user", "content": None}], [],
             [{"role": "system", "content": "Only a system"}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}]]
    full = [[{f.name: m.get(f.name) for f in S.MESSAGE} for m in r] for r in rows]
    column = pa.array(full, pa.list_(S.MESSAGE))
    for scope in ("prompt", "conversation"):
        got = message_signatures(column, scope, 3)
        want = signatures([text_of(r, scope) for r in rows], 3)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), scope


def _greedy_reference(keys, digests, threshold):
    """The greedy pass as the spec words it, row by row over every kept row in its buckets."""
    import numpy as np

    buckets: list[dict[int, list[int]]] = [{} for _ in range(keys.shape[1])]
    found = []
    for row, row_keys in enumerate(keys.tolist()):
        others = sorted({k for b, key in enumerate(row_keys) for k in buckets[b].get(key, ())})
        best = None
        if others:
            similarity = (digests[others] == digests[row]).mean(axis=1)
            at = int(np.argmax(similarity))  # the first of the highest
            if similarity[at] >= threshold:
                best = (others[at], float(similarity[at]))
        if best is None:
            for b, key in enumerate(row_keys):
                buckets[b].setdefault(key, []).append(row)
        else:
            found.append((row, best[0], best[1]))
    return found


def test_the_greedy_pass_equals_the_row_by_row_reference_on_families_and_twins():
    """near_duplicates (first twins, shared buckets only) gives the reference's verdicts, kept
    rows and similarities: families of near-copies at several distances, exact twins of kept
    and of filtered rows interleaved with later kept rows, rows alone."""
    import numpy as np

    from dflash_etl.mix.near_dedup import NUM_PERM, band_keys, near_duplicates

    rng = np.random.default_rng(11)
    for trial in range(4):
        bases = rng.integers(0, 2**32, size=(40, NUM_PERM), dtype=np.uint32)
        rows = []
        for _ in range(1500):
            if rows and rng.random() < 0.3:  # a twin of an earlier row
                rows.append(rows[int(rng.integers(len(rows)))].copy())
                continue
            row = bases[int(rng.integers(len(bases)))].copy()
            changed = rng.choice(NUM_PERM, size=int(rng.integers(0, 60)), replace=False)
            row[changed] = rng.integers(0, 2**32, size=len(changed), dtype=np.uint32)
            rows.append(row)
        digests = np.stack(rows)
        keys = band_keys(digests)
        for threshold in (0.5, 0.8, 1.0):
            want = _greedy_reference(keys, digests, threshold)
            assert near_duplicates(keys, digests, threshold) == want, (trial, threshold)
    assert near_duplicates(keys[:0], digests[:0], 0.8) == []


def test_near_dedup_with_dedup_off_is_refused_before_any_work(tmp_path):
    """[run] dedup = false with near-dedup on kept 50 exact copies of a conversation and removed
    its one near copy (reliability issue, item 6): the combination is refused, naming why."""
    from dflash_etl.core.errors import StageError

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(_conv(r)) + "\n"
                                                 for r in _planted()))
    (tmp_path / "pipeline.toml").write_text(
        '[run]\ndedup = false\n[[sources]]\nname = "mix"\npath = "rows.jsonl"\n\n'
        '[ingest]\nnear_dedup = true\n')
    with pytest.raises(StageError, match="would keep every exact copy"):
        ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run", progress=False,
                   workers=1)
    assert not (tmp_path / "run" / "ingest").exists()
