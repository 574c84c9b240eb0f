"""The rehearsal's conversations: N rows in the real layouts of ../shared/fixtures/data, each a
fixture row with its words varied so that no two rows are the same or near the same, and three
mistakes planted at known rates, which ingest must find exactly.

Layouts (shares of N): OpenAI `messages` (GSM8K-style chat) 25%, OpenAI tool calling with tools
and tool results 10%, ShareGPT 20%, ShareGPT tool calling (glaive: function_call / observation
turns) 15%, Alpaca 20%, agentic traces (LLaMA-Factory v1 content parts: reasoning, tool calls,
tool results, tools) 10%. A row's natural text (every message's text, reasoning, an Alpaca
field) keeps its length and its words' kind: 40% of its words are replaced by words drawn from
the fixtures' own vocabulary, and a text under 30 words gains 6 more at random places (a 9-word
prompt otherwise keeps every word in one copy of a hundred: near-copies nobody planted), so
that two copies of one fixture row share few word 3-grams; JSON payloads (tool calls, tool results,
tools) are kept as they are, so they stay valid.

Planted (rates of N, each row planted once, originals never planted themselves):
- exact duplicates (0.5%): a row written again, byte for byte, later in its file -> `duplicate`;
- near-copies (1%): a row written again later in its file with its user turns re-cased,
  re-spaced and re-punctuated -> `near_duplicate` (the words are the same: Jaccard 1);
- benchmark items (0.1%): a row whose first user turn is a benchmark item's text (GSM8K
  question, HumanEval prompt, MT-Bench first turn; each item once) -> `benchmark_contamination`.

Fixture rows that hold a benchmark item's text themselves (the contamination check, run on the
fixtures once) are not used as templates: the planted count is then the whole count.
Deterministic in (N, seed); cached under benchmarks/work/scale/data_N.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
from bench_states_width import _strings

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "shared" / "fixtures"
DATA = FIXTURES / "data"
EVALSETS = FIXTURES / "evalsets"
WORK = HERE / "work" / "scale"
BENCHMARK_FILES = ("gsm8k_test.jsonl", "humaneval.jsonl", "mt_bench_question.jsonl")

LAYOUTS = {  # layout: (fixture files, share of N)
    "openai_messages": (("openai_messages.jsonl",), 0.25),
    "openai_tools": (("tool_calls.jsonl",), 0.10),
    "sharegpt": (("sharegpt.jsonl",), 0.20),
    "sharegpt_tools": (("sharegpt_toolcall_glaive.jsonl",), 0.15),
    "alpaca": (("alpaca.jsonl",), 0.20),
    "agentic": (("agentic_reasoning_tool_use.jsonl",), 0.10),
}
RATES = {"exact_duplicates": 0.005, "near_copies": 0.01, "benchmark_items": 0.001}
TEXT_KEYS = {"content", "value", "instruction", "input", "output", "text"}
USER_ROLES = {"user", "human"}
REPLACED, SHORT, ADDED = 0.4, 30, 6
CHUNK = 20_000


@functools.cache
def _vocabulary() -> list[str]:
    words: set[str] = set()
    for path in sorted(DATA.glob("*.jsonl")):
        words.update(w for w in re.findall(r"[A-Za-z]{3,14}", path.read_text()))
    return sorted(words)


def _is_payload(text: str) -> bool:
    return text.lstrip()[:1] in ("{", "[")


def vary(text: str, rng: np.random.Generator, vocab: np.ndarray) -> str:
    tokens = text.split(" ")
    replace = np.flatnonzero(rng.random(len(tokens)) < REPLACED)
    picks = vocab[rng.integers(len(vocab), size=len(replace))]
    for k, word in zip(replace.tolist(), picks.tolist(), strict=True):
        tokens[k] = word
    if len(tokens) < SHORT:
        for word in vocab[rng.integers(len(vocab), size=ADDED)].tolist():
            tokens.insert(int(rng.integers(len(tokens) + 1)), word)
    return " ".join(tokens)


def _varied(node: Any, rng: np.random.Generator, vocab: np.ndarray, key: str = "") -> Any:
    if isinstance(node, dict):
        if "function" in node and "type" in node:  # a tool definition or call: payload
            return node
        return {k: _varied(v, rng, vocab, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_varied(v, rng, vocab, key) for v in node]
    if isinstance(node, str) and key in TEXT_KEYS and node.strip() and not _is_payload(node):
        return vary(node, rng, vocab)
    return node


def _user_texts(row: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(the dict holding a user turn's text, its key), in any of the layouts."""
    if "instruction" in row:
        return [(row, "instruction")]
    out = []
    for turn in row.get("messages") or row.get("conversations") or []:
        if (turn.get("role") or turn.get("from")) not in USER_ROLES:
            continue
        content = turn.get("content", turn.get("value"))
        if isinstance(content, list):
            out += [(part, "value") for part in content if part.get("type") == "text"]
        else:
            out.append((turn, "content" if "content" in turn else "value"))
    return out


def near_copy(row: dict[str, Any]) -> dict[str, Any]:
    """The same row, its user turns re-cased, re-spaced and re-punctuated: no byte is shared
    with the original's hash, every word is."""
    copy = json.loads(json.dumps(row))
    for holder, key in _user_texts(copy):
        holder[key] = "  " + holder[key].upper().replace(" ", "  ") + " !!"
    return copy


def with_item(row: dict[str, Any], item: str) -> dict[str, Any]:
    copy = json.loads(json.dumps(row))
    texts = _user_texts(copy)
    holder, key = texts[0]
    holder[key] = "Please help with this one.\n\n" + item
    return copy


