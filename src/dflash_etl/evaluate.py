"""eval: a drafter's acceptance length (tau) against its target on benchmark prompts, as the field
reports it (MT-Bench, GSM8K, HumanEval, or any messages/prompt JSONL; temperature 0).

    dflash-etl eval --run R --bench mt_bench_question.jsonl,gsm8k_test.jsonl [--limit 20]
    dflash-etl eval --drafter DIR --target DIR --bench FILE [--baseline]
    python -m dflash_etl.evaluate ...

Each prompt is rendered with the target's chat template and its generation prompt (in the
thinking mode the run's rows were tokenized in, or `--thinking`), decoded by the same simulated
speculative decoding as train's tau (models/acceptance.py: z-lab's count), and MT-Bench's second
turn follows the target's own first reply, as the benchmark is run. Writes
`<out>/<benchmark>.json` (default out: <run>/eval): tau, per category, the accepted lengths per
verify step, the prompts, the settings and the drafter's and target's identities.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.rundir import now, write_json_atomic
from dflash_etl.io.benchmarks import BenchmarkItem, read_benchmark


def sample_items(items: list[BenchmarkItem], limit: int | None, seed: int) -> list[BenchmarkItem]:
    """`limit` items by a seeded draw, in the benchmark's order; all when no limit."""
    import numpy as np

    if limit is None or limit >= len(items):
        return list(items)
    chosen = np.sort(np.random.default_rng(seed).permutation(len(items))[:limit])
    return [items[k] for k in chosen]


def summarize(name: str, per_prompt: list[dict[str, Any]]) -> dict[str, Any]:
    """tau over the prompts that took a step (mean of per-prompt means, as z-lab averages),
    per category, and the distribution of what each verify step added."""
    stepped = [p for p in per_prompt if p["tau"] is not None]
    steps = [n for p in per_prompt for n in p["accepted"]]
    by_category: dict[str, list[float]] = {}
    for p in stepped:
        by_category.setdefault(p["category"] or "all", []).append(p["tau"])
    return {
        "benchmark": name,
        "tau": round(sum(p["tau"] for p in stepped) / len(stepped), 4) if stepped else 1.0,
        "tau_by_category": {c: round(sum(v) / len(v), 4) for c, v in sorted(by_category.items())},
        "prompts": len(per_prompt), "prompts_with_a_step": len(stepped),
        "verify_steps": len(steps), "tokens": sum(steps),
        "accepted_per_step": {str(k): v for k, v in sorted(Counter(steps).items())},
    }


class Evaluator:
    """A drafter and its target, loaded once, and how prompts are rendered for them."""

    def __init__(self, drafter_dir: Path, target_dir: str, template_kwargs: dict[str, Any],
                 max_new_tokens: int, baseline: bool = False, propose: Any = None,
                 shared: Evaluator | None = None) -> None:
        import torch

        from dflash_etl.models.acceptance import drafter_proposer, eos_token_ids
        from dflash_etl.models.drafter import DFlashDrafter
        from dflash_etl.models.target import Target, TargetSpec
        from dflash_etl.models.tokenizer import load_tokenizer

        drafter = DFlashDrafter.load(drafter_dir)
        if baseline:  # the same drafter before training: its config, seeded initial weights
            torch.manual_seed(0)
            drafter = DFlashDrafter(drafter.config)
        layers = ",".join(map(str, drafter.config.target_layer_ids))
        self.target = shared.target if shared else Target(TargetSpec(model=target_dir,
                                                                     layers=layers))
        self.drafter = drafter.to(self.target.device).eval()
        self.tokenizer = load_tokenizer(target_dir)
        self.kwargs = dict(template_kwargs)
        self.max_new_tokens = max_new_tokens
        self.eos = eos_token_ids(self.target.model)
        self.propose = propose or drafter_proposer(self.target, self.drafter)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from dflash_etl.templates.render import RenderError, render

        try:
            text = render(self.tokenizer, messages, chat_template=None,
                          add_generation_prompt=True, kwargs=self.kwargs)
        except RenderError as exc:
            raise StageError(f"the target's chat template refused a benchmark prompt ({exc}): "
                             "check --thinking and the template") from exc
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def item(self, item: BenchmarkItem) -> dict[str, Any]:
        """Every turn of the item decoded in order, each after the target's own reply to the
        one before; the turns' verify steps pooled into the item's tau."""
        from dflash_etl.models.acceptance import speculative_decode

        messages: list[dict[str, str]] = []
        accepted: list[int] = []
        for turn in item.turns:
            messages.append({"role": "user", "content": turn})
            decoded = speculative_decode(self.target, self.propose, self.prompt_ids(messages),
                                         self.max_new_tokens, self.eos)
            accepted += decoded.accepted
            reply = self.tokenizer.decode(decoded.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
        return {"item": item.item, "category": item.category, "turns": len(item.turns),
                "tau": round(sum(accepted) / len(accepted), 4) if accepted else None,
                "accepted": accepted}


def evaluate(benches: list[str], *, run: str | Path | None = None, drafter: str | None = None,
             target: str | None = None, out: str | Path | None = None, limit: int | None = None,
             max_new_tokens: int = 256, thinking: str = "run", seed: int = 0,
             baseline: bool = False, propose: Any = None) -> dict[str, dict[str, Any]]:
    """tau per benchmark file; writes <out>/<benchmark>.json and returns them by name."""
    drafter_dir, target_dir, kwargs = _resolve(run, drafter, target, thinking)
    out_dir = Path(out) if out else (Path(run) / "eval" if run else None)
    if out_dir is None:
        raise StageError("give --out DIR for the results (or --run R: they go to R/eval)")
    files = [Path(b) for b in benches]
    if not files:
        raise StageError("give --bench FILE[,FILE...]: the benchmark prompt files")
    items = {f.stem: sample_items(read_benchmark(f), limit, seed) for f in files}
    evaluator = Evaluator(drafter_dir, target_dir, kwargs, max_new_tokens, propose=propose)
    base = (Evaluator(drafter_dir, target_dir, kwargs, max_new_tokens, True, shared=evaluator)
            if baseline else None)
    from dflash_etl.models.identity import model_identity

    results = {}
    for f in files:
        name = f.stem
        per_prompt = [evaluator.item(i) for i in items[name]]
        doc = summarize(name, per_prompt)
        if base is not None:
            doc["baseline"] = summarize(name, [base.item(i) for i in items[name]])["tau"]
        doc.update({
            "file": str(f.resolve()),
            "per_prompt": [{k: v for k, v in p.items() if k != "accepted"} for p in per_prompt],
            "settings": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "limit": limit,
                         "seed": seed, "block_size": evaluator.drafter.config.block_size,
                         "template_kwargs": kwargs},
            "drafter": {"dir": str(Path(drafter_dir).resolve()),
                        "identity": model_identity(drafter_dir)},
            "target": {"dir": str(Path(target_dir).resolve()),
                       "identity": model_identity(target_dir)},
            "created_at": now()})
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / f"{name}.json", doc)
        results[name] = doc
    if run is not None and out_dir.resolve() == (Path(run) / "eval").resolve():
        from dflash_etl.report import publish_docs

        publish_docs(run)  # the report's "Acceptance per benchmark" section
    return results


