"""export: a finished run as the trainer the user deploys with reads it, and the command to run.

    dflash-etl export --run R --to speculators|specforge [--out DIR] [--link hard|symlink|copy]
    dflash-etl export --run R --to vllm      # prints the `vllm serve` line for the drafter
    python -m dflash_etl export --run R --to ...

speculators: one `--data-path` directory: the tokenized dataset's files hard-linked, and a file
per row of hidden states (the chosen layers, then the last one its loader wants), hard links to
extract's speculators-format files (no second copy unless `--link copy`) or, from the native
format, each row's slice of its shard written shard by shard. specforge: the `.ckpt` records
its offline reader takes, written shard by shard, plus its draft-model config and a run config.
Written to `<out>.partial`, checked (every row accounted, lengths, the layer count) and renamed
into place; `<out>/export.json` records what was exported and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import ContractError, StageError
from dflash_etl.core.lock import run_lock
from dflash_etl.core.outputs import DrafterOutput, HiddenStatesOutput, TokenizedOutput
from dflash_etl.core.progress import progress_bar
from dflash_etl.core.rundir import (
    OutputT,
    RunDir,
    StageRecord,
    now,
    remove_tree,
    swap_in,
    write_json_atomic,
)
from dflash_etl.handoff import specforge, speculators
from dflash_etl.models.loading import embedding_weight_names
from dflash_etl.models.serving import (
    attention_mismatch,
    aux_hidden_state_layer_ids,
    serve_notes,
    vllm_command,
)
from dflash_etl.stages import PIPELINE

TARGETS = ("speculators", "specforge")  # written; `vllm` only prints its serve line
LINKS = ("hard", "symlink", "copy")
RECORD = "export.json"  # also the marker: an --out directory without it is never replaced


def export(run_dir: str | Path, to: str, out: str | Path | None = None, link: str = "hard",
           progress: bool | None = None, gpus: int | None = None) -> dict[str, Any]:
    """Export the run for `to`; returns export.json's document (with the command to run, for
    `gpus` GPUs per node where given)."""
    if to not in TARGETS:
        raise StageError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    if link not in LINKS:
        raise StageError(f"--link {link!r}: choose one of {', '.join(LINKS)}")
    run = RunDir(Path(run_dir))
    if not run.manifest_path.exists():
        raise StageError(f"{run.root} is not a run directory (no manifest.json): give the --run "
                         "directory a `dflash-etl run` or stage wrote")
    final = Path(out) if out else run.root / "export" / to
    with _run_lock_unless_read_only(run.root, final, to):
        inputs = _inputs(run, to)
        inputs["gpus"] = gpus
        if final.exists() and not (final / RECORD).is_file():
            raise StageError(f"{final} exists and is not an export this tool wrote (no {RECORD}"
                             "): give another --out, or remove it yourself")
        partial = final.with_name(f".{final.name}.partial")
        remove_tree(partial)
        final.parent.mkdir(parents=True, exist_ok=True)
        _check_space(final.parent, _bytes_needed(inputs, to, link))
        partial.mkdir(parents=True)
        writer = _speculators if to == "speculators" else _specforge
        try:
            doc = writer(inputs, partial, final, link, progress)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            remove_tree(partial)  # the space it took goes back
            raise StageError(f"the disk of {final.parent} filled up while the export was "
                             f"written ({exc}); the partial export was removed: free space or "
                             "give --out on another disk") from exc
        doc.update({"to": to, "run": str(run.root.resolve()), "created_at": now()})
        _account(doc)
        write_json_atomic(partial / RECORD, doc)
        old = final.with_name(f".{final.name}.old")
        swap_in(partial, final, old)  # the run's own publish: never no export in place
        remove_tree(old)
    return doc


def _bytes_needed(inputs: dict[str, Any], to: str, link: str) -> int:
    """What the export writes, from extract's file sizes: SpecForge's records hold the chosen
    layers (not the last one extract keeps too) plus ids, mask and a header per row; speculators'
    files are links to a speculators-format extract's, or (native, or --link copy) its bytes."""
    import pyarrow.parquet as pq

    states: HiddenStatesOutput = inputs["states"]
    size = sum(p.stat().st_size for p in (states.stage_dir / "hidden_states").iterdir()
               if p.is_file())
    if to == "specforge":
        lengths = pq.read_table(states.index_file, columns=["length"]).column("length")
        return (int(size * len(states.layers) / len(states.stored_layers))
                + 16 * int(sum(lengths.to_pylist())) + 2048 * len(lengths))
    linked = states.format == "speculators" and link != "copy"
    return 0 if linked else size


