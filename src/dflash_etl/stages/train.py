"""train: a DFlash drafter on the target's hidden states, with acceptance-length evaluation.

Reads the tokenized rows (input_ids, loss_mask) and, offline, the extract stage's hidden states;
online (`--online`) it computes them from the target for each batch through the same Target class
extract uses. Each step samples rows and, per row, anchors where the loss mask and its successor
are 1; every anchor opens a block (anchor token + block_size-1 mask tokens) predicted in one pass
(see models/drafter.py). The loss at block offset k is cross-entropy against the row's token at
anchor+k, weighted exp(-(k-1)/gamma) and by the loss mask, normalised by the weight sum (SpecForge).

Held-out conversations (never trained on) give the evaluation prompts: tau before training, every
`eval_every` steps, and at the end (train/eval.json). Checkpoints (safetensors + config.json +
optimizer state) are written every `save_every` steps and a rerun resumes from the newest; under
torchrun each rank trains on its share of every batch (DDP) and rank 0 writes.

Output (runs/<name>/train/): drafter/ (model.safetensors, config.json), eval.json, log.jsonl,
checkpoints/, stats.json, contract.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.config import (
    TARGET_HINT,
    register_section,
    setting,
    stage_settings,
)
from dflash_etl.core.distributed import barrier, device_for_rank, join
from dflash_etl.core.errors import ContractError, StageError
from dflash_etl.core.progress import progress_bar
from dflash_etl.core.rundir import (
    RunDir,
    Timer,
    remove_tree,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)
from dflash_etl.core.stage import Stage, StageContext
from dflash_etl.models.identity import model_identity
from dflash_etl.models.loading import placement
from dflash_etl.models.mask_token import resolve_mask_token
from dflash_etl.stages.shell import settings_of, stage_runner
from dflash_etl.validation.contracts import read_arrow

STAGE = "train"
F_HELD_OUT = "held_out_for_eval"
F_NO_ANCHOR = "no_anchor"  # no position where the loss mask and its successor are both 1


@dataclass(frozen=True)
class TrainSettings:
    """[train] in pipeline.toml; CLI flags override it."""

    target: str = setting("", metavar="DIR",
                          help="the target model directory (offline; default: [target] model)")
    draft_layers: int = setting(5, min=1, help="decoder layers of the drafter")
    block_size: int = setting(16, min=2, why="a block needs the anchor and at least one token "
                              "to predict", help="anchor + tokens predicted per block")
    steps: int = setting(1000, min=1, help="optimizer steps")
    lr: float = setting(6e-4, above=0, help="peak learning rate")
    warmup_steps: int = setting(-1, min=-1, help="learning-rate warmup steps (-1: 4% of the "
                                                 "steps)")
    batch_rows: int = setting(8, min=1, help="rows per step, over all ranks")
    anchors_per_row: int = setting(64, min=1, help="blocks sampled per row")
    gamma: float = setting(7.0, above=0, help="loss decay over block offsets")
    grad_clip: float = setting(1.0, above=0, help="gradient norm clip")
    weight_decay: float = setting(0.0, min=0, help="AdamW weight decay")
    seed: int = setting(0, min=0, help="seed of the drafter's init, the sampling and the "
                                       "held-out split")
    mask_token_id: int = setting(-1, min=-1, help="the blocks' mask token (-1: the tokenizer's "
                                                  "mask token, a spare embedding row, or pad)")
    online: bool = setting(False, help="compute the hidden states from the target (no extract "
                                       "output needed)")
    layers: str = setting("auto", metavar="auto|1,16,31",
                          help="target layer indices, or 'auto': extract's layers (offline: "
                               "those it stored; --online: [extract] layers and draft_layers "
                               "by extract's rule)")
    dist_timeout_s: int = setting(1800, min=1, help="under torchrun: seconds a rank waits for "
                                                    "the others before the run fails")
    eval_prompts: int = setting(16, min=0, help="held-out prompts for tau")
    eval_new_tokens: int = setting(48, min=1, help="tokens decoded per prompt")
    eval_every: int = setting(0, min=0, help="steps between evaluations (0: before and after "
                                             "training only)")
    save_every: int = setting(200, min=1, help="steps between checkpoints")
    keep_checkpoints: int = setting(2, min=1, help="checkpoints kept")
    dtype: str = setting("fp32", choices=("fp32", "bf16"),
                         help="the target's dtype (the drafter trains in fp32)")
    head_vocab: str = setting("full", choices=("full", "draft"),
                              help="the loss's vocabulary: the target's whole LM head, or only "
                                   "its rows of tokenize's draft vocabulary (t2d, as "
                                   "speculators' --draft-vocab-size; labels outside it are left "
                                   "out of the loss and counted)")
    device: str = setting("auto", choices=("auto", "cpu", "cuda", "cuda:N"),
                          help="where the target and the drafter run")
    device_map: str = setting("none", choices=("none", "auto"),
                              help="'auto': place the target's layers over the visible GPUs, "
                                   "then the CPU (the drafter runs with the embedding)")
    max_memory: str = setting("", metavar="0=70GiB,1=70GiB,cpu=200GiB",
                              help="with --device-map auto: the memory each device may hold "
                                   "(default: accelerate's estimate of what is free)")

    @classmethod
    def from_sources(cls, section: dict[str, Any], overrides: dict[str, Any],
                     base_dir: Path | None) -> TrainSettings:
        settings = stage_settings(cls, "train", section, overrides, base_dir, ("target",),
                                  "target", "the target model", TARGET_HINT)
        if settings.block_size < 2:
            raise StageError(f"--block-size {settings.block_size}: a block needs the anchor and "
                             "at least one token to predict")
        if settings.steps < 1 or settings.batch_rows < 1 or settings.anchors_per_row < 1:
            raise StageError("--steps, --batch-rows and --anchors-per-row must be >= 1")
        placement(settings.device_map, settings.max_memory)  # a bad value fails before any work
        return settings

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else max(1, round(0.04 * self.steps))


register_section("train", TrainSettings)


# ---------------------------------------------------------------- pure core
def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p with loss_mask[p] == loss_mask[p+1] == 1: the anchor is supervised and so is
    at least the first token its block predicts."""
    m = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:])