def _run_target(run: Path, train_settings: dict[str, Any]) -> str | None:
    """The target train recorded, or the run's own built target when that path is gone: a
    relative path recorded from another working directory, or a run moved since."""
    recorded = train_settings.get("target")
    if recorded and Path(recorded).is_dir():
        return str(recorded)
    if (run / "target" / "config.json").is_file():
        return str(run / "target")
    if recorded:
        raise StageError(f"train's target {recorded} is not there any more (moved or deleted): "
                         "give it with --target DIR")
    return None


def _resolve(run: str | Path | None, drafter: str | None, target: str | None,
             thinking: str) -> tuple[Path, str, dict[str, Any]]:
    """The drafter directory, the target and the template kwargs: the run's (its trained
    drafter, train's target, the thinking mode tokenize rendered the rows in), or as given."""
    kwargs: dict[str, Any] = {}
    if run is not None:
        from dflash_etl.core.outputs import TokenizedOutput
        from dflash_etl.core.rundir import RunDir

        manifest = RunDir(Path(run)).manifest().get("stages", {})
        if manifest.get("train", {}).get("status") != "complete":
            raise StageError(f"{run} has no complete train stage: run `dflash-etl train --run "
                             f"{run}`, or give --drafter DIR --target DIR")
        drafter = drafter or str(Path(run) / "train" / "drafter")
        target = target or _run_target(Path(run), manifest["train"].get("settings", {}))
        if (Path(run) / "tokenize" / "stats.json").is_file():
            kwargs = TokenizedOutput.read(Path(run) / "tokenize").template_kwargs
    if not drafter or not target:
        raise StageError("give --run R, or --drafter DIR and --target DIR")
    if not (Path(drafter) / "config.json").is_file():
        raise StageError(f"{drafter} holds no drafter (config.json): give train's drafter "
                         "directory")
    if thinking in ("on", "off"):
        kwargs["enable_thinking"] = thinking == "on"
    return Path(drafter), str(target), kwargs


# ---------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--run", default=None, help="a run with a trained drafter (its drafter, "
                   "target and thinking mode); results in <run>/eval")
    p.add_argument("--drafter", default=None, help="a drafter directory (train's)")
    p.add_argument("--target", default=None, help="its target model directory")
    p.add_argument("--bench", required=True, type=lambda s: [x for x in s.split(",") if x],
                   help="benchmark files, comma-separated (MT-Bench, GSM8K, HumanEval, or "
                        "messages/prompt JSONL)")
    p.add_argument("--out", default=None, help="where the <benchmark>.json files go")
    p.add_argument("--limit", type=int, default=None, help="items per benchmark (a seeded draw)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--thinking", choices=("run", "on", "off"), default="run",
                   help="the template's thinking switch (default: as the run's rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true",
                   help="also the untrained drafter's tau (same config, initial weights)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise StageError(f"--limit {args.limit}: give 1 or more items per benchmark")
    if args.max_new_tokens < 1:
        raise StageError(f"--max-new-tokens {args.max_new_tokens}: give 1 or more")
    results = evaluate(args.bench, run=args.run, drafter=args.drafter, target=args.target,
                       out=args.out, limit=args.limit, max_new_tokens=args.max_new_tokens,
                       thinking=args.thinking, seed=args.seed, baseline=args.baseline)
    for name, doc in results.items():
        base = f" (untrained {doc['baseline']:.3f})" if "baseline" in doc else ""
        print(f"eval {name}: tau {doc['tau']:.3f}{base} on {doc['prompts']} prompts, "
              f"{doc['verify_steps']} verify steps", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from dflash_etl.cli.stage import module_main

    return module_main(argv, add_arguments, run_from_args, "python -m dflash_etl.evaluate",
                       __doc__, "eval")


if __name__ == "__main__":
    raise SystemExit(main())
