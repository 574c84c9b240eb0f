"""The draft vocabulary: speculators' d2t / t2d maps of the most frequent supervised tokens, and
the token frequencies they come from (token_freq.json, token_freq.pt), as tokenize writes them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from dflash_etl.core.rundir import write_json_atomic
from dflash_etl.io.torch_pickle import save_plain_dict


def draft_vocab(freq: Counter[int], draft_vocab_size: int, tokenizer_size: int,
                model_vocab_size: int):
    """speculators' d2t (offsets) / t2d (bool mask): the most frequent supervised tokens.

    Draft tokens are real tokens (below the tokenizer's size); t2d spans the model's padded
    vocabulary, the length the trainers check it against."""
    size = min(draft_vocab_size, tokenizer_size)
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:size]]
    if len(chosen) < size:  # pad with the lowest unused ids, as speculators does
        taken = set(chosen)
        chosen += [t for t in range(tokenizer_size) if t not in taken][: size - len(chosen)]
    chosen.sort()
    d2t = np.asarray(chosen, dtype=np.int64) - np.arange(size, dtype=np.int64)
    t2d = np.zeros(model_vocab_size, dtype=bool)
    t2d[chosen] = True
    total = sum(freq.values())
    covered = sum(freq.get(t, 0) for t in chosen)
    return d2t, t2d, (covered / total if total else 0.0)


def vocab_map_names(size: int) -> tuple[str, str]:
    """d2t-<N>.npy / t2d-<N>.npy: the names speculators looks for (N = the draft vocab size)."""
    return f"d2t-{size}.npy", f"t2d-{size}.npy"


def save_vocab(freq: Counter[int], draft_vocab_size: int, tokenizer_size: int,
                model_vocab: int, model_vocab_from: str, out: Path) -> dict[str, Any]:
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    write_json_atomic(out / "token_freq.json", {
        "vocab_size": tokenizer_size, "supervised_tokens": sum(freq.values()),
        "distinct_tokens": len(freq), "frequencies": {str(t): n for t, n in ranked},
    })
    # what torch.load gives the trainers; in token order, whatever order the chunks were counted in
    save_plain_dict(dict(sorted(freq.items())), out / "token_freq.pt")
    d2t, t2d, coverage = draft_vocab(freq, draft_vocab_size, tokenizer_size, model_vocab)
    d2t_name, t2d_name = vocab_map_names(int(d2t.shape[0]))
    np.save(out / d2t_name, d2t)
    np.save(out / t2d_name, t2d)
    draft = {"size": int(d2t.shape[0]), "coverage": round(coverage, 6), "d2t": d2t_name,
             "t2d": t2d_name, "t2d_length": int(t2d.shape[0]),
             "t2d_length_from": model_vocab_from}
    write_json_atomic(out / "draft_vocab.json", draft)
    return draft
