"""The plan beside a real helios-train run: ``helios-plan --model tiny --gpu lavapipe --run-db RUN_DIR``,
and measured links in place of the device table's: ``--calibrate LINKS_JSON``.

Reads ``RUN_DIR/run.db`` (helios.profile.rundb): the run's model and batch (its
``config_json``), the median step wall time and tokens/s after the first two steps (the
first compiles pipelines), its MFU, and the bytes the weights pool held for parameters,
gradients and moments (``config_json["memory"]["weights_pool_in_use"]``).  The plan is
made for exactly that run (same shape, batch, data-parallel degree and ZeRO stage, fp32,
materialized attention as helios-train computes it today), and both are printed with their
ratio.  Where the run profiled kernels (``--profile-steps``), the matmul rate it reached is
printed beside the table's rate.

``--calibrate LINKS_JSON`` (bench/multihost.py writes one per cluster it measures) replaces the
device's links by measured α-β per level, as the planner's ring formulas use them::

    {"per_node": 2, "compute_ranks": 4,
     "intra": {"alpha_s": 4.1e-05, "bytes_per_s": 2.3e9},
     "inter": {"alpha_s": 2.2e-04, "bytes_per_s": 1.2e8},
     "source": "bench/multihost.py ..."}

``per_node``: ranks per host; ``intra``/``inter``: the α (seconds per message) and bandwidth
(bytes/s, per rank and direction) fitted to all-reduces inside a host and between hosts
(efficiency included: the planner applies none on top); ``compute_ranks`` (optional, CPU
devices): the ranks that share the machine's cores, when the hosts are namespaces of one machine.
"""

from __future__ import annotations

import json
import statistics

from dataclasses import replace

from .hardware import Device
from .layout import Parallel, Settings
from .memory import memory_per_rank
from .model import ModelShape, PlanError
from .timing import step_time

WARMUP_STEPS = 2


def _positive(doc: dict, path: str, *keys: str) -> float:
    v = doc
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise PlanError(f"--calibrate {path}: {'.'.join(keys)} must be a positive number, got {v!r}")
    return float(v)


def with_measured_links(dev: Device, path: str) -> Device:
    """``dev`` with the links (and ranks per node) measured in ``path`` (see the module docstring)."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise PlanError(f"--calibrate {path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise PlanError(f"--calibrate {path}: expected a JSON object with per_node, intra and inter")
    per_node = _positive(doc, path, "per_node")
    shared = doc.get("compute_ranks")
    if shared is not None:
        shared = _positive(doc, path, "compute_ranks")
    if per_node != int(per_node) or (shared is not None and shared != int(shared)):
        raise PlanError(f"--calibrate {path}: per_node and compute_ranks must be whole numbers")
    return replace(dev, per_node=int(per_node), compute_ranks=int(shared or 0), link_efficiency=1.0,
                   intra_alpha=_positive(doc, path, "intra", "alpha_s"),
                   intra_bw=_positive(doc, path, "intra", "bytes_per_s"),
                   inter_alpha=_positive(doc, path, "inter", "alpha_s"),
                   inter_bw=_positive(doc, path, "inter", "bytes_per_s"),
                   sources={**dev.sources, "links": f"measured, {path}" + (f": {doc['source']}" if doc.get("source") else "")})


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
    # helios-train's --batch-size is the global batch (every rank takes its slice of it)
    batch = int(tr["batch_size"])
    st = Settings(global_batch=batch * int(tr.get("grad_accum") or 1), tokens=1.0, dtype=dtype, attention="materialized")
    par = Parallel(dp=world, zero=zero, mb=max(1, batch // world), recompute="none")
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
