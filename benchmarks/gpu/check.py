"""The one-shot GPU check: what only a GPU can show, in one short run, the first thing a lent GPU
machine runs (benchmarks/gpu/check.sh; about 5 minutes on an H200).

    python benchmarks/gpu/check.py --out DIR/gpu_check.json   # on the GPU machine
    python benchmarks/gpu/check.py --cpu --out /tmp/x.json    # the same steps, tiny, on CPU

On random-weight targets built from real configs, cut to a few layers, in bf16 (the project's
tokenizer, data/tokenizer, as their vocabulary: nothing can be fetched there):
  dense   Qwen3-8B's widths (hidden 4096, MLP 12288, 32 heads, 8 KV heads, head_dim 128)
  hybrid  Qwen3.6-27B's widths (hidden 5120, MLP 17408, Gated DeltaNet layers 3 of 4, 24 heads,
          4 KV heads, head_dim 256, 16 key / 48 value linear heads of 128)
it measures
  extract_speed   extract's hooked, batched forward (models/target.Target: the chosen layers,
                  the pass stopped after the last one) against a one-row-at-a-time forward with
                  output_hidden_states (what a plain script does): tokens/s each, the ratio
                  (issue goal >= 3x), peak GPU memory
  server_states   extract's server client (models/states_server.ServerTarget) against the dev
                  server's vLLM extract_hidden_states protocol on the GPU, and against a real
                  `vllm serve` started from the line extract prints where vllm is importable:
                  states equal to the hooks' within bf16 tolerance, no all-zero layer
  regenerate_vllm regenerate's vllm backend on the dense target, where vllm is importable
  nccl_train      two training processes over NCCL, where two GPUs are visible
Steps that cannot run say why (`skipped`); a failing step records its error and the rest go on.
The results file is rewritten after every step, so a run cut short keeps what it measured.
Only torch, transformers, safetensors and httpx are needed (the GPU image has them; polars and
the validation stack are not imported), with PYTHONPATH=src.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizer"
LAYERS = [1, 2]  # ours (0-based decoder layers): extract's chosen layers on the 4-layer cuts
WIDTHS = {
    "dense": {"gpu": {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "head_dim": 128},
              "cpu": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 16}},
    "hybrid": {"gpu": {"hidden_size": 5120, "intermediate_size": 17408,
                       "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                       "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                       "linear_num_key_heads": 16, "linear_num_value_heads": 48},
               "cpu": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                       "linear_num_value_heads": 4}},
}


class Check:
    """Where the run is (CPU dry run or GPU), its work directory and its results so far."""

    def __init__(self, cpu: bool, out: Path, work: Path, deadline_s: float) -> None:
        import torch

        self.torch, self.cpu, self.out = torch, cpu, out
        self.device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
        self.dtype = "fp32" if self.device == "cpu" else "bf16"
        self.work = work  # the targets' weights: never under --out (only results go back)
        self.deadline = time.monotonic() + deadline_s
        self.targets: dict[str, Path] = {}
        self.results: dict[str, Any] = {
            "mode": "cpu dry run" if self.device == "cpu" else "gpu",
            "date": dt.date.today().isoformat(), "machine": _machine(torch), "steps": {}}

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def rows(self, vocab: int, n: int, seed: int = 0) -> list[list[int]]:
        """Seeded random token rows, lengths spread as chat rows are (128 to 2048 on a GPU)."""
        g = self.torch.Generator().manual_seed(seed)
        top = 96 if self.device == "cpu" else 2048
        lengths = self.torch.randint(top // 16, top + 1, (n,), generator=g).tolist()
        return [self.torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=2) + "\n")


def _machine(torch: Any) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "gpu": gpu,
            "gpus": torch.cuda.device_count(), "vllm": _version("vllm"),
            "flash_linear_attention": _version("fla"), "transformers": _version("transformers")}


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "present")
    except Exception:  # absent, or broken on this machine: either way not usable
        return None


# ---------------------------------------------------------------- targets
def build_target(check: Check, kind: str, out: Path) -> Path:
    """A random-weight target of `kind`'s widths, 4 layers, saved with the project tokenizer."""
    torch = check.torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists():
        return out
    vocab_file = json.loads((TOKENIZER / "tokenizer.json").read_text())
    vocab = len(vocab_file["model"]["vocab"]) + len(vocab_file["added_tokens"])
    common = {"vocab_size": -(-vocab // 64) * 64, "num_hidden_layers": 4,
              "tie_word_embeddings": False, **WIDTHS[kind]["cpu" if check.cpu else "gpu"]}
    if kind == "dense":
        config: Any = Qwen3Config(**common)
        cls: Any = Qwen3ForCausalLM
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(layer_types=["linear_attention"] * 3 + ["full_attention"],
                                   **common)
        cls = Qwen3_5ForCausalLM
    torch.manual_seed(0)
    dtype = torch.float32 if check.dtype == "fp32" else torch.bfloat16
    with torch.device(check.device):
        model = cls(config).to(dtype)
    model.save_pretrained(out)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    del model
    return out


def step_targets(check: Check) -> dict[str, Any]:
    out = {}
    for kind in ("dense", "hybrid"):
        check.targets[kind] = build_target(check, kind, check.work / kind)
        config = json.loads((check.targets[kind] / "config.json").read_text())
        out[kind] = {k: config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                "layer_types", "vocab_size")}
    return out


