"""The rehearsal at the user's scale: 1M conversations in the real layouts (scale_data.py) through
ingest (decontaminated against MT-Bench, GSM8K and HumanEval, near-dedup on) and tokenize (the
Qwen3.6 tokenizer and template, thinking on, seq_length 8192), on the local executor and on Ray.

Per stage and executor: wall, CPU seconds and peak RSS of the process tree (Ray's own processes
included), bytes written, rows/s; beside them the limits on the same machine: a bare polars read
of the same files (`pl.read_ndjson`, one process), and render + encode of the same conversations
with the same tokenizer in one process per core (at --small-rows only: it costs what tokenize
costs; its per-conversation CPU is scaled). The planted mistakes (exact duplicates, near-copies,
benchmark items) must come back exactly: ingest's filtered counts per reason against
planted.json.

    python benchmarks/bench_scale.py [--rows 1000000] [--small-rows 100000]
        [--executors local,ray] [--note "..."]

Results: benchmarks/results/scale.{json,md}. Each run is a fresh `python -m dflash_etl` process
(bench_executors.measure_run: sampled every 100 ms, phases from the CLI's timers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_executors as bx  # noqa: E402
import bench_ingest as bi  # noqa: E402
import scale_data as sd  # noqa: E402

TOKENIZER = sd.FIXTURES / "qwen36-tokenizer"
RESULTS = HERE / "results"
REASONS = {"exact_duplicates": "duplicate", "near_copies": "near_duplicate",
           "benchmark_items": "benchmark_contamination"}


def write_config(data: Path, run_tag: str) -> Path:
    sources = "".join(f'[[sources]]\nname = "{layout}"\npath = "{data / (layout + ".jsonl")}"\n\n'
                      for layout in sd.LAYOUTS)
    benchmarks = ", ".join(f'"{sd.EVALSETS / name}"' for name in sd.BENCHMARK_FILES)
    config = sd.WORK / f"{run_tag}.toml"
    config.write_text(
        f"[run]\ndedup = true\n\n{sources}[ingest]\ndecontaminate = [{benchmarks}]\n"
        f"near_dedup = true\n\n[tokenize]\nmodel = \"{TOKENIZER}\"\nseq_length = 8192\n"
        "template_kwargs = { enable_thinking = true }\n")
    return config


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class LogWatcher(threading.Thread):
    """When each line of a run's log arrived (stderr is a file: what a `nohup` run leaves), for
    the longest silence a person watching it sees."""

    def __init__(self, log: Path) -> None:
        super().__init__(daemon=True)
        self.log, self.stop, self.arrivals = log, threading.Event(), [time.time()]

    def run(self) -> None:
        seen = 0
        while not self.stop.wait(0.25):
            text = self.log.read_bytes() if self.log.exists() else b""
            new = text.count(b"\n") - seen
            if new > 0:
                seen += new
                self.arrivals.append(time.time())

    def longest_silence(self) -> float:
        times = [*self.arrivals, time.time()]
        return round(max(b - a for a, b in itertools.pairwise(times)), 1)


def stage_run(stage: str, executor: str, config: Path, run_dir: Path) -> dict[str, Any]:
    argv = [stage, "--config", str(config), "--run", str(run_dir), "--force",
            "--executor", executor]
    log = sd.WORK / "logs" / f"{run_dir.name}-{stage}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    watcher = LogWatcher(log)
    watcher.start()
    try:
        result = bx.measure_run(f"{stage} {executor} {run_dir.name}", argv, log)
    finally:
        watcher.stop.set()
        watcher.join()
    result["longest_log_silence_s"] = watcher.longest_silence()
    stats = json.loads((run_dir / stage / "stats.json").read_text())["total"]
    result["stats"] = stats
    manifest = json.loads((run_dir / "manifest.json").read_text())
    result["in_stage_s"] = manifest["stages"][stage]["seconds"]
    result["bytes_written"] = dir_bytes(run_dir / stage)
    return result


def polars_read(data: Path) -> dict[str, Any]:
    """The bare read of the same files, one process (imports not timed)."""
    code = ("import sys, time, polars as pl\nt = time.perf_counter(); c = time.process_time()\n"
            "n = sum(pl.read_ndjson(f, infer_schema_length=None).height for f in sys.argv[1:])\n"
            "print(n, time.perf_counter() - t, time.process_time() - c)")
    files = [str(data / f"{layout}.jsonl") for layout in sd.LAYOUTS]
    out = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True,
                         check=True)
    rows, wall, cpu = out.stdout.split()
    return {"rows": int(rows), "wall_s": round(float(wall), 2), "cpu_s": round(float(cpu), 2)}


def render_encode(part: int, parts: int, conversations: str) -> dict[str, Any]:
    """The tokenize limit in one process: the template's render of each conversation (thinking
    on, its tools) and a batch encode, loading not timed."""
    import polars as pl

    from dflash_etl.models.generation.conversations import template_messages
    from dflash_etl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(TOKENIZER))
    frame = pl.read_parquet(Path(conversations) / "*.parquet").gather_every(parts, offset=part)
    rows = frame.select("messages", "tools").to_dicts()
    start, cpu = time.perf_counter(), time.process_time()
    texts = []
    for row in rows:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        texts.append(tok.apply_chat_template(template_messages(row["messages"]), tools=tools,
                                             tokenize=False, enable_thinking=True))
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
            "conversations": len(texts), "tokens": sum(map(len, encoded))}


def render_encode_all_cores(conversations: Path) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        parts = pool.starmap(render_encode, [(k, cores, str(conversations))
                                             for k in range(cores)])
    return {"wall_s": round(max(p["seconds"] for p in parts), 2),
            "cpu_s": round(sum(p["cpu_s"] for p in parts), 2), "processes": cores,
            "conversations": sum(p["conversations"] for p in parts),
            "tokens": sum(p["tokens"] for p in parts)}


def planted_check(meta: dict[str, Any], ingest: dict[str, Any]) -> dict[str, Any]:
    filtered = ingest["stats"]["rows_filtered"]
    return {kind: {"planted": n, "found": filtered.get(REASONS[kind], 0),
                   "exact": filtered.get(REASONS[kind], 0) == n}
            for kind, n in meta["planted"].items()}


def one_size(rows: int, executors: list[str], limits: bool) -> dict[str, Any]:
    meta = sd.generate(rows)
    data = sd.dataset_dir(rows)
    bi.warm_cache(data)
    res: dict[str, Any] = {"rows": rows, "data": meta, "runs": {}}
    res["polars_read"] = polars_read(data)
    for executor in executors:
        run_dir = sd.WORK / "runs" / f"{executor}_{rows}"
        config = write_config(data, f"{executor}_{rows}")
        ingest = stage_run("ingest", executor, config, run_dir)
        ingest["planted"] = planted_check(meta, ingest)
        tokenize = stage_run("tokenize", executor, config, run_dir)
        res["runs"][executor] = {"ingest": ingest, "tokenize": tokenize}
        print(json.dumps({executor: {s: {k: r[k] for k in ("wall_s", "cpu_s", "bytes_written")}
                                     for s, r in res["runs"][executor].items()},
                          "planted": ingest["planted"]}), flush=True)
    if limits:
        first = sd.WORK / "runs" / f"{executors[0]}_{rows}" / "ingest" / "conversations"
        res["render_encode"] = render_encode_all_cores(first)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--small-rows", type=int, default=100_000)
    ap.add_argument("--executors", default="local,ray")
    ap.add_argument("--note", default="")
    ap.add_argument("--report-only", action="store_true",
                    help="the digests and the tables again from results/scale.json and the runs")
    args = ap.parse_args(argv)
    executors = args.executors.split(",")
    if args.report_only:
        return report(json.loads((RESULTS / "scale.json").read_text()), args.small_rows,
                      args.rows, executors)
    res: dict[str, Any] = {
        "command": "python benchmarks/bench_scale.py" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "machine": bi.machine_info(), "note": args.note, "sizes": {}}
    for rows in (args.small_rows, args.rows):
        res["sizes"][str(rows)] = one_size(rows, executors, limits=rows == args.small_rows)
        (RESULTS / "scale.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    return report(res, args.small_rows, args.rows, executors)


def report(res: dict[str, Any], small: int, rows: int, executors: list[str]) -> int:
    """Whether the executors wrote the same bytes (bench_executors.output_digest: the data
    files, not the timings), the goals, the tables."""
    for size, entry in res["sizes"].items():
        for executor, run in entry["runs"].items():
            for stage, r in run.items():
                r["output_sha256"] = bx.output_digest(
                    sd.WORK / "runs" / f"{executor}_{size}" / stage)
        digests = {r["output_sha256"] for run in entry["runs"].values() for r in
                   run.values()}
        entry["outputs_identical_across_executors"] = (
            len(digests) == 2 if len(entry["runs"]) > 1 else None)  # one per stage
    res["goals"] = goals(res, small, rows, executors)
    (RESULTS / "scale.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    md = markdown(res)
    (RESULTS / "scale.md").write_text(md)
    print(md)
    return 0


def _pair(res: dict[str, Any], rows: int, executor: str) -> tuple[dict, dict]:
    run = res["sizes"][str(rows)]["runs"][executor]
    return run["ingest"], run["tokenize"]


def goals(res: dict[str, Any], small: int, rows: int, executors: list[str]) -> dict[str, Any]:
    ingest, tokenize = _pair(res, rows, "local")
    s_ingest, s_tokenize = _pair(res, small, "local")
    both = ingest["wall_s"] + tokenize["wall_s"]
    per_row = both / rows / ((s_ingest["wall_s"] + s_tokenize["wall_s"]) / small)
    runs = [r for size in res["sizes"].values() for run in size["runs"].values()
            for r in run.values()]
    peak = max(r["peak_tree_rss_bytes"] for r in runs)
    exact = all(c["exact"] for size in res["sizes"].values() for run in size["runs"].values()
                for c in run["ingest"]["planted"].values())
    silence = max(r["longest_log_silence_s"] for r in runs)
    out: dict[str, Any] = {
        "ingest_plus_tokenize_local_s": {"value": round(both, 1), "target": "<= 720",
                                         "met": both <= 720},
        "peak_tree_rss_bytes": {"value": peak, "target": "<= 3 GB", "met": peak <= 3e9},
        "time_per_row_growth": {"value": round(per_row, 3), "target": "<= 1.2",
                                "met": per_row <= 1.2},
        "planted_exact": {"value": exact, "target": "every count", "met": exact},
        "longest_log_silence_s": {"value": silence, "target": "<= 30", "met": silence <= 30},
    }
    if "ray" in executors:
        r_ingest, r_tokenize = _pair(res, rows, "ray")
        ratio = (r_ingest["wall_s"] + r_tokenize["wall_s"]) / both
        out["ray_over_local"] = {"value": round(ratio, 3), "target": "<= 1.15",
                                 "met": ratio <= 1.15}
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# ingest + tokenize at the user's scale — {m.get('date', '')}", ""]
    if res.get("note"):
        lines += [f"**{res['note']}**", ""]
    lines += [f"Command: `{res['command']}`; {m.get('nproc')} CPUs ({m.get('cpu')}), "
              f"{m.get('memory')}, Python {m.get('python')}, dflash_etl {m.get('dflash_etl')}.",
              "", "Data (benchmarks/scale_data.py): the layouts of ../shared/fixtures/data, "
              "each row a fixture row with 40% of its words replaced; planted at known rates: "
              "exact duplicates 0.5%, near-copies 1% (re-cased, re-spaced, re-punctuated user "
              "turns), benchmark items 0.1%. Ingest: `decontaminate` against MT-Bench, GSM8K "
              "and HumanEval, `near_dedup` on; tokenize: the Qwen3.6 tokenizer and template "
              "(../shared/fixtures/qwen36-tokenizer), thinking on, seq_length 8192.", "",
              "| rows | executor | stage | wall s | in-stage s | CPU s (tree) | peak tree RSS | "
              "rows in | rows out | rows/s (in) | MB written | longest log silence s | "
              "Ray start s |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, size in res["sizes"].items():
        for executor, run in size["runs"].items():
            for stage, r in run.items():
                st = r["stats"]
                lines.append(
                    f"| {int(rows):,} | {executor} | {stage} | {r['wall_s']:.1f} | "
                    f"{r['in_stage_s']:.1f} | {r['cpu_s']:.1f} | "
                    f"{_gib(r['peak_tree_rss_bytes'])} | {st['rows_in']:,} | "
                    f"{st.get('rows_out', st.get('rows_written', 0)):,} | "
                    f"{st['rows_in'] / r['wall_s']:,.0f} | {r['bytes_written'] / 1e6:,.0f} | "
                    f"{r['longest_log_silence_s']} | {r['phases'].get('ray_init', 0):.1f} |")
    lines += ["", "Limits on the same machine, same files:", "",
              "| rows | bare polars read (1 process) wall s / CPU s | render + encode, "
              "one process per core: wall s / CPU s (conversations, tokens) |",
              "|---:|---|---|"]
    for rows, size in res["sizes"].items():
        pr, re_ = size["polars_read"], size.get("render_encode")
        limit = (f"{re_['wall_s']} / {re_['cpu_s']} ({re_['conversations']:,}, "
                 f"{re_['tokens']:,})" if re_ else "(measured at the smaller size)")
        lines.append(f"| {int(rows):,} | {pr['wall_s']} / {pr['cpu_s']} | {limit} |")
    lines += ["", "Planted mistakes, found by ingest (filtered by reason):", "",
              "| rows | executor | exact duplicates | near-copies | benchmark items |",
              "|---:|---|---|---|---|"]
    for rows, size in res["sizes"].items():
        for executor, run in size["runs"].items():
            p = run["ingest"]["planted"]
            lines.append(f"| {int(rows):,} | {executor} | " + " | ".join(
                f"{p[k]['found']:,} of {p[k]['planted']:,}" for k in
                ("exact_duplicates", "near_copies", "benchmark_items")) + " |")
    lines += ["", "Outputs of the two executors byte-identical (sha256 of every data file, per "
              "stage): " + ", ".join(
                  f"{int(rows):,}: " + ("yes" if size.get("outputs_identical_across_executors")
                                        else "no") for rows, size in res["sizes"].items()) + ".",
              "", "Rows not written, by reason (quarantined: q, filtered: f):", ""]
    for rows, size in res["sizes"].items():
        for executor, run in size["runs"].items():
            for stage, r in run.items():
                st = r["stats"]
                q = st.get("quarantine_reasons") or {}
                f = st.get("rows_filtered") if isinstance(st.get("rows_filtered"), dict) else (
                    st.get("filter_reasons") or {})
                lines.append(f"- {int(rows):,} {executor} {stage}: q {dict(q)}, f {dict(f)}")
    lines += ["", "| goal | value | target | met |", "|---|---:|---|---|"]
    for key, g in res["goals"].items():
        lines.append(f"| {key} | {g['value']} | {g['target']} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
