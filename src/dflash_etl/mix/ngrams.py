"""Word n-gram hashes of many texts at once, for the mix filters at a million rows.

The words are words.py's. A batch of texts is one Arrow string array, normalized
(`normalize_array`: Arrow lower-cases the ASCII texts, Python normalizes the others); its bytes
are split into words by a byte table in numpy (a few passes over the bytes, no Python object
per word: after normalizing, every byte of a character outside ASCII is a word byte), Arrow's
hash table numbers the distinct words (`dictionary_encode`), and only the distinct words are
hashed (a polynomial over their bytes). Each n-gram is a mixed combination of its words'
hashes. Pure: texts in, numpy arrays out. No polars here: its thread pool deadlocks in the
forked workers that run this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_etl.mix.words import normalize_array

SEED = 0x5EED
_BYTE_BASE = np.uint64(0x100000001B3)
# one odd multiplier per position in a gram: "a b" and "b a" hash apart
_MULTIPLIERS = (np.random.default_rng(SEED).integers(1, 2**63, size=64, dtype=np.uint64)
                * np.uint64(2) + np.uint64(1))
_WORD_BYTE = np.zeros(256, dtype=bool)
_WORD_BYTE[np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)] = True
_WORD_BYTE[0x80:] = True


@dataclass(frozen=True)
class Words:
    """The words of a batch of texts: `ids[k]` numbers the k-th word in `dictionary` (its
    distinct words); `counts` words per text, in order."""

    dictionary: pa.Array
    ids: np.ndarray
    counts: np.ndarray

    def text_of(self, words: np.ndarray) -> np.ndarray:
        """The text each of `words` (positions in `ids`) is in."""
        return np.searchsorted(np.cumsum(self.counts), words, side="right")


def split_words(texts: list[str] | pa.Array | pa.ChunkedArray) -> Words:
    """Every text's words in order (a null text has none)."""
    array = normalize_array(texts)
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64)[
        array.offset:array.offset + len(array) + 1]
    data = _data(array, offsets)
    offsets = offsets - offsets[0]
    word = _WORD_BYTE[data]
    starts, ends = _runs(word, offsets)
    word_offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=word_offsets[1:])
    words = pa.LargeStringArray.from_buffers(
        len(starts), pa.py_buffer(word_offsets), pa.py_buffer(np.ascontiguousarray(data[word])))
    encoded = pc.dictionary_encode(words)
    counts = np.diff(np.searchsorted(starts, offsets)).astype(np.int64)
    return Words(encoded.dictionary, encoded.indices.to_numpy(zero_copy_only=False), counts)


def _runs(word: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of each run of word bytes, a run cut where one text ends and the next
    begins."""
    if not len(word):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    change = np.flatnonzero(word[1:] != word[:-1]) + 1
    change = np.concatenate([[0] if word[0] else [], change, [len(word)] if word[-1] else []]
                            ).astype(np.int64)
    starts, ends = change[0::2], change[1::2]
    inner = np.unique(offsets[(offsets > 0) & (offsets < len(word))])
    cross = inner[word[inner - 1] & word[inner]]  # a word touching the next text's word
    if len(cross):
        starts = np.insert(starts, np.searchsorted(starts, cross), cross)
        ends = np.insert(ends, np.searchsorted(ends, cross), cross)
    return starts, ends


def _data(array: pa.LargeStringArray, offsets: np.ndarray) -> np.ndarray:
    if array.buffers()[2] is None:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(array.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]


def hash_strings(strings: pa.Array) -> np.ndarray:
    """A 64-bit hash of each string (a polynomial over its bytes, finalised): uint64 [n]."""
    strings = strings.cast(pa.large_string())
    if not len(strings):
        return np.zeros(0, dtype=np.uint64)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[
        strings.offset:strings.offset + len(strings) + 1]
    data = np.frombuffer(strings.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    starts, lengths = offsets[:-1] - offsets[0], np.diff(offsets)
    pos = np.arange(len(data), dtype=np.int64) - np.repeat(starts, lengths)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(max(int(lengths.max()), 1), _BYTE_BASE, dtype=np.uint64))
        hashes = np.add.reduceat((data.astype(np.uint64) + np.uint64(1)) * powers[pos], starts) \
            if len(data) else np.zeros(len(strings), dtype=np.uint64)
        return _finalize(hashes ^ lengths.astype(np.uint64))


def word_hashes(texts: list[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(the hash of every word of every text, flat; the number of words of each text)."""
    words = split_words(texts)
    return hash_strings(words.dictionary)[words.ids], words.counts


def _finalize(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: the linear combination's low bits become well mixed
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def combine(hashes: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """The hash of the `n` words from each of `starts` (every start has n words after it)."""
    combined = np.zeros(len(starts), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            combined += hashes[starts + i] * _MULTIPLIERS[i]
        return _finalize(combined)


def gram_hashes(hashes: np.ndarray, counts: np.ndarray, n: int, whole_short: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """(the hash of every run of `n` consecutive words of each text, flat; the number of runs
    of each text). `whole_short`: a text of fewer than `n` (but some) words has one gram, all
    of its words."""
    if not 1 <= n <= len(_MULTIPLIERS):
        raise ValueError(f"n-grams of 1..{len(_MULTIPLIERS)} words, not {n}")
    total = len(hashes)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    text = np.repeat(np.arange(len(counts)), counts)
    pos = np.arange(total, dtype=np.int64) - starts[:-1][text]
    left = counts[text] - pos  # words from here to the end of the text
    combined = np.zeros(total, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            shifted = np.zeros(total, dtype=np.uint64)
            shifted[:total - i] = hashes[i:]
            combined += np.where(left > i, shifted * _MULTIPLIERS[i], np.uint64(0))
        combined = _finalize(combined)
    keep = left >= n
    if whole_short:
        keep |= (pos == 0) & (counts[text] < n)
    return combined[keep], np.bincount(text[keep], minlength=len(counts)).astype(np.int64)
