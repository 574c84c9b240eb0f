"""Benchmark contamination: a conversation that holds a benchmark item's text is kept out of the
training mix, or the drafter's acceptance measured on that benchmark is inflated.

The rule is the field's (GPT-3, Llama): text compared as its words (words.py: lower case,
punctuation and spacing dropped, any script, invisible characters and look-alike letters
undone), and a conversation is contaminated by an item when any text the chat template renders
(a message's content, reasoning and tool-call arguments, the tool definitions) shares a run of
`ngram` words (13) with the item, or holds the whole item where the item is shorter (at least
MIN_WORDS words: an eight-word run is specific). An item of MIN_WHOLE to MIN_WORDS words (a
one-line HumanEval solution, a short MT-Bench turn) matches a text that is the item and
nothing else. Calculator notes (GSM8K's `<<48/2=24>>`) and code-fence markers are dropped on
both sides. Re-cased, re-spaced, re-punctuated copies and an item embedded in a longer prompt
are caught; a reference answer (GSM8K's solution) as a reply is too. Pure: words in, matches
out.

At scale `match_many` (and `match_conversations`, on Arrow columns) takes a batch: every stored
gram is at least MIN_WORDS words, so a text holding one holds its first MIN_WORDS words, each
of them a word of the benchmarks. The batch's words are numbered in that vocabulary at once
(ngrams.py: Arrow's hash table, no Python object per word), only the runs of MIN_WORDS known
words of one text are hashed and looked up among the stored prefixes, and only the
conversations that hold one (or a short text of known words only) are searched word by word:
the result is `match`'s, at a small fraction of its cost (most words of a chat message are not
in the benchmarks' vocabulary).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_etl.io.benchmarks import BenchmarkItem
from dflash_etl.mix.ngrams import combine, hash_strings, split_words
from dflash_etl.mix.words import words

NGRAM = 13
MIN_WORDS = 8
MIN_WHOLE = 3  # a shorter item (`return x`) is too common to name a benchmark
# dropped before the words are read, on both sides (Python's re and Arrow's RE2 read them
# alike): a calculator note; a code-fence marker, which also bounds a text a short item may be
CALCULATOR_NOTE = r"<<[^<>\n]*>>"
FENCE = r"```[A-Za-z0-9_+.-]*"
_CALCULATOR_NOTE, _FENCE = re.compile(CALCULATOR_NOTE), re.compile(FENCE)
# a JSON string's escapes, in tool-call arguments and tool definitions: `\nJanet` is "janet"
JSON_ESCAPE = r'\\(u[0-9a-fA-F]{4}|[nrtbf"\\/])'


def compared_words(text: str) -> list[str]:
    return words(_FENCE.sub(" ", _CALCULATOR_NOTE.sub(" ", text)))


def fenced_words(text: str) -> list[list[str]]:
    """The words of each part of a text between code-fence markers (one part where it has
    none): their concatenation is `compared_words`."""
    return [words(part) for part in _FENCE.split(_CALCULATOR_NOTE.sub(" ", text))]


def rendered_texts(messages: pa.Array | pa.ChunkedArray,
                   tools: pa.Array | pa.ChunkedArray | None = None
                   ) -> tuple[pa.Array, np.ndarray]:
    """(every text a chat template renders of each row of a canonical `messages` column and its
    `tools` column: content, reasoning, tool-call arguments, tool definitions; the row each
    text is of), JSON escapes read as spaces."""
    if isinstance(messages, pa.ChunkedArray):
        messages = messages.combine_chunks()
    flat = pc.list_flatten(messages)
    owner = pc.list_parent_indices(messages).to_numpy(zero_copy_only=False).astype(np.int64)
    names = {flat.type.field(k).name for k in range(flat.type.num_fields)}
    texts: list[pa.Array] = []
    owners: list[np.ndarray] = []
    columns = [(pc.struct_field(flat, name), owner, name == "tool_calls")
               for name in ("content", "reasoning", "tool_calls") if name in names]
    if tools is not None:
        if isinstance(tools, pa.ChunkedArray):
            tools = tools.combine_chunks()
        columns.append((tools, np.arange(len(tools), dtype=np.int64), True))
    for column, rows, is_json in columns:
        present = pc.is_valid(column)
        column = column.filter(present).cast(pa.large_string())
        texts.append(pc.replace_substring_regex(column, JSON_ESCAPE, " ") if is_json else column)
        owners.append(rows[present.to_numpy(zero_copy_only=False)])
    if not texts:
        return pa.array([], pa.large_string()), np.zeros(0, dtype=np.int64)
    return pa.concat_arrays(texts), np.concatenate(owners)


@dataclass
class ContaminationIndex:
    """The n-grams of every benchmark item (and the whole of the shorter ones), each with the
    first item it came from."""

    ngram: int = NGRAM
    grams: dict[tuple[str, ...], tuple[str, str]] = field(default_factory=dict)
    lengths: set[int] = field(default_factory=set)  # the lengths of the grams stored
    whole: dict[tuple[str, ...], tuple[str, str]] = field(default_factory=dict)  # short texts
    items: int = 0
    # per benchmark: its items, and those with a text long enough to be looked for
    read: Counter[str] = field(default_factory=Counter)
    indexed: Counter[str] = field(default_factory=Counter)
    prefixes: set[tuple[str, ...]] = field(default_factory=set)  # each gram's first words
    # (the vocabulary of the prefixes and short texts, its words' hashes, the prefixes' sorted
    # hashes): built on the first batch (not pickled)
    _prefix_hashes: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, items: Iterable[BenchmarkItem], ngram: int = NGRAM) -> ContaminationIndex:
        if ngram < MIN_WORDS:
            raise ValueError(f"a shared run is at least MIN_WORDS ({MIN_WORDS}) words: {ngram}")
        index = cls(ngram)
        for item in items:
            index.items += 1
            index.read[item.benchmark] += 1
            found = (item.benchmark, item.item)
            indexed = False
            for text in item.texts:
                w = compared_words(text)
                indexed |= len(w) >= MIN_WHOLE
                if MIN_WHOLE <= len(w) < MIN_WORDS:
                    index.whole.setdefault(tuple(w), found)
                if len(w) < MIN_WORDS:
                    continue
                n = min(ngram, len(w))
                index.lengths.add(n)
                for k in range(len(w) - n + 1):
                    index.grams.setdefault(tuple(w[k:k + n]), found)
                    index.prefixes.add(tuple(w[k:k + MIN_WORDS]))
            index.indexed[item.benchmark] += indexed
        return index

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_prefix_hashes": None}  # workers rebuild it: small pickles

    def match(self, texts: Iterable[str | None]) -> tuple[str, str, str] | None:
        """(benchmark, item, the shared words) for the first item the texts hold, or None."""
        for text in texts:
            parts = fenced_words(text or "")
            w = [word for part in parts for word in part]
            for whole in [w] + (parts if len(parts) > 1 else []):
                hit = self.whole.get(tuple(whole))
                if hit is not None:
                    return hit[0], hit[1], " ".join(whole)
            for n in sorted(self.lengths, reverse=True):
                for k in range(len(w) - n + 1):
                    hit = self.grams.get(tuple(w[k:k + n]))
                    if hit is not None:
                        return hit[0], hit[1], " ".join(w[k:k + n])
        return None

    def match_many(self, conversations: list[list[str]]) -> list[tuple[str, str, str] | None]:
        """`match` of each conversation (its texts), for a batch."""
        texts = pa.array([t for texts in conversations for t in texts], pa.large_string())
        owner = np.repeat(np.arange(len(conversations)), [len(t) for t in conversations])
        results: list[tuple[str, str, str] | None] = [None] * len(conversations)
        for k in self.candidates(texts, owner).tolist():
            results[k] = self.match(conversations[k])
        return results

    def match_conversations(self, messages: pa.Array | pa.ChunkedArray,
                            tools: pa.Array | pa.ChunkedArray | None = None
                            ) -> dict[int, tuple[str, str, str]]:
        """{row: `match` of its `rendered_texts`} for the rows of canonical `messages` (and
        `tools`) columns that hold an item."""
        texts, owner = rendered_texts(messages, tools)
        order = np.argsort(owner, kind="stable")
        by_row = owner[order]
        found = {}
        for k in self.candidates(texts, owner).tolist():
            mine = order[np.searchsorted(by_row, k):np.searchsorted(by_row, k, "right")]
            hit = self.match(texts.take(pa.array(mine)).to_pylist())
            if hit is not None:
                found[k] = hit
        return found

    def candidates(self, texts: pa.Array, owner: np.ndarray) -> np.ndarray:
        """The owners (sorted, distinct) of the texts that hold a run of MIN_WORDS words
        beginning a stored gram, or are a short text of known words only: a superset of those
        `match` finds."""
        if not (self.prefixes or self.whole) or not len(texts):
            return np.zeros(0, dtype=np.int64)
        if self._prefix_hashes is None:
            self._prefix_hashes = self._prefix_table()
        vocabulary, word_hash, known_prefixes, whole_word = self._prefix_hashes
        parts = pc.split_pattern_regex(pc.replace_substring_regex(texts, CALCULATOR_NOTE, " "),
                                       FENCE)
        part_text = pc.list_parent_indices(parts).to_numpy(zero_copy_only=False)
        words = split_words(pc.list_flatten(parts))
        number = pc.fill_null(pc.index_in(words.dictionary, value_set=vocabulary), -1)
        ids = number.to_numpy(zero_copy_only=False).astype(np.int64)[words.ids]
        known = ids >= 0
        found = []
        if self.whole:  # the short parts, and short texts, of short items' words only
            word_part = np.repeat(np.arange(len(words.counts)), words.counts)
            part_known = np.bincount(word_part, weights=known & whole_word[np.maximum(ids, 0)],
                                     minlength=len(words.counts))
            text_words = np.bincount(part_text, weights=words.counts, minlength=len(texts))
            text_known = np.bincount(part_text, weights=part_known, minlength=len(texts))
            found += [owner[part_text[_short(words.counts, part_known)]],
                      owner[_short(text_words, text_known)]]
        count = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(known, out=count[1:])
        starts = np.flatnonzero(count[MIN_WORDS:] - count[:-MIN_WORDS] == MIN_WORDS)
        text = part_text[words.text_of(starts)]  # a run may cross a fence, not a text's end
        starts = starts[text == part_text[words.text_of(starts + MIN_WORDS - 1)]]
        if len(known_prefixes) and len(starts):
            keys = combine(word_hash[ids[starts[:, None] + np.arange(MIN_WORDS)]].ravel(),
                           np.arange(len(starts)) * MIN_WORDS, MIN_WORDS)
            at = np.minimum(np.searchsorted(known_prefixes, keys), len(known_prefixes) - 1)
            found.append(owner[part_text[words.text_of(starts[known_prefixes[at] == keys])]])
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)

    def _prefix_table(self) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
        """(the vocabulary of the prefixes and short texts, its words' hashes, the prefixes'
        sorted hashes, which of its words are a short text's)."""
        prefix_words = [w for p in self.prefixes for w in p]
        whole_words = [w for t in self.whole for w in t]
        encoded = pc.dictionary_encode(pa.array(prefix_words + whole_words, pa.large_string()))
        vocabulary = encoded.dictionary
        word_hash = hash_strings(vocabulary)
        ids = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        keys = combine(word_hash[ids[:len(prefix_words)]],
                       np.arange(len(self.prefixes)) * MIN_WORDS, MIN_WORDS)
        whole_word = np.zeros(len(vocabulary), dtype=bool)
        whole_word[ids[len(prefix_words):]] = True
        return vocabulary, word_hash, np.unique(keys), whole_word


def _short(n_words: np.ndarray, n_known: np.ndarray) -> np.ndarray:
    """The texts (or parts) of MIN_WHOLE to MIN_WORDS words, each a benchmark word."""
    return np.flatnonzero((n_words >= MIN_WHOLE) & (n_words < MIN_WORDS) & (n_known == n_words))
