"""Data-parallel training: Helios (helios-run + helios-train) against PyTorch DDP on gloo.

Both train the same GPT shape with the same per-rank batch, one thread per rank
(LP_NUM_THREADS=1 for lavapipe, torch.set_num_threads(1)), on 1 and on 2 ranks, in one
run of this script.  Printed as JSON lines:

* ``scaling``: tokens/s of each at 1 and 2 ranks, and scaling efficiency
  = tokens/s at 2 ranks / (2 x tokens/s at 1 rank);
* ``overlap``: the share of Helios' gradient all-reduce time that ran while backward was
  still computing (from the Chrome trace of a profiled window: collective intervals on
  the collectives track against the backward phase minus its end-of-backward wait);
* ``zero``: step time of each ZeRO stage over plain data parallel, and bytes per rank.

    python bench/data_parallel.py [--config tiny] [--steps 30] [--warmup 5] [--zero 1,2,3] [--smoke]

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): the nano config, 4 steps (the
first left out of the medians), one validation batch, and the scaling line's 2-rank run also
profiled and checkpointing every 2 steps, so it gives the overlap, checkpoint and ZeRO stage 0
lines too; no ZeRO stage runs unless ``--zero`` names some.  Every line as above, its figures
meaningless.

The PyTorch ranks are this file run with ``--torch-rank R``, their GPT bench/torch_twin.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)


def _env(threads: int = 1) -> dict:
    e = dict(os.environ)
    e.update(LP_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HELIOS_LAUNCHER", "HELIOS_JOB_ID"):
        e.pop(k, None)
    return e


# ------------------------------------------------------------------------------------ Helios
def helios_run(world: int, per_rank_batch: int, config: str, steps: int, out: str, *extra: str) -> str:
    """Train with helios-train on ``world`` ranks; returns the run folder."""
    args = ["--config", config, "--steps", str(steps), "--batch-size", str(per_rank_batch * world), "--no-progress",
            "--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "1", "--out", out, *extra]
    if world == 1:
        cmd = [os.path.join(BIN, "helios-train"), *args]
    else:
        cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", str(world), "-m", "helios.train", *args]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"helios run failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return out


def step_seconds(run_dir: str, warmup: int) -> float:
    """Median wall time of rank 0's steps after ``warmup``, from run.db."""
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        walls = [w for (w,) in con.execute("SELECT wall_ns FROM step_timing WHERE rank = 0 AND step > ? ORDER BY step",
                                           (warmup,))]
    finally:
        con.close()
    return statistics.median(walls) / 1e9


def checkpoint_cost(run_dir: str, warmup: int) -> dict:
    """Rank 0's step time on checkpoint steps against the others, and the checkpoint phase
    (the snapshot: the write happens on a background thread)."""
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        rows = con.execute("SELECT wall_ns, checkpoint_ns FROM step_timing WHERE rank = 0 AND step > ? ORDER BY step",
                           (warmup,)).fetchall()
    finally:
        con.close()
    with_ck = [(w, c) for w, c in rows if c > 0]
    plain = [w for w, c in rows if c == 0]
    if not with_ck or not plain:
        return {}
    base = statistics.median(plain)
    return {"checkpoint_steps": len(with_ck), "step_ms": round(base / 1e6, 2),
            "checkpoint_step_ms": round(statistics.median(w for w, _ in with_ck) / 1e6, 2),
            "snapshot_ms": round(statistics.median(c for _, c in with_ck) / 1e6, 2),
            "extra_over_snapshot_ms": round((statistics.median(w for w, _ in with_ck) - base
                                            - statistics.median(c for _, c in with_ck)) / 1e6, 2)}


