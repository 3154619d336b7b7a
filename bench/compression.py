"""Gradient compression for data parallel: bytes per step, step time and loss of each hook.

The tiny GPT trains on 2 ranks, one thread per rank, for ``--steps`` steps (300 by
default), once per configuration, in one run of this script:

* Helios (helios-run + helios-train ``--grad-compression SPEC``) over the tcp backend, so
  the bytes it counts are bytes on the wire: ``none``, ``bf16``, ``onebit``,
  ``topk:0.01`` and ``powersgd:rank=4,start=S`` (``fp16`` on request);
* the peer, PyTorch DDP on gloo with its built-in comm hooks: none (the reducer's own
  all-reduce), ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4, the same S
  uncompressed warm-up steps).

Both sides start from the same initial weights (Helios' GPT initialisation with
helios-train's seed), draw the same batches from helios.data (rank r takes its contiguous
slice of every global batch), use helios-train's AdamW settings, cosine learning rate and
gradient clipping, and measure the validation loss at the end on helios-train's
validation batches.

    python bench/compression.py [--steps 300] [--hooks none,powersgd,torch-powersgd] [--skip-torch]
                                [--powersgd-start 10] [--out-svg bench/compression_loss.svg] [--work-dir DIR]
                                [--config tiny] [--smoke]

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): the nano config, 4 steps, the
configurations ``none,powersgd,torch-powersgd`` with PowerSGD from step 2 (PyTorch's hook wants
more than 1 warm-up step), the first step left out of the medians, and the plot into the work
folder (not over bench/compression_loss.svg); every line as below (the summary's peer fields
need ``torch-none`` too), its figures meaningless.

Each configuration's wall time goes to stderr as it finishes; at the end come JSON lines,
one per configuration (``bench: "compression"``):

* ``side``: ``helios`` or ``peer`` (torch_ddp_gloo); ``hook``: the configuration's name and
  ``spec``: the --grad-compression value or the PyTorch hook;
* ``warmup_steps``: the hook's uncompressed first steps; the per-step figures below are
  medians over rank 0's steps after ``max(warmup_steps, --skip)`` (null when there are
  none: onebit's default warm-up is 20 steps);
* ``wire_bytes_per_step``: bytes rank 0 sent to its peer in a step.  Helios: measured by
  its comm layer on tcp (every collective of the step, the per-step loss agreement
  included).  Peer: computed, ``payload x 2(n-1)/n`` for all-reduce (a ring's bytes) and
  ``payload x (n-1)`` for all-gather (``wire_bytes_source`` says so);
* ``payload_bytes_per_step``: the summed operand sizes of rank 0's collectives in a step.
  Peer: counted by wrapping ``torch.distributed.all_reduce`` / ``all_gather`` (what the
  hooks call; an all-gather counts its input); with no hook, the reducer's gradient
  buckets (every parameter's gradient);
* ``bytes_share``: ``wire_bytes_per_step`` over the same side's uncompressed run's;
* ``step_ms``: median wall time of a step on rank 0; ``tok_per_s``: the global batch's
  tokens (16 x 64) over it;
* ``final_train_loss`` (the last step's, mean over ranks), ``final_val_loss`` (8
  validation batches at the end), ``val_gap_pct``: ``final_val_loss`` against the same
  side's uncompressed run, in %.

Then one ``compression_summary`` line: PowerSGD's bytes as a share of uncompressed and
its validation-loss gap in %, for Helios and for the peer, against the issue's target
(<= 10 % of the bytes, within 3 % of the loss).  Each configuration's training loss (a
running mean over ``--smooth`` steps) is drawn into ``--out-svg``.

The PyTorch ranks are this file run with ``--torch-rank R`` (started by the script); their GPT is
bench/torch_twin.py's, from Helios' initial weights.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from xml.sax.saxutils import escape

from data_parallel import BIN, HERE, ROOT, _env
from torch_twin import gpt_config, helios_weights, loss_module, torch_loss_fn

WORLD = 2
CONFIG = "tiny"  # helios-train's config; --config (--smoke: nano) sets it
SEED = 1337  # helios-train's default --seed
EVAL_BATCHES = 8  # helios-train's default --eval-batches

# Configuration name -> Helios --grad-compression spec ("{start}": --powersgd-start).
HELIOS_HOOKS = {"none": "none", "bf16": "bf16", "fp16": "fp16", "onebit": "onebit", "topk": "topk:0.01",
                "powersgd": "powersgd:rank=4,start={start}"}
# Configuration name -> PyTorch DDP comm hook.
TORCH_HOOKS = {"torch-none": "none (the reducer's all-reduce)", "torch-fp16": "default_hooks.fp16_compress_hook",
               "torch-powersgd": "powerSGD_hook.powerSGD_hook(matrix_approximation_rank=4, start_powerSGD_iter={start})"}
DEFAULT_HOOKS = "none,bf16,onebit,topk,powersgd,torch-none,torch-fp16,torch-powersgd"
SMOKE_HOOKS = "none,powersgd,torch-powersgd"


# ------------------------------------------------------------------------------------ Helios
def helios_spec(name: str, start: int) -> str:
    """The --grad-compression value of configuration ``name`` (a table entry, or a spec itself)."""
    return HELIOS_HOOKS.get(name, name).format(start=start)


def helios_warmup(spec: str) -> int:
    """How many uncompressed steps the hook of ``spec`` runs first (0 for none / fp16 / bf16 / topk)."""
    from helios.schedule.compression import parse_spec

    hook = parse_spec(spec)
    return int(getattr(hook, "start_iter", getattr(hook, "warmup", 0)) or 0)


def helios_train(spec: str, steps: int, out: str) -> dict:
    """Train the tiny GPT with helios-train on 2 ranks over tcp; returns rank 0's JSON summary."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", str(WORLD), "-m", "helios.train", "--config", CONFIG,
           "--steps", str(steps), "--no-progress", "--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "1",
           "--out", out, "--grad-compression", spec]
    env = _env()
    env["HELIOS_COMM_BACKEND"] = "tcp"  # a real socket: the bytes counted are bytes on the wire
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"helios run failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    last = r.stdout.strip().splitlines()[-1]
    return json.loads(last[last.index("{"):])  # helios-run prefixes rank 0's lines with "[rank 0] "


