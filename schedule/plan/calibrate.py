"""The plan beside a real helios-train run: ``helios-plan --model tiny --gpu lavapipe --run-db RUN_DIR``,
measured links in place of the device table's: ``--calibrate LINKS_JSON``, and a compute rate
fitted to another run on the same machine: ``--compute-from RUN_DIR``.

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

``--compute-from RUN_DIR`` replaces the table's compute rate (``achievable``) by the one that
makes the plan of that run take its measured median step.  A CPU device's rate swings several
times with the machine's load (lavapipe's table figure is a quiet day's), so a plan for two hosts
made from a one-host run of the same hour predicts what the extra host and its links change,
not what the day's load was.
"""

from __future__ import annotations

import json
import statistics

from dataclasses import dataclass, replace

from .hardware import Device
from .layout import Parallel, Settings
from .memory import memory_per_rank
from .model import ModelShape, PlanError
from .timing import step_time

WARMUP_STEPS = 2


class NoComputeRateFits(PlanError):
    """--compute-from names a run whose step is shorter than the plan's other parts at the
    device's peak (a run of a few milliseconds, or one of another --gpu)."""

    reason = "no_compute_rate_fits"


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


@dataclass(frozen=True)
class MeasuredRun:
    """A helios-train run read from its run.db, as the planner sees it."""

    data: dict  # helios.profile.rundb.read_run's document
    cfg: dict  # the run's config_json
    shape: ModelShape
    par: Parallel
    settings: Settings
    steps: int
    steady: list  # the steps after WARMUP_STEPS
    wall_s: float  # median step wall time of the steady steps


def read_measured_run(run_dir: str, dtype: str = "fp32", flag: str = "--run-db") -> MeasuredRun:
    """The model, batch, layout and median step time of the latest run in ``run_dir``, or PlanError
    naming ``flag``."""
    from helios.profile.errors import ProfileError
    from helios.profile.rundb import read_run

    try:
        data = read_run(run_dir)
    except ProfileError as e:
        raise PlanError(f"{flag}: {e}") from None
    run = data["run"]
    try:
        cfg = json.loads(run.get("config_json") or "{}")
        mc, tr = cfg["config"], cfg["train"]
    except (ValueError, KeyError, TypeError):
        raise PlanError(f"{flag} {run_dir}: the run records no model configuration (not a helios-train run?)") from None
    steps = [s for s in data["steps"] if s.get("wall_ns")]
    if len(steps) <= WARMUP_STEPS:
        raise PlanError(f"{flag} {run_dir}: {len(steps)} step(s) recorded; need more than {WARMUP_STEPS} "
                        "(the first ones compile kernels)")
    world = int(cfg.get("world_size") or run.get("n_devices") or 1)
    shape = ModelShape(int(mc["n_layer"]), int(mc["n_embd"]), int(mc["n_head"]), int(mc["vocab_size"]),
                       int(mc["block_size"]), name="run")
    # helios-train's --batch-size is the global batch (every rank takes its slice of it)
    batch = int(tr["batch_size"])
    st = Settings(global_batch=batch * int(tr.get("grad_accum") or 1), tokens=1.0, dtype=dtype, attention="materialized")
    par = Parallel(dp=world, zero=int(cfg.get("zero") or 0), mb=max(1, batch // world), recompute="none")
    steady = steps[WARMUP_STEPS:]
    wall = statistics.median(s["wall_ns"] for s in steady) / 1e9
    return MeasuredRun(data, cfg, shape, par, st, len(steps), steady, wall)


def with_fitted_compute(dev: Device, run_dir: str, dtype: str = "fp32") -> Device:
    """``dev`` with its compute rate (``achievable``) fitted so that the plan of the helios-train run
    in ``run_dir`` takes that run's measured step time (``--compute-from``).

    The step time does not rise with the rate (the backward shrinks faster than the gradient
    reduction it hides can become exposed: compute plus exposure is the later of backward's end
    and the reduction's), so the rate is found by bisection.  Everything else -- memory-bound kernels,
    launches, links -- stays the device's (or ``--calibrate``'s), so a plan for another layout on
    the same machine differs from the measured run by what the model says the layout changes."""
    ref = read_measured_run(run_dir, dtype, flag="--compute-from")

    def plan(x: float):
        return step_time(ref.shape, ref.par, ref.settings, replace(dev, achievable=x), dtype)

    lo, hi = 1e-9, 1.0
    at_peak = plan(hi)
    if at_peak.step > ref.wall_s:
        rest = sum(v for k, v in at_peak.parts.items() if k != "compute")
        raise NoComputeRateFits(
            f"--compute-from {run_dir}: no compute rate up to the device's peak fits the run's "
            f"{1e3 * ref.wall_s:.1f} ms step (the plan's other parts -- launches, memory-bound kernels, "
            f"links, optimizer -- take {1e3 * rest:.1f} ms of it): a run too short to fit, or of another --gpu")
    for _ in range(200):  # geometric bisection: the rate may be any power of ten below peak
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if plan(mid).step > ref.wall_s else (lo, mid)
        if hi / lo < 1 + 1e-9:
            break
    rate = hi * dev.peak_for(dtype)
    run_id = ref.data["run"].get("run_id")
    return replace(dev, achievable=hi, achievable_source=(
        f"fitted to run {run_id} in {run_dir}: {rate / 1e9:.1f} GFLOP/s makes its planned step its measured "
        f"{1e3 * ref.wall_s:.1f} ms"), sources={**dev.sources, "compute": f"fitted, {run_dir}"})


def calibrate(run_dir: str, dev: Device, dtype: str = "fp32") -> dict:
    """Planned vs measured for the latest run in ``run_dir``."""
    ref = read_measured_run(run_dir, dtype)
    data, cfg, shape, par, st = ref.data, ref.cfg, ref.shape, ref.par, ref.settings
    t = step_time(shape, par, st, dev, dtype)
    mem = memory_per_rank(shape, par, st, dev)
    tps = statistics.median(s["tokens_per_s"] for s in ref.steady if s.get("tokens_per_s"))
    mfus = [s["mfu"] for s in ref.steady if s.get("mfu") is not None]
    pool = (cfg.get("memory") or {}).get("weights_pool_in_use")
    rows = [
        ("step time (s)", t.step, ref.wall_s),
        ("tokens/s", t.tokens_per_s, tps),
        ("MFU", t.mfu, statistics.median(mfus) if mfus else None),
        ("model states (bytes)", mem.states, pool),
    ]
    ops = [o for o in data.get("ops", []) if "matmul" in o["name"].lower() and o["device_ns"] > 0]
    if ops:
        rate = sum(o["flops"] for o in ops) / (sum(o["device_ns"] for o in ops) / 1e9)
        rows.append(("matmul FLOP/s", dev.achievable * dev.peak_for(dtype), rate))
    run = data["run"]
    out = {"run_dir": str(run_dir), "run_id": run["run_id"], "device": run.get("device"), "steps": ref.steps,
           "steady_steps": len(ref.steady), "shape": shape.to_dict(), "parallel": par.to_dict(),
           "planned_parts_s": dict(t.parts), "compute_source": dev.achievable_source,
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
