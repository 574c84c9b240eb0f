"""A serving deployment's own speculative-decoding counters, as vLLM exports them on /metrics.

vLLM (v1/spec_decode/metrics.py) counts, per engine and model: `vllm:spec_decode_num_drafts`
(verify steps that carried a draft), `vllm:spec_decode_num_draft_tokens` (tokens drafted),
`vllm:spec_decode_num_accepted_tokens` (drafted tokens the target accepted) and
`vllm:spec_decode_num_accepted_tokens_per_pos{position="k"}`; Prometheus appends `_total` to a
counter's name. Its mean acceptance length is 1 + accepted / drafts (the bonus token counted):
the served tau. `vllm:generation_tokens` counts every token it generated, which tells whether
other clients used the server while we measured. No torch and no prometheus_client here: the
text format is read directly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from dflash_etl.core.errors import StageError

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATED = "vllm:generation_tokens"
MAX_METRICS_BYTES = 16 << 20  # a /metrics page past this is not a metrics page
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class SpecCounters:
    """One reading of the counters, summed over engines (data parallel ranks)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)
    generated: float | None = None  # None: the server does not export it
    found: bool = False  # the spec-decode counters were on the page


def parse_counters(text: str, model: str | None = None) -> SpecCounters:
    """The counters in a Prometheus text page; with `model`, only samples labelled with that
    model_name (a sample without the label counts for any model)."""
    out = SpecCounters()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels_text, value_text = match.groups()
        name = name.removesuffix("_total")
        if name.endswith("_created"):
            continue
        labels = dict(_LABEL.findall(labels_text or ""))
        if model is not None and labels.get("model_name", model) != model:
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        if name == DRAFTS:
            out.drafts += value
            out.found = True
        elif name == DRAFT_TOKENS:
            out.draft_tokens += value
        elif name == ACCEPTED:
            out.accepted += value
        elif name == PER_POSITION and labels.get("position", "").isdigit():
            pos = int(labels["position"])
            out.per_position[pos] = out.per_position.get(pos, 0.0) + value
        elif name == GENERATED:
            out.generated = (out.generated or 0.0) + value
    return out


def metrics_url(base: str) -> str:
    """/metrics sits beside /v1, not under it."""
    return base.rstrip("/").removesuffix("/v1") + "/metrics"


def read_counters(base: str, model: str | None, deadline_s: float) -> SpecCounters:
    """The server's counters now; a server without the spec-decode counters is an error that
    says what to enable."""
    import httpx

    url = metrics_url(base)
    try:
        with httpx.Client(timeout=deadline_s) as client, client.stream("GET", url) as response:
            response.raise_for_status()
            pieces, size = [], 0
            for piece in response.iter_bytes():
                pieces.append(piece)
                size += len(piece)
                if size > MAX_METRICS_BYTES:
                    raise StageError(f"{url} sent more than {MAX_METRICS_BYTES} bytes: not a "
                                     "metrics page")
    except httpx.HTTPError as exc:
        raise StageError(f"cannot read {url} ({type(exc).__name__}: {exc}): the served "
                         "acceptance comes from the server's own counters; is it vLLM, "
                         "running, with its metrics endpoint?") from exc
    counters = parse_counters(b"".join(pieces).decode("utf-8", "replace"), model)
    if not counters.found:
        raise StageError(f"{url} has no {DRAFTS} counter"
                         + (f" for model {model!r}" if model else "")
                         + ": the server does not speculate. Serve the target with the drafter "
                         "(the `vllm serve ... --speculative-config ...` line `dflash-etl export "
                         "--to vllm` prints) and leave its stats on (no --disable-log-stats)")
    return counters


def served_acceptance(before: SpecCounters, after: SpecCounters,
                      completion_tokens: int) -> dict[str, Any]:
    """What the deployment did between two readings: its mean acceptance length (vLLM's
    1 + accepted / drafts), acceptance rate, per-position rates, and the tokens it generated
    beyond the ones we asked for (other clients' traffic mixed into the figure)."""
    readings = (before.drafts, before.accepted, before.draft_tokens, after.drafts,
                after.accepted, after.draft_tokens)
    if not all(math.isfinite(v) for v in readings):
        raise StageError(f"the server's spec-decode counters are not finite numbers "
                         f"({readings}): its metrics page is broken; nothing is computed from it")
    drafts = after.drafts - before.drafts
    accepted = after.accepted - before.accepted
    drafted = after.draft_tokens - before.draft_tokens
    if min(drafts, accepted, drafted) < 0:
        raise StageError("the server's spec-decode counters went backwards while it answered "
                         f"(drafts {before.drafts:g} -> {after.drafts:g}, accepted "
                         f"{before.accepted:g} -> {after.accepted:g}): an engine restarted (or "
                         "one of a data-parallel deployment's did) between the readings; rerun "
                         "against a server that stays up")
    if drafts <= 0:
        raise StageError("the server's spec-decode counters did not move while it answered "
                         f"{completion_tokens} tokens: it does not draft for this model (check "
                         "its --speculative-config), or another engine answered")
    positions = sorted(set(after.per_position) | set(before.per_position))
    other = None
    if after.generated is not None and before.generated is not None:
        other = int(after.generated - before.generated) - completion_tokens
    if drafted and accepted > drafted:
        raise StageError(f"the server reports {accepted:g} accepted of {drafted:g} drafted "
                         "tokens: its counters are not vLLM's, or are broken")
    return {
        "tau": round(1 + accepted / drafts, 4),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
        "accepted_per_position": [
            round((after.per_position.get(p, 0.0) - before.per_position.get(p, 0.0)) / drafts, 4)
            for p in positions],
        "completion_tokens": completion_tokens,
        "other_traffic_tokens": other,
    }
