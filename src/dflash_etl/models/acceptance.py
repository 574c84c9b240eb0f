"""Acceptance length (tau): simulated speculative decoding of a drafter against its target.

Each step the drafter proposes a block (the last accepted token, then block_size-1 mask tokens,
one forward pass), the target checks it greedily, the longest agreeing prefix is accepted plus
the target's own next token (the bonus), and the step scores the tokens it added to the text:
accepted + 1, but no more than `max_new_tokens` leave room for, and no further than the end of
turn. Near the end the block shrinks to the room left. This is z-lab's `dflash_generate`'s count
(tested against it: the same tau on the same drafter, target and prompts); tau is the mean score
per step, averaged per prompt and then over the prompts that took a step (as z-lab's benchmark
does). The output is the target's greedy decoding whatever the drafter proposes (tested).

At a temperature above 0 the target's tokens are drawn, and drafts accepted by the standard
speculative-sampling rule (`verify`), from a seeded generator: the text follows the target's
sampling distribution whatever the drafter proposes (tested).

The target keeps a KV cache and feeds only each block (rejected drafts are cropped from it);
targets whose cache cannot be cropped (hybrid recurrent layers) re-read the whole sequence each
step instead. Both give the same tokens and scores (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_etl.models.loading import execution_device


@dataclass
class Decoded:
    tokens: list[int]  # the new tokens, the target's greedy continuation
    accepted: list[int]  # per step: draft tokens accepted + 1
    drafted: list[int] = field(default_factory=list)  # per step: the tokens drafted

    @property
    def tau(self) -> float | None:
        """Tokens per step; None when the text ended before a step (z-lab leaves it out)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else None


# (the target's states before the anchor, the text so far, the tokens the step may add) ->
# the drafts, at most that many
Proposer = Callable[[Any, list[int], int], list[int]]


def drafter_block(target: Any, drafter: Any) -> Callable[[Any, list[int], int], Any]:
    """The drafter's block: given the target's states before the anchor (the last token of
    `seq`), (its states [drafts, H], its logits [drafts, vocab]) at the block_size-1 positions
    after the anchor from one forward pass (fewer where `room` is smaller: the block is then
    the anchor and `room` mask tokens, as z-lab's loop makes it)."""
    c = drafter.config
    embed, lm_head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    device = next(drafter.parameters()).device
    head_device = execution_device(lm_head)  # another one than the drafter's under a device map

    def block(context: Any, seq: list[int], room: int) -> tuple[Any, Any]:
        drafts = max(0, min(c.block_size - 1, room))
        if not drafts:
            return (torch.empty(0, c.hidden_size, device=device),
                    torch.empty(0, lm_head.weight.shape[0]))
        ids = torch.tensor([[seq[-1]] + [c.mask_token_id] * drafts], device=device)
        flat = context.reshape(1, context.shape[0], -1).to(device, torch.float32)
        hidden = drafter(flat, torch.ones(flat.shape[:2], dtype=torch.bool, device=device),
                         embed(ids).float()[:, None],
                         torch.tensor([[len(seq) - 1]], device=device))[0, 0, 1:]
        return hidden, lm_head(hidden.to(head_device, lm_head.weight.dtype))

    return block


def drafter_logits(target: Any, drafter: Any) -> Callable[[Any, list[int], int], Any]:
    """The drafter's logits [drafts, vocab] for a block (`drafter_block`)."""
    block = drafter_block(target, drafter)
    return lambda context, seq, room: block(context, seq, room)[1]


def drafter_proposer(target: Any, drafter: Any) -> Proposer:
    """The drafter's chain: the argmax at each position of its block (`drafter_block`); for
    DFlash2 its selector's greedy path over the top-k, as z-lab's `dflash_generate` decodes."""
    block = drafter_block(target, drafter)
    selector = getattr(drafter, "candidate_selector", None)

    def propose(context: Any, seq: list[int], room: int) -> list[int]:
        hidden, logits = block(context, seq, room)
        if selector is None or not len(logits):
            return logits.argmax(-1).tolist()
        anchor = torch.tensor([seq[-1]], device=hidden.device)
        return selector.path(hidden[None], logits.to(hidden.device)[None], anchor)[0].tolist()

    return propose


