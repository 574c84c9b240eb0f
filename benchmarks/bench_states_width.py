"""extract --backend server at Qwen3.6-27B width: the states client against a plain copy.

No machine here holds a 27B target, so the dev server answers in its width mode
(`--synthetic-states`: no model; each token's states a seeded pseudo-random row its token id picks,
at a config's width, written as vLLM's connector writes them) for a config-only directory shaped
as Qwen3.6-27B's text model (64 layers, hidden 5120, bf16) beside the Qwen3.6 tokenizer and
template (../shared/fixtures/qwen36-tokenizer). The rows: `--rows` conversations of about
`--tokens` tokens (a prompt and a reply assembled from the fixture conversations, each distinct),
ingested and tokenized with the Qwen3.6 template (seq_length 8192). Then, measured:

1. `extract --plan` through the server (the same client): the bytes it projects;
2. `extract --backend server --dtype bf16`, the server in its own process: wall, the bytes of
   states stored and their MB/s, the client's CPU (this process) and the server's;
3. a plain copy of the same shard files on the same disk (`shutil.copyfile`, no fsync, as the
   stage writes its shards): the MB/s the disk gives for the same bytes;
4. memory bandwidth: numpy copying a 1 GiB buffer (the in-memory part's ceiling).

The client reads each server file (in the page cache: just written) and writes it into shards:
one read and one write per byte, as the copy. Goals (#45): the client >= 0.8x the copy's MB/s,
<= 10% of one core per GB/s (<= 0.1 CPU s per GB), --plan within 10% of the bytes.

    python benchmarks/bench_states_width.py [--rows 80] [--tokens 2000] [--concurrency 2]

Needs ~2 x rows x tokens x 61 KB of free disk (10 GB at the defaults) under benchmarks/work/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "states_width"
FIXTURES = REPO.parent / "shared" / "fixtures"
WIDTH = {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
         "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
         "vocab_size": 248320}


def width_model(out: Path) -> Path:
    """A config-only Qwen3 directory at Qwen3.6-27B's text width, with the Qwen3.6 tokenizer."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(FIXTURES / "qwen36-tokenizer", out, copy_function=shutil.copyfile)
    out.chmod(0o755)  # the fixtures are read-only
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
              "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
              "tie_word_embeddings": False, **WIDTH}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def conversations(n: int, tokens: int, out: Path) -> Path:
    """n distinct ShareGPT conversations of ~`tokens` tokens from the fixtures' message texts."""
    import random

    texts = []
    for path in sorted((FIXTURES / "data").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                texts += _strings(json.loads(line))
    texts = [t for t in texts if len(t) > 40]
    rng = random.Random(0)
    chars = 4 * tokens  # ~4 characters a token in English text
    with out.open("w") as f:
        for i in range(n):
            prompt = f"Question {i}:"  # about a third of the tokens, as chat data has
            while len(prompt) < chars // 3:
                prompt += "\n\n" + rng.choice(texts)
            reply, parts = "", 0
            while len(reply) < chars - len(prompt):
                reply += f"\n\nPart {parts} of answer {i}. " + rng.choice(texts)
                parts += 1
            f.write(json.dumps({"conversations": [{"from": "human", "value": prompt},
                                                  {"from": "gpt", "value": reply}]}) + "\n")
    return out


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def tokenized_run(rows: int, tokens: int, model: Path) -> Path:
    from dflash_etl.stages import ingest, load_config, tokenize

    base = WORK / f"run-{rows}x{tokens}"
    if (base / "tokenize" / "stats.json").exists():
        return base
    shutil.rmtree(base, ignore_errors=True)
    source = conversations(rows, tokens, WORK / f"long-{rows}x{tokens}.jsonl")
    config_path = WORK / "pipeline.toml"
    config_path.write_text(f'[run]\nseed = 0\n\n[[sources]]\nname = "long"\npath = "{source}"\n'
                           f'\n[tokenize]\nmodel = "{model}"\nseq_length = 8192\n')
    config = load_config(config_path)
    ingest.run(config, base, progress=False)
    tokenize.run(config, base, progress=False)
    return base


def start_server(model: Path, layer_ids: list[int], states: Path) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(HERE))
    from bench_extract_server import _free_port, _wait_ready

    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dflash_etl.models.devserver", "--model", str(model), "--port",
         str(port), "--extract-hidden-states", ",".join(map(str, layer_ids)),
         "--synthetic-states", "--states-dir", str(states)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    _wait_ready(url, process)
    return process, url


TARGET_LAYERS = 5  # Qwen3.6-27B's DFlash drafters read 5 target layers


def served_run(model: Path, rows: int, tokens: int, run: Path, states: Path,
               without: tuple[str, ...]) -> tuple[list[int], subprocess.Popen, str]:
    """A copy of the tokenized run at `run` (less the outputs of the stages `without` names)
    and a width-mode server for its layers writing into `states`: (the layers extract's rule
    picks, the server process, its /v1 URL)."""
    from dflash_etl.models.layers import resolve_layers
    from dflash_etl.models.states_server import vllm_layer_ids

    base = tokenized_run(rows, tokens, model)
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run, ignore=shutil.ignore_patterns(*(f"{s}*" for s in without)))
    layers = resolve_layers("auto", str(model), TARGET_LAYERS)
    shutil.rmtree(states, ignore_errors=True)
    process, url = start_server(model, vllm_layer_ids(layers, WIDTH["num_hidden_layers"]),
                                states)
    return layers, process, url


