"""``helios-plan ... --html PATH``: one self-contained page (inline SVG and CSS, no network).

Drawn with helios-report's pieces (helios.profile.svg's stacked bars, the report's CSS,
its error sentinel and its rendered marker), so tests check it in headless Chromium the
same way: charts of memory per rank by kind and of step time by component for the top
plans, the plans' table, the best plan's breakdown, the assumptions, and the comparison
with a measured run when ``--run-db`` was given.
"""

from __future__ import annotations

from html import escape

from helios.profile._atomic import atomic_write_text
from helios.profile.page import CSS, DONE, SENTINEL, card, section
from helios.profile.svg import stacked_bars

from .hardware import Device
from .layout import Settings
from .memory import KINDS
from .model import ModelShape
from .search import SearchResult
from .timing import COMPONENTS

MEM_COLOURS = {"params": "#2b8cbe", "grads": "#e6550d", "optimizer": "#31a354", "activations": "#8c6bb1",
               "transient": "#fdae6b", "allowance": "#bdbdbd"}
TIME_COLOURS = {"compute": "#2b8cbe", "memory_bound": "#41b6c4", "launch": "#7fcdbb", "tp": "#de2d26", "cp": "#fb6a4a",
                "ep": "#c994c7", "pp_p2p": "#756bb1", "bubble": "#bdbdbd", "dp": "#e6550d", "optimizer": "#31a354"}


def _legend(colours: dict, names) -> str:
    return '<div class="legend">' + "".join(f'<span><i style="background:{colours[n]}"></i>{escape(n.replace("_", "-"))}</span>'
                                            for n in names) + "</div>"


def render(shape: ModelShape, st: Settings, dev: Device, gpus: int, dtype: str, res: SearchResult, show: int,
           calib: dict | None = None) -> str:
    from .cli import run_summary

    plans = res.plans[:show]
    xs = [f"#{i}" for i in range(1, len(plans) + 1)]
    mem_kinds = [k for k in KINDS if any(getattr(p.mem, k) > 0 for p in plans)]
    mem_series = [(k, MEM_COLOURS[k], [getattr(p.mem, k) / 1e9 for p in plans]) for k in mem_kinds]
    t_kinds = [k for k in COMPONENTS if any(p.time.parts[k] > 0 for p in plans)]
    t_series = [(k.replace("_", "-"), TIME_COLOURS[k], [p.time.parts[k] for p in plans]) for k in t_kinds]
    best = plans[0]
    rs = run_summary(best, shape, st)
    cards = "".join([
        card("model", f"{shape.n_params() / 1e9:.3g} B params" if shape.n_params() >= 1e9 else f"{shape.n_params():,}",
              f"{shape.n_layer} x {shape.d_model}, context {shape.seq}"),
        card("hardware", f"{gpus} x {dev.key}", f"{dev.peak_for(dtype) / 1e12:.1f} TFLOP/s {dtype}, {dev.memory / 1e9:.0f} GB"),
        card("best step", f"{best.time.step:.3g} s", best.par.label()),
        card("tokens / s", f"{best.time.tokens_per_s:,.0f}", f"MFU {100 * best.time.mfu:.1f} %"),
        card("run", f"{rs['days']:.3g} days", f"{st.tokens:.3g} tokens"),
        card("cost", f"${rs['cost']:,.0f}", f"{rs['gpu_hours']:,.0f} GPU-hours at ${st.price:.2f}"),
    ])
    head = ("<tr>" + "".join(f'<th class="{c}">{escape(n)}</th>' for n, c in (
        ("#", "l"), ("layout", "l"), ("GB/GPU", ""), ("step s", ""), ("tokens/s", ""), ("MFU", ""), ("days", ""),
        ("bound", "l"))) + "</tr>")
    body = "".join(
        f'<tr><td class="l">{i}</td><td class="l mono">{escape(p.par.label())}</td><td>{p.mem.total / 1e9:.2f}</td>'
        f"<td>{p.time.step:.4g}</td><td>{p.time.tokens_per_s:,.0f}</td><td>{100 * p.time.mfu:.1f}%</td>"
        f'<td>{run_summary(p, shape, st)["days"]:.3g}</td><td class="l">{escape(p.bound)}</td></tr>'
        for i, p in enumerate(plans, 1))
    sections = [
        section("chart-memory", "Memory per rank by kind",
                 f"The fullest rank of each plan (GB); the device holds {dev.memory / 1e9:.0f} GB. Hover a bar for its "
                 "breakdown.", _legend(MEM_COLOURS, mem_kinds) + stacked_bars(xs, mem_series, "GB", "plan", "memory")),
        section("chart-time", "Step time by component",
                 "Seconds per optimizer step; the components add up to the step (communication shown is what is not "
                 "hidden behind compute).", _legend(TIME_COLOURS, t_kinds) +
                 stacked_bars(xs, t_series, "s", "plan", "step time")),
        section("table-plans", "Plans", f"{len(res.plans):,} of {res.evaluated:,} legal layouts fit; fastest first.",
                 f"<table>{head}{body}</table>"),
        section("assumptions", "Assumptions",
                 escape(f"GEMMs at {100 * dev.achievable:.1f} % of peak ({dev.achievable_source}); links at "
                        f"{100 * dev.link_efficiency:.0f} % of {dev.intra_bw / 1e9:.0f} GB/s in a node of {dev.per_node} and "
                        f"{dev.inter_bw / 1e9:.0f} GB/s between nodes; {dtype}; attention {st.attention}; gradient "
                        f"overlap {'on' if st.overlap else 'off'}; allowance {dev.reserve / 1e9:.0f} GB + "
                        f"{100 * st.frag:.0f} % of activations. See schedule/plan/README.md."), ""),
    ]
    if calib is not None:
        rows = "".join(f'<tr><td class="l">{escape(r["quantity"])}</td><td>{r["planned"]:.4g}</td>'
                       f'<td>{"n/a" if r["measured"] is None else format(r["measured"], ".4g")}</td>'
                       f'<td>{"n/a" if r["ratio"] is None else format(r["ratio"], ".2f")}</td></tr>' for r in calib["rows"])
        sections.append(section("calibration", "Planned vs measured", escape(f"run {calib['run_id']} in {calib['run_dir']}"),
                                 '<table><tr><th class="l">quantity</th><th>planned</th><th>measured</th>'
                                 f"<th>measured / planned</th></tr>{rows}</table>"))
    title = f"Helios plan: {shape.describe()} on {gpus} x {dev.name}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{CSS}</style>{SENTINEL}</head><body>"
            f"<header><h1>Helios training plan</h1><div class=\"sub\">{escape(title)}</div></header>"
            "<main><div id=\"js-errors\"></div>"
            f"<div class=\"cards\">{cards}</div>{''.join(sections)}"
            f"<footer>helios-plan · <span id=\"render-status\">rendered without scripts</span></footer>"
            f"</main>{DONE}</body></html>\n")


def write_page(path: str, shape: ModelShape, st: Settings, dev: Device, gpus: int, dtype: str, res: SearchResult,
               show: int, calib: dict | None = None) -> str:
    """Render and write atomically; returns the path."""
    return atomic_write_text(path, render(shape, st, dev, gpus, dtype, res, show, calib))
