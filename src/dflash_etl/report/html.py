"""HTML building blocks for the report: escaping, tables, badges and one inline stylesheet.

Why hand-written: the report must open offline with no request to any outside host, and GE's own
Data Docs load their CSS/JS from CDNs. Everything here is inline; links are relative files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2430;
background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:14px 28px}
header a{color:#cfe3ff}
header h1{margin:0;font-size:20px}
main{padding:18px 28px;max-width:1200px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px 18px;
margin:0 0 16px}
h2{font-size:17px;margin:4px 0 10px}
h3{font-size:15px;margin:12px 0 6px}
table{border-collapse:collapse;margin:4px 0 8px;font-size:13px}
th,td{border:1px solid #dde1e7;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f3f4f6;padding:8px;white-space:pre-wrap;word-break:break-word;margin:4px 0}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-weight:600;font-size:12px}
.pass{background:#d8f3dc;color:#1b5e20}.fail{background:#ffd6d6;color:#a4161a}
.skip{background:#e9ecef;color:#495057}
tr.failed td{background:#fff5f5}
.muted{color:#6b7280}
.charts{display:flex;flex-wrap:wrap;gap:14px}
.charts figure{margin:0}
figcaption{font-size:12px;color:#4b5563}
nav a{margin-right:14px}
pre.row{max-height:260px;overflow:auto}
pre.row .t:hover{outline:1px solid #9ca3af}
pre.row .s{background:#d8f3dc;color:#1b5e20}
"""


def esc(value: Any) -> str:
    if value is None:
        return '<span class="muted">—</span>'
    if isinstance(value, float):
        return escape(f"{value:.4g}")
    if isinstance(value, dict | list):
        return f"<code>{escape(json.dumps(value, default=str, ensure_ascii=False))}</code>"
    return escape(str(value))


def badge(passed: bool | None, text: str | None = None) -> str:
    if passed is None:
        return f'<span class="badge skip">{escape(text or "NOT RUN")}</span>'
    cls, label = ("pass", "PASS") if passed else ("fail", "FAIL")
    return f'<span class="badge {cls}" data-status="{cls}">{escape(text or label)}</span>'


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
          row_classes: Sequence[str] | None = None, raw: bool = False) -> str:
    """A table; cells are escaped unless `raw` (then they are already HTML)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for k, row in enumerate(rows):
        cls = f' class="{row_classes[k]}"' if row_classes and row_classes[k] else ""
        cells = []
        for cell in row:
            num = isinstance(cell, int | float) and not isinstance(cell, bool)
            text = cell if raw and isinstance(cell, str) else esc(cell)
            cells.append(f'<td class="num">{text}</td>' if num else f"<td>{text}</td>")
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def page(title: str, body: str, nav: str = "") -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>{escape(title)}</h1>{nav}</header><main>{body}</main></body></html>\n"
    )


def truncate(text: Any, limit: int = 300) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[:limit] + f"… (+{len(text) - limit} chars)"
