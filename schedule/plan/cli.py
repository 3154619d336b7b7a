"""``helios-plan``: what fits, how long it takes, what it costs, and why.

    helios-plan --params 1e12 --tokens 2e13 --gpu h100-sxm --gpus 4096 --seq 8192
    helios-plan --model tiny --gpu lavapipe --gpus 1 [--run-db RUN_DIR]
    helios-plan --model tiny --gpu lavapipe --gpus 4 --calibrate links.json --run-db RUN_DIR
    helios-plan --model tiny --gpu lavapipe --gpus 4 --calibrate links.json --compute-from ONE_HOST_RUN --run-db RUN_DIR
    helios-plan --params 7e9 --gpu h100-sxm --gpus 64 --show 10 --html plan.html
    helios-plan --check "1e12 params, 400 H100, 17 s/step, 8.4e6 tokens/step"
    helios-plan --validate

Exit status: 0 a plan (or every claim holds), 1 ``--check`` found a claim that breaks a
bound, 2 a request that cannot be planned (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from .claims import fmt_g, check, parse_number
from .hardware import Device, device_names, get_device
from .layout import RECOMPUTE, Settings
from .memory import KINDS
from .model import ModelShape, PlanError, fmt_count, fmt_duration, helios_config, shape_for_params
from .search import SearchResult, explain_empty, search

DEFAULT_BATCH_TOKENS = 1 << 22  # ~4M tokens per step for --check when no tokens/step are stated


def default_batch_tokens(n_params: float) -> float:
    """Tokens per step when --global-batch is not given, as published runs of that size used:
    GPT-3 (Brown et al. 2020, table 2.1): 0.5M below 1B, 1M to 5B, 2M to 50B, 3.2M for 175B;
    beyond 300B, Llama 3 405B's 16M (Dubey et al. 2024, table 4)."""
    for limit, tokens in ((1e9, 0.5e6), (5e9, 1e6), (5e10, 2e6), (3e11, 3.2e6)):
        if n_params < limit:
            return tokens
    return 16e6
    # (the number of sequences is then rounded to a power of two: see resolve)
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022, when --tokens is not given


def _number(text: str) -> float:
    try:
        return parse_number(text)
    except PlanError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (write 1e12, 1T, 7B or 8.4e6)") from None


