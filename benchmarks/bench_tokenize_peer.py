"""`dflash-etl tokenize` against speculators 0.7.0.2's `prepare_data`, whole process, same rows.

The peer is the harness in ../shared/peer (its README sets up PEER: a CPU torch environment with
speculators 0.7.0.2 beside it, never this project's). Its generators make the inputs: N synthetic
ShareGPT conversations and two 8k-BPE ChatML tokenizers, one whose template has
`{% generation %}` tags (speculators then uses transformers' assistant mask) and one without
(speculators then falls back to its regex pattern; which path it took is read from its log).
The rows are ingested once (not timed). Then, per tokenizer, peer and stage alternate
(`--repeats` each, a fresh datasets cache per peer run), each timed as a whole process (wall,
CPU of its process tree, peak RSS of the tree); the median run of each counts. The masks are
compared row by row (`compare_masks`).

    python benchmarks/bench_tokenize.py --peer PEER [--conversations 20000] [--repeats 3]

Each of our runs is a whole `dflash-etl tokenize` process as a user runs it stage by stage:
bytecode cached (as pip leaves an installed package: `bench_tokenize.warm_up`, not timed),
nothing resident before it, its gates' imports (great_expectations, pandera) in its own time.
Writes benchmarks/results/tokenize_peer[_N].{json,md}. Goal: >= 2x speculators with the tag
tokenizer, >= 3x with the plain one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HARNESS = REPO.parent / "shared" / "peer"
WORK = HERE / "work" / "tokenize_peer"
sys.path[:0] = [str(HERE), str(REPO / "src")]
from bench_threads import busy  # noqa: E402
from bench_tokenize import stage_env, timed, warm_up  # noqa: E402

TOKENIZERS = {"chatml-generation-tags": ["--generation-tags"], "chatml-plain": []}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def prepare(peer: Path, n: int) -> tuple[Path, dict[str, Path]]:
    """The peer's inputs (made by its own generators) and our ingested run."""
    python = str(peer / "venv" / "bin" / "python")
    data = WORK / f"data_{n}"
    if not (data / "sharegpt.jsonl").exists():
        subprocess.run([python, str(HARNESS / "gen_data.py"), str(n), str(data)], check=True,
                       stdout=subprocess.DEVNULL)
    tokenizers = {}
    for name, flags in TOKENIZERS.items():
        directory = WORK / name
        if not (directory / "tokenizer.json").exists():
            subprocess.run([python, str(HARNESS / "make_tokenizer.py"), str(directory), *flags],
                           check=True, stdout=subprocess.DEVNULL)
        tokenizers[name] = directory
    run_dir = WORK / f"run_{n}"
    if not (run_dir / "ingest" / "conversations").is_dir():
        config = WORK / "peer.toml"
        config.write_text(f'[run]\ndedup = false\n[[sources]]\nname = "sharegpt"\n'
                          f'path = "{data / "sharegpt.jsonl"}"\n')
        subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config", str(config),
                        "--run", str(run_dir)], check=True, stdout=subprocess.DEVNULL,
                       env=stage_env())
    return run_dir, tokenizers


def run_peer(peer: Path, tokenizer: Path, data: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as cache:
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
               **OFFLINE, "HF_DATASETS_CACHE": cache, "PYTHONPATH": str(peer / "spec0702")}
        result = timed([str(peer / "venv" / "bin" / "python"),
                        str(HARNESS / "speculators07_prepare.py"), str(tokenizer), str(data),
                        str(out), "2"], env)
    log = result.pop("log")
    result["rows"] = next((int(line.split("rows=")[1].split()[0]) for line in log.splitlines()
                           if line.startswith("rows=")), 0)
    return result


def peer_mask_path(peer: Path, tokenizer: Path) -> str:
    """Which mask path speculators takes for this tokenizer (its own test; its log is off)."""
    code = ("import sys; from transformers import AutoTokenizer; from speculators.data_generation"
            ".preprocessing import _supports_assistant_mask as ok; "
            "print(ok(AutoTokenizer.from_pretrained(sys.argv[1])))")
    out = subprocess.run([str(peer / "venv" / "bin" / "python"), "-c", code, str(tokenizer)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, **OFFLINE, "PYTHONPATH": str(peer / "spec0702")})
    return ("HF assistant mask ({% generation %} tags)" if out.stdout.strip().endswith("True")
            else "regex pattern (_detect_assistant_pattern)")


def run_ours(run_dir: Path, tokenizer: Path) -> dict:
    env = stage_env()
    result = timed([sys.executable, "-m", "dflash_etl", "tokenize", "--run", str(run_dir),
                    "--model", str(tokenizer), "--seq-length", "8192", "--force"], env)
    result.pop("log")
    stats = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]
    result.update(rows=stats["rows_written"], quarantined=stats["rows_quarantined"],
                  strategies=stats["strategies"], cross_checked=stats.get("cross_checked"))
    return result


def compare_masks(run_dir: Path, peer_out: Path) -> dict:
    """Row-by-row agreement of input_ids and loss_mask. speculators shuffles its rows and keeps
    the render's text after the last turn (ChatML's final newline), which our rows end before:
    a peer row matches ours when ours is its prefix and the rest of it is unsupervised."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from dflash_etl.validation.contracts import read_arrow

    peer_rows = pa.concat_tables(
        ipc.open_stream(str(f)).read_all() for f in sorted((peer_out / "data").glob("*.arrow")))
    ours = pa.concat_tables(read_arrow(f) for f in sorted(
        (run_dir / "tokenize" / "dataset").glob("*.arrow")))
    our_masks = ours.column("loss_mask").to_pylist()
    by_ids = {tuple(ids): k for k, ids in enumerate(ours.column("input_ids").to_pylist())}
    matched = same_mask = peer_supervised = 0
    for p_ids, p_mask in zip(peer_rows.column("input_ids").to_pylist(),
                             peer_rows.column("loss_mask").to_pylist(), strict=True):
        p_mask = [int(m) for m in p_mask]
        peer_supervised += sum(p_mask)
        for cut in range(len(p_ids), max(len(p_ids) - 3, 0), -1):
            k = by_ids.get(tuple(p_ids[:cut]))
            if k is not None:
                matched += 1
                same_mask += our_masks[k] == p_mask[:cut] and not any(p_mask[cut:])
                break
    return {"rows": peer_rows.num_rows, "same_input_ids": matched, "same_loss_mask": same_mask,
            "peer_supervised_tokens": peer_supervised,
            "our_supervised_tokens": sum(map(sum, our_masks))}


@contextlib.contextmanager
def loaded(n: int) -> Iterator[None]:
    """N spinning processes for the length of one timed run: the same load for both tools."""
    spinners = busy(n)
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main(peer: Path, conversations: int, repeats: int, only: str | None = None,
         load: int = 0) -> None:
    if not (peer / "venv" / "bin" / "python").exists() or not (peer / "spec0702").is_dir():
        raise SystemExit(f"{peer}: no peer environment (venv/ and spec0702/): set it up as "
                         f"{HARNESS / 'README.md'} says")
    WORK.mkdir(parents=True, exist_ok=True)
    run_dir, tokenizers = prepare(peer, conversations)
    data = WORK / f"data_{conversations}" / "sharegpt.jsonl"
    results = {"date": dt.date.today().isoformat(), "machine": {
        "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "load_avg_at_start": os.getloadavg()[0]},
        "conversations": conversations, "load": load,
        "peer": "speculators 0.7.0.2 prepare_data, 2 workers",
        "runs": {}}
    for name, tokenizer in tokenizers.items():
        if only and name != only:
            continue
        peers, ours = [], []
        peer_out = WORK / f"peer_out_{name}"
        warm_up()  # bytecode cached, as pip leaves an installed package (not timed)
        for k in range(repeats):  # alternate, the first one each way round
            order = ("peer", "ours") if k % 2 == 0 else ("ours", "peer")
            for who in order:
                with loaded(load):
                    if who == "peer":
                        peers.append(run_peer(peer, tokenizer, data, peer_out))
                    else:
                        ours.append(run_ours(run_dir, tokenizer))
        p_median = statistics.median(r["seconds"] for r in peers)
        o_median = statistics.median(r["seconds"] for r in ours)
        results["runs"][name] = {
            "peer": peers, "ours": ours, "peer_median_s": p_median, "ours_median_s": o_median,
            "speedup": round(p_median / o_median, 2),
            "peer_mask_path": peer_mask_path(peer, tokenizer),
            "masks": compare_masks(run_dir, peer_out)}
        print(name, json.dumps({k: v for k, v in results["runs"][name].items()
                                if k not in ("peer", "ours")}), flush=True)
    results["machine"]["load_avg_at_end"] = os.getloadavg()[0]
    out = HERE / "results"
    stem = "tokenize_peer" + (f"_{conversations}" if conversations != 20000 else "") + (
        f"_{only}" if only else "") + (f"_load{load}" if load else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    lines = [f"# tokenize vs speculators 0.7.0.2 ({results['date']}, {m['cores']} cores, 1-min "
             f"load {m['load_avg_at_start']:.1f} at start, {m['load_avg_at_end']:.1f} at end)",
             "", f"{conversations} synthetic ShareGPT conversations from "
             "../shared/peer/gen_data.py (1-3 turns, 10% system), 8k-BPE ChatML tokenizers "
             "from its make_tokenizer.py; "
             f"whole process, {repeats} alternating runs each, median; nothing resident before "
             "either (each dflash-etl run imports its gates' engines itself). Command: "
             f"`python benchmarks/bench_tokenize.py --peer PEER --conversations {conversations}"
             f"{f' --load {load}' if load else ''}`.",
             *(["", f"**Loaded:** {load} processes spinning in Python ran beside every timed "
                "run of either tool (started before it, killed after it)."] if load else []),
             "",
             "| tokenizer | speculators mask path | speculators s (runs) | dflash-etl s (runs) | "
             "speedup (medians) | CPU s peer / ours (median run) | peak RSS peer / ours | "
             "rows peer / ours | rows matched | same loss_mask | supervised tokens peer / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        pm = sorted(r["peer"], key=lambda x: x["seconds"])[len(r["peer"]) // 2]
        om = sorted(r["ours"], key=lambda x: x["seconds"])[len(r["ours"]) // 2]
        masks = r["masks"]
        lines.append(
            f"| {name} | {r['peer_mask_path']} | "
            f"{' / '.join(str(x['seconds']) for x in r['peer'])} | "
            f"{' / '.join(str(x['seconds']) for x in r['ours'])} | **{r['speedup']}x** | "
            f"{pm['cpu_seconds']} / {om['cpu_seconds']} | {pm['peak_rss_mb']} / "
            f"{om['peak_rss_mb']} MB | {pm['rows']} / {om['rows']} | "
            f"{masks['same_input_ids']} of {masks['rows']} | {masks['same_loss_mask']} of "
            f"{masks['rows']} | {masks['peer_supervised_tokens']} / "
            f"{masks['our_supervised_tokens']} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
