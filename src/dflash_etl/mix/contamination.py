"""Benchmark contamination: a conversation that holds a benchmark item's text is kept out of the
training mix, or the drafter's acceptance measured on that benchmark is inflated.

The rule is the field's (GPT-3, Llama): text normalised to lower-case words (punctuation and
spacing dropped), and a conversation is contaminated by an item when any of its messages shares
a run of `ngram` words (13) with the item, or holds the whole item where the item is shorter
(at least MIN_WORDS words: a two-word item would match everything). Re-cased, re-spaced,
re-punctuated copies and an item embedded in a longer prompt are caught; a reference answer
(GSM8K's solution) as a reply is too. Pure: words in, matches out.

At scale `match_many` takes a batch: every stored gram is at least MIN_WORDS words, so a
conversation holding one holds its first MIN_WORDS words. Those prefixes are tested for every
conversation of the batch at once by hash (ngrams.py), and only the conversations that hold
one are searched word by word: the result is `match`'s, at a tenth of its cost.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_etl.io.benchmarks import BenchmarkItem
from dflash_etl.mix.ngrams import gram_hashes, word_hashes

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
    prefixes: set[tuple[str, ...]] = field(default_factory=set)  # each gram's first words
    # sorted, built on the first match_many (not pickled)
    _prefix_hashes: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, items: Iterable[BenchmarkItem], ngram: int = NGRAM) -> ContaminationIndex:
        if ngram < MIN_WORDS:
            raise ValueError(f"a shared run is at least MIN_WORDS ({MIN_WORDS}) words: {ngram}")
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
                    index.prefixes.add(tuple(w[k:k + MIN_WORDS]))
        return index

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_prefix_hashes": None}  # workers rebuild it: small pickles

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

    def match_many(self, conversations: list[list[str]]) -> list[tuple[str, str, str] | None]:
        """`match` of each conversation (its messages' texts), for a batch."""
        if not self.prefixes or not conversations:
            return [None] * len(conversations)
        if self._prefix_hashes is None:
            hashes, counts = word_hashes([" ".join(p) for p in self.prefixes])
            self._prefix_hashes = np.unique(gram_hashes(hashes, counts, MIN_WORDS)[0])
        # messages joined: a gram across two messages is a false candidate, searched and
        # rejected by `match`, never a missed one
        hashes, counts = word_hashes(["\n".join(texts) for texts in conversations])
        grams, per_text = gram_hashes(hashes, counts, MIN_WORDS)
        known = self._prefix_hashes
        at = np.minimum(np.searchsorted(known, grams), len(known) - 1)
        found = known[at] == grams
        text = np.repeat(np.arange(len(conversations)), per_text)
        candidates = np.unique(text[found])
        results: list[tuple[str, str, str] | None] = [None] * len(conversations)
        for k in candidates.tolist():
            results[k] = self.match(conversations[k])
        return results
