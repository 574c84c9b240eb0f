"""One rule for what identifies a model directory in a fingerprint or a cache key."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dflash_etl.core.rundir import sha256_file

MODEL_SUFFIXES = (".json", ".safetensors", ".bin", ".jinja", ".model", ".txt", ".py")
FULL_HASH_MAX = 256 * 2**20  # larger files: size plus their first and last 16 MiB
EDGE_BYTES = 16 * 2**20


def file_identity(path: Path) -> str:
    """sha256 of the file, or for a large weights file of its size and both ends (hashing a
    27B target's 54 GB at every stage would take minutes; a changed checkpoint changes its
    header or its first tensors)."""
    size = path.stat().st_size
    if size <= FULL_HASH_MAX:
        return sha256_file(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        digest.update(fh.read(EDGE_BYTES))
        fh.seek(size - EDGE_BYTES)
        digest.update(fh.read(EDGE_BYTES))
    return "edges:" + digest.hexdigest()


def model_identity(model_dir: str | Path) -> str:
    """A hash of a model directory's config, weights, tokenizer and template files."""
    files = sorted(p for p in Path(model_dir).iterdir()
                   if p.is_file() and p.suffix in MODEL_SUFFIXES)
    return hashlib.sha256("".join(f"{p.name}:{file_identity(p)};" for p in files)
                          .encode()).hexdigest()
