"""The drafter's loss through the target's LM head: computed a chunk of positions at a time with
its gradient in the same pass (peak memory chunk x vocab, not positions x vocab), equal to the
plain cross-entropy over every position's logits; and over a draft vocabulary (tokenize's t2d)
equal to a reference computed by hand, labels outside it left out and counted."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.training import loss as train

torch = pytest.importorskip("torch")
from dflash_etl.models.drafter import (  # noqa: E402
    DFlashDrafter,
    DrafterConfig,
    block_loss_weights,
    head_cross_entropy,
    logit_chunk,
)

VOCAB, HIDDEN, BLOCK = 40, 16, 4


def _setup(bias: bool = False):
    config = DrafterConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8, intermediate_size=32,
                           vocab_size=VOCAB, target_layer_ids=[0], mask_token_id=VOCAB - 1,
                           block_size=BLOCK)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias).requires_grad_(False)
    rows = [{"input_ids": [int(t) for t in torch.randint(0, VOCAB - 1, (n,))],
             "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (14, 9, 11)]
    anchors = train.sample_anchors(rows, 6, np.random.default_rng(1))
    states = [torch.randn(len(r["input_ids"]), 1, HIDDEN) for r in rows]
    batch = train.make_batch(rows, states, anchors, BLOCK, VOCAB - 1)
    return drafter, embed, lm_head, rows, anchors, batch, block_loss_weights(BLOCK, 7.0)


def _grads(model) -> list:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_loss_equals_the_plain_cross_entropy_for_any_chunk(bias):
    drafter, embed, lm_head, _rows, _anchors, batch, weights = _setup(bias)
    hidden = drafter(batch["hidden"], batch["valid"], embed(batch["block_ids"]).detach(),
                     batch["anchors"])
    ok = batch["label_ok"][:, :, 1:]
    w = (weights[1:] * ok)[ok]
    plain = (torch.nn.functional.cross_entropy(lm_head(hidden[:, :, 1:][ok]),
                                               batch["labels"][:, :, 1:][ok],
                                               reduction="none") * w).sum()
    plain.backward()
    want = _grads(drafter)
    assert len(w) > 20
    for chunk in (1, 7, len(w), None):
        drafter.zero_grad()
        loss, metrics = train.block_loss(drafter, embed, lm_head, batch, weights, chunk=chunk,
                                         normalizer=1.0)
        loss.backward()
        assert abs(loss.item() - plain.item()) <= 1e-6 * max(1.0, abs(plain.item())), chunk
        assert all(torch.allclose(g, p.grad, atol=1e-6, rtol=1e-5)
                   for g, p in zip(want, drafter.parameters(), strict=True)), chunk
        assert metrics["supervised"] == len(w)


def test_a_chunk_holds_a_bounded_number_of_logits_whatever_the_batch():
    """Before: 4,096 positions a chunk whatever the vocabulary (4 GB of fp32 logits at 248k).
    Now the chunk is sized from the head's rows."""
    assert logit_chunk(248_320) * 248_320 <= 1 << 26 < (logit_chunk(248_320) + 1) * 248_320
    assert logit_chunk(32_000) > 2000 and logit_chunk(10) == (1 << 26) // 10
    states = torch.randn(5, 3, requires_grad=True)
    head = torch.randn(7, 3)
    total, hits, _ = head_cross_entropy(states[:0], head, None,
                                        torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert float(total) == 0.0 and hits.shape == (0,)  # no supervised position: no error


def test_the_draft_vocabulary_loss_equals_a_hand_computed_reference():
    """Head rows = the target head's t2d rows in token id order (speculators' layout); labels are
    mapped to draft ids; labels outside the draft vocabulary leave the loss and its normaliser
    (SpecForge's position mask) and are counted."""
    drafter, embed, lm_head, rows, anchors, batch, weights = _setup()
    ids = sorted({t for r in rows for t in r["input_ids"]})
    draft = ids[::2]  # every other token id the data uses: plenty of labels fall outside
    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[draft] = True
    vocab = train.DraftVocab(t2d, VOCAB)
    normalizer = train.loss_weight_total(rows, anchors, weights.numpy(), vocab.inside)
    loss, metrics = train.block_loss(drafter, embed, lm_head, batch, weights, chunk=3,
                                     normalizer=normalizer, vocab=vocab)

    # by hand, position by position
    with torch.no_grad():
        hidden = drafter(batch["hidden"], batch["valid"], embed(batch["block_ids"]),
                         batch["anchors"])
    total, weight_sum, outside, inside = 0.0, 0.0, 0, 0
    b, n, s = batch["labels"].shape
    for i in range(b):
        for j in range(n):
            for k in range(1, s):
                if not batch["label_ok"][i, j, k]:
                    continue
                label = int(batch["labels"][i, j, k])
                if label not in draft:
                    outside += 1
                    continue
                inside += 1
                logits = [float(lm_head.weight[t] @ hidden[i, j, k]) for t in draft]
                top = max(logits)
                log_z = top + float(np.log(sum(np.exp(x - top) for x in logits)))
                total += float(weights[k]) * (log_z - logits[draft.index(label)])
                weight_sum += float(weights[k])
    assert outside > 5 and inside > 5
    assert metrics["outside_draft_vocab"] == outside and metrics["inside_draft_vocab"] == inside
    assert normalizer == pytest.approx(weight_sum, rel=1e-9)
    assert float(loss) == pytest.approx(total / weight_sum, rel=1e-5)
    loss.backward()  # and it trains the drafter
    assert all(p.grad is not None for p in drafter.parameters())
    assert lm_head.weight.grad is None


def test_a_t2d_map_that_does_not_fit_the_head_is_refused():
    t2d = np.zeros(VOCAB + 5, dtype=bool)
    t2d[VOCAB + 2] = True
    with pytest.raises(StageError, match="beyond the target's 40 LM head rows"):
        train.DraftVocab(t2d, VOCAB)
    with pytest.raises(StageError, match="non-empty"):
        train.DraftVocab(np.zeros(VOCAB, dtype=bool), VOCAB)
    short = np.zeros(VOCAB - 8, dtype=bool)  # tokenize's tokenizer-sized map: padded with False
    short[[1, 3]] = True
    vocab = train.DraftVocab(short, VOCAB)
    assert vocab.size == 2 and vocab.to_draft.tolist()[:4] == [-1, 0, -1, 1]
    assert len(vocab.to_draft) == VOCAB
