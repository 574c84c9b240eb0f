"""Hidden-state health: the numbers that catch states which are finite, well-shaped and wrong.

Two known peer failures pass every shape and finiteness check: states that came out all zeros on
hybrid models (the drafters validated well and accepted ~1.05 tokens in serving), and states
silently wrong for batches of more than one row (padding leaking into a row). So per shard and
layer: the share of exact zeros, the non-finite count, the per-token L2 norms (mean, max) and the
tokens whose norm is far above the layer's median (reported, not failed: real targets have a few
massive-activation tokens); and a reference check: one batched row re-run alone, unpadded, and
compared. Pure: tensors in, numbers out; the thresholds are the contract's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OUTLIER_RATIO = 50.0  # a token whose norm is > 50x its layer's median in the shard


@dataclass(frozen=True)
class HealthLimits:
    """What fails a shard (the extract contract)."""

    max_zero_share: float = 0.01
    max_relative_diff: float = 1e-3  # batched vs alone; bf16 gets BF16_RELATIVE_DIFF

    @classmethod
    def for_dtype(cls, dtype: str) -> HealthLimits:
        return cls(max_relative_diff=BF16_RELATIVE_DIFF if dtype == "bf16" else 1e-3)


BF16_RELATIVE_DIFF = 2e-2


# the values whose token norms one shard's health computes: past it, a strided sample of its
# tokens (norms are the check's costliest pass: ~0.8 CPU s per GB of bf16 at a 27B width)
NORM_VALUES = 1 << 26


def all_finite(x: Any) -> bool:
    """Every value finite: a NaN or an infinity reaches the min or the max (one fast pass)."""
    import torch

    if not x.numel() or not x.is_floating_point():
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def layer_health(states: Any | Sequence[Any], layers: Sequence[int]) -> list[dict[str, Any]]:
    """Per stored layer of `states` [tokens, layers, hidden] (or rows of it, never joined: a
    shard's copy cost more than its checks): tokens, zero share, non-finite count (over every
    value), and the mean / max / median per-token L2 norm and the outlier tokens (over every
    token, or a strided sample of them past NORM_VALUES values)."""
    import torch

    parts = [states] if isinstance(states, torch.Tensor) else list(states)
    parts = [x if x.is_floating_point() else x.float() for x in parts]
    n = len(layers)
    step = max(1, -(-sum(x.numel() for x in parts) // NORM_VALUES))
    picks, tokens, zeros, non_finite = [], 0, [0] * n, [0] * n
    for x in parts:  # every step-th token of the rows as if joined
        picks.append(x[(-tokens) % step::step])
        tokens += x.shape[0]
        zeros = [a + b for a, b in zip(zeros, zero_counts(x), strict=True)]
        if not all_finite(x):
            non_finite = [a + int((~x[:, k].isfinite()).sum()) for k, a in enumerate(non_finite)]
    sample = torch.cat(picks) if picks else torch.zeros(0, n, 0)
    values = tokens * (parts[0].shape[2] if parts else 0)
    out = []
    for k, layer in enumerate(layers):
        picked = sample[:, k] if not non_finite[k] else sample[:, k].nan_to_num(0.0, 0.0, 0.0)
        norms = torch.linalg.vector_norm(picked, dim=-1, dtype=torch.float32)
        median = float(norms.median()) if norms.numel() else 0.0
        out.append({
            "layer": int(layer), "tokens": tokens,
            "zero_share": round(zeros[k] / values if values else 0.0, 6),
            "non_finite": non_finite[k],
            "norm_mean": round(float(norms.mean()) if norms.numel() else 0.0, 4),
            "norm_max": round(float(norms.max()) if norms.numel() else 0.0, 4),
            "norm_median": round(median, 4),
            "outliers": int((norms > OUTLIER_RATIO * median).sum()) if median > 0 else 0,
        })
    return out


ZERO_SCAN_VALUES = 1 << 20  # values compared at once: the comparison stays in the cache


def zero_counts(x: Any) -> list[int]:
    """Exact zeros (+0.0 and -0.0) per layer of `x` [tokens, layers, hidden], found on the
    values' bits read as integers, in cache-sized pieces of the contiguous tensor: ~10x cheaper
    than comparing bf16 values layer by layer (each layer a strided view)."""
    import numpy as np
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    bits = x.contiguous().view(ints).numpy().reshape(-1)
    negative_zero = np.iinfo(bits.dtype).min  # the sign bit alone; no other value is lower
    signed = bool(bits.size) and bits.min() == negative_zero
    layers, hidden = x.shape[1], x.shape[2]
    counts = np.zeros(layers, dtype=np.int64)
    for start in range(0, bits.size, ZERO_SCAN_VALUES):
        piece = bits[start:start + ZERO_SCAN_VALUES]
        found = piece == 0
        if signed:
            found |= piece == negative_zero
        where = np.flatnonzero(found)
        if where.size:
            counts += np.bincount((where + start) // hidden % layers, minlength=layers)
    return [int(c) for c in counts]


def reference_diff(batched: Any, alone: Any) -> dict[str, float]:
    """How far a row's batched states are from the same row run alone: max abs difference and
    max relative difference per token (|a - b| / |b|, L2 over the hidden axis)."""
    import torch

    b = alone.float()
    d = batched.float() - b
    low, high = torch.aminmax(d)
    diff = torch.linalg.vector_norm(d, dim=-1)
    scale = torch.linalg.vector_norm(b, dim=-1).clamp_min(1e-6)
    return {"max_abs": max(-float(low), float(high)), "max_rel": float((diff / scale).max())}


def shard_problems(health: list[dict[str, Any]], reference: dict[str, Any] | None,
                   limits: HealthLimits) -> list[str]:
    """What makes a shard's states unusable, with the numbers."""
    problems = []
    for layer in health:
        if layer["tokens"] and layer["zero_share"] > limits.max_zero_share:
            problems.append(f"layer {layer['layer']}: {layer['zero_share']:.1%} of the values "
                            f"are exactly zero (limit {limits.max_zero_share:.1%})")
        if layer["tokens"] and layer["norm_max"] == 0:
            problems.append(f"layer {layer['layer']}: every state is zero")
    if reference and reference["max_rel"] > limits.max_relative_diff:
        problems.append(f"row {reference['row']} batched differs from the same row run alone: "
                        f"max relative diff {reference['max_rel']:.3g} (limit "
                        f"{limits.max_relative_diff:g}), max abs {reference['max_abs']:.3g}: "
                        "padding leaks into the states")
    return problems


