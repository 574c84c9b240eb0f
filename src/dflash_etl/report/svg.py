"""Charts as inline SVG, drawn from the histograms the suites save (no plotting library, no
external assets: the report must open offline)."""

from __future__ import annotations

from html import escape
from typing import Any

W, H, PAD_L, PAD_B, PAD_T, PAD_R = 380, 200, 46, 34, 12, 10


def _fmt(x: float) -> str:
    if abs(x) >= 1000:
        return f"{x / 1000:.1f}k"
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.2f}"


def histogram_svg(hist: dict[str, Any], label: str) -> str:
    """Bars for counts between edges; empty histograms say so."""
    counts, edges = hist.get("counts") or [], hist.get("edges") or []
    if not counts:
        return f'<p class="muted">{escape(label)}: no data</p>'
    top = max(counts) or 1
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    bar_w = plot_w / len(counts)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">',
             f'<rect x="0" y="0" width="{W}" height="{H}" fill="#fff"/>']
    for k, c in enumerate(counts):
        h = plot_h * c / top
        x = PAD_L + k * bar_w
        parts.append(f'<rect x="{x + 0.5:.1f}" y="{PAD_T + plot_h - h:.1f}" '
                     f'width="{max(bar_w - 1, 0.5):.1f}" height="{h:.1f}" fill="#4c78a8">'
                     f'<title>{escape(_fmt(edges[k]))}–{escape(_fmt(edges[k + 1]))}: {c}'
                     '</title></rect>')
    axis_y = PAD_T + plot_h
    parts.append(f'<line x1="{PAD_L}" y1="{axis_y}" x2="{W - PAD_R}" y2="{axis_y}" '
                 'stroke="#333"/>')
    parts.append(f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{axis_y}" stroke="#333"/>')
    for value, y in ((top, PAD_T), (0, axis_y)):
        parts.append(f'<text x="{PAD_L - 4}" y="{y + 4}" font-size="10" '
                     f'text-anchor="end">{_fmt(value)}</text>')
    for value, x in ((edges[0], PAD_L), (edges[-1], W - PAD_R)):
        parts.append(f'<text x="{x}" y="{axis_y + 14}" font-size="10" '
                     f'text-anchor="middle">{_fmt(value)}</text>')
    parts.append(f'<text x="{PAD_L + plot_w / 2}" y="{H - 4}" font-size="11" '
                 f'text-anchor="middle">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def curve_svg(points: list[tuple[float, float]], label: str, x_label: str,
              top: str = "100%") -> str:
    """A line through (x, y) points with y in [0, 1] (e.g. cumulative coverage); `top` labels
    y = 1 (a curve scaled to its maximum names that maximum)."""
    if not points:
        return f'<p class="muted">{escape(label)}: no data</p>'
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    x_max = max(p[0] for p in points) or 1
    coords = " ".join(f"{PAD_L + plot_w * x / x_max:.1f},{PAD_T + plot_h * (1 - y):.1f}"
                      for x, y in points)
    axis_y = PAD_T + plot_h
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">'
        f'<rect x="0" y="0" width="{W}" height="{H}" fill="#fff"/>'
        f'<polyline points="{coords}" fill="none" stroke="#e45756" stroke-width="2"/>'
        f'<line x1="{PAD_L}" y1="{axis_y}" x2="{W - PAD_R}" y2="{axis_y}" stroke="#333"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{axis_y}" stroke="#333"/>'
        f'<text x="{PAD_L - 4}" y="{PAD_T + 4}" font-size="10" '
        f'text-anchor="end">{escape(top)}</text>'
        f'<text x="{PAD_L - 4}" y="{axis_y + 4}" font-size="10" text-anchor="end">0</text>'
        f'<text x="{W - PAD_R}" y="{axis_y + 14}" font-size="10" '
        f'text-anchor="middle">{_fmt(x_max)}</text>'
        f'<text x="{PAD_L + plot_w / 2}" y="{H - 4}" font-size="11" '
        f'text-anchor="middle">{escape(x_label)}</text></svg>'
    )
