"""Tokenized rows as the drafter sees them, for the report: decoded token by token (special
tokens visible), the supervised ones highlighted, each token's id on hover. A seeded handful
per source, plus the longest and the shortest row."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

PER_SOURCE = 2
MAX_TOKENS = 400  # shown per row (the rest is counted)


def pick_rows(sources: list[str], lengths: Any, seed: int = 0) -> list[int]:
    """Row positions to show: PER_SOURCE per source by a seeded draw, then the longest and the
    shortest row; in dataset order, each once."""
    import numpy as np

    rng = np.random.default_rng(seed)
    by_source: dict[str, list[int]] = {}
    for k, s in enumerate(sources):
        by_source.setdefault(s, []).append(k)
    chosen: set[int] = set()
    for name in sorted(by_source):
        rows = by_source[name]
        chosen.update(int(x) for x in rng.choice(rows, size=min(PER_SOURCE, len(rows)),
                                                  replace=False))
    if len(lengths):
        chosen.add(int(np.argmax(lengths)))
        chosen.add(int(np.argmin(lengths)))
    return sorted(chosen)


def row_views(stage_dir: Path, tokenizer: Any) -> list[dict[str, Any]]:
    """The picked rows of a tokenize output: source, id, turn, tokens and supervised count,
    and the HTML of its tokens."""
    import pyarrow as pa

    from dflash_etl.core.outputs import TokenizedOutput
    from dflash_etl.core.schema import list_lengths
    from dflash_etl.validation.contracts import read_arrow

    files = TokenizedOutput.files_in(stage_dir) if TokenizedOutput.found_in(stage_dir) else []
    if not files:
        return []
    table = pa.concat_tables([read_arrow(f).select(["id", "source", "turn", "input_ids",
                                                    "loss_mask"]) for f in files])
    lengths = list_lengths(table.column("input_ids"))
    views = []
    for k in pick_rows(table.column("source").to_pylist(), lengths):
        row = table.slice(k, 1).to_pylist()[0]
        ids, mask = row["input_ids"][:MAX_TOKENS], row["loss_mask"][:MAX_TOKENS]
        spans = "".join(
            f'<span class="t{" s" if m else ""}" title="{t}">'
            f"{escape(tokenizer.decode([t]))}</span>" for t, m in zip(ids, mask, strict=True))
        views.append({"row": k, "source": row["source"], "id": row["id"], "turn": row["turn"],
                      "tokens": len(row["input_ids"]), "supervised": sum(row["loss_mask"]),
                      "shown": len(ids), "shown_supervised": sum(mask), "html": spans})
    return views


def rows_html(views: list[dict[str, Any]]) -> str:
    if not views:
        return ""
    out = ['<h3>Rows as the drafter sees them</h3><p class="muted">supervised tokens '
           'highlighted (what the loss is computed on); hover a token for its id</p>']
    for v in views:
        more = (f", first {v['shown']} shown" if v["shown"] < v["tokens"] else "")
        out.append(f'<p><b>{escape(v["source"])}</b> row {v["row"]} (id {escape(v["id"][:12])},'
                   f' turn {v["turn"]}): {v["tokens"]} tokens, {v["supervised"]} supervised'
                   f'{more}</p><pre class="row" data-row="{v["row"]}" '
                   f'data-supervised="{v["shown_supervised"]}">{v["html"]}</pre>')
    return "".join(out)
