"""train: our DFlash trainer against speculators' (0.9) on the same run's data, on CPU.

Per seed, both trainers train a drafter from the same extracted hidden states (ours reads the
run's extract output through `Trainer`; speculators reads the run exported to its format by
`dflash_etl.handoff.export`, through its own CLI entry with the export's printed command) for
the same optimizer steps, peak learning rate, warm-up, blocks per step, loss decay, gradient
clip and seed, on the same rows (speculators' training split); then it measures

* tau of both drafters by the same simulator (`models/acceptance.speculative_decode`, greedy
  verification by the target as `evaluate.Evaluator` loads it) on a seeded sample of prompts
  neither trainer saw: the run's held-out conversations (default) or GSM8K + MT-Bench
  (`--prompts-from bench`, rendered as `dflash-etl eval` renders them); theirs drafts with its
  own `DFlashDraftModel` loaded from its checkpoint, with its head (and d2t, for a draft
  vocabulary);
* steps/s of both: the wall time (and CPU time) of the optimizer steps only (batches, forward,
  backward, optimizer), not model loading, validation or checkpoints, each trainer timed
  `--rounds` times per seed in alternating order (ours, theirs, theirs, ours, ...), so a burst
  of other load on a shared machine falls on both sides of each ratio;
* the untrained drafter's tau (our init, the same seed) as the floor.

The goal (the issue's): our tau >= theirs at equal steps, and our steps/s >= 1.5x theirs.

    python benchmarks/bench_trainer_vs_speculators.py [--run runs/default] [--steps 100]
        [--seeds 0,1,2] [--prompts-from held-out|bench] [--bench FILE,FILE] [--prompts 16]
        [--new-tokens 32] [--their-defaults] [--labels data|target] [--ours-only]
        [--out benchmarks/results/trainer_vs_speculators]

`--labels` sets our trainer's `[train] labels` (default: the run's); `--ours-only` trains and
measures ours alone (speculators' figures do not depend on our settings), written as a short
table: e.g. `--ours-only --labels target` against `--ours-only --labels data`
(benchmarks/results/train_labels.md).

The run must be complete through train (`dflash-etl run`); nothing in it is changed: the
export and both trainers' drafters go to benchmarks/work/trainer_vs_speculators/. Results:
benchmarks/results/trainer_vs_speculators.{md,json} (the md's hand-written `## Findings` are
kept). Steps default to 100, not the run's 300: speculators trains at ~2 steps/s on 2 quiet CPU
cores (~0.7 when they are shared), so 3 seeds of both trainers plus tau take ~4 minutes (~10
on a shared machine); `--steps 300` takes ~12.5 minutes on a quiet one, ~30 on a shared one.

speculators on CPU, the smallest patches (only while it trains): its trainer moves the model to
`get_local_rank()` (accelerator 0): patched to return "cpu"; it calls
`torch.accelerator.synchronize()`: patched to a no-op. It runs with `--draft-attn-impl sdpa`
(flex attention and its compiled block mask need a GPU), `--loss-implementation eager` (the
fused losses are Triton kernels), `--num-workers 0` and `--logger ""`; its
`torch.autocast("cuda")` is disabled on a CPU-only machine (a warning), so it trains in fp32, as
ours does. Its checkpoints are bf16 whatever it trained in; they are evaluated in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "trainer_vs_speculators"
EVALSETS = REPO.parent / "shared" / "fixtures" / "evalsets"  # ../shared beside the checkout
BENCHES = f"{EVALSETS / 'gsm8k_test.jsonl'},{EVALSETS / 'mt_bench_question.jsonl'}"
TRAIN_RATIO = 0.9  # speculators' default --train-data-ratio: its first 90% of rows train
DEFAULT_OUT = HERE / "results" / "trainer_vs_speculators"
DEFAULT_STEPS = 100  # 3 seeds of both trainers + tau: ~4 min on 2 quiet cores, ~10 shared


# ---------------------------------------------------------------- the run
def run_settings(run: Path) -> Any:
    """The run's train settings (as its manifest recorded them), its target resolved."""
    from dflash_etl.core.errors import StageError
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.evaluate import _run_target
    from dflash_etl.stages.train import TrainSettings

    stages = RunDir(run).manifest().get("stages", {})
    if stages.get("train", {}).get("status") != "complete":
        raise StageError(f"{run}: no complete train stage; run `dflash-etl run` first")
    recorded = stages["train"]["settings"]
    names = {f.name for f in fields(TrainSettings)}
    settings = TrainSettings(**{k: v for k, v in recorded.items() if k in names})
    return replace(settings, target=_run_target(run, recorded), device="cpu",
                   device_map="none", eval_every=0)


def split_rows(run: Path, split: int
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any, list[dict]]:
    """(our training rows: speculators' training split, dataset rows < `split`, that have
    hidden states and an anchor; the held-out rows: the rest, of conversations the split does
    not train on; the extract output; its index)."""
    from dflash_etl.core.outputs import HiddenStatesOutput, TokenizedOutput
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.models.training.loss import anchor_candidates
    from dflash_etl.stages.train import _load_rows, _read_index

    rd = RunDir(run)
    rows = _load_rows(TokenizedOutput.read(rd.stage_dir("tokenize")), rd)
    extracted = HiddenStatesOutput.read(rd.stage_dir("extract"))
    index = _read_index(extracted.index_file)
    stored = {e["row"] for e in index}
    kept = [r for r in rows if r["row"] < split and r["row"] in stored
            and len(anchor_candidates(r["loss_mask"]))]
    trained = {r["id"] for r in rows[:split]}
    held = [r for r in rows[split:] if r["id"] not in trained]
    return kept, held, extracted, index


