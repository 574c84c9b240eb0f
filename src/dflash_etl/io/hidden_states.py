"""Extract's hidden-state files (safetensors: `hidden_states` [tokens, layers, hidden] and
`token_ids`; a file per shard, or per row in speculators' layout), and the digest of each row's
states that makes the output's identity its content, not how its files are laid out."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def states_digest(torch: Any, states: Any, token_ids: list[int]) -> str:
    """sha256 of one row's states, as stored (their dtype's bytes), and its token ids."""
    digest = hashlib.sha256(states.contiguous().view(torch.uint8).numpy())  # no copy
    digest.update(json.dumps(token_ids).encode())
    return digest.hexdigest()


def content_digest(index: list[dict[str, Any]], shape: dict[str, Any]) -> str:
    """The output's identity from its rows' states alone (row, id, turn, digest; and what the
    columns are: `shape`): a re-extract that stores the same states in another layout, shard
    size or order has the same one, so what was built on it stays valid."""
    rows = sorted((e["row"], e["id"], e["turn"], e["sha256"]) for e in index)
    return hashlib.sha256(json.dumps([shape, rows], sort_keys=True).encode()).hexdigest()


def moved(source: Path | None, path: Path) -> bool:
    """A server's states file that is already this row's file (the speculators layout: the
    same two tensors, checked by the client) renamed into place: no second copy of its bytes.
    False (the caller writes the file) where there is none, or it lies on another file system
    (it is then removed once written)."""
    if source is None:
        return False
    try:
        os.replace(source, path)
        return True
    except OSError:
        return False


def drop_server_files(states: list[Any]) -> None:
    """Remove the server's files of states not moved into the output (rows quarantined, or
    written as a copy)."""
    for s in states:
        source = getattr(s, "server_file", None)
        if source is not None:
            Path(source).unlink(missing_ok=True)


STATES_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def write_states_file(path: Path, rows: list[Any], token_ids: list[int]) -> None:
    """`hidden_states` (the rows joined on the token axis) and `token_ids` as one safetensors
    file, byte for byte what safetensors' save_file writes for the joined tensors (its header:
    the wider dtype first, padded to 8 bytes), but streamed row by row: no joined copy and no
    serialized copy of a shard (the two cost ~1 CPU s per GB at a 27B width). Written beside
    `path` and renamed into place whole."""
    import struct

    import numpy as np
    import torch

    ids = np.asarray(token_ids, dtype="<i8")
    tokens = sum(int(r.shape[0]) for r in rows)
    shape = [tokens, *map(int, rows[0].shape[1:])]
    size = sum(r.numel() * r.element_size() for r in rows)
    dtype = STATES_DTYPES[str(rows[0].dtype).split(".")[-1]]
    header = {"token_ids": {"dtype": "I64", "shape": [len(ids)],
                            "data_offsets": [0, ids.nbytes]},
              "hidden_states": {"dtype": dtype, "shape": shape,
                                "data_offsets": [ids.nbytes, ids.nbytes + size]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_suffix(".tmp")
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.write(ids.tobytes())
        for r in rows:
            f.write(r.contiguous().view(torch.uint8).numpy())  # the tensor's bytes, no copy
    os.replace(partial, path)


def save_states(torch: Any, layout: str, kept: list[tuple[dict[str, Any], Any]], name: str,
                directory: Path) -> list[dict[str, Any]]:
    """Write the kept rows' states (speculators: a file per row; native: one per shard),
    each renamed into place whole; returns their index rows."""

    def save(path: Path, rows: list[Any], token_ids: list[int]) -> None:
        if len(rows) == 1 and moved(getattr(rows[0], "server_file", None), path):
            return
        write_states_file(path, rows, token_ids)

    directory.mkdir(exist_ok=True)
    index, offset = [], 0
    for row, states in kept:
        shard = (f"hs_{row['row']}.safetensors" if layout == "speculators"
                 else f"{name}.safetensors")
        index.append({"id": row["id"], "turn": row["turn"], "row": row["row"], "shard": shard,
                      "offset": offset, "length": len(row["input_ids"]),
                      "sha256": states_digest(torch, states, row["input_ids"])})
        if layout == "speculators":
            save(directory / shard, [states], row["input_ids"])
        else:
            offset += len(row["input_ids"])
    if layout != "speculators" and kept:
        save(directory / f"{name}.safetensors", [s for _, s in kept],
             [t for row, _ in kept for t in row["input_ids"]])
    return index