def overlap_share(trace_path: str) -> dict:
    """Share of rank 0's gradient all-reduce time that ran while backward was still computing.

    From a trace profiled with ``--profile-host-only`` (device timestamps would serialise
    lavapipe's queue).  A gradient all-reduce is an async all_reduce on the collectives
    track; its interval starts once the device has produced its bucket (the trace reports
    that wait apart as ``device_wait_us``).  Backward computes from the start of its phase
    until its last gradient exists: the latest start of its step's gradient all-reduces
    (or the host's end of recording, if later).  What lies after that is exposed.
    """
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    rank0 = [e for e in events if e.get("ph") == "X" and int(e.get("pid", 0)) < 100]
    backward = sorted((e for e in rank0 if e.get("cat") == "phase" and e["name"] == "backward"), key=lambda e: e["ts"])
    waits = [e for e in rank0 if e.get("cat") == "phase" and e["name"] == "comm"]
    reduces = [e for e in rank0 if e.get("cat") == "comm" and e["name"] == "all_reduce" and e["args"].get("async")]
    total = hidden = 0.0
    counted = 0
    for i, b in enumerate(backward):
        b0 = b["ts"]
        nxt = backward[i + 1]["ts"] if i + 1 < len(backward) else float("inf")
        mine = [e for e in reduces if b0 <= e["ts"] < nxt]
        if not mine:
            continue
        inner = [w for w in waits if b0 <= w["ts"] <= b0 + b["dur"]]
        recorded = inner[0]["ts"] if inner else b0 + b["dur"]
        computing_end = max(recorded, max(e["ts"] for e in mine))
        for e in mine:
            a0, a1 = e["ts"], e["ts"] + e["dur"]
            total += e["dur"]
            hidden += max(0.0, min(a1, computing_end) - a0)
            counted += 1
    return {"all_reduces": counted, "all_reduce_ms": round(total / 1e3, 2), "hidden_ms": round(hidden / 1e3, 2),
            "hidden_share": round(hidden / total, 3) if total else None}


# ----------------------------------------------------------------------------------- PyTorch
def torch_rank(rank: int, world: int, port: int, config: str, per_rank_batch: int, steps: int, warmup: int) -> None:
    """One rank of PyTorch DDP (gloo) on the same GPT; rank 0 prints its seconds per step."""
    import time

    import numpy as np
    import torch
    import torch.distributed as tdist

    from torch_twin import gpt_config, loss_module

    torch.set_num_threads(1)
    cfg = gpt_config(config)
    T = cfg.block_size
    if world > 1:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    # The same GPT as Helios' (bench/torch_twin.py), its weights drawn here: only the step time is measured.
    module = loss_module(cfg, per_rank_batch, T, {n: torch.randn(*s, generator=gen) * 0.02
                                                  for n, s in _gpt_shapes(cfg).items()})
    model = torch.nn.parallel.DistributedDataParallel(module) if world > 1 else module
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    rng = np.random.default_rng(rank)
    batches = [(torch.tensor(rng.integers(0, 256, (per_rank_batch, T))), torch.tensor(rng.integers(0, 256, (per_rank_batch, T))))
               for _ in range(steps)]
    times = []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        step(x, y)
        if world > 1:
            tdist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"torch_step_s": statistics.median(times)}))
    if world > 1:
        tdist.destroy_process_group()


def _gpt_shapes(cfg) -> dict:
    from helios.nn import GPT

    return {n: p.shape for n, p in GPT(cfg, seed=0).named_parameters()}


