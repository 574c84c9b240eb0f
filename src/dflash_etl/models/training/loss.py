"""The blocks a DFlash drafter learns from and their loss: anchors where the loss mask and its
successor are 1, a block per anchor (the anchor token, then block_size-1 mask tokens), and the
decay-weighted cross-entropy of its predictions, over the target's whole LM head or only the draft
vocabulary's rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_etl.core.errors import StageError


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p with loss_mask[p] == loss_mask[p+1] == 1: the anchor is supervised and so is
    at least the first token its block predicts."""
    m = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(rows: list[dict[str, Any]], anchors_per_row: int,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """Each row's anchors (sorted), drawn among its anchor candidates without replacement."""
    picks = []
    for row in rows:
        cands = anchor_candidates(row["loss_mask"])
        picks.append(np.sort(rng.choice(cands, size=min(anchors_per_row, len(cands)),
                                        replace=False)))
    return picks


def loss_weight_total(rows: list[dict[str, Any]], anchors: list[np.ndarray],
                      weights: np.ndarray, in_vocab: np.ndarray | None = None) -> float:
    """The sum of the loss weights of every predicted position of these blocks: the loss's
    normaliser, computed from the rows alone so that every rank of a DDP step divides by the
    whole batch's total (the step then equals one process training on the whole batch). With
    `in_vocab` (a draft vocabulary's bool per token id) only labels inside it count."""
    total = 0.0
    for row, picks in zip(rows, anchors, strict=True):
        mask = np.asarray(row["loss_mask"], dtype=bool)
        if in_vocab is not None:
            mask = mask & in_vocab[np.asarray(row["input_ids"], dtype=np.int64)]
        for k in range(1, len(weights)):
            at = picks + k
            inside = at < len(mask)
            total += float(weights[k]) * int(mask[at[inside]].sum())
    return total


def make_batch(rows: list[dict[str, Any]], states: list[Any], picks: list[np.ndarray],
               block_size: int, mask_token_id: int,
               label_ids: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Pad the rows and lay out their blocks at the given anchors; returns the tensors
    `block_loss` takes. The labels are the rows' tokens, or `label_ids` (per row, as long as
    it: the target's tokens, labels.target_labels) with `labels_changed` counting the
    supervised labels that differ from the row's; a block's anchor is the row's token."""
    import torch

    b, t = len(rows), max(len(r["input_ids"]) for r in rows)
    width = states[0].shape[1] * states[0].shape[2]
    ids = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    valid = torch.zeros((b, t), dtype=torch.bool)
    hidden = torch.zeros((b, t, width), dtype=torch.float32)
    for k, (row, s) in enumerate(zip(rows, states, strict=True)):
        n = len(row["input_ids"])
        ids[k, :n] = torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int64))
        mask[k, :n] = torch.as_tensor(np.asarray(row["loss_mask"], dtype=bool))
        valid[k, :n] = True
        hidden[k, :n] = s.reshape(n, width).float()
    n = max(len(p) for p in picks)
    anchors = torch.zeros((b, n), dtype=torch.long)
    keep = torch.zeros((b, n), dtype=torch.bool)
    for k, p in enumerate(picks):
        anchors[k, :len(p)] = torch.as_tensor(p)
        keep[k, :len(p)] = True
    offsets = torch.arange(block_size)
    where = anchors[..., None] + offsets  # [B, N, S]
    inside = where < valid.sum(1)[:, None, None]
    clipped = where.clamp(max=t - 1)
    labels = torch.gather(ids[:, None].expand(-1, n, -1), 2, clipped)
    supervised = torch.gather(mask[:, None].expand(-1, n, -1), 2, clipped)
    block_ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long)
    block_ids[..., 0] = labels[..., 0]
    batch = {"hidden": hidden, "valid": valid, "block_ids": block_ids, "anchors": anchors,
             "labels": labels, "label_ok": keep[..., None] & inside & supervised & (offsets > 0)}
    if label_ids is not None:
        chosen = torch.zeros((b, t), dtype=torch.long)
        for k, row_labels in enumerate(label_ids):
            chosen[k, :len(row_labels)] = torch.as_tensor(np.asarray(row_labels, np.int64))
        batch["labels"] = torch.gather(chosen[:, None].expand(-1, n, -1), 2, clipped)
        batch["labels_changed"] = int(((batch["labels"] != labels) & batch["label_ok"]).sum())
    return batch


class DraftVocab:
    """tokenize's draft vocabulary (t2d: a bool per target token id, speculators' layout) as
    the LM head's rows: the loss over the draft tokens only, as speculators trains with
    --draft-vocab-size (its head is the target head's t2d rows, in token id order)."""

    def __init__(self, t2d: np.ndarray, head_rows: int, source: str = "t2d") -> None:
        import torch

        t2d = np.asarray(t2d, dtype=bool)
        if t2d.ndim != 1 or not t2d.any():
            raise StageError(f"{source}: a draft vocabulary needs a non-empty 1-d bool t2d map")
        if len(t2d) > head_rows and t2d[head_rows:].any():
            raise StageError(f"{source} marks token ids beyond the target's {head_rows} LM head "
                             "rows: it was made for another target; rerun tokenize")
        self.inside = np.zeros(head_rows, dtype=bool)  # padded/cut to the head's rows
        self.inside[:min(len(t2d), head_rows)] = t2d[:head_rows]
        self.size = int(self.inside.sum())
        self.rows = torch.as_tensor(np.flatnonzero(self.inside))
        to_draft = np.full(head_rows, -1, dtype=np.int64)
        to_draft[self.inside] = np.arange(self.size)
        self.to_draft = torch.as_tensor(to_draft)
        self._head: tuple[Any, Any, Any] | None = None

    def head(self, lm_head: Any) -> tuple[Any, Any]:
        """(weight, bias) of the LM head's draft rows (a copy, made once per head)."""
        if self._head is None or self._head[0] is not lm_head:
            rows = self.rows.to(lm_head.weight.device)
            bias = getattr(lm_head, "bias", None)
            self._head = (lm_head, lm_head.weight.detach()[rows].contiguous(),
                          None if bias is None else bias.detach()[rows].contiguous())
        return self._head[1], self._head[2]


