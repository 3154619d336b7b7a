"""The plan beside a real helios-train run: ``helios-plan --model tiny --gpu lavapipe --run-db RUN_DIR``.

Reads ``RUN_DIR/run.db`` (helios.profile.rundb): the run's model and batch (its
``config_json``), the median step wall time and tokens/s after the first two steps (the
first compiles pipelines), its MFU, and the bytes the weights pool held for parameters,
gradients and moments (``config_json["memory"]["weights_pool_in_use"]``).  The plan is
made for exactly that run (same shape, batch, data-parallel degree and ZeRO stage, fp32,
materialized attention as helios-train computes it today), and both are printed with their
ratio.  Where the run profiled kernels (``--profile-steps``), the matmul rate it reached is
printed beside the table's rate.
"""

from __future__ import annotations

import json
import statistics

from .hardware import Device
from .layout import Parallel, Settings
from .memory import memory_per_rank
from .model import ModelShape, PlanError
from .timing import step_time

WARMUP_STEPS = 2


def calibrate(run_dir: str, dev: Device, dtype: str = "fp32") -> dict:
    """Planned vs measured for the latest run in ``run_dir``."""
    from helios.profile.errors import ProfileError
    from helios.profile.rundb import read_run

    try:
        data = read_run(run_dir)
    except ProfileError as e:
        raise PlanError(f"--run-db: {e}") from None
    run = data["run"]
    try:
        cfg = json.loads(run.get("config_json") or "{}")
        mc, tr = cfg["config"], cfg["train"]
    except (ValueError, KeyError, TypeError):
        raise PlanError(f"--run-db {run_dir}: the run records no model configuration (not a helios-train run?)") from None
    steps = [s for s in data["steps"] if s.get("wall_ns")]
    if len(steps) <= WARMUP_STEPS:
        raise PlanError(f"--run-db {run_dir}: {len(steps)} step(s) recorded; need more than {WARMUP_STEPS} "
                        "(the first ones compile kernels)")
    steady = steps[WARMUP_STEPS:]
    world = int(cfg.get("world_size") or run.get("n_devices") or 1)
    zero = int(cfg.get("zero") or 0)
    shape = ModelShape(int(mc["n_layer"]), int(mc["n_embd"]), int(mc["n_head"]), int(mc["vocab_size"]),
                       int(mc["block_size"]), name="run")
    per_rank = int(tr["batch_size"]) * int(tr.get("grad_accum") or 1)
    st = Settings(global_batch=per_rank * world, tokens=1.0, dtype=dtype, attention="materialized")
    par = Parallel(dp=world, zero=zero, mb=int(tr["batch_size"]), recompute="none")
    t = step_time(shape, par, st, dev, dtype)
    mem = memory_per_rank(shape, par, st, dev)
    wall = statistics.median(s["wall_ns"] for s in steady) / 1e9
    tps = statistics.median(s["tokens_per_s"] for s in steady if s.get("tokens_per_s"))
    mfus = [s["mfu"] for s in steady if s.get("mfu") is not None]
    pool = (cfg.get("memory") or {}).get("weights_pool_in_use")
    rows = [
        ("step time (s)", t.step, wall),
        ("tokens/s", t.tokens_per_s, tps),
        ("MFU", t.mfu, statistics.median(mfus) if mfus else None),
        ("model states (bytes)", mem.states, pool),
    ]
    ops = [o for o in data.get("ops", []) if "matmul" in o["name"].lower() and o["device_ns"] > 0]
    if ops:
        rate = sum(o["flops"] for o in ops) / (sum(o["device_ns"] for o in ops) / 1e9)
        rows.append(("matmul FLOP/s", dev.achievable * dev.peak_for(dtype), rate))
    out = {"run_dir": str(run_dir), "run_id": run["run_id"], "device": run.get("device"), "steps": len(steps),
           "steady_steps": len(steady), "shape": shape.to_dict(), "parallel": par.to_dict(),
           "planned_parts_s": dict(t.parts),
           "rows": [{"quantity": q, "planned": p, "measured": m, "ratio": (m / p if (m and p) else None)} for q, p, m in rows]}
    return out


def _v(q: str, v: float | None) -> str:
    if v is None:
        return "n/a"
    if q == "MFU":
        return f"{100 * v:.2f} %"
    if "bytes" in q:
        return f"{v / 1e6:.2f} MB"
    if "FLOP/s" in q:
        return f"{v / 1e9:.1f} G"
    if "step" in q:
        return f"{v * 1e3:.1f} ms"
    return f"{v:,.0f}"


def format_calibration(c: dict) -> str:
    lines = [f"measured: run {c['run_id']} in {c['run_dir']} on {c['device']}, median of {c['steady_steps']} steps "
             f"after the first {WARMUP_STEPS}"]
    w = max(len(r["quantity"]) for r in c["rows"])
    lines.append(f"  {'':{w}}  {'planned':>12}  {'measured':>12}  measured/planned")
    for r in c["rows"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        lines.append(f"  {r['quantity']:{w}}  {_v(r['quantity'], r['planned']):>12}  {_v(r['quantity'], r['measured']):>12}"
                     f"  {ratio}")
    return "\n".join(lines)
