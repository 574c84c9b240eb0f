"""Benchmark prompt files (MT-Bench, GSM8K, HumanEval, or any `messages`/`prompt` JSONL) as
items of text: what decontamination keeps out of the training mix.

A file's layout is read from its first row's keys: `turns` (MT-Bench: `question_id`, each user
turn), `question` (GSM8K: with its `answer`, the calculator notes `<<16-3=13>>` dropped),
`prompt` (HumanEval: with its `canonical_solution`; or a plain prompt list), `messages` (every
message's content). A file of more than MAX_ITEMS rows is an error, never cut short.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError

CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")
MAX_ITEMS = 1_000_000  # a bound on one benchmark file's rows


@dataclass(frozen=True)
class BenchmarkItem:
    benchmark: str  # the file's stem (gsm8k_test, mt_bench_question, humaneval)
    item: str  # its id in the benchmark (question_id, task_id, or the line)
    turns: tuple[str, ...]  # the user turns, in order (MT-Bench has two)
    references: tuple[str, ...] = ()  # the reference answer where the file has one
    category: str = ""  # MT-Bench's

    @property
    def texts(self) -> tuple[str, ...]:
        """Every text of the item: what decontamination looks for."""
        return self.turns + self.references


def read_benchmark(path: str | Path) -> list[BenchmarkItem]:
    """The items of one benchmark file; an unknown layout is an error naming the keys."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise StageError(f"benchmark file {path} cannot be read ({exc})") from exc
    rows = sum(1 for line in lines if line.strip())
    if rows > MAX_ITEMS:
        raise StageError(f"benchmark file {path} holds {rows:,} rows, past the {MAX_ITEMS:,} "
                         "this reads (a benchmark's test split is thousands): is it a training "
                         "set? Give the test split, or split the file")
    items = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise StageError(f"{path}:{line_no}: not a JSON line ({exc})") from exc
        if not isinstance(row, dict):
            raise StageError(f"{path}:{line_no}: a JSON object per line is expected")
        items.append(_item(path.stem, row, path, line_no))
    return items


def _item(name: str, row: dict[str, Any], path: Path, line: int) -> BenchmarkItem:
    def strings(*values: Any) -> tuple[str, ...]:
        return tuple(v for v in values if isinstance(v, str) and v.strip())

    if isinstance(row.get("turns"), list):
        return BenchmarkItem(name, str(row.get("question_id", line)), strings(*row["turns"]),
                             category=str(row.get("category") or ""))
    if "question" in row:
        answer = CALCULATOR_NOTE.sub("", row.get("answer") or "")
        return BenchmarkItem(name, str(row.get("id", line)), strings(row["question"]),
                             strings(answer))
    if "prompt" in row:
        return BenchmarkItem(name, str(row.get("task_id", row.get("id", line))),
                             strings(row["prompt"]), strings(row.get("canonical_solution")))
    if isinstance(row.get("messages"), list):
        messages = [m for m in row["messages"] if isinstance(m, dict)]
        return BenchmarkItem(name, str(row.get("id", line)), strings(
            *(m.get("content") for m in messages if m.get("role") == "user")), strings(
            *(m.get("content") for m in messages if m.get("role") == "assistant")))
    raise StageError(f"{path}:{line}: no benchmark layout in keys {sorted(row)[:12]}: give "
                     "MT-Bench (turns), GSM8K (question, answer), HumanEval (prompt), or "
                     "messages / prompt JSONL")
