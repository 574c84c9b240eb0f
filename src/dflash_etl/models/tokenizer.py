"""Tokenizers from local directories only: never the hub, never remote code."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError


def load_tokenizer(model: str) -> Any:
    """A local tokenizer or model directory; never the hub, never remote code.

    Loaded once per process and directory (a 12 MB tokenizer.json takes seconds to parse); the
    cache key includes the files' sizes and times, so an edited tokenizer is reloaded.
    """
    path = Path(model)
    if not path.is_dir():
        raise StageError(f"--model {model!r} is not a directory: give a local tokenizer or model "
                         "directory (the hub is never used)")
    signature = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                             for f in path.iterdir() if f.is_file()))
    return _load_tokenizer(str(path.resolve()), signature)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(model: str, signature: tuple[Any, ...]) -> Any:
    """A directory with tokenizer.json loads as a plain fast tokenizer: AutoTokenizer would import
    torch (through the model configs), which costs seconds in every process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        if (Path(model) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model, local_files_only=True)
        from dflash_etl.models.loading import load_auto_tokenizer

        return load_auto_tokenizer(model)
    except (StageError, ModuleNotFoundError):  # the runner names what to install
        raise
    except Exception as exc:  # transformers raises many types for a bad directory
        raise StageError(f"cannot load a tokenizer from {model}: {exc}") from exc


def model_vocab_size(model: str, tokenizer_size: int) -> tuple[int, str]:
    """The target's vocabulary size (its embedding and LM head rows) and where it was read.

    Checkpoints pad it beyond the tokenizer (Qwen: 151936 rows for 151669 tokens), and the
    trainers size their vocab maps to it (speculators refuses a t2d of the tokenizer's length).
    Vision-language checkpoints keep it in `text_config`. A tokenizer-only directory (no
    config.json) falls back to the tokenizer's size."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return tokenizer_size, "the tokenizer (no config.json beside it)"
    except (OSError, ValueError) as exc:
        raise StageError(f"{path}: not readable JSON ({exc}); fix or remove it") from exc
    for where, section in (("text_config.vocab_size", config.get("text_config")),
                           ("vocab_size", config)):
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and size > 0:
            if size < tokenizer_size:
                raise StageError(
                    f"{path}: {where} = {size} is smaller than the tokenizer ({tokenizer_size} "
                    "tokens): the tokenizer and the model do not belong together")
            return size, f"config.json {where}"
    return tokenizer_size, "the tokenizer (config.json names no vocab_size)"


def read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise StageError(f"--chat-template {path}: cannot read it ({exc})") from exc