def held_out_ids(ids: list[str], rows_wanted: int, seed: int) -> set[str]:
    """Conversations set aside for evaluation: the first by a seeded hash of their id until they
    hold `rows_wanted` rows (all rows of a conversation stay on one side)."""
    counts: dict[str, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    ranked = sorted(counts, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    chosen, rows = set(), 0
    for i in ranked:
        if rows >= rows_wanted or len(chosen) >= len(counts) - 1:
            break
        chosen.add(i)
        rows += counts[i]
    return chosen


def eval_prompt(input_ids: list[int], loss_mask: list[int]) -> list[int] | None:
    """The row's tokens before its first supervised token: the prompt the reply answers."""
    first = next((k for k, m in enumerate(loss_mask) if m), None)
    return list(input_ids[:first]) if first else None


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def sample_anchors(rows: list[dict[str, Any]], anchors_per_row: int,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """Each row's anchors (sorted), drawn among its anchor candidates without replacement."""
    picks = []
    for row in rows:
        cands = anchor_candidates(row["loss_mask"])
        picks.append(np.sort(rng.choice(cands, size=min(anchors_per_row, len(cands)),
                                        replace=False)))
    return picks


def loss_weight_total(rows: list[dict[str, Any]], anchors: list[np.ndarray],
                      weights: np.ndarray, in_vocab: np.ndarray | None = None) -> float:
    """The sum of the loss weights of every predicted position of these blocks: the loss's
    normaliser, computed from the rows alone so that every rank of a DDP step divides by the
    whole batch's total (the step then equals one process training on the whole batch). With
    `in_vocab` (a draft vocabulary's bool per token id) only labels inside it count."""
    total = 0.0
    for row, picks in zip(rows, anchors, strict=True):
        mask = np.asarray(row["loss_mask"], dtype=bool)
        if in_vocab is not None:
            mask = mask & in_vocab[np.asarray(row["input_ids"], dtype=np.int64)]
        for k in range(1, len(weights)):
            at = picks + k
            inside = at < len(mask)
            total += float(weights[k]) * int(mask[at[inside]].sum())
    return total


def make_batch(rows: list[dict[str, Any]], states: list[Any], picks: list[np.ndarray],
               block_size: int, mask_token_id: int) -> dict[str, Any]:
    """Pad the rows and lay out their blocks at the given anchors; returns the tensors
    `block_loss` takes."""
    import torch

    b, t = len(rows), max(len(r["input_ids"]) for r in rows)
    width = states[0].shape[1] * states[0].shape[2]
    ids = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    valid = torch.zeros((b, t), dtype=torch.bool)
    hidden = torch.zeros((b, t, width), dtype=torch.float32)
    for k, (row, s) in enumerate(zip(rows, states, strict=True)):
        n = len(row["input_ids"])
        ids[k, :n] = torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int64))
        mask[k, :n] = torch.as_tensor(np.asarray(row["loss_mask"], dtype=bool))
        valid[k, :n] = True
        hidden[k, :n] = s.reshape(n, width).float()
    n = max(len(p) for p in picks)
    anchors = torch.zeros((b, n), dtype=torch.long)
    keep = torch.zeros((b, n), dtype=torch.bool)
    for k, p in enumerate(picks):
        anchors[k, :len(p)] = torch.as_tensor(p)
        keep[k, :len(p)] = True
    offsets = torch.arange(block_size)
    where = anchors[..., None] + offsets  # [B, N, S]
    inside = where < valid.sum(1)[:, None, None]
    clipped = where.clamp(max=t - 1)
    labels = torch.gather(ids[:, None].expand(-1, n, -1), 2, clipped)
    supervised = torch.gather(mask[:, None].expand(-1, n, -1), 2, clipped)
    block_ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long)
    block_ids[..., 0] = labels[..., 0]
    return {"hidden": hidden, "valid": valid, "block_ids": block_ids, "anchors": anchors,
            "labels": labels, "label_ok": keep[..., None] & inside & supervised & (offsets > 0)}