def speculative_decode(target: Any, propose: Proposer,
                       prompt: list[int], max_new_tokens: int, eos_ids: set[int],
                       use_cache: bool = True, temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> Decoded:
    """Decode `max_new_tokens` after `prompt`: `propose` drafts each block from the target's
    states before the anchor, the target verifies it (greedily, or at `temperature` by the
    speculative-sampling rule, drawing from `generator`: see `verify`). With a croppable KV
    cache (any attention-only target) each step feeds only the block and drops the rejected
    drafts from the cache, as a serving engine does; otherwise the target re-reads the whole
    sequence."""
    cache = _croppable_cache(target) if use_cache else None
    if cache is None:
        logits, states = target.forward([prompt], logits=True, logits_keep=1)
        last, context = logits[0][-1], states[0]
    else:
        logits, context = target.extend(prompt, cache)
        last = logits[-1]
    seq = [*prompt, _pick(last, temperature, generator)]
    new, accepted, drafted = [seq[-1]], [], []
    with torch.no_grad():
        while len(new) < max_new_tokens and new[-1] not in eos_ids:
            anchor = len(seq) - 1
            room = max_new_tokens - len(new)  # the tokens this step may still add
            draft = propose(context, seq, room)[:room]
            if cache is None:
                # only the anchor's and the drafts' logits: the LM head over every position
                # of the sequence made the pass ~11x slower on a 248k vocabulary (bench_tau_verify)
                logits, states = target.forward([seq + draft], logits=True,
                                                logits_keep=len(draft) + 1)
                block_logits = logits[0]
            else:
                block_logits, block_states = target.extend([seq[-1], *draft], cache)
            n, following = verify(block_logits, draft, temperature, generator)
            gained = [*draft[:n], following][:room]
            for k, token in enumerate(gained):  # stop at the end of turn, as the target would
                if token in eos_ids:
                    gained = gained[:k + 1]
                    break
            accepted.append(len(gained))  # what the step added to the text: z-lab's count
            drafted.append(len(draft))
            seq += gained
            new += gained
            if cache is None:
                context = states[0][:len(seq) - 1]
            else:  # keep the anchor and the accepted drafts; the bonus token is the next anchor
                extra = cache.get_seq_length() - (anchor + n + 1)
                if extra:
                    cache.crop(-extra)
                context = torch.cat([context, block_states[:n + 1]])
    return Decoded(tokens=new[:max_new_tokens], accepted=accepted, drafted=drafted)


def verify(logits: Any, draft: list[int], temperature: float = 0.0,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """(drafts accepted, the target's token after them) for one block: `logits` [len(draft)+1,
    vocab] are the target's at the anchor and at each draft. Greedy: the longest prefix equal
    to the target's argmax, then its argmax. At a temperature the drafts are deterministic (the
    drafter's argmax, as vLLM's DFlash proposer drafts), so the speculative-sampling rule for a
    one-hot draft distribution applies: draft x is accepted with probability p(x); at the first
    rejection the token is drawn from p with x removed, after all of them from the next p. The
    text then follows the target's own sampling distribution exactly (tested)."""
    if temperature <= 0:
        checked = logits.argmax(-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == checked[n]:
            n += 1
        return n, checked[n]
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    for n, token in enumerate(draft):
        p = probs[n]
        if torch.rand((), generator=generator, device=p.device) >= p[token]:
            rest = p.clone()
            rest[token] = 0.0
            return n, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator))


def _pick(logits: Any, temperature: float, generator: torch.Generator | None) -> int:
    """The target's token from one position's logits: argmax, or a draw at `temperature`."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _croppable_cache(target: Any) -> Any:
    """A cache the verify loop can crop back to the kept tokens, or None (the loop then feeds
    the whole sequence each step). A linear-attention layer (Gated DeltaNet: Qwen3.5/3.6) says
    it is croppable from transformers 5.25 on, but crops only what it recorded, and recording
    its recurrent states changes how the model computes them: such a cache is taken as not
    croppable, as every earlier transformers said it was."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.model.config)
    if not cache.is_croppable:
        return None
    linear = [layer for layer in getattr(cache, "layers", ()) if hasattr(layer, "conv_states")]
    if any(getattr(layer, "record_past", None) is False for layer in linear):
        return None
    return cache


def acceptance_length(target: Any, drafter: Any, prompts: list[list[int]], max_new_tokens: int,
                      eos_ids: set[int]) -> dict[str, Any]:
    """tau over `prompts`: per prompt, and their mean."""
    was_training = drafter.training
    drafter.eval()
    propose = drafter_proposer(target, drafter)
    per_prompt = [speculative_decode(target, propose, p, max_new_tokens, eos_ids).tau
                  for p in prompts]
    drafter.train(was_training)
    stepped = [t for t in per_prompt if t is not None]  # a text that ended at once: no step
    return {"tau": sum(stepped) / len(stepped) if stepped else 1.0,
            "per_prompt": [None if t is None else round(t, 4) for t in per_prompt]}


def eos_token_ids(model: Any) -> set[int]:
    """The end-of-sequence ids the target's generation config and config name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids
