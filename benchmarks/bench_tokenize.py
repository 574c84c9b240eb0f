"""Tokenize benchmark: `dflash-etl tokenize` against the raw limit, on two tokenizers.

20k synthetic ShareGPT conversations (1-3 turns, 10% with a system turn), ingested once (not
timed). Then, for a small 8k-vocabulary BPE ChatML tokenizer (trained here on the same text, with
the project's ChatML template) and for the real Qwen3.6 tokenizer (../shared/fixtures):
  raw limit: in one process, apply_chat_template(tokenize=False) on every conversation plus the
             tokenizer's batch encode of the texts (no masks, no verification, no writing);
  stage:     `python -m dflash_etl tokenize --force` as a whole process (default workers = cores).
Raw limit and stage runs alternate (--repeats stage runs per tokenizer, one more raw run); the
fastest run of each counts, and, as a figure the host's drift moves less, the median over the
stage runs of (mean of the raw runs just before and after) / stage. With --base REV the stage of
that git revision runs too, alternating with this tree's (same data, same checks), so a change's
effect on the whole process shows within one run. The raw limit also runs with every core (one
spawned process per core on its share of the conversations). Reports conversations/s, tokens/s,
the ratio stage/raw against both raw limits (goal >= 0.75), CPU per conversation and the stage's
peak RSS (summed over its process tree). Stage runs find the imports' bytecode cached, as an
installed package has it (`warm_up`); each imports its gates' engines itself.
Writes benchmarks/results/tokenize.{json,md} (tokenize_N[_TOKENIZER] for other sizes or one
tokenizer).

    python benchmarks/bench_tokenize.py [--conversations 20000] [--repeats 2] [--base REV]
    python benchmarks/bench_tokenize.py --conversations 200000 --tokenizer qwen3.6  # steady state
    python benchmarks/bench_tokenize.py --peer PEER   # against speculators: bench_tokenize_peer
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "tokenize"
QWEN = REPO.parent / "shared" / "fixtures" / "qwen36-tokenizer"
TEMPLATE = REPO / "data" / "tokenizer" / "chat_template.jinja"
PAGE = os.sysconf("SC_PAGE_SIZE")
WORDS = (  # noqa: SIM905
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason research girl "
    "guy moment air teacher force education").split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
    return " ".join(words).capitalize() + rng.choice([".", "?", "!"])


def make_data(n: int, path: Path) -> None:
    rng = random.Random(0)
    with path.open("w") as fh:
        for k in range(n):
            conv = []
            if rng.random() < 0.1:
                conv.append({"from": "system", "value": sentence(rng)})
            for _ in range(rng.randint(1, 3)):
                conv.append({"from": "human", "value": " ".join(
                    sentence(rng) for _ in range(rng.randint(1, 3)))})
                conv.append({"from": "gpt", "value": " ".join(
                    sentence(rng) for _ in range(rng.randint(2, 8)))})
            fh.write(json.dumps({"id": f"c{k}", "conversations": conv}) + "\n")


def train_bpe(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = (m["value"] for line in corpus.open() for m in json.loads(line)["conversations"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
               "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=8192, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {
            "content": t, "special": t.startswith("<|"), "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False} for t in special}}))
    shutil.copy(TEMPLATE, out / "chat_template.jinja")


def raw_limit(model: Path, conversations: Path, part: int = 0, parts: int = 1) -> dict:
    """apply_chat_template to text + batch encode, in this process (of `parts` processes, the
    one that takes every `parts`-th conversation from `part`).

    The tokenizer is loaded as the stage loads it (a fast tokenizer from tokenizer.json; loading is
    not timed): AutoTokenizer would first import torch, minutes on a slow machine.
    """
    import polars as pl

    from dflash_etl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model))
    frame = pl.read_parquet(conversations / "*.parquet", columns=["messages"])
    frame = frame.gather_every(parts, offset=part) if parts > 1 else frame
    start, cpu = time.perf_counter(), time.process_time()
    texts = [tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in msgs],
                                     tokenize=False) for msgs in frame["messages"].to_list()]
    rendered, render_cpu = time.perf_counter(), time.process_time()
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 2),
            "render_seconds": round(rendered - start, 2),
            "encode_cpu_seconds": round(cpu_seconds - (render_cpu - cpu), 2),
            "conversations": len(texts), "tokens": sum(len(e) for e in encoded)}


def raw_limit_all_cores(model: Path, conversations: Path) -> dict:
    """The raw limit with every core: one spawned process per core, each on its share of the
    conversations; wall is the slowest process's, CPU the sum (imports and loading not timed)."""
    import multiprocessing

    cores = os.cpu_count() or 1
    env = {"TOKENIZERS_PARALLELISM": "false"}  # one thread per process: the processes are the cores
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with multiprocessing.get_context("spawn").Pool(cores) as pool:
            parts = pool.starmap(raw_limit, [(model, conversations, k, cores)
                                             for k in range(cores)])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"seconds": max(p["seconds"] for p in parts),
            "cpu_seconds": round(sum(p["cpu_seconds"] for p in parts), 2),
            "conversations": sum(p["conversations"] for p in parts),
            "tokens": sum(p["tokens"] for p in parts), "processes": cores}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def gate_import_cpu() -> float:
    """CPU seconds a fresh process spends importing great_expectations and building the GE
    context (every gated stage process pays it once, interpreter start included)."""
    before = children_cpu()
    subprocess.run([sys.executable, "-c", "from dflash_etl.validation import suites; "
                    "suites._batch_definition()"], check=True, env={
                        **os.environ, "PYTHONPATH": str(REPO / "src")})
    return round(children_cpu() - before, 2)


