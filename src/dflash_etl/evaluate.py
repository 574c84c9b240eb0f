"""eval: a drafter's acceptance length (tau) against its target on benchmark prompts, as the field
reports it (MT-Bench, GSM8K, HumanEval, or any messages/prompt JSONL; temperature 0).

    dflash-etl eval --run R --bench mt_bench_question.jsonl,gsm8k_test.jsonl [--limit 20]
    dflash-etl eval --drafter DIR --target DIR --bench FILE [--baseline]
    dflash-etl eval --run R --server http://HOST:8000/v1 --bench FILE   # and on the deployment
    python -m dflash_etl eval ...

Each prompt is rendered with the target's chat template and its generation prompt (in the
thinking mode the run's rows were tokenized in, or `--thinking`), decoded by the same simulated
speculative decoding as train's tau (models/acceptance.py: z-lab's count), and MT-Bench's second
turn follows the target's own first reply, as the benchmark is run. Writes
`<out>/<benchmark>.json` (default out: <run>/eval): tau, per category, the accepted lengths per
verify step, the prompts, the settings and the drafter's and target's identities.

`--server URL` sends the same prompts to a server that serves the target with the drafter
(vLLM with the `--speculative-config` the export prints) and reads the acceptance from the
server's own counters before and after each benchmark (models/spec_metrics.py): `served.tau` is
the deployment's 1 + accepted / drafts, pooled over verify steps, so it is set beside the
simulator's `tokens_per_step` (also pooled); where they differ for the same drafter, the
deployment is not running what was trained.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import asdict, dataclass
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


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 1.0


def summarize(name: str, per_prompt: list[dict[str, Any]]) -> dict[str, Any]:
    """tau as z-lab's benchmark counts it: the mean over turns (each a request of its own; one
    per item but MT-Bench's two) of each turn's mean accepted length, over the turns that took a
    step; per category; per item (its turns' steps pooled) beside it; and the distribution of
    what each verify step added."""
    turns = [(p["category"], t) for p in per_prompt for t in p["turn_taus"] if t is not None]
    stepped = [p for p in per_prompt if p["tau"] is not None]
    steps = [n for p in per_prompt for n in p["accepted"]]
    by_category: dict[str, list[float]] = {}
    for category, tau in turns:
        by_category.setdefault(category or "all", []).append(tau)
    return {
        "benchmark": name,
        "tau": _mean([t for _, t in turns]),
        "tau_per_item": _mean([p["tau"] for p in stepped]),
        "tau_by_category": {c: _mean(v) for c, v in sorted(by_category.items())},
        "prompts": len(per_prompt), "prompts_with_a_step": len(stepped),
        "turns": sum(p["turns"] for p in per_prompt), "turns_with_a_step": len(turns),
        "verify_steps": len(steps), "tokens": sum(steps),
        # pooled over steps, as a server's counters pool them: the figure to set beside its tau
        "tokens_per_step": round(sum(steps) / len(steps), 4) if steps else 1.0,
        "accepted_per_step": {str(k): v for k, v in sorted(Counter(steps).items())},
        **({"tree": _tree_summary(per_prompt)} if per_prompt and "tree" in per_prompt[0] else {}),
    }


def _tree_summary(per_prompt: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tree budget, as the chain is counted: tau (the mean over turns of each turn's mean),
    tokens per step pooled, and the nodes one verify pass reads per step (the cost side)."""
    out = {}
    for budget in per_prompt[0]["tree"]:
        runs = [p["tree"][budget] for p in per_prompt]
        turns = [t for r in runs for t in r["turn_taus"] if t is not None]
        steps = [n for r in runs for n in r["accepted"]]
        nodes = [n for r in runs for n in r["nodes"]]
        out[budget] = {"tau": _mean(turns), "verify_steps": len(steps),
                       "tokens_per_step": round(sum(steps) / len(steps), 4) if steps else 1.0,
                       "nodes_per_step": round(sum(nodes) / len(nodes), 2) if nodes else 1.0}
    return out


@dataclass(frozen=True)
class Decoding:
    """How every benchmark prompt is decoded, offline and on a server."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy; above: sampled, the speculative-sampling rule
    seed: int = 0  # of the item draw and of the sampling (per item: see Evaluator.item)


class Evaluator:
    """A drafter and its target, loaded once, and how prompts are rendered for them."""

    def __init__(self, drafter_dir: Path, target_dir: str, template_kwargs: dict[str, Any],
                 decoding: Decoding, baseline: bool = False, propose: Any = None,
                 shared: Evaluator | None = None, chat_template: str | None = None,
                 tree_budgets: tuple[int, ...] = ()) -> None:
        import torch

        from dflash_etl.models.acceptance import (
            drafter_logits,
            drafter_proposer,
            eos_token_ids,
        )
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
        self.drafter_dir, self.target_dir = drafter_dir, target_dir
        self.tokenizer = load_tokenizer(target_dir)
        self.kwargs = dict(template_kwargs)
        self.chat_template = chat_template  # None: the target's own
        self.decoding = decoding
        self.eos = eos_token_ids(self.target.model)
        self.propose = propose or drafter_proposer(self.target, self.drafter)
        self.tree_budgets = tree_budgets  # DDTree verification of the same drafter's blocks
        self.block_logits = drafter_logits(self.target, self.drafter)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from dflash_etl.templates.limits import RenderError
        from dflash_etl.templates.render import render

        try:
            text = render(self.tokenizer, messages, chat_template=self.chat_template,
                          add_generation_prompt=True, kwargs=self.kwargs)
        except RenderError as exc:
            raise StageError(f"the target's chat template refused a benchmark prompt ({exc}): "
                             "check --thinking and the template") from exc
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def item(self, item: BenchmarkItem) -> dict[str, Any]:
        """Every turn of the item decoded in order, each after the target's own reply to the
        one before: each turn's tau, and the turns' verify steps pooled into the item's."""
        import zlib

        import torch

        from dflash_etl.models.acceptance import speculative_decode
        from dflash_etl.models.tree_verify import tree_decode

        d = self.decoding
        # per item, so an item's draws do not depend on which others were drawn with it
        generator = torch.Generator(self.target.device).manual_seed(
            d.seed * 1_000_003 + zlib.crc32(item.item.encode()))
        messages: list[dict[str, str]] = []
        accepted: list[int] = []
        turn_taus: list[float | None] = []
        trees: dict[str, dict[str, list[Any]]] = {
            str(b): {"turn_taus": [], "accepted": [], "nodes": []} for b in self.tree_budgets}
        for turn in item.turns:
            messages.append({"role": "user", "content": turn})
            prompt = self.prompt_ids(messages)
            decoded = speculative_decode(self.target, self.propose, prompt,
                                         d.max_new_tokens, self.eos, temperature=d.temperature,
                                         generator=generator)
            for budget, tree in trees.items():  # the same text (lossless): only steps differ
                verified = tree_decode(self.target, self.block_logits, prompt,
                                       d.max_new_tokens, self.eos, int(budget))
                tree["turn_taus"].append(None if verified.tau is None
                                         else round(verified.tau, 4))
                tree["accepted"] += verified.accepted
                tree["nodes"] += verified.nodes
            accepted += decoded.accepted
            turn_taus.append(round(sum(decoded.accepted) / len(decoded.accepted), 4)
                             if decoded.accepted else None)
            reply = self.tokenizer.decode(decoded.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
        return {"item": item.item, "category": item.category, "turns": len(item.turns),
                "tau": round(sum(accepted) / len(accepted), 4) if accepted else None,
                "turn_taus": turn_taus, "accepted": accepted,
                **({"tree": trees} if trees else {})}


class ServedEvaluator:
    """The benchmark prompts sent to a serving deployment of the target with the drafter (the
    fleet client regenerate uses: deadlines, retries), MT-Bench's second turn after the
    server's own first reply; the acceptance read from the server's counters before and
    after, so the figure is the deployment's, not the simulator's."""

    def __init__(self, url: str, served_model: str | None, template_kwargs: dict[str, Any],
                 decoding: Decoding, concurrency: int, deadline_s: float) -> None:
        from dflash_etl.models.generation.fleet import OpenAIBackend
        from dflash_etl.stages.regenerate import RegenerateSettings

        settings = RegenerateSettings(model=url, backend="openai", endpoint=url,
                                      served_model=served_model,
                                      max_new_tokens=decoding.max_new_tokens,
                                      temperature=decoding.temperature, seed=decoding.seed,
                                      concurrency=concurrency,
                                      request_deadline_s=deadline_s,
                                      timeout_s=min(120.0, deadline_s),
                                      # as the rows were rendered: sent as chat_template_kwargs
                                      template_kwargs=dict(template_kwargs))
        self.url, self.deadline_s = url.rstrip("/"), deadline_s
        self.backend = OpenAIBackend(settings)

    def bench(self, items: list[BenchmarkItem]) -> dict[str, Any]:
        from dflash_etl.models.spec_metrics import read_counters, served_acceptance

        model = self.backend.served_model
        before = read_counters(self.url, model, self.deadline_s)
        chats: list[list[dict[str, str]]] = [[] for _ in items]
        failed: list[dict[str, Any]] = []
        tokens = requests = 0
        for turn in range(max((len(i.turns) for i in items), default=0)):
            live = [k for k, i in enumerate(items) if len(i.turns) > turn
                    and not any(f["item"] == i.item for f in failed)]
            asked = [[*chats[k], {"role": "user", "content": items[k].turns[turn]}]
                     for k in live]
            for k, messages, reply in zip(live, asked, self.backend.generate(
                    [(m, None) for m in asked]), strict=True):
                requests += 1
                if reply.error:
                    failed.append({"item": items[k].item, "turn": turn + 1,
                                   "error": reply.error})
                    continue
                tokens += reply.new_tokens
                chats[k] = [*messages, {"role": "assistant", "content": reply.text}]
        if failed and len(failed) == len(items):
            raise StageError(f"{self.url} answered none of {len(items)} benchmark prompts: "
                             f"{failed[0]['error']}")
        doc = served_acceptance(before, read_counters(self.url, model, self.deadline_s), tokens)
        doc.update({"url": self.url, "model": model, "requests": requests, "failed": failed})
        return doc


def evaluate(benches: list[str], *, run: str | Path | None = None, drafter: str | None = None,
             target: str | None = None, out: str | Path | None = None, limit: int | None = None,
             decoding: Decoding = Decoding(), thinking: str = "run", baseline: bool = False,
             propose: Any = None, server: str | None = None,
             served_model: str | None = None, concurrency: int = 8,
             request_deadline_s: float = 600.0,
             tree_budgets: tuple[int, ...] = ()) -> dict[str, dict[str, Any]]:
    """tau per benchmark file, by the simulator (given a drafter: --run or --drafter) and on a
    serving deployment (given --server); writes <out>/<benchmark>.json, returns them by name."""
    local = server is None or run is not None or drafter is not None
    if tree_budgets and decoding.temperature > 0:
        raise StageError("--tree-budget is measured greedy only: DDTree's rule for verifying a "
                         "tree at a temperature is not implemented here; give --temperature 0")
    if tree_budgets and not local:
        raise StageError("--tree-budget measures the drafter offline: give --run or --drafter "
                         "(a server reports only its own chain's counters)")
    if local:
        drafter_dir, target_dir, kwargs = _resolve(run, drafter, target, thinking)
    else:
        drafter_dir, target_dir, kwargs = None, None, _thinking(thinking, {})
    out_dir = Path(out) if out else (Path(run) / "eval" if run else None)
    if out_dir is None:
        raise StageError("give --out DIR for the results (or --run R: they go to R/eval)")
    files = [Path(b) for b in benches]
    if not files:
        raise StageError("give --bench FILE[,FILE...]: the benchmark prompt files")
    items = _benchmark_items(files, limit, decoding.seed)
    template = _rows_template(run, target_dir)
    evaluator = (Evaluator(drafter_dir, target_dir, kwargs, decoding, propose=propose,
                           chat_template=template, tree_budgets=tuple(tree_budgets))
                 if drafter_dir is not None and target_dir is not None else None)
    base = (Evaluator(drafter_dir, target_dir, kwargs, decoding, True, shared=evaluator,
                      chat_template=template)
            if baseline and evaluator is not None else None)
    served = (ServedEvaluator(server, served_model, kwargs, decoding, concurrency,
                              request_deadline_s) if server else None)
    results = {}
    for f in files:
        doc: dict[str, Any] = {"benchmark": f.stem}
        if evaluator is not None:
            doc.update(_offline(evaluator, base, f.stem, items[f.stem]))
        if served is not None:
            doc["served"] = served.bench(items[f.stem])
            if gap := served_gap(doc):
                doc["served"]["below_offline"] = gap
        doc.update({
            "file": str(f.resolve()),
            "settings": {**asdict(decoding), "limit": limit,
                         "chat_template": "the rows'" if template else "the target's",
                         "tree_budgets": list(tree_budgets),
                         "block_size": evaluator.drafter.config.block_size
                         if evaluator else None, "template_kwargs": kwargs},
            "created_at": now()})
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / f"{f.stem}.json", doc)
        results[f.stem] = doc
    if run is not None and out_dir.resolve() == (Path(run) / "eval").resolve():
        from dflash_etl.report import publish_docs

        publish_docs(run)  # the report's "Acceptance per benchmark" section
    return results


def _rows_template(run: str | Path | None, target: str | None) -> str | None:
    """The template tokenize rendered the run's rows with, where it is not the target's own:
    the drafter is measured on the contexts it trained on (and the serve line makes vLLM render
    with it too); said on stderr."""
    if run is None or target is None:
        return None
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.models.serving import rows_template

    template = rows_template(RunDir(Path(run)), target)
    if template.note:
        print(f"eval: {template.note}" + (
            "; prompts are rendered with it, as the serve line of `dflash-etl export --to "
            f"vllm` has the server do ({template.flags.strip()})" if template.text else ""),
              file=sys.stderr, flush=True)
    return template.text


SERVED_GAP = 0.8  # served / offline tokens per step below this: not what was trained is served


def served_gap(doc: dict[str, Any]) -> str | None:
    """Where the server's figure falls far below this drafter's offline one on the same prompts
    (both pooled per step; greedy, they agree to 1e-3 when the deployment serves what was
    trained), what the deployment likely serves differently."""
    if "served" not in doc or "tokens_per_step" not in doc:
        return None
    served, offline = doc["served"]["tau"], doc["tokens_per_step"]
    if served >= SERVED_GAP * offline:
        return None
    return (f"the server's {served:.3f} tokens per step is {1 - served / offline:.0%} below "
            f"this drafter's {offline:.3f} offline on the same prompts: the deployment does not "
            "serve what was trained. Compare its command with the serve line `dflash-etl export "
            "--to vllm` printed: the drafter directory (another or an older drafter), the "
            "target layers it is fed (`target_layer_ids`), the chat template and its thinking "
            "mode (`--default-chat-template-kwargs`: rows rendered with thinking off, served "
            "with it on), the attention (a sliding window, causal within the block), the "
            "target's weights and dtype")


def _benchmark_items(files: list[Path], limit: int | None, seed: int
                     ) -> dict[str, list[BenchmarkItem]]:
    """Each benchmark's items, by its name (the file's stem, which names its results): two
    files of one name, or a file without an item, is an error naming them, not a result that
    is never written or one of tau 1.0 on 0 prompts."""
    names = [f.stem for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise StageError(f"two benchmark files share the name {twice[0]!r} "
                         f"({', '.join(str(f) for f in files if f.stem == twice[0])}): their "
                         "results would go to one <out>/<name>.json; rename one")
    items = {f.stem: sample_items(read_benchmark(f), limit, seed) for f in files}
    for f in files:
        if not items[f.stem]:
            raise StageError(f"{f} holds no benchmark item (an empty file, or no line with a "
                             "prompt, messages or MT-Bench turns): nothing to measure tau on")
    return items


def _offline(evaluator: Evaluator, base: Evaluator | None, name: str,
             items: list[BenchmarkItem]) -> dict[str, Any]:
    """The simulator's figures for one benchmark: tau, per category and per step, the
    untrained drafter's beside it, and which drafter and target they are."""
    from dflash_etl.models.identity import model_identity

    per_prompt = [evaluator.item(i) for i in items]
    doc = summarize(name, per_prompt)
    block = evaluator.drafter.config.block_size
    if not doc["verify_steps"] or not 1 <= doc["tau"] <= block:
        raise StageError(f"{name}: {doc['verify_steps']} verify steps and tau {doc['tau']} over "
                         f"{len(items)} prompts (a drafter of block {block} gives tau in [1, "
                         f"{block}] over at least one step): no figure is written; every "
                         "prompt ended before its first step (raise --max-new-tokens?)")
    if base is not None:
        doc["baseline"] = summarize("", [base.item(i) for i in items])["tau"]
    doc["per_prompt"] = [{**{k: v for k, v in p.items() if k not in ("accepted", "tree")},
                          **({"tree": {b: {"turn_taus": t["turn_taus"]}
                                       for b, t in p["tree"].items()}} if "tree" in p else {})}
                         for p in per_prompt]
    doc["drafter"] = {"dir": str(evaluator.drafter_dir.resolve()),
                      "identity": model_identity(evaluator.drafter_dir)}
    doc["target"] = {"dir": str(Path(evaluator.target_dir).resolve()),
                     "identity": model_identity(evaluator.target_dir)}
    return doc


def _thinking(thinking: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    if thinking in ("on", "off"):
        kwargs["enable_thinking"] = thinking == "on"
    return kwargs


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
        from dflash_etl.core.outputs import DrafterOutput, TokenizedOutput
        from dflash_etl.core.rundir import RunDir

        found = RunDir(Path(run)).published(DrafterOutput)
        if found is None:
            raise StageError(f"{run} has no complete train stage: run `dflash-etl train --run "
                             f"{run}`, or give --drafter DIR --target DIR")
        trained, record = found
        drafter = drafter or str(trained.drafter_dir)
        target = target or _run_target(Path(run), record.settings)
        tokenized = RunDir(Path(run)).published(TokenizedOutput)
        if tokenized is not None:
            kwargs = tokenized[0].template_kwargs
    if not drafter or not target:
        raise StageError("give --run R, or --drafter DIR and --target DIR")
    if not (Path(drafter) / "config.json").is_file():
        raise StageError(f"{drafter} holds no drafter (config.json): give train's drafter "
                         "directory")
    return Path(drafter), str(target), _thinking(thinking, kwargs)


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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (as the field reports tau); above: sampled, drafts accepted "
                        "by the speculative-sampling rule, seeded by --seed")
    p.add_argument("--thinking", choices=("run", "on", "off"), default="run",
                   help="the template's thinking switch (default: as the run's rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true",
                   help="also the untrained drafter's tau (same config, initial weights)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="also (or, without --run/--drafter, only) measure a serving deployment: "
                        "its /v1 URL; the acceptance is read from its vLLM spec-decode counters")
    p.add_argument("--served-model", default=None,
                   help="with --server: the model name (default: the first it lists)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="with --server: requests in flight")
    p.add_argument("--request-deadline-s", type=float, default=600.0,
                   help="with --server: seconds one request (or one /metrics read) may take")
    p.add_argument("--tree-budget", default="", metavar="B[,B...]",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="also measure DDTree verification of the same drafter with at most B "
                        "draft nodes per step (greedy): tau and nodes per step, per budget")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise StageError(f"--limit {args.limit}: give 1 or more items per benchmark")
    if args.max_new_tokens < 1:
        raise StageError(f"--max-new-tokens {args.max_new_tokens}: give 1 or more")
    if args.temperature < 0:
        raise StageError(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if any(b < 1 for b in args.tree_budget or ()):
        raise StageError(f"--tree-budget {args.tree_budget}: each budget is 1 node or more")
    if args.concurrency < 1 or args.request_deadline_s <= 0:
        raise StageError("--concurrency must be 1 or more and --request-deadline-s above 0")
    results = evaluate(args.bench, run=args.run, drafter=args.drafter, target=args.target,
                       out=args.out, limit=args.limit, thinking=args.thinking,
                       decoding=Decoding(args.max_new_tokens, args.temperature, args.seed),
                       baseline=args.baseline,
                       server=args.server, served_model=args.served_model,
                       concurrency=args.concurrency,
                       request_deadline_s=args.request_deadline_s,
                       tree_budgets=tuple(args.tree_budget or ()))
    for name, doc in results.items():
        print(f"eval {name}: " + "; ".join(_summary_parts(doc)), flush=True)
    return 0


def _summary_parts(doc: dict[str, Any]) -> list[str]:
    """Each figure named for what it is: offline tau is a mean of per-turn means (z-lab's
    figure); a server's counters pool every verify step, so its figure is set beside the
    offline one pooled the same way, never beside the mean of means."""
    parts = []
    if "tau" in doc:
        base = f" (untrained {doc['baseline']:.3f})" if "baseline" in doc else ""
        per_item = (f", per item (turns pooled) {doc['tau_per_item']:.3f}"
                    if doc.get("turns", doc["prompts"]) > doc["prompts"] else "")
        parts.append(f"tau {doc['tau']:.3f}{base} (mean over {doc.get('turns_with_a_step')} "
                     f"turns of {doc['prompts']} prompts, as z-lab's benchmark{per_item}); "
                     f"pooled over its {doc['verify_steps']} verify steps "
                     f"{doc['tokens_per_step']:.3f} tokens per step")
    for budget, tree in (doc.get("tree") or {}).items():
        parts.append(f"DDTree of {budget} nodes: tau {tree['tau']:.3f}, "
                     f"{tree['tokens_per_step']:.3f} tokens per step for "
                     f"{tree['nodes_per_step']:.1f} nodes verified per step")
    if "served" in doc:
        served = doc["served"]
        parts.append(f"served: {served['tau']:.3f} tokens per step pooled over "
                     f"{served['drafts']} drafts at {served['url']} (the server's counters; "
                     "compare with the pooled offline figure)"
                     + (f", {len(served['failed'])} requests failed" if served["failed"]
                        else ""))
        if served.get("below_offline"):
            parts.append(f"WARNING: {served['below_offline']}")
        if served.get("other_traffic_tokens"):
            parts.append(f"note: the server generated {served['other_traffic_tokens']} tokens "
                         "for other clients meanwhile, and its counters include them")
    return parts
