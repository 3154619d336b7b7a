"""``helios-report RUN_DIR``: one self-contained HTML page about a run.

Reads ``RUN_DIR/run.db`` (see :mod:`helios.profile.rundb`), writes
``RUN_DIR/report.html`` atomically and prints its path. The page needs no
network: charts are inline SVG drawn here, CSS is inline, and the only script is
an error sentinel (any script error on the page is written into the page, in
``#js-errors``, so a headless check sees it).

Charts: step-time waterfall (a stacked bar per step, one colour per phase), MFU
(and HFU) over steps, loss curve, top-10 ops by device time, kernel launches per
step, achieved bandwidth (GB/s) and FLOP rate of the top kernels. A chart without
data says why instead of drawing nothing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from collections.abc import Sequence
from html import escape
from typing import Any

from helios.profile._atomic import atomic_write_text
from helios.profile.errors import ProfileError
from helios.profile.mfu import format_mfu
from helios.profile.page import CSS, DONE, SENTINEL, card, empty, section
from helios.profile.profiler import fmt_ns
from helios.profile.rundb import read_run
from helios.profile.svg import hbars, line_chart, stacked_bars
from helios.profile.timers import ALL_PHASES

#: One colour per phase (idle last, in grey); chosen to stay distinct side by side.
PHASE_COLOURS = {
    "data_load": "#8c6bb1", "host_to_device": "#41b6c4", "forward": "#2b8cbe", "backward": "#e6550d",
    "grad_clip": "#fdae6b", "optimizer": "#31a354", "replay": "#1c9099", "comm": "#de2d26", "device_to_host": "#7fcdbb",
    "checkpoint": "#756bb1", "sample_gen": "#c994c7", "idle": "#bdbdbd",
}
MAX_BARS = 120  # beyond this many steps the waterfall shows bucket means

def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _buckets(steps: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    if len(steps) <= MAX_BARS:
        return [(str(s["step"]), [s]) for s in steps]
    size = -(-len(steps) // MAX_BARS)
    out = []
    for i in range(0, len(steps), size):
        grp = steps[i:i + size]
        out.append((f"{grp[0]['step']}–{grp[-1]['step']}", grp))
    return out


def waterfall(steps: list[dict[str, Any]]) -> str:
    """The step-time waterfall chart (with its legend)."""
    if not steps:
        return empty("No steps recorded yet.")
    groups = _buckets(steps)
    used = [p for p in ALL_PHASES if any(s[f"{p}_ns"] for s in steps)]
    series = [(p, PHASE_COLOURS[p], [sum(s[f"{p}_ns"] for s in g) / len(g) / 1e6 for _, g in groups]) for p in used]
    legend = "".join(f'<span><i style="background:{PHASE_COLOURS[p]}"></i>{escape(p)}</span>' for p in used)
    label = "step" if len(groups) == len(steps) else f"steps (mean of {len(groups[0][1])} per bar)"
    return f'<div class="legend">{legend}</div>' + stacked_bars([x for x, _ in groups], series, "ms", label,
                                                                  "step time by phase")


def phase_table(steps: list[dict[str, Any]]) -> str:
    """Mean time and share of each phase over all steps."""
    if not steps:
        return ""
    wall = sum(s["wall_ns"] for s in steps) or 1
    rows = []
    for p in ALL_PHASES:
        tot = sum(s[f"{p}_ns"] for s in steps)
        if tot == 0:
            continue
        rows.append(f'<tr><td class="l"><i style="display:inline-block;width:10px;height:10px;border-radius:2px;'
                    f'background:{PHASE_COLOURS[p]};margin-right:6px"></i>{escape(p)}</td>'
                    f"<td>{fmt_ns(tot / len(steps))}</td><td>{100 * tot / wall:.1f}%</td></tr>")
    return ('<table><thead><tr><th class="l">phase</th><th>mean per step</th><th>share of wall time</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>')


def _op_rows(data: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Per-op totals over all profiled windows (op_profile, else the raw timeline)."""
    agg: dict[str, dict[str, Any]] = {}
    if data["ops"]:
        for r in data["ops"]:
            a = agg.setdefault(r["name"], {"name": r["name"], "calls": 0, "dispatches": 0, "host_ns": 0,
                                           "device_ns": 0, "flops": 0, "bytes": 0})
            for k in ("calls", "dispatches", "host_ns", "device_ns", "flops", "bytes"):
                a[k] += r[k] or 0
        return sorted(agg.values(), key=lambda a: -a["device_ns"]), "op_profile"
    for r in data["timeline"]:
        name = r["op"] or r["name"]
        a = agg.setdefault(name, {"name": name, "calls": 0, "dispatches": 0, "host_ns": 0, "device_ns": 0,
                                  "flops": 0, "bytes": 0})
        a["dispatches"] += 1
        a["calls"] += 1
        a["device_ns"] += r["end_ns"] - r["start_ns"]
        a["flops"] += r["flops"]
        a["bytes"] += r["bytes"]
    return sorted(agg.values(), key=lambda a: -a["device_ns"]), "gpu_timeline"


