"""`[train] labels = "target"`: the token the target itself writes at each position a block
predicts (greedy), instead of the row's token. It is the argmax of the target's final norm and
LM head over its last decoder layer's state at the position before, the state extract stores
after the chosen layers (and the online sources compute). speculators trains its DFlash
drafters on these labels; verification accepts exactly them, so they are what tau rewards."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_etl.core.errors import StageError


def final_norm(model: Any) -> Any:
    """The target's final norm, which its decoder applies after the last layer and before the
    LM head (`get_decoder().norm`: Llama, Qwen2/3, Qwen3.5's language model, ...)."""
    import contextlib

    decoder = None
    with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
        decoder = model.get_decoder()
    norm = getattr(decoder, "norm", None)
    if norm is None or not callable(norm):
        raise StageError(f"[train] labels = \"target\": {type(model).__name__} has no final norm "
                         "at get_decoder().norm, so its greedy tokens cannot be computed from "
                         "the last layer's state; use labels = \"data\"")
    weight = getattr(norm, "weight", None)
    if weight is not None and weight.device.type == "meta":
        raise StageError("[train] labels = \"target\": the device map offloaded the target's "
                         "final norm; raise --max-memory so it stays on a device")
    return norm


def predicted_positions(loss_mask: Any, picks: np.ndarray, block_size: int) -> np.ndarray:
    """The supervised positions the blocks at `picks` predict: anchor + k, 1 <= k < block_size,
    inside the row (sorted, each once)."""
    mask = np.asarray(loss_mask, dtype=bool)
    at = (np.asarray(picks, dtype=np.int64)[:, None] + np.arange(1, block_size)).ravel()
    at = np.unique(at[at < len(mask)])
    return at[mask[at]]


def greedy_tokens(states: Any, norm: Any, head: Any, vocab: Any = None) -> Any:
    """argmax(head(norm(state))) per row of `states` [n, hidden] (token ids, on the CPU), a
    chunk of positions at a time within drafter.LOGIT_BUDGET floats; with a draft `vocab`, over
    its rows of the head only (as speculators), mapped back to target token ids."""
    import torch

    from dflash_etl.models.drafter import logit_chunk

    weight, bias = (head.weight, getattr(head, "bias", None)) if vocab is None \
        else vocab.head(head)
    norm_weight = getattr(norm, "weight", None)
    where = (norm_weight.device, norm_weight.dtype) if norm_weight is not None \
        else (weight.device, weight.dtype)
    step = logit_chunk(weight.shape[0])
    picked = []
    with torch.no_grad():
        for start in range(0, states.shape[0], step):
            x = norm(states[start:start + step].to(*where)).to(weight.device, weight.dtype)
            picked.append(torch.nn.functional.linear(x, weight, bias).argmax(-1).cpu())
    index = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
    return index if vocab is None else vocab.rows[index]


def target_labels(rows: list[dict[str, Any]], last: list[Any], picks: list[np.ndarray],
                  block_size: int, norm: Any, head: Any, vocab: Any = None) -> list[np.ndarray]:
    """Per row: its input ids, with every supervised position a block predicts replaced by the
    target's greedy token there, from `last` [seq, hidden] (its last layer's states): the
    token at p is read off the state at p - 1. The other positions keep the row's tokens
    (the anchors among them: a block starts from the data token)."""
    import torch

    positions = [predicted_positions(row["loss_mask"], p, block_size)
                 for row, p in zip(rows, picks, strict=True)]
    gathered = [state[torch.as_tensor(at - 1)] for state, at in zip(last, positions, strict=True)
                if len(at)]
    if not gathered:
        return [np.asarray(row["input_ids"], dtype=np.int64) for row in rows]
    tokens = greedy_tokens(torch.cat(gathered), norm, head, vocab).numpy()
    out, used = [], 0
    for row, at in zip(rows, positions, strict=True):
        ids = np.array(row["input_ids"], dtype=np.int64)
        ids[at] = tokens[used:used + len(at)]
        used += len(at)
        out.append(ids)
    return out
