"""Helios matmul GFLOP/s against numpy (its BLAS) on the same shapes, in the same process.

    python bench/matmul.py [--sizes 256 512 1024 2048] [--gpt 8 256 768] [--shapes MxKxN ...] [--rounds 7]
                           [--layouts nn tn nt] [--dtype float32] [--tiles 8x8 16x8 --wy 4] [--smoke]

Shapes: fp32 squares and a GPT MLP projection (B*T x C) @ (C x 4C).  Layouts: ``nn``
row-major operands (the forward), ``nt`` A @ B^T and ``tn`` A^T @ B as transposed views
(the two backward products, g @ W^T and X^T @ g).

Method: both sides are warmed up first (a new pipeline JITs for ~300 ms on lavapipe).
Each round times Helios (``reps`` products recorded back to back, then
``helios.synchronize()`` and one element read back) and then numpy on the same shape,
so the two see the same machine load; a shape's figure is the median over rounds of the
per-product time.  One JSON line per shape: {"bench": "matmul", "shape", "layout",
"helios_gflops", "numpy_gflops", "ratio", "numpy_threads", "lp_num_threads", "device"};
``ratio`` = helios / numpy.  The ``*_gflops_cpu`` / ``ratio_cpu`` fields divide by the
process CPU time instead (all threads, lavapipe's and OpenBLAS' included): on a host
shared with other work they move far less than the wall-clock figures.  With ``--dtype float16/bfloat16`` Helios stores 16-bit
operands (computing in fp32) while numpy still runs fp32 BLAS: numpy has no bf16 and its
float16 matmul does not use BLAS, so fp32 is the fair peer.  On a GPU, ``--cuda-peer`` also
times torch.matmul on CUDA (fp32, TF32 off, same shape and layout) in the same run and adds
``cuda_peer_gflops`` and ``ratio_cuda_peer`` to each line: numpy on the host's cores is no
peer for a GPU (``--no-numpy`` leaves it out).  With ``--dtype bfloat16/float16`` the CUDA peer
runs in that dtype (cuBLAS on tensor cores), as Helios does on ``cuda:N`` (its products of
16-bit tensors run the wgmma kernel there; ``HELIOS_TENSOR_CORES=0`` for the SIMT one).
``--shapes`` adds products of any M x K by K x N (GPT-2's weight gradients: ``768x8192x2304
--layouts tn``).
``--tiles`` (CPU devices only) repeats the square shapes for
each TM x TN register block listed, to re-tune ``_MM_CPU_TILE`` on a new host.

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): 64^3 and a GPT MLP shape of
(2*16 x 32) @ (32 x 128), layouts nn, nt and tn, one round; the same lines, their figures
meaningless.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np

import helios as hl
from helios import _kernels as K
from helios.runtime import get_runtime


def numpy_threads() -> int | str:
    """Threads numpy's BLAS uses: asked of the loaded OpenBLAS, else what the env says."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln})
        for path in libs:
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
                fn = getattr(lib, name, None)
                if fn is not None:
                    return int(fn())
    except OSError:
        pass
    return os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "unknown"


def operands(M: int, Kd: int, N: int, layout: str, dtype: str, rng):
    """numpy (a, b) and Helios (A, B) with A @ B = a @ b; 't' operands are transposed views."""
    a = rng.standard_normal((M, Kd), dtype=np.float32)
    b = rng.standard_normal((Kd, N), dtype=np.float32)
    A = hl.tensor(np.ascontiguousarray(a.T), dtype=dtype).mT if layout[0] == "t" else hl.tensor(a, dtype=dtype)
    B = hl.tensor(np.ascontiguousarray(b.T), dtype=dtype).mT if layout[1] == "t" else hl.tensor(b, dtype=dtype)
    # numpy gets the same memory layouts (its BLAS takes transposed operands natively)
    na = np.ascontiguousarray(a.T).T if layout[0] == "t" else a
    nb = np.ascontiguousarray(b.T).T if layout[1] == "t" else b
    return na, nb, A, B


