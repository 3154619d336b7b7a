"""Elementwise chain fusion: a 4-op chain on 1M floats, fused (helios.elementwise_jit) vs unfused.

    y = (x * 2.0 + 1.0).relu() - z        # mul_s, add_s, relu, sub

Unfused (the peer, ``helios.fused_kernels.ENABLED = False`` as HELIOS_FUSION=0 sets it, in the same
process) is four dispatches, each reading and writing 1M floats; fused is one generated kernel
that reads x and z and writes y.  Each variant runs ``--iters`` chains and one
synchronize per rep; the figure is the median over ``--reps`` of seconds per chain, plus the
dispatches each chain issued and the effective bandwidth (bytes the unfused chain moves /
time).  The results of the two are checked bit for bit first.  The first fused chain of the
process compiles (or loads from the disk cache) its kernel; that one-off cost is printed
apart (``jit_s``) and kept out of the timed reps.

Second line, the host cost of the queue: recording 3,000 ops on 16-element tensors
(``y = x + 1.0``: nothing to fuse; ``y = y + 1.0``: a chain), fusion on and off interleaved
in this process, process CPU µs per op with nothing submitted while recording (as
bench/dispatch.py's recording figure), median over the reps.

    .venv/bin/python bench/ew_fusion.py [--n 1048576] [--iters 20] [--reps 5] [--smoke]

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): 4096 floats, 2 chains a rep, one
rep, 300 recorded ops; the same lines, their figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import helios as hl
from helios import fused_kernels
from helios.runtime import get_runtime


def chain(x, z):
    """The benchmarked chain: four elementwise ops."""
    return (x * 2.0 + 1.0).relu() - z


def run(x, z, iters: int, fused: bool) -> tuple[float, int]:
    """(seconds per chain, dispatches per chain) over ``iters`` chains and one synchronize."""
    rt = get_runtime()
    fused_kernels.ENABLED = fused
    try:
        rt.synchronize()
        d0 = rt.stats()["dispatches"]
        t0 = time.perf_counter()
        for _ in range(iters):
            y = chain(x, z)
        rt.synchronize()
        dt = time.perf_counter() - t0
        d = rt.stats()["dispatches"] - d0
    finally:
        fused_kernels.ENABLED = True
    del y
    return dt / iters, d / iters


def record_cpu_us(x, n: int, chain: bool, fused: bool) -> float:
    """Process CPU µs per op to record ``n`` tiny ops (nothing submitted while recording)."""
    rt = get_runtime()
    dev = rt.dev
    rt.synchronize()
    old = dev.auto_submit_dispatches
    dev.auto_submit_dispatches = max(old, n + 10)
    fused_kernels.ENABLED = fused
    try:
        y = x
        c0 = time.process_time()
        for _ in range(n):
            y = (y if chain else x) + 1.0
        c = time.process_time() - c0
        del y
        rt.synchronize()
    finally:
        fused_kernels.ENABLED = True
        dev.auto_submit_dispatches = old
    return c / n * 1e6


def main() -> None:
    """Print one JSON line: fused vs unfused seconds per chain on this device."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="floats a vector (default 1048576; --smoke 4096)")
    ap.add_argument("--iters", type=int, default=None, help="chains a rep (default 20; --smoke 2)")
    ap.add_argument("--reps", type=int, default=None, help="reps, interleaved, median kept (default 5; --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 4096 floats, 2 chains, one rep, 300 recorded ops")
    args = ap.parse_args()
    args.n = args.n or (4096 if args.smoke else 1 << 20)
    args.iters = args.iters or (2 if args.smoke else 20)
    args.reps = args.reps or (1 if args.smoke else 5)
    record_ops = 300 if args.smoke else 3000
    rt = get_runtime()
    rng = np.random.default_rng(0)
    x = hl.tensor(rng.standard_normal(args.n).astype(np.float32))
    z = hl.tensor(rng.standard_normal(args.n).astype(np.float32))
    t0 = time.perf_counter()
    fused_y = chain(x, z).numpy()  # compiles (or loads) the fused kernel
    jit_s = time.perf_counter() - t0
    fused_kernels.ENABLED = False
    ref_y = chain(x, z).numpy()
    fused_kernels.ENABLED = True
    if fused_y.tobytes() != ref_y.tobytes():  # a benchmark of wrong results is no benchmark
        raise AssertionError("the fused chain differs from the unfused ops")
    run(x, z, 2, True), run(x, z, 2, False)  # warm both paths
    fused, unfused = [], []
    for _ in range(args.reps):  # interleaved, so load changes hit both alike
        fused.append(run(x, z, args.iters, True))
        unfused.append(run(x, z, args.iters, False))
    f = statistics.median(t for t, _ in fused)
    u = statistics.median(t for t, _ in unfused)
    moved = 4 * args.n * (2 + 2 + 2 + 3)  # bytes the unfused chain moves: 3 unary ops x 2 vectors, sub 3
    print(json.dumps({
        "bench": "ew_fusion_chain4", "device": rt.info["name"], "n": args.n, "iters": args.iters, "reps": args.reps,
        "unit": "ms/chain", "fused_ms": round(f * 1e3, 3), "unfused_ms": round(u * 1e3, 3),
        "speedup": round(u / f, 2), "fused_dispatches": fused[0][1], "unfused_dispatches": unfused[0][1],
        "unfused_GBps": round(moved / u / 1e9, 2), "fused_GBps_equiv": round(moved / f / 1e9, 2),
        "jit_s": round(jit_s, 3), "lp_num_threads": os.environ.get("LP_NUM_THREADS", ""),
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }))
    tiny = hl.tensor(np.ones(16, np.float32))
    rec = {}
    for _ in range(args.reps):
        for is_chain in (False, True):
            for fused_ in (True, False):
                rec.setdefault((is_chain, fused_), []).append(record_cpu_us(tiny, record_ops, is_chain, fused_))
    med = {k: round(statistics.median(v), 2) for k, v in rec.items()}
    print(json.dumps({
        "bench": "ew_fusion_record", "device": rt.info["name"], "unit": "cpu_us/op", "ops": record_ops, "numel": 16,
        "independent_fused": med[(False, True)], "independent_unfused": med[(False, False)],
        "chain_fused": med[(True, True)], "chain_unfused": med[(True, False)],
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }))


if __name__ == "__main__":
    main()
