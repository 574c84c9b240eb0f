"""The trainer: the target (frozen), the drafter, the optimizer and the data of one training
run; one seeded optimizer step at a time (under torchrun, each rank on its share of the batch:
DDP), the loop that logs, evaluates and checkpoints, and the resume from the newest checkpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dflash_etl.core.distributed import device_for_rank
from dflash_etl.core.errors import StageError
from dflash_etl.core.progress import progress_bar, progress_record
from dflash_etl.core.rundir import write_text_atomic
from dflash_etl.models.training.checkpoints import (
    CheckpointRefused,
    checked_checkpoint,
    list_checkpoints,
    log_through,
    save_checkpoint,
    tidy_checkpoints,
)
from dflash_etl.models.training.evaluation import TauEvaluator
from dflash_etl.models.training.labels import final_norm, target_labels
from dflash_etl.models.training.loss import (
    DraftVocab,
    block_loss,
    loss_weight_total,
    make_batch,
    sample_anchors,
)
from dflash_etl.models.training.settings import TrainingSettings
from dflash_etl.models.training.states import ExtractedStates, OnlineStates

# (target model directory, its embedding rows, the explicit setting or -1) -> (token id, why)
MaskTokenRule = Callable[[str, int, int], tuple[int, str]]


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """Everything one training run holds: target, drafter, data, optimizer, log."""

    def __init__(self, settings: TrainingSettings, rows: list[dict[str, Any]],
                 extracted: ExtractedStates | None, extract_layers: list[int] | None, out: Path,
                 rank: int = 0, world: int = 1, draft_vocab: np.ndarray | None = None, *,
                 mask_token: MaskTokenRule, head_only: bool = False) -> None:
        import torch

        from dflash_etl.models.drafter import (
            DFLASH2_SETTINGS,
            DFlashDrafter,
            DrafterConfig,
            block_loss_weights,
        )
        from dflash_etl.models.target import Target, TargetSpec, resident_head
        from dflash_etl.models.target_head import HeadTarget

        self.torch, self.settings, self.rank, self.world = torch, settings, rank, world
        layers = ",".join(map(str, extract_layers)) if extract_layers else settings.layers
        device = device_for_rank(settings.device)
        # head_only: the states come from a server and nothing here runs the target's decoder
        self.target = (HeadTarget if head_only else Target)(TargetSpec(
            model=settings.target, layers=layers, draft_layers=settings.draft_layers,
            dtype=settings.dtype, device=device, device_map=settings.device_map,
            max_memory=settings.max_memory))
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        self.device = self.target.device
        self.embed = self.target.model.get_input_embeddings()
        self.lm_head = resident_head(self.target.model.get_output_embeddings())
        self.vocab = None if draft_vocab is None else DraftVocab(
            draft_vocab, self.lm_head.weight.shape[0], "tokenize's t2d")
        self.mask_token_id, self.mask_reason = mask_token(
            settings.target, self.embed.weight.shape[0], settings.mask_token_id)
        torch.manual_seed(settings.seed)
        config = DrafterConfig.from_target(
            self.target.model.config, draft_layers=settings.draft_layers,
            target_layer_ids=self.target.layers, mask_token_id=self.mask_token_id,
            block_size=settings.block_size)
        config.loss_decay_gamma = settings.gamma
        if settings.arch == "dflash2":
            config.arch = "dflash2"
            for name in DFLASH2_SETTINGS:
                setattr(config, name, getattr(settings, name))
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
        # labels = "target": the target's final norm (before its LM head) gives the labels
        self.norm = final_norm(self.target.model) if settings.labels == "target" else None
        self.states = extracted or OnlineStates(self.target, last=self.norm is not None)
        self.rows = rows
        self.log_path = out / "log.jsonl"
        self.layers_from = "train layers"  # where the target layers came from (the stats say)

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step on the step's seeded batch (the same on every rank and rerun)."""
        s = self.settings
        rows, anchors = self.batch(step)
        # DDP averages the ranks' gradients: each rank divides its share by the whole batch's
        # weight total / world, so a step equals one process training on the whole batch
        # the target's labels are argmaxes over the head's (draft) rows: inside it, all
        inside = self.vocab.inside if self.vocab and self.norm is None else None
        normalizer = loss_weight_total(rows, anchors, self.weights.cpu().numpy(),
                                       inside) / self.world
        share = list(range(self.rank, len(rows), self.world))
        mine = [rows[k] for k in share or [0]]  # a rank without rows still joins the all-reduce
        states = self.states(mine)
        if hasattr(self.states, "prefetch") and step + 1 < s.steps:  # asked while this trains
            ahead = self.batch(step + 1)[0]
            self.states.prefetch([ahead[k] for k in share or [0]])
        picks = [anchors[k] for k in share or [0]]
        states, labels = self._labels(mine, states, picks)
        batch = make_batch(mine, states, picks, s.block_size, self.mask_token_id, labels)
        loss, metrics = block_loss(self.model, self.embed, self.lm_head, batch, self.weights,
                                   normalizer=max(normalizer, 1e-6), vocab=self.vocab,
                                   selector_alpha=s.selector_loss_alpha)
        if labels is not None:  # how many of the supervised labels the target changed
            metrics["labels_changed"] = float(batch["labels_changed"] if share else 0)
            metrics["labels_total"] = float(batch["label_ok"].sum() if share else 0)
        if not share:
            loss = loss * 0.0
        if self.world > 1:  # log the whole batch's loss, not this rank's share of it
            import torch.distributed as dist

            whole = loss.detach().clone()
            dist.all_reduce(whole)
            metrics["loss"] = float(whole) / self.world
            if labels is not None:
                counts = self.torch.tensor([metrics["labels_changed"], metrics["labels_total"]],
                                           device=whole.device)
                dist.all_reduce(counts)
                metrics["labels_changed"], metrics["labels_total"] = map(float, counts.tolist())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = self.torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), s.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return {**metrics, "grad_norm": float(norm), "lr": self.scheduler.get_last_lr()[0]}

    def _labels(self, rows: list[dict[str, Any]], states: list[Any], picks: list[np.ndarray]
                ) -> tuple[list[Any], list[np.ndarray] | None]:
        """(the chosen layers' states, the labels): with labels = "target" the states end with
        the last layer's, which give the target's greedy tokens and are then dropped; with
        "data", the states as they are and None (make_batch reads the rows' tokens)."""
        if self.norm is None:
            return states, None
        labels = target_labels(rows, [st[:, -1] for st in states], picks,
                               self.settings.block_size, self.norm, self.lm_head, self.vocab)
        return [st[:, :-1] for st in states], labels

    def batch(self, step: int) -> tuple[list[dict[str, Any]], list[Any]]:
        """The step's rows and anchors: seeded by the step alone, so every rank and rerun (and
        a prefetch one step ahead) draws the same."""
        s = self.settings
        rng = np.random.default_rng([s.seed, step])
        picked = rng.choice(len(self.rows), size=min(s.batch_rows, len(self.rows)),
                            replace=False)
        rows = [self.rows[i] for i in picked]
        return rows, sample_anchors(rows, s.anchors_per_row, rng)

    def resume(self, directory: Path) -> dict[str, Any]:
        """Load the newest checkpoint (if any); returns its state ({} when starting afresh)."""
        if self.rank == 0:
            tidy_checkpoints(directory)
        found = list_checkpoints(directory)
        if not found:
            if self.rank == 0:  # starting afresh: a killed run's log is not this one's
                self.log_path.unlink(missing_ok=True)
            return {}
        latest = found[-1]
        state, weights, opt = checked_checkpoint(latest, set(self.drafter.state_dict()),
                                                 self.device)
        try:
            self.drafter.load_state_dict(weights)
            self.optimizer.load_state_dict(opt["optimizer"])
            self.scheduler.load_state_dict(opt["scheduler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointRefused(latest, f"its states do not fit this drafter ({exc})"
                                    ) from exc
        if self.rank == 0 and self.log_path.exists():
            kept = log_through(self.log_path, state["step"])
            write_text_atomic(self.log_path, "".join(f"{json.dumps(e)}\n" for e in kept))
        return state

    def fit(self, start: int, evaluate: TauEvaluator, checkpoints: Path,
            progress: bool | None, on_saved: Callable[[int], None]) -> None:
        """Steps `start`..settings.steps. Rank 0 logs each step, evaluates every `eval_every`
        steps and saves a checkpoint (with the evaluations so far) every `save_every` steps and
        at the end, then calls `on_saved` with the step; every rank takes part in each step."""
        s, lead = self.settings, self.rank == 0
        every = max(1, s.steps // 10)
        # the log sits in the partial directory, whose parent is the run
        record = progress_record(self.log_path.parent.parent, "train") if lead else None
        with progress_bar("train", total=s.steps - start, enabled=progress if lead else False,
                          record=record, unit="steps"
                          ) as bar, open(self.log_path, "a") as log:
            for step in range(start, s.steps):
                last = self.step(step)
                if not math.isfinite(last["loss"]):
                    raise StageError(f"train: the loss became {last['loss']} at step {step + 1}; "
                                     f"lower --lr (now {s.lr}) or check the hidden states")
                done = step + 1
                if lead:
                    log.write(json.dumps({"step": done, **{k: round(v, 6) for k, v in last.items()
                                                           if isinstance(v, float)}}) + "\n")
                    log.flush()
                    if done % every == 0:
                        bar.note(f"train: step {done}/{s.steps}: loss {last['loss']:.4f}, "
                                 f"offset-1 accuracy {last['acc_1']:.3f}, lr {last['lr']:.2e}")
                    if s.eval_every and done % s.eval_every == 0 and done < s.steps:
                        evaluate(done)
                    if done % s.save_every == 0 or done == s.steps:
                        save_checkpoint(checkpoints, done, self.drafter, self.optimizer,
                                        self.scheduler, {"eval": evaluate.history},
                                        s.keep_checkpoints)
                        on_saved(done)
                bar.advance(1)
