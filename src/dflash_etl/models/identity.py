"""One rule for what identifies a model directory in a fingerprint or a cache key.

Every regular file at the top of the directory counts (weights in any format: safetensors,
pytorch_model.bin, .pt, .h5, .msgpack, .gguf; config; tokenizer files of any kind: .json, .model,
.tiktoken, vocab and merges), except what cannot change what the model computes: hidden files and
documents (README.md, LICENSE, .gitattributes). A list of suffixes (the earlier rule) misses the
kinds nobody thought of, and a stage then skips as complete on stale outputs."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dflash_etl.core.rundir import sha256_file

DOCUMENT_SUFFIXES = (".md", ".rst", ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".svg")
DOCUMENT_NAMES = ("license", "licence", "notice", "copying", "use_policy")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".onnx", ".npz", ".npy")
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


def model_files(model_dir: str | Path) -> list[Path]:
    """The files of a model directory that identify it (see the module's docstring)."""
    def counts(path: Path) -> bool:
        name = path.name.lower()
        return (path.is_file() and not name.startswith(".")
                and not name.endswith(DOCUMENT_SUFFIXES)
                and name.split(".")[0] not in DOCUMENT_NAMES)

    return sorted(p for p in Path(model_dir).iterdir() if counts(p))


def _identity(files: list[Path]) -> str:
    return hashlib.sha256("".join(f"{p.name}:{file_identity(p)};" for p in files)
                          .encode()).hexdigest()


def model_identity(model_dir: str | Path) -> str:
    """A hash of every file of a model directory that identifies it: weights, config,
    tokenizer and template files."""
    return _identity(model_files(model_dir))


def tokenizer_identity(model_dir: str | Path) -> str:
    """The same, less the weights: what a tokenizer's output depends on (a model directory's new
    weights do not change its tokenization)."""
    return _identity([p for p in model_files(model_dir)
                      if not p.name.lower().endswith(WEIGHT_SUFFIXES)])
