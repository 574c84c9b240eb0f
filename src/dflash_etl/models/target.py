"""The target model with forward hooks on its decoder layers: the hidden states extract stores,
train computes online, and tau evaluation reads (logits and a KV cache)."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_etl.core.errors import StageError


@dataclass(frozen=True)
class TargetSpec:
    """Which target and how to run it (extract's settings have the same fields)."""

    model: str
    layers: str = "auto"
    draft_layers: int = 5
    dtype: str = "fp32"
    device: str = "auto"
    device_map: str = "none"  # "auto": accelerate places the layers over the visible GPUs/CPU
    max_memory: str = ""  # with device_map auto: "0=70GiB,1=70GiB,cpu=200GiB"


def auto_layers(n_layers: int, k: int) -> list[int]:
    """DFlash's rule: K target layers spread evenly from layer 1 to layer L-3 (one layer: the
    middle one), as SpecForge's and z-lab's build_target_layer_ids."""
    if k == 1:
        return [n_layers // 2]
    last = max(1, n_layers - 3)
    return sorted({round(float(x)) for x in np.linspace(1, last, max(1, k))})


def parse_layers(spec: str, n_layers: int, k: int) -> list[int]:
    if spec == "auto":
        return auto_layers(n_layers, k)
    try:
        layers = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError as exc:
        raise StageError(f"--layers {spec!r}: give 'auto' or comma-separated indices") from exc
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad or not layers:
        raise StageError(f"--layers {spec!r}: the target has decoder layers 0..{n_layers - 1}")
    return layers


def text_config(config: Any) -> Any:
    """The decoder's config: a vision-language checkpoint's config is composite (Qwen3.5/3.6's
    `Qwen3_5Config` keeps num_hidden_layers, hidden_size, ... in `text_config`)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_layers(model: Any) -> Any:
    """The model's decoder layer list: the language model's (`get_decoder()`, which for a
    vision-language model is `model.language_model`, never the vision tower), else the first
    ModuleList as long as the decoder's num_hidden_layers."""
    import torch

    n = text_config(model.config).num_hidden_layers
    with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
        layers = getattr(model.get_decoder(), "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
            return layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and not any(
                part in name for part in ("visual", "vision", "audio")):
            return module
    raise StageError(f"cannot find the {n} decoder layers of {type(model).__name__}: no "
                     "ModuleList of that length; this architecture needs explicit support")


def placement_of(model: Any) -> dict[str, str]:
    """Module name -> device: accelerate's map when the model spans several devices
    (transformers sets hf_device_map only then), else {"": the one device its weights are on}."""
    mapped = getattr(model, "hf_device_map", None)
    if mapped:
        return {k: str(v) for k, v in mapped.items()}
    return {"": ",".join(sorted({str(p.device) for p in model.parameters()}))}


def resident_head(head: Any) -> Any:
    """The LM head with its weights in memory: `head` itself, unless a device map offloaded it
    (accelerate keeps an offloaded module's parameters on "meta" and loads them for each call),
    then a frozen copy on its execution device, for the training loss, which reads the weight
    directly (drafter.head_cross_entropy)."""
    import torch

    if head.weight.device.type != "meta":
        return head
    from accelerate.utils import align_module_device

    from dflash_etl.models.loading import execution_device

    device = execution_device(head)
    with align_module_device(head, device):
        bias = getattr(head, "bias", None)
        copy = torch.nn.Linear(head.in_features, head.out_features, bias=bias is not None,
                               device=device, dtype=head.weight.dtype)
        with torch.no_grad():
            copy.weight.copy_(head.weight)
            if bias is not None:
                copy.bias.copy_(bias)
    return copy.requires_grad_(False)


# ---------------------------------------------------------------- the target
def _report_placement(model: str, layer_devices: dict[str, str]) -> None:
    """Say where a device map put the layers, and warn when some are offloaded (disk always,
    the CPU when a GPU is the main device): those are read back every forward pass."""
    devices = sorted(set(layer_devices.values()), key=str)
    gpu = any(d not in ("cpu", "disk") for d in devices)
    slow = [d for d in devices if d == "disk" or (d == "cpu" and gpu)]
    print(f"target: --device-map auto placed {model} on {', '.join(devices)}"
          + (f" (the layers on {' and '.join(slow)} are read back every forward pass: "
             "raise --max-memory for the GPUs to avoid that)" if slow else ""),
          file=sys.stderr, flush=True)


# What a layer id's stored state is, stated in the drafter's config: a decoder layer's output;
# the last layer's, after the final norm, as Hugging Face's `hidden_states[-1]` that z-lab's
# `dflash_generate` and SpecForge feed their drafters (a hook on the layer sees it before)
LAST_LAYER_STATE = "after_final_norm"
AFTER_NORM = "norm"  # the captured key of the final norm's output


def decoder_norm(model: Any) -> Any:
    """The final norm the decoder applies after its last layer (`get_decoder().norm`)."""
    import torch

    with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
        norm = getattr(model.get_decoder(), "norm", None)
        if isinstance(norm, torch.nn.Module):
            return norm
    raise StageError(f"--layers names the last decoder layer of {type(model).__name__}, whose "
                     "state is read after the final norm (as z-lab's and SpecForge's drafters "
                     "read it), but the model has no get_decoder().norm: choose layers below "
                     "the last (`auto` does)")


class _EnoughLayers(Exception):
    """Raised by the last wanted layer's hook: the rest of the forward pass is not needed."""


class Target:
    """The target model with forward hooks that keep the chosen layers' outputs."""

    def __init__(self, settings: TargetSpec) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch

        self.torch = torch
        placed = self._load(settings)
        self.placement = placement_of(self.model)
        if placed:
            _report_placement(settings.model, self.placement)
        config = text_config(self.model.config)
        self.n_layers = config.num_hidden_layers
        self.layers = parse_layers(settings.layers, self.n_layers, settings.draft_layers)
        self.hidden = config.hidden_size
        self.captured: dict[int | str, Any] = {}
        self.stop_after: int | str | None = None  # the layer after which a forward pass may stop
        # transformers renamed past_key_values to cache (5.x); older models know only the first
        self.cache_argument = ("cache" if "cache" in inspect.signature(
            self.model.forward).parameters else "past_key_values")
        modules = decoder_layers(self.model)
        self.last_layer = self.n_layers - 1
        for index in sorted({*self.layers, self.last_layer}):
            modules[index].register_forward_hook(self._keep(index))
        # a chosen last layer is read after the final norm (see `LAST_LAYER_STATE`); the extra
        # last layer (the verifier's state for labels and speculators) stays before it
        self.keys = [AFTER_NORM if i == self.last_layer else i for i in self.layers]
        if AFTER_NORM in self.keys:
            decoder_norm(self.model).register_forward_hook(self._keep(AFTER_NORM))

    def _load(self, settings: TargetSpec) -> bool:
        """Load the model in eval mode onto `self.device`, or spread by a device map (then
        `self.device` is where the embedding is, where ids go in); True when spread."""
        from dflash_etl.models.loading import (
            input_device,
            load_causal_lm,
            placement,
            refuse_remote_code,
        )

        torch = self.torch
        self.device = settings.device if settings.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
        refuse_remote_code(settings.model)
        # extract's and train's settings carry these fields too; other callers may not
        placed = placement(getattr(settings, "device_map", "none"),
                           getattr(settings, "max_memory", ""))
        try:
            self.model = load_causal_lm(settings.model, dtype=dtype, **placed)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise StageError(f"cannot load the target from {settings.model}: {exc}") from exc
        if placed:
            self.device = input_device(self.model)
            self.model.eval()
        else:
            self.model.to(self.device).eval()
        return bool(placed)

    def _keep(self, index: int | str):
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            state = output[0] if isinstance(output, tuple) else output
            # under a device map the layers sit on several devices: gather on one (a no-op
            # otherwise)
            self.captured[index] = state.to(self.device)
            if index == self.stop_after:
                raise _EnoughLayers
        return hook

    def states(self, rows: list[list[int]]) -> list[Any]:
        """[seq, layers, hidden] per row (right padding; causal attention ignores the pad)."""
        return self.forward(rows)[1]

    def forward(self, rows: list[list[int]], logits: bool = False,
                extra_layers: tuple[int, ...] = (), logits_keep: int = 0
                ) -> tuple[list[Any] | None, list[Any]]:
        """(logits [seq, vocab] per row when asked, else None; states [seq, layers + extra,
        hidden] per row). `extra_layers` appends more decoder layers' outputs (hooked too).
        `logits_keep` > 0 (one row only): the logits of its last `logits_keep` positions alone,
        so the LM head does not run over the whole sequence (tau's verify pass)."""
        torch = self.torch
        if logits_keep and len(rows) != 1:
            raise ValueError("logits_keep needs a single row (right padding would keep pads)")
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, :len(r)] = torch.tensor(r)
            mask[k, :len(r)] = 1
        self.captured.clear()
        # without logits, nothing after the last wanted layer is needed: its hook ends the pass
        self.stop_after = None if logits else (
            AFTER_NORM if AFTER_NORM in self.keys else max((*self.layers, *extra_layers)))
        out = None
        try:
            with torch.no_grad(), contextlib.suppress(_EnoughLayers):
                out = self.model(input_ids=ids.to(self.device),
                                 attention_mask=mask.to(self.device), use_cache=False,
                                 logits_to_keep=logits_keep if logits else 1)
        finally:  # the final norm's hook is also called by the training labels' norm
            self.stop_after = None
        stacked = torch.stack([self.captured[i] for i in (*self.keys, *extra_layers)],
                              dim=2).cpu()
        states = [stacked[k, :len(r)] for k, r in enumerate(rows)]
        if not logits or out is None:
            return None, states
        if logits_keep:
            return [out.logits[0, -logits_keep:]], states
        return [out.logits[k, :len(r)] for k, r in enumerate(rows)], states


    def every_layer(self, ids: list[int]) -> Any:
        """[seq, layers + 1, hidden] for one row: the embedding output, then every decoder
        layer's, in vLLM's numbering (index = its layer id): what a server's states are checked
        against, whichever layers it captures. Hooks added for this pass only."""
        torch = self.torch
        kept: dict[int, Any] = {}

        def keep(index: int) -> Any:
            def hook(_module: Any, _inputs: Any, output: Any) -> None:
                state = output[0] if isinstance(output, tuple) else output
                kept[index] = state[0].to("cpu", torch.float32)
            return hook

        modules = [self.model.get_input_embeddings(), *decoder_layers(self.model)]
        handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(modules)]
        self.captured.clear()
        self.stop_after = None  # the last layer's own hook would end the pass before ours
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False,
                           logits_to_keep=1)
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack([kept[i] for i in range(len(modules))], dim=1)

    def extend(self, tokens: list[int], cache: Any) -> tuple[Any, Any]:
        """Feed `tokens` after what the KV `cache` holds (one sequence): (logits [k, vocab],
        states [k, layers, hidden]) of the new tokens."""
        torch = self.torch
        self.captured.clear()
        self.stop_after = None
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([tokens], device=self.device),
                             use_cache=True, **{self.cache_argument: cache})
        states = torch.stack([self.captured[i] for i in self.keys], dim=2)[0].cpu()
        return out.logits[0], states
