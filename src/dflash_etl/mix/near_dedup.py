"""Near-duplicate conversations: the same prompt with other spacing, case or punctuation, a
sentence added or cut, a templated family that differs in a number. Exact hashing keeps them
all, and a drafter trained on them over-learns a few prompts.

MinHash signatures (rensa: 27x datasketch's speed on this machine at equal or better recall,
benchmarks/bench_near_dedup.py) of word n-gram shingles of the normalised text (lower-case
words, punctuation and spacing dropped), LSH for candidates, each candidate verified by the
signatures' Jaccard estimate. Rows are taken in a stable order (source, file, line): the first
of a cluster is kept, the others are near-duplicates of it. `scope = "prompt"` hashes the user
turns only, so a long system prompt shared by distinct conversations does not make them
duplicates. Pure: texts in, verdicts out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dflash_etl.mix.contamination import words

NUM_PERM = 128
BANDS = 16  # 16 bands of 8 rows: a pair at Jaccard 0.8 is a candidate with p > 0.99
SEED = 42


def shingles(text: str, n: int) -> list[str]:
    w = words(text)
    if len(w) <= n:
        return [" ".join(w)] if w else []
    return sorted({" ".join(w[k:k + n]) for k in range(len(w) - n + 1)})


def text_of(messages: Iterable[dict[str, Any]], scope: str) -> str:
    """What is compared: the user turns (scope "prompt") or every message."""
    return "\n".join((m.get("content") or "") for m in messages
                     if scope == "conversation" or m.get("role") == "user")


@dataclass
class NearDedup:
    """Rows offered in order; each is kept, or is a near-duplicate of an earlier kept one."""

    threshold: float = 0.8
    ngram: int = 3
    lsh: Any = None
    kept: dict[int, Any] = field(default_factory=dict)  # key -> signature
    ids: dict[int, str] = field(default_factory=dict)  # key -> conversation id

    def __post_init__(self) -> None:
        import rensa

        self.rensa = rensa
        self.lsh = rensa.RMinHashLSH(threshold=self.threshold, num_perm=NUM_PERM,
                                     num_bands=BANDS)

    def offer(self, key: int, conv_id: str, text: str) -> tuple[str, float] | None:
        """(the kept id it duplicates, the estimated Jaccard), or None: kept."""
        tokens = shingles(text, self.ngram)
        if not tokens:
            return None  # no words: nothing to compare (exact dedup still applies)
        signature = self.rensa.RMinHash(num_perm=NUM_PERM, seed=SEED)
        signature.update(tokens)
        best: tuple[str, float] | None = None
        for other in self.lsh.query(signature):
            similarity = self.kept[other].jaccard(signature)
            if similarity >= self.threshold and (best is None or similarity > best[1]):
                best = (self.ids[other], similarity)
        if best is None:
            self.lsh.insert(key, signature)
            self.kept[key], self.ids[key] = signature, conv_id
        return best
