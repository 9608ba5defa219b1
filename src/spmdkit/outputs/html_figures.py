"""The figures' parts shared by the sections of ``spmdkit plan --html``
(:mod:`spmdkit.outputs.html`): escaping, the colours (the phases', the ranks'), rank lists and
mesh coordinates, horizontal stacked bars and a time axis, drawn as inline SVG. Standard library
only."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

PHASE_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "optimizer": "#59a14f", "recompute": "#b07aa1"}
COMM_COLOUR = "#e15759"
BUCKET_COLOUR = "#9c755f"


def esc(x: Any) -> str:
    """``x`` as text for HTML, quotes escaped (for attribute values too)."""
    return html.escape(str(x), quote=True)


def rank_colour(k: int) -> str:
    """A distinct colour for the ``k``-th rank or block (golden-angle hues)."""
    palette = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
               "#9c755f", "#bab0ac"]
    if k < len(palette):
        return palette[k]
    return f"hsl({(k * 137.508) % 360:.0f}, 55%, 62%)"


def rank_ranges(xs: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``0-3,6``."""
    out: list[str] = []
    xs = sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def rank_coords(shape: Sequence[int], rank: int) -> list[int]:
    """The mesh coordinates of the ``rank``-th place of a mesh of ``shape`` (row-major)."""
    c = []
    for s in reversed(shape):
        c.append(rank % s)
        rank //= s
    return c[::-1]


def bars_svg(fig: str, title: str, rows: list[tuple[str, list[float], str]], keys: list[tuple[str, str]],
             fmt: Any) -> str:
    """Horizontal stacked bars: (label, values per key, tooltip) rows; keys: (name, colour)."""
    top = max((sum(v) for _, v, _ in rows), default=0.0) or 1.0
    lw, bw, bh = 90, 330, 14
    h = 24 + len(rows) * (bh + 3) + 22
    w = lw + bw + 90
    parts = [f'<svg class="fig bars" data-figure="{fig}" data-rows="{len(rows)}" width="{w}" height="{h}" '
             f'viewBox="0 0 {w} {h}" role="img" aria-label="{esc(title)}"><text x="0" y="14" class="ttl">{esc(title)}'
             f'</text>']
    for k, (label, vals, tip) in enumerate(rows):
        y = 24 + k * (bh + 3)
        x = float(lw)
        parts.append(f'<g class="bar"><title>{esc(tip)}</title><text x="{lw - 4}" y="{y + bh - 3}" text-anchor="end" '
                     f'class="lbl">{esc(label)}</text>')
        for (name, colour), v in zip(keys, vals):
            if v <= 0:
                continue
            ww = bw * v / top
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{ww:.2f}" height="{bh}" fill="{colour}" '
                         f'data-key="{esc(name)}"/>')
            x += ww
        parts.append(f'<text x="{x + 4:.1f}" y="{y + bh - 3}" class="lbl">{esc(fmt(sum(vals)))}</text></g>')
    y = 24 + len(rows) * (bh + 3) + 14
    x = 0
    for name, colour in keys:
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{x + 13}" y="{y}" class="lbl">{esc(name)}</text>')
        x += 20 + 7 * len(name)
    parts.append("</svg>")
    return "".join(parts)


def axis_svg(x0: float, w: float, total: float, y: float, fmt: Any, ticks: int = 6) -> str:
    """A horizontal axis at height ``y`` from ``x0``, ``w`` wide, ``ticks`` + 1 ticks labelled
    ``fmt`` of 0 to ``total``."""
    out = [f'<line x1="{x0}" y1="{y}" x2="{x0 + w}" y2="{y}" stroke="#888"/>']
    for k in range(ticks + 1):
        x = x0 + w * k / ticks
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#888"/>'
                   f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle" class="lbl">{esc(fmt(total * k / ticks))}</text>')
    return "".join(out)


__all__ = ["BUCKET_COLOUR", "COMM_COLOUR", "PHASE_COLOURS", "axis_svg", "bars_svg", "esc", "rank_colour",
           "rank_coords", "rank_ranges"]
