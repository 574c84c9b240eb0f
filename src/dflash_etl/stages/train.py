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

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import DrafterOutput, HiddenStatesOutput, Output, TokenizedOutput
from dflash_etl.core.rundir import RunDir, StageRecord, Timer, sha256_file, write_json_atomic
from dflash_etl.core.settings import endpoint_list, fingerprinted, setting
from dflash_etl.core.stage import Stage, StageContext, counts_line, state_word
from dflash_etl.models.identity import model_identity
from dflash_etl.models.loading import placement
from dflash_etl.models.mask_token import resolve_mask_token
from dflash_etl.models.training.checkpoints import log_through
from dflash_etl.models.training.evaluation import TauEvaluator, eval_prompt, held_out_ids
from dflash_etl.models.training.loss import anchor_candidates
from dflash_etl.models.training.states import ExtractedStates
from dflash_etl.models.training.trainer import Trainer
from dflash_etl.runner.settings import stage_settings
from dflash_etl.stages.extract import ExtractStage
from dflash_etl.validation.contracts import read_arrow

STAGE = "train"
F_HELD_OUT = "held_out_for_eval"
STATE_SERVER = ("states_from", ("server",))  # the settings of --states-from server alone
DFLASH2 = ("arch", ("dflash2",))  # the settings of a DFlash2 drafter alone
F_NO_ANCHOR = "no_anchor"  # no position where the loss mask and its successor are both 1