def _int(text: str) -> int:
    v = _number(text)
    if v != int(v):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-plan", description="Plan a training run: the layouts that fit, step time, "
                                "throughput, MFU, days and cost, each with what bounds it.")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=_number, help="parameter count (1e12, 1T, 7B): a GPT shape is derived and printed")
    m.add_argument("--model", help="a helios-train --config (nano, tiny, small, gpt2)")
    m.add_argument("--layers", type=_int, help="layers (with --hidden and --heads: an exact shape)")
    m.add_argument("--hidden", type=_int, help="model width")
    m.add_argument("--heads", type=_int, help="attention heads")
    m.add_argument("--vocab", type=_int, help="vocabulary (default 51200; 256 with --model)")
    m.add_argument("--ffn", type=_int, default=0, help="MLP width (default 4 x hidden)")
    m.add_argument("--experts", type=_int, default=1, help="experts per MoE layer (default 1: dense)")
    m.add_argument("--top-k", type=_int, default=1, help="experts per token")
    m.add_argument("--seq", type=_int, help="context length (default 2048; the config's with --model)")
    h = p.add_argument_group("hardware and run")
    h.add_argument("--gpu", default="h100-sxm", help=f"device: {', '.join(device_names())} (default h100-sxm)")
    h.add_argument("--gpus", type=_int, default=None, help="number of devices (default: one node)")
    h.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                   help="bf16 mixed precision (default), fp32 (helios-train today; the default on lavapipe)")
    h.add_argument("--grad-bytes", type=int, default=2, choices=(2, 4), help="bytes per gradient in mixed precision")
    h.add_argument("--attention", default=None, choices=("flash", "materialized"),
                   help="flash (default) or materialized scores (Megatron-LM 2021; helios-train today)")
    h.add_argument("--no-sp", action="store_true", help="tensor parallel without sequence parallelism")
    h.add_argument("--no-overlap", action="store_true", help="put every data-parallel collective on the critical path")
    h.add_argument("--global-batch", type=_int, help="sequences per optimizer step (default: as published runs of the "
                   "size: 0.5M tokens below 1B parameters ... 16M beyond 300B)")
    h.add_argument("--tokens", type=_number, help="training tokens (default 20 per parameter)")
    h.add_argument("--price", type=float, default=2.0, help="$ per GPU-hour for the cost (default 2.00, an assumption)")
    f = p.add_argument_group("fix a degree (the search varies the others)")
    for k in ("dp", "tp", "pp", "cp", "ep", "zero"):
        f.add_argument(f"--{k}", type=_int)
    f.add_argument("--micro-batch", type=_int, dest="mb")
    f.add_argument("--recompute", choices=RECOMPUTE)
    o = p.add_argument_group("output")
    o.add_argument("--show", type=_int, default=5, help="plans in the table (default 5)")
    o.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    o.add_argument("--html", metavar="PATH", help="also write a self-contained HTML page with the charts")
    o.add_argument("--check", metavar="TEXT", help="check claims: \"1e12 params, 400 H100, 17 s/step, 8.4e6 tokens/step\"")
    o.add_argument("--run-db", metavar="RUN_DIR", help="compare the plan with a helios-train run (its --out folder)")
    o.add_argument("--calibrate", metavar="LINKS_JSON", help="measured alpha-beta per level (in a host, between "
                   "hosts) and ranks per host in place of the device's links (bench/multihost.py writes one)")
    o.add_argument("--compute-from", metavar="RUN_DIR", help="fit the device's compute rate to a helios-train run on "
                   "this machine (its --out folder), e.g. one host's, to plan another layout from it")
    o.add_argument("--validate", action="store_true", help="the model against published runs (Megatron-LM, ZeRO)")
    o.add_argument("--list-gpus", action="store_true", help="the hardware table")
    return p


# ---------------------------------------------------------------------------- building the request


def resolve(args: argparse.Namespace) -> tuple[ModelShape, Settings, Device, int, str, dict]:
    """(shape, settings, device, gpus, dtype, fixed degrees) from the flags, or PlanError."""
    dev = get_device(args.gpu)
    if args.calibrate:
        from .calibrate import with_measured_links

        dev = with_measured_links(dev, args.calibrate)
    cpu = dev.key == "lavapipe"
    dtype = args.dtype or ("fp32" if cpu else "bf16")
    dev.peak_for(dtype)
    if args.compute_from:
        from .calibrate import with_fitted_compute

        dev = with_fitted_compute(dev, args.compute_from, dtype)
    gpus = args.gpus if args.gpus is not None else (1 if cpu else dev.per_node)
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    batch = None
    if args.model:
        if args.params or args.layers:
            raise PlanError("--model names a whole shape: give it without --params/--layers")
        shape, batch = helios_config(args.model, args.vocab or 256)
        if args.seq:
            shape = shape.with_seq(args.seq)
    elif args.layers or args.hidden or args.heads:
        if not (args.layers and args.hidden and args.heads):
            raise PlanError("an exact shape needs all of --layers, --hidden and --heads")
        shape = ModelShape(args.layers, args.hidden, args.heads, args.vocab or 51200, args.seq or 2048, ffn=args.ffn,
                           n_experts=args.experts, top_k=args.top_k, name="given")
    elif args.params:
        shape = shape_for_params(args.params, args.seq or 2048, args.vocab or 51200, args.experts, args.top_k)
    else:
        raise PlanError("say what to plan: --params N, --model NAME, or --layers/--hidden/--heads (or --check TEXT)")
    if args.global_batch is not None:
        gb = args.global_batch
    elif batch is not None:
        gb = batch
    else:
        # a power of two of sequences (nearest in log), so that power-of-two degrees divide it
        gb = 2 ** max(0, round(math.log2(max(1.0, default_batch_tokens(shape.n_params()) / shape.seq))))
    if gb < 1:
        raise PlanError(f"--global-batch must be at least 1, got {gb}")
    tokens = args.tokens if args.tokens else CHINCHILLA_TOKENS_PER_PARAM * shape.n_params()
    if not (tokens > 0 and math.isfinite(tokens)):
        raise PlanError(f"--tokens must be positive, got {tokens}")
    attention = args.attention or ("materialized" if args.model else "flash")
    st = Settings(global_batch=gb, tokens=tokens, dtype=dtype, grad_bytes=args.grad_bytes, attention=attention,
                  sequence_parallel=not args.no_sp, overlap=not args.no_overlap, price=args.price)
    fixed = {k: getattr(args, k) for k in ("dp", "tp", "pp", "cp", "ep", "zero", "mb", "recompute")}
    return shape, st, dev, gpus, dtype, fixed


