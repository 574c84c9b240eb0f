"""Training checkpoints: saved atomically beside the run's partial output, the newest few kept,
what a killed run left tidied away, and each checked against its own files before a rerun
resumes from it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.rundir import remove_tree, write_json_atomic

OPTIMIZER = "optimizer.pt"
CHECKPOINT_FILES = ("model.safetensors", "config.json", OPTIMIZER)


def list_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints (their state.json is written last), oldest first."""
    return sorted(p for p in directory.glob("step-*") if (p / "state.json").exists())


def tidy_checkpoints(directory: Path) -> None:
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


def save_checkpoint(directory: Path, step: int, drafter: Any, optimizer: Any, scheduler: Any,
                    state: dict[str, Any], keep: int) -> None:
    import torch

    final = directory / f"step-{step:06d}"
    tmp = directory / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               tmp / OPTIMIZER)
    # what resume checks the directory against (checked_checkpoint)
    files = {name: (tmp / name).stat().st_size for name in CHECKPOINT_FILES}
    write_json_atomic(tmp / "state.json", {**state, "step": step,
                                           "tensors": len(drafter.state_dict()), "files": files})
    if final.exists():
        remove_tree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(directory)[:-keep]:
        remove_tree(old)  # never half deleted: one with state.json would be resumed from


class CheckpointRefused(StageError):
    """A checkpoint that does not match its directory or its files: resuming from it would
    publish a drafter that is not what state.json says."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"cannot resume from the checkpoint {path}: {reason}. Delete that directory (the "
            "rerun then resumes from an older checkpoint, or starts afresh) or rerun with "
            "--force")


def checked_checkpoint(path: Path, expected_tensors: set[str], device: Any
                       ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(state, weights, optimizer file) of a checkpoint, each checked against the others and
    the directory: the step against the directory's name and the scheduler's step count, the
    files present (with the sizes state.json recorded), the tensors those the drafter has.
    CheckpointRefused says what does not match; a corrupt or non-weights file is refused the
    same way, never an unpickling traceback."""
    state = _checked_state(path)
    weights = _checked_weights(path, state, expected_tensors, device)
    return state, weights, _checked_optimizer(path, state["step"], device)


def _checked_state(path: Path) -> dict[str, Any]:
    """state.json, its step that of the directory's name, the files it recorded present with
    the sizes it recorded."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(path, f"state.json is not readable JSON ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointRefused(path, "state.json does not hold an object")
    step = state.get("step")
    named = path.name.removeprefix("step-")
    if not isinstance(step, int) or not named.isdigit() or int(named) != step:
        raise CheckpointRefused(path, f"state.json says step {step!r} but the directory is "
                                f"{path.name}")
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointRefused(path, f"{', '.join(missing)} missing")
    recorded = state.get("files")
    if recorded is not None:
        if not isinstance(recorded, dict):
            raise CheckpointRefused(path, "state.json's files is not an object")
        for name, size in recorded.items():
            actual = (path / name).stat().st_size if (path / name).is_file() else None
            if actual != size:
                raise CheckpointRefused(path, f"{name} has {actual} bytes, state.json recorded "
                                        f"{size}")
    return state


def _checked_weights(path: Path, state: dict[str, Any], expected_tensors: set[str],
                     device: Any) -> dict[str, Any]:
    """model.safetensors, holding the tensors state.json counted and the drafter has."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / "model.safetensors"), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointRefused(path, f"model.safetensors is not readable safetensors ({exc})"
                                ) from exc
    if state.get("tensors", len(weights)) != len(weights):
        raise CheckpointRefused(path, f"state.json records {state.get('tensors')!r} tensors, "
                                f"model.safetensors holds {len(weights)}")
    if set(weights) != expected_tensors:
        odd = sorted(set(weights) ^ expected_tensors)[:3]
        raise CheckpointRefused(path, f"model.safetensors holds {len(weights)} tensors, not the "
                                f"drafter's {len(expected_tensors)} (e.g. {odd}): another "
                                "drafter's checkpoint")
    return weights


def _checked_optimizer(path: Path, step: int, device: Any) -> dict[str, Any]:
    """The optimizer file, loaded as weights only, its scheduler at `step`."""
    import torch

    try:
        opt = torch.load(path / OPTIMIZER, map_location=device, weights_only=True)
    except Exception as exc:  # a corrupt zip, a truncated file, a pickle of other objects
        raise CheckpointRefused(
            path, f"{OPTIMIZER} is not an optimizer state torch loads as weights only "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if not (isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict)
            and isinstance(opt.get("scheduler"), dict)):
        raise CheckpointRefused(path, f"{OPTIMIZER} does not hold the optimizer and scheduler "
                                "states")
    if opt["scheduler"].get("last_epoch") != step:
        raise CheckpointRefused(path, f"its scheduler has made "
                                f"{opt['scheduler'].get('last_epoch')!r} steps, state.json says "
                                f"{step}")
    return opt


def log_through(path: Path, step: int) -> list[dict[str, Any]]:
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
