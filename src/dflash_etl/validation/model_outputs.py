"""The contracts of the model stages' outputs, which no contract file can state: extract's
hidden states (shape, finite, the tokenized rows' token ids, healthy layers) and train's drafter
(it loads, finite weights, tau in range). The shell's gate runs them on the partial output, as it
runs the contract files on ingest's and tokenize's; `dflash-etl check` runs them on a published
one."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core.errors import ContractError, StageError
from dflash_etl.core.outputs import HiddenStatesOutput
from dflash_etl.core.rundir import write_json_atomic
from dflash_etl.validation.contracts import read_arrow
from dflash_etl.validation.health import HealthLimits, all_finite, layer_health, shard_problems

Q_NON_FINITE = "non_finite_hidden_states"  # extract's quarantine reasons
Q_UNHEALTHY = "unhealthy_hidden_states"


class TokenIds(Mapping[int, list[int]]):
    """The tokenized rows' input_ids by row position, read one row at a time from the
    memory-mapped Arrow files: a dataset's ids as Python lists would be many times its size."""

    def __init__(self, files: list[Path]) -> None:
        self.column = pa.concat_tables([read_arrow(f).select(["input_ids"]) for f in files]
                                       ).column("input_ids")

    def __getitem__(self, row: int) -> list[int]:
        if not 0 <= row < len(self.column):
            raise KeyError(row)
        return self.column[row].as_py()

    def __len__(self) -> int:
        return len(self.column)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.column)))


def validate_model_output(contract: str, stage_dir: Path, params: dict[str, Any]) -> None:
    """The contract the stage registry names (hidden_states, drafter) on a partial output."""
    checks = {"hidden_states": validate_hidden_states, "drafter": validate_drafter}
    if contract not in checks:
        raise ValueError(f"no model-output contract named {contract!r} (known: {list(checks)})")
    checks[contract](stage_dir, params)


# what to do about the reason most of extract's rows were quarantined for
NO_ROWS_HINTS = {
    Q_NON_FINITE: "the target computes non-finite states: try --dtype fp32",
    Q_UNHEALTHY: "the shards' health check failed: see the problems above and "
                 "extract/stats.json's health",
}


def no_rows_kept(total: dict[str, Any]) -> str:
    """Why extract kept no row, from the reasons its rows were quarantined for (not a guess)."""
    reasons = Counter(total.get("quarantine_reasons") or {})
    lines = [f"extract kept no rows of {total.get('rows_in')}: quarantined {dict(reasons)}"]
    lines += [f"{reason}: {NO_ROWS_HINTS[reason]}" for reason, _ in reasons.most_common()
              if reason in NO_ROWS_HINTS]
    return "; ".join(lines)


def health_advice(problems: list[str]) -> str:
    """What to do, for the kinds of problem found (validation/health.py's wording)."""
    advice = []
    if any("zero" in p or "run alone" in p for p in problems):
        advice.append("States that are zeros or differ from the same row run alone are wrong "
                      "even though finite: check the target's architecture support, or "
                      "--batch-tokens 1 to rule padding out.")
    if any("scaled or cast" in p for p in problems):
        advice.append("States far from the target's own scale on the spot-check row: a server "
                      "changed since the check (restarted with other settings) or scales its "
                      "states; check each server's flags and dtype, then rerun.")
    return " ".join(advice)


def validate_hidden_states(stage_dir: Path, params: dict[str, Any]) -> None:
    """The gate of an extract output (its stats.json written): the shards' health, a kept row,
    then the contract against the tokenized rows (`params["dataset"]`: its Arrow files);
    contract.json says what it found."""
    doc = json.loads((stage_dir / "stats.json").read_text())
    unhealthy = doc["health"]["problems"]
    if unhealthy:
        raise ContractError(
            "the extract health check failed (their rows are quarantined "
            f"{Q_UNHEALTHY}):\n  - " + "\n  - ".join(unhealthy[:20]) + "\n"
            + health_advice(unhealthy), {"problems": unhealthy})
    if not pq.read_metadata(stage_dir / "index.parquet").num_rows:
        raise StageError(no_rows_kept(doc["total"]))
    total = doc["total"]
    problems = verify_states(stage_dir, TokenIds(params["dataset"]), len(total["stored_layers"]),
                             total["hidden_size"])
    _contract_report(stage_dir, "extract", problems)


def validate_drafter(stage_dir: Path, params: dict[str, Any]) -> None:
    """The gate of a train output (its stats.json written): the drafter and its eval.json."""
    block_size = json.loads((stage_dir / "stats.json").read_text())["total"]["block_size"]
    _contract_report(stage_dir, "train", verify_drafter(stage_dir, int(block_size)))


def _contract_report(stage_dir: Path, stage: str, problems: list[str]) -> None:
    write_json_atomic(stage_dir / "contract.json", {"passed": not problems,
                                                    "problems": problems})
    if problems:
        raise ContractError(f"the {stage} contract failed:\n  - " + "\n  - ".join(problems),
                            {"problems": problems})


