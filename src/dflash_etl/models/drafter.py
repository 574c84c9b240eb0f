"""The DFlash drafter: a few decoder layers that predict a block of tokens in one pass.

As published (z-lab DFlash; SpecForge's and speculators' implementations): the target's hidden
states at K chosen layers are concatenated, projected to the hidden size (`fc`) and normalised
(`hidden_norm`); every draft layer's attention reads them as extra keys and values, computed with
that layer's own k/v projections, ahead of the block's own keys and values. A block is the anchor
token followed by block_size-1 mask tokens; its queries see the context before the anchor and the
whole block (bidirectional), and each mask position predicts its own token. The target's embedding
and LM head are shared and frozen, so the drafter stores only its layers, fc and norms.

DFlash2 (`arch = "dflash2"`, z-lab's, as speculators 0.9 trains it) adds a grouped dynamic causal
convolution before and after each sublayer (within a block, starting as the identity) and a
candidate selector: each draft is chosen among the LM head's top-k by unary + a low-rank bilinear
term of the previous draft, the position's state and the candidate.

One source for the architecture: the norms, the MLP and the attention's projections are the
classes of dflash_remote.py, the standalone remote code every drafter directory carries (as
`dflash.py`, which config.json's `auto_map` names). This module adds what training needs around
them: several blocks per row in one pass (their positions and attention mask), the config.json
writer, the safetensors files and the chunked LM-head loss.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_etl.core.errors import StageError
from dflash_etl.models import dflash_remote as remote
from dflash_etl.models.serving import attention_mismatch, aux_hidden_state_layer_ids
from dflash_etl.models.target import LAST_LAYER_STATE

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
REMOTE_CODE = "dflash.py"  # models/dflash_remote.py, copied beside the weights (auto_map)
REMOTE_SOURCE = Path(__file__).with_name("dflash_remote.py")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# a DFlash2 drafter's own settings (dflash_config's keys; [train]'s and speculators' names)
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DrafterConfig:
    """The drafter's shape; the attention and MLP shapes copy the target's."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    target_num_hidden_layers: int = 0
    loss_decay_gamma: float = 7.0
    # the target's context length: vLLM sizes the drafter's rotary cache by it (32768 if absent)
    max_position_embeddings: int = 32768
    # "dflash2": z-lab's DFlash2, with these (speculators' defaults); written in dflash_config
    arch: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @classmethod
    def from_target(cls, target_config: Any, *, draft_layers: int, target_layer_ids: list[int],
                    mask_token_id: int, block_size: int) -> DrafterConfig:
        # a vision-language target's config is composite: the decoder's shape is its text config
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") \
            else target_config
        heads = text.num_attention_heads
        return cls(
            hidden_size=text.hidden_size, num_hidden_layers=draft_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            vocab_size=text.vocab_size, target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id, block_size=block_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=float(getattr(text, "rope_theta", None)
                             or (getattr(text, "rope_parameters", None) or {}).get(
                                 "rope_theta", 1_000_000.0)),
            target_num_hidden_layers=text.num_hidden_layers,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None)
                                        or cls.max_position_embeddings))

    def to_json(self) -> dict[str, Any]:
        """config.json in the z-lab DFlash layout (a Qwen3 config plus dflash_config), with every
        field a loader would otherwise default stated: what this drafter computes (SiLU, no
        attention bias, full bidirectional attention, plain rotary), the target's context
        length, and the target layers in both conventions (see `aux_hidden_state_layer_ids`)."""
        doc = {k: v for k, v in asdict(self).items()
               if k not in ("target_layer_ids", "mask_token_id", "arch", *DFLASH2_SETTINGS)}
        name = ARCHITECTURES[self.arch]
        doc.update({
            "architectures": [name], "model_type": "qwen3",
            "auto_map": {"AutoModel": f"{REMOTE_CODE.removesuffix('.py')}.{name}"},
            "num_target_layers": self.target_num_hidden_layers,
            "target_hidden_size": self.hidden_size,
            "hidden_act": "silu", "attention_bias": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": False, "dtype": "float32", "torch_dtype": "float32",
            "dflash_config": {"target_layer_ids": self.target_layer_ids,
                              "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
            # vLLM's name for the same layers counted with the embedding output as 0; its
            # hidden-state capture reads this first (else dflash_config.target_layer_ids + 1)
            "eagle_aux_hidden_state_layer_ids": aux_hidden_state_layer_ids(
                self.target_layer_ids),
            # which state of the target's last layer the drafter reads, if it reads that one
            "target_last_layer_state": LAST_LAYER_STATE})
        if self.arch == "dflash2":
            doc["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_SETTINGS})
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DrafterConfig:
        values = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        values["target_layer_ids"] = doc["dflash_config"]["target_layer_ids"]
        values["mask_token_id"] = doc["dflash_config"]["mask_token_id"]
        names = {v: k for k, v in ARCHITECTURES.items()}
        values["arch"] = names.get((doc.get("architectures") or ["DFlashDraftModel"])[0],
                                   "dflash")
        values.update({k: doc["dflash_config"][k] for k in DFLASH2_SETTINGS
                       if k in doc["dflash_config"]})
        return cls(**values)

    @property
    def conv_shape(self) -> tuple[int, int, int] | None:
        """DFlash2's local convolutions (kernel size, group size, block size); DFlash: None."""
        return (self.conv_kernel_size, self.conv_group_size, self.block_size) \
            if self.arch == "dflash2" else None


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the half-split layout of Llama/Qwen) at explicit positions.
    x: [B, heads, S, D]; positions: [B, S]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[..., None] * inv  # [B, S, D/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, S, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class BlockAttention(remote.DFlashAttention):
    """The remote code's attention (its projections, norms, shapes and config parsing) over the
    blocks of a training batch: the context's keys and values, then every block's. Its forward
    is its own for the rotary embedding: `rotate` gives the remote `_rotate`'s values with its
    operations in another order, so autograd sums their gradients in another order, and the
    trained weights are byte-identical outputs (tests/run_compare.py) only in this order."""

    def forward(self, x: torch.Tensor, context: torch.Tensor, positions: torch.Tensor,
                context_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        keys_in = torch.cat([context, x], dim=1)
        k = self.k_norm(self._split(self.k_proj(keys_in), self.kv_heads))
        v = self._split(self.v_proj(keys_in), self.kv_heads)
        q = rotate(q, positions, self.theta)
        k = rotate(k, torch.cat([context_positions, positions], dim=1), self.theta)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DecoderLayer(remote.DFlashDecoderLayer):
    """The remote code's decoder layer (its norms, MLP and DFlash2 convolutions, in its order)
    with BlockAttention."""

    def __init__(self, config: Any, layer_idx: int,
                 conv: tuple[int, int, int] | None = None) -> None:
        super().__init__(config, layer_idx, attention=BlockAttention, conv=conv)

    def forward(self, x: torch.Tensor, context: torch.Tensor, positions: torch.Tensor,
                context_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.around(x, lambda h: self.self_attn(h, context, positions, context_positions,
                                                       mask))


def block_attention_mask(anchors: torch.Tensor, context_valid: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Which keys each block position attends to, [B, N*S, T + N*S] (True: attends), keys
    laid out as the context then the blocks: the context strictly before the block's anchor,
    and every position of its own block (full attention, bidirectional within the block: no
    sliding window, no causal order), as z-lab's DFlash attends."""
    b, n = anchors.shape
    t = context_valid.shape[1]
    device = anchors.device
    sees_context = (torch.arange(t, device=device)[None, None] < anchors[..., None])  # B,N,T
    sees_context = sees_context & context_valid[:, None]
    block_of = torch.arange(n, device=device).repeat_interleave(block_size)
    same_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context.repeat_interleave(block_size, dim=1), same_block], dim=2)


class DFlashDrafter(nn.Module):
    """The trainable part of a DFlash drafter (the embedding and LM head are the target's). Its
    layers are built from the config.json it writes, parsed as the remote code parses it."""

    def __init__(self, config: DrafterConfig) -> None:
        from transformers import Qwen3Config

        super().__init__()
        self.config = config
        c = config
        written = Qwen3Config(**c.to_json())
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = remote.DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(written, i, c.conv_shape)
                                    for i in range(c.num_hidden_layers))
        self.norm = remote.DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.apply(self._init)
        if c.arch == "dflash2":  # its convolutions start as the identity, as speculators' do
            for layer in self.layers:
                layer.attention_conv.reset_parameters()
                layer.mlp_conv.reset_parameters()
            self.candidate_selector = remote.DFlashCandidateSelector(
                c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, target_hidden: torch.Tensor, context_valid: torch.Tensor,
                block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Hidden states of every block position, before the LM head.

        target_hidden: [B, T, K*H] the target's states at positions 0..T-1 (the context);
        context_valid: [B, T] bool, False on padding;
        block_embeds: [B, N, S, H] the embedded blocks (anchor token, then mask tokens);
        anchors: [B, N] each block's anchor position (the block occupies anchor..anchor+S-1
        and sees the context strictly before the anchor).
        Returns [B, N, S, H].
        """
        b, n, s, h = block_embeds.shape
        t = target_hidden.shape[1]
        device = block_embeds.device
        context = self.hidden_norm(self.fc(target_hidden))
        offsets = torch.arange(s, device=device)
        positions = (anchors[..., None] + offsets).reshape(b, n * s)
        context_positions = torch.arange(t, device=device).expand(b, t)
        mask = block_attention_mask(anchors, context_valid, s)
        x = block_embeds.reshape(b, n * s, h)
        for layer in self.layers:
            x = layer(x, context, positions, context_positions, mask)
        return self.norm(x).view(b, n, s, h)

    # ------------------------------------------------------------ files
    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
        (directory / CONFIG).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        shutil.copyfile(REMOTE_SOURCE, directory / REMOTE_CODE)

    @classmethod
    def load(cls, directory: Path) -> DFlashDrafter:
        from safetensors.torch import load_file

        written = json.loads((directory / CONFIG).read_text())
        if problem := attention_mismatch(written, directory / CONFIG):
            raise StageError(problem)
        config = DrafterConfig.from_json(written)
        model = cls(config)
        model.load_state_dict(load_file(str(directory / WEIGHTS)))
        return model


def block_loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for block offsets k = 1..block_size-1 (offset 0 is the anchor: 0)."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# the logits of one chunk of predicted positions: chunk x vocab fp32 floats (256 MB), so a
# 248k vocabulary takes ~270 positions at a time, a 32k one ~2,000, whatever the batch holds
LOGIT_BUDGET = 1 << 26


def logit_chunk(vocab: int, budget: int = LOGIT_BUDGET) -> int:
    """Predicted positions per chunk so that a chunk's logits stay within `budget` floats."""
    return max(1, budget // max(1, vocab))


class _HeadCrossEntropy(torch.autograd.Function):
    """sum(w * cross_entropy(states @ W.T + b, labels)) a chunk of positions at a time, with the
    gradient for `states` computed in the same pass (softmax - one-hot, times W): the head is
    frozen, so nothing else needs a gradient and no chunk's logits are recomputed or kept for
    the backward pass. Also returns per position whether the argmax is the label, and the ids
    of its `top_k` largest logits (DFlash2's candidates; none for 0)."""

    @staticmethod
    def forward(ctx: Any, states: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, labels: torch.Tensor, label_weights: torch.Tensor,
                chunk: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, head = states.shape[0], weight.device  # the head may sit on another device
        labels, label_weights = labels.to(head), label_weights.to(head)
        total = torch.zeros((), dtype=torch.float32, device=head)
        hits = torch.zeros(n, dtype=torch.bool, device=head)
        candidates = torch.zeros((n, top_k), dtype=torch.long, device=head)
        grad = torch.empty_like(states, dtype=torch.float32) \
            if ctx.needs_input_grad[0] else None
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            y, w = labels[a:b], label_weights[a:b].float()
            rows = torch.arange(b - a, device=head)
            # few passes over the chunk's logits, in place: they dominate at a large vocabulary
            logits = F.linear(states[a:b].to(head, weight.dtype), weight, bias).float()
            if top_k:
                candidates[a:b] = logits.topk(top_k, dim=-1).indices
            picked = logits[rows, y]
            top, best = logits.max(dim=-1)
            hits[a:b] = best == y
            exps = logits.sub_(top[:, None]).exp_()
            sums = exps.sum(dim=-1)
            total = total + ((top + sums.log() - picked) * w).sum()
            if grad is not None:  # w * (softmax - one-hot) @ W
                exps.mul_((w / sums)[:, None])
                exps[rows, y] -= w
                grad[a:b] = (exps.to(weight.dtype) @ weight).to(grad.device, torch.float32)
            del logits, exps
        ctx.mark_non_differentiable(hits, candidates)
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.states_dtype = states.dtype
        return total.to(states.device), hits, candidates

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.states_dtype), None, None, None, None, None, None


def head_cross_entropy(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       labels: torch.Tensor, label_weights: torch.Tensor,
                       chunk: int | None = None, top_k: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of the weighted cross-entropy of a frozen LM head's logits, argmax == label per
    position, the ids of each position's `top_k` largest logits [P, top_k]) over states
    [P, H]; at most `chunk` positions' logits exist at one time (default: `logit_chunk` of the
    head's rows). The head gets no gradient."""
    chunk = chunk or logit_chunk(weight.shape[0])
    return _HeadCrossEntropy.apply(states, weight.detach(),
                                   None if bias is None else bias.detach(), labels,
                                   label_weights, chunk, top_k)
