"""Which MinHash library near-dedup uses: rensa vs datasketch on the same documents.

    python benchmarks/bench_near_dedup.py [--docs 20000] [--threshold 0.8]

Synthetic conversations (prompts of 40-90 words from a 5,000-word vocabulary), a tenth of them
planted near-copies of another (a few words changed, a sentence added or cut); each library
signs every document (word 5-gram shingles, 128 permutations), finds the near-duplicates with
its LSH, and is scored against brute-force Jaccard on the candidate and the planted pairs:
seconds, documents per second, precision and recall at the threshold. Results:
benchmarks/results/near_dedup.md. datasketch is not a dependency: `pip install datasketch` to
compare.
"""

from __future__ import annotations

import argparse
import random
import time


def shingles(words: list[str], n: int = 5) -> set[str]:
    return {" ".join(words[k:k + n]) for k in range(max(1, len(words) - n + 1))}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def corpus(n: int, seed: int = 0) -> tuple[list[list[str]], list[tuple[int, int]]]:
    rng = random.Random(seed)
    vocab = [f"w{k}" for k in range(5000)]
    docs, planted = [], []
    for k in range(n):
        if k and rng.random() < 0.1:
            source = rng.randrange(k)
            words = list(docs[source])
            for _ in range(rng.randint(1, 3)):  # a few words changed
                words[rng.randrange(len(words))] = rng.choice(vocab)
            if rng.random() < 0.5:
                words += [rng.choice(vocab) for _ in range(4)]  # a short sentence added
            docs.append(words)
            planted.append((source, k))
        else:
            docs.append([rng.choice(vocab) for _ in range(rng.randint(40, 90))])
    return docs, planted


def run_rensa(sets: list[set[str]], threshold: float) -> tuple[list[tuple[int, int]], float]:
    import rensa

    start = time.perf_counter()
    lsh = rensa.RMinHashLSH(threshold=threshold, num_perm=128, num_bands=16)
    pairs = []
    for k, s in enumerate(sets):
        m = rensa.RMinHash(num_perm=128, seed=42)
        m.update(list(s))
        pairs += [(j, k) for j in lsh.query(m)]
        lsh.insert(k, m)
    return pairs, time.perf_counter() - start


def run_rensa_verified(sets: list[set[str]], threshold: float
                       ) -> tuple[list[tuple[int, int]], float]:
    """rensa's LSH candidates kept only where the signatures' Jaccard estimate reaches the
    threshold (what near-dedup does)."""
    import rensa

    start = time.perf_counter()
    lsh = rensa.RMinHashLSH(threshold=threshold, num_perm=128, num_bands=16)
    signatures, pairs = [], []
    for k, s in enumerate(sets):
        m = rensa.RMinHash(num_perm=128, seed=42)
        m.update(list(s))
        pairs += [(j, k) for j in lsh.query(m) if signatures[j].jaccard(m) >= threshold]
        lsh.insert(k, m)
        signatures.append(m)
    return pairs, time.perf_counter() - start


def run_datasketch(sets: list[set[str]], threshold: float) -> tuple[list[tuple[int, int]], float]:
    from datasketch import MinHash, MinHashLSH

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=threshold, num_perm=128)
    pairs = []
    for k, s in enumerate(sets):
        m = MinHash(num_perm=128, seed=42)
        m.update_batch([x.encode() for x in s])
        pairs += [(j, k) for j in lsh.query(m)]
        lsh.insert(k, m)
    return pairs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--threshold", type=float, default=0.8)
    args = parser.parse_args()
    docs, planted = corpus(args.docs)
    sets = [shingles(d) for d in docs]
    truth = {p for p in planted if jaccard(sets[p[0]], sets[p[1]]) >= args.threshold}
    print(f"{args.docs} documents, {len(planted)} planted near-copies, {len(truth)} of them at "
          f"Jaccard >= {args.threshold}")
    for name, fn in (("rensa", run_rensa), ("rensa+verify", run_rensa_verified),
                     ("datasketch", run_datasketch)):
        found, seconds = fn(sets, args.threshold)
        real = {p for p in found if jaccard(sets[p[0]], sets[p[1]]) >= args.threshold}
        precision = len(real) / len(found) if found else 1.0
        recall = len(truth & set(found)) / len(truth) if truth else 1.0
        print(f"{name:>12}: {seconds:6.2f} s ({args.docs / seconds:8.0f} docs/s), candidates "
              f"{len(found)}, precision {precision:.4f}, recall {recall:.4f}")


if __name__ == "__main__":
    main()