def speculators_batches(data: Path, split: int, seq_len: int, seed: int,
                        steps: int) -> tuple[int, float]:
    """(epochs that give `steps` batches, mean rows per batch) of speculators' packing sampler
    over its training split at --total-seq-len `seq_len`."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(str(data)).with_format(None)["seq_len"])[:split]
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=seq_len, lengths=lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    total, epochs, rows = 0, 0, 0
    while total < steps:
        sampler.set_epoch(epochs)
        batches = sampler._generate_batches(epochs)
        total += len(batches)
        rows += sum(len(b) for b in batches)
        epochs += 1
    return epochs, rows / total


# ---------------------------------------------------------------- ours
def train_ours(settings: Any, rows: list[dict[str, Any]], extracted: Any, index: list[dict],
               out: Path) -> dict[str, Any]:
    """Our Trainer, its steps timed; the drafter saved to out/drafter."""
    import numpy as np

    from dflash_etl.models.mask_token import resolve_mask_token
    from dflash_etl.models.training.states import ExtractedStates
    from dflash_etl.models.training.trainer import Trainer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    states = ExtractedStates(extracted.stage_dir, len(extracted.layers), index,
                             hidden_size=extracted.hidden_size,
                             last=settings.labels == "target")
    t2d = None
    if settings.head_vocab == "draft":
        from dflash_etl.core.outputs import TokenizedOutput

        t2d = np.load(TokenizedOutput.read(extracted.stage_dir.parent / "tokenize").t2d_file)
    trainer = Trainer(settings, rows, states, extracted.layers, out, draft_vocab=t2d,
                      mask_token=resolve_mask_token)
    losses, durations = [], []
    start, cpu = time.perf_counter(), time.process_time()
    last = start
    for step in range(settings.steps):
        losses.append(trainer.step(step)["loss"])
        now = time.perf_counter()
        durations.append(now - last)
        last = now
    seconds, cpu = last - start, time.process_time() - cpu
    states.close()
    trainer.drafter.save(out / "drafter")
    return {**_speed(seconds, cpu, durations), "steps": settings.steps,
            "parameters": sum(p.numel() for p in trainer.drafter.parameters()),
            "final_loss": round(float(np.mean(losses[-30:])), 4), "drafter": out / "drafter"}


def _speed(seconds: float, cpu: float, durations: list[float]) -> dict[str, Any]:
    """steps/s over all steps, and by the median step (robust to bursts of other load)."""
    import statistics

    steps = len(durations)
    return {"seconds": round(seconds, 3), "steps": steps,
            "steps_per_s": round(steps / seconds, 3),
            "median_steps_per_s": round(1 / statistics.median(durations), 3),
            "cpu_s_per_step": round(cpu / steps, 4)}


# ---------------------------------------------------------------- speculators'
@contextlib.contextmanager
def speculators_on_cpu(timing: dict[str, Any]) -> Iterator[None]:
    """The smallest patches that let speculators' trainer run on CPU, plus a timer around its
    training epochs (steps only: not its validation epochs or checkpoints) and a tap on the
    training metrics it logs (every --log-freq steps)."""
    import speculators.train.trainer as trainer_module
    import torch

    trainer_class = trainer_module.Trainer
    saved = (trainer_module.get_local_rank, torch.accelerator.synchronize,
             trainer_class.train_epoch, trainer_module.normalize_counted_metrics,
             trainer_class._schedulers_step)
    original_epoch, original_normalize, original_scheduler = saved[2], saved[3], saved[4]
    inside, last = [False], [0.0]

    def timed_epoch(self: Any, epoch: int, **kwargs: Any) -> None:
        before, start, cpu = self.global_step, time.perf_counter(), time.process_time()
        inside[0], last[0] = True, start
        try:
            original_epoch(self, epoch, **kwargs)
        finally:
            inside[0] = False
        timing["seconds"] += time.perf_counter() - start
        timing["cpu_seconds"] += time.process_time() - cpu
        timing["steps"] += self.global_step - before

    def step_end(self: Any) -> None:  # once per optimizer step, after it
        original_scheduler(self)
        now = time.perf_counter()
        timing["durations"].append(now - last[0])
        last[0] = now

    def tapped(metrics: dict[str, float], world_size: int = 1) -> dict[str, float]:
        out = original_normalize(metrics, world_size)
        if inside[0] and "loss" in out:
            timing["losses"].append(float(out["loss"]))
        return out

    trainer_module.get_local_rank = lambda: "cpu"  # its default: accelerator 0
    torch.accelerator.synchronize = lambda *a, **k: None  # no accelerator to wait for
    trainer_class.train_epoch = timed_epoch
    trainer_module.normalize_counted_metrics = tapped
    trainer_class._schedulers_step = step_end
    try:
        yield
    finally:
        (trainer_module.get_local_rank, torch.accelerator.synchronize,
         trainer_class.train_epoch, trainer_module.normalize_counted_metrics,
         trainer_class._schedulers_step) = saved


def _without(argv: list[str], flags: set[str]) -> list[str]:
    """`argv` without these single-valued flags (to be given again)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def speculators_argv(command: str, save: Path, settings: Any, seq_len: int,
                     epochs: int, variant: str) -> list[str]:
    """The export's printed command, with our run's settings where speculators has them.
    `variant` "matched": its optimizer, schedule, lr and loss as ours (AdamW, cosine, CE on the
    target's argmax, fixed exp decay at our gamma); "defaults": its own for each of them (Muon
    + AdamW at lr 1e-3, weight decay 0.01, linear schedule, its default loss, D-PACE)."""
    printed = _without(shlex.split(command)[3:],  # drop `python -m speculators.train`
                       {"--save-path", "--total-seq-len"})
    argv = [*printed, "--save-path", str(save), "--no-resume-from-checkpoint",
            "--max-steps", str(settings.steps), "--epochs", str(epochs),
            "--seed", str(settings.seed),
            "--max-anchors", str(settings.batch_rows * settings.anchors_per_row),
            "--total-seq-len", str(seq_len), "--train-data-ratio", str(TRAIN_RATIO),
            "--log-freq", "10",
            # CPU: no flex attention, no Triton kernels, no worker processes, no logger
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--num-workers", "0", "--logger", ""]
    if settings.arch == "dflash2":  # the run's export printed a DFlash command
        at = argv.index("--speculator-type")
        argv[at + 1] = "dflash2"
        from dflash_etl.models.drafter import DFLASH2_SETTINGS

        for name in (*DFLASH2_SETTINGS, "selector_loss_alpha"):
            argv += [f"--{name.replace('_', '-')}", str(getattr(settings, name))]
    if variant == "matched":  # "defaults": its own optimizer, schedule, lr, loss and weighting
        argv += ["--lr", str(settings.lr), "--optimizer", "adamw",
                 "--weight-decay", str(settings.weight_decay), "--scheduler-type", "cosine",
                 "--scheduler-warmup-steps", str(settings.warmup), "--loss-fn", "ce",
                 "--per-position-loss-weight", "fixed-exp-decay",
                 "--dflash-decay-gamma", str(settings.gamma)]
    return argv


def train_theirs(argv: list[str], save: Path) -> dict[str, Any]:
    """speculators' own CLI entry on the export; returns its steps/s and final checkpoint."""
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    shutil.rmtree(save, ignore_errors=True)
    timing: dict[str, Any] = {"seconds": 0.0, "cpu_seconds": 0.0, "steps": 0, "losses": [],
                              "durations": []}
    with speculators_on_cpu(timing):
        cli.main(TrainConfig.resolve(argv))
    checkpoint = max((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()),
                     key=lambda p: int(p.name))
    tail = timing["losses"][-3:]  # logged every 10 steps: about the last 30
    if len(timing["durations"]) != timing["steps"]:
        raise RuntimeError(f"speculators made {timing['steps']} steps but "
                           f"{len(timing['durations'])} were timed: its trainer changed")
    return {**_speed(timing["seconds"], timing["cpu_seconds"], timing["durations"]),
            "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
            "checkpoint": checkpoint}


def load_speculators_drafter(checkpoint: Path) -> Any:
    """Its checkpoint by its own class (verifier embedding, norm and head reloaded from the
    target, as its loader does), with SDPA attention (flex attention is GPU-only). Its
    checkpointer saves bf16 weights (whatever the training dtype): they are computed in fp32
    here, as ours are."""
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel

    kind = json.loads((checkpoint / "config.json").read_text())["speculators_model_type"]
    config_class, model_class = ((DFlash2SpeculatorConfig, DFlash2DraftModel)
                                 if kind == "dflash2" else
                                 (DFlashSpeculatorConfig, DFlashDraftModel))
    config = config_class.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = "sdpa"
    return model_class.from_pretrained(str(checkpoint), config=config).float().eval()


def speculators_proposer(model: Any) -> Callable[[Any, list[int], int], list[int]]:
    """A block proposal by speculators' drafter, as vLLM's DFlash drafts: the target's states
    before the anchor become every layer's extra keys and values (`fc`, `hidden_norm`), the block
    (anchor, then mask tokens) attends to them and to itself (full attention), its own
    draft-vocabulary head picks each position's token and d2t maps it to a target id
    (target id = draft id + d2t[draft id]); a DFlash2 drafter's own candidate selector picks
    the greedy path instead, one position at a time (its `select`, as z-lab decodes)."""
    import torch

    block, mask = model.block_size, model.mask_token_id
    d2t = model.d2t
    selector = getattr(model, "candidate_selector", None)

    def propose(context: Any, seq: list[int], room: int) -> list[int]:
        drafts = max(0, min(block - 1, room))
        if not drafts:
            return []
        with torch.no_grad():
            ids = torch.tensor([[seq[-1]] + [mask] * drafts])
            ctx = context.reshape(1, context.shape[0], -1).float()
            target_hidden = model.hidden_norm(model.fc(ctx))
            x = model.embed_tokens(ids)
            positions = torch.cat([torch.arange(ctx.shape[1]),
                                   len(seq) - 1 + torch.arange(drafts + 1)])[None]
            embeddings = model.rotary_emb(x, positions)
            for layer in model.layers:
                x = layer(hidden_states=x, target_hidden=target_hidden, attention_mask=None,
                          position_ids=positions, position_embeddings=embeddings)
            states = model.norm(x)[0, 1:]
            logits = model.lm_head(states)
            if selector is not None:
                chosen, before = [], torch.tensor([seq[-1]])
                for p in range(drafts):
                    ids, scores = selector.select(logits[p:p + 1], states[p:p + 1], before)
                    before = ids[0, scores[0].argmax()][None]
                    chosen.append(int(before))
                return chosen
            picked = logits.argmax(-1)
            if d2t is not None:
                picked = picked + d2t[picked]
        return picked.tolist()

    return propose


# ---------------------------------------------------------------- tau
class TauBench:
    """The target (loaded once, as `dflash-etl eval` loads it) and the prompts; tau of any
    proposer. Prompts: the run's own held-out conversations (speculators' validation rows,
    neither trainer trains on them: their prompt before the first reply token, as train's tau),
    or the GSM8K and MT-Bench files rendered as `dflash-etl eval` renders them."""

    def __init__(self, run: Path, drafter_dir: Path, source: str, prompts: int,
                 new_tokens: int, held: list[dict[str, Any]], benches: list[Path]) -> None:
        import numpy as np

        from dflash_etl.evaluate import Evaluator, _resolve, sample_items
        from dflash_etl.io.benchmarks import read_benchmark
        from dflash_etl.models.training.evaluation import eval_prompt

        _, target, kwargs = _resolve(run, None, None, "run")
        self.target_dir, self.kwargs, self.new_tokens = target, kwargs, new_tokens
        self.decoding = _greedy(new_tokens)
        self.base = Evaluator(drafter_dir, target, kwargs, self.decoding)
        self.items: list[Any] = []
        self.prompts: list[list[int]] = []
        if source == "bench":
            per_file = [prompts // len(benches) + (k < prompts % len(benches))
                        for k in range(len(benches))]
            self.items = [i for f, n in zip(benches, per_file, strict=True)
                          for i in sample_items(read_benchmark(f), n, 0)]
        else:
            found = [p for p in (eval_prompt(r["input_ids"], r["loss_mask"]) for r in held)
                     if p]
            chosen = np.sort(np.random.default_rng(0).permutation(len(found))[:prompts])
            self.prompts = [found[k] for k in chosen]

    def ours(self, drafter: Any) -> Any:
        """Our drafter's proposal (acceptance.drafter_proposer) against this target."""
        from dflash_etl.models.acceptance import drafter_proposer

        return drafter_proposer(self.base.target, drafter.eval())

    def tau(self, propose: Any) -> float:
        """Mean tau per prompt (per item: its turns pooled), as `dflash-etl eval` and train's
        tau average; a prompt whose text ended before a step is left out."""
        from dflash_etl.evaluate import Evaluator, summarize
        from dflash_etl.models.acceptance import speculative_decode

        if self.items:
            evaluator = Evaluator(self.base.drafter_dir, self.target_dir, self.kwargs,
                                  self.decoding, propose=propose, shared=self.base)
            return summarize("", [evaluator.item(i) for i in self.items])["tau"]
        taus = [speculative_decode(self.base.target, propose, p, self.new_tokens,
                                   self.base.eos).tau for p in self.prompts]
        stepped = [t for t in taus if t is not None]
        return round(sum(stepped) / len(stepped), 4) if stepped else 1.0


def _greedy(new_tokens: int) -> Any:
    """Evaluator's decoding settings: greedy, `new_tokens` per turn."""
    from dflash_etl.evaluate import Decoding

    return Decoding(max_new_tokens=new_tokens, temperature=0.0, seed=0)


def untrained(drafter_dir: Path, seed: int) -> Any:
    """Our drafter of this config before training, initialised as our trainer does."""
    import torch

    from dflash_etl.models.drafter import DFlashDrafter

    torch.manual_seed(seed)
    return DFlashDrafter(DFlashDrafter.load(drafter_dir).config)


# ---------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=REPO / "runs" / "default")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="optimizer steps of each trainer (default: %(default)s; 0: the "
                             "run's train steps)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--prompts-from", choices=("held-out", "bench"), default="held-out",
                        help="tau's prompts: the run's held-out conversations (speculators' "
                             "validation rows), or GSM8K + MT-Bench")
    parser.add_argument("--bench", default=BENCHES, help="--prompts-from bench: the "
                        "benchmark files, comma-separated (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts for tau (a seeded "
                        "sample; bench: half GSM8K, half MT-Bench)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per turn")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where the results go: OUT.md and OUT.json (default: %(default)s)")
    parser.add_argument("--labels", choices=("data", "target"),
                        help="our trainer's [train] labels (default: the run's setting)")
    parser.add_argument("--ours-only", action="store_true",
                        help="train and measure our trainer only (e.g. one [train] setting "
                             "against another: speculators' figures do not change with ours)")
    parser.add_argument("--their-defaults", action="store_true",
                        help="also train speculators under its own defaults (Muon + AdamW, "
                             "lr 1e-3, linear schedule, its loss, D-PACE weighting)")
    parser.add_argument("--ours-target", action="store_true",
                        help="also train ours with labels = target: the target-head pass "
                             "speculators makes every step, for a like-for-like speed")
    parser.add_argument("--arch", choices=("dflash", "dflash2"),
                        help="the drafter both trainers train (default: the run's); dflash2 "
                             "also trains ours as DFlash at equal steps and at DFlash2's wall "
                             "time (what the extra parameters buy)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each trainer is timed per seed, in alternating order, so "
                             "other load falls on both (tau: the first round's drafters)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dflash_etl.handoff.export import export
    from dflash_etl.models.drafter import DFlashDrafter

    clock = time.perf_counter()
    run = args.run.resolve()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = run_settings(run)
    if args.steps:
        base = replace(base, steps=args.steps)  # the run's warm-up rule (default: 4%)
    if args.labels:
        base = replace(base, labels=args.labels)
    if args.arch:
        base = replace(base, arch=args.arch)
    data = WORK / "speculators-data"
    doc = export(run, "speculators", data, progress=False)
    split = int(doc["rows_in"] * TRAIN_RATIO)
    rows, held, extracted, index = split_rows(run, split)
    lengths = [len(r["input_ids"]) for r in rows]
    # a speculators batch is one packed sequence: ~batch_rows of these rows, the same tokens
    seq_len = max(max(lengths), round(base.batch_rows * sum(lengths) / len(lengths)))
    bench = TauBench(run, run / "train" / "drafter", args.prompts_from, args.prompts,
                     args.new_tokens, held, [Path(f) for f in args.bench.split(",") if f])
    variants = [] if args.ours_only else ["matched",
                                          *(["defaults"] if args.their_defaults else [])]
    # ours again with the target's labels: the head pass theirs makes every step (like for like)
    ours = ["ours", *(["ours_target"] if args.ours_target and base.labels != "target" else []),
            *(["ours_dflash"] if base.arch == "dflash2" else [])]
    contenders = [*ours, *(f"theirs_{v}" for v in variants)]
    print(f"export, rows, target: {time.perf_counter() - clock:.0f} s", flush=True)
    results = []
    for seed in seeds:
        settings = replace(base, seed=seed)
        lap = _Lap()
        row: dict[str, Any] = {"seed": seed, "rounds": []}
        # round 0 trains each contender once (tau measured); later rounds time them again in
        # alternating order, so a burst of load falls on both sides of every ratio
        for round_no in range(args.rounds):
            order = contenders if round_no % 2 == 0 else contenders[::-1]
            if round_no == 0 and "ours_dflash" in contenders:  # after ours and ours_dflash
                order = [*order, "ours_dflash_time"]
            speeds: dict[str, float] = {}
            for name in order:
                if name.startswith("ours"):
                    got = train_ours(_our_variant(settings, name, row), rows, extracted, index,
                                     WORK / f"{name}-{seed}")
                    lap(f"{name} round {round_no}")
                    if round_no == 0:
                        got["tau"] = bench.tau(bench.ours(DFlashDrafter.load(got["drafter"])))
                        if name == "ours":
                            row["tau_untrained"] = bench.tau(
                                bench.ours(untrained(got["drafter"], seed)))
                else:
                    variant = name.removeprefix("theirs_")
                    epochs, per_batch = speculators_batches(data, split, seq_len, seed,
                                                            settings.steps)
                    save = WORK / f"{name}-{seed}"
                    argv = speculators_argv(doc["command"], save, settings, seq_len, epochs,
                                            variant)
                    got = train_theirs(argv, save)
                    lap(f"{name} round {round_no}")
                    if round_no == 0:
                        model = load_speculators_drafter(got["checkpoint"])
                        got.update(tau=bench.tau(speculators_proposer(model)),
                                   rows_per_batch=round(per_batch, 2), epochs=epochs,
                                   argv=argv)
                if round_no == 0:
                    row[name] = _public(got)
                    lap(f"tau {name}")
                if name != "ours_dflash_time":  # its steps differ: not a speed contender
                    speeds[name] = got["median_steps_per_s"]
            row["rounds"].append(speeds)
        row["wall_s"] = lap.seconds
        results.append(row)
        print(f"seed {seed}: {json.dumps(_brief(row))} ({time.perf_counter() - clock:.0f} s)",
              flush=True)
    if args.ours_only:
        write_ours(args, base, results, time.perf_counter() - clock)
        return
    write_results(args, run, base, doc, rows, seq_len, results, variants,
                  time.perf_counter() - clock, bench.prompts or bench.items)


def _our_variant(settings: Any, name: str, row: dict[str, Any]) -> Any:
    """Our trainer's settings for a contender: ours; ours with the target's labels; ours as
    DFlash at equal steps; ours as DFlash for as many steps as DFlash2's wall time buys
    (from both's round-0 speeds in `row`)."""
    if name == "ours_target":
        return replace(settings, labels="target")
    if name == "ours_dflash":
        return replace(settings, arch="dflash")
    if name == "ours_dflash_time":
        ratio = row["ours_dflash"]["median_steps_per_s"] / row["ours"]["median_steps_per_s"]
        return replace(settings, arch="dflash", steps=max(1, round(settings.steps * ratio)))
    return settings


class _Lap:
    """Wall seconds per phase, in one dict."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, name: str) -> dict[str, float]:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.last, 1)
        self.last = now
        return self.seconds


PROMPTS = {"held-out": "the run's held-out conversations: speculators' validation rows, the "
                       "prompt before their first reply token, as train's tau",
           "bench": "half GSM8K, half MT-Bench with its two turns, rendered as `dflash-etl "
                    "eval` renders them"}


def _shown(path: Path) -> str:
    """A path as the command line gives it: relative to the repository where inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in doc.items()}


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("tau", "steps_per_s", "median_steps_per_s", "cpu_s_per_step", "final_loss")
    return {k: ({f: v[f] for f in keep if f in v} if k.startswith(("ours", "theirs")) else v)
            for k, v in row.items()}


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3)