def selector_loss(selector: Any, states: Any, head_weight: Any, head_bias: Any,
                  candidates: Any, labels: Any, predecessors: Any, weights: Any
                  ) -> tuple[Any, Any]:
    """DFlash2's selector objective, speculators 0.9's (models/dflash2/metrics.py): a
    cross-entropy over each position's unary top-k candidates, the label injected in place of
    the k-th when the top-k misses it, scored as at serving (unary logit + the bilinear term of
    the predecessor, the teacher-forced previous label), weighted as the unary loss. Returns
    (the weighted sum, per position whether the selector's choice is the label)."""
    import torch
    import torch.nn.functional as F

    present = candidates == labels[:, None]
    found = present.any(-1)
    candidates = candidates.clone()
    candidates[:, -1] = torch.where(found, candidates[:, -1], labels)
    where = torch.where(found, present.long().argmax(-1), candidates.shape[1] - 1)
    on_head = candidates.to(head_weight.device)  # the head may sit on another device
    rows = head_weight[on_head].to(states.device, states.dtype)  # [P, k, H], frozen
    unary = torch.bmm(rows, states.unsqueeze(-1))[..., 0]
    if head_bias is not None:
        unary = unary + head_bias[on_head].to(unary.device, unary.dtype)
    scores = unary.float() + selector.transition(states, predecessors, candidates).float()
    total = (F.cross_entropy(scores, where, reduction="none") * weights).sum()
    return total, (scores.argmax(-1) == where) & found


def block_loss(drafter: Any, embed: Any, lm_head: Any, batch: dict[str, Any], weights: Any,
               chunk: int | None = None, normalizer: float | None = None,
               vocab: DraftVocab | None = None, selector_alpha: float = 1.0
               ) -> tuple[Any, dict[str, float]]:
    """The decay-weighted cross-entropy of a batch of blocks (divided by `normalizer`, default
    the batch's own weight total), and its accuracy at offset 1; a DFlash2 drafter adds
    `selector_alpha` times its selector's loss (`selector_loss`).

    Only supervised positions go through the LM head, `chunk` at a time (default: as many as
    keep a chunk's logits within drafter.LOGIT_BUDGET floats), with the head's gradient for
    them computed in the same pass (drafter.head_cross_entropy): with a 248k vocabulary the
    logits of every block would take gigabytes. With a draft `vocab` the head is its rows only
    and labels outside it are left out of the loss and counted (`outside_draft_vocab`)."""
    import torch

    from dflash_etl.models.drafter import head_cross_entropy

    device = weights.device
    selector = getattr(getattr(drafter, "module", drafter), "candidate_selector", None)
    with torch.no_grad():
        block_embeds = embed(batch["block_ids"].to(device)).float()
    hidden = drafter(batch["hidden"].to(device), batch["valid"].to(device), block_embeds,
                     batch["anchors"].to(device))
    ok = batch["label_ok"][:, :, 1:].to(device)
    first = torch.zeros_like(ok)
    first[..., 0] = True
    labels = batch["labels"][:, :, 1:].to(device)[ok]
    w = (weights[1:] * ok)[ok]
    states = hidden[:, :, 1:][ok]  # [supervised positions, hidden]
    first = first[ok]
    head_weight, head_bias = lm_head.weight, getattr(lm_head, "bias", None)
    outside = 0
    if vocab is not None:
        mapped = vocab.to_draft.to(device)[labels]
        inside = mapped >= 0
        outside = int((~inside).sum())
        labels, w, states, first = mapped[inside], w[inside], states[inside], first[inside]
        head_weight, head_bias = vocab.head(lm_head)
    total, hits, candidates = head_cross_entropy(
        states, head_weight, head_bias, labels, w, chunk,
        top_k=0 if selector is None else min(selector.top_k, head_weight.shape[0]))
    hits = hits.to(first.device)  # the head's device, under a device-mapped target
    divide = normalizer if normalizer is not None else w.sum() + 1e-6
    metrics: dict[str, float] = {}
    if selector is not None:
        # each position's predecessor: the anchor, then the label before it (the accepted path)
        before = torch.cat([batch["block_ids"][:, :, :1], batch["labels"][:, :, 1:-1]], dim=2)
        picked_total, picked = selector_loss(
            selector, states, head_weight.detach(),
            None if head_bias is None else head_bias.detach(), candidates.to(device),
            labels, before.to(device)[ok], w)
        total = total.to(device) + selector_alpha * picked_total.to(device)
        picked = picked.to(first.device)
        metrics.update(selector_loss=float(picked_total.detach()) / float(divide),
                       selector_acc_1=float((picked & first).sum() / first.sum().clamp(min=1)))
    loss = total / divide
    metrics.update({"loss": float(loss.detach()),
                    "acc_1": float((hits & first).sum() / first.sum().clamp(min=1)),
                    "supervised": len(labels)})
    if vocab is not None:
        metrics.update(outside_draft_vocab=float(outside), inside_draft_vocab=float(len(labels)))
    return loss, metrics