def benchmark_items() -> list[str]:
    """Every item's text of the three sets, interleaved (GSM8K, HumanEval, MT-Bench, ...)."""
    sets = []
    for name in BENCHMARK_FILES:
        rows = [json.loads(line) for line in (EVALSETS / name).read_text().splitlines() if line]
        texts = [r.get("question") or r.get("prompt") or (r.get("turns") or [""])[0]
                 for r in rows]
        sets.append([t for t in texts if len(t.split()) >= 20])
    out = []
    for k in range(max(map(len, sets))):
        out += [s[k] for s in sets if k < len(s)]
    return out


@functools.cache
def clean_templates(layout: str) -> list[dict[str, Any]]:
    """The layout's fixture rows that hold no benchmark item's text (ingest's own check)."""
    rows = []
    for name in LAYOUTS[layout][0]:
        rows += [json.loads(line) for line in (DATA / name).read_text().splitlines()
                 if line.strip()]
    return [r for r in rows if not _contaminated(r)]


_MATCHER: Any = None


def _contaminated(row: dict[str, Any]) -> bool:
    global _MATCHER
    from dflash_etl.io.benchmarks import read_benchmark
    from dflash_etl.mix.contamination import ContaminationIndex

    if _MATCHER is None:
        _MATCHER = ContaminationIndex.build(
            i for name in BENCHMARK_FILES for i in read_benchmark(EVALSETS / name))
    return _MATCHER.match(s for s in _strings(row) if s.strip()) is not None


def _chunk(args: tuple[str, int, int, int]) -> bytes:
    """Rows [start, start + count) of a layout's file: varied copies of its templates."""
    layout, start, count, seed = args
    templates = clean_templates(layout)
    vocab = np.array(_vocabulary(), dtype=object)
    lines = []
    for i in range(start, start + count):
        rng = np.random.default_rng([seed, i, len(layout)])
        row = _varied(templates[i % len(templates)], rng, vocab)
        if "id" in row:
            row["id"] = f"{layout}-{i}"
        lines.append(json.dumps(row, ensure_ascii=False).encode())
    return b"\n".join(lines) + b"\n"


def dataset_dir(rows: int, seed: int = 0) -> Path:
    return WORK / f"data_{rows}_{seed}"


def generate(rows: int, seed: int = 0, processes: int = 2) -> dict[str, Any]:
    """The dataset's files and planted.json (cached: made once per (rows, seed))."""
    out = dataset_dir(rows, seed)
    planted_file = out / "planted.json"
    if planted_file.is_file():
        return json.loads(planted_file.read_text())
    out.mkdir(parents=True, exist_ok=True)
    counts = {name: int(rows * share) for name, (_, share) in LAYOUTS.items()}
    counts["openai_messages"] += rows - sum(counts.values())
    planted = {kind: int(rows * rate) for kind, rate in RATES.items()}
    rng = random.Random(seed)
    items = benchmark_items()
    if planted["benchmark_items"] > len(items):
        raise SystemExit(f"{planted['benchmark_items']} benchmark items to plant, "
                         f"{len(items)} usable")
    rng.shuffle(items)
    meta: dict[str, Any] = {"rows": rows, "seed": seed, "layouts": {}, "planted": planted,
                            "planted_by_layout": {}}
    layout_of_plant = rng.choices(list(counts), weights=list(counts.values()),
                                  k=sum(planted.values()))
    kinds = [k for k, n in planted.items() for _ in range(n)]
    mine_of = {layout: [kind for kind, where in zip(kinds, layout_of_plant, strict=True)
                        if where == layout] for layout in counts}
    jobs = [(layout, s, min(CHUNK, base - len(mine_of[layout]) - s), seed)
            for layout, base in counts.items()
            for s in range(0, base - len(mine_of[layout]), CHUNK)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        blobs = pool.map(_chunk, jobs)
    vocab = np.array(_vocabulary(), dtype=object)
    for layout in counts:
        mine = mine_of[layout]
        lines = b"".join(b for job, b in zip(jobs, blobs, strict=True)
                         if job[0] == layout).splitlines()
        rows_of = [json.loads(line) for line in _pick(lines, len(mine), rng)]
        plants = []
        for k, (kind, original) in enumerate(zip(mine, rows_of, strict=True)):
            if kind == "exact_duplicates":
                plants.append(json.dumps(original, ensure_ascii=False).encode())
            elif kind == "near_copies":
                plants.append(json.dumps(near_copy(original), ensure_ascii=False).encode())
            else:  # varied again: not a near-copy of its original
                fresh = _varied(original, np.random.default_rng([seed, k, 7]), vocab)
                plants.append(json.dumps(with_item(fresh, items.pop()),
                                         ensure_ascii=False).encode())
        # each plant after every original: the first of a cluster (file order) is kept
        positions = sorted(rng.randrange(len(lines) // 2, len(lines) + 1) for _ in plants)
        merged, last = [], 0
        for pos, plant in zip(positions, plants, strict=True):
            merged += lines[last:pos]
            merged.append(plant)
            last = pos
        merged += lines[last:]
        (out / f"{layout}.jsonl").write_bytes(b"\n".join(merged) + b"\n")
        meta["layouts"][layout] = {"rows": len(merged), "templates": len(clean_templates(layout))}
        meta["planted_by_layout"][layout] = {k: mine.count(k) for k in planted}
    meta["bytes"] = sum(f.stat().st_size for f in out.glob("*.jsonl"))
    planted_file.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _pick(lines: list[bytes], n: int, rng: random.Random) -> list[bytes]:
    """n distinct originals from the file's first half (a plant goes after its original)."""
    return [lines[k] for k in rng.sample(range(len(lines) // 2), n)]