class DraftVocab:
    """tokenize's draft vocabulary (t2d: a bool per target token id, speculators' layout) as
    the LM head's rows: the loss over the draft tokens only, as speculators trains with
    --draft-vocab-size (its head is the target head's t2d rows, in token id order)."""

    def __init__(self, t2d: np.ndarray, head_rows: int, source: str = "t2d") -> None:
        import torch

        t2d = np.asarray(t2d, dtype=bool)
        if t2d.ndim != 1 or not t2d.any():
            raise StageError(f"{source}: a draft vocabulary needs a non-empty 1-d bool t2d map")
        if len(t2d) > head_rows and t2d[head_rows:].any():
            raise StageError(f"{source} marks token ids beyond the target's {head_rows} LM head "
                             "rows: it was made for another target; rerun tokenize")
        self.inside = np.zeros(head_rows, dtype=bool)  # padded/cut to the head's rows
        self.inside[:min(len(t2d), head_rows)] = t2d[:head_rows]
        self.size = int(self.inside.sum())
        self.rows = torch.as_tensor(np.flatnonzero(self.inside))
        to_draft = np.full(head_rows, -1, dtype=np.int64)
        to_draft[self.inside] = np.arange(self.size)
        self.to_draft = torch.as_tensor(to_draft)
        self._head: tuple[Any, Any, Any] | None = None

    def head(self, lm_head: Any) -> tuple[Any, Any]:
        """(weight, bias) of the LM head's draft rows (a copy, made once per head)."""
        if self._head is None or self._head[0] is not lm_head:
            rows = self.rows.to(lm_head.weight.device)
            bias = getattr(lm_head, "bias", None)
            self._head = (lm_head, lm_head.weight.detach()[rows].contiguous(),
                          None if bias is None else bias.detach()[rows].contiguous())
        return self._head[1], self._head[2]


def block_loss(drafter: Any, embed: Any, lm_head: Any, batch: dict[str, Any], weights: Any,
               chunk: int | None = None, normalizer: float | None = None,
               vocab: DraftVocab | None = None) -> tuple[Any, dict[str, float]]:
    """The decay-weighted cross-entropy of a batch of blocks (divided by `normalizer`, default
    the batch's own weight total), and its accuracy at offset 1.

    Only supervised positions go through the LM head, `chunk` at a time (default: as many as
    keep a chunk's logits within drafter.LOGIT_BUDGET floats), with the head's gradient for
    them computed in the same pass (drafter.head_cross_entropy): with a 248k vocabulary the
    logits of every block would take gigabytes. With a draft `vocab` the head is its rows only
    and labels outside it are left out of the loss and counted (`outside_draft_vocab`)."""
    import torch

    from dflash_etl.models.drafter import head_cross_entropy

    device = weights.device
    with torch.no_grad():
        block_embeds = embed(batch["block_ids"].to(device)).float()
    hidden = drafter(batch["hidden"].to(device), batch["valid"].to(device), block_embeds,
                     batch["anchors"].to(device))
    ok = batch["label_ok"][:, :, 1:].to(device)
    first = torch.zeros_like(ok)
    first[..., 0] = True
    labels = batch["labels"][:, :, 1:].to(device)[ok]
    w = (weights[1:] * ok)[ok]
    states = hidden[:, :, 1:][ok]  # [supervised positions, hidden]
    first = first[ok]
    head_weight, head_bias = lm_head.weight, getattr(lm_head, "bias", None)
    outside = 0
    if vocab is not None:
        mapped = vocab.to_draft.to(device)[labels]
        inside = mapped >= 0
        outside = int((~inside).sum())
        labels, w, states, first = mapped[inside], w[inside], states[inside], first[inside]
        head_weight, head_bias = vocab.head(lm_head)
    total, hits = head_cross_entropy(states, head_weight, head_bias, labels, w, chunk)
    hits = hits.to(first.device)  # the head's device, under a device-mapped target
    loss = total / (normalizer if normalizer is not None else w.sum() + 1e-6)
    metrics = {"loss": float(loss.detach()),
               "acc_1": float((hits & first).sum() / first.sum().clamp(min=1)),
               "supervised": len(labels)}
    if vocab is not None:
        metrics.update(outside_draft_vocab=float(outside), inside_draft_vocab=float(len(labels)))
    return loss, metrics


# ---------------------------------------------------------------- state sources
class ExtractedStates:
    """Hidden states the extract stage wrote (either format), per tokenized row."""

    def __init__(self, extract_dir: Path, n_layers: int, index: list[dict[str, Any]]) -> None:
        from safetensors import safe_open

        self.dir = extract_dir / "hidden_states"
        self.where = {e["row"]: e for e in index}
        self.n_layers = n_layers
        self._open = safe_open
        self.handles: dict[str, Any] = {}
        self.files = contextlib.ExitStack()

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        out = []
        for row in rows:
            entry = self.where[row["row"]]
            if entry["shard"] not in self.handles:
                self.handles[entry["shard"]] = self.files.enter_context(
                    self._open(str(self.dir / entry["shard"]), "pt"))
            a = entry["offset"]
            states = self.handles[entry["shard"]].get_slice("hidden_states")[a:a + entry["length"]]
            out.append(states[:, :self.n_layers])  # speculators' files append the last layer
        return out

    def close(self) -> None:
        self.files.close()


def _read_index(path: Path) -> list[dict[str, Any]]:
    """extract's index.parquet: row -> shard, offset, length."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


class OnlineStates:
    """Hidden states computed from the target for each batch (no extract output needed)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        return self.target.states([list(r["input_ids"]) for r in rows])

    def close(self) -> None:
        return None