# ---------------------------------------------------------------------------- text output


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}" if b >= 1e8 else f"{b / 1e9:.3f}"


def run_summary(plan, shape: ModelShape, st: Settings) -> dict:
    """Days, GPU-hours and cost of the whole token budget at ``plan``'s throughput."""
    secs = st.tokens / plan.time.tokens_per_s
    hours = secs / 3600 * plan.par.gpus
    return {"seconds": secs, "days": secs / 86400, "gpu_hours": hours, "cost": hours * st.price, "steps":
            math.ceil(st.tokens / (st.global_batch * shape.seq))}


def table(plans: list, shape: ModelShape, st: Settings) -> str:
    cols = ("#", "dp", "tp", "pp", "cp", "ep", "zero", "mb", "m", "recompute", "GB/GPU", "step", "tokens/s", "MFU",
            "days", "bound")
    rows = []
    for i, pl in enumerate(plans, 1):
        p, t = pl.par, pl.time
        rs = run_summary(pl, shape, st)
        rows.append((str(i), str(p.dp), str(p.tp), str(p.pp), str(p.cp), str(p.ep), str(p.zero), str(p.mb),
                     str(t.micro_batches), p.recompute, _gb(pl.mem.total), fmt_duration(t.step), f"{t.tokens_per_s:,.0f}",
                     f"{100 * t.mfu:.1f}%", f"{rs['days']:.1f}" if rs["days"] >= 0.1 else f"{rs['days']:.2g}", pl.bound))
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    left = {"recompute", "bound"}
    fmt = lambda r: "  ".join(v.ljust(w[i]) if cols[i] in left else v.rjust(w[i]) for i, v in enumerate(r)).rstrip()
    return "\n".join([fmt(cols), *(fmt(r) for r in rows)])


def breakdown(pl) -> tuple[str, str]:
    parts = pl.time.parts
    tsum = " + ".join(f"{k.replace('_', '-')} {fmt_duration(v)}" for k, v in parts.items() if v > 0)
    msum = " + ".join(f"{k} {_gb(getattr(pl.mem, k))}" for k in KINDS if getattr(pl.mem, k) > 0)
    return (f"step {fmt_duration(pl.time.step)} = {tsum}",
            f"memory {_gb(pl.mem.total)} GB of {pl.capacity / 1e9:.0f} ({pl.mem.stage} stage) = {msum}")


