"""Collectives benchmark: helios.comm (shm, tcp) against torch.distributed (gloo) and memcpy.

    .venv/bin/python bench/collectives.py                      # 2 and 4 ranks, 4 KiB .. 64 MiB
    .venv/bin/python bench/collectives.py --ranks 2 --sizes 4096,33554432 --ops all_reduce

For each (op, ranks, size) the helios backends and gloo run the same float32 buffers in
the same run, one after the other, each rank pinned to nothing (the OS schedules them).
Time is the median over iterations of the slowest rank's time per call (every rank times
its own loop after a barrier; rank 0 takes the maximum), and the bandwidths follow
nccl-tests: algbw = S / t (GB = 1e9 bytes), busbw = algbw * 2(n-1)/n for all_reduce and
(n-1)/n for all_gather / reduce_scatter, with S the all-reduce buffer or the gathered
(all-gather output, reduce-scatter input) size.  A single-core memcpy of the same sizes
gives the memory-bandwidth reference.  Output: one JSON line per measurement, then one
line per target with its verdict; the exit status is 1 when a target is missed and
``--gate`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]


def _iters(nbytes: int) -> int:
    return int(min(200, max(5, (256 << 20) // max(nbytes, 1) // 8)))


def _busbw_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


# ------------------------------------------------------------------------------- worker
def worker(impl: str, ops: list[str], sizes: list[int]) -> None:
    """One rank: run every (op, size), print rank 0's JSON results."""
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if impl == "gloo":
        import torch
        import torch.distributed as td

        td.init_process_group("gloo", rank=rank, world_size=n)

        def mk(count: int):
            return torch.ones(count, dtype=torch.float32)

        def run(op: str, a, b) -> None:
            if op == "all_reduce":
                td.all_reduce(a)
            elif op == "all_gather":
                td.all_gather_into_tensor(b, a)
            else:
                td.reduce_scatter_tensor(a, b)

        def barrier() -> None:
            td.barrier()

        def gather_max(v: float) -> float:
            t = torch.tensor([v], dtype=torch.float64)
            td.all_reduce(t, op=td.ReduceOp.MAX)
            return float(t[0])
    else:
        import helios.comm as dist

        dist.init_process_group(backend=impl.split("-")[1], timeout=300)

        def mk(count: int):
            return np.ones(count, dtype=np.float32)

        def run(op: str, a, b) -> None:
            if op == "all_reduce":
                dist.all_reduce(a)
            elif op == "all_gather":
                dist.all_gather(b, a)
            else:
                dist.reduce_scatter(a, b)

        def barrier() -> None:
            dist.barrier()

        def gather_max(v: float) -> float:
            t = np.array([v], dtype=np.float64)
            dist.all_reduce(t, op="max")
            return float(t[0])

    results = []
    for op in ops:
        for nbytes in sizes:
            # S: the all-reduce buffer, or the gathered size (all-gather output, reduce-scatter input).
            count = nbytes // 4
            small = count if op == "all_reduce" else max(1, count // n)
            a, b = mk(small), mk(small * n)
            it = _iters(nbytes)
            for _ in range(2):
                run(op, a, b)
            times = []
            for _ in range(it):
                barrier()
                t0 = time.perf_counter()
                run(op, a, b)
                times.append(gather_max(time.perf_counter() - t0))
            results.append({"op": op, "bytes": small * 4 * (1 if op == "all_reduce" else n),
                            "t": statistics.median(times), "p99": sorted(times)[int(0.99 * (len(times) - 1))]})
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


# ------------------------------------------------------------------------------- parent
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def launch(impl: str, n: int, ops: list[str], sizes: list[int]) -> list[dict]:
    """Run ``n`` ranks of ``impl`` and return rank 0's results."""
    port = _free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, HERE, "--worker", impl, "--ops", ",".join(ops),
                                       "--sizes", ",".join(map(str, sizes))], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"{impl} rank failed: {e[-2000:]}")
            out.append(o)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for o in out:
        for line in o.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
    raise RuntimeError(f"{impl}: no result")


def memcpy_bw(nbytes: int) -> float:
    """Single-core memcpy bandwidth in GB/s (bytes copied per second) for ``nbytes`` buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    it = _iters(nbytes)
    ts = []
    for _ in range(it):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts) / 1e9


def main() -> int:
    """Run the benchmark (or one worker rank with --worker)."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", default=None)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--backends", default="shm,tcp")
    p.add_argument("--gate", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args()
    ops, sizes = a.ops.split(","), [int(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(a.worker, ops, sizes)
        return 0
    mem = {s: memcpy_bw(s) for s in sizes}
    for s in sizes:
        print(json.dumps({"bench": "memcpy_1core", "bytes": s, "GBps": round(mem[s], 3)}), flush=True)
    table: dict[tuple, dict] = {}
    for n in [int(x) for x in a.ranks.split(",")]:
        gloo = {(r["op"], r["bytes"]): r for r in launch("gloo", n, ops, sizes)}
        for backend in a.backends.split(","):
            mine = launch(f"helios-{backend}", n, ops, sizes)
            for r in mine:
                g = gloo[(r["op"], r["bytes"])]
                f = _busbw_factor(r["op"], n)
                algbw, galgbw = r["bytes"] / r["t"] / 1e9, g["bytes"] / g["t"] / 1e9
                row = {"bench": f"{r['op']}", "backend": backend, "ranks": n, "bytes": r["bytes"],
                       "helios": {"time_us": round(r["t"] * 1e6, 1), "p99_us": round(r["p99"] * 1e6, 1),
                                  "algbw_GBps": round(algbw, 3), "busbw_GBps": round(algbw * f, 3)},
                       "peer": {"name": "torch.distributed gloo", "time_us": round(g["t"] * 1e6, 1),
                                "p99_us": round(g["p99"] * 1e6, 1), "algbw_GBps": round(galgbw, 3),
                                "busbw_GBps": round(galgbw * f, 3)},
                       "ratio": round(algbw / galgbw, 3),
                       "memcpy_1core_GBps": round(mem.get(r["bytes"], mem[max(mem)]), 3)}
                table[(r["op"], backend, n, r["bytes"])] = row
                print(json.dumps(row), flush=True)
    ok = True
    checks = []
    m32 = 32 << 20
    if ("all_reduce", "shm", 2, m32) in table:
        row = table[("all_reduce", "shm", 2, m32)]
        checks.append(("shm all_reduce 32 MiB, 2 ranks: busbw >= 5x gloo", row["ratio"], 5.0))
        checks.append(("shm all_reduce 32 MiB, 2 ranks: busbw >= 30% of 1-core memcpy",
                       row["helios"]["busbw_GBps"] / mem[m32], 0.30))
    if ("all_reduce", "shm", 2, 4096) in table:
        row = table[("all_reduce", "shm", 2, 4096)]
        checks.append(("shm all_reduce 4 KiB, 2 ranks: latency <= 0.5x gloo",
                       row["peer"]["time_us"] / row["helios"]["time_us"], 2.0))
    if ("all_reduce", "tcp", 2, m32) in table:
        row = table[("all_reduce", "tcp", 2, m32)]
        checks.append(("tcp all_reduce 32 MiB, 2 ranks: busbw >= 0.9x gloo", row["ratio"], 0.9))
    for name, val, need in checks:
        passed = val >= need
        ok &= passed
        print(json.dumps({"target": name, "measured": round(val, 3), "needed": need, "pass": passed}), flush=True)
    return 0 if ok or not a.gate else 1


if __name__ == "__main__":
    sys.exit(main())