def bench_shape(M: int, Kd: int, N: int, layout: str, dtype: str, rounds: int, rng, numpy_peer: bool = True) -> dict:
    na, nb, A, B = operands(M, Kd, N, layout, dtype, rng)
    flop = 2.0 * M * N * Kd
    # warm-up (pipeline JIT, first-touch of memory) and a correctness guard
    C = A @ B
    got = C.numpy().astype(np.float32)
    if numpy_peer or max(M, N, Kd) <= 4096:
        ref = na @ nb
        err = float(np.abs(got - ref).max() / max(1e-30, np.abs(ref).max()))
    else:  # the guard on a sample of rows: a full fp32 product on the host takes seconds here
        rows = rng.choice(M, 64, replace=False)
        ref = na[rows] @ nb
        err = float(np.abs(got[rows] - ref).max() / max(1e-30, np.abs(ref).max()))
    # enough products per timed block that a block lasts ~0.2 s (dispatch overhead amortised)
    t0 = time.perf_counter()
    (A @ B)[0, 0].item()
    one = time.perf_counter() - t0
    reps = max(1, min(50, int(0.2 / max(one, 1e-6))))
    # Helios' rounds first, then numpy's: OpenBLAS' threads keep spinning for a while after a
    # product, and when Helios ran right after each numpy block they took the cores from
    # lavapipe's threads (1024^3: 40 GFLOP/s interleaved against 57 alone, same kernel).
    th, tn, ch, cn = [], [], [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            C = A @ B
        hl.synchronize()
        C[0, 0].item()
        th.append((time.perf_counter() - t0) / reps)
        ch.append((time.process_time() - c0) / reps)
    for _ in range(rounds if numpy_peer else 0):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            na @ nb
        tn.append((time.perf_counter() - t0) / reps)
        cn.append((time.process_time() - c0) / reps)
    gh, gch = flop / statistics.median(th) / 1e9, flop / statistics.median(ch) / 1e9
    res = {"helios_gflops": round(gh, 3), "helios_gflops_cpu": round(gch, 3), "rel_err": float(f"{err:.2e}"),
           "reps": reps, "rounds": rounds}
    if numpy_peer:
        # per CPU-second of this process (lavapipe's and OpenBLAS' threads included): steadier
        # than wall time when other work shares the cores
        gn, gcn = flop / statistics.median(tn) / 1e9, flop / statistics.median(cn) / 1e9
        res.update(numpy_gflops=round(gn, 3), ratio=round(gh / gn, 4), numpy_gflops_cpu=round(gcn, 3),
                   ratio_cpu=round(gch / gcn, 4))
    return res


def cuda_peer_gflops(M: int, Kd: int, N: int, layout: str, rounds: int, dtype: str = "float32") -> float | str:
    """torch.matmul on CUDA in ``dtype`` (fp32 with TF32 off; bf16 / fp16 on cuBLAS's tensor
    cores), for the same shape and layout (median of ``rounds`` blocks of 20 products, timed by
    CUDA events); a string says why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False
    tdt = getattr(torch, dtype)
    a = torch.randn((Kd, M) if layout[0] == "t" else (M, Kd), device="cuda", dtype=tdt)
    b = torch.randn((N, Kd) if layout[1] == "t" else (Kd, N), device="cuda", dtype=tdt)
    a = a.t() if layout[0] == "t" else a
    b = b.t() if layout[1] == "t" else b
    for _ in range(3):
        a @ b
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20 / 1e3)
    return 2.0 * M * N * Kd / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Helios matmul vs numpy, same process")
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="squares (default 256 512 1024 2048; --smoke 64)")
    ap.add_argument("--gpt", type=int, nargs=3, default=None, metavar=("B", "T", "C"),
                    help="GPT MLP shape (B*T x C) @ (C x 4C), default 8 256 768 (--smoke 2 16 32); --gpt 0 0 0 skips it")
    ap.add_argument("--shapes", nargs="*", default=[], metavar="MxKxN",
                    help="more products of M x K by K x N, e.g. GPT-2's weight gradients 768x8192x2304 (with --layouts tn)")
    ap.add_argument("--layouts", nargs="+", default=None, choices=["nn", "nt", "tn", "tt"],
                    help="default nn; --smoke nn nt tn")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, median kept (default 7; --smoke 1)")
    ap.add_argument("--tiles", nargs="*", default=None, help="CPU register blocks to compare, e.g. 8x8 16x8")
    ap.add_argument("--wy", type=int, nargs="*", default=None, help="CPU subgroups per workgroup to compare")
    ap.add_argument("--cuda-peer", action="store_true", help="also time torch.matmul on CUDA (a GPU's peer)")
    ap.add_argument("--no-numpy", action="store_true", help="leave numpy out (with --cuda-peer: the GPU's peer only)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 64^3 and a small GPT MLP shape, 3 layouts, one round")
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.sizes = args.sizes if args.sizes is not None else ([64] if smoke else [256, 512, 1024, 2048])
    args.gpt = args.gpt or ([2, 16, 32] if smoke else [8, 256, 768])
    args.layouts = args.layouts or (["nn", "nt", "tn"] if smoke else ["nn"])
    args.rounds = args.rounds or (1 if smoke else 7)

    rt = get_runtime()
    common = {"bench": "matmul", "dtype": args.dtype, "device": rt.info["name"], "device_type": rt.info["type"],
              "numpy_threads": numpy_threads(), "lp_num_threads": os.environ.get("LP_NUM_THREADS", f"default ({os.cpu_count()})")}
    rng = np.random.default_rng(0)
    shapes = [(f"{n}x{n}x{n}", n, n, n) for n in args.sizes]
    if args.gpt and all(args.gpt):
        Bsz, T, C = args.gpt
        shapes.append((f"gpt_mlp({Bsz}*{T}x{C})@({C}x{4 * C})", Bsz * T, C, 4 * C))
    for text in args.shapes:
        try:
            M, Kd, N = (int(x) for x in text.lower().split("x"))
        except ValueError:
            ap.error(f"--shapes: {text!r} is not MxKxN (three integers, e.g. 768x8192x2304)")
        shapes.append((text, M, Kd, N))
    configs = [(None, None)]
    if args.tiles is not None or args.wy is not None:
        if rt.info["type"] != "cpu":
            print(json.dumps({**common, "skipped": "--tiles/--wy tune the CPU kernel; this device is not a CPU"}))
            return 0
        tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles] if args.tiles else [None]
        configs = [(t, w) for t in tiles for w in (args.wy or [None])]
    default_tile, default_wy = K.gemm._MM_CPU_TILE, K.gemm._MM_CPU_WY
    try:
        for tile, wy in configs:
            K.gemm._MM_CPU_TILE, K.gemm._MM_CPU_WY = tile, wy
            for name, M, Kd, N in shapes:
                extra = {}
                if rt.info["type"] == "cpu":
                    tm, tn, w = K._mm_cpu_tile(M, N, getattr(hl, args.dtype))
                    extra = {"tile": f"{tm}x{tn}", "wy": w}
                for layout in args.layouts:
                    res = bench_shape(M, Kd, N, layout, args.dtype, args.rounds, rng, not args.no_numpy)
                    if args.cuda_peer:
                        peer = cuda_peer_gflops(M, Kd, N, layout, args.rounds, args.dtype)
                        if isinstance(peer, str):
                            res["cuda_peer_skipped"] = peer
                        else:
                            res["cuda_peer_gflops"] = round(peer, 1)
                            res["ratio_cuda_peer"] = round(res["helios_gflops"] / peer, 4)
                    load = round(os.getloadavg()[0], 2)  # other work on the host skews both sides
                    print(json.dumps({**common, "shape": name, "layout": layout, **extra, **res, "loadavg_1m": load}),
                          flush=True)
    finally:
        K.gemm._MM_CPU_TILE, K.gemm._MM_CPU_WY = default_tile, default_wy
    return 0


if __name__ == "__main__":
    sys.exit(main())
