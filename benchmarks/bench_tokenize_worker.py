"""Worker CPU per conversation of the tokenize stage: this tree against another git revision.

This machine's speed drifts by 2x within minutes, so two whole-process runs minutes apart cannot
show a 10% change. Here both versions run in one process, alternating: the revision's
`dflash_etl` is extracted with `git archive` and imported as `dflash_etl_base`; each version
tokenizes the same conversations (`tokenize_rows`, chunks of 256, as a worker does) several
times, and the fastest CPU time of each counts. Rows must be equal.

Uses the 20k synthetic conversations of bench_tokenize.py when it has run, else makes (and
ingests) as many as asked. Also prints the renders per conversation each version took, by
render path, where its stats record them (`renders`, `render_paths`).

    python benchmarks/bench_tokenize_worker.py --base REV [--tokenizer qwen3.6|bpe8k-chatml]
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
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


def _conversations_dir(n: int) -> Path:
    """bench_tokenize.py's 20k conversations, else `n` made and ingested here (same maker)."""
    made = WORK / "run_20000" / "ingest" / "conversations"
    if made.is_dir():
        return made
    own = WORK / f"run_{n}" / "ingest" / "conversations"
    if not own.is_dir():
        sys.path.insert(0, str(HERE))
        from bench_tokenize import make_data

        WORK.mkdir(parents=True, exist_ok=True)
        source = WORK / f"sharegpt_{n}.jsonl"
        if not source.exists():
            make_data(n, source)
        config = WORK / f"bench_{n}.toml"
        config.write_text(f'[[sources]]\nname = "sharegpt"\npath = "{source.name}"\n')
        subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config", str(config),
                        "--run", str(WORK / f"run_{n}")], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    return own


def _renders(outputs) -> str:
    """Renders per written conversation and the conversations per render path, from the
    stats tokenize_rows returned (older revisions record none)."""
    renders, paths = 0, collections.Counter()
    for _rows, _quarantine, per_source in outputs:
        for stats in per_source.values():
            renders += stats.extra.get("renders", 0)
            paths.update(stats.extra.get("render_paths", {}))
    written = sum(paths.values())
    return f"{renders / written:.2f} renders/conv {dict(paths)}" if written else "not recorded"


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
    parser.add_argument("--without", metavar="SHORTCUT",
                        help="also this tree with a shortcut of probe.json's fast_paths off "
                        "(e.g. one_render: N+1 renders for N replies), in the same rounds")
    args = parser.parse_args()
    conversations_dir = _conversations_dir(args.conversations)
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
        if args.without:
            import dataclasses

            module, tokenizer, probe, settings = versions["work"]
            versions["without"] = (module, tokenizer, dataclasses.replace(probe, fast_paths={
                **probe.fast_paths, args.without: False}), settings)

        def run(name: str):
            module, tokenizer, probe, settings = versions[name]
            out = []
            for start in range(0, len(convs), 256):
                out.append(module.tokenize_rows(convs[start:start + 256], tokenizer, probe,
                                                settings, None))
            return out

        times: dict[str, list[float]] = {name: [] for name in versions}
        outputs = {}
        for round_ in range(args.rounds):
            for name in list(versions)[::1 if round_ % 2 == 0 else -1]:
                gc.collect()
                start = time.process_time()
                outputs[name] = run(name)
                times[name].append(time.process_time() - start)
    same = all(  # the token frequencies follow from the rows (older revisions returned them)
        _row_tuples(b[0]) == _row_tuples(w[0])
        for other in outputs.values() if other is not outputs["work"]
        for b, w in zip(other, outputs["work"], strict=True))
    n = len(convs)
    best = {k: min(v) / n * 1e3 for k, v in times.items()}
    print(f"{args.tokenizer}, {n} conversations, fastest of {args.rounds}: base ({args.base}) "
          f"{best['base']:.3f} ms/conv, this tree {best['work']:.3f} ms/conv "
          f"({best['work'] / best['base']:.2f}x); same rows: {same}")
    if "without" in best:
        print(f"  this tree without {args.without}: {best['without']:.3f} ms/conv (this tree "
              f"{best['work'] / best['without']:.2f}x of it)")
    for name in versions:
        print(f"  {name}: {_renders(outputs[name])}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