def settings_table(v: dict[str, Any]) -> list[str]:
    """The settings of both trainers, side by side: which are matched, which cannot be, and
    whom each difference favours (in tau at equal steps, or in speed)."""
    full = v["head_vocab"] != "draft"
    rows = [
        ("steps", f"{v['steps']}",
         f"`--max-steps {v['steps']}`, `--epochs` enough of its packed batches", "yes", "-"),
        ("peak lr", f"{v['lr']}", f"`--lr {v['lr']}` (its default 1e-3)", "yes", "-"),
        ("optimizer", f"AdamW, weight decay {v['wd']}",
         f"`--optimizer adamw --weight-decay {v['wd']}` (its defaults: Muon + AdamW, 0.01)",
         "yes", "-"),
        ("warm-up", f"{v['warmup']} steps, linear from lr/{v['warmup']}",
         f"`--scheduler-warmup-steps {v['warmup']}` (its default 1%), linear from 0",
         "yes (its ramp starts one step lower)", "-"),
        ("decay", "cosine to 10% of the peak",
         "`--scheduler-type cosine`: cosine to 0 (its default: linear to 0)",
         "**no**: it has no floor setting", "ours in tau (it still learns in the last steps)"),
        ("seed", "`seed`: init, rows, anchors", "`--seed`: init, packing order, anchors",
         "same value; the draws differ", "-"),
        ("blocks per step", f"{v['rows']} rows x {v['apr']} anchors = {v['anchors']}",
         f"`--max-anchors {v['anchors']}` in one packed sequence, `--total-seq-len "
         f"{v['seq_len']}` (~{v['per_batch']:.1f} rows)",
         "blocks and tokens yes; it has no rows-per-batch flag (it packs)", "-"),
        ("anchors", f"<= {v['apr']} per row: token and successor supervised",
         f"{v['anchors']} per packed batch: any supervised token (not the last "
         f"{v['block']} of the sequence)", "**no**: per batch, not per row", "unmeasured"),
        ("block size", f"{v['block']}", f"`--block-size {v['block']}`", "yes", "-"),
        ("loss labels", "the **target's argmax** at anchor+k (`labels = target`: the stored "
         "last-layer states through the target's norm and head)" if v["labels"] == "target"
         else "the **data token** at anchor+k (`labels = data`)",
         "`--loss-fn ce`: the **target's argmax** at anchor+k (its stored last-layer states "
         "through the target's norm and head)", "yes" if v["labels"] == "target" else "**no**",
         "-" if v["labels"] == "target" else "ours in speed (no target-head pass per step; "
         "the `ours, labels = target` row removes it)"),
        ("loss weights", f"exp(-(k-1)/{v['gamma']}) / the batch's weight total",
         f"`--per-position-loss-weight fixed-exp-decay --dflash-decay-gamma {v['gamma']}` "
         "(its default: D-PACE) / the supervised count", "decay yes; normaliser no", "-"),
        ("LM head", f"the target's, frozen, `head_vocab = {v['head_vocab']}`",
         "the target's, frozen, full vocabulary (the export's command gives no "
         "`--draft-vocab-size`)" if full else
         f"the target's rows of the {v['draft_vocab']}-token draft vocabulary (t2d), frozen",
         "yes", "-"),
        ("grad clip", f"{v['clip']}", "1.0 (fixed)", "yes" if v["clip"] == 1.0 else "no", "-"),
        ("precision", "fp32; saved fp32",
         "fp32 (`--hidden-states-dtype float32`, its autocast off on CPU); **saved bf16**",
         "training yes; saved weights no", "ours in tau, slightly (its weights rounded)"),
        ("data", f"speculators' train split (first {v['ratio']:.0%}), rows with an anchor: "
         f"{v['train_rows']}", f"`--train-data-ratio {v['ratio']}`", "yes", "-"),
        ("attention", "full, bidirectional in the block",
         "`--full-attention-indices` every layer, `--draft-attn-impl sdpa`", "yes", "-"),
    ]
    return ["## Settings", "",
            "| setting | ours | speculators | matched | favours |", "|---|---|---|---|---|",
            *(f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows)]