def header(shape: ModelShape, st: Settings, dev: Device, gpus: int, dtype: str, res: SearchResult) -> list[str]:
    peak = dev.peak_for(dtype)
    lines = [
        f"model: {shape.describe()}" + (f" [{shape.name}]" if shape.name else ""),
        f"  FLOPs per token {fmt_g(shape.flops_per_token())} (6N + 12LTC, as helios-train's MFU); "
        f"global batch {st.global_batch} x {shape.seq} = {fmt_count(st.global_batch * shape.seq)} tokens/step; "
        f"budget {fmt_g(st.tokens)} tokens",
        f"hardware: {gpus} x {dev.label(dtype)}; GEMMs at {100 * dev.achievable:.1f} % of peak "
        f"({dev.achievable_source})",
        f"  links per device each way: {dev.intra_bw / 1e9:.3g} GB/s in a node of {dev.per_node}, "
        f"{dev.inter_bw / 1e9:.3g} GB/s between nodes, x{dev.link_efficiency:.2f} efficiency; "
        f"{dtype}, attention {st.attention}, overlap {'on' if st.overlap else 'off'}",
        *([f"  links: {dev.sources['links']}"] if "links" in dev.sources else []),
        f"searched {res.evaluated:,} legal layouts: {len(res.plans):,} fit in {dev.memory / 1e9:.0f} GB, "
        f"{res.rejected.get('memory', 0):,} do not",
    ]
    _ = peak
    if st.global_batch * shape.seq < 256 * gpus:
        lines.append(f"  note: {fmt_count(st.global_batch * shape.seq)} tokens per step over {gpus} GPUs is "
                     f"{st.global_batch * shape.seq / gpus:.0f} per GPU: communication will dominate "
                     "(raise --global-batch or use fewer GPUs)")
    return lines


def plan_json(shape, st, dev, gpus, dtype, res, show) -> dict:
    def one(pl):
        return {"parallel": pl.par.to_dict(), "memory_bytes": pl.mem.to_dict(), "fits": pl.fits, "bound": pl.bound,
                **pl.time.to_dict(), "run": run_summary(pl, shape, st)}
    return {"model": shape.to_dict(), "settings": st.to_dict(), "device": {
        "key": dev.key, "name": dev.name, "peak_flops": dev.peak_for(dtype), "dtype": dtype, "memory": dev.memory,
        "hbm_bw": dev.hbm_bw, "intra_bw": dev.intra_bw, "inter_bw": dev.inter_bw, "per_node": dev.per_node,
        "achievable": dev.achievable, "achievable_source": dev.achievable_source, "intra_alpha": dev.intra_alpha,
        "inter_alpha": dev.inter_alpha, "compute_ranks": dev.compute_ranks, "links_source": dev.sources.get("links")},
        "gpus": gpus,
        "evaluated": res.evaluated, "fitting": len(res.plans), "rejected": dict(res.rejected),
        "plans": [one(p) for p in res.plans[:show]]}


# ---------------------------------------------------------------------------- entry point


