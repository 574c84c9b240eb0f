"""A DFlash drafter as a transformers remote-code model: train copies this file into every drafter
directory as `dflash.py`, and config.json's `auto_map` names it, so
`AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)` returns a working drafter.

Written for dflash_etl, compatible with z-lab's `DFlashDraftModel`: the same class name, state
dict keys (layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm, layers.N.mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm, norm, fc, hidden_norm) and forward signature, and the
same computation as models/drafter.py (tested equal). The file must stand alone (transformers
imports it from its own module cache): torch and transformers only, nothing from dflash_etl.

What it computes: the target's states at the chosen layers ([B, C, K*H]) are projected by `fc`
and normalised by `hidden_norm`; every layer's attention reads them, through its own k/v
projections and k_norm, as keys and values ahead of the block's own (the noise embeddings: the
anchor token, then mask tokens). Attention is bidirectional unless `attention_mask` says
otherwise; rotary positions come from `position_ids` ([B, C + Q]: the context's, then the
block's). The embedding and the LM head are the target's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel


def _dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """A drafter setting: `dflash_config` first, then the top level (z-lab's lookup order)."""
    sub = getattr(config, "dflash_config", None) or {}
    return sub.get(name, getattr(config, name, default))


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"this drafter computes plain rotary embeddings; rope_type "
                         f"{params['rope_type']!r} is not supported")
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 1_000_000.0)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split rotary embedding (Llama/Qwen layout). x: [B, heads, S, D]; positions: [B, S]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(device=x.device, dtype=torch.float32)[..., None] * inv
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context states, then the block."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.theta = _rope_theta(config)
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, past_key_values: Any = None
                ) -> torch.Tensor:
        q_len = x.shape[1]
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        keys_in = torch.cat([context, x], dim=1)
        k = self.k_norm(self._split(self.k_proj(keys_in), self.kv_heads))
        v = self._split(self.v_proj(keys_in), self.kv_heads)
        q = _rotate(q, position_ids[:, -q_len:], self.theta)
        k = _rotate(k, position_ids[:, -keys_in.shape[1]:], self.theta)
        if past_key_values is not None:  # earlier context's keys, already rotated
            k, v = past_key_values.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        b = out.shape[0]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _local_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int,
                group_size: int) -> torch.Tensor:
    """DFlash2's grouped dynamic causal convolution along the positions of each block of
    `block_size` (x [B, L, H], blocks laid end to end from position 0): tap t adds the state t
    positions earlier in the same block times base[t] (per channel) + delta[..., t, g] (per
    channel group, computed from the position's own state)."""
    b, length, hidden = x.shape
    groups = hidden // group_size
    blocks = x.view(b, length, groups, group_size)
    delta = delta.reshape(b, length, base.shape[0], groups, 1)
    within = torch.arange(length, device=x.device) % block_size
    out = torch.zeros_like(blocks)
    for tap in range(base.shape[0]):
        shifted = blocks if tap == 0 else F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        weight = base[tap].to(x.dtype).view(1, 1, groups, group_size) + delta[:, :, tap]
        out = out + shifted * weight * (within >= tap).view(1, -1, 1, 1)
    return out.view_as(x)


class DFlashLocalConv(nn.Module):
    """The two convolutions DFlash2 puts around a sublayer (its input, its output), their
    per-token kernels from one projection of the input. Parameter names are z-lab's and
    speculators' (GroupedDynamicCausalConv); it starts as the identity, as theirs does."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        if hidden % group_size or kernel_size > block_size:
            raise ValueError(f"DFlash2 convolution: hidden size {hidden} must be a multiple of "
                             f"conv_group_size {group_size}, and conv_kernel_size "
                             f"{kernel_size} at most block_size {block_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size),
                                           bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved input, and the output side's per-token kernel."""
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        return (_local_conv(x, kernels[..., 0, :, :], self.base_kernel[0], self.block_size,
                            self.group_size), kernels[..., 1, :, :])

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return _local_conv(x, delta, self.base_kernel[1], self.block_size, self.group_size)


