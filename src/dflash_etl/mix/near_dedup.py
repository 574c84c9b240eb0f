"""Near-duplicate conversations: the same prompt with other spacing, case or punctuation, a
sentence added or cut, a templated family that differs in a number. Exact hashing keeps them
all, and a drafter trained on them over-learns a few prompts.

MinHash signatures (rensa: 27x datasketch's speed on this machine at equal or better recall,
benchmarks/bench_near_dedup.py) of word n-gram shingles of the normalised text (words.py's
words: any script, punctuation, spacing and disguises dropped), LSH for candidates, each
candidate verified by the signatures' Jaccard estimate. Rows are taken in a stable order
(source, file, line): the first of a cluster is kept, the others are near-duplicates of it.
`scope = "prompt"` hashes the user turns only, so a long system prompt shared by distinct
conversations does not make them duplicates. Pure: texts in, verdicts out.

At scale the work splits where the data is: each ingest work item signs its own rows
(`signatures`, `band_keys`: vectorised shingle hashes, rensa's batch digests), and the driver,
which alone sees every row in order, reads the band keys, finds the rows sharing a bucket
(`candidates`) and reads only their signatures for the greedy pass (`near_duplicates`).

The shingles' 64-bit hashes, which MinHash permutes, are ngrams.py's (a hash of each word's
bytes, mixed per position), not rensa's own string hash: rensa's flat-hash path given rensa's
own token hashes reproduces `RMinHash.update` bit for bit, so this is the one difference from
signing the shingle strings with rensa. The signatures are another, equally valid draw of the
same estimator (128 permutations: a standard error of about 0.035 at Jaccard 0.8), and only
pairs at the threshold's edge change verdict: on bench_ingest's 100k rows 12,522 near-duplicates
instead of 12,540; the 110 rows only the string-hashed run filtered have a true shingle Jaccard
of 0.71-0.83 (16 at 0.8 or more), the 92 only this one filters 0.71-0.81 (12), and the
verdicts below a true 0.8 are 113 here, 136 there. The order, the rule (first of a cluster
kept, the most similar earlier kept row named, the earliest at a tie) and the executors'
agreement are unchanged; the string-hashed pass broke a tie in the order rensa's LSH returned
its candidates, this one by row order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_etl.mix.ngrams import gram_hashes, word_hashes
from dflash_etl.mix.words import words

NUM_PERM = 128
BANDS = 16  # 16 bands of 8 rows: a pair at Jaccard 0.8 is a candidate with p > 0.99
ROWS = NUM_PERM // BANDS
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


def signatures(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(each text's MinHash digest of its shingles, uint32 [n, NUM_PERM]; whether it has any
    word: a text without one has nothing to compare, and its row is zeros)."""
    hashes, counts = word_hashes(texts)
    return _digests(hashes, counts, ngram)