def _check_space(directory: Path, need: int) -> None:
    from dflash_etl.core.progress import size_text

    free = shutil.disk_usage(directory).free
    if need > free:
        raise StageError(f"the export needs ~{size_text(need)} but {directory} has "
                         f"{size_text(free)} free: free space, or give --out on a disk with "
                         "room (nothing was written)")


@contextlib.contextmanager
def _run_lock_unless_read_only(root: Path, final: Path, to: str) -> Iterator[None]:
    """The run lock; a run on a read-only disk (an archived run) cannot take it, and needs none
    (nothing can write there either): the export then reads it unlocked, into an --out
    elsewhere."""
    with contextlib.ExitStack() as stack:
        try:
            if stale := stack.enter_context(run_lock(root, f"export {to}")):
                from dflash_etl.runner.lifecycle import settle

                # a stage whose process died (a killed --force rerun): settled as a stage would
                settle(RunDir(root), stale)
        except OSError as exc:  # taking the lock; the export's own errors are not caught here
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            if final.resolve().is_relative_to(root.resolve()):
                raise StageError(f"{root} is read-only ({exc.strerror}): give the export an "
                                 "--out directory on a writable disk") from exc
            print(f"export: {root} is read-only ({exc.strerror}): reading it without the run "
                  "lock", file=sys.stderr, flush=True)
        yield


# ---------------------------------------------------------------- the run's outputs
def _published(run: RunDir, kind: type[OutputT]) -> tuple[OutputT, StageRecord]:
    """The run's complete output of `kind`, or an error naming the stage to run."""
    found = run.published(kind)
    if found is None:
        stage = PIPELINE.writer(kind)
        raise StageError(f"{run.root}: the {stage} stage is not complete "
                         f"({run.record(stage).status or 'never run'}); run `dflash-etl {stage} "
                         f"--run {run.root}` first")
    return found


def _inputs(run: RunDir, to: str) -> dict[str, Any]:
    tokenized, _ = _published(run, TokenizedOutput)
    states, extracted = _published(run, HiddenStatesOutput)
    target = extracted.settings.get("model") or ""
    if to == "speculators" and states.stored_layers != [*states.layers, states.n_layers - 1]:
        raise StageError(
            f"{run.root}: extract stored layers {states.stored_layers} (an extract written "
            "before both formats kept the last layer); speculators reads the target's last "
            f"layer after the chosen ones {states.layers}. Rerun: dflash-etl extract --run "
            f"{run.root} --model {target or 'DIR'} --layers "
            f"{','.join(map(str, states.layers))} --force")
    if not Path(target, "config.json").is_file():
        raise StageError(f"extract's target model {target!r} has no config.json any more: the "
                         "export needs its vocabulary size and shape; restore it, or rerun "
                         "extract with --model DIR")
    trained = run.published(DrafterOutput)
    return {
        "run": run, "tokenized": tokenized,
        # absolute: the printed commands run from wherever the user is
        "states": states, "target": str(Path(target).resolve()),
        "drafter": trained[0] if trained else None,
        "train_settings": trained[1].settings if trained else {},
    }


def _dataset_files(dataset: Path) -> list[Path]:
    state = json.loads((dataset / "state.json").read_text())
    return [dataset / f["filename"] for f in state["_data_files"]]


def _dataset(tokenized: TokenizedOutput) -> Any:
    """The tokenized rows as one memory-mapped Arrow table (row i = the dataset's row i)."""
    import pyarrow as pa

    from dflash_etl.validation.contracts import read_arrow

    return pa.concat_tables([read_arrow(p).select(["input_ids", "loss_mask"])
                             for p in _dataset_files(tokenized.dataset_dir)])


