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
import re
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
    tokenizer) a tokenizer_config.json with `auto_map` and a tokenizer_class it does not have.
    A path that is not a directory is refused first: transformers would take it for a hub repo
    id and answer "Repo id must be in the form ..." or "couldn't connect to huggingface.co"."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise StageError(f"{str(model_dir)!r} is not a directory"
                         + ("" if directory.exists() else " (nothing is there)")
                         + ": a model is read from a local directory (config.json and its "
                         "weights), never the hub; check --model / --target / [target] model")
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


_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B|B)?$", re.IGNORECASE)
DEVICE_MAPS = ("none", "auto")


def parse_max_memory(text: str, setting: str = "max_memory"
                     ) -> dict[int | str, int | str] | None:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'} (accelerate's
    max_memory); '' -> None (accelerate's own budget). A malformed entry is a StageError that
    names the setting and the entry."""
    if not text.strip():
        return None
    out: dict[int | str, int | str] = {}
    for entry in text.split(","):
        key, sep, size = (part.strip() for part in entry.partition("="))
        where = key if key == "cpu" else int(key) if key.isdigit() else None
        if not sep or where is None or not _SIZE.match(size):
            raise StageError(
                f"--{setting.replace('_', '-')} {text!r}: entry {entry.strip()!r} is not "
                "DEVICE=SIZE; give GPU indices (as CUDA_VISIBLE_DEVICES numbers them) or cpu "
                "with a size such as 70GiB, e.g. '0=70GiB,1=70GiB,cpu=200GiB' (disk offload is "
                "not supported)")
        if where in out:
            raise StageError(f"--{setting.replace('_', '-')} {text!r}: {key} is given twice")
        size = size.replace(" ", "")
        out[where] = int(size) if size.isdigit() else size  # accelerate: bytes as an int
    return out


def placement(device_map: str, max_memory: str) -> dict[str, Any]:
    """from_pretrained's placement arguments for the settings `device_map` (none|auto) and
    `max_memory`. 'auto' spreads the layers over the visible GPUs, then the CPU (accelerate's
    pipeline placement: one layer runs at a time)."""
    if device_map not in DEVICE_MAPS:
        raise StageError(f"--device-map {device_map!r}: use none or auto")
    memory = parse_max_memory(max_memory)
    if device_map == "none":
        if memory is not None:
            raise StageError(f"--max-memory {max_memory!r} applies only with "
                             "--device-map auto")
        return {}
    try:
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise StageError("--device-map auto needs accelerate: pip install "
                         "'dflash-etl[multigpu]' (or accelerate)") from exc
    return {"device_map": "auto", **({"max_memory": memory} if memory else {})}


def execution_device(module: Any) -> Any:
    """Where a module computes: accelerate's execution device when a device map dispatched it
    (an offloaded module's own parameters sit on "meta"), else its weight's device."""
    import torch

    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device) if device is not None else module.weight.device


def input_device(model: Any) -> Any:
    """Where a (possibly device-mapped) model takes its input ids: its embedding's device."""
    return execution_device(model.get_input_embeddings())


def load_causal_lm(model_dir: str | Path, **kwargs: Any) -> Any:
    """AutoModelForCausalLM from the directory (kwargs: dtype, ...)."""
    refuse_remote_code(model_dir)
    _offline()
    from transformers import AutoModelForCausalLM

    from dflash_etl.models.kernels import announce_kernels

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                 trust_remote_code=False, **kwargs)
    announce_kernels(model)  # a hybrid target: which linear-attention kernels, once a process
    fit_threads(sum(p.numel() for p in model.parameters()))
    return model


SMALL_MODEL_PARAMS = 50_000_000  # below: an op is too small to be worth splitting over threads


def fit_threads(params: int) -> int:
    """torch's intra-op threads for a model of `params` parameters: one for a small model, whose
    ops are too small to split — with torch's default (a thread per core) each op waits on a
    core another process holds: the embedded default took 4.3x as long with every core busy
    (benchmarks/results/threads.md; the reliability issue saw 18x), against 1.55x on one
    thread. One thread also makes a small model's numbers the same on every machine, busy or
    not. A larger model keeps torch's default, and so does a count the user set
    (OMP_NUM_THREADS, MKL_NUM_THREADS). Returns the count in effect."""
    import torch

    if params < SMALL_MODEL_PARAMS and not any(os.environ.get(v) for v in (
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        torch.set_num_threads(1)
    return torch.get_num_threads()


def load_auto_tokenizer(model_dir: str | Path) -> Any:
    """AutoTokenizer from the directory (which reads config.json too, when tokenizer_config.json
    names no tokenizer class)."""
    refuse_remote_code(model_dir)
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                         trust_remote_code=False)


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index's weight map, else each file's
    header), without loading a tensor."""
    directory = Path(model_dir)
    index = sorted(directory.glob("*.safetensors.index.json"))
    if index:
        weight_map = _read_json(index[0]).get("weight_map", {})
        return {name: directory / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def weight_names(model_dir: str | Path) -> list[str]:
    """The tensor names of a safetensors checkpoint, without loading a tensor."""
    return sorted(weight_files(model_dir))


def embedding_weight_names(model_dir: str | Path) -> tuple[str, str | None]:
    """(the decoder's input embedding, the output head or None where it is tied) as the
    checkpoint names them: `model.embed_tokens.weight` in a causal LM,
    `model.language_model.embed_tokens.weight` in a vision-language one (Qwen3.6's layout)."""
    names = weight_names(model_dir)
    embeddings = [n for n in names if n.endswith("embed_tokens.weight")]
    if not embeddings:
        raise StageError(f"{model_dir}: no `embed_tokens.weight` among its {len(names)} "
                         "safetensors tensors; the trainers need the target's embedding: give a "
                         "safetensors checkpoint of the target")
    heads = [n for n in names if n.endswith("lm_head.weight")]
    return min(embeddings, key=len), (min(heads, key=len) if heads else None)