def helios_steps(run_dir: str) -> list[dict]:
    """Rank 0's rows of ``step_timing`` in ``run_dir/run.db``: step, wall_ns, loss, comm_bytes, comm_payload_bytes."""
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        rows = con.execute("SELECT step, wall_ns, loss, comm_bytes, comm_payload_bytes FROM step_timing "
                           "WHERE rank = 0 ORDER BY step").fetchall()
    finally:
        con.close()
    return [dict(zip(("step", "wall_ns", "loss", "wire", "payload"), r)) for r in rows]


def run_helios(name: str, a, work: str) -> dict:
    """One Helios configuration: its JSON line's fields and its loss curve (``curve``)."""
    spec = helios_spec(name, a.powersgd_start)
    warm = helios_warmup(spec)
    out = os.path.join(work, f"helios-{name.replace(':', '_').replace('=', '')}")
    summary = helios_train(spec, a.steps, out)
    rows = helios_steps(out)
    after = [r for r in rows if r["step"] > max(warm, a.skip)]  # run.db counts steps from 1
    return {"side": "helios", "hook": name, "spec": spec, "warmup_steps": warm,
            "wire_bytes_per_step": _int(_median(r["wire"] for r in after)),
            "wire_bytes_source": "measured (helios.comm over tcp)",
            "payload_bytes_per_step": _int(_median(r["payload"] for r in after)),
            **_step_time(_median(r["wall_ns"] for r in after)),
            "final_train_loss": summary["final_train_loss"], "final_val_loss": summary["final_val_loss"],
            "curve": [r["loss"] for r in rows]}


# ----------------------------------------------------------------------------------- PyTorch
def torch_rank(rank: int, port: int, hook: str, steps: int, start: int, init_path: str) -> None:
    """One rank of PyTorch DDP (gloo) training the tiny GPT as helios-train does, with comm hook ``hook``.

    Rank 0 prints one JSON line: per-step losses (mean over ranks), wall times, operand
    bytes and computed ring bytes of the collectives the hook issued, and the final
    validation loss.
    """
    import numpy as np
    import torch
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from helios.data import BatchLoader, prepare_dataset
    from helios.optim import cosine_lr
    from helios.train import CONFIGS

    torch.set_num_threads(1)
    c = CONFIGS[CONFIG]
    T, bs, lr_max = c["block_size"], c["batch_size"], c["lr"]
    per = bs // WORLD
    warmup = max(1, steps // 20)  # helios-train's default --warmup
    ds = prepare_dataset(None, "byte")
    cfg = gpt_config(CONFIG, ds.tokenizer.vocab_size)
    loader = BatchLoader(ds.train, bs, T, seed=SEED)
    val_loader = BatchLoader(ds.val, bs, T, seed=SEED + 1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                             timeout=datetime.timedelta(minutes=5))  # a lost peer fails the run instead of hanging it

    init = np.load(init_path)  # Helios' initial parameters (the file keeps Helios' order; the module sorts them)
    # The GPT's training loss over a per-rank batch (bench/torch_twin.py), parameters under Helios' names.
    module = loss_module(cfg, per, T, {n: init[n] for n in init.files})
    # 25 MiB given explicitly (helios-train's --bucket-cap-mb default) also lifts DDP's 1 MiB cap on its
    # first bucket: the tiny GPT's gradients make one bucket.  With several, powerSGD_hook's chained
    # all-reduces (issued from future callbacks) of two buckets can reach gloo in different orders on
    # the two ranks: a collective mismatch that aborts the run now and then.
    model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25)
    if hook == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=start)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook != "torch-none":
        raise SystemExit(f"unknown PyTorch hook {hook!r}; expected one of {', '.join(TORCH_HOOKS)}")
    params = list(module.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr_max, betas=(0.9, 0.95))
    counter = _CollectiveCounter(tdist, WORLD)
    if hook == "torch-none":  # the C++ reducer all-reduces every gradient once, out of Python's sight
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        counter.fixed(grad_bytes, grad_bytes * 2 * (WORLD - 1) / WORLD)

    losses, walls, payload, wire = [], [], [], []
    for step in range(steps):
        t0 = time.perf_counter_ns()
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, lr_max, warmup, steps)
        x, y = loader.next_batch()
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]  # DistRun.shard: a contiguous slice
        counter.reset()
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        walls.append(time.perf_counter_ns() - t0)
        payload.append(counter.payload)
        wire.append(counter.wire)
    counter.restore()

    mean_losses = torch.tensor(losses, dtype=torch.float64)
    tdist.all_reduce(mean_losses)
    mean_losses /= WORLD
    if rank == 0:
        evaluate = torch_loss_fn(cfg, bs, T, module.params)
        with torch.no_grad():
            val = [evaluate(torch.from_numpy(vx), torch.from_numpy(vy)).item()
                   for vx, vy in val_loader.iter_eval(EVAL_BATCHES)]
        print(json.dumps({"losses": mean_losses.tolist(), "wall_ns": walls, "payload": payload, "wire": wire,
                          "final_val_loss": sum(val) / len(val)}), flush=True)
    del model  # DDP's reducer (and a hook's state) go before the process group they use
    tdist.barrier()
    tdist.destroy_process_group()


class _CollectiveCounter:
    """Counts the operand bytes of the torch.distributed collectives Python code issues.

    Replaces ``all_reduce``, ``all_gather`` and ``all_gather_into_tensor`` on the
    ``torch.distributed`` module (the hooks look them up there at each call) with
    wrappers that add the operand's bytes to ``payload`` and a ring's bytes sent per rank
    to ``wire``: ``payload x 2(n-1)/n`` for all-reduce, ``payload x (n-1)`` for all-gather.
    """

    def __init__(self, tdist, world: int) -> None:
        self.tdist, self.payload, self.wire = tdist, 0, 0.0
        self._fixed = None
        self._saved = {}
        ring = {"all_reduce": (0, "tensor", 2 * (world - 1) / world), "all_gather": (1, "tensor", world - 1),
                "all_gather_into_tensor": (1, "input_tensor", world - 1)}
        for name, (pos, kw, factor) in ring.items():
            fn = self._saved[name] = getattr(tdist, name)
            setattr(tdist, name, self._wrap(fn, pos, kw, factor))

    def _wrap(self, fn, pos: int, kw: str, factor: float):
        """``fn`` counting its operand (positional ``pos`` or keyword ``kw``) before it runs."""

        def counted(*args, **kwargs):
            t = args[pos] if len(args) > pos else kwargs[kw]
            n = t.numel() * t.element_size()
            self.payload += n
            self.wire += n * factor
            return fn(*args, **kwargs)

        return counted

    def fixed(self, payload: int, wire: float) -> None:
        """Count ``payload`` / ``wire`` bytes at every step instead (collectives Python does not see)."""
        self._fixed = (payload, wire)

    def reset(self) -> None:
        """Start a step's count."""
        self.payload, self.wire = self._fixed or (0, 0.0)

    def restore(self) -> None:
        """Put the original functions back (later collectives are not counted)."""
        for name, fn in self._saved.items():
            setattr(self.tdist, name, fn)