def message_signatures(messages: pa.Array | pa.ChunkedArray, scope: str, ngram: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """`signatures` of each row's `text_of` (a canonical `messages` column), from Arrow."""
    if isinstance(messages, pa.ChunkedArray):
        messages = messages.combine_chunks()
    flat = pc.list_flatten(messages)
    owner = pc.list_parent_indices(messages).to_numpy(zero_copy_only=False)
    contents = pc.struct_field(flat, "content")
    if scope != "conversation":
        user = pc.fill_null(pc.equal(pc.struct_field(flat, "role"), "user"), False)
        contents = contents.filter(user)
        owner = owner[user.to_numpy(zero_copy_only=False)]
    hashes, counts = word_hashes(contents)
    # the texts' words in order are the rows' words in order: each row's texts are adjacent
    per_row = np.bincount(owner, weights=counts, minlength=len(messages)).astype(np.int64)
    return _digests(hashes, per_row, ngram)


def _digests(hashes: np.ndarray, counts: np.ndarray, ngram: int
             ) -> tuple[np.ndarray, np.ndarray]:
    import rensa

    grams, per_text = gram_hashes(hashes, counts, ngram, whole_short=True)
    has = per_text > 0
    digests = np.zeros((len(counts), NUM_PERM), dtype=np.uint32)
    if has.any():
        offsets = np.zeros(int(has.sum()) + 1, dtype=np.uint64)
        np.cumsum(per_text[has], out=offsets[1:])
        matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(grams, offsets, NUM_PERM,
                                                                     SEED)
        digests[has] = np.asarray(matrix.to_rows(), dtype=np.uint32)
    return digests, has


def band_keys(digests: np.ndarray) -> np.ndarray:
    """One uint64 key per LSH band (ROWS digest values each): uint64 [n, BANDS]."""
    bands = digests.astype(np.uint64).reshape(len(digests), BANDS, ROWS)
    keys = np.zeros((len(digests), BANDS), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for r in range(ROWS):
            keys = (keys ^ bands[:, :, r]) * np.uint64(0x100000001B3)  # FNV-style fold
    return keys


def candidates(keys: np.ndarray, has: np.ndarray) -> np.ndarray:
    """The rows (of those with a signature) sharing some band's bucket with another row."""
    return np.flatnonzero(_shares_a_bucket(keys, has) & has)


def near_duplicates(keys: np.ndarray, digests: np.ndarray, threshold: float
                    ) -> list[tuple[int, int, float]]:
    """Rows in order (the candidates' band keys and digests): each is kept, or is a near-
    duplicate of the earlier kept row it shares a bucket with and is most similar to (at a
    tie the earliest). Returns (row, kept row, estimated Jaccard) for each near-duplicate.

    The greedy pass in Python visits only what can change its outcome. Rows of one digest
    ("twins") share every bucket; a later twin is never kept (its first twin, or that one's
    kept match, matches it as well), and where the first is kept the later ones repeat it at
    1.0. A first twin that shares no bucket with another digest is kept; and only buckets
    holding two digests can hold a match. So the loop takes the first twins that share a
    bucket with another digest, and their later twins, and looks in those buckets only."""
    if not len(keys):
        return []
    twin_of = _first_twins(keys, digests)
    first = np.flatnonzero(twin_of == np.arange(len(keys)))
    groups = _shared_groups(keys[first])  # [len(first), bands]: -1 where not shared
    linked = np.zeros(len(keys), dtype=bool)
    linked[first] = (groups >= 0).any(axis=1)
    row_groups = np.full((len(keys), keys.shape[1]), -1, dtype=np.int64)
    row_groups[first] = groups
    visit = np.flatnonzero(linked[twin_of])
    found = _greedy(visit, twin_of, row_groups[twin_of[visit]], digests, threshold)
    later = np.flatnonzero((twin_of != np.arange(len(keys))) & ~linked[twin_of])
    found += [(row, kept, 1.0) for row, kept in zip(later.tolist(), twin_of[later].tolist(),
                                                     strict=True)]
    return sorted(found)


def _first_twins(keys: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """Each row's first row of the same digest (by a hash of its band keys, checked)."""
    with np.errstate(over="ignore"):
        whole = np.zeros(len(keys), dtype=np.uint64)
        for b in range(keys.shape[1]):
            whole = (whole ^ keys[:, b]) * np.uint64(0x9E3779B97F4A7C15)
    _, first, group = np.unique(whole, return_index=True, return_inverse=True)
    twin_of = first[group.reshape(-1)]
    later = np.flatnonzero(twin_of != np.arange(len(keys)))
    if not np.array_equal(digests[later], digests[twin_of[later]]):  # a 64-bit collision
        _, first, group = np.unique(np.ascontiguousarray(digests).view(
            np.dtype((np.void, digests.shape[1] * digests.itemsize))).ravel(),
            return_index=True, return_inverse=True)
        twin_of = first[group.reshape(-1)]
    return twin_of


def _shares_a_bucket(keys: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Whether a row's bucket in some band holds another row (rows without a signature share
    bucket 0): one band at a time, no copy of the whole key matrix."""
    shared = np.zeros(len(keys), dtype=bool)
    for b in range(keys.shape[1]):
        column = np.where(has, keys[:, b], np.uint64(0))
        order = np.argsort(column, kind="stable")
        same = column[order[1:]] == column[order[:-1]]
        shared[order[1:][same]] = True
        shared[order[:-1][same]] = True
    return shared


def _shared_groups(keys: np.ndarray) -> np.ndarray:
    """Each row's bucket in each band, numbered across bands, where another row shares it;
    else -1: int64 [n, bands]."""
    groups = np.full(keys.shape, -1, dtype=np.int64)
    base = 0
    for b in range(keys.shape[1]):
        _, inverse, count = np.unique(keys[:, b], return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        groups[:, b] = np.where(count[inverse] > 1, inverse + base, -1)
        base += len(count)
    return groups


def _greedy(rows: np.ndarray, twin_of: np.ndarray, groups: np.ndarray, digests: np.ndarray,
            threshold: float) -> list[tuple[int, int, float]]:
    """The greedy pass over `rows` (in order; `groups`: their shared buckets): kept first
    twins enter their buckets."""
    buckets: dict[int, list[int]] = {}
    kept: set[int] = set()
    found = []
    width = digests.shape[1]
    for row, twin, row_groups in zip(rows.tolist(), twin_of[rows].tolist(), groups.tolist(),
                                     strict=True):
        if twin != row and twin in kept:
            found.append((row, twin, 1.0))
            continue
        row_groups = [g for g in row_groups if g >= 0]
        others = sorted({k for g in row_groups for k in buckets.get(g, ())})
        if others:
            same = np.count_nonzero(digests[others] == digests[row], axis=1)
            at = int(np.argmax(same))  # the first of the highest
            similarity = int(same[at]) / width  # the reference's mean of equal values
            if similarity >= threshold:
                found.append((row, others[at], similarity))
                continue
        if twin == row:
            kept.add(row)
            for g in row_groups:
                buckets.setdefault(g, []).append(row)
    return found
