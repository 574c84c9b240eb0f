"""Loading configs, models and tokenizers from local directories: never the hub, never remote code.

A model directory is untrusted input. A config whose `auto_map` names Python files of the
directory makes transformers ask `[y/N]` on stdin (and run that code on "y") when the caller does
not say `trust_remote_code`; every load here passes `trust_remote_code=False`, and a directory
whose model can only be built by its own code is refused first, naming the key, instead of
failing deep inside transformers. An `auto_map` next to an architecture transformers has built in
is harmless (transformers then uses its own class, as here), so it loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a missing or broken file is transformers' error to report
    return data if isinstance(data, dict) else {}


def _mapping(auto_map: Any) -> str:
    if not isinstance(auto_map, dict):
        return repr(auto_map)
    return ", ".join(f"{k} -> {v}" for k, v in list(auto_map.items())[:4])


def refuse_remote_code(model_dir: str | Path, *, model: bool = True,
                       tokenizer: bool = True) -> None:
    """StageError when loading `model_dir` would need the Python code the directory ships: (the
    model) a config.json with `auto_map` and a model_type transformers does not have, or (the
    tokenizer) a tokenizer_config.json with `auto_map` and a tokenizer_class it does not have."""
    directory = Path(model_dir)
    config = _read_json(directory / "config.json") if model else {}
    if "auto_map" in config:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = config.get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise StageError(
                f"{directory / 'config.json'}: `auto_map` ({_mapping(config['auto_map'])}) points "
                f"at Python code in the model directory, and model_type {model_type!r} is not "
                "an architecture transformers has built in, so loading it would run that code. "
                "dflash-etl never runs a model's own code (trust_remote_code=False): use a model "
                "whose architecture transformers supports natively (or convert this one)")
    tok_config = _read_json(directory / "tokenizer_config.json") if tokenizer else {}
    if "auto_map" in tok_config and not (directory / "tokenizer.json").is_file():
        import transformers

        tokenizer_class = tok_config.get("tokenizer_class")
        if not (isinstance(tokenizer_class, str) and hasattr(transformers, tokenizer_class)):
            raise StageError(
                f"{directory / 'tokenizer_config.json'}: `auto_map` "
                f"({_mapping(tok_config['auto_map'])}) points at Python code in the model "
                f"directory, and tokenizer_class {tokenizer_class!r} is not one transformers has, "
                "so loading the tokenizer would run that code; dflash-etl never runs a model's "
                "own code (trust_remote_code=False). Give a directory with a tokenizer.json")


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def load_config(model_dir: str | Path) -> Any:
    """The directory's transformers config (no weights)."""
    refuse_remote_code(model_dir)
    _offline()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True,
                                      trust_remote_code=False)


def load_causal_lm(model_dir: str | Path, **kwargs: Any) -> Any:
    """AutoModelForCausalLM from the directory (kwargs: dtype, ...)."""
    refuse_remote_code(model_dir)
    _offline()
    from transformers import AutoModelForCausalLM

    from dflash_etl.models.kernels import announce_kernels

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                 trust_remote_code=False, **kwargs)
    announce_kernels(model)  # a hybrid target: which linear-attention kernels, once a process
    return model


def load_auto_tokenizer(model_dir: str | Path) -> Any:
    """AutoTokenizer from the directory (which reads config.json too, when tokenizer_config.json
    names no tokenizer class)."""
    refuse_remote_code(model_dir)
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                         trust_remote_code=False)