def _drafter_shape(inputs: dict[str, Any]) -> tuple[int, int]:
    """(draft layers, block size) of the drafter the trainer is to train: the one this run
    trained, else train's settings as declared (what `dflash-etl train` would make)."""
    drafter: DrafterOutput | None = inputs["drafter"]
    if drafter is not None:
        return drafter.draft_layers, drafter.block_size
    from dflash_etl.stages.train import TrainSettings

    defaults = TrainSettings()
    return defaults.draft_layers, defaults.block_size


def _head(inputs: dict[str, Any], draft_vocab_size: int) -> dict[str, Any]:
    """Which head the printed speculators command trains: ours (train's `head_vocab`, from the
    run's drafter, else as declared), so both trainers train the same drafter; its rows."""
    from dflash_etl.stages.train import TrainSettings

    vocab = inputs["train_settings"].get("head_vocab") or TrainSettings().head_vocab
    if vocab == "draft":
        return {"vocab": vocab, "rows": draft_vocab_size, "why": "tokenize's draft vocabulary "
                "(t2d), as ours (head_vocab = \"draft\"): --draft-vocab-size, the exported "
                "d2t/t2d"}
    config = json.loads(Path(inputs["target"], "config.json").read_text())
    rows = int(config.get("text_config", {}).get("vocab_size") or config["vocab_size"])
    return {"vocab": vocab, "rows": rows, "why": "the target's whole LM head, as ours "
            "(head_vocab = \"full\"): no --draft-vocab-size"}


def _arch(inputs: dict[str, Any]) -> tuple[str, tuple[tuple[str, float], ...]]:
    """train's drafter (its arch; for DFlash2 its convolution and selector settings), so the
    printed speculators command trains the same kind of drafter as ours."""
    from dflash_etl.models.drafter import DFLASH2_SETTINGS
    from dflash_etl.stages.train import TrainSettings

    declared, defaults = inputs["train_settings"], TrainSettings()
    arch = declared.get("arch") or defaults.arch
    if arch != "dflash2":
        return arch, ()
    names = (*DFLASH2_SETTINGS, "selector_loss_alpha")
    return arch, tuple((n, declared.get(n, getattr(defaults, n))) for n in names)


def _link(source: Path, dest: Path, how: str) -> str:
    """`dest` as a hard link, symlink or copy of `source`; a hard link across file systems
    falls back to a symlink (said in export.json)."""
    if how == "hard":
        try:
            os.link(source, dest)
            return "hard"
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP):
                raise
            how = "symlink"
    if how == "symlink":
        dest.symlink_to(source.resolve())
        return "symlink"
    shutil.copy2(source, dest)
    return "copy"


# ---------------------------------------------------------------- speculators
def _speculators(inputs: dict[str, Any], partial: Path, final: Path, link: str,
                 progress: bool | None) -> dict[str, Any]:
    tokenized: TokenizedOutput = inputs["tokenized"]
    states: HiddenStatesOutput = inputs["states"]
    tok = tokenized.stage_dir
    d2t, t2d = tokenized.d2t_file.name, tokenized.t2d_file.name
    if not tokenized.d2t_file.is_file():
        raise StageError(f"{tokenized.d2t_file} is missing: rerun `dflash-etl tokenize --run "
                         f"{inputs['run'].root} --force`")
    used: set[str] = set()
    for path in sorted(tokenized.dataset_dir.iterdir()):
        if path.is_file():
            used.add(_link(path, partial / path.name, link))
    for name in ("token_freq.pt", d2t):
        used.add(_link(tok / name, partial / name, link))
    t2d_note = _t2d_for_target(tokenized.t2d_file, partial / t2d, inputs["target"], link, used)
    (partial / "hidden_states").mkdir()
    input_ids = _dataset(tokenized).column("input_ids")
    n_rows = len(input_ids)
    with progress_bar("export speculators", n_rows, progress) as bar:
        written, problems = _speculators_states(states, input_ids, partial / "hidden_states",
                                                link, used, bar)
    if problems:
        raise ContractError("the speculators export breaks its contract: " + "; ".join(problems))
    missing = n_rows - written
    drafter: DrafterOutput | None = inputs["drafter"]
    draft_layers, block_size = _drafter_shape(inputs)
    head = _head(inputs, tokenized.draft_vocab_size)
    arch, dflash2 = _arch(inputs)
    training = speculators.SpeculatorsTraining(
        target=inputs["target"], data_path=str(final.resolve()),
        save_path=str((final.parent / "speculators-drafter").resolve()), layers=states.layers,
        draft_vocab_size=tokenized.draft_vocab_size, draft_layers=draft_layers,
        block_size=block_size, seq_length=tokenized.seq_length,
        mask_token_id=drafter.mask_token_id if drafter else None,
        rows_without_states=missing, states_dtype=states.dtype, head_vocab=head["vocab"],
        arch=arch, dflash2=dflash2)
    return {
        "rows_in": n_rows, "rows_out": written,
        "rows_quarantined": missing, "quarantine_reasons": _extract_reasons(inputs, missing),
        "rows_filtered": {},
        "layers": states.layers,
        "aux_hidden_state_layer_ids": aux_hidden_state_layer_ids(states.layers),
        "stored_layers": states.stored_layers, "hidden_size": states.hidden_size,
        "draft_vocab_size": tokenized.draft_vocab_size, "t2d": t2d_note, "links": sorted(used),
        "head": head,
        "command": training.command(), "argv": training.argv(),
    }


