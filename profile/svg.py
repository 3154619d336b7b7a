"""Small inline-SVG chart makers for the HTML report (no JavaScript, no external files).

Each function returns an ``<svg>`` string sized by its viewBox (the page scales
it to the column width). Hover text is an SVG ``<title>``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

W, H = 920, 300
PAD_L, PAD_R, PAD_T, PAD_B = 64, 20, 16, 40


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(v, 12))
    return ticks


def fmt_num(v: float) -> str:
    """Compact number for axis labels: 1200 -> 1.2k, 0.00012 -> 1.2e-4."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e9:
        return f"{v / 1e9:.3g}G"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 0.01:
        return f"{v:.3g}"
    return f"{v:.1e}"


def _svg_open(title: str, h: int = H) -> list[str]:
    return [(f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {h}" role="img" '
             f'aria-label="{escape(title)}" class="chart-svg">')]


def _y_axis(parts: list[str], ticks: list[float], y_of, unit: str, h: int = H) -> None:
    for t in ticks:
        y = y_of(t)
        parts.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{PAD_L - 8}" y="{y + 4:.1f}" class="tick" text-anchor="end">{fmt_num(t)}</text>')
    parts.append(f'<text x="14" y="{PAD_T + (h - PAD_T - PAD_B) / 2:.0f}" class="axis-label" text-anchor="middle" '
                 f'transform="rotate(-90 14 {PAD_T + (h - PAD_T - PAD_B) / 2:.0f})">{escape(unit)}</text>')