def run_torch(name: str, a, work: str) -> dict:
    """One PyTorch configuration on 2 gloo ranks: its JSON line's fields and its loss curve (``curve``)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-rank", str(r), "--port", str(port),
                               "--hooks", name, "--steps", str(a.steps), "--powersgd-start", str(a.powersgd_start),
                               "--init", os.path.join(work, "init.npz"), "--config", CONFIG],
                              env=_env(), stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(WORLD)]
    try:
        outs = [p.communicate(timeout=300 + 5 * a.steps)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"PyTorch DDP ranks ({name}) did not finish in {300 + 5 * a.steps} s") from None
    if any(p.returncode for p in procs):
        raise SystemExit(f"PyTorch DDP rank failed ({name}): {outs}")
    res = json.loads(outs[0].strip().splitlines()[-1])
    warm = a.powersgd_start if name == "torch-powersgd" else 0
    after = slice(max(warm, a.skip), None)  # 0-based here: step i is the (i+1)-th
    return {"side": "peer", "peer": "torch_ddp_gloo", "hook": name, "spec": TORCH_HOOKS[name].format(start=a.powersgd_start),
            "warmup_steps": warm, "wire_bytes_per_step": _int(_median(res["wire"][after])),
            "wire_bytes_source": "computed: payload x 2(n-1)/n (ring all-reduce)",
            "payload_bytes_per_step": _int(_median(res["payload"][after])),
            **_step_time(_median(res["wall_ns"][after])),
            "final_train_loss": round(res["losses"][-1], 4), "final_val_loss": round(res["final_val_loss"], 4),
            "curve": res["losses"]}


def write_init(path: str) -> None:
    """Helios' initial GPT parameters (helios-train's seed), in its parameter order, to ``path`` (.npz).

    Also fills the token cache once, before the ranks of either side read it.
    """
    import numpy as np

    from helios.data import prepare_dataset

    ds = prepare_dataset(None, "byte")
    np.savez(path, **helios_weights(gpt_config(CONFIG, ds.tokenizer.vocab_size), SEED, manual_seed=True))


# -------------------------------------------------------------------------------------- plot
def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values (steps of 1, 2 or 5 x 10^k), the first <= lo and the last >= hi."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    count = math.ceil((hi - first) / step - 1e-9)
    return [round(first + i * step, 10) for i in range(count + 1)]


def svg_plot(series: list[dict], path: str, title: str, xlabel: str, ylabel: str, width: int = 860,
             height: int = 520) -> None:
    """Write a line chart as a standalone SVG file.

    ``series``: dicts with ``label``, ``y`` (values at x = 1, 2, ...), ``color`` and
    ``dash`` (an SVG stroke-dasharray, or None).  Axes with round ticks, a grid, and a
    legend in the upper right.
    """
    left, right, top, bottom = 70, 20, 40, 55
    pw, ph = width - left - right, height - top - bottom
    ys = [v for s in series for v in s["y"] if v is not None and math.isfinite(v)]
    xmax = max((len(s["y"]) for s in series), default=1)
    ylo, yhi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    yt = nice_ticks(ylo, yhi)
    ylo, yhi = yt[0], yt[-1]
    xt = nice_ticks(0, xmax)
    xhi = xt[-1]
    sx = lambda x: left + pw * x / xhi
    sy = lambda y: top + ph * (1 - (y - ylo) / ((yhi - ylo) or 1))
    fmt = lambda v: f"{v:g}"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for v in yt:
        y = sy(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    for v in xt:
        x = sx(v)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{fmt(v)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 14}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text transform="translate(18 {top + ph / 2}) rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>')
    for s in series:
        pts = " ".join(f"{sx(i + 1):.1f},{sy(v):.1f}" for i, v in enumerate(s["y"]) if v is not None and math.isfinite(v))
        dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke="{s["color"]}" stroke-width="1.6"{dash}/>')
    lw = 52 + 7 * max((len(s["label"]) for s in series), default=0)  # about 7 px a character at 12 px
    lx, ly = left + pw - lw - 4, top + 12
    out.append(f'<rect x="{lx - 8}" y="{ly - 10}" width="{lw}" height="{18 * len(series) + 6}" fill="white" '
               'fill-opacity="0.85" stroke="#ccc"/>')
    for i, s in enumerate(series):
        y = ly + 18 * i + 4
        dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
        out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 28}" y2="{y}" stroke="{s["color"]}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 36}" y="{y + 4}">{escape(s["label"])}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# One colour per method, shared by Helios (solid) and the peer (dashed); others take the spares.
COLORS = {"none": "#1f77b4", "bf16": "#d62728", "fp16": "#e377c2", "onebit": "#2ca02c", "topk": "#9467bd",
          "powersgd": "#ff7f0e"}
SPARE_COLORS = ["#8c564b", "#17becf", "#7f7f7f", "#bcbd22", "#000000"]
PEER_LABELS = {"torch-none": "PyTorch DDP, no hook", "torch-fp16": "PyTorch DDP fp16_compress_hook",
               "torch-powersgd": "PyTorch DDP powerSGD_hook (rank 4)"}


def plot_losses(results: list[dict], path: str, steps: int, smooth: int, start: int) -> None:
    """Every configuration's training-loss curve into one SVG: Helios solid, the peer dashed, one colour a method."""
    series, spare = [], iter(SPARE_COLORS * 4)
    for r in results:
        method = r["hook"].removeprefix("torch-").split(":")[0]
        color = COLORS[method] if method in COLORS and ":" not in r["hook"] else next(spare)
        label = f"Helios {r['spec']}" if r["side"] == "helios" else PEER_LABELS[r["hook"]]
        series.append({"label": f"{label}: val {r['final_val_loss']:.3f}", "y": running_mean(r["curve"], max(1, smooth)),
                       "color": color, "dash": "6 4" if r["side"] == "peer" else None})
    mean = f", running mean over {smooth} steps" if smooth > 1 else ""
    svg_plot(series, path, f"Tiny GPT on {WORLD} ranks: training loss by gradient compression "
             f"({steps} steps, PowerSGD from step {start})", "step", f"training loss (nats/token{mean})")


