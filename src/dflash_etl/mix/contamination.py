"""Benchmark contamination: a conversation that holds a benchmark item's text is kept out of the
training mix, or the drafter's acceptance measured on that benchmark is inflated.

The rule is the field's (GPT-3, Llama): text normalised to lower-case words (punctuation and
spacing dropped), and a conversation is contaminated by an item when any of its messages shares
a run of `ngram` words (13) with the item, or holds the whole item where the item is shorter
(at least MIN_WORDS words: a two-word item would match everything). Re-cased, re-spaced,
re-punctuated copies and an item embedded in a longer prompt are caught; a reference answer
(GSM8K's solution) as a reply is too. Pure: words in, matches out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from dflash_etl.io.benchmarks import BenchmarkItem

WORD = re.compile(r"[a-z0-9]+")
NGRAM = 13
MIN_WORDS = 8


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


@dataclass
class ContaminationIndex:
    """The n-grams of every benchmark item (and the whole of the shorter ones), each with the
    first item it came from."""

    ngram: int = NGRAM
    grams: dict[tuple[str, ...], tuple[str, str]] = field(default_factory=dict)
    lengths: set[int] = field(default_factory=set)  # the lengths of the grams stored
    items: int = 0

    @classmethod
    def build(cls, items: Iterable[BenchmarkItem], ngram: int = NGRAM) -> ContaminationIndex:
        index = cls(ngram)
        for item in items:
            index.items += 1
            for text in item.texts:
                w = words(text)
                if len(w) < MIN_WORDS:
                    continue
                n = min(ngram, len(w))
                index.lengths.add(n)
                for k in range(len(w) - n + 1):
                    index.grams.setdefault(tuple(w[k:k + n]), (item.benchmark, item.item))
        return index

    def match(self, texts: Iterable[str]) -> tuple[str, str, str] | None:
        """(benchmark, item, the shared words) for the first item the texts hold, or None."""
        for text in texts:
            w = words(text)
            for n in sorted(self.lengths, reverse=True):
                for k in range(len(w) - n + 1):
                    hit = self.grams.get(tuple(w[k:k + n]))
                    if hit is not None:
                        return hit[0], hit[1], " ".join(w[k:k + n])
        return None
