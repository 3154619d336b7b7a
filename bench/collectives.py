"""Collectives benchmark: helios.comm (shm, tcp) against torch.distributed (gloo) and memcpy.

    .venv/bin/python bench/collectives.py                      # 2 and 4 ranks, 4 KiB .. 64 MiB
    .venv/bin/python bench/collectives.py --ranks 2 --sizes 4096,33554432 --ops all_reduce
    .venv/bin/python bench/collectives.py --smoke              # CI's seconds-long run

For each (ranks, backend) one set of processes initialises both helios.comm and
torch.distributed (gloo) and, for each (op, size), alternates short bursts of the two on
the same float32 sizes, so both see the same machine load.  Time is the median over
iterations of the slowest rank's time per call (a barrier before each call; the ranks'
times are max-reduced), and the bandwidths follow
nccl-tests: algbw = S / t (GB = 1e9 bytes), busbw = algbw * 2(n-1)/n for all_reduce and
(n-1)/n for all_gather / reduce_scatter, with S the all-reduce buffer or the gathered
(all-gather output, reduce-scatter input) size.  A single-core memcpy of the same sizes
gives the memory-bandwidth reference.  Output: one JSON line per measurement, then one
line per target with its verdict; the exit status is 1 when a target is missed and
``--gate`` is given.

``--smoke`` (tests/test_bench_smoke.py): 2 ranks, 4 KiB, every op on shm (the bench's code is
the same for every backend), one round of 3 calls a side (``--iters``: the timed calls per round, overriding the size's count); the
same lines, their figures meaningless (no target applies at these sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from helios.comm.launcher import free_port

HERE = os.path.abspath(__file__)
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]


def _iters(nbytes: int) -> int:
    return int(min(200, max(5, (256 << 20) // max(nbytes, 1) // 8)))


def _busbw_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


# ------------------------------------------------------------------------------- worker
def worker(backend: str, ops: list[str], sizes: list[int], rounds: int, iters: int | None = None) -> None:
    """One rank: both helios.comm (``backend``) and gloo in this process, measured in alternation."""
    import helios.comm as dist
    import torch
    import torch.distributed as td

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    td.init_process_group("gloo", rank=rank, world_size=n)
    dist.init_process_group(backend=backend, timeout=300, master_port=int(os.environ["HELIOS_BENCH_PORT"]))

    def run_helios(op: str, a, b) -> None:
        if op == "all_reduce":
            dist.all_reduce(a)
        elif op == "all_gather":
            dist.all_gather(b, a)
        else:
            dist.reduce_scatter(a, b)

    def run_gloo(op: str, a, b) -> None:
        if op == "all_reduce":
            td.all_reduce(a)
        elif op == "all_gather":
            td.all_gather_into_tensor(b, a)
        else:
            td.reduce_scatter_tensor(a, b)

    def slowest(v: float) -> float:
        t = np.array([v], dtype=np.float64)
        dist.all_reduce(t, op="max")
        return float(t[0])

    results = []
    for op in ops:
        for nbytes in sizes:
            # S: the all-reduce buffer, or the gathered size (all-gather output, reduce-scatter input).
            count = nbytes // 4
            small = count if op == "all_reduce" else max(1, count // n)
            ha, hb = np.ones(small, np.float32), np.ones(small * n, np.float32)
            ga, gb = torch.ones(small), torch.ones(small * n)
            it = iters or max(2, _iters(nbytes) // rounds)
            times: dict[str, list[float]] = {"helios": [], "gloo": []}
            for _ in range(2):
                run_helios(op, ha, hb)
                run_gloo(op, ga, gb)
            # Alternate short bursts so both see the same machine load over the run.
            for _ in range(rounds):
                for name, fn, a, b in (("helios", run_helios, ha, hb), ("gloo", run_gloo, ga, gb)):
                    for _ in range(it):
                        dist.barrier()
                        t0 = time.perf_counter()
                        fn(op, a, b)
                        times[name].append(slowest(time.perf_counter() - t0))
            res = {"op": op, "bytes": small * 4 * (1 if op == "all_reduce" else n)}
            for name, ts in times.items():
                ts.sort()
                res[name] = {"t": statistics.median(ts), "p99": ts[int(0.99 * (len(ts) - 1))]}
            results.append(res)
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()
    td.destroy_process_group()


# ------------------------------------------------------------------------------- parent
def launch(backend: str, n: int, ops: list[str], sizes: list[int], rounds: int, iters: int | None = None) -> list[dict]:
    """Run ``n`` ranks measuring helios ``backend`` and gloo; rank 0's results."""
    port, hport = free_port("127.0.0.1"), free_port("127.0.0.1")
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   HELIOS_BENCH_PORT=str(hport))
        procs.append(subprocess.Popen([sys.executable, HERE, "--worker", backend, "--ops", ",".join(ops),
                                       "--sizes", ",".join(map(str, sizes)), "--rounds", str(rounds)]
                                      + (["--iters", str(iters)] if iters else []), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=3600)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, o, e in out:
        for line in o.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
    raise RuntimeError(f"{backend}: no result: {out[0][2][-2000:]}")


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
    p.add_argument("--sizes", default=None, help="comma list of bytes (default 4 KiB .. 64 MiB; --smoke 4096)")
    p.add_argument("--ranks", default=None, help="comma list of world sizes (default 2,4; --smoke 2)")
    p.add_argument("--backends", default=None, help="comma list (default shm,tcp; --smoke shm)")
    p.add_argument("--gate", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--rounds", type=int, default=None, help="alternating helios / gloo bursts per size (default 4; --smoke 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per burst (default: by size; --smoke 3)")
    p.add_argument("--smoke", action="store_true", help="CI's quick run: 2 ranks, 4 KiB, shm, one round of 3 calls")
    a = p.parse_args()
    a.sizes = a.sizes or ("4096" if a.smoke else ",".join(map(str, SIZES)))
    a.ranks = a.ranks or ("2" if a.smoke else "2,4")
    a.backends = a.backends or ("shm" if a.smoke else "shm,tcp")
    a.rounds = a.rounds or (1 if a.smoke else 4)
    a.iters = a.iters or (3 if a.smoke else None)
    ops, sizes = a.ops.split(","), [int(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(a.worker, ops, sizes, a.rounds, a.iters)
        return 0
    mem = {s: memcpy_bw(s) for s in sizes}
    for s in sizes:
        print(json.dumps({"bench": "memcpy_1core", "bytes": s, "GBps": round(mem[s], 3)}), flush=True)
    table: dict[tuple, dict] = {}
    for n in [int(x) for x in a.ranks.split(",")]:
        for backend in a.backends.split(","):
            for r in launch(backend, n, ops, sizes, a.rounds, a.iters):
                f = _busbw_factor(r["op"], n)
                h, g = r["helios"], r["gloo"]
                algbw, galgbw = r["bytes"] / h["t"] / 1e9, r["bytes"] / g["t"] / 1e9
                row = {"bench": r["op"], "backend": backend, "ranks": n, "bytes": r["bytes"],
                       "helios": {"time_us": round(h["t"] * 1e6, 1), "p99_us": round(h["p99"] * 1e6, 1),
                                  "algbw_GBps": round(algbw, 3), "busbw_GBps": round(algbw * f, 3)},
                       "peer": {"name": "torch.distributed gloo", "time_us": round(g["t"] * 1e6, 1),
                                "p99_us": round(g["p99"] * 1e6, 1), "algbw_GBps": round(galgbw, 3),
                                "busbw_GBps": round(galgbw * f, 3)},
                       "ratio": round(algbw / galgbw, 3),
                       "memcpy_1core_GBps": round(mem[r["bytes"]] if r["bytes"] in mem else mem[max(mem)], 3)}
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