def _speculators_states(states: HiddenStatesOutput, input_ids: Any, out: Path, link: str,
                        used: set[str], bar: Any) -> tuple[int, list[str]]:
    """A file per row into `out`: links to a speculators-format extract's files, or each row's
    slice of a native shard written alone, a shard at a time; (rows written, problems)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    want = [len(states.stored_layers), states.hidden_size]
    written, problems = 0, []

    def check(row: int, shape: list[int], same_ids: bool = True) -> None:
        expected = [len(input_ids[row]), *want]
        if (list(shape) != expected or not same_ids) and len(problems) < 5:
            problems.append(f"hs_{row}.safetensors: shape {list(shape)}, expected {expected}"
                            + ("" if same_ids else "; its token ids are not tokenize's"))

    if states.format == "speculators":  # already one file per row: linked, not copied
        for row in range(len(input_ids)):
            source = states.stage_dir / "hidden_states" / f"hs_{row}.safetensors"
            bar.advance()
            if source.is_file():
                with safe_open(str(source), framework="pt") as f:
                    check(row, f.get_slice("hidden_states").get_shape())
                used.add(_link(source, out / source.name, link))
                written += 1
        return written, problems
    for row, hidden_states, token_ids in _states_by_row(states, stored=True):
        bar.advance()
        check(row, list(hidden_states.shape), token_ids.tolist() == input_ids[row].as_py())
        save_file({"hidden_states": hidden_states.contiguous(),
                   "token_ids": token_ids.contiguous()}, str(out / f"hs_{row}.safetensors"))
        written += 1
    used.add("written from extract's native shards")
    return written, problems


def _t2d_for_target(source: Path, dest: Path, target: str, link: str, used: set[str]) -> str:
    """t2d must span the target's (padded) vocabulary, which speculators checks; tokenize sized
    it to its own model directory, which may be a tokenizer without config.json: pad it here."""
    import numpy as np

    from dflash_etl.models.tokenizer import model_vocab_size

    t2d = np.load(source)
    want, where = model_vocab_size(target, len(t2d))
    if want == len(t2d):
        used.add(_link(source, dest, link))
        return f"{len(t2d)} entries, the target's vocabulary ({where})"
    padded = np.zeros(want, dtype=bool)
    padded[: len(t2d)] = t2d
    np.save(dest, padded)
    return f"padded from {len(t2d)} (tokenize's) to {want}, the target's {where}"


def _extract_reasons(inputs: dict[str, Any], missing: int) -> dict[str, int]:
    reasons = dict(inputs["states"].quarantine_reasons)
    if sum(reasons.values()) != missing:
        raise ContractError(
            f"{missing} tokenized rows have no hidden states, but extract accounts for "
            f"{sum(reasons.values())} ({reasons}): the extract output is incomplete; rerun "
            f"`dflash-etl extract --run {inputs['run'].root} --force`")
    return reasons


# ---------------------------------------------------------------- specforge
def _states_by_row(states: HiddenStatesOutput, stored: bool = False) -> Any:
    """(row, states [seq, K, H], token_ids) for every extracted row, one shard at a time (K the
    chosen layers, or with `stored` every layer the file holds)."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    ext = states.stage_dir
    k = len(states.stored_layers) if stored else len(states.layers)
    if states.format == "speculators":
        for path in sorted((ext / "hidden_states").glob("hs_*.safetensors"),
                           key=lambda p: int(p.stem[3:])):
            data = load_file(str(path))
            yield int(path.stem[3:]), data["hidden_states"][:, :k], data["token_ids"]
        return
    index = pq.read_table(states.index_file).to_pylist()
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for entry in index:
        by_shard.setdefault(entry["shard"], []).append(entry)
    for shard in sorted(by_shard):
        data = load_file(str(ext / "hidden_states" / shard))
        for e in by_shard[shard]:
            span = slice(e["offset"], e["offset"] + e["length"])
            yield e["row"], data["hidden_states"][span, :k], data["token_ids"][span]