class DFlashCandidateSelector(nn.Module):
    """DFlash2's selector: at each block position the unary top-k candidates of the LM head are
    rescored by unary + (predecessor code * projected state) . successor code, the predecessor
    being the token chosen one position earlier (the anchor for the first). Parameter names are
    z-lab's and speculators' (the codebooks are plain parameters, stored without `.weight`)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook,
                       self.hidden_projection.weight):
            nn.init.normal_(weight, std=0.02)

    def transition(self, hidden: torch.Tensor, predecessors: torch.Tensor,
                   candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term: hidden [..., H], predecessors [...], candidates [..., K]: [..., K]."""
        context = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)
        return torch.matmul(self.successor_codebook[candidates], context.unsqueeze(-1))[..., 0]

    def path(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor
             ) -> torch.Tensor:
        """The greedy path through a block: hidden [B, D, H], logits [B, D, V], anchors [B]
        -> the chosen tokens [B, D], each position's predecessor the one chosen before it."""
        unary, candidates = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        chosen, predecessor = [], anchors
        for position in range(hidden.shape[1]):
            scores = unary[:, position].float() + self.transition(
                hidden[:, position], predecessor, candidates[:, position]).float()
            predecessor = candidates[:, position].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            chosen.append(predecessor)
        return torch.stack(chosen, dim=1) if chosen else candidates[..., 0]