def _rate(n: int, ns: int) -> float | None:
    return n / ns if ns > 0 else None


def top_ops(data: dict[str, Any]) -> str:
    """Top-10 ops by device time: bars plus a table."""
    rows, _src = _op_rows(data)
    rows = [r for r in rows if r["device_ns"] > 0][:10]
    if not rows:
        return empty("No profiled window in this run (train with --profile-steps START:STOP).")
    total = sum(r["device_ns"] for r in _op_rows(data)[0]) or 1
    bars = [(r["name"], r["device_ns"] / 1e6, "#2b8cbe",
             (f"{r['name']}: {fmt_ns(r['device_ns'])} device, {r['dispatches']} launches, "
              f"{100 * r['device_ns'] / total:.1f}% of device time")) for r in rows]
    body = []
    for r in rows:
        gf, gb = _rate(r["flops"], r["device_ns"]), _rate(r["bytes"], r["device_ns"])
        body.append(f'<tr><td class="l mono">{escape(r["name"])}</td><td>{r["calls"]}</td><td>{r["dispatches"]}</td>'
                    f'<td>{fmt_ns(r["device_ns"])}</td><td>{100 * r["device_ns"] / total:.1f}%</td>'
                    f'<td>{fmt_ns(r["host_ns"]) if r["host_ns"] else "–"}</td>'
                    f'<td>{"n/a" if gf is None else f"{gf:.2f}"}</td><td>{"n/a" if gb is None else f"{gb:.2f}"}</td></tr>')
    table = ('<table><thead><tr><th class="l">op</th><th>calls</th><th>launches</th><th>device time</th>'
             '<th>share</th><th>host time</th><th>GFLOP/s</th><th>GB/s</th></tr></thead>'
             f'<tbody>{"".join(body)}</tbody></table>')
    return hbars(bars, "device time (ms)", "top ops by device time") + table


