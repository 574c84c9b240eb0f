"""Word n-gram hashes of many texts at once, for the mix filters at a million rows.

The words are contamination's (lower-case runs of [a-z0-9]); each word is hashed from its bytes
and each n-gram is a mixed combination of its words' hashes, all in numpy: a batch of texts costs a
few vectorised passes, not a Python tuple per gram. Pure: texts in, uint64 arrays out.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NOT_WORD = r"[^a-z0-9]+"  # the words are the runs between: contamination.WORD
SEED = 0x5EED
_BYTE_BASE = np.uint64(0x100000001B3)
# one odd multiplier per position in a gram: "a b" and "b a" hash apart
_MULTIPLIERS = (np.random.default_rng(SEED).integers(1, 2**63, size=64, dtype=np.uint64)
                * np.uint64(2) + np.uint64(1))


def word_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the hash of every word of every text, flat; the number of words of each text).

    Arrow splits and numpy hashes (a polynomial over each word's bytes): no polars here, whose
    thread pool deadlocks in the forked workers that run this."""
    lowered = pa.array([t.lower() for t in texts], pa.large_string())
    split = pc.split_pattern_regex(lowered, NOT_WORD)
    pieces = pc.list_flatten(split)
    parents = pc.list_parent_indices(split).to_numpy()
    nonempty = pc.binary_length(pieces).to_numpy() > 0
    counts = np.bincount(parents[nonempty], minlength=len(texts)).astype(np.int64)
    words = pc.filter(pieces, pa.array(nonempty))
    if not len(words):
        return np.zeros(0, dtype=np.uint64), counts
    offsets = np.frombuffer(words.buffers()[1], dtype=np.int64)[
        words.offset:words.offset + len(words) + 1]
    data = np.frombuffer(words.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    starts, lengths = offsets[:-1] - offsets[0], np.diff(offsets)
    pos = np.arange(len(data), dtype=np.int64) - np.repeat(starts, lengths)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(int(lengths.max()), _BYTE_BASE, dtype=np.uint64))
        hashes = np.add.reduceat((data.astype(np.uint64) + np.uint64(1)) * powers[pos], starts)
        return _finalize(hashes ^ lengths.astype(np.uint64)), counts


def _finalize(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: the linear combination's low bits become well mixed
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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