def _err(msg: str) -> int:
    print(f"helios-plan: {msg}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except PlanError as e:
        if args.json:  # a program reading the JSON learns why from it, not from the message's words
            print(json.dumps({"error": str(e), "reason": e.reason}))
        return _err(str(e))
    except OSError as e:
        return _err(f"{e.filename or ''}: {e.strerror or e}")


def _main(args: argparse.Namespace) -> int:
    if args.list_gpus:
        for k in device_names():
            d = get_device(k)
            pk = ", ".join(f"{dt} {v / 1e12:.1f}" for dt, v in d.peak.items())
            print(f"{k:10s} {d.name}: TFLOP/s {pk}; {d.memory / 1e9:.0f} GB at {d.hbm_bw / 1e12:.2f} TB/s; "
                  f"{d.intra_bw / 1e9:.0f} GB/s in-node, {d.inter_bw / 1e9:.0f} GB/s between nodes")
        return 0
    if args.validate:
        from .validation import report

        text, ok = report()
        print(text)
        return 0 if ok else 1
    if args.check:
        return _check(args)
    if args.show < 1:
        raise PlanError(f"--show must be at least 1, got {args.show}")
    shape, st, dev, gpus, dtype, fixed = resolve(args)
    res = search(shape, st, dev, gpus, dtype, fixed)
    calib = None
    if args.run_db:
        from .calibrate import calibrate

        calib = calibrate(args.run_db, dev, dtype)
    if not res.plans:
        raise PlanError(explain_empty(res, shape, st, dev, gpus))
    if args.json:
        doc = plan_json(shape, st, dev, gpus, dtype, res, args.show)
        if calib is not None:
            doc["calibration"] = calib
        print(json.dumps(doc, indent=1))
    else:
        print("\n".join(header(shape, st, dev, gpus, dtype, res)))
        print()
        print(table(res.plans[:args.show], shape, st))
        best = res.plans[0]
        rs = run_summary(best, shape, st)
        print()
        print(f"best: {best.par.label()}")
        for line in breakdown(best):
            print("  " + line)
        print(f"  run: {fmt_g(st.tokens)} tokens = {rs['steps']:,} steps in {fmt_duration(rs['seconds'])} on {gpus} GPU(s), "
              f"{rs['gpu_hours']:,.0f} GPU-hours, ${rs['cost']:,.0f} at ${st.price:.2f}/GPU-hour (--price); "
              f"MFU {100 * best.time.mfu:.1f} %, HFU {100 * best.time.hfu:.1f} %")
        if calib is not None:
            from .calibrate import format_calibration

            print()
            print(format_calibration(calib))
    if args.html:
        from .page import write_page

        path = write_page(args.html, shape, st, dev, gpus, dtype, res, min(args.show, 10), calib)
        if not args.json:
            print(f"\nwrote {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    dtype = args.dtype or "bf16"
    r = check(args.check, gpu=None if args.gpu == "h100-sxm" else args.gpu, dtype=dtype, price=args.price)
    vs = r["verdicts"]
    if args.json:
        print(json.dumps({"facts": r["facts"], "verdicts": [v.__dict__ for v in vs]}, indent=1))
    else:
        f = r["facts"]
        dev = r["device"]
        print(f"claims: {args.check}")
        print(f"bounds at 100 % of the dense {dtype} peak of {dev.name} ({dev.peak_for(dtype) / 1e12:.1f} TFLOP/s), "
              f"nothing else on the critical path")
        for v in vs:
            print("  " + v.line())
        if f.get("params") and f.get("gpus"):
            _check_plan(f, dev, dtype, args)
    return 1 if any(v.status == "BREAKS" for v in vs) else 0


def _check_plan(f: dict, dev: Device, dtype: str, args: argparse.Namespace) -> None:
    """What the planner finds for the stated model and fleet (context for the bounds)."""
    seq = args.seq or 2048
    shape = shape_for_params(f["params"], seq)
    tps = f.get("tokens_per_step")
    gb = max(1, round(tps / seq)) if tps else max(1, round(DEFAULT_BATCH_TOKENS / seq))
    g = int(f["gpus"])
    if gb >= g:
        gb = round(gb / g) * g  # a multiple of the GPU count, so that every data-parallel degree divides it
    st = Settings(global_batch=gb, tokens=f.get("tokens") or CHINCHILLA_TOKENS_PER_PARAM * shape.n_params(),
                  dtype=dtype, price=args.price)
    res = search(shape, st, dev, int(f["gpus"]), dtype)
    print(f"planner: {shape.describe()}; {gb} x {seq} = {fmt_count(gb * seq)} tokens/step on {f['gpus']} x {dev.name}:")
    if not res.plans:
        print("  " + explain_empty(res, shape, st, dev, int(f["gpus"])))
        return
    best = res.plans[0]
    print(f"  best of {res.evaluated:,} layouts ({len(res.plans):,} fit): {best.par.label()}: {fmt_duration(best.time.step)} per step, "
          f"MFU {100 * best.time.mfu:.1f} %, {_gb(best.mem.total)} GB per GPU, bound by {best.bound}")
    if f.get("step_s"):
        print(f"  that is {best.time.step / f['step_s']:.1f}x the claimed {f['step_s']:g} s/step")


if __name__ == "__main__":
    sys.exit(main())
