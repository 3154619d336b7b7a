"""Flash attention against Helios' dense attention and PyTorch CPU, in the same run.

    python bench/attention.py [--T 64 256 1024 2048] [--batch 1] [--heads 4] [--head-dim 64]
                              [--rounds 5] [--no-causal] [--no-memory]
                              [--sparse] [--density 0.1] [--block-size 64]
                              [--dilated] [--segments 512 1024 2048] [--dilations 1 2 4]

Three implementations on the same float32 values, q, k, v of shape [batch, heads, T, head_dim]:

* ``flash``: ``helios.nn.functional.scaled_dot_product_attention`` (the flash kernel,
  kernels_spirv/glsl/flash_attn.comp);
* ``dense``: the GPT's path today, ``attention_softmax(q @ k^T, scale, causal) @ v``, which
  materialises the [batch, heads, T, T] scores and probabilities;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the CPU (the peer).

Time: each round times the three one after another, so they see the same machine load: a
forward without autograd (inference), then a forward + backward (a random upstream gradient),
each as a block of calls in a row lasting about 0.3 s (one call at large T), so the start of a
block (PyTorch's OpenMP threads still spinning from the previous block, idle cores waking up)
weighs little.  Every Helios call ends with ``helios.synchronize()`` and a read-back.  Each
figure is the median over rounds of the time per call, after a warm-up call (pipeline JIT).

Memory: the peak above the inputs over one forward + backward, as each allocator counts it:
Helios' activation pool (``peak_in_use_bytes``; a fresh process per path and T, since the
pool's peak only grows) and PyTorch's CPU allocator (the running total of its allocation
events recorded by ``torch.profiler`` with ``profile_memory=True``).

One JSON line per T: {"bench": "attention", "B", "H", "T", "D", "causal", "<impl>_fwd_ms",
"<impl>_fwd_bwd_ms", "<impl>_peak_mib", "flash_speedup_vs_<other>" (forward + backward),
"flash_fwd_speedup_vs_<other>", ...}; a speedup is the other side's time over flash's (> 1:
flash is faster).  A path that cannot run the shape (the dense scores of 4 heads at T = 4096
are 256 MiB, over lavapipe's 128 MiB binding range) gets "<impl>_failed" with the error.

``--sparse`` / ``--dilated`` (either or both) time, instead, the sparse attentions of
helios/attention.py against Helios' dense flash attention on the same values, interleaved in
each round as above (forward, forward + backward):

* ``--sparse``: ``block_sparse_attention`` with a block mask of ``--density`` of the block
  grid: each query block keeps its diagonal block and round(density * blocks) - 1 others drawn
  at random (seed 0) among the blocks it can see (those at or before it with causal), so a
  causal row computes as many blocks as a non-causal one.  One line per T: {"bench":
  "attention_sparse", "density" (computed blocks / all blocks), "pair_ratio" (computed
  (query, key) pairs / dense flash's, causal halves counted), "sparse_fwd_ms", "flash_fwd_ms",
  "sparse_fwd_bwd_ms", "flash_fwd_bwd_ms", "time_ratio" (sparse / flash, forward + backward),
  "fwd_time_ratio", ...}.
* ``--dilated``: ``dilated_attention`` with ``--segments`` and ``--dilations`` (each clipped
  to T).  One line per T: {"bench": "attention_dilated", "segments", "dilations",
  "dilated_fwd_ms", "flash_fwd_ms", ..., "time_ratio"}.
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

IMPLS = ("flash", "dense", "torch")


def _inputs(B: int, H: int, T: int, D: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4)]  # q, k, v, upstream grad


def _helios_fns(arrays, causal: bool):
    """(forward, forward + backward) callables of the flash and dense paths."""
    import helios as hl
    import helios.functional as HF
    import helios.nn.functional as F

    q, k, v, g = (hl.tensor(a, requires_grad=i < 3) for i, a in enumerate(arrays))
    scale = 1.0 / float(np.sqrt(q.shape[-1]))

    def flash():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def dense():
        return HF.matmul(HF.attention_softmax(HF.matmul(q, k.mT), scale, causal=causal), v)

    def run(fn, backward: bool):
        return _timed_call(fn, backward, q, k, v, g)

    return {"flash": (run(flash, False), run(flash, True)), "dense": (run(dense, False), run(dense, True))}


def _torch_fns(arrays, causal: bool):
    import torch

    q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays[:3])
    g = torch.tensor(arrays[3])

    def fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(g)
        q.grad = k.grad = v.grad = None

    return fwd, fwd_bwd


def _time(fn, reps: int = 1) -> float:
    """Seconds per call over ``reps`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _child(impl: str, B: int, H: int, T: int, D: int, causal: bool) -> dict:
    """One forward + backward of a Helios path in this (fresh) process: the activation pool's
    peak above the inputs (the pool's peak only grows, hence a process per measurement)."""
    import helios as hl
    from helios.runtime import get_runtime

    fns = _helios_fns(_inputs(B, H, T, D), causal)
    hl.synchronize()
    pool = get_runtime().dev
    st = pool.pool_stats()["activations"]
    base, prior = st["in_use_bytes"], st["peak_in_use_bytes"]
    fns[impl][1]()
    peak = pool.pool_stats()["activations"]["peak_in_use_bytes"]
    return {"peak_bytes": peak - base, "measurable": peak > prior}


def _timed_call(fn, backward: bool, q, k, v, g):
    """A call to time: ``fn()``'s forward (under no_grad) or forward + backward with upstream
    gradient ``g``, ending with a read-back so the device work is inside the timing."""
    import helios as hl

    def go():
        o = fn()
        if backward:
            o.backward(g)
            q.grad[0, 0, 0, 0].item()
            q.grad = k.grad = v.grad = None
        else:
            hl.synchronize()
            o[0, 0, 0, 0].item()
    return go if backward else hl.no_grad()(go)


def _torch_peak_bytes(B: int, H: int, T: int, D: int, causal: bool) -> int:
    """Peak bytes PyTorch's CPU allocator held during one forward + backward (see torch_peak_bytes)."""
    _, fwd_bwd = _torch_fns(_inputs(B, H, T, D), causal)
    fwd_bwd()  # warm-up outside the profile
    return torch_peak_bytes(fwd_bwd)


def torch_peak_bytes(fn) -> int:
    """Peak bytes PyTorch's CPU allocator held while ``fn()`` ran, above what it held before:
    the running total of its allocation events under torch.profiler (bench/ring_attention.py
    measures its peer with it too)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def _peak_mib(impl: str, B: int, H: int, T: int, D: int, causal: bool) -> float | str:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--batch", str(B), "--heads", str(H),
           "--head-dim", str(D), "--T", str(T)] + ([] if causal else ["--no-causal"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if not res["measurable"]:
        return "not measurable (an earlier peak was higher)"
    return round(res["peak_bytes"] / 2**20, 2)


def bench_T(B: int, H: int, T: int, D: int, causal: bool, rounds: int, memory: bool) -> dict:
    import torch

    from helios import HeliosError

    arrays = _inputs(B, H, T, D)
    fns = _helios_fns(arrays, causal)
    fns["torch"] = _torch_fns(arrays, causal)
    reps, failed = {}, {}
    for impl in IMPLS:
        try:
            for part in (0, 1):
                fns[impl][part]()  # warm-up: pipeline JIT, first touch of memory
                one = _time(fns[impl][part])
                reps[(impl, part)] = max(1, min(50, int(0.3 / max(one, 1e-6))))
        except HeliosError as e:  # e.g. the dense scores exceed one binding range
            failed[impl] = f"{type(e).__name__}: {e}"
            reps.pop((impl, 0), None)
    times = {key: [] for key in reps}
    for _ in range(rounds):
        for key, n in reps.items():
            times[key].append(_time(fns[key[0]][key[1]], n))
    res = {"bench": "attention", "B": B, "H": H, "T": T, "D": D, "causal": causal}
    for impl in IMPLS:
        if impl in failed:
            res[f"{impl}_failed"] = failed[impl]
            continue
        res[f"{impl}_fwd_ms"] = round(statistics.median(times[(impl, 0)]) * 1e3, 2)
        res[f"{impl}_fwd_bwd_ms"] = round(statistics.median(times[(impl, 1)]) * 1e3, 2)
    for other in ("dense", "torch"):
        if other not in failed and "flash" not in failed:
            res[f"flash_speedup_vs_{other}"] = round(res[f"{other}_fwd_bwd_ms"] / res["flash_fwd_bwd_ms"], 3)
            res[f"flash_fwd_speedup_vs_{other}"] = round(res[f"{other}_fwd_ms"] / res["flash_fwd_ms"], 3)
    if memory:
        for impl in ("flash", "dense"):
            if impl not in failed:
                res[f"{impl}_peak_mib"] = _peak_mib(impl, B, H, T, D, causal)
        res["torch_peak_mib"] = round(_torch_peak_bytes(B, H, T, D, causal) / 2**20, 2)
    res["torch_threads"] = torch.get_num_threads()
    res["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other work on the host skews every side
    return res


def _sparse_mask(T: int, bs: int, density: float, causal: bool) -> "np.ndarray":
    """A block mask with round(density * blocks) blocks a row: the diagonal and random others
    among the blocks the row can see (seed 0)."""
    rng = np.random.default_rng(0)
    n = -(-T // bs)
    per_row = max(1, round(density * n))
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        m[i, i] = True
        pool = np.setdiff1d(np.arange(i + 1 if causal else n), [i])
        m[i, rng.choice(pool, size=min(per_row - 1, pool.size), replace=False)] = True
    return m


def bench_sparse(kind: str, B: int, H: int, T: int, D: int, causal: bool, rounds: int, args) -> dict:
    """Block-sparse (``kind`` "sparse") or dilated attention against dense flash, same run."""
    import helios as hl
    import helios.nn.functional as F
    from helios import _kernels as K

    arrays = _inputs(B, H, T, D)
    q, k, v, g = (hl.tensor(a, requires_grad=i < 3) for i, a in enumerate(arrays))
    res = {"bench": f"attention_{kind}", "B": B, "H": H, "T": T, "D": D, "causal": causal}
    if kind == "sparse":
        m = _sparse_mask(T, args.block_size, args.density, causal)
        pairs = K.FlashBlockMask(m, args.block_size, T, T, causal).pairs
        res.update(block_size=args.block_size, density=round(float(m.mean()), 4),
                   pair_ratio=round(pairs / K._fa_pairs(T, T, causal), 4))

        def other():
            return F.block_sparse_attention(q, k, v, block_mask=m, block_size=args.block_size, is_causal=causal)
    else:
        segs = [min(w, T) for w in args.segments]
        res.update(segments=segs, dilations=args.dilations)

        def other():
            return F.dilated_attention(q, k, v, segments=segs, dilations=args.dilations, is_causal=causal)

    def flash():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def run(fn, backward: bool):
        return _timed_call(fn, backward, q, k, v, g)

    fns = {kind: (run(other, False), run(other, True)), "flash": (run(flash, False), run(flash, True))}
    reps = {}
    for impl in fns:
        for part in (0, 1):
            fns[impl][part]()  # warm-up
            reps[(impl, part)] = max(1, min(50, int(0.3 / max(_time(fns[impl][part]), 1e-6))))
    times = {key: [] for key in reps}
    for _ in range(rounds):
        for key, n in reps.items():
            times[key].append(_time(fns[key[0]][key[1]], n))
    for impl in fns:
        res[f"{impl}_fwd_ms"] = round(statistics.median(times[(impl, 0)]) * 1e3, 2)
        res[f"{impl}_fwd_bwd_ms"] = round(statistics.median(times[(impl, 1)]) * 1e3, 2)
    res["time_ratio"] = round(res[f"{kind}_fwd_bwd_ms"] / res["flash_fwd_bwd_ms"], 3)
    res["fwd_time_ratio"] = round(res[f"{kind}_fwd_ms"] / res["flash_fwd_ms"], 3)
    res["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Helios flash vs dense attention vs PyTorch CPU, same run")
    ap.add_argument("--T", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the per-process peak memory runs")
    ap.add_argument("--sparse", action="store_true", help="block-sparse attention vs dense flash instead")
    ap.add_argument("--density", type=float, default=0.1, help="--sparse: fraction of the block grid computed")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dilated", action="store_true", help="dilated attention vs dense flash instead")
    ap.add_argument("--segments", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--dilations", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--gpu-rows", type=int, nargs="+", default=None,
                    help="GPU devices: query rows a workgroup of the flash kernel owns, one run each (default: the "
                         "kernel's own choice)")
    ap.add_argument("--child", choices=("flash", "dense"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.batch, args.heads, args.T[0], args.head_dim, args.causal)))
        return 0
    from helios.runtime import get_runtime

    info = get_runtime().info
    common = {"device": info["name"], "lp_num_threads": os.environ.get("LP_NUM_THREADS", f"default ({os.cpu_count()})")}
    if args.sparse or args.dilated:
        for T in args.T:
            for kind in ("sparse",) * args.sparse + ("dilated",) * args.dilated:
                res = bench_sparse(kind, args.batch, args.heads, T, args.head_dim, args.causal, args.rounds, args)
                print(json.dumps({**res, **common}), flush=True)
        return 0
    from helios._kernels import flash

    default_rows = flash._FA_GPU_WG
    try:
        for rows in args.gpu_rows or [default_rows]:
            if args.gpu_rows and info["type"] == "cpu":
                print(json.dumps({**common, "skipped": "--gpu-rows: a CPU device runs the subgroup kernel"}))
                return 0
            flash._FA_GPU_WG = rows  # read at each dispatch
            for T in args.T:
                res = bench_T(args.batch, args.heads, T, args.head_dim, args.causal, args.rounds, args.memory)
                print(json.dumps({**res, **common, "gpu_rows": rows}), flush=True)
    finally:
        flash._FA_GPU_WG = default_rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