SCALE_RATIO = 4.0  # a shard's median token norm against the spot check's, either way


def scale_problems(health: list[dict[str, Any]], reference: dict[int, float]) -> list[str]:
    """A shard's layers whose median token norm is past SCALE_RATIO from the target's own on
    the spot-check row (`reference`: our layer -> norm): served states scaled after the
    check, or by another server of the fleet."""
    problems = []
    for layer in health:
        want = reference.get(layer["layer"])
        if not want or not layer["tokens"]:
            continue
        ratio = layer["norm_median"] / want
        if not 1 / SCALE_RATIO <= ratio <= SCALE_RATIO:
            problems.append(f"layer {layer['layer']}: median token norm {layer['norm_median']:.4g}"
                            f" is x{ratio:.4g} the target's own ({want:.4g}, limit x"
                            f"{SCALE_RATIO:g} either way): the states are scaled or cast")
    return problems


def summarize(shards: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per layer over all shards: token-weighted zero share and mean norm, the max norm, the
    outliers; for stats.json and the report."""
    by_layer: dict[int, dict[str, Any]] = {}
    for shard in shards:
        for layer in shard:
            acc = by_layer.setdefault(layer["layer"], {
                "layer": layer["layer"], "tokens": 0, "zeros": 0.0, "norm_sum": 0.0,
                "norm_max": 0.0, "non_finite": 0, "outliers": 0})
            n = layer["tokens"]
            acc["tokens"] += n
            acc["zeros"] += layer["zero_share"] * n
            acc["norm_sum"] += layer["norm_mean"] * n
            acc["norm_max"] = max(acc["norm_max"], layer["norm_max"])
            acc["non_finite"] += layer["non_finite"]
            acc["outliers"] += layer["outliers"]
    out = []
    for acc in sorted(by_layer.values(), key=lambda a: a["layer"]):
        n = acc["tokens"] or 1
        out.append({"layer": acc["layer"], "tokens": acc["tokens"],
                    "zero_share": round(acc["zeros"] / n, 6),
                    "norm_mean": round(acc["norm_sum"] / n, 4),
                    "norm_max": acc["norm_max"], "non_finite": acc["non_finite"],
                    "outliers": acc["outliers"]})
    return out