def _specforge(inputs: dict[str, Any], partial: Path, final: Path, link: str,
               progress: bool | None) -> dict[str, Any]:
    import torch

    tokenized: TokenizedOutput = inputs["tokenized"]
    extracted: HiddenStatesOutput = inputs["states"]
    table = _dataset(tokenized)
    n_rows = table.num_rows
    input_ids, loss_mask = table.column("input_ids"), table.column("loss_mask")
    layers, hidden = extracted.layers, extracted.hidden_size
    features = partial / "features"
    written, filtered, problems = 0, 0, []
    seen: set[int] = set()
    with progress_bar("export specforge", n_rows, progress) as bar:
        for row, states, token_ids in _states_by_row(extracted):
            bar.advance()
            seen.add(row)
            ids = input_ids[row].as_py()
            mask = loss_mask[row].as_py()
            if token_ids.tolist() != ids or tuple(states.shape) != (len(ids), len(layers),
                                                                    hidden):
                if len(problems) < 5:
                    problems.append(f"row {row}: hidden states {tuple(states.shape)} for "
                                    f"{len(ids)} tokens, or other token ids than tokenize's")
                continue
            if not specforge.has_consecutive_supervised(mask):
                filtered += 1
                continue
            path = features / specforge.record_name(row)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(specforge.record(ids, mask, states), path)
            written += 1
    if problems:
        raise ContractError("the specforge export breaks its contract: " + "; ".join(problems))
    missing = n_rows - len(seen)
    draft_config = _draft_config(inputs)
    write_json_atomic(partial / "dflash_draft_config.json", draft_config)
    drafter: DrafterOutput | None = inputs["drafter"]
    embedding_key, lm_head_key = embedding_weight_names(inputs["target"])
    config = specforge.run_config(
        target=inputs["target"], draft_config=str((final / "dflash_draft_config.json").resolve()),
        features=str((final / "features").resolve()), seq_length=tokenized.seq_length,
        output_dir=str((final.parent / "specforge-drafter").resolve()),
        gamma=drafter.loss_decay_gamma if drafter else None, states_dtype=extracted.dtype,
        embedding_key=embedding_key, lm_head_key=lm_head_key)
    write_json_atomic(partial / "specforge_run.json", config)
    return {
        "rows_in": n_rows, "rows_out": written, "rows_quarantined": missing,
        "quarantine_reasons": _extract_reasons(inputs, missing),
        "rows_filtered": {specforge.Q_NO_PAIR: filtered} if filtered else {},
        "layers": layers, "aux_hidden_state_layer_ids": aux_hidden_state_layer_ids(layers),
        "hidden_size": hidden, "dtype": extracted.dtype,
        "embedding_key": embedding_key,
        "command": specforge.train_command(str((final / "specforge_run.json").resolve()),
                                           inputs["gpus"]),
    }