# ---------------------------------------------------------------- shell
def target_layers(ctx: StageContext, settings: TrainSettings,
                  extracted: dict[str, Any] | None) -> tuple[list[int], str]:
    """The target layers the drafter reads, and where they come from (recorded in the stats).
    One rule for both modes: extract's. Offline they are the layers the extract output holds
    (train's explicit --layers must name the same ones); online, train's explicit --layers,
    else the config's [extract] layers/draft_layers resolved as extract resolves them, so an
    online run of a config trains on what an offline run of it would."""
    from dflash_etl.models.layers import resolve_layers
    from dflash_etl.models.target import parse_layers

    if extracted is not None:
        stored = list(extracted["layers"])
        if settings.layers != "auto":
            asked = parse_layers(settings.layers, int(extracted["n_layers"]), len(stored))
            if asked != stored:
                raise StageError(
                    f"train --layers {settings.layers} ({asked}) but the extract output holds "
                    f"layers {stored}: drop train's layers (offline training reads what extract "
                    "stored), re-extract with --layers "
                    f"{','.join(map(str, asked))}, or train --online")
        return stored, "the extract output (extract/stats.json)"
    if settings.layers != "auto":
        return (resolve_layers(settings.layers, settings.target, settings.draft_layers),
                f"train layers = {settings.layers!r}")
    ext = settings_of("extract", ctx.config, ctx.run.root, {"model": settings.target})
    return (resolve_layers(ext.layers, ext.model, ext.draft_layers),
            f"[extract] layers = {ext.layers!r}, draft_layers = {ext.draft_layers} (extract's "
            "rule, as an offline run of this config)")


def _load_rows(run: RunDir) -> tuple[list[dict[str, Any]], list[Path]]:
    files = sorted((run.stage_dir("tokenize") / "dataset").glob("*.arrow"))
    if not files:
        raise StageError(f"no tokenized dataset in {run.stage_dir('tokenize') / 'dataset'}: run "
                         "`dflash-etl tokenize` for this run first")
    table = pa.concat_tables([read_arrow(f).select(["input_ids", "loss_mask", "id", "source",
                                                    "turn"]) for f in files])
    rows = table.to_pylist()
    for position, row in enumerate(rows):
        row["row"] = position
    return rows, files


def _t2d_file(run: RunDir) -> Path:
    """tokenize's t2d map (named in its draft_vocab.json), for --head-vocab draft."""
    out = run.stage_dir("tokenize")
    try:
        name = json.loads((out / "draft_vocab.json").read_text())["t2d"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StageError(f"--head-vocab draft: no draft vocabulary in {out} (draft_vocab.json "
                         f"naming its t2d map: {exc}); rerun `dflash-etl tokenize` for this run "
                         "or train with --head-vocab full") from exc
    if not (out / name).is_file():
        raise StageError(f"--head-vocab draft: {out / name} is missing; rerun tokenize")
    return out / name


def _extract_info(run: RunDir) -> dict[str, Any]:
    info = run.manifest().get("stages", {}).get("extract", {})
    out = run.stage_dir("extract")
    if info.get("status") != "complete" or not (out / "index.parquet").exists():
        raise StageError(f"no complete extract output in {out}: run `dflash-etl extract` first, "
                         "or train with --online to compute the hidden states from the target")
    return {**json.loads((out / "stats.json").read_text())["total"],
            "fingerprint": info.get("fingerprint")}


def _checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("step-*") if (p / "state.json").exists())


def _tidy_checkpoints(directory: Path) -> None:
    """Remove what a killed run left in checkpoints/: half-written or half-deleted checkpoints
    (*.tmp) and step directories without their state.json (written last), which would
    otherwise be published with the output."""
    for path in directory.iterdir():
        if path.name.endswith(".tmp") or (path.name.startswith("step-")
                                          and not (path / "state.json").exists()):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def _save_checkpoint(directory: Path, step: int, drafter: Any, optimizer: Any, scheduler: Any,
                     state: dict[str, Any], keep: int) -> None:
    import torch

    final = directory / f"step-{step:06d}"
    tmp = directory / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               tmp / OPTIMIZER)
    # what resume checks the directory against (_checked_checkpoint)
    files = {name: (tmp / name).stat().st_size for name in CHECKPOINT_FILES}
    write_json_atomic(tmp / "state.json", {**state, "step": step,
                                           "tensors": len(drafter.state_dict()), "files": files})
    if final.exists():
        remove_tree(final)
    os.replace(tmp, final)
    for old in _checkpoints(directory)[:-keep]:
        remove_tree(old)  # never half deleted: one with state.json would be resumed from


OPTIMIZER = "optimizer.pt"
CHECKPOINT_FILES = ("model.safetensors", "config.json", OPTIMIZER)