class DFlashDecoderLayer(nn.Module):
    """Attention then MLP, each pre-normed with a residual; DFlash2 (`conv`: kernel size,
    group size, block size) wraps each sublayer in its local convolutions."""

    def __init__(self, config: Qwen3Config, layer_idx: int, attention: type = DFlashAttention,
                 conv: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        self.attention_conv = DFlashLocalConv(config.hidden_size, *conv) if conv else None
        self.mlp_conv = DFlashLocalConv(config.hidden_size, *conv) if conv else None

    def forward(self, x: torch.Tensor, context: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, past_key_values: Any = None
                ) -> torch.Tensor:
        return self.around(x, lambda h: self.self_attn(h, context, position_ids, attention_mask,
                                                       past_key_values))

    def around(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        """The layer given its attention as a function of the normed input."""
        x = x + self._sublayer(self.input_layernorm(x), attend, self.attention_conv)
        return x + self._sublayer(self.post_attention_layernorm(x), self.mlp, self.mlp_conv)

    @staticmethod
    def _sublayer(h: torch.Tensor, sublayer: Any, conv: DFlashLocalConv | None) -> torch.Tensor:
        if conv is None:
            return sublayer(h)
        h, after = conv.prepare(h)
        return conv.finish(sublayer(h), after)


def _sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An attention mask as SDPA takes it: bool (True: attend) or additive float, [B, 1, Q, K].
    A [B, K] mask is a key padding mask (1: a real key); [B, Q, K] gains the head axis."""
    if mask is None:
        return None
    if mask.dim() == 2:
        mask = mask[:, None, None, :].bool()
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    return mask


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The drafter. `forward` returns the block's hidden states before the LM head."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]  # noqa: RUF012 (transformers' class attribute)

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"this drafter has full (bidirectional) attention only; "
                             f"layer_types {sorted(kinds)} are not supported")
        self.target_layer_ids = list(_dflash_value(config, "target_layer_ids"))
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        conv = self._conv_shape(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i, conv=conv)
                                    for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size,
                            bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None,
                target_hidden: torch.Tensor | None = None, past_key_values: Any = None,
                use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        """noise_embedding [B, Q, H]: the embedded block(s); target_hidden [B, C, K*H]: the
        target's states at the chosen layers for the C context positions not yet in
        `past_key_values` (a transformers Cache, updated in place; crop it to the context
        afterwards); position_ids [B, C + Q]; attention_mask None (every query sees every key)
        or [B, 1, Q, cached + C + Q]. Returns [B, Q, H]."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel needs noise_embedding and target_hidden")
        context = self.hidden_norm(self.fc(target_hidden))
        mask = _sdpa_mask(attention_mask, noise_embedding.dtype)
        x = noise_embedding  # use_cache is z-lab's argument: a given cache is always updated
        for layer in self.layers:
            x = layer(x, context, position_ids, mask, past_key_values)
        return self.norm(x)

    def _conv_shape(self, config: Qwen3Config) -> tuple[int, int, int] | None:
        """DFlash has no local convolutions (DFlash2's: kernel size, group size, block)."""
        return None

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """The target's LM head on the drafter's states (z-lab's method name)."""
        return output_head(hidden)

    def draft_tokens(self, hidden: torch.Tensor, anchors: torch.Tensor, output_head: nn.Module
                     ) -> torch.Tensor:
        """The block's drafts from its states after the anchor [B, D, H]: the argmax."""
        return self.compute_logits(hidden, output_head).argmax(-1)

    def target_context(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The drafter's input from a transformers forward's `hidden_states` (index 0 is the
        embedding output, so decoder layer i's output is at i + 1)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      **_ignored: Any) -> torch.LongTensor:
        """Greedy speculative decoding of one sequence with `target` (z-lab's method name and
        arguments): each step drafts a block after the last token, the target checks it in one
        pass, the agreeing drafts and the target's next token are kept, both KV caches are
        cropped to what was kept. The result is the target's own greedy continuation."""
        import inspect

        from transformers import DynamicCache

        if temperature > 0:
            raise NotImplementedError("spec_generate here is greedy only (temperature 0); "
                                      "z-lab's dflash.model.dflash_generate samples")
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate decodes one sequence at a time")
        device, prompt = input_ids.device, input_ids.shape[1]
        limit, stops = prompt + max_new_tokens, set(stop_token_ids or [])
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        try:  # per-layer caches as the target's config says (sliding windows)
            target_cache = DynamicCache(config=target.config)
        except TypeError:  # transformers before the config argument
            target_cache = DynamicCache()
        draft_cache = DynamicCache()
        # transformers 5.x renamed the target's past_key_values argument to cache
        key = "cache" if "cache" in inspect.signature(target.forward).parameters \
            else "past_key_values"

        def crop(cache: Any, length: int) -> None:
            if cache.get_seq_length() > length:
                cache.crop(length - cache.get_seq_length())

        out = target(input_ids, use_cache=True, output_hidden_states=True,
                     **{key: target_cache})
        tokens = [*input_ids[0].tolist(), int(out.logits[0, -1].argmax())]
        context = self.target_context(out.hidden_states)
        while len(tokens) < limit and tokens[-1] not in stops:
            start = len(tokens) - 1  # the anchor: the last kept token, not yet seen by target
            size = min(self.block_size, limit - start)
            block = torch.tensor([[tokens[-1]] + [self.mask_token_id] * (size - 1)],
                                 device=device)
            if size > 1:
                positions = torch.arange(start - context.shape[1], start + size, device=device)
                hidden = self(position_ids=positions[None], noise_embedding=embed(block),
                              target_hidden=context, past_key_values=draft_cache)
                crop(draft_cache, start)
                block[0, 1:] = self.draft_tokens(hidden[:, 1:], block[:, 0], head)[0]
            out = target(block, position_ids=torch.arange(start, start + size,
                                                          device=device)[None],
                         use_cache=True, output_hidden_states=True, **{key: target_cache})
            checked = out.logits[0].argmax(-1).tolist()
            drafts = block[0, 1:].tolist()
            accepted = 0
            while accepted < size - 1 and drafts[accepted] == checked[accepted]:
                accepted += 1
            new = [*drafts[:accepted], checked[accepted]]
            stop_at = next((k for k, t in enumerate(new) if t in stops), None)
            tokens.extend(new if stop_at is None else new[:stop_at + 1])
            crop(target_cache, start + accepted + 1)
            context = self.target_context(out.hidden_states)[:, :accepted + 1]
        return torch.tensor([tokens[:limit]], device=device)


class DFlash2DraftModel(DFlashDraftModel):
    """z-lab's DFlash2: DFlash with local convolutions around every sublayer and a candidate
    selector choosing each draft among the LM head's top-k (dflash_config: conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.candidate_selector = DFlashCandidateSelector(
            config.vocab_size, config.hidden_size, int(_dflash_value(config, "selector_rank")),
            int(_dflash_value(config, "selector_top_k")))
        self.post_init()

    def _conv_shape(self, config: Qwen3Config) -> tuple[int, int, int] | None:
        return (int(_dflash_value(config, "conv_kernel_size")),
                int(_dflash_value(config, "conv_group_size")), self.block_size)

    def draft_tokens(self, hidden: torch.Tensor, anchors: torch.Tensor, output_head: nn.Module
                     ) -> torch.Tensor:
        """The selector's greedy path (z-lab's `propose` at temperature 0)."""
        return self.candidate_selector.path(hidden, self.compute_logits(hidden, output_head),
                                            anchors)