def plain_copy(files: list[Path], into: Path) -> tuple[float, float]:
    """Seconds to copy `files` into `into` (then removed), and the CPU seconds (user + system)
    the copying took: the kernel's work of reading and writing the bytes, which any writer on
    this disk pays too."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    start, cpu0 = time.perf_counter(), cpu()
    for f in files:
        shutil.copyfile(f, into / f.name)
    seconds, cpu_s = time.perf_counter() - start, cpu() - cpu0
    shutil.rmtree(into)
    return seconds, cpu_s


def memory_gb_per_s() -> float:
    import numpy as np

    src = np.ones(1 << 30, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return (1 << 30) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=80)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--format", choices=("native", "speculators"), default="native",
                        help="extract's layout; speculators: the server's row files are moved "
                             "into the output (results/states_width_speculators.*)")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import psutil

    from dflash_etl.stages import extract

    WORK.mkdir(parents=True, exist_ok=True)
    model = width_model(WORK / "qwen36-27b-width")
    run, states = WORK / "run", WORK / "served"
    layers, process, url = served_run(model, args.rows, args.tokens, run, states, ("extract",))
    kw = {"model": str(model), "draft_layers": TARGET_LAYERS, "backend": "server",
          "endpoint": url,
          "states_dir": str(states), "dtype": "bf16", "concurrency": args.concurrency,
          "request_deadline_s": 600.0, "format": args.format}
    try:
        planned = extract.run(None, run, progress=False, plan=True, **kw)
        server, me = psutil.Process(process.pid), psutil.Process()
        server0, client0 = sum(server.cpu_times()[:2]), sum(me.cpu_times()[:2])
        start = time.perf_counter()
        doc = extract.run(None, run, progress=False, **kw)
        wall = time.perf_counter() - start
        server_cpu = sum(server.cpu_times()[:2]) - server0
        client_cpu = sum(me.cpu_times()[:2]) - client0
    finally:
        process.terminate()
        process.wait(30)
    shards = sorted((run / "extract" / "hidden_states").glob("*"))
    stored = sum(f.stat().st_size for f in shards)
    copy_s, copy_cpu = plain_copy(shards, WORK / "copy")
    memory = memory_gb_per_s()
    total = doc["total"]
    tokens = planned["dataset"]["tokens"]
    result = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "disk_free_gb": round(shutil.disk_usage(WORK).free / 1e9, 1)},
        "command": f"python benchmarks/bench_states_width.py --rows {args.rows} --tokens "
                   f"{args.tokens} --concurrency {args.concurrency} --format {args.format}",
        "format": args.format,
        "width": WIDTH, "layers": layers, "stored_layers": len(layers) + 1, "dtype": "bf16",
        "rows": total["rows_out"], "rows_in": total["rows_in"], "tokens": tokens,
        "bytes_per_token": round(stored / tokens), "stored_bytes": stored,
        "extract_wall_s": round(wall, 2), "client_mb_per_s": round(stored / wall / 1e6, 1),
        "copy_s": round(copy_s, 2), "copy_mb_per_s": round(stored / copy_s / 1e6, 1),
        "client_vs_copy": round(copy_s / wall, 3),
        "copy_cpu_s": round(copy_cpu, 2), "copy_cpu_s_per_gb": round(copy_cpu / (stored / 1e9), 3),
        "client_cpu_s": round(client_cpu, 2), "server_cpu_s": round(server_cpu, 2),
        "client_cpu_s_per_gb": round(client_cpu / (stored / 1e9), 3),
        "memory_gb_per_s": round(memory, 2),
        "plan_projected_bytes": planned["projected"]["bytes"],
        "plan_error": round(planned["projected"]["bytes"] / stored - 1, 4)}
    out = HERE / "results"
    stem = "states_width" if args.format == "native" else f"states_width_{args.format}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    r = result
    lines = [
        f"# states at Qwen3.6-27B width through the server path — {r['date']}", "",
        f"{r['machine']['cores']} cores, Python {r['machine']['python']}; command: "
        f"`{r['command']}`. The dev server's width mode (`--synthetic-states`) for a config-only "
        f"Qwen3.6-27B-wide target (64 layers x 5120, bf16), layers {layers} + the last stored "
        f"({r['bytes_per_token']} bytes a token), {args.format} layout; {r['rows']} rows, "
        f"{tokens} tokens, "
        "Qwen3.6 template. The server runs on the same 2 cores (a real one is another machine).",
        "", "| | seconds | MB/s | CPU s | CPU s per GB |", "|---|---:|---:|---:|---:|",
        f"| extract --backend server (the whole stage) | {r['extract_wall_s']} | "
        f"{r['client_mb_per_s']} | {r['client_cpu_s']} (client) | {r['client_cpu_s_per_gb']} |",
        f"| — the server process | | | {r['server_cpu_s']} | |",
        f"| plain copy of the same {stored / 1e9:.2f} GB of shards, same disk | {r['copy_s']} | "
        f"{r['copy_mb_per_s']} | {r['copy_cpu_s']} | {r['copy_cpu_s_per_gb']} |",
        f"| memory copy (numpy, 1 GiB) | | {1000 * r['memory_gb_per_s']:.0f} | | |", "",
        f"Client / copy bandwidth: **{r['client_vs_copy']}x** (goal >= 0.8x). Client CPU: "
        f"**{r['client_cpu_s_per_gb']} s per GB** (goal <= 0.1: 10% of a core per GB/s; the "
        f"plain copy's own: {r['copy_cpu_s_per_gb']}). "
        f"`--plan` projected {r['plan_projected_bytes']} bytes against {stored} written: "
        f"**{100 * r['plan_error']:+.2f}%** (goal within 10%)."]
    from results_page import write_keeping_findings

    write_keeping_findings(out / f"{stem}.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