def _x_axis_steps(parts: list[str], lo: float, hi: float, x_of, label: str = "step", h: int = H) -> None:
    # Steps are integers: no 2.5 on a step axis.
    ticks = [t for t in nice_ticks(lo, hi, 8) if lo <= t <= hi and float(t).is_integer()] or [lo]
    for t in ticks:
        x = x_of(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{h - PAD_B}" y2="{h - PAD_B + 5}" class="axis"/>')
        parts.append(f'<text x="{x:.1f}" y="{h - PAD_B + 18}" class="tick" text-anchor="middle">{fmt_num(t)}</text>')
    parts.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{h - PAD_B}" y2="{h - PAD_B}" class="axis"/>')
    parts.append(f'<text x="{(PAD_L + W - PAD_R) / 2:.0f}" y="{h - 4}" class="axis-label" '
                 f'text-anchor="middle">{escape(label)}</text>')


def stacked_bars(xs: Sequence[str], series: Sequence[tuple[str, str, Sequence[float]]], unit: str,
                 x_label: str = "step", title: str = "") -> str:
    """Vertical stacked bars: ``series`` = [(name, colour, values per x)], drawn bottom-up."""
    n = len(xs)
    totals = [sum(s[2][i] for s in series) for i in range(n)]
    ticks = nice_ticks(0.0, max(totals) if totals else 1.0)
    top = ticks[-1]
    ph = H - PAD_T - PAD_B
    y_of = lambda v: PAD_T + ph * (1 - v / top)
    pw = W - PAD_L - PAD_R
    slot = pw / max(1, n)
    bw = max(1.0, slot * 0.8) if n < pw else slot
    parts = _svg_open(title)
    _y_axis(parts, ticks, y_of, unit)
    for i in range(n):
        x = PAD_L + i * slot + (slot - bw) / 2
        base = 0.0
        tip = [f"{x_label} {xs[i]}: total {totals[i]:.3f} {unit}"]
        tip += [f"{name}: {vals[i]:.3f} {unit}" for name, _, vals in series if vals[i] > 0]
        parts.append(f'<g class="bar"><title>{escape(chr(10).join(tip))}</title>')
        for _name, colour, vals in series:
            v = vals[i]
            if v <= 0:
                continue
            y1, y0 = y_of(base + v), y_of(base)
            parts.append(f'<rect x="{x:.2f}" y="{y1:.2f}" width="{bw:.2f}" height="{max(0.0, y0 - y1):.2f}" '
                         f'fill="{colour}"/>')
            base += v
        parts.append("</g>")
    # x labels: at most ~10, evenly spaced
    every = max(1, math.ceil(n / 10))
    for i in range(0, n, every):
        x = PAD_L + (i + 0.5) * slot
        parts.append(f'<text x="{x:.1f}" y="{H - PAD_B + 18}" class="tick" text-anchor="middle">{escape(xs[i])}</text>')
    parts.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{H - PAD_B}" y2="{H - PAD_B}" class="axis"/>')
    parts.append(f'<text x="{(PAD_L + W - PAD_R) / 2:.0f}" y="{H - 4}" class="axis-label" '
                 f'text-anchor="middle">{escape(x_label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_chart(series: Sequence[tuple[str, str, Sequence[tuple[float, float]]]], unit: str,
               x_label: str = "step", y_min: float | None = None, title: str = "",
               y_fmt=lambda v: f"{v:.4g}") -> str:
    """Lines over x: ``series`` = [(name, colour, [(x, y), ...])]; points are marked when few."""
    pts = [p for _, _, ps in series for p in ps]
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    lo = min(ys) if y_min is None else y_min
    hi = max(ys)
    if hi == lo:
        hi = lo + (abs(lo) * 0.1 or 1.0)
        lo = lo - (abs(lo) * 0.1 if y_min is None else 0)
    ticks = nice_ticks(lo, hi)
    ph = H - PAD_T - PAD_B
    pw = W - PAD_L - PAD_R
    y_of = lambda v: PAD_T + ph * (1 - (v - ticks[0]) / (ticks[-1] - ticks[0]))
    x_of = lambda v: PAD_L + pw * (v - x_lo) / (x_hi - x_lo)
    parts = _svg_open(title)
    _y_axis(parts, ticks, y_of, unit)
    _x_axis_steps(parts, x_lo, x_hi, x_of, x_label)
    for name, colour, ps in series:
        if not ps:
            continue
        d = " ".join(f"{'M' if j == 0 else 'L'}{x_of(x):.2f},{y_of(y):.2f}" for j, (x, y) in enumerate(ps))
        parts.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="2" stroke-linejoin="round">'
                     f'<title>{escape(name)}</title></path>')
        r = 3.0 if len(ps) <= 60 else 0.0
        stride = 1 if len(ps) <= 300 else math.ceil(len(ps) / 300)
        for x, y in ps[::stride]:
            # Invisible hit targets carry the hover text when the markers are too dense to draw.
            parts.append(f'<circle cx="{x_of(x):.2f}" cy="{y_of(y):.2f}" r="{r if r else 4}" fill="{colour}" '
                         f'fill-opacity="{1 if r else 0}"><title>{escape(name)} @ {x_label} {fmt_num(x)}: '
                         f'{escape(y_fmt(y))}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def hbars(rows: Sequence[tuple[str, float, str, str]], unit: str, title: str = "", label_w: int = 250) -> str:
    """Horizontal bars: rows = [(label, value, colour, hover text)], largest first as given."""
    bar_h, gap = 22, 8
    h = PAD_T + len(rows) * (bar_h + gap) + 34
    vmax = max((r[1] for r in rows), default=1.0) or 1.0
    ticks = nice_ticks(0.0, vmax, 5)
    x0, x1 = label_w, W - PAD_R - 70
    x_of = lambda v: x0 + (x1 - x0) * v / ticks[-1]
    parts = _svg_open(title, h)
    axis_y = PAD_T + len(rows) * (bar_h + gap)
    for t in ticks:
        x = x_of(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T - 4}" y2="{axis_y}" class="grid"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 16}" class="tick" text-anchor="middle">{fmt_num(t)}</text>')
    parts.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{h - 2}" class="axis-label" text-anchor="middle">'
                 f'{escape(unit)}</text>')
    for i, (label, v, colour, tip) in enumerate(rows):
        y = PAD_T + i * (bar_h + gap)
        short = label if len(label) <= 34 else label[:33] + "…"
        parts.append(f'<g class="bar"><title>{escape(tip)}</title>'
                     f'<text x="{x0 - 8}" y="{y + bar_h * 0.7:.1f}" class="bar-label" text-anchor="end">'
                     f'{escape(short)}</text>'
                     f'<rect x="{x0}" y="{y}" width="{max(1.0, x_of(v) - x0):.2f}" height="{bar_h}" fill="{colour}" rx="2"/>'
                     f'<text x="{x_of(v) + 6:.1f}" y="{y + bar_h * 0.7:.1f}" class="bar-value">{fmt_num(v)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