def interleaved(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each contender's steps/s over every round of every seed (median, min, max), and each
    other contender's speed against speculators' matched one, as the median of the per-round
    ratios: the two ran minutes apart, so the load they met is about the same."""
    import statistics

    names = list(results[0]["rounds"][0])
    rounds = [r for row in results for r in row["rounds"]]
    doc: dict[str, Any] = {"rounds": len(rounds), "steps_per_s": {}, "ratio_to_theirs": {}}
    for name in names:
        speeds = [r[name] for r in rounds]
        doc["steps_per_s"][name] = {"median": round(statistics.median(speeds), 3),
                                    "min": round(min(speeds), 3),
                                    "max": round(max(speeds), 3)}
        if "theirs_matched" in names and name != "theirs_matched":
            ratios = [r[name] / r["theirs_matched"] for r in rounds]
            doc["ratio_to_theirs"][name] = {"median": round(statistics.median(ratios), 2),
                                            "min": round(min(ratios), 2),
                                            "max": round(max(ratios), 2)}
    return doc


CLASSES = {"dflash": "DFlashDraftModel",
           "dflash2": "DFlash2DraftModel, its candidate selector choosing the drafts"}
NAMES = {"ours": "ours", "ours_target": "ours, labels = target",
         "theirs_matched": "speculators, matched", "theirs_defaults": "speculators, its defaults"}


def speed_table(speeds: dict[str, Any]) -> list[str]:
    lines = ["## Speed, interleaved", "",
             f"steps/s by the median step of each training, over {speeds['rounds']} trainings "
             "per contender (each seed's rounds in alternating order); the ratio is the median "
             "of the per-round ratios to speculators' matched run, whose neighbours in time "
             "met the same load.", "",
             "| trainer | steps/s (median) | min | max | x speculators, matched (median) | "
             "min | max |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, v in speeds["steps_per_s"].items():
        r = speeds["ratio_to_theirs"].get(name)
        ratio = f"{r['median']:.2f}x | {r['min']:.2f}x | {r['max']:.2f}x" if r else "1 | | "
        lines.append(f"| {NAMES.get(name, name)} | {v['median']:.2f} | {v['min']:.2f} | "
                     f"{v['max']:.2f} | {ratio} |")
    return [*lines, ""]


def arch_table(results: list[dict[str, Any]], settings: Any) -> list[str]:
    """--arch dflash2: ours as DFlash2 against ours as DFlash at equal steps and at DFlash2's
    wall time (round 0 of each seed)."""
    if "ours_dflash" not in results[0]:
        return []
    lines = ["## DFlash2 against DFlash (ours)", "",
             f"The same rows, seed and settings; DFlash at {settings.steps} steps (equal steps) "
             "and at the steps DFlash2's wall time buys it (DFlash2's steps x the speed ratio of "
             "the seed's first round).", "",
             "| seed | DFlash2 tau | DFlash tau, equal steps | DFlash tau, equal time (steps) "
             "| DFlash2 steps/s | DFlash steps/s | DFlash2 parameters / DFlash's |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        two, one, timed = r["ours"], r["ours_dflash"], r["ours_dflash_time"]
        lines.append(f"| {r['seed']} | {two['tau']:.3f} | {one['tau']:.3f} | "
                     f"{timed['tau']:.3f} ({timed['steps']}) | "
                     f"{two['median_steps_per_s']:.2f} | {one['median_steps_per_s']:.2f} | "
                     f"{two['parameters'] / one['parameters']:.2f} |")
    mean = {k: _mean([r[k]["tau"] for r in results])
            for k in ("ours", "ours_dflash", "ours_dflash_time")}
    return [*lines, f"| **mean** | {mean['ours']:.3f} | {mean['ours_dflash']:.3f} | "
                    f"{mean['ours_dflash_time']:.3f} | | | |", ""]


def write_ours(args: argparse.Namespace, settings: Any, results: list[dict[str, Any]],
               seconds: float) -> None:
    """--ours-only: OUT.json and a short OUT.md, our trainer's tau and speed per seed."""
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = (f"python benchmarks/bench_trainer_vs_speculators.py --run {_shown(args.run)} "
               f"--steps {settings.steps} --seeds {args.seeds} --prompts-from "
               f"{args.prompts_from} --prompts {args.prompts} --new-tokens {args.new_tokens} "
               f"--ours-only --labels {settings.labels} --out {_shown(args.out)}")
    ours = [r["ours"] for r in results]
    summary = {"ours_tau": _mean([o["tau"] for o in ours]),
               "tau_untrained": _mean([r["tau_untrained"] for r in results]),
               "ours_steps_per_s": _mean([o["median_steps_per_s"] for o in ours])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"date": date, "command": command, "seconds": round(seconds, 1),
         "labels": settings.labels, "head_vocab": settings.head_vocab, "steps": settings.steps,
         "summary": summary, "seeds": results}, indent=2) + "\n")
    lines = [f"# our trainer, labels = {settings.labels} — {date}", "",
             f"Command: `{command}` ({seconds / 60:.1f} min).", "",
             "| seed | our tau | untrained tau | our steps/s | final loss |",
             "|---|---:|---:|---:|---:|",
             *(f"| {r['seed']} | {o['tau']:.3f} | {r['tau_untrained']:.3f} | "
               f"{o['median_steps_per_s']:.2f} | {o['final_loss']} |"
               for r, o in zip(results, ours, strict=True)),
             f"| **mean** | {summary['ours_tau']:.3f} | {summary['tau_untrained']:.3f} | "
             f"{summary['ours_steps_per_s']:.2f} | |", ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def write_results(args: argparse.Namespace, run: Path, settings: Any, doc: dict[str, Any],
                  rows: list[dict[str, Any]], seq_len: int, results: list[dict[str, Any]],
                  variants: list[str], seconds: float, bench_prompts: list[Any]) -> None:
    """OUT.json and OUT.md (default benchmarks/results/trainer_vs_speculators; the md's
    hand-written `## Findings` section is kept)."""
    from importlib.metadata import version

    import torch

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    anchors = settings.batch_rows * settings.anchors_per_row
    ours = [r["ours"] for r in results]
    theirs = [r["theirs_matched"] for r in results]
    summary = {
        "ours_tau": _mean([o["tau"] for o in ours]),
        "theirs_tau": _mean([t["tau"] for t in theirs]),
        "tau_untrained": _mean([r["tau_untrained"] for r in results]),
        "ours_steps_per_s": _mean([o["median_steps_per_s"] for o in ours]),
        "theirs_steps_per_s": _mean([t["median_steps_per_s"] for t in theirs]),
        "ours_steps_per_s_all": _mean([o["steps_per_s"] for o in ours]),
        "theirs_steps_per_s_all": _mean([t["steps_per_s"] for t in theirs]),
        "ours_cpu_s_per_step": _mean([o["cpu_s_per_step"] for o in ours]),
        "theirs_cpu_s_per_step": _mean([t["cpu_s_per_step"] for t in theirs])}
    speeds = interleaved(results)
    # the speed goal is judged on the interleaved ratio; round 0's alone is kept beside it
    summary["speed_ratio_round0"] = round(summary["ours_steps_per_s"]
                                          / summary["theirs_steps_per_s"], 2)
    summary["speed_ratio"] = speeds["ratio_to_theirs"]["ours"]["median"]
    if "ours_target" in results[0]:
        summary["ours_target_tau"] = _mean([r["ours_target"]["tau"] for r in results])
        summary["ours_target_speed_ratio"] = speeds["ratio_to_theirs"]["ours_target"]["median"]
    summary["cpu_ratio"] = round(summary["theirs_cpu_s_per_step"]
                                 / summary["ours_cpu_s_per_step"], 2)
    summary["goal_tau"] = summary["ours_tau"] >= summary["theirs_tau"]
    summary["goal_speed"] = summary["speed_ratio"] >= 1.5
    if "defaults" in variants:
        summary["theirs_defaults_tau"] = _mean([r["theirs_defaults"]["tau"] for r in results])
    if "ours_dflash" in results[0]:
        summary["ours_dflash_tau"] = _mean([r["ours_dflash"]["tau"] for r in results])
        summary["ours_dflash_time_tau"] = _mean([r["ours_dflash_time"]["tau"] for r in results])
        summary["ours_dflash_speed_ratio"] = speeds["ratio_to_theirs"]["ours_dflash"]["median"]
    command = (f"python benchmarks/bench_trainer_vs_speculators.py --run {_shown(args.run)} "
               f"--steps {settings.steps} --seeds {args.seeds} --prompts-from "
               f"{args.prompts_from} --prompts {args.prompts} --new-tokens {args.new_tokens}"
               + (" --their-defaults" if args.their_defaults else "")
               + (" --ours-target" if args.ours_target else "")
               + f" --rounds {args.rounds}"
               + (f" --arch {args.arch}" if args.arch else "")
               + (f" --labels {args.labels}" if args.labels else "")
               + ("" if args.out == DEFAULT_OUT else f" --out {_shown(args.out)}"))
    per_batch = _mean([t["rows_per_batch"] for t in theirs])
    result = {
        "date": date, "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                  "torch": torch.__version__,
                                  "speculators": version("speculators")},
        "command": command, "seconds": round(seconds, 1), "run": str(run),
        "steps": settings.steps, "lr": settings.lr, "warmup": settings.warmup,
        "batch_rows": settings.batch_rows, "anchors_per_row": settings.anchors_per_row,
        "max_anchors": anchors, "total_seq_len": seq_len, "rows_per_batch": per_batch,
        "block_size": settings.block_size, "gamma": settings.gamma,
        "head_vocab": settings.head_vocab, "draft_vocab_size": doc["draft_vocab_size"],
        "labels": settings.labels,
        "train_rows": len(rows), "prompts": args.prompts, "new_tokens": args.new_tokens,
        "summary": summary, "speed": speeds, "seeds": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    extra = "defaults" in variants
    target = "ours_target" in results[0]
    m = result["machine"]
    lines = [f"# trainer vs speculators ({settings.arch}) — {date}", "",
             f"{m['cores']} CPU cores, which other jobs may share (so the steps/s are of the "
             "median step, robust to bursts of their load, with the CPU seconds per step "
             f"beside them), Python {m['python']}, torch {m['torch']}, speculators "
             f"{m['speculators']}, fp32. Command: `{command}` ({seconds / 60:.1f} min).", "",
             "| seed | our tau | their tau | untrained tau | our steps/s | their steps/s | "
             "ratio | our CPU s/step | their CPU s/step |"
             + (" their tau, its defaults |" if extra else "")
             + (" our tau, labels = target |" if target else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if extra else "")
             + ("---:|" if target else "")]
    for r, o, t in zip(results, ours, theirs, strict=True):
        lines.append(f"| {r['seed']} | {o['tau']:.3f} | {t['tau']:.3f} | "
                     f"{r['tau_untrained']:.3f} | {o['median_steps_per_s']:.2f} | "
                     f"{t['median_steps_per_s']:.2f} | "
                     f"{o['median_steps_per_s'] / t['median_steps_per_s']:.2f}x | "
                     f"{o['cpu_s_per_step']:.3f} | {t['cpu_s_per_step']:.3f} |"
                     + (f" {r['theirs_defaults']['tau']:.3f} |" if extra else "")
                     + (f" {r['ours_target']['tau']:.3f} |" if target else ""))
    s = summary
    lines += [f"| **mean** | {s['ours_tau']:.3f} | {s['theirs_tau']:.3f} | "
              f"{s['tau_untrained']:.3f} | {s['ours_steps_per_s']:.2f} | "
              f"{s['theirs_steps_per_s']:.2f} | {s['speed_ratio']:.2f}x | "
              f"{s['ours_cpu_s_per_step']:.3f} | {s['theirs_cpu_s_per_step']:.3f} |"
              + (f" {s['theirs_defaults_tau']:.3f} |" if extra else "")
              + (f" {s['ours_target_tau']:.3f} |" if target else ""), "",
              f"Goal 1, our tau >= theirs at equal steps: **{'met' if s['goal_tau'] else 'not met'}"
              f"** ({s['ours_tau']:.3f} vs {s['theirs_tau']:.3f}). Goal 2, our steps/s >= 1.5x "
              f"theirs: **{'met' if s['goal_speed'] else 'not met'}** ({s['speed_ratio']}x, the "
              "median of the interleaved rounds' ratios below; the first round's alone "
              f"{s['speed_ratio_round0']}x; {s['cpu_ratio']}x in CPU seconds per step).", "",
              "The per-seed table is each seed's first round (its drafters give the tau).", "",
              *speed_table(speeds),
              "tau: the same simulator for both (`speculative_decode`, greedy), "
              f"{len(bench_prompts)} seeded prompts ({PROMPTS[args.prompts_from]}), "
              f"{args.new_tokens} new tokens per turn; neither trainer saw them. Theirs "
              f"drafts with its own `{CLASSES[settings.arch]}` (its checkpoint and the head the "
              "export's command gives it: the full vocabulary, or the draft vocabulary and d2t "
              "back to target ids with `head_vocab = draft`). steps/s: the optimizer steps "
              "only (ours: `Trainer.step` in a loop; theirs: its `train_epoch`s), final losses "
              "in the JSON (not comparable: other labels and normaliser).", "",
              *settings_table({
                  "steps": settings.steps, "lr": settings.lr, "wd": settings.weight_decay,
                  "warmup": settings.warmup, "rows": settings.batch_rows,
                  "apr": settings.anchors_per_row, "anchors": anchors, "seq_len": seq_len,
                  "per_batch": per_batch, "block": settings.block_size,
                  "gamma": settings.gamma, "head_vocab": settings.head_vocab,
                  "labels": settings.labels,
                  "draft_vocab": doc["draft_vocab_size"], "clip": settings.grad_clip,
                  "ratio": TRAIN_RATIO, "train_rows": len(rows)}), "",
              *arch_table(results, settings)]
    from results_page import write_keeping_findings

    write_keeping_findings(args.out.with_suffix(".md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
