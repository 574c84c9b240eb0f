"""The target's embedding and LM head alone, for a trainer whose hidden states come from a
server: a 27B target's decoder (~54 GB in bf16) stays on the serving node, and the training node
reads two tensors of its checkpoint (2 x vocab x hidden) instead of loading every shard."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.models.target import TargetSpec, parse_layers, text_config


class HeadTarget:
    """What the trainer reads of the target when a server computes the states: its config, the
    layers, the input embedding and the LM head, on a model skeleton whose other weights stay
    on the meta device (never allocated, never read)."""

    def __init__(self, settings: TargetSpec) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from safetensors import safe_open

        from dflash_etl.models.loading import (
            embedding_weight_names,
            fit_threads,
            load_config,
            refuse_remote_code,
            weight_files,
        )

        self.torch = torch
        model_dir = Path(settings.model)
        refuse_remote_code(model_dir)
        self.device = settings.device if settings.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
        self.model = _skeleton(load_config(model_dir))
        config = text_config(self.model.config)
        self.n_layers, self.hidden = config.num_hidden_layers, config.hidden_size
        self.layers = parse_layers(settings.layers, self.n_layers, settings.draft_layers)
        embed_key, head_key = embedding_weight_names(model_dir)  # head None: tied
        if head_key is None and not getattr(config, "tie_word_embeddings", False):
            raise StageError(f"{model_dir}: its config unties the LM head from the embedding, but "
                             "no `lm_head.weight` is among its safetensors tensors: give the "
                             "target's whole checkpoint directory")
        files = weight_files(model_dir)
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        loaded = {}
        for key in filter(None, (embed_key, head_key)):
            with safe_open(str(files[key]), framework="pt") as f:
                tensor = f.get_tensor(key)
            if tuple(tensor.shape) != tuple(embed.weight.shape):
                raise StageError(f"{files[key]}: `{key}` is {list(tensor.shape)}, but the "
                                 f"config's vocabulary x hidden is {list(embed.weight.shape)}: "
                                 "the checkpoint is not this config's model")
            loaded[key] = torch.nn.Parameter(tensor.to(self.device, dtype), requires_grad=False)
        embed.weight = loaded[embed_key]
        head.weight = loaded[head_key] if head_key else embed.weight
        fit_threads(sum(t.numel() for t in loaded.values()))


def _skeleton(config: Any) -> Any:
    """The causal LM of `config` with every weight on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return model.eval()