def tree_rss(pid: int) -> int:
    """RSS of `pid` and its descendants, found through /proc/PID/task/TID/children (cheap: the
    sampler must not take the cores the stage is measured on)."""
    total, todo, seen = 0, [pid], 0
    while todo and seen < 4096:
        current = todo.pop()
        seen += 1
        total += own_rss(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                todo += map(int, Path(f"/proc/{current}/task/{task}/children").read_text().split())
            except (OSError, ValueError):
                continue
    return total


def own_rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split()[23]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def timed(cmd: list[str], env: dict[str, str]) -> dict:
    """Run a whole process (failing the benchmark if it fails): wall seconds, CPU seconds of its
    tree, peak RSS of its tree and of the process itself (sampled every 0.1 s), its output."""
    start, cpu = time.perf_counter(), children_cpu()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peak_tree = peak_own = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_tree, peak_own
        while not done.is_set():
            peak_tree = max(peak_tree, tree_rss(proc.pid))
            peak_own = max(peak_own, own_rss(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{shlex.join(cmd[:4])} failed:\n{out[-3000:]}")
    return {"seconds": round(time.perf_counter() - start, 3),
            "cpu_seconds": round(children_cpu() - cpu, 2),  # its workers too
            "peak_rss_mb": round(peak_tree / 2**20, 1),
            "peak_own_rss_mb": round(peak_own / 2**20, 1), "log": out}


def stage_env(src: Path = REPO / "src") -> dict[str, str]:
    """The environment a stage run gets: Python's bytecode caches on, as an installed package
    has them (pip compiles at install; PYTHONDONTWRITEBYTECODE, set on some machines, made every
    run compile its imports again: ~1.5 s of a 13 s run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(src)}


def warm_up(src: Path = REPO / "src") -> None:
    """The imports' bytecode cached, as an installed package has it (not timed)."""
    code = ("import transformers, tokenizers, polars, pyarrow.parquet, pandera.polars, "
            "great_expectations, dflash_etl.stages.tokenize")
    subprocess.run([sys.executable, "-c", code], env=stage_env(src), check=True)


def run_stage(run_dir: Path, model: Path, src: Path = REPO / "src") -> dict:
    cmd = [sys.executable, "-m", "dflash_etl", "tokenize", "--run", str(run_dir),
           "--model", str(model), "--force", "--seq-length", "4096"]
    result = timed(cmd, stage_env(src))
    stats = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {"seconds": result["seconds"], "cpu_seconds": result["cpu_seconds"],
            "peak_rss_mb": result["peak_rss_mb"],
            "in_stage_seconds": manifest["stages"]["tokenize"]["seconds"],
            "conversations": stats["rows_in"], "rows_written": stats["rows_written"],
            "tokens": stats["tokens"], "quarantined": stats["rows_quarantined"],
            "filtered": stats["rows_filtered"], "strategies": stats["strategies"],
            # how the stage rendered (older revisions record neither)
            "renders_per_conversation": (round(stats["renders"] / stats["rows_out"], 3)
                                         if stats.get("renders") and stats["rows_out"] else None),
            "render_paths": stats.get("render_paths")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--repeats", type=int, help="stage runs per tokenizer (default 2; 3 "
                        "alternating pairs with --peer)")
    parser.add_argument("--base", help="also run the stage of this git revision, alternating")
    parser.add_argument("--peer", type=Path, metavar="PEER",
                        help="instead: against speculators 0.7.0.2 in PEER (../shared/peer), "
                        "see bench_tokenize_peer.py")
    parser.add_argument("--peer-tokenizer", choices=("chatml-generation-tags", "chatml-plain"),
                        help="with --peer: only this tokenizer")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="with --peer: N processes spinning in Python during every timed "
                        "run of either tool (a busy machine; default 0: quiet)")
    parser.add_argument("--tokenizer", choices=("bpe8k-chatml", "qwen3.6"),
                        help="only this tokenizer (results go to tokenize_N.{json,md})")
    args = parser.parse_args()
    if args.peer:
        import bench_tokenize_peer

        bench_tokenize_peer.main(args.peer.resolve(), args.conversations, args.repeats or 3,
                                 args.peer_tokenizer, args.load)
        return
    args.repeats = args.repeats or 2
    base_src = None
    if args.base:
        base_src = WORK / "base" / "src"
        shutil.rmtree(WORK / "base", ignore_errors=True)
        (WORK / "base").mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base, "src",
                                  "contracts", "expectations"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(WORK / "base")], input=archive, check=True)
    WORK.mkdir(parents=True, exist_ok=True)
    source = WORK / f"sharegpt_{args.conversations}.jsonl"
    if not source.exists():
        make_data(args.conversations, source)
    bpe = WORK / "bpe8k"
    if not (bpe / "tokenizer.json").exists():
        train_bpe(source, bpe)
    run_dir = WORK / f"run_{args.conversations}"
    config = WORK / "bench.toml"
    config.write_text(f'[[sources]]\nname = "sharegpt"\npath = "{source.name}"\n')
    subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config", str(config),
                    "--run", str(run_dir)], check=True, env=stage_env(),
                   stdout=subprocess.DEVNULL)
    results = {"date": dt.date.today().isoformat(), "machine": {
        "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "load_avg_at_start": os.getloadavg()[0]},
        "conversations": args.conversations, "runs": {}}
    results["gate_import_cpu_seconds"] = gate_import_cpu()
    models = {"bpe8k-chatml": bpe}
    if QWEN.is_dir():
        models["qwen3.6"] = QWEN
    if args.tokenizer:
        models = {args.tokenizer: models[args.tokenizer]}
    for name, model in models.items():
        # Raw limit and stage alternate (raw, stage, raw, ..., raw) and the fastest run of each
        # counts: this machine's speed drifts by 2x within minutes, and the fastest run is the
        # one least slowed by whatever else the host runs.
        raws, raws_all, stages, bases = [], [], [], []
        conversations = run_dir / "ingest" / "conversations"
        warm_up()
        if base_src is not None:
            warm_up(base_src)
        for _ in range(args.repeats):
            raws.append(raw_limit(model, conversations))
            raws_all.append(raw_limit_all_cores(model, conversations))
            stages.append(run_stage(run_dir, model))
            if base_src is not None:
                bases.append(run_stage(run_dir, model, base_src))
        raws.append(raw_limit(model, conversations))
        raws_all.append(raw_limit_all_cores(model, conversations))
        raw_all = {**min(raws_all, key=lambda r: r["seconds"]),
                   "all_seconds": [r["seconds"] for r in raws_all]}
        stage = min(stages, key=lambda r: r["seconds"])
        raw = {**min(raws, key=lambda r: r["seconds"]),
               "all_seconds": [r["seconds"] for r in raws]}
        stage["all_seconds"] = [r["seconds"] for r in stages]
        ratio = (stage["conversations"] / stage["seconds"]) / (raw["conversations"] /
                                                                raw["seconds"])
        paired = sorted((raws[k]["seconds"] + raws[k + 1]["seconds"]) / 2 / st["seconds"]
                        for k, st in enumerate(stages))
        results["runs"][name] = {"raw": raw, "stage": stage, "ratio": round(ratio, 3),
                                 "ratio_paired_median": round(paired[len(paired) // 2], 3),
                                 "raw_all_cores": raw_all,
                                 "ratio_all_cores": round(raw_all["seconds"] / stage["seconds"], 3)}
        if bases:
            results["runs"][name]["base"] = {
                "revision": args.base, "all_seconds": [r["seconds"] for r in bases],
                "cpu_seconds": min(r["cpu_seconds"] for r in bases)}
        print(name, json.dumps(results["runs"][name]), flush=True)
    results["machine"]["load_avg_at_end"] = os.getloadavg()[0]
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stem = ("tokenize" if args.conversations == 20000 and not args.tokenizer
            else f"tokenize_{args.conversations}" + (f"_{args.tokenizer}" if args.tokenizer
                                                     else ""))
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    machine = results["machine"]
    lines = [f"# tokenize benchmark ({results['date']}, {os.cpu_count()} cores, 1-min load "
             f"average {machine['load_avg_at_start']:.1f} at start, "
             f"{machine['load_avg_at_end']:.1f} at end)", "",
             f"{args.conversations} synthetic ShareGPT conversations (1-3 turns, 10% system).", "",
             "| tokenizer | raw limit s (all runs) | raw limit conv/s | stage s (all runs) | "
             "stage conv/s (whole process) | ratio (fastest) | ratio (paired median) | "
             "stage conv/s (in-stage time) | stage peak RSS | rows written | tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        raw, st = r["raw"], r["stage"]
        lines.append(f"| {name} | {' / '.join(f'{x:.1f}' for x in raw['all_seconds'])} | "
                     f"{raw['conversations'] / raw['seconds']:.0f} | "
                     f"{' / '.join(f'{x:.1f}' for x in st['all_seconds'])} | "
                     f"{st['conversations'] / st['seconds']:.0f} | {r['ratio']:.2f} | "
                     f"{r['ratio_paired_median']:.2f} | "
                     f"{st['conversations'] / st['in_stage_seconds']:.0f} | "
                     f"{st['peak_rss_mb']:.0f} MB | {st['rows_written']} | {st['tokens']} |")
    lines += ["", "Renders per written conversation (the stage's stats.json): " + "; ".join(
        f"{name} {r['stage'].get('renders_per_conversation')} "
        f"({r['stage'].get('render_paths')})" for name, r in results["runs"].items())]
    if any("base" in r for r in results["runs"].values()):
        lines += ["", f"The stage at {args.base}, alternating with this tree's in the same run:",
                  "", "| tokenizer | stage s at the base (all runs) | this tree (all runs) | "
                  "fastest: base -> this tree | CPU s (fewest): base -> this tree |",
                  "|---|---|---|---|---|"]
        for name, r in results["runs"].items():
            if "base" in r:
                b, st = r["base"], r["stage"]
                lines.append(
                    f"| {name} | {' / '.join(f'{x:.1f}' for x in b['all_seconds'])} | "
                    f"{' / '.join(f'{x:.1f}' for x in st['all_seconds'])} | "
                    f"{min(b['all_seconds']):.1f} -> {st['seconds']:.1f} s | "
                    f"{b['cpu_seconds']:.1f} -> {st['cpu_seconds']:.1f} |")
    cores = os.cpu_count() or 1
    lines += ["", f"Against the raw limit with every core ({cores} spawned processes, each "
              "rendering and encoding its share, one tokenizer thread each; the slowest "
              "process's time), and CPU per conversation:", "",
              "| tokenizer | raw limit, all cores s (all runs) | stage s (fastest) | ratio | "
              "CPU ms/conversation: raw limit (1 process / all cores) | stage (whole process) |",
              "|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        raw, raw_all, st = r["raw"], r["raw_all_cores"], r["stage"]
        lines.append(
            f"| {name} | {' / '.join(f'{x:.1f}' for x in raw_all['all_seconds'])} | "
            f"{st['seconds']:.1f} | **{r['ratio_all_cores']:.2f}** | "
            f"{1000 * raw['cpu_seconds'] / raw['conversations']:.3f} / "
            f"{1000 * raw_all['cpu_seconds'] / raw_all['conversations']:.3f} | "
            f"{1000 * st['cpu_seconds'] / st['conversations']:.3f} |")
    lines += ["", "CPU seconds (user + system; the stage's process tree: its workers, and its "
              "gates' imports: great_expectations alone takes "
              f"{results['gate_import_cpu_seconds']:.1f} s of CPU in a fresh process):", "",
              "| tokenizer | raw limit CPU s (render / batch encode) | stage CPU s | "
              "CPU s the goal allows the stage | of which the raw limit's encode | "
              "left for everything else |",
              "|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        raw, st = r["raw"], r["stage"]
        allowed = cores * raw["seconds"] / 0.75
        encode = raw["encode_cpu_seconds"]
        render = raw["cpu_seconds"] - encode
        lines.append(f"| {name} | {raw['cpu_seconds']:.1f} ({render:.1f} / {encode:.1f}) | "
                     f"{st['cpu_seconds']:.1f} | {allowed:.1f} ({cores} cores x raw s / 0.75) | "
                     f"{encode:.1f} | {allowed - encode:.1f} |")
    lines += ["", "*raw limit*: apply_chat_template to text + batch encode in one process, "
              "imports and tokenizer loading not counted. Raw limit and stage runs alternate; "
              "the fastest of each counts (the machine's speed drifts). *whole process*: "
              "`python -m dflash_etl "
              "tokenize` from start to exit (imports, probe, masks with per-row verification, "
              "writing, contract and suite). *in-stage time*: the stage's own timer in the "
              "manifest (no interpreter start-up or imports). *left for everything else*: "
              "what the goal leaves for interpreter start-up and imports, loading the "
              "tokenizer, the probe, the render-diff's renders (>= 2 per reply), masks, "
              "per-row verification, writing the dataset and the pandera contract, if the stage "
              "kept every core busy from start to exit.", "",
              "Goal (issue 30): ratio >= 0.9 against the one-process raw limit at 200k "
              "Qwen3.6 conversations. Command: `python benchmarks/bench_tokenize.py "
              "[--conversations 200000 --tokenizer qwen3.6]`"]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
