"""Speculative decoding at a temperature: whatever the drafter proposes, the text follows the
target's own sampling distribution (the acceptance rule for deterministic drafts), checked
exactly on a bigram target whose every sequence probability is known."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from dflash_etl.models.acceptance import speculative_decode, verify  # noqa: E402

VOCAB, NEW, TEMPERATURE = 3, 3, 0.7
CHI2_DF26_P001 = 54.05  # chi-square, 26 degrees of freedom, p = 0.001


class Bigram:
    """A target whose next-token logits depend on the last token only."""

    def __init__(self) -> None:
        self.table = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.5, 0.3], [-0.5, 0.2, 1.0]])

    def forward(self, rows: list[list[int]], logits: bool = False, logits_keep: int = 1):
        seq = rows[0]
        out = torch.stack([self.table[t] for t in seq[-logits_keep:]])[None]
        return out, torch.zeros(1, len(seq), 1, 1)


def _propose(context, seq, room):  # drafts often wrong, sometimes right
    return [(seq[-1] + 1 + k) % VOCAB for k in range(min(2, room))]


def _exact() -> dict[tuple[int, ...], float]:
    probs = torch.softmax(Bigram().table / TEMPERATURE, dim=-1)
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        p, prev = 1.0, 0
        for t in seq:
            p *= float(probs[prev, t])
            prev = t
        out[seq] = p
    return out


def _chi2(counts: Counter, n: int) -> float:
    return sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in _exact().items())


def test_sampled_text_follows_the_targets_distribution_whatever_is_drafted():
    target, generator, n = Bigram(), torch.Generator().manual_seed(0), 3000
    counts, steps = Counter(), []
    for _ in range(n):
        decoded = speculative_decode(target, _propose, [0], NEW, set(), use_cache=False,
                                     temperature=TEMPERATURE, generator=generator)
        counts[tuple(decoded.tokens)] += 1
        steps += decoded.accepted
    assert _chi2(counts, n) < CHI2_DF26_P001
    assert max(steps) == 2 and min(steps) == 1  # drafts were accepted, and rejected
    # the same draws without the rule (every draft taken) are far from the target's text
    greedy_drafts = Counter()
    for _ in range(n):
        seq = [0, int(torch.multinomial(torch.softmax(target.table[0] / TEMPERATURE, -1), 1,
                                        generator=generator))]
        seq += _propose(None, seq, NEW - 1)
        greedy_drafts[tuple(seq[1:])] += 1
    assert _chi2(greedy_drafts, n) > 10 * CHI2_DF26_P001


def test_at_temperature_zero_the_rule_is_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    assert verify(logits, [1, 0]) == (2, 2)
    assert verify(logits, [1, 2]) == (1, 0)
    assert verify(logits, [0, 0]) == (0, 1)
    greedy = speculative_decode(Bigram(), _propose, [0], 5, set(), use_cache=False)
    assert greedy.tokens == [0, 0, 0, 0, 0]  # the bigram's argmax from 0 is 0
