"""Worker CPU per conversation of the tokenize stage: this tree against another git revision.

This machine's speed drifts by 2x within minutes, so two whole-process runs minutes apart cannot
show a 10% change. Here both versions run in one process, alternating: the revision's
`dflash_etl` is extracted with `git archive` and imported as `dflash_etl_base`; each version
tokenizes the same conversations (`tokenize_rows`, chunks of 256, as a worker does) several
times, and the fastest CPU time of each counts. Rows must be equal.

Uses the 20k synthetic conversations of bench_tokenize.py (run it once first).

    python benchmarks/bench_tokenize_worker.py --base REV [--tokenizer qwen3.6|bpe8k-chatml]
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "tokenize"
MODELS = {"qwen3.6": REPO.parent / "shared" / "fixtures" / "qwen36-tokenizer",
          "bpe8k-chatml": WORK / "bpe8k"}


def extract(rev: str, into: Path) -> None:
    """The revision's package as `dflash_etl_base` under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src/dflash_etl"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "dflash_etl_base"
    (into / "src" / "dflash_etl").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bdflash_etl\b", "dflash_etl_base", path.read_text()))


def _row_tuples(rows) -> list[tuple[list[int], list[int], int]]:
    """(input_ids, loss_mask, turn) per row, from a list of row dicts (older revisions) or a
    table."""
    if not isinstance(rows, list):
        rows = rows.to_pylist()
    return [([int(t) for t in r["input_ids"]], [int(m) for m in r["loss_mask"]], r["turn"])
            for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument("--tokenizer", choices=sorted(MODELS), default="qwen3.6")
    parser.add_argument("--conversations", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    conversations_dir = WORK / "run_20000" / "ingest" / "conversations"
    if not conversations_dir.is_dir():
        raise SystemExit("run benchmarks/bench_tokenize.py once first (it makes the data)")
    import polars as pl

    convs = pl.read_parquet(conversations_dir / "*.parquet", columns=[
        "id", "source", "messages", "tools", "file", "line"]).head(args.conversations).to_dicts()
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        import dflash_etl_base.stages.tokenize as base

        import dflash_etl.stages.tokenize as work

        versions = {}
        for name, module in (("base", base), ("work", work)):
            settings = module.TokenizeSettings(model=str(MODELS[args.tokenizer]))
            tokenizer = module.load_tokenizer(settings.model)
            versions[name] = (module, tokenizer, module.probe(settings, tokenizer), settings)

        def run(name: str):
            module, tokenizer, probe, settings = versions[name]
            out = []
            for start in range(0, len(convs), 256):
                out.append(module.tokenize_rows(convs[start:start + 256], tokenizer, probe,
                                                settings, None))
            return out

        times: dict[str, list[float]] = {"base": [], "work": []}
        outputs = {}
        for round_ in range(args.rounds):
            for name in ("base", "work") if round_ % 2 == 0 else ("work", "base"):
                gc.collect()
                start = time.process_time()
                outputs[name] = run(name)
                times[name].append(time.process_time() - start)
    same = all(  # the token frequencies follow from the rows (older revisions returned them)
        _row_tuples(b[0]) == _row_tuples(w[0])
        for b, w in zip(outputs["base"], outputs["work"], strict=True))
    n = len(convs)
    best = {k: min(v) / n * 1e3 for k, v in times.items()}
    print(f"{args.tokenizer}, {n} conversations, fastest of {args.rounds}: base ({args.base}) "
          f"{best['base']:.3f} ms/conv, this tree {best['work']:.3f} ms/conv "
          f"({best['work'] / best['base']:.2f}x); same rows: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