def launches(data: dict[str, Any]) -> str:
    """Kernel launches per step (step_timing.dispatches, else counted from the timeline)."""
    steps = data["steps"]
    pts = [(s["step"], s["dispatches"]) for s in steps if s["dispatches"] is not None]
    if not pts and data["timeline"]:
        counts: dict[int, int] = {}
        for r in data["timeline"]:
            if r["step"] is not None:
                counts[r["step"]] = counts.get(r["step"], 0) + 1
        pts = sorted(counts.items())
    if not pts:
        return empty("The runtime did not count kernel launches in this run.")
    xs = [str(s) for s, _ in pts]
    if len(pts) > MAX_BARS:
        size = -(-len(pts) // MAX_BARS)
        groups = [pts[i:i + size] for i in range(0, len(pts), size)]
        xs = [f"{g[0][0]}–{g[-1][0]}" for g in groups]
        vals = [sum(v for _, v in g) / len(g) for g in groups]
    else:
        vals = [float(v) for _, v in pts]
    return stacked_bars(xs, [("launches", "#756bb1", vals)], "launches", "step", "kernel launches per step")


def bandwidth(data: dict[str, Any]) -> str:
    """Achieved GB/s of the top kernels by device time (FLOP rate in the hover text)."""
    agg: dict[str, list[int]] = {}
    for r in data["timeline"]:
        a = agg.setdefault(r["name"], [0, 0, 0, 0])
        a[0] += r["end_ns"] - r["start_ns"]
        a[1] += r["bytes"]
        a[2] += r["flops"]
        a[3] += 1
    if not agg:
        for r in _op_rows(data)[0]:
            agg[r["name"]] = [r["device_ns"], r["bytes"], r["flops"], r["dispatches"]]
    rows = sorted(((k, v) for k, v in agg.items() if v[0] > 0), key=lambda kv: -kv[1][0])[:10]
    if not rows:
        return empty("No device timings in this run (train with --profile-steps START:STOP).")
    bars = []
    for name, (ns, by, fl, n) in rows:
        gb = by / ns
        tip = f"{name}: {gb:.2f} GB/s, {fl / ns:.2f} GFLOP/s over {n} launches ({fmt_ns(ns)} device)"
        bars.append((name, gb, "#31a354", tip))
    return hbars(bars, "achieved GB/s (bytes moved / device time)", "achieved bandwidth")


def render(data: dict[str, Any]) -> str:
    """The whole HTML page for one run's data (as returned by :func:`~helios.profile.rundb.read_run`)."""
    run, steps = data["run"], data["steps"]
    started = _dt.datetime.fromtimestamp(run["started_at"], _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    status = run["status"]
    if status == "running" and run["ended_at"] is None:
        status = "running or killed (no clean end recorded)"
    med_wall = _median([s["wall_ns"] for s in steps])
    med_tps = _median([s["tokens_per_s"] for s in steps])
    med_mfu = _median([s["mfu"] for s in steps])
    med_hfu = _median([s["hfu"] for s in steps])
    last_loss = next((s["loss"] for s in reversed(steps) if s["loss"] is not None), None)
    last_val = next((s["val_loss"] for s in reversed(steps) if s.get("val_loss") is not None), None)
    med_disp = _median([s["dispatches"] for s in steps])
    peak_note = run["peak_label"] or ("peak unknown for this device" if not run["peak_flops"] else "")
    cards = "".join([
        card("steps", str(len(steps)), f"{steps[0]['step']}–{steps[-1]['step']}" if steps else ""),
        card("step time (median)", fmt_ns(med_wall) if med_wall is not None else "n/a"),
        card("tokens / s (median)", f"{med_tps:,.0f}" if med_tps is not None else "n/a"),
        card("MFU (median)", format_mfu(med_mfu), peak_note),
        card("HFU (median)", format_mfu(med_hfu)),
        card("last loss", f"{last_loss:.4f}" if last_loss is not None else "n/a"),
        card("last validation loss", f"{last_val:.4f}" if last_val is not None else "n/a"),
        card("launches / step", f"{med_disp:.0f}" if med_disp is not None else "n/a"),
    ])

    mfu_pts = [(s["step"], 100 * s["mfu"]) for s in steps if s["mfu"] is not None]
    hfu_pts = [(s["step"], 100 * s["hfu"]) for s in steps if s["hfu"] is not None]
    if mfu_pts:
        ser = [("MFU", "#2b8cbe", mfu_pts)] + ([("HFU", "#e6550d", hfu_pts)] if hfu_pts else [])
        legend = "".join(f'<span><i style="background:{c}"></i>{n}</span>' for n, c, _ in ser)
        mfu_body = f'<div class="legend">{legend}</div>' + line_chart(ser, "% of peak", y_min=0.0, title="MFU",
                                                                       y_fmt=lambda v: f"{v:.2f}%")
    else:
        mfu_body = empty("MFU is n/a: " + (peak_note or "no peak FLOP/s or FLOPs per token recorded") + ".")
    loss_pts = [(s["step"], s["loss"]) for s in steps if s["loss"] is not None]
    val_pts = [(s["step"], s["val_loss"]) for s in steps if s.get("val_loss") is not None]
    if loss_pts:
        ser = [("training", "#de2d26", loss_pts)] + ([("validation", "#3182bd", val_pts)] if val_pts else [])
        legend = "".join(f'<span><i style="background:{c}"></i>{n}</span>' for n, c, _ in ser)
        loss_body = f'<div class="legend">{legend}</div>' + line_chart(ser, "loss", title="loss")
    else:
        loss_body = empty("No loss values recorded.")

    sections = [
        section("chart-waterfall", "Step time by phase",
                 "Each bar is one step; the phases add up to the step's wall time (idle = time outside every "
                 "phase). Hover a bar for its breakdown.", waterfall(steps) + phase_table(steps)),
        section("chart-mfu", "Model FLOPs utilisation",
                 "MFU = model FLOPs per token × tokens/s ÷ (peak FLOP/s × devices); HFU counts recomputed "
                 f"FLOPs too. Peak: {escape(peak_note or 'n/a')}.", mfu_body),
        section("chart-loss", "Loss", "Training loss at each step; validation loss where it was measured "
                 "(--eval-every, and at the end).", loss_body),
        section("chart-top-ops", "Top 10 ops by device time",
                 "Summed over the profiled steps; a launch no host op claimed is listed under its kernel name.",
                 top_ops(data)),
        section("chart-launches", "Kernel launches per step", "Dispatches the runtime recorded in each step.",
                 launches(data)),
        section("chart-bandwidth", "Achieved bandwidth of the top kernels",
                 "Bytes moved ÷ device time for the 10 kernels with the most device time; hover for GFLOP/s.",
                 bandwidth(data)),
    ]
    cfg = run.get("config_json") or ""
    sub = " · ".join(x for x in [
        f"device: {run['device'] or 'unknown'}", f"dtype: {run['dtype'] or '?'}",
        f"devices: {run['n_devices']}", f"started {started}", f"status: {status}",
        f"host: {run['host']}"] if x)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>Helios report: {escape(run['name'] or '')}</title><style>{CSS}</style>{SENTINEL}</head><body>"
        f"<header><h1>Helios run report: {escape(run['name'] or '')}</h1><div class=\"sub\">{escape(sub)}</div>"
        "</header><main><div id=\"js-errors\"></div>"
        f"<div class=\"cards\">{cards}</div>{''.join(sections)}"
        + (f'<details><summary>configuration</summary><pre>{escape(cfg)}</pre></details>' if cfg else "")
        + f"<footer>run {run['run_id']} · <span id=\"render-status\">rendered without scripts</span></footer>"
        f"</main>{DONE}</body></html>\n"
    )


def write_report(run_dir: str, run_id: int | None = None, out: str | None = None) -> str:
    """Render the report of ``run_dir`` to ``out`` (default RUN_DIR/report.html), atomically; returns its path."""
    import os

    html = render(read_run(run_dir, run_id))
    return atomic_write_text(out or os.path.join(run_dir, "report.html"), html)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``helios-report RUN_DIR [--run-id N] [-o FILE]``; prints the report's path."""
    ap = argparse.ArgumentParser(prog="helios-report", description="Write RUN_DIR/report.html from RUN_DIR/run.db.")
    ap.add_argument("run_dir", help="the folder passed to helios-train --out")
    ap.add_argument("--run-id", type=int, default=None, help="which run of the folder (default: the latest)")
    ap.add_argument("-o", "--output", default=None, help="where to write the page (default: RUN_DIR/report.html)")
    args = ap.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.run_id, args.output)
    except ProfileError as e:
        print(f"helios-report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