# ---------------------------------------------------------------------------------- summary
def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _int(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _step_time(wall_ns: float | None) -> dict:
    """``step_ms`` and ``tok_per_s`` (the global batch's tokens over it) of a median step time."""
    from helios.train import CONFIGS

    if wall_ns is None:
        return {"step_ms": None, "tok_per_s": None}
    tokens = CONFIGS[CONFIG]["batch_size"] * CONFIGS[CONFIG]["block_size"]
    return {"step_ms": round(wall_ns / 1e6, 2), "tok_per_s": round(tokens / (wall_ns / 1e9), 1)}


def relative_to_baseline(results: list[dict]) -> None:
    """Add ``bytes_share`` and ``val_gap_pct`` against each side's uncompressed run (when it ran)."""
    base = {r["side"]: r for r in results if r["hook"] in ("none", "torch-none")}
    for r in results:
        b = base.get(r["side"])
        if b is None:
            continue
        if r["wire_bytes_per_step"] is not None and b["wire_bytes_per_step"]:
            r["bytes_share"] = round(r["wire_bytes_per_step"] / b["wire_bytes_per_step"], 4)
        r["val_gap_pct"] = round(100 * (r["final_val_loss"] - b["final_val_loss"]) / b["final_val_loss"], 2)


def summary_line(results: list[dict], steps: int) -> dict:
    """PowerSGD against uncompressed on each side, and whether Helios meets the issue's target."""
    by = {r["hook"]: r for r in results}
    out = {"bench": "compression_summary", "config": CONFIG, "world": WORLD, "steps": steps,
           "target": "PowerSGD rank 4: <= 10 % of the uncompressed bytes, val loss within 3 %"}
    for side, name in (("helios", "powersgd"), ("peer", "torch-powersgd")):
        r = by.get(name)
        if r is None or "val_gap_pct" not in r:
            continue
        out[f"{side}_powersgd_bytes_share"] = r.get("bytes_share")
        out[f"{side}_powersgd_val_gap_pct"] = r["val_gap_pct"]
        if r.get("bytes_share") is not None:
            out[f"{side}_meets_target"] = r["bytes_share"] <= 0.10 and abs(r["val_gap_pct"]) <= 3.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps of each configuration (default 300; --smoke 4)")
    ap.add_argument("--hooks", default=None,
                    help=f"comma list of configurations to run (default {DEFAULT_HOOKS}; --smoke {SMOKE_HOOKS}); a Helios "
                         "entry may also be a --grad-compression spec without commas, e.g. onebit:warmup=5")
    ap.add_argument("--config", default=None, help="helios-train config (default tiny; --smoke nano)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run (see the docstring)")
    ap.add_argument("--skip-torch", action="store_true", help="run only the Helios configurations")
    ap.add_argument("--powersgd-start", type=int, default=None,
                    help="uncompressed warm-up steps of PowerSGD (both sides; default 10, --smoke 2)")
    ap.add_argument("--skip", type=int, default=None, help="first steps left out of the per-step medians (default 3; --smoke 1)")
    ap.add_argument("--smooth", type=int, default=10, help="running-mean window of the plotted losses (1: raw)")
    ap.add_argument("--out-svg", default=None,
                    help="where the loss plot goes (default bench/compression_loss.svg; --smoke: the work folder)")
    ap.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--torch-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    global CONFIG
    CONFIG = a.config or ("nano" if a.smoke else CONFIG)
    a.steps = a.steps if a.steps is not None else (4 if a.smoke else 300)
    a.hooks = a.hooks or (SMOKE_HOOKS if a.smoke else DEFAULT_HOOKS)
    a.powersgd_start = a.powersgd_start if a.powersgd_start is not None else (2 if a.smoke else 10)
    a.skip = a.skip if a.skip is not None else (1 if a.smoke else 3)
    if a.torch_rank is not None:
        torch_rank(a.torch_rank, a.port, a.hooks, a.steps, a.powersgd_start, a.init)
        return
    names = [h.strip() for h in a.hooks.split(",") if h.strip()]
    if a.skip_torch:
        names = [h for h in names if not h.startswith("torch-")]
    for h in names:
        if h.startswith("torch-") and h not in TORCH_HOOKS:
            ap.error(f"--hooks: unknown PyTorch configuration {h!r}; expected one of {', '.join(TORCH_HOOKS)}")
        if not h.startswith("torch-"):
            try:
                helios_warmup(helios_spec(h, a.powersgd_start))
            except ValueError as e:
                ap.error(f"--hooks {h}: {e}")
    if a.steps < 1:
        ap.error(f"--steps must be at least 1, got {a.steps}")

    with tempfile.TemporaryDirectory() as tmp:
        work = a.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        write_init(os.path.join(work, "init.npz"))
        results = []
        for h in names:
            t0 = time.monotonic()
            results.append(run_torch(h, a, work) if h.startswith("torch-") else run_helios(h, a, work))
            print(f"{h}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        relative_to_baseline(results)
        for r in results:
            print(json.dumps({"bench": "compression", "config": CONFIG, "world": WORLD, "steps": a.steps,
                              **{k: v for k, v in r.items() if k != "curve"}}), flush=True)
        print(json.dumps(summary_line(results, a.steps)), flush=True)
        out_svg = a.out_svg if a.out_svg is not None else (os.path.join(work, "compression_loss.svg") if a.smoke
                                                            else os.path.join(HERE, "compression_loss.svg"))
        if results and out_svg:  # (a smoke run's plot goes with its temporary work folder)
            plot_losses(results, out_svg, a.steps, a.smooth, a.powersgd_start)
            inside = os.path.abspath(out_svg).startswith(ROOT + os.sep)
            print(json.dumps({"bench": "compression_plot", "svg": os.path.relpath(out_svg, ROOT) if inside else out_svg}),
                  flush=True)


if __name__ == "__main__":
    main()