@dataclass(frozen=True)
class TrainSettings:
    """[train] in pipeline.toml; CLI flags override it."""

    # its identity (its files) is fingerprinted, not its path: a moved run is not redone
    target: str = setting("", metavar="DIR", required="the target model", target=True,
                          path=True, fingerprint=False,
                          help="the target model directory (offline; default: [target] model)")
    draft_layers: int = setting(5, min=1, help="decoder layers of the drafter")
    block_size: int = setting(16, min=2, max=256,
                              why="a block needs the anchor and at least one token to predict; "
                                  "DFlash drafters use 8 or 16 (each step's work grows with it)",
                              help="anchor + tokens predicted per block")
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
    states_from: str = setting("target", choices=("target", "server"), applies=("online", (True,)),
                               help="--online: the states from the target loaded here, or from "
                                    "a hidden-states server (vLLM extract_hidden_states, as "
                                    "extract --backend server): --states-endpoint, --states-dir")
    states_endpoint: str = setting("", fingerprint=False, metavar="URL", applies=STATE_SERVER,
                                   help="--states-from server: the server's /v1 base")
    # a fleet, through the fleet client regenerate and extract use; its limits are [extract]'s
    states_endpoints: tuple[str, ...] = setting(
        (), metavar="URL,URL", fingerprint=False, applies=STATE_SERVER,
        help="--states-from server: several hidden-states servers of one "
        "model, comma-separated; each request goes to the least loaded healthy one, a failed "
        "one is taken out and its rows asked of another ([extract]'s concurrency, timeout_s, "
        "request_deadline_s, retries, cooldown_s; default: --states-endpoint)")
    states_dir: str = setting("", metavar="DIR", fingerprint=False, applies=STATE_SERVER,
                              help="--states-from server: the server's shared_storage_path (its "
                                   "files go there)")
    layers: str = setting("auto", metavar="auto|1,16,31",
                          help="target layer indices, or 'auto': extract's layers (offline: "
                               "those it stored; --online: [extract] layers and draft_layers "
                               "by extract's rule)")
    launcher: str = setting("none", fingerprint=False, choices=("none", "torchrun"),
                            help="torchrun: re-run this command under `python -m "
                                 "torch.distributed.run --standalone` (DDP, one node)")
    nproc_per_node: int = setting(0, min=0, fingerprint=False,
                                  applies=("launcher", ("torchrun",)),
                                  help="--launcher torchrun: processes (0: one per visible GPU, "
                                       "at least one)")
    dist_timeout_s: int = setting(1800, min=1, fingerprint=False,
                                  help="under torchrun: seconds a rank waits for the others "
                                       "before the run fails")
    eval_prompts: int = setting(16, min=0, help="held-out prompts for tau")
    eval_new_tokens: int = setting(48, min=1, help="tokens decoded per prompt")
    eval_every: int = setting(0, min=0, help="steps between evaluations (0: before and after "
                                             "training only)")
    eval_tree_budget: int = setting(0, min=0, fingerprint="unless_default",
                                    help="after training, tau also with DDTree verification of "
                                         "at most this many drafts (as eval --tree-budget; 0: "
                                         "the chain only)")
    save_every: int = setting(200, fingerprint=False, min=1, help="steps between checkpoints")
    keep_checkpoints: int = setting(2, fingerprint=False, min=1, help="checkpoints kept")
    dtype: str = setting("fp32", choices=("fp32", "bf16"),
                         help="the target's dtype (the drafter trains in fp32)")
    head_vocab: str = setting("full", choices=("full", "draft"),
                              help="the loss's vocabulary: the target's whole LM head, or only "
                                   "its rows of tokenize's draft vocabulary (t2d, as "
                                   "speculators' --draft-vocab-size; labels outside it are left "
                                   "out of the loss and counted)")
    # runs made before the setting (labels from the data) are not redone
    reply_check: str = setting("auto", choices=("auto", "off"), fingerprint=False,
                               applies=("online", (True,)),
                               help="--online: are the replies the target's? as extract's "
                                    "reply_check (offline, extract checked them)")
    labels: str = setting("data", choices=("data", "target"), fingerprint="unless_default",
                          help="what each block position learns to predict: the row's token "
                               "(data), or the target's greedy token there (target: the argmax "
                               "of its final norm and LM head over its last layer's state, as "
                               "speculators trains; the anchor stays the row's token)")
    # runs made before DFlash2 (a DFlash drafter) are not redone
    arch: str = setting("dflash", choices=("dflash", "dflash2"), fingerprint="unless_default",
                        help="the drafter: DFlash, or z-lab's DFlash2 (local convolutions around "
                             "each sublayer and a candidate selector; docs/stages/train.md)")
    conv_kernel_size: int = setting(2, min=1, applies=DFLASH2, fingerprint="unless_default",
                                    help="DFlash2: taps of each local convolution")
    conv_group_size: int = setting(16, min=1, applies=DFLASH2, fingerprint="unless_default",
                                   help="DFlash2: hidden channels sharing a dynamic kernel")
    selector_rank: int = setting(256, min=1, applies=DFLASH2, fingerprint="unless_default",
                                 help="DFlash2: rank of the candidate selector")
    selector_top_k: int = setting(16, min=1, applies=DFLASH2, fingerprint="unless_default",
                                  help="DFlash2: the LM head's candidates the selector rescores")
    selector_loss_alpha: float = setting(1.0, min=0, applies=DFLASH2,
                                         fingerprint="unless_default",
                                         help="DFlash2: weight of the selector's loss")
    device: str = setting("auto", fingerprint=False, choices=("auto", "cpu", "cuda", "cuda:N"),
                          help="where the target and the drafter run")
    device_map: str = setting("none", fingerprint=False, choices=("none", "auto"),
                              help="'auto': place the target's layers over the visible GPUs, "
                                   "then the CPU (the drafter runs with the embedding)")
    max_memory: str = setting("", fingerprint=False, metavar="0=70GiB,1=70GiB,cpu=200GiB",
                              help="with --device-map auto: the memory each device may hold "
                                   "(default: accelerate's estimate of what is free)")

    def __post_init__(self) -> None:
        """The placement, and what a server's states need, checked before any work."""
        object.__setattr__(self, "states_endpoints", endpoint_list(self.states_endpoints))
        placement(self.device_map, self.max_memory)
        if self.arch == "dflash2" and self.head_vocab == "draft":
            raise StageError("[train] arch = \"dflash2\" needs the whole LM head (its selector "
                             "scores token ids of the target's vocabulary, as z-lab's and "
                             "speculators' DFlash2 require): use head_vocab = \"full\"")
        if self.states_from == "server" and not (
                self.online and (self.states_endpoint or self.states_endpoints)
                and self.states_dir):
            raise StageError("--states-from server needs --online, --states-endpoint URL (the "
                             "hidden-states server's /v1 base; --states-endpoints URL,URL for "
                             "several) and --states-dir DIR (its "
                             "shared_storage_path); train prints the `vllm serve` line that "
                             "starts such a server")
        if self.eval_tree_budget and not self.eval_prompts:
            raise StageError("[train] eval_tree_budget needs held-out prompts to decode: set "
                             "eval_prompts > 0, or measure the tree with `dflash-etl eval "
                             "--tree-budget` after training")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else max(1, round(0.04 * self.steps))



