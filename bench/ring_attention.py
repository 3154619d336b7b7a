"""Ring attention on W ranks against one device and PyTorch CPU, in the same run.

    python bench/ring_attention.py [--T 8192] [--world 2] [--layout zigzag] [--batch 1] [--heads 2]
                                   [--head-dim 32] [--rounds 3] [--no-causal] [--threads 1 2] [--smoke]

The same float32 q, k, v and upstream gradient ([batch, heads, T, head_dim]) through:

* ``ring``: ``helios.schedule.ring_attention`` on W ranks of this host (one process each,
  ``LP_NUM_THREADS=1`` per rank, shared-memory transport), each rank holding T/W tokens
  (``ring_shard`` of ``--layout``);
* ``single``: ``helios.nn.functional.scaled_dot_product_attention`` (the flash kernel) on
  the whole sequence in one process, with ``LP_NUM_THREADS`` = each of ``--threads``;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the CPU on the whole
  sequence (PyTorch has no ring attention on the CPU), ``torch.set_num_threads`` = each of
  ``--threads``.

Time: a forward + backward, and a forward alone (no autograd); after a warm-up call, each of
``--rounds`` rounds times one call, the median is reported.  The ranks start each round
together (a barrier) and a round lasts until the slowest rank has read back its dQ.  Every
Helios call ends with ``helios.synchronize()`` and a read-back.

CPU: the process CPU seconds of a forward + backward (lavapipe's threads included; median of
the rounds), per rank and for the single device: on a loaded machine, where wall time says
little, the ranks' sum over the single device's is the ring's extra work.

Memory: the peak of Helios' activation pool above the inputs over the first forward +
backward of a fresh process (the pool's peak only grows), per rank for the ring; PyTorch's,
the running total of its CPU allocator's events under ``torch.profiler``.  And what a
forward keeps for its backward (the pool's in-use growth over a forward after the timed
rounds: the activation memory a model holds per attention layer), per rank and for the
single device.  The pool hands out
blocks in size classes, so its figures are what it reserved for the tensors, not their exact
sizes.

One JSON line per measurement ({"bench": "ring_attention", "impl", "threads" or "world", "T",
"fwd_bwd_ms", "fwd_ms", "peak_mib", ...}) and a summary line with the ring's speedup over
each peer (the peer's time over the ring's: > 1, the ring is faster) and each rank's peak
over the single device's.

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): T = 256 on 2 ranks, one timed
round, the single device and the peer on 1 thread only; the same lines, their figures
meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)


def _inputs(B: int, H: int, T: int, D: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4)]  # q, k, v, upstream


def _helios_round(fn, q, g, backward: bool) -> float:
    """Seconds of one call of ``fn`` (forward, and backward with ``g``), read-back included;
    the process's CPU seconds over the call (lavapipe's threads included) go to ``_CPU``."""
    import helios as hl

    c0, t0 = time.process_time(), time.perf_counter()
    if backward:
        fn().backward(g)
        q.grad[0, 0, 0, 0].item()
        q.grad = None
    else:
        with hl.no_grad():
            o = fn()
        hl.synchronize()
        o[0, 0, 0, 0].item()
    t = time.perf_counter() - t0
    _CPU.append(time.process_time() - c0)
    return t


_CPU: list = []


def _peak_of_first_call(fn, q, g) -> float:
    """MiB the activation pool peaked at above its use before one forward + backward."""
    import helios as hl
    from helios.runtime import get_runtime

    pool = get_runtime().dev
    hl.synchronize()
    base = pool.pool_stats()["activations"]["in_use_bytes"]
    _helios_round(fn, q, g, True)
    return (pool.pool_stats()["activations"]["peak_in_use_bytes"] - base) / 2**20


def _kept_mib(fn, q, g) -> float:
    """MiB the activation pool holds more after a forward than before it (what the forward
    keeps for its backward), measured after the timed rounds, then the backward is run."""
    import helios as hl
    from helios.runtime import get_runtime

    pool = get_runtime().dev
    hl.synchronize()
    before = pool.pool_stats()["activations"]["in_use_bytes"]
    o = fn()
    hl.synchronize()
    kept = pool.pool_stats()["activations"]["in_use_bytes"] - before
    o.backward(g)
    q.grad = None
    return kept / 2**20


def _rank(a) -> dict:
    """One rank of the ring (started by the main process with RANK/WORLD_SIZE set)."""
    import helios as hl
    import helios.comm as dist
    from helios.schedule.ring_attention import ring_attention, ring_shard

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, g = (hl.tensor(ring_shard(x, a.layout, rank, world), requires_grad=i < 3)
                  for i, x in enumerate(_inputs(a.batch, a.heads, a.T, a.head_dim)))

    def fn():
        return ring_attention(q, k, v, layout=a.layout, is_causal=a.causal)

    peak = _peak_of_first_call(fn, q, g)
    times: dict = {"fwd_bwd": [], "fwd": [], "fwd_bwd_cpu": []}
    for r in range(a.rounds + 1):
        for part in ("fwd_bwd", "fwd"):
            dist.barrier()
            t = _helios_round(fn, q, g, part == "fwd_bwd")
            if r:  # round 0 is the warm-up
                times[part].append(t)
                if part == "fwd_bwd":
                    times["fwd_bwd_cpu"].append(_CPU[-1])
    # In a steady state: the communicator's thread keeps its last operation's buffer until the
    # next operation, so a first call would count the block it leaves behind.
    kept = _kept_mib(fn, q, g)
    dist.destroy_process_group()
    return {"rank": rank, "peak_mib": peak, "kept_mib": kept, **times}


def _single(a) -> dict:
    """The flash kernel on the whole sequence in this process."""
    import helios as hl
    import helios.nn.functional as NF

    q, k, v, g = (hl.tensor(x, requires_grad=i < 3) for i, x in enumerate(_inputs(a.batch, a.heads, a.T, a.head_dim)))

    def fn():
        return NF.scaled_dot_product_attention(q, k, v, is_causal=a.causal)

    peak = _peak_of_first_call(fn, q, g)
    times = {"fwd_bwd": [], "fwd": [], "fwd_bwd_cpu": []}
    for r in range(a.rounds + 1):
        for part in ("fwd_bwd", "fwd"):
            t = _helios_round(fn, q, g, part == "fwd_bwd")
            if r:
                times[part].append(t)
                if part == "fwd_bwd":
                    times["fwd_bwd_cpu"].append(_CPU[-1])
    return {"peak_mib": peak, "kept_mib": _kept_mib(fn, q, g), **times}


def _torch(a, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    arrays = _inputs(a.batch, a.heads, a.T, a.head_dim)
    q, k, v = (torch.tensor(x, requires_grad=True) for x in arrays[:3])
    g = torch.tensor(arrays[3])

    def fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=a.causal).backward(g)
        q.grad = k.grad = v.grad = None

    def fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=a.causal)

    times = {"fwd_bwd": [], "fwd": []}
    for r in range(a.rounds + 1):
        for part, f in (("fwd_bwd", fwd_bwd), ("fwd", fwd)):
            t0 = time.perf_counter()
            f()
            if r:
                times[part].append(time.perf_counter() - t0)
    from attention import torch_peak_bytes  # bench/attention.py, beside this script

    return {"peak_mib": torch_peak_bytes(fwd_bwd) / 2**20, **times}


def _child_args(a, role: str) -> list[str]:
    return [sys.executable, HERE, "--role", role, "--T", str(a.T), "--world", str(a.world), "--layout", a.layout,
            "--batch", str(a.batch), "--heads", str(a.heads), "--head-dim", str(a.head_dim), "--rounds",
            str(a.rounds)] + ([] if a.causal else ["--no-causal"])


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _run_ring(a) -> list[dict]:
    from helios.comm.launcher import free_port

    port, job = free_port(), secrets.token_hex(4)
    procs = []
    for r in range(a.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), HELIOS_JOB_ID=job, LP_NUM_THREADS="1")
        procs.append(subprocess.Popen(_child_args(a, "rank"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=3600)
        if p.returncode != 0:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            raise RuntimeError(f"ring rank failed ({p.returncode}): {e.strip()[-2000:]}")
        outs.append(_last_json(o))
    return outs


def _run_child(a, role: str, threads: int) -> dict:
    env = dict(os.environ, LP_NUM_THREADS=str(threads))
    r = subprocess.run(_child_args(a, role) + ["--threads", str(threads)], env=env, capture_output=True, text=True,
                       timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{role} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return _last_json(r.stdout)


def _ms(ts: list[float]) -> float:
    return round(statistics.median(ts) * 1e3, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ring attention on W ranks vs one device vs PyTorch CPU, same run")
    ap.add_argument("--T", type=int, default=None, help="sequence length (default 8192; --smoke 256)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "stripe"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, median kept (default 3; --smoke 1)")
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="LP_NUM_THREADS of the single device and torch threads of the peer, each measured "
                         "(default 1 2; --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: T 256 on 2 ranks, one round, 1 thread")
    ap.add_argument("--role", choices=("rank", "single", "torch"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.T = a.T or (256 if a.smoke else 8192)
    a.rounds = a.rounds or (1 if a.smoke else 3)
    a.threads = a.threads or ([1] if a.smoke else [1, 2])
    if a.role == "rank":
        print(json.dumps(_rank(a)))
        return 0
    if a.role in ("single", "torch"):
        res = _single(a) if a.role == "single" else _torch(a, a.threads[0])
        print(json.dumps(res))
        return 0
    shape = {"bench": "ring_attention", "B": a.batch, "H": a.heads, "T": a.T, "D": a.head_dim, "causal": a.causal}
    ranks = _run_ring(a)
    # A round lasts until the slowest rank is done.
    ring = {part: _ms([max(r[part][i] for r in ranks) for i in range(a.rounds)]) for part in ("fwd_bwd", "fwd")}
    peaks = [round(r["peak_mib"], 2) for r in ranks]
    kept = [round(r["kept_mib"], 3) for r in ranks]
    cpu = [_ms(r["fwd_bwd_cpu"]) for r in ranks]
    print(json.dumps({**shape, "impl": "ring", "world": a.world, "layout": a.layout, "lp_num_threads_per_rank": 1,
                      "fwd_bwd_ms": ring["fwd_bwd"], "fwd_ms": ring["fwd"], "peak_mib_per_rank": peaks,
                      "kept_mib_per_rank": kept, "fwd_bwd_cpu_ms_per_rank": cpu}), flush=True)
    summary = {**shape, "impl": "summary", "world": a.world, "layout": a.layout}
    for impl in ("single", "torch"):
        for th in a.threads:
            res = _run_child(a, impl, th)
            line = {**shape, "impl": impl, "threads": th, "fwd_bwd_ms": _ms(res["fwd_bwd"]), "fwd_ms": _ms(res["fwd"]),
                    "peak_mib": round(res["peak_mib"], 2)}
            if impl == "single":
                line["kept_mib"] = round(res["kept_mib"], 3)
                line["fwd_bwd_cpu_ms"] = _ms(res["fwd_bwd_cpu"])
            print(json.dumps(line), flush=True)
            summary[f"ring_speedup_vs_{impl}_{th}t"] = round(line["fwd_bwd_ms"] / ring["fwd_bwd"], 2)
            summary[f"ring_fwd_speedup_vs_{impl}_{th}t"] = round(line["fwd_ms"] / ring["fwd"], 2)
            if impl == "single" and th == a.threads[0]:
                summary["rank_peak_over_single"] = [round(p / line["peak_mib"], 3) for p in peaks]
                summary["rank_kept_over_single"] = [round(k / line["kept_mib"], 3) for k in kept]
                # CPU seconds of all ranks together over the single device's: the ring's extra
                # work (merges, copies, communication), whatever else the machine runs.
                summary["ring_cpu_over_single"] = round(sum(cpu) / line["fwd_bwd_cpu_ms"], 3)
    with open("/proc/loadavg") as f:
        summary["loadavg"] = f.read().split()[:3]
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