# ---------------------------------------------------------------- extract
def _batches(rows: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Rows by length, packed to `budget` padded tokens a batch (extract's bucketing)."""
    batches: list[list[list[int]]] = []
    for row in sorted(rows, key=len):
        if batches and len(row) * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def step_extract_speed(check: Check) -> dict[str, Any]:
    from dflash_etl.models.target import Target, TargetSpec

    torch, out = check.torch, {}
    budget = 4096 if check.device == "cpu" else 65536
    for kind, target_dir in check.targets.items():
        hooked = Target(TargetSpec(model=str(target_dir), layers=",".join(map(str, LAYERS)),
                                   dtype=check.dtype, device=check.device))
        rows = check.rows(hooked.model.config.vocab_size, 24 if check.cpu else 256)
        tokens = sum(map(len, rows))
        if check.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        hooked.forward(rows[:2])  # warm-up (kernels, allocator)
        check.sync()
        start = time.perf_counter()
        for batch in _batches(rows, budget):
            hooked.forward(batch)
        check.sync()
        batched = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if check.device == "cuda" else None
        del hooked  # its hooks would capture (and stop) the plain forward below
        model = _plain_model(check, target_dir)
        naive_rows = rows[: max(4, len(rows) // 4)]  # the slow loop on a quarter of the rows
        model(input_ids=torch.tensor([naive_rows[0]], device=check.device), use_cache=False)
        check.sync()
        start = time.perf_counter()
        with torch.no_grad():
            for row in naive_rows:
                model(input_ids=torch.tensor([row], device=check.device),
                      output_hidden_states=True, use_cache=False)
        check.sync()
        naive = time.perf_counter() - start
        naive_tps = sum(map(len, naive_rows)) / naive
        out[kind] = {"rows": len(rows), "tokens": tokens, "hooks_tokens_per_s": tokens / batched,
                     "one_row_tokens_per_s": naive_tps, "ratio": tokens / batched / naive_tps,
                     "peak_gpu_gib": peak, "batch_tokens": budget}
        del model
        if check.device == "cuda":
            torch.cuda.empty_cache()
    return out


def _plain_model(check: Check, target_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch = check.torch
    dtype = torch.float32 if check.dtype == "fp32" else torch.bfloat16
    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(
        check.device).eval()


def _compare(check: Check, server_target: Any, hooked: Any, rows: list[list[int]]
             ) -> dict[str, Any]:
    """The server's states against the hooks' for the same rows: the chosen layers and the
    last, the largest difference, all-zero layers, non-finite values."""
    torch = check.torch
    start = time.perf_counter()
    _, served = server_target.forward(rows, extra_layers=(server_target.last_layer,))
    seconds = time.perf_counter() - start
    _, mine = hooked.forward(rows, extra_layers=(hooked.last_layer,))
    failed = [s for s in served if isinstance(s, str)]
    good = [(s, m) for s, m in zip(served, mine) if not isinstance(s, str)]
    diff = max((float((s.float() - m.float()).abs().max()) for s, m in good), default=None)
    zero_layers = sorted({k for s, _ in good for k in range(s.shape[1])
                          if not bool(s[:, k].any())})
    return {"rows": len(rows), "failed_rows": len(failed), "max_abs_diff": diff,
            "zero_layers": zero_layers,
            "nonfinite": any(not bool(torch.isfinite(s.float()).all()) for s, _ in good),
            "tokens_per_s": sum(map(len, rows)) / seconds}


def step_server_states(check: Check) -> dict[str, Any]:
    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import ServerTarget, vllm_layer_ids
    from dflash_etl.models.target import Target, TargetSpec

    out: dict[str, Any] = {}
    for kind, target_dir in check.targets.items():
        hooked = Target(TargetSpec(model=str(target_dir), layers=",".join(map(str, LAYERS)),
                                   dtype=check.dtype, device=check.device))
        rows = check.rows(hooked.model.config.vocab_size, 8, seed=1)
        states_dir = check.work / f"states-{kind}"
        with DevServer(str(target_dir), extract_layers=vllm_layer_ids(LAYERS, hooked.n_layers),
                       states_dir=str(states_dir)) as server:
            client = ServerTarget(_client_settings(check, server.url, states_dir, target_dir),
                                  LAYERS, hooked.n_layers, hooked.hidden)
            out[kind] = {"dev_server": _compare(check, client, hooked, rows)}
        out[kind]["vllm"] = _vllm_states(check, kind, target_dir, hooked, rows)
    return out


def _client_settings(check: Check, url: str, states_dir: Path, target: Path) -> Any:
    """What extract's server client reads of its settings (the fleet client's limits among
    them), without extract's stage module: it imports polars, which the GPU image lacks."""
    return SimpleNamespace(endpoint=url, servers=(url.rstrip("/"),), states_dir=str(states_dir),
                           timeout_s=120.0, request_deadline_s=120.0, cooldown_s=10.0,
                           dtype=check.dtype, concurrency=4, retries=1, served_model=None,
                           model=str(target), keep_server_files=False)


def _vllm_states(check: Check, kind: str, target: Path, hooked: Any,
                 rows: list[list[int]]) -> dict[str, Any]:
    """The same rows through `vllm serve` started exactly as extract prints it."""
    import shlex

    from dflash_etl.models.states_server import ServerTarget, serve_command

    if _version("vllm") is None or check.device != "cuda":
        return {"skipped": "vllm is not importable here (the lent GPU image has none, and its "
                           "wheel is over what the device tool carries)"
                if _version("vllm") is None else "needs a GPU"}
    states_dir = check.work / f"vllm-states-{kind}"
    port = 8765
    line = serve_command(str(target), LAYERS, hooked.n_layers, str(states_dir))
    argv = [*shlex.split(line), "--port", str(port), "--max-model-len", "4096",
            "--gpu-memory-utilization", "0.4"]
    log = (check.work / f"vllm-{kind}.log").open("w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        if not _wait_for(url, min(300.0, check.deadline - time.monotonic()), server):
            return {"command": line, "error": f"no answer from {url}; log: {log.name}",
                    "log_tail": _tail(Path(log.name))}
        client = ServerTarget(_client_settings(check, url, states_dir, target), LAYERS,
                              hooked.n_layers, hooked.hidden)
        return {"command": line, **_compare(check, client, hooked, rows)}
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        server.kill()


def _wait_for(url: str, seconds: float, process: subprocess.Popen) -> bool:
    import httpx

    end = time.monotonic() + seconds
    while time.monotonic() < end and process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                return True
        time.sleep(2)
    return False


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ---------------------------------------------------------------- regenerate, training
def step_regenerate_vllm(check: Check) -> dict[str, Any]:
    if _version("vllm") is None or check.device != "cuda":
        return {"skipped": "needs vllm and a GPU"}
    from dflash_etl.models.generation.local import VLLMBackend
    from dflash_etl.stages.regenerate import RegenerateSettings

    backend = VLLMBackend(RegenerateSettings(model=str(check.targets["dense"]), backend="vllm",
                                             max_new_tokens=64))
    prompts = [([{"role": "user", "content": f"Question {k}: what is {k} + {k}?"}], None)
               for k in range(16)]
    start = time.perf_counter()
    replies = backend.generate(prompts)
    seconds = time.perf_counter() - start
    return {"replies": len(replies), "errors": sum(r.error is not None for r in replies),
            "tokens_per_s": sum(r.new_tokens for r in replies) / seconds}


def step_nccl_train(check: Check) -> dict[str, Any]:
    gpus = check.torch.cuda.device_count() if check.device == "cuda" else 0
    why = (f"{gpus} GPU(s) visible: NCCL needs one GPU per rank (it refuses two ranks on one)"
           if gpus < 2 else "not in this check: it needs an extracted run, so the validation "
           "stack; run `dflash-etl train --launcher torchrun --nproc-per-node 2` on one")
    return {"skipped": why + "; tests/test_train_stage.py trains with two processes over gloo "
                             "on CPU and checks they give one process's drafter"}


STEPS = [("targets", step_targets), ("extract_speed", step_extract_speed),
         ("server_states", step_server_states), ("regenerate_vllm", step_regenerate_vllm),
         ("nccl_train", step_nccl_train)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the dry run: tiny sizes, CPU")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                        "gpu_check.json")
    parser.add_argument("--work", type=Path,
                        default=Path(tempfile.gettempdir()) / "dflash_gpu_check",
                        help="where the targets are built (GBs on a GPU)")
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="steps not started by then are skipped")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    check = Check(args.cpu, args.out, args.work, args.deadline_s)
    for name, step in STEPS:
        if time.monotonic() > check.deadline:
            check.results["steps"][name] = {"skipped": "past --deadline-s"}
            continue
        start = time.perf_counter()
        try:
            result = step(check)
        except Exception as exc:  # a step's failure is its result; the others still run
            result = {"error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        check.results["steps"][name] = result
        print(f"{name}: {json.dumps(result)[:400]}", flush=True)
        check.save()
    heavy = [m for m in ("polars", "pandera", "great_expectations", "datasets")
             if m in sys.modules]
    check.results["imported_heavy_modules"] = heavy  # none: the GPU image lacks them
    check.save()
    print(f"results: {args.out}")
    return 1 if any("error" in r for r in check.results["steps"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