class CheckpointRefused(StageError):
    """A checkpoint that does not match its directory or its files: resuming from it would
    publish a drafter that is not what state.json says."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"cannot resume from the checkpoint {path}: {reason}. Delete that directory (the "
            "rerun then resumes from an older checkpoint, or starts afresh) or rerun with "
            "--force")


def _checked_checkpoint(path: Path, expected_tensors: set[str], device: Any
                        ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(state, weights, optimizer file) of a checkpoint, each checked against the others and
    the directory: the step against the directory's name and the scheduler's step count, the
    files present (with the sizes state.json recorded), the tensors those the drafter has.
    CheckpointRefused says what does not match; a corrupt or non-weights file is refused the
    same way, never an unpickling traceback."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def refuse(reason: str) -> CheckpointRefused:
        return CheckpointRefused(path, reason)

    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise refuse(f"state.json is not readable JSON ({exc})") from exc
    if not isinstance(state, dict):
        raise refuse("state.json does not hold an object")
    step = state.get("step")
    named = path.name.removeprefix("step-")
    if not isinstance(step, int) or not named.isdigit() or int(named) != step:
        raise refuse(f"state.json says step {step!r} but the directory is {path.name}")
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise refuse(f"{', '.join(missing)} missing")
    recorded = state.get("files")
    if recorded is not None:
        if not isinstance(recorded, dict):
            raise refuse("state.json's files is not an object")
        for name, size in recorded.items():
            actual = (path / name).stat().st_size if (path / name).is_file() else None
            if actual != size:
                raise refuse(f"{name} has {actual} bytes, state.json recorded {size}")
    try:
        weights = load_file(str(path / "model.safetensors"), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise refuse(f"model.safetensors is not readable safetensors ({exc})") from exc
    if state.get("tensors", len(weights)) != len(weights):
        raise refuse(f"state.json records {state.get('tensors')!r} tensors, model.safetensors "
                     f"holds {len(weights)}")
    if set(weights) != expected_tensors:
        odd = sorted(set(weights) ^ expected_tensors)[:3]
        raise refuse(f"model.safetensors holds {len(weights)} tensors, not the drafter's "
                     f"{len(expected_tensors)} (e.g. {odd}): another drafter's checkpoint")
    try:
        opt = torch.load(path / OPTIMIZER, map_location=device, weights_only=True)
    except Exception as exc:  # a corrupt zip, a truncated file, a pickle of other objects
        raise refuse(f"{OPTIMIZER} is not an optimizer state torch loads as weights only "
                     f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                     ) from exc
    if not (isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict)
            and isinstance(opt.get("scheduler"), dict)):
        raise refuse(f"{OPTIMIZER} does not hold the optimizer and scheduler states")
    if opt["scheduler"].get("last_epoch") != step:
        raise refuse(f"its scheduler has made {opt['scheduler'].get('last_epoch')!r} steps, "
                     f"state.json says {step}")
    return state, weights, opt


def _log_through(path: Path, step: int) -> list[dict[str, Any]]:
    """The training log's entries up to `step`: what a resumed run keeps. A line cut by a kill
    (the last one) is dropped, and so is what was logged after the checkpoint."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) \
                and entry["step"] <= step:
            kept.append(entry)
    return kept