def _draft_config(inputs: dict[str, Any]) -> dict[str, Any]:
    """The drafter SpecForge trains: the one this run trained when there is one (same layers,
    mask token, block), else one shaped from the target's config as train would make it."""
    layers = inputs["states"].layers
    drafter: DrafterOutput | None = inputs["drafter"]
    if drafter is None:
        from dflash_etl.models.drafter import DrafterConfig
        from dflash_etl.models.loading import load_config
        from dflash_etl.models.mask_token import resolve_mask_token
        from dflash_etl.models.target import text_config
        from dflash_etl.stages.train import TrainSettings

        target = inputs["target"]
        target_config = text_config(load_config(target))
        draft_layers, block_size = _drafter_shape(inputs)
        mask, _ = resolve_mask_token(target, target_config.vocab_size,
                                     TrainSettings().mask_token_id)
        config = DrafterConfig.from_target(
            target_config, draft_layers=draft_layers, target_layer_ids=layers,
            mask_token_id=mask, block_size=block_size).to_json()
    else:
        config = dict(drafter.config)
    if drafter is not None and (problem := attention_mismatch(
            config, drafter.drafter_dir / "config.json")):
        raise StageError(problem)
    if config["dflash_config"]["target_layer_ids"] != layers:
        raise StageError(f"the trained drafter reads layers "
                         f"{config['dflash_config']['target_layer_ids']} but extract stored "
                         f"{layers}: rerun train on this extract")
    config.setdefault("layer_types", ["full_attention"] * config["num_hidden_layers"])
    config.setdefault("hidden_act", "silu")
    config.setdefault("attention_bias", False)
    config.setdefault("tie_word_embeddings", False)
    return config


def _account(doc: dict[str, Any]) -> None:
    """Every tokenized row is exported, quarantined upstream or filtered here; none exported is
    an error that says why."""
    accounted = doc["rows_out"] + doc["rows_quarantined"] + sum(doc["rows_filtered"].values())
    if accounted != doc["rows_in"]:
        raise ContractError(f"the export accounts for {accounted} of {doc['rows_in']} rows")
    if not doc["rows_out"]:
        raise StageError(f"the export holds no rows: of {doc['rows_in']} tokenized rows "
                         f"{doc['rows_quarantined']} have no hidden states and "
                         f"{doc['rows_filtered']} were filtered (SpecForge needs two "
                         "consecutive supervised tokens per row)")


# ---------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.add_argument("--to", required=True, choices=(*TARGETS, "vllm"),
                   help="the trainer that reads it (vllm: print the serve line for the drafter)")
    p.add_argument("--out", default=None, help="where (default: <run>/export/<to>)")
    p.add_argument("--link", default="hard", choices=LINKS,
                   help="how the big files get there (speculators; default: hard links, "
                        "a symlink across file systems)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs per node for the printed SpecForge launch (default: N, to fill in)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    if args.to == "vllm":
        if args.out:  # nothing is written: an --out given would be silently ignored
            raise StageError("--to vllm prints the serve line and writes nothing: drop --out "
                             f"({args.out})")
        print(f"serve the drafter with:\n  {vllm_command(args.run)}"
              + "".join(f"\n{note}" for note in serve_notes(args.run)), flush=True)
        return 0
    if args.gpus is not None and args.gpus < 1:
        raise StageError(f"--gpus {args.gpus}: give the number of GPUs per node, 1 or more")
    doc = export(args.run, args.to, args.out, args.link, gpus=args.gpus)
    out = Path(args.out) if args.out else Path(args.run) / "export" / args.to
    print(f"export {args.to}: {doc['rows_out']} of {doc['rows_in']} rows -> {out}", flush=True)
    if doc["rows_quarantined"] or doc["rows_filtered"]:
        print(f"  not exported: {doc['quarantine_reasons']} upstream, {doc['rows_filtered']} "
              "filtered", flush=True)
    print(f"  layers: {doc['layers']} (decoder layers, 0-based: SpecForge, z-lab, vLLM's "
          f"dflash_config) = {doc['aux_hidden_state_layer_ids']} (embedding = 0: speculators)",
          flush=True)
    print(f"train with:\n  {doc['command']}", flush=True)
    if " N " in f" {doc['command']} ":
        print("  (N: the GPUs per node to train on; or give the export --gpus N)", flush=True)
    return 0
