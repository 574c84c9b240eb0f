"""What SpecForge's offline DFlash trainer reads, and the config that trains on it.

Its offline reader walks a directory of `torch.save` records (any depth, sorted by name); its
normalizer wants `input_ids [seq]`, `loss_mask [seq]` and `hidden_states [1, seq, K*H]` (the K
chosen layers concatenated on the last axis, in layer order) and raises on a row without two
consecutive supervised tokens, so such rows are filtered here, with a reason. SpecForge's
`dflash_config.target_layer_ids` are 0-based decoder layers, like ours.
"""

from __future__ import annotations

import itertools
import shlex
from typing import Any

GROUP_ROWS = 2000  # SpecForge's own prepare script: rows_{g}-{g+2000}/data_{i}.ckpt
Q_NO_PAIR = "no_consecutive_supervised_tokens"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # extract's names


def record_name(row: int) -> str:
    group = row - row % GROUP_ROWS
    return f"rows_{group}-{group + GROUP_ROWS}/data_{row}.ckpt"


def has_consecutive_supervised(loss_mask: list[int]) -> bool:
    """What SpecForge's normalizer requires of a row (a DFlash block needs an anchor and a
    supervised token after it)."""
    return any(a and b for a, b in itertools.pairwise(loss_mask))


def record(input_ids: list[int], loss_mask: list[int], states: Any) -> dict[str, Any]:
    """One row's record; `states` is [seq, K, H] (dtype kept: bf16 stays bf16)."""
    import torch

    seq = len(input_ids)
    return {"input_ids": torch.tensor(input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
            # a copy of the row alone: a slice of a shard saved as it is keeps the shard's
            # whole storage in every file (torch.save writes the storage, not the view)
            "hidden_states": states.reshape(1, seq, -1).clone()}


def run_config(*, target: str, draft_config: str, features: str, seq_length: int,
               output_dir: str, gamma: float | None, states_dtype: str, embedding_key: str,
               lm_head_key: str | None) -> dict[str, Any]:
    """A SpecForge run config (its `Config` schema) for offline DFlash training on the export.

    The drafter's shape (layers, block size, the target layers it reads) is the draft config's
    alone: SpecForge's `model.draft_num_hidden_layers` would make it rebuild
    `dflash_config.target_layer_ids` by its own rule (`apply_dflash_overrides`), which trains
    on other layers than the features hold, silently where the count happens to match. The
    drafter is built in the features' dtype (SpecForge's default bf16 against fp32 features
    fails in the first matmul), and the target's embedding and head are named as the
    checkpoint names them (a vision-language target's sit under `model.language_model`)."""
    model: dict[str, Any] = {"target_model_path": target, "draft_model_config": draft_config,
                             "torch_dtype": TORCH_DTYPES[states_dtype],
                             "embedding_key": embedding_key}
    if lm_head_key is not None:  # tied: SpecForge reads the embedding as the head
        model["lm_head_key"] = lm_head_key
    training: dict[str, Any] = {"strategy": "dflash", "attention_backend": "sdpa"}
    if gamma is not None:
        training["loss_decay_gamma"] = gamma
    return {
        "model": model,
        "data": {"hidden_states_path": features, "max_length": seq_length},
        "training": training,
        "output_dir": output_dir,
    }


def train_command(config_path: str, gpus: int | None = None) -> str:
    """The launch line; `N` (the GPUs per node) where the export was not told `--gpus`."""
    return shlex.join(["torchrun", "--nproc-per-node", str(gpus) if gpus else "N", "-m",
                       "specforge.cli", "train", "--config", config_path])
