"""Benchmark contamination: a conversation that holds a benchmark item's text is kept out of the
training mix, or the drafter's acceptance measured on that benchmark is inflated.

The rule is the field's (GPT-3, Llama): text normalised to lower-case words (punctuation and
spacing dropped), and a conversation is contaminated by an item when any of its messages shares
a run of `ngram` words (13) with the item, or holds the whole item where the item is shorter
(at least MIN_WORDS words: a two-word item would match everything). Re-cased, re-spaced,
re-punctuated copies and an item embedded in a longer prompt are caught; a reference answer
(GSM8K's solution) as a reply is too. Pure: words in, matches out.

At scale `match_many` (and `match_messages`, on an Arrow column) takes a batch: every stored
gram is at least MIN_WORDS words, so a message holding one holds its first MIN_WORDS words,
each of them a word of the benchmarks. The batch's words are numbered in that vocabulary at once
(ngrams.py: Arrow's hash table, no Python object per word), only the runs of MIN_WORDS known
words of one message are hashed and looked up among the stored prefixes, and only the
conversations that hold one are searched word by word: the result is `match`'s, at a small
fraction of its cost (most words of a chat message are not in the benchmarks' vocabulary).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_etl.io.benchmarks import BenchmarkItem
from dflash_etl.mix.ngrams import combine, hash_strings, split_words

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
    # (the prefixes' vocabulary, its words' hashes, the prefixes' sorted hashes): built on
    # the first batch (not pickled)
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
        texts = pa.array([t for texts in conversations for t in texts], pa.large_string())
        owner = np.repeat(np.arange(len(conversations)), [len(t) for t in conversations])
        results: list[tuple[str, str, str] | None] = [None] * len(conversations)
        for k in self.candidates(texts, owner).tolist():
            results[k] = self.match(conversations[k])
        return results

    def match_messages(self, messages: pa.Array | pa.ChunkedArray
                       ) -> dict[int, tuple[str, str, str]]:
        """{row: `match` of its messages' contents} for the rows of a canonical `messages`
        column that hold an item."""
        if isinstance(messages, pa.ChunkedArray):
            messages = messages.combine_chunks()
        contents = pc.struct_field(pc.list_flatten(messages), "content")
        owner = pc.list_parent_indices(messages).to_numpy(zero_copy_only=False)
        found = {}
        for k in self.candidates(contents, owner).tolist():
            texts = [m["content"] or "" for m in messages[k].as_py()]
            hit = self.match(texts)
            if hit is not None:
                found[k] = hit
        return found

    def candidates(self, texts: pa.Array, owner: np.ndarray) -> np.ndarray:
        """The owners (sorted, distinct) of the texts that hold a run of MIN_WORDS words
        beginning a stored gram: a superset of those `match` finds."""
        if not self.prefixes or not len(texts):
            return np.zeros(0, dtype=np.int64)
        if self._prefix_hashes is None:
            self._prefix_hashes = self._prefix_table()
        vocabulary, word_hash, known_prefixes = self._prefix_hashes
        words = split_words(texts)
        number = pc.fill_null(pc.index_in(words.dictionary, value_set=vocabulary), -1)
        ids = number.to_numpy(zero_copy_only=False).astype(np.int64)[words.ids]
        count = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(ids >= 0, out=count[1:])
        starts = np.flatnonzero(count[MIN_WORDS:] - count[:-MIN_WORDS] == MIN_WORDS)
        text = words.text_of(starts)
        starts = starts[text == words.text_of(starts + MIN_WORDS - 1)]
        keys = combine(word_hash[ids[starts[:, None] + np.arange(MIN_WORDS)]].ravel(),
                       np.arange(len(starts)) * MIN_WORDS, MIN_WORDS)
        at = np.minimum(np.searchsorted(known_prefixes, keys), len(known_prefixes) - 1)
        return np.unique(owner[words.text_of(starts[known_prefixes[at] == keys])])

    def _prefix_table(self) -> tuple[pa.Array, np.ndarray, np.ndarray]:
        encoded = pc.dictionary_encode(pa.array([w for p in self.prefixes for w in p],
                                                pa.large_string()))
        vocabulary = encoded.dictionary
        word_hash = hash_strings(vocabulary)
        ids = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        keys = combine(word_hash[ids], np.arange(len(self.prefixes)) * MIN_WORDS, MIN_WORDS)
        return vocabulary, word_hash, np.unique(keys)