def _read_index(path: Path) -> list[dict[str, Any]]:
    """extract's index.parquet: row -> shard, offset, length."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# ---------------------------------------------------------------- shell
def target_layers(ctx: StageContext, settings: TrainSettings,
                  extracted: HiddenStatesOutput | None) -> tuple[list[int], str]:
    """The target layers the drafter reads, and where they come from (recorded in the stats).
    One rule for both modes: extract's. Offline they are the layers the extract output holds
    (train's explicit --layers must name the same ones); online, train's explicit --layers,
    else the config's [extract] layers/draft_layers resolved as extract resolves them, so an
    online run of a config trains on what an offline run of it would."""
    from dflash_etl.models.layers import resolve_layers
    from dflash_etl.models.target import parse_layers

    if extracted is not None:
        stored = list(extracted.layers)
        if settings.layers != "auto":
            asked = parse_layers(settings.layers, extracted.n_layers, len(stored))
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
    ext = stage_settings(ExtractStage, ctx.config, ctx.run.root, {"model": settings.target})
    return (resolve_layers(ext.layers, ext.model, ext.draft_layers),
            f"[extract] layers = {ext.layers!r}, draft_layers = {ext.draft_layers} (extract's "
            "rule, as an offline run of this config)")


def _load_rows(tokenized: TokenizedOutput, run: RunDir) -> list[dict[str, Any]]:
    files = tokenized.dataset_files()
    table = pa.concat_tables([read_arrow(f).select(["input_ids", "loss_mask", "id", "source",
                                                    "turn"]) for f in files])
    rows = table.to_pylist()
    for position, row in enumerate(rows):
        row["row"] = position
        if len(row["loss_mask"]) != len(row["input_ids"]):  # would crash mid-run when sampled
            raise StageError(
                f"tokenized row {row['id']!r} (row {position} of the dataset in "
                f"{files[0].parent}): loss_mask has {len(row['loss_mask'])} entries for "
                f"{len(row['input_ids'])} input_ids; the tokenized output is corrupt: `dflash-etl "
                f"check {run.root}` shows it, `dflash-etl tokenize --run {run.root} "
                "--force` remakes it")
    return rows


def _t2d_file(tokenized: TokenizedOutput) -> Path:
    """tokenize's t2d map (its typed output names it), for --head-vocab draft."""
    t2d = tokenized.t2d_file
    if not t2d.is_file():
        raise StageError(f"--head-vocab draft: {t2d} is missing; rerun tokenize")
    return t2d


def _require_last_layer(extracted: HiddenStatesOutput) -> None:
    """labels = "target" reads the last decoder layer's states, stored after the chosen ones."""
    if extracted.stored_layers != [*extracted.layers, extracted.n_layers - 1]:
        raise StageError(
            f"[train] labels = \"target\" needs the target's last layer ({extracted.n_layers - 1})"
            f" in the extract output, which stores layers {extracted.stored_layers} (an extract "
            "made before it stored the last one): rerun `dflash-etl extract --force`, train "
            "--online, or use labels = \"data\"")


def _head_only(settings: TrainSettings) -> bool:
    """Whether the trainer needs only the target's embedding and LM head: its states come from
    a server, no tau is measured here and the labels are the data's. A 27B target's decoder then
    stays on the serving node."""
    return (settings.online and settings.states_from == "server"
            and not settings.eval_prompts and settings.labels == "data")


def _server_states(settings: TrainSettings, target: Any, extract: Any, probe: list[int],
                   last: bool = False, reference: bool = True) -> Any:
    """train --online --states-from server: the batches' states from hidden-states servers,
    through extract's server client (its checks, the fleet client's failover, retries and
    deadlines), with [extract]'s limits and served model (`extract`: its settings); each
    server spot-checked on `probe` against the loaded target first (`reference` False: the
    target here is its head only; the check loads the target where it fits, as extract's)."""
    from dflash_etl.models.states_server import (
        PROBE_TOKENS,
        ServerTarget,
        serve_command,
        spot_check,
    )
    from dflash_etl.models.training.states import ServerStates

    client = replace(extract, model=settings.target, backend="server", dtype=settings.dtype,
                     endpoint=settings.states_endpoint, endpoints=settings.states_endpoints,
                     states_dir=settings.states_dir)
    print(f"train: the states come from the server(s) at {', '.join(client.servers)}, each "
          "started as:\n  " + serve_command(client.served_model or settings.target,
                                             target.layers, target.n_layers,
                                             settings.states_dir),
          file=sys.stderr, flush=True)
    spot_check(client, target.layers, target.n_layers, target.hidden, probe[:PROBE_TOKENS],
               reference=target if reference else None, stage="train")
    return ServerStates(ServerTarget(client, target.layers, target.n_layers, target.hidden),
                        last=last)


def _fingerprint_payload(settings: TrainSettings, files: list[Path],
                         extract_fp: str | None, layers: list[int] | None = None
                         ) -> dict[str, Any]:
    payload = {"settings": fingerprinted(settings), "inputs": [sha256_file(f) for f in files],
               "extract": extract_fp, "model": model_identity(settings.target)}
    if layers is not None:  # online: [extract] may choose them (offline: extract_fp covers them)
        from dflash_etl.models.layers import layer_state_identity, target_layer_count

        payload["layers"] = layers
        payload.update(layer_state_identity(layers, target_layer_count(settings.target)))
    return payload


def _split(rows: list[dict[str, Any]], settings: TrainSettings
           ) -> tuple[list[dict[str, Any]], list[list[int]], dict[str, Stats]]:
    """Training rows, evaluation prompts and the per-source accounting of the split."""
    held = held_out_ids([r["id"] for r in rows], settings.eval_prompts, settings.seed)
    train_rows, prompts, per_source = [], [], {}
    for row in rows:
        stats = per_source.setdefault(row["source"], Stats(extra={"tokens": 0,
                                                                  "supervised_tokens": 0}))
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
            stats.extra["supervised_tokens"] += int(sum(row["loss_mask"]))  # what it trains on
            train_rows.append(row)
    return train_rows, prompts[:settings.eval_prompts], per_source


def _rows_extracted(rows: list[dict[str, Any]], index: list[dict[str, Any]], run: RunDir
                    ) -> list[dict[str, Any]]:
    """The rows extract stored states of (it quarantined the others), each checked against the
    length extract's index gives it."""
    lengths = {e["row"]: e["length"] for e in index}
    rows = [r for r in rows if r["row"] in lengths]
    for r in rows:
        if lengths[r["row"]] != len(r["input_ids"]):
            raise StageError(
                f"extract's index gives row {r['row']} ({r['id']!r}) {lengths[r['row']]} "
                f"tokens, tokenize {len(r['input_ids'])}: the hidden states are of other rows "
                f"than the tokenized ones (tokenize was redone since?); rerun `dflash-etl "
                f"extract --run {run.root} --force`")
    return rows


class TrainStage(Stage):
    """Hidden states (or the target, online) -> a DFlash drafter and its tau. Under torchrun
    every rank runs it (the runner joins them: ctx.rank, ctx.world) and trains on its share of
    each step's batch (DDP); rank 0 alone owns the run directory (lock, partial, publish).
    Offline it reads extract's hidden states too; online the target computes them."""

    name: ClassVar[str] = STAGE
    help: ClassVar[str] = "hidden states -> a DFlash drafter, with its tau"
    Settings: ClassVar[type] = TrainSettings
    reads: ClassVar[tuple[type[Output], ...]] = (TokenizedOutput,)
    writes: ClassVar[type[DrafterOutput]] = DrafterOutput
    settings: TrainSettings

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []  # the tokenized rows it trains and evaluates on
        self.extracted: HiddenStatesOutput | None = None  # offline: extract's output
        self.index: list[dict[str, Any]] = []  # offline: its index (row -> shard)
        self.layers: list[int] = []
        self.layers_from = ""  # where the layers came from, in words
        self.t2d: np.ndarray | None = None  # --head-vocab draft: tokenize's t2d map
        self.generated_with: dict[str, Any] | None = None  # how regenerate made the replies

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings = self.settings
        tokenized = ctx.read(TokenizedOutput)
        self.generated_with = (tokenized.stats().get("on_policy") or {}).get("generated_with")
        self.rows = _load_rows(tokenized, ctx.run)
        files = tokenized.dataset_files()
        if settings.head_vocab == "draft":
            t2d_file = _t2d_file(tokenized)
            files = [*files, t2d_file]
            self.t2d = np.load(t2d_file)
        extract_fp = None
        if not settings.online:
            self.extracted = ctx.read(
                HiddenStatesOutput, hint=", or train with --online to compute the hidden states "
                                         "from the target")
            # the states by content where extract records it: another format is the same input
            record = ctx.run.record(self.extracted.stage_dir.name)
            extract_fp = record.content or record.fingerprint
            self.index = _read_index(self.extracted.index_file)
            self.rows = _rows_extracted(self.rows, self.index, ctx.run)
            if settings.labels == "target":
                _require_last_layer(self.extracted)
        self.layers, self.layers_from = target_layers(ctx, settings, self.extracted)
        return _fingerprint_payload(settings, files, extract_fp,
                                    None if self.extracted else self.layers)

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        call = Timer()  # this call's seconds, recorded with each checkpoint (see _train)
        settings, rows, extracted = self.settings, self.rows, self.extracted
        train_rows, prompts, per_source = _split(rows, settings)
        if not train_rows:
            held = sum(s.rows_filtered.get(F_HELD_OUT, 0) for s in per_source.values())
            raise StageError(f"train has no rows to train on: of {len(rows)} rows, {held} are "
                             "held out for evaluation and the rest have no two consecutive "
                             "supervised tokens to anchor a block; check the tokenize stage's "
                             "masks or lower --eval-prompts")
        if not prompts and settings.eval_prompts:
            raise StageError("train has no evaluation prompts: no held-out row has a prompt "
                             "before its first supervised token; raise --eval-prompts (now "
                             f"{settings.eval_prompts}) or check the tokenize stage's masks")
        states = (ExtractedStates(extracted.stage_dir, len(extracted.layers), self.index,
                                  hidden_size=extracted.hidden_size,
                                  last=settings.labels == "target") if extracted else None)
        head_only = _head_only(settings)
        trainer = Trainer(settings, train_rows, states, self.layers, ctx.partial,
                          ctx.rank, ctx.world, draft_vocab=self.t2d,
                          mask_token=resolve_mask_token, head_only=head_only)
        trainer.layers_from = self.layers_from
        replies = None  # online, nothing before read the replies (extract does, offline)
        if settings.online and ctx.rank == 0 and settings.reply_check != "off":
            from dflash_etl.models.reply_check import check_replies, replies_origin, sample

            origin = replies_origin(self.generated_with, model_identity(settings.target))
            # head only: no decoder here to measure them (as extract --backend server)
            picked = [] if head_only else [
                train_rows[k] for k in sample([len(r["input_ids"]) for r in train_rows])]
            replies = check_replies(picked, origin, target=trainer.target)
        if settings.online and settings.states_from == "server":
            trainer.states = _server_states(settings, trainer.target, stage_settings(
                ExtractStage, ctx.config, ctx.run.root, {"model": settings.target}),
                train_rows[0]["input_ids"], last=settings.labels == "target",
                reference=not head_only)
        try:
            doc, timing = _train(trainer, ctx.run, settings, prompts, per_source, ctx.partial,
                                 ctx.rank, ctx.progress, call)
            if replies:
                doc["replies"] = replies
                doc["warnings"] = [*doc.get("warnings", []), *filter(None, [replies["warning"]])]
            ctx.timings.update(timing)
            if timing:  # how much of the training this call did: the run's record, not data
                ctx.call_totals["steps_this_run"] = timing["steps_this_run"]
            served = getattr(trainer.states, "requested", None)
            if served is not None:  # this call's: how much of the server's work came ahead
                ctx.call_totals["states_server"] = {
                    "rows_requested": served, "rows_prefetched": trainer.states.prefetched,
                    "servers": trainer.states.server.fleet.server_figures()}
            return doc
        finally:
            trainer.states.close()

    def end(self, ctx: StageContext) -> None:
        if ctx.rank == 0:
            from dflash_etl.models.serving import serve_notes, vllm_command

            print(f"train: serve the drafter with:\n  {vllm_command(ctx.run.root)}" + "".join(
                f"\ntrain: {note}" for note in serve_notes(ctx.run.root)), file=sys.stderr,
                flush=True)

    @classmethod
    def summary(cls, doc: dict[str, Any], record: StageRecord, out: Path) -> list[str]:
        total = doc["total"]  # timings are the manifest's, not stats.json's (which is data)
        return [f"train {state_word(doc)}: rows {counts_line(total)}",
                f"  {total.get('steps')} steps ({total.get('steps_this_run')} this run, "
                f"{record.get('steps_per_s')} steps/s), final loss {total.get('final_loss')}, "
                f"{total.get('drafter_parameters')} drafter parameters",
                f"  acceptance length tau on {total.get('eval_prompts')} held-out prompts: "
                f"{_fmt(total.get('tau_untrained'))} untrained -> {_fmt(total.get('tau_final'))}"
                f" trained (block {total.get('block_size')})" if total.get('eval_prompts') else
                "  acceptance length tau: not measured here ([train] eval_prompts = 0); "
                f"measure it with `dflash-etl eval --run {out.parent}`",
                *([f"  with DDTree verification of <= {tree['budget']} drafts: tau "
                   f"{_fmt(tree['tau'])} ({tree['nodes_per_step']} tokens verified per step)"]
                  if (tree := total.get("tau_tree")) else []),
                f"  drafter: {out / 'drafter'}",
                f"  eval:    {out / 'eval.json'}"]


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


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
    ckpt_dir = partial / "checkpoints"
    ckpt_dir.mkdir(exist_ok=True)
    state = trainer.resume(ckpt_dir)
    start = state.get("step", 0)
    earlier = _earlier_seconds(run, start) if rank == 0 else 0.0
    tau = TauEvaluator(trainer.target, trainer.drafter, prompts, settings.eval_new_tokens,
                       state.get("eval", []))
    if rank == 0:
        run.update_stage(STAGE, settings=asdict(settings), mask_token_id=trainer.mask_token_id,
                         mask_token=trainer.mask_reason, layers=trainer.target.layers,
                         layers_from=trainer.layers_from)
        if not tau.history:
            tau(0)
        if start:
            print(f"train: resuming from the checkpoint of step {start}", file=sys.stderr,
                  flush=True)
    timer = Timer()
    trainer.fit(start, tau, ckpt_dir, progress, lambda done: _record_checkpoint_seconds(
        run, done, earlier + call.seconds, settings.keep_checkpoints))
    seconds = timer.seconds
    if rank:
        return {}, {}
    if not tau.history or tau.history[-1]["step"] != settings.steps:
        tau(settings.steps)
    trainer.drafter.save(partial / "drafter")
    if not prompts:
        print(f"train: tau: not measured here ([train] eval_prompts = 0); measure the drafter "
              f"with `dflash-etl eval --run {run.root}`", file=sys.stderr, flush=True)
    evaluation = tau.document(settings.block_size)
    if settings.eval_tree_budget:
        evaluation["tree"] = tau.tree(settings.eval_tree_budget)
    write_json_atomic(partial / "eval.json", evaluation)
    doc = _stats_document(trainer, settings, per_source, evaluation)
    trained = settings.steps - start
    return doc, {"steps_per_s": round(trained / seconds, 3) if seconds and trained else None,
                 "steps_this_run": trained, "earlier_seconds": earlier,
                 "seconds_this_run": round(call.seconds, 3), "checkpoint_seconds": None}


def _stats_document(trainer: Trainer, settings: TrainSettings, per_source: dict[str, Stats],
                    evaluation: dict[str, Any]) -> dict[str, Any]:
    """stats.json: the rows' accounting, what was trained and how it scored."""
    from dflash_etl.models.drafter import parameter_count

    doc = stats_document(per_source, STAGE)
    # the last step's loss as logged: the same whether this run made that step or resumed
    # after it (stats.json is data: byte-identical however often the run was interrupted)
    logged = log_through(trainer.log_path, settings.steps)
    final_loss = logged[-1].get("loss") if logged else None
    doc["total"].update({
        "steps": settings.steps,
        "final_loss": round(final_loss, 4) if final_loss is not None else None,
        "tau_untrained": evaluation["tau_untrained"], "tau_final": evaluation["tau_final"],
        "eval_prompts": evaluation["prompts"], "draft_layers": settings.draft_layers,
        "block_size": settings.block_size, "target_layers": trainer.target.layers,
        "target_layers_from": trainer.layers_from,
        "mask_token_id": trainer.mask_token_id, "online": settings.online,
        "target_loaded": "embedding and head" if _head_only(settings) else "whole",
        "drafter_parameters": parameter_count(trainer.drafter), "labels": settings.labels,
        "arch": settings.arch,
    })
    if "tree" in evaluation:
        doc["total"]["tau_tree"] = evaluation["tree"]
    if settings.labels == "target":  # the supervised labels the target's tokens changed
        changed = sum(e.get("labels_changed", 0.0) for e in logged)
        total = sum(e.get("labels_total", 0.0) for e in logged)
        doc["total"]["labels_from_target"] = {
            "changed": int(changed), "supervised": int(total),
            "share_changed": round(changed / total, 6) if total else 0.0}
    if trainer.vocab is not None:  # the labels the loss left out, over every logged step
        outside = sum(e.get("outside_draft_vocab", 0.0) for e in logged)
        inside = sum(e.get("inside_draft_vocab", 0.0) for e in logged)
        doc["total"]["draft_vocab"] = {
            "size": trainer.vocab.size, "labels_outside": int(outside),
            "labels_inside": int(inside),
            "share_outside": round(outside / (outside + inside), 6) if outside + inside else 0.0}
    return doc


def _record_checkpoint_seconds(run: RunDir, step: int, seconds: float, keep: int) -> None:
    """The stage's seconds up to checkpoint `step`, all calls together (the newest few)."""
    recorded = run.record(STAGE).get("checkpoint_seconds") or {}
    recorded = {**recorded, str(step): round(seconds, 3)}
    newest = sorted(recorded, key=int)[-(keep + 1):]
    run.update_stage(STAGE, checkpoint_seconds={k: recorded[k] for k in newest})


def _earlier_seconds(run: RunDir, start: int) -> float:
    """The seconds the earlier calls spent up to checkpoint `start` (0 when starting afresh;
    a checkpoint saved just before a kill but not yet recorded counts the one before it)."""
    if not start:
        return 0.0
    recorded = run.record(STAGE).get("checkpoint_seconds") or {}
    steps = [int(k) for k in recorded if str(k).isdigit() and int(k) <= start]
    return float(recorded[str(max(steps))]) if steps else 0.0