def torch_ddp(world: int, config: str, per_rank_batch: int, steps: int, warmup: int) -> float:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, __file__, "--torch-rank", str(r), "--world", str(world), "--port", str(port),
                               "--config", config, "--per-rank-batch", str(per_rank_batch), "--steps", str(steps),
                               "--warmup", str(warmup)], env=_env(), stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"torch DDP rank failed: {outs}")
    return json.loads(outs[0].strip().splitlines()[-1])["torch_step_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="helios-train config (default tiny; --smoke nano)")
    ap.add_argument("--steps", type=int, default=None, help="steps of each run (default 30; --smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps left out of the medians (default 5; --smoke 1)")
    ap.add_argument("--per-rank-batch", type=int, default=None)
    ap.add_argument("--zero", default=None, help="ZeRO stages to time against plain DP ('' for none; default 1,2,3, "
                                                 "--smoke none)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: nano, 4 steps, 3 runs (see the docstring)")
    ap.add_argument("--torch-rank", type=int, default=None)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    a.config = a.config or ("nano" if a.smoke else "tiny")
    a.steps = a.steps if a.steps is not None else (4 if a.smoke else 30)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 5)
    a.zero = a.zero if a.zero is not None else ("" if a.smoke else "1,2,3")
    from helios.train import CONFIGS

    c = CONFIGS[a.config]
    per = a.per_rank_batch or c["batch_size"]
    if a.torch_rank is not None:
        torch_rank(a.torch_rank, a.world, a.port, a.config, per, a.steps, a.warmup)
        return
    T = c["block_size"]
    # A smoke run evaluates on one batch, and its 2-rank run of the scaling line is also the traced
    # and the checkpointing run (and ZeRO's stage 0): every line from 2 helios-train runs.
    quick = ("--eval-batches", "1") if a.smoke else ()
    prof_from = max(a.warmup, a.steps - 5)
    ck_every = "2" if a.smoke else "5"
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        traced = ("--profile-steps", f"{prof_from}:{a.steps}", "--trace", trace, "--profile-host-only")
        res, runs = {}, {}
        for world in (1, 2):
            also = (*traced, "--ckpt-every", ck_every) if a.smoke and world == 2 else ()
            run = runs[world] = helios_run(world, per, a.config, a.steps, os.path.join(tmp, f"h{world}"), *quick, *also)
            res[f"helios_{world}"] = per * T * world / step_seconds(run, a.warmup)
            res[f"torch_{world}"] = per * T * world / torch_ddp(world, a.config, per, a.steps, a.warmup)
        h_eff = res["helios_2"] / (2 * res["helios_1"])
        t_eff = res["torch_2"] / (2 * res["torch_1"])
        print(json.dumps({"bench": "data_parallel_scaling", "config": a.config, "per_rank_batch": per,
                          "helios_tok_s_1": round(res["helios_1"], 1), "helios_tok_s_2": round(res["helios_2"], 1),
                          "peer": "torch_ddp_gloo", "peer_tok_s_1": round(res["torch_1"], 1),
                          "peer_tok_s_2": round(res["torch_2"], 1), "helios_efficiency": round(h_eff, 3),
                          "peer_efficiency": round(t_eff, 3), "ratio": round(h_eff / t_eff, 3)}), flush=True)

        if not a.smoke:
            helios_run(2, per, a.config, a.steps, os.path.join(tmp, "traced"), *traced)
        print(json.dumps({"bench": "data_parallel_overlap", "config": a.config, "world": 2, **overlap_share(trace)}),
              flush=True)

        ck = runs[2] if a.smoke else helios_run(2, per, a.config, a.steps, os.path.join(tmp, "ckpt"), "--ckpt-every", ck_every)
        print(json.dumps({"bench": "checkpoint_step", "config": a.config, "world": 2, **checkpoint_cost(ck, a.warmup)}),
              flush=True)

        stages = [int(s) for s in a.zero.split(",") if s.strip()]
        if stages or a.smoke:
            z0 = runs[2] if a.smoke else helios_run(2, per, a.config, a.steps, os.path.join(tmp, "z0"))
            base = step_seconds(z0, a.warmup)
            print(json.dumps({"bench": "zero", "config": a.config, "world": 2, "stage": 0, "step_ms": round(base * 1e3, 2),
                              **_zero_bytes(z0)}), flush=True)
            for st in stages:
                run = helios_run(2, per, a.config, a.steps, os.path.join(tmp, f"z{st}"), *quick, "--zero", str(st))
                t = step_seconds(run, a.warmup)
                print(json.dumps({"bench": "zero", "config": a.config, "world": 2, "stage": st,
                                  "step_ms": round(t * 1e3, 2), "dp_step_ms": round(base * 1e3, 2),
                                  "ratio": round(t / base, 3), **_zero_bytes(run)}), flush=True)


def _zero_bytes(run_dir: str) -> dict:
    """Bytes per rank the run recorded (runs.config_json 'memory'), if it did."""
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        cfg = json.loads(con.execute("SELECT config_json FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()[0])
    finally:
        con.close()
    return {"bytes_per_rank": cfg.get("memory")}


if __name__ == "__main__":
    main()
