"""Dispatch overhead: 10,000 tiny elementwise ops in one stream, Helios vs a raw C++ loop.

Helios records ``y = x + 1.0`` (one ``ew_unary`` add_s dispatch and one output
allocation per op) through the whole Python path: functional.add -> autograd
Function.apply -> _kernels.unary -> Runtime.dispatch -> the addon.  The peer is
``Device.bench_raw_dispatch``: the same pipeline, push constants, bindings and
workgroup count recorded n times by a C++ loop through the same command stream, then
synchronized.  Both are timed from the first op to the end of the final wait.

Two variants:
  independent  y = x + 1.0 every time: Helios writes a fresh output each op (no
               hazard, no barrier); the raw loop rewrites one output (a WAW barrier
               per dispatch), so the device side is not identical here.
  chain        y = y + 1.0: every Helios op reads the previous result (a RAW barrier
               per dispatch), like the raw loop's barrier per dispatch: like for like.

Also printed: the host-only recording cost per op (auto-submit raised so nothing is
submitted while recording), and the cost of calling the addon's ``dispatch`` from a
bare Python loop (the floor any Python caller pays).

    .venv/bin/python bench/dispatch.py [--n 10000] [--numel 16] [--reps 5] [--smoke]

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): 200 ops a run, one run a side;
the same lines, their figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import helios as hl
from helios import _kernels as K
from helios.runtime import get_runtime

TARGET_RATIO = 1.5


def _helios_loop(x: hl.Tensor, n: int, chain: bool) -> hl.Tensor:
    y = x
    if chain:
        for _ in range(n):
            y = y + 1.0
    else:
        for _ in range(n):
            y = x + 1.0
    return y


def time_helios(x: hl.Tensor, n: int, chain: bool) -> tuple[float, dict]:
    """Seconds from the first op to the end of hl.synchronize(), and the stream stats."""
    dev = get_runtime().dev
    hl.synchronize()
    dev.reset_stats()
    t0 = time.perf_counter()
    y = _helios_loop(x, n, chain)
    hl.synchronize()
    dt = time.perf_counter() - t0
    stats = dev.stats()
    expected = x.numpy() + (n if chain else 1.0)
    if not np.array_equal(y.numpy(), expected):  # a benchmark of wrong results is no benchmark
        raise AssertionError("Helios produced a wrong value")
    return dt, stats


def time_helios_record(x: hl.Tensor, n: int, chain: bool) -> tuple[float, float]:
    """Host-only (wall, CPU) seconds to record n ops (nothing is submitted while recording,
    so the process's CPU time is the recording thread's: robust on a shared machine)."""
    dev = get_runtime().dev
    hl.synchronize()
    old = dev.auto_submit_dispatches
    dev.auto_submit_dispatches = max(old, n + 1)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        _helios_loop(x, n, chain)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        hl.synchronize()
    finally:
        dev.auto_submit_dispatches = old
    return wall, cpu


def raw_args(x: hl.Tensor) -> tuple:
    """(pipeline id, bindings, push bytes, groups) of the dispatch ``x + 1.0`` records."""
    rt = get_runtime()
    m = x.numel()
    out = K.empty(x.shape, x.dtype, rt)
    pid = rt.pipeline("ew_unary", x.dtype.tag, (K.UNARY["add_s"], 1))
    bx, ox = K.bind(x, span=m)
    bo, oo = K.bind(out, True, span=m)
    push = K._P_UNARY.pack(m, 1, ox, oo, 1.0, 0.0, 0, 0, *K._PAD6, *K._PAD6)
    return pid, [bx, bo], push, K.grid(m), out


def time_raw(args: tuple, n: int) -> tuple[float, dict]:
    dev = get_runtime().dev
    pid, bufs, push, groups, _out = args
    hl.synchronize()
    dev.reset_stats()
    dt = dev.bench_raw_dispatch(pid, bufs, push, groups, n)
    return dt, dev.stats()


def time_addon_calls(args: tuple, n: int) -> float:
    """Host seconds for n calls of the addon's dispatch from a bare Python loop (record only)."""
    dev = get_runtime().dev
    pid, bufs, push, groups, _out = args
    hl.synchronize()
    old = dev.auto_submit_dispatches
    dev.auto_submit_dispatches = max(old, n + 1)
    try:
        d = dev.dispatch
        t0 = time.perf_counter()
        for _ in range(n):
            d(pid, bufs, push, groups, "add_s", 0, 0)
        dt = time.perf_counter() - t0
        hl.synchronize()
    finally:
        dev.auto_submit_dispatches = old
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=None, help="ops per timed run (default 10000; --smoke 200)")
    ap.add_argument("--numel", type=int, default=16, help="elements of the tiny tensor")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per side, median reported, best too (default 5; "
                                                          "--smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 200 ops, one run a side")
    a = ap.parse_args()
    a.n = a.n or (200 if a.smoke else 10_000)
    a.reps = a.reps or (1 if a.smoke else 5)

    rt = get_runtime()
    x = hl.tensor(np.arange(a.numel, dtype=np.float32))
    args = raw_args(x)
    # Warm up: pipelines built, pools grown, allocator free lists populated.
    for chain in (False, True):
        time_helios(x, min(a.n, 2000), chain)
    time_raw(args, min(a.n, 2000))

    for variant, chain in (("independent", False), ("chain", True)):
        h, r, rec, cpu, call = [], [], [], [], []
        hs = rs = None
        for _ in range(a.reps):  # interleaved, so drift on a shared machine hits both sides
            t, hs = time_helios(x, a.n, chain)
            h.append(t)
            t, rs = time_raw(args, a.n)
            r.append(t)
            w, c = time_helios_record(x, a.n, chain)
            rec.append(w)
            cpu.append(c)
            call.append(time_addon_calls(args, a.n))
        hu = statistics.median(h) / a.n * 1e6
        ru = statistics.median(r) / a.n * 1e6
        print(json.dumps({
            "bench": f"dispatch_{variant}",
            "device": rt.info["name"],
            "n": a.n,
            "numel": a.numel,
            "unit": "us/op",
            "helios": round(hu, 3),
            "peer": round(ru, 3),
            "ratio": round(hu / ru, 3),
            # best-of-reps on both sides: the least disturbed run on a shared machine
            "ratio_best": round(min(h) / min(r), 3),
            "helios_us_per_op": round(hu, 3),
            "raw_us_per_op": round(ru, 3),
            "helios_record_us_per_op": round(statistics.median(rec) / a.n * 1e6, 3),
            "helios_record_cpu_us_per_op": round(statistics.median(cpu) / a.n * 1e6, 3),
            "addon_call_record_us_per_op": round(statistics.median(call) / a.n * 1e6, 3),
            "helios_dispatches": hs["dispatches"],
            "helios_barriers": hs["barriers"],
            "helios_submits": hs["submits"],
            "raw_dispatches": rs["dispatches"],
            "raw_barriers": rs["barriers"],
            "raw_submits": rs["submits"],
            "target_ratio": TARGET_RATIO,
            "reps": a.reps,
        }), flush=True)


if __name__ == "__main__":
    main()