class Trainer:
    """Everything one training run holds: target, drafter, data, optimizer, log."""

    def __init__(self, settings: TrainSettings, rows: list[dict[str, Any]],
                 extracted: ExtractedStates | None, extract_layers: list[int] | None, out: Path,
                 rank: int = 0, world: int = 1, draft_vocab: np.ndarray | None = None) -> None:
        import torch

        from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig, block_loss_weights
        from dflash_etl.models.target import Target, TargetSpec, resident_head

        self.torch, self.settings, self.rank, self.world = torch, settings, rank, world
        layers = ",".join(map(str, extract_layers)) if extract_layers else settings.layers
        device = device_for_rank(settings.device)
        self.target = Target(TargetSpec(model=settings.target, layers=layers,
                                             draft_layers=settings.draft_layers,
                                             dtype=settings.dtype, device=device,
                                             device_map=settings.device_map,
                                             max_memory=settings.max_memory))
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        self.device = self.target.device
        self.embed = self.target.model.get_input_embeddings()
        self.lm_head = resident_head(self.target.model.get_output_embeddings())
        self.vocab = None if draft_vocab is None else DraftVocab(
            draft_vocab, self.lm_head.weight.shape[0], "tokenize's t2d")
        self.mask_token_id, self.mask_reason = resolve_mask_token(
            settings.target, self.embed.weight.shape[0], settings.mask_token_id)
        torch.manual_seed(settings.seed)
        config = DrafterConfig.from_target(
            self.target.model.config, draft_layers=settings.draft_layers,
            target_layer_ids=self.target.layers, mask_token_id=self.mask_token_id,
            block_size=settings.block_size)
        config.loss_decay_gamma = settings.gamma
        self.drafter = DFlashDrafter(config).to(self.device)
        self.model = self.drafter
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.drafter)
        self.weights = block_loss_weights(settings.block_size, settings.gamma).to(self.device)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=settings.lr,
                                           weight_decay=settings.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, settings.warmup, settings.steps))
        self.states = extracted or OnlineStates(self.target)
        self.rows = rows
        self.log_path = out / "log.jsonl"
        self.layers_from = "train layers"  # where the target layers came from (the stats say)

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step on the step's seeded batch (the same on every rank and rerun)."""
        s = self.settings
        rng = np.random.default_rng([s.seed, step])
        picked = rng.choice(len(self.rows), size=min(s.batch_rows, len(self.rows)),
                            replace=False)
        rows = [self.rows[i] for i in picked]
        anchors = sample_anchors(rows, s.anchors_per_row, rng)
        # DDP averages the ranks' gradients: each rank divides its share by the whole batch's
        # weight total / world, so a step equals one process training on the whole batch
        normalizer = loss_weight_total(rows, anchors, self.weights.cpu().numpy(),
                                       self.vocab.inside if self.vocab else None) / self.world
        share = list(range(self.rank, len(rows), self.world))
        mine = [rows[k] for k in share or [0]]  # a rank without rows still joins the all-reduce
        batch = make_batch(mine, self.states(mine), [anchors[k] for k in share or [0]],
                           s.block_size, self.mask_token_id)
        loss, metrics = block_loss(self.model, self.embed, self.lm_head, batch, self.weights,
                                   normalizer=max(normalizer, 1e-6), vocab=self.vocab)
        if not share:
            loss = loss * 0.0
        if self.world > 1:  # log the whole batch's loss, not this rank's share of it
            import torch.distributed as dist

            whole = loss.detach().clone()
            dist.all_reduce(whole)
            metrics["loss"] = float(whole) / self.world
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = self.torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), s.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return {**metrics, "grad_norm": float(norm), "lr": self.scheduler.get_last_lr()[0]}

    def resume(self, directory: Path) -> dict[str, Any]:
        """Load the newest checkpoint (if any); returns its state ({} when starting afresh)."""
        if self.rank == 0:
            _tidy_checkpoints(directory)
        found = _checkpoints(directory)
        if not found:
            if self.rank == 0:  # starting afresh: a killed run's log is not this one's
                self.log_path.unlink(missing_ok=True)
            return {}
        latest = found[-1]
        state, weights, opt = _checked_checkpoint(latest, set(self.drafter.state_dict()),
                                                  self.device)
        try:
            self.drafter.load_state_dict(weights)
            self.optimizer.load_state_dict(opt["optimizer"])
            self.scheduler.load_state_dict(opt["scheduler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointRefused(latest, f"its states do not fit this drafter ({exc})"
                                    ) from exc
        if self.rank == 0 and self.log_path.exists():
            kept = _log_through(self.log_path, state["step"])
            write_text_atomic(self.log_path, "".join(f"{json.dumps(e)}\n" for e in kept))
        return state


# settings that do not change the trained drafter: a resumed run may change them
NOT_FINGERPRINTED = ("device", "device_map", "max_memory", "save_every", "keep_checkpoints",
                     "dist_timeout_s")


def _fingerprint_payload(settings: TrainSettings, files: list[Path],
                         extract_fp: str | None, layers: list[int] | None = None
                         ) -> dict[str, Any]:
    kept = {k: v for k, v in asdict(settings).items() if k not in NOT_FINGERPRINTED}
    payload = {"settings": kept, "inputs": [sha256_file(f) for f in files],
               "extract": extract_fp, "model": model_identity(settings.target)}
    if layers is not None:  # online: [extract] may choose them (offline: extract_fp covers them)
        payload["layers"] = layers
    return payload


def _split(rows: list[dict[str, Any]], settings: TrainSettings
           ) -> tuple[list[dict[str, Any]], list[list[int]], dict[str, Stats]]:
    """Training rows, evaluation prompts and the per-source accounting of the split."""
    held = held_out_ids([r["id"] for r in rows], settings.eval_prompts, settings.seed)
    train_rows, prompts, per_source = [], [], {}
    for row in rows:
        stats = per_source.setdefault(row["source"], Stats(extra={"tokens": 0}))
        stats.rows_in += 1
        if row["id"] in held:
            stats.filter(F_HELD_OUT)
            prompt = eval_prompt(row["input_ids"], row["loss_mask"])
            if prompt:
                prompts.append(prompt)
        elif not len(anchor_candidates(row["loss_mask"])):
            stats.filter(F_NO_ANCHOR)
        else:
            stats.rows_out += 1
            stats.extra["tokens"] += len(row["input_ids"])
            train_rows.append(row)
    return train_rows, prompts[:settings.eval_prompts], per_source


def verify(out: Path, block_size: int) -> list[str]:
    """The contract of a train output: the drafter loads from its files with finite weights,
    and eval.json holds finite tau values within [1, block_size]."""
    import torch

    from dflash_etl.models.drafter import DFlashDrafter

    problems = []
    try:
        drafter = DFlashDrafter.load(out / "drafter")
        if not all(bool(torch.isfinite(p).all()) for p in drafter.parameters()):
            problems.append("drafter/model.safetensors: non-finite weights")
    except Exception as exc:  # a broken file raises many types
        problems.append(f"drafter/: cannot load the drafter: {exc}")
    evaluation = json.loads((out / "eval.json").read_text())
    for key in ("tau_untrained", "tau_final"):
        value = evaluation.get(key)
        if not isinstance(value, int | float) or not 1.0 <= value <= block_size:
            problems.append(f"eval.json: {key} = {value!r}, expected a number in "
                            f"[1, {block_size}]")
    return problems


def check_output(out: Path) -> tuple[int, int, list[str]]:
    """`dflash-etl check` on a train output: (rows trained on, checkpoints, problems)."""
    total = json.loads((out / "stats.json").read_text())["total"]
    checkpoints = len(_checkpoints(out / "checkpoints")) if (out / "checkpoints").is_dir() else 0
    return total["rows_out"], checkpoints, verify(out, int(total["block_size"]))


class TrainStage(Stage):
    """Hidden states (or the target, online) -> a DFlash drafter and its tau. Under torchrun
    every rank runs it; rank 0 alone owns the run directory (lock, partial, publish)."""

    name = STAGE

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings: TrainSettings = ctx.settings
        ctx.rank, ctx.world = join(settings.dist_timeout_s)
        rows, files = _load_rows(ctx.run)
        t2d = None
        if settings.head_vocab == "draft":
            t2d_file = _t2d_file(ctx.run)
            files = [*files, t2d_file]
            t2d = np.load(t2d_file)
        extracted = None if settings.online else _extract_info(ctx.run)
        index: list[dict[str, Any]] = []
        if extracted is not None:
            index = _read_index(ctx.run.stage_dir("extract") / "index.parquet")
            indexed = {e["row"] for e in index}
            rows = [r for r in rows if r["row"] in indexed]  # extract quarantined the others
        layers, layers_from = target_layers(ctx, settings, extracted)
        ctx.state.update(rows=rows, extracted=extracted, index=index, layers=layers,
                         layers_from=layers_from, t2d=t2d)
        return _fingerprint_payload(settings, files,
                                    extracted["fingerprint"] if extracted else None,
                                    None if extracted else layers)

    def begin(self, ctx: StageContext) -> None:
        barrier(ctx.world)  # rank 0 has prepared the partial directory

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        call = Timer()  # this call's seconds, recorded with each checkpoint (see _train)
        settings: TrainSettings = ctx.settings
        rows, extracted = ctx.state["rows"], ctx.state["extracted"]
        train_rows, prompts, per_source = _split(rows, settings)
        if not train_rows:
            held = sum(s.rows_filtered.get(F_HELD_OUT, 0) for s in per_source.values())
            raise StageError(f"train has no rows to train on: of {len(rows)} rows, {held} are "
                             "held out for evaluation and the rest have no two consecutive "
                             "supervised tokens to anchor a block; check the tokenize stage's "
                             "masks or lower --eval-prompts")
        if not prompts:
            raise StageError("train has no evaluation prompts: no held-out row has a prompt "
                             "before its first supervised token; raise --eval-prompts (now "
                             f"{settings.eval_prompts}) or check the tokenize stage's masks")
        states = (ExtractedStates(ctx.run.stage_dir("extract"), len(extracted["layers"]),
                                  ctx.state["index"]) if extracted else None)
        trainer = Trainer(settings, train_rows, states, ctx.state["layers"], ctx.partial,
                          ctx.rank, ctx.world, draft_vocab=ctx.state["t2d"])
        trainer.layers_from = ctx.state["layers_from"]
        try:
            doc, timing = _train(trainer, ctx.run, settings, prompts, per_source, ctx.partial,
                                 ctx.rank, ctx.progress, call)
            ctx.timings.update(timing)
            return doc
        finally:
            trainer.states.close()

    def end(self, ctx: StageContext) -> None:
        barrier(ctx.world)  # rank 0 has published
        if ctx.rank == 0:
            from dflash_etl.models.serving import vllm_command

            print(f"train: serve the drafter with:\n  {vllm_command(ctx.run.root)}",
                  file=sys.stderr, flush=True)


run = stage_runner(TrainStage)


def _train(trainer: Trainer, run: RunDir, settings: TrainSettings, prompts: list[list[int]],
           per_source: dict[str, Stats], partial: Path, rank: int,
           progress: bool | None, call: Timer | None = None
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train; returns the stats document (stats.json) and the timings, which go to the manifest
    only: the data files of two runs of the same inputs are byte-identical. The manifest's
    seconds count every call that made the drafter: each checkpoint records (in the manifest,
    not its state.json, which is data) the seconds spent up to it, and a resumed call adds
    those of the checkpoint it resumed from."""
    call = call or Timer()
    from dflash_etl.models.acceptance import acceptance_length, eos_token_ids
    from dflash_etl.models.drafter import parameter_count

    ckpt_dir = partial / "checkpoints"
    ckpt_dir.mkdir(exist_ok=True)
    state = trainer.resume(ckpt_dir)
    start = state.get("step", 0)
    earlier = _earlier_seconds(run, start) if rank == 0 else 0.0
    eos = eos_token_ids(trainer.target.model)
    history = state.get("eval", [])

    say = print if rank == 0 else (lambda *_a, **_k: None)

    def evaluate(step: int) -> float:
        result = acceptance_length(trainer.target, trainer.drafter, prompts,
                                   settings.eval_new_tokens, eos)
        history.append({"step": step, "tau": result["tau"], "per_prompt": result["per_prompt"]})
        say(f"train: step {step}: tau {result['tau']:.3f} on {len(prompts)} held-out prompts",
            file=sys.stderr, flush=True)
        return result["tau"]

    if rank == 0:
        run.update_stage(STAGE, settings=asdict(settings), mask_token_id=trainer.mask_token_id,
                         mask_token=trainer.mask_reason, layers=trainer.target.layers,
                         layers_from=trainer.layers_from)
        if not history:
            evaluate(0)
    if start:
        say(f"train: resuming from the checkpoint of step {start}", file=sys.stderr, flush=True)
    timer = Timer()
    last: dict[str, float] = {}
    every = max(1, settings.steps // 10)
    with progress_bar("train", total=settings.steps - start,
                      enabled=progress if rank == 0 else False) as bar, \
            open(trainer.log_path, "a") as log:
        for step in range(start, settings.steps):
            last = trainer.step(step)
            if not math.isfinite(last["loss"]):
                raise StageError(f"train: the loss became {last['loss']} at step {step + 1}; "
                                 f"lower --lr (now {settings.lr}) or check the hidden states")
            done = step + 1
            if rank == 0:
                log.write(json.dumps({"step": done, **{k: round(v, 6) for k, v in last.items()
                                                       if isinstance(v, float)}}) + "\n")
                log.flush()
                if done % every == 0:
                    bar.note(f"train: step {done}/{settings.steps}: loss {last['loss']:.4f}, "
                             f"offset-1 accuracy {last['acc_1']:.3f}, lr {last['lr']:.2e}")
                if settings.eval_every and done % settings.eval_every == 0 \
                        and done < settings.steps:
                    evaluate(done)
                if done % settings.save_every == 0 or done == settings.steps:
                    _save_checkpoint(ckpt_dir, done, trainer.drafter, trainer.optimizer,
                                     trainer.scheduler, {"eval": history},
                                     settings.keep_checkpoints)
                    _record_checkpoint_seconds(run, done, earlier + call.seconds,
                                               settings.keep_checkpoints)
            bar.advance(1)
    seconds = timer.seconds
    if rank:
        return {}, {}
    if not history or history[-1]["step"] != settings.steps:
        evaluate(settings.steps)
    trainer.drafter.save(partial / "drafter")
    evaluation = {
        "tau_untrained": history[0]["tau"] if history else None,
        "tau_final": history[-1]["tau"] if history else None,
        "prompts": len(prompts), "max_new_tokens": settings.eval_new_tokens,
        "block_size": settings.block_size, "history": history,
    }
    write_json_atomic(partial / "eval.json", evaluation)
    doc = stats_document(per_source, STAGE)
    trained = settings.steps - start
    # the last step's loss as logged: the same whether this run made that step or resumed
    # after it (stats.json is data: byte-identical however often the run was interrupted)
    logged = _log_through(trainer.log_path, settings.steps)
    final_loss = logged[-1].get("loss") if logged else None
    doc["total"].update({
        "steps": settings.steps,
        "final_loss": round(final_loss, 4) if final_loss is not None else None,
        "tau_untrained": evaluation["tau_untrained"], "tau_final": evaluation["tau_final"],
        "eval_prompts": len(prompts), "draft_layers": settings.draft_layers,
        "block_size": settings.block_size, "target_layers": trainer.target.layers,
        "target_layers_from": trainer.layers_from,
        "mask_token_id": trainer.mask_token_id, "online": settings.online,
        "drafter_parameters": parameter_count(trainer.drafter),
    })
    if trainer.vocab is not None:  # the labels the loss left out, over every logged step
        outside = sum(e.get("outside_draft_vocab", 0.0) for e in logged)
        inside = sum(e.get("inside_draft_vocab", 0.0) for e in logged)
        doc["total"]["draft_vocab"] = {
            "size": trainer.vocab.size, "labels_outside": int(outside),
            "labels_inside": int(inside),
            "share_outside": round(outside / (outside + inside), 6) if outside + inside else 0.0}
    problems = verify(partial, settings.block_size)
    write_json_atomic(partial / "contract.json", {"passed": not problems, "problems": problems})
    if problems:
        raise ContractError("the train contract failed:\n  - " + "\n  - ".join(problems),
                            {"problems": problems})
    write_json_atomic(partial / "stats.json", doc)
    # how much of the training this process did is the run's record (the manifest), not data
    doc["total"]["steps_this_run"] = trained
    return doc, {"steps_per_s": round(trained / seconds, 3) if seconds and trained else None,
                 "steps_this_run": trained, "earlier_seconds": earlier,
                 "seconds_this_run": round(call.seconds, 3), "checkpoint_seconds": None}


def _record_checkpoint_seconds(run: RunDir, step: int, seconds: float, keep: int) -> None:
    """The stage's seconds up to checkpoint `step`, all calls together (the newest few)."""
    recorded = run.manifest().get("stages", {}).get(STAGE, {}).get("checkpoint_seconds") or {}
    recorded = {**recorded, str(step): round(seconds, 3)}
    newest = sorted(recorded, key=int)[-(keep + 1):]
    run.update_stage(STAGE, checkpoint_seconds={k: recorded[k] for k in newest})


def _earlier_seconds(run: RunDir, start: int) -> float:
    """The seconds the earlier calls spent up to checkpoint `start` (0 when starting afresh;
    a checkpoint saved just before a kill but not yet recorded counts the one before it)."""
    if not start:
        return 0.0
    recorded = run.manifest().get("stages", {}).get(STAGE, {}).get("checkpoint_seconds") or {}
    steps = [int(k) for k in recorded if str(k).isdigit() and int(k) <= start]
    return float(recorded[str(max(steps))]) if steps else 0.0


def main(argv: list[str] | None = None) -> int:
    from dflash_etl.cli.stage import stage_main

    return stage_main("train", argv)


if __name__ == "__main__":
    raise SystemExit(main())