def verify_states(out: Path, rows: Mapping[int, list[int]], n_layers: int, hidden: int
                  ) -> list[str]:
    """The contract of an extract output: every indexed row's states are [length, layers, hidden],
    finite, and stored with token ids equal to the tokenized row. Returns the problems."""
    from safetensors import safe_open

    index = pq.read_table(out / "index.parquet").to_pylist()
    problems = []
    handles: dict[str, Any] = {}
    with contextlib.ExitStack() as files:
        for entry in index:
            if entry["shard"] not in handles:
                handles[entry["shard"]] = files.enter_context(
                    safe_open(str(out / "hidden_states" / entry["shard"]), "pt"))
            problems += _entry_problems(handles[entry["shard"]], entry, rows, n_layers, hidden)
            if len(problems) >= 20:
                break
    return problems


def check_states(out: Path) -> tuple[int, int, list[str]]:
    """`dflash-etl check` on an extract output: (rows, shard files, problems), against the
    tokenized dataset of the same run (../tokenize/dataset)."""
    states = HiddenStatesOutput.read(out)
    dataset = out.parent / "tokenize" / "dataset"
    files = sorted(dataset.glob("*.arrow"))
    if not files:
        return 0, 0, [f"no tokenized dataset at {dataset} to compare the token ids with"]
    problems = verify_states(out, TokenIds(files), len(states.stored_layers),
                             states.hidden_size)
    problems += health_problems(out, states.stored_layers, HealthLimits.for_dtype(states.dtype))
    index_rows = pq.read_metadata(states.index_file).num_rows
    return index_rows, len(list((out / "hidden_states").iterdir())), problems


def health_problems(out: Path, layers: list[int], limits: HealthLimits) -> list[str]:
    """The health check on published states, file by file (no model here, so no reference
    check): a layer of zeros is wrong however finite and well-shaped it is."""
    from safetensors import safe_open

    problems: list[str] = []
    for path in sorted((out / "hidden_states").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            health = layer_health(f.get_tensor("hidden_states"), layers)
        problems += [f"{path.name}: {p}" for p in shard_problems(health, None, limits)]
        if len(problems) >= 20:
            break
    return problems


def _entry_problems(f: Any, entry: dict[str, Any], rows: Mapping[int, list[int]], n_layers: int,
                    hidden: int) -> list[str]:
    """One index entry's problems: shape, finite values, token ids."""
    problems = []
    a, b = entry["offset"], entry["offset"] + entry["length"]
    states = f.get_slice("hidden_states")[a:b]
    tokens = f.get_slice("token_ids")[a:b].tolist()
    where = f"row {entry['row']} (id {entry['id']}, turn {entry['turn']})"
    if tuple(states.shape) != (entry["length"], n_layers, hidden):
        problems.append(f"{where}: states {tuple(states.shape)}, expected "
                        f"({entry['length']}, {n_layers}, {hidden})")
    elif not all_finite(states):
        problems.append(f"{where}: non-finite values")
    if tokens != rows.get(entry["row"]):
        problems.append(f"{where}: token ids differ from the tokenized row")
    return problems


def verify_drafter(out: Path, block_size: int) -> list[str]:
    """The contract of a train output: the drafter loads from its files with finite weights,
    and eval.json holds finite tau values within [1, block_size]."""
    import torch

    from dflash_etl.models.drafter import DFlashDrafter  # torch: loaded when a drafter is checked

    problems = []
    try:
        drafter = DFlashDrafter.load(out / "drafter")
        if not all(bool(torch.isfinite(p).all()) for p in drafter.parameters()):
            problems.append("drafter/model.safetensors: non-finite weights")
    except Exception as exc:  # a broken file raises many types
        problems.append(f"drafter/: cannot load the drafter: {exc}")
    evaluation = json.loads((out / "eval.json").read_text())
    if evaluation.get("prompts") == 0 and not evaluation.get("history"):
        return problems  # [train] eval_prompts = 0: tau is `dflash-etl eval`'s
    for key in ("tau_untrained", "tau_final"):
        value = evaluation.get(key)
        if not isinstance(value, int | float) or not 1.0 <= value <= block_size:
            problems.append(f"eval.json: {key} = {value!r}, expected a number in "
                            f"[1, {block_size}]")
    return problems


def check_drafter(out: Path) -> tuple[int, int, list[str]]:
    """`dflash-etl check` on a train output: (rows trained on, checkpoints, problems)."""
    total = json.loads((out / "stats.json").read_text())["total"]
    from dflash_etl.models.training.checkpoints import list_checkpoints

    checkpoints = (len(list_checkpoints(out / "checkpoints"))
                   if (out / "checkpoints").is_dir() else 0)
    return total["rows_out"], checkpoints, verify_drafter(out, int(total["block_size"]))
