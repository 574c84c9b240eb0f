"""Which linear-attention kernels a hybrid target (Qwen3.5/3.6, Qwen3-Next: Gated DeltaNet
layers beside full attention) runs with, said once per process.

transformers uses flash-linear-attention (`fla`) for the gated delta rule and `causal_conv1d`
for the short convolution when they import, else its reference PyTorch code: correct, much
slower on a GPU, and it warns per function at every forward pass's first call. A run says once
which it is (the first model loaded with linear-attention layers), whatever the stages that
load the target after it, and the reference code's own warnings are not repeated."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

# (import name, distribution to install, what transformers uses it for)
LINEAR_ATTENTION_KERNELS = (
    ("fla", "flash-linear-attention", "the gated delta rule"),
    ("causal_conv1d", "causal-conv1d", "the short convolution"),
)
_said: str | None = None  # this process's message, once said


def linear_attention_layers(config: Any) -> int:
    """How many of the decoder's layers are linear attention (its `layer_types`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return sum(t == "linear_attention" for t in (getattr(text, "layer_types", None) or ()))


def kernel_status() -> dict[str, str | None]:
    """Per kernel distribution: its version when it imports (as transformers imports it), else
    None."""
    status: dict[str, str | None] = {}
    for module, distribution, _ in LINEAR_ATTENTION_KERNELS:
        try:
            imported = importlib.import_module(module)
        except Exception:  # not installed, or installed but broken: transformers falls back too
            status[distribution] = None
        else:
            status[distribution] = str(getattr(imported, "__version__", "installed"))
    return status


def kernels_message(layers: int, total: int, status: dict[str, str | None]) -> str:
    used = [f"{d} {v}" for d, v in status.items() if v]
    missing = [d for d, v in status.items() if not v]
    text = (f"dflash-etl: the target has {layers} linear-attention layers of {total} (Gated "
            "DeltaNet); kernels: ")
    if used:
        text += ", ".join(used)
    if missing:
        text += ("; " if used else "") + (
            f"transformers' reference PyTorch code for {', '.join(missing)} (not installed): "
            f"correct but much slower on a GPU; there install `pip install {' '.join(missing)}`"
            " (README: GPU extras for hybrid targets)")
    return text


def announce_kernels(model: Any) -> str | None:
    """Say (stderr) which linear-attention kernels the model runs with, the first time in this
    process that a model with such layers is loaded; returns the message when said now."""
    global _said
    layers = linear_attention_layers(model.config)
    if not layers or _said is not None:
        return None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else (
        model.config)
    _said = kernels_message(layers, int(text.num_hidden_layers), kernel_status())
    print(_said, file=sys.stderr, flush=True)
    # the same news, per function and stage, from transformers: said once above
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    return _said
