"""Flash attention against Helios' dense attention and PyTorch CPU, in the same run; on
``--device cuda:N``, Helios' tensor-core flash attention against PyTorch's on the same GPU.

    python bench/attention.py [--T 64 256 1024 2048] [--batch 1] [--heads 4] [--kv-heads 4] [--head-dim 64]
                              [--rounds 5] [--no-causal] [--no-memory] [--device vulkan:N] [--dtype bf16|fp16]
                              [--sparse] [--density 0.1] [--block-size 64]
                              [--dilated] [--segments 512 1024 2048] [--dilations 1 2 4] [--smoke]
    python bench/attention.py --device cuda:0 [--dtype bf16|fp16] [--T 1024 2048 4096 8192 16384]
                              [--head-dim 64 128] [--causal | --no-causal] [--batch B] [--heads H]
                              [--rounds 5] [--tol 0.05] [--require-wgmma] [--smoke]

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

One JSON line per T: {"bench": "attention", "B", "H", "Hk", "T", "D", "causal", "<impl>_fwd_ms",
"<impl>_fwd_bwd_ms", "<impl>_peak_mib", "flash_speedup_vs_<other>" (forward + backward),
"flash_fwd_speedup_vs_<other>", ...}; a speedup is the other side's time over flash's (> 1:
flash is faster).  A path that cannot run the shape (the dense scores of 4 heads at T = 4096
are 256 MiB, over lavapipe's 128 MiB binding range) gets "<impl>_failed" with the error.

``--dtype bf16|fp16`` (not with --sparse / --dilated): Helios' q, k, v and upstream gradient in
that dtype (the float32 values rounded), as a GPT's QKV projection gives them under autocast,
and the dense path under that autocast, as the GPT trains it (the scores in 16 bits, the
softmax in float32, its product with v rounding the probabilities as it loads them); flash
attention takes the 16-bit operands as they are (on a GPU listing cooperative matrices, its
``flash_coop`` kernel).  It says where flash is worth training with on a device
(helios.nn.modules.FLASH_MIN_TRAIN_T, measured on lavapipe in float32).  The peer stays
PyTorch on the CPU in float32; each line has "dtype".

``--kv-heads Hk`` (a divisor of --heads): k and v with Hk heads, each shared by a group of query
heads (grouped-query attention, a LLaMA's): flash and PyTorch take them as they are
(``enable_gqa=True``), the dense path repeats them to --heads first.

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py; the GPU path's is below): T = 64,
B = 1, H = 2, D = 32, causal, one round of one call per block (no block sizing), the memory
runs included (``--no-memory`` leaves them out); with ``--sparse`` / ``--dilated`` the same
one-call rounds.  The same lines, their figures meaningless.

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

``--device cuda:N`` (``gpu_main``): ``helios.nn.functional.scaled_dot_product_attention`` on
``cuda:N`` with [B, H, T, D] operands in ``--dtype`` (bf16 by default; on Hopper these run the
tensor-core kernels ``flash_wgmma_fwd`` / ``flash_wgmma_bwd``) against
``torch.nn.functional.scaled_dot_product_attention`` on the same GPU in the same dtype, its
flash backend forced (``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)``: an error
rather than another backend if it cannot run).  Defaults: T = 1024 ... 16384, D = 64 and 128,
causal and not, and, as FlashAttention's benchmark sizes its runs, 16384 tokens of a 2048-wide
model in each: B = 16384 // T and H = 2048 // D (``--batch`` / ``--heads`` override them).

* Inputs: q, k, v and the upstream gradient drawn by torch (seed 0), rounded to the dtype,
  the same values on both sides.
* Check, once per configuration, before any timing: one forward + backward on each side; the
  output and dq, dk, dv compared element by element: ``max_abs_diff_{fwd,dq,dk,dv}`` (max
  |helios - peer|) and ``rel_diff_*`` (that over max |peer|).  ``numerics_ok`` is every
  ``rel_diff_*`` within ``--tol`` (0.05); a configuration that is not ok makes the exit status 1,
  so a wrong kernel cannot post a fast number unnoticed.  Helios' forward and backward run
  under ``helios.profile`` there: ``helios_kernels_fwd`` / ``helios_kernels_bwd`` name the
  kernels that ran, ``tensor_cores`` is whether they were ``flash_wgmma_fwd`` and
  ``flash_wgmma_bwd`` (``--require-wgmma``: exit 1 when not).
* Time: rounds (``--rounds``, median kept), each timing Helios' forward, Helios' forward +
  backward, then the peer's, as blocks of calls in a row lasting ~0.1 s.  The forward runs
  with autograd recording (inputs requiring grad, as in training); forward + backward is
  that forward and ``o.backward(g)``, the gradients dropped after each.  Helios: wall time
  of the block, ended by ``helios.synchronize()`` and a read-back of one element (as
  bench/matmul.py and bench/train_step.py time ``cuda:N``); the peer: CUDA events around
  the block.  **Backward time = (forward + backward) - forward**, not timed on its own.
* FLOPs (the FlashAttention papers' convention): forward 4 B H T^2 D (Q K^T and P V),
  halved when causal; backward 2.5 x the forward.  ``*_tflops`` are those over the times;
  ``ratio_{fwd,bwd,fwd_bwd}`` = Helios' TFLOP/s over the peer's (> 1: Helios faster).

One JSON line per (D, causal, T): {"bench": "attention_gpu", "dtype", "B", "H", "T", "D",
"causal", "max_abs_diff_fwd", ..., "numerics_ok", "helios_kernels_fwd", "tensor_cores",
"helios_fwd_ms", "helios_fwd_tflops", "helios_bwd_ms", "helios_bwd_tflops",
"helios_fwd_bwd_ms", ..., "peer_fwd_ms", ..., "ratio_fwd", "ratio_bwd", "ratio_fwd_bwd",
"device", "device_name", "peer", ...}; a configuration that raised gets "failed" instead.
Without a CUDA driver (or torch without CUDA) it prints one "skipped" line and exits 0.

``--smoke``: T = 128, B = 1, H = 1, D = 64, causal, one round of one call.  With
``HELIOS_CUDA_DEVICE=emulator`` the whole GPU path runs without a GPU: Helios' kernels on the
CPU emulator, the peer PyTorch on the CPU in float32 (on the same rounded values); its lines
carry ``"emulated": true`` and only the check's fields (no times: the emulator's mean
nothing).
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


def _inputs(B: int, H: int, T: int, D: int, seed: int = 0, Hk: int | None = None):
    """q, k, v, upstream gradient; k and v with ``Hk`` heads (grouped-query attention), else H."""
    rng = np.random.default_rng(seed)
    heads = (H, Hk or H, Hk or H, H)
    return [rng.standard_normal((B, h, T, D)).astype(np.float32) for h in heads]


def _helios_fns(arrays, causal: bool, dtype: str | None = None):
    """(forward, forward + backward) callables of the flash and dense paths; with ``dtype``
    ("bf16" / "fp16") q, k, v and the upstream gradient in it, and the dense path under that
    autocast, as a GPT trains (its softmax in float32, the product with v rounding it).  With
    fewer K/V heads than query heads, flash takes them as they are (``enable_gqa``) and the
    dense path repeats them first (a LLaMA's dense attention)."""
    import contextlib

    import helios as hl
    import helios.functional as HF
    import helios.nn.functional as F

    low = {"bf16": hl.bfloat16, "fp16": hl.float16}[dtype] if dtype else None
    q, k, v, g = (hl.tensor(a).to(low).requires_grad_(i < 3) if low else hl.tensor(a, requires_grad=i < 3)
                  for i, a in enumerate(arrays))
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    group = q.shape[1] // k.shape[1]

    def flash():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)

    def dense():
        kk, vv = (HF.repeat_interleave(t, group, dim=1) for t in (k, v)) if group > 1 else (k, v)
        with hl.autocast(low) if low else contextlib.nullcontext():
            return HF.matmul(HF.attention_softmax(HF.matmul(q, kk.mT), scale, causal=causal), vv)

    def run(fn, backward: bool):
        return _timed_call(fn, backward, q, k, v, g)

    return {"flash": (run(flash, False), run(flash, True)), "dense": (run(dense, False), run(dense, True))}


def _torch_fns(arrays, causal: bool):
    import torch

    q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays[:3])
    g = torch.tensor(arrays[3])
    gqa = k.shape[1] != q.shape[1]

    def fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def fwd_bwd():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        o.backward(g)
        q.grad = k.grad = v.grad = None

    return fwd, fwd_bwd


def _time(fn, reps: int = 1) -> float:
    """Seconds per call over ``reps`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _child(impl: str, B: int, H: int, T: int, D: int, causal: bool, dtype: str | None = None, Hk: int | None = None) -> dict:
    """One forward + backward of a Helios path in this (fresh) process: the activation pool's
    peak above the inputs (the pool's peak only grows, hence a process per measurement)."""
    import helios as hl
    from helios.runtime import get_runtime

    fns = _helios_fns(_inputs(B, H, T, D, Hk=Hk), causal, dtype)
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


def _torch_peak_bytes(B: int, H: int, T: int, D: int, causal: bool, Hk: int | None = None) -> int:
    """Peak bytes PyTorch's CPU allocator held during one forward + backward (see torch_peak_bytes)."""
    _, fwd_bwd = _torch_fns(_inputs(B, H, T, D, Hk=Hk), causal)
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


def _peak_mib(impl: str, B: int, H: int, T: int, D: int, causal: bool, dtype: str | None = None,
              Hk: int | None = None) -> float | str:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--batch", str(B), "--heads", str(H),
           "--head-dim", str(D), "--T", str(T)] + ([] if causal else ["--no-causal"]) + (["--dtype", dtype] if dtype else [])
    cmd += ["--kv-heads", str(Hk)] if Hk else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if not res["measurable"]:
        return "not measurable (an earlier peak was higher)"
    return round(res["peak_bytes"] / 2**20, 2)


def bench_T(B: int, H: int, T: int, D: int, causal: bool, rounds: int, memory: bool, smoke: bool = False,
            dtype: str | None = None, Hk: int | None = None) -> dict:
    import torch

    from helios import HeliosError

    arrays = _inputs(B, H, T, D, Hk=Hk)
    fns = _helios_fns(arrays, causal, dtype)
    fns["torch"] = _torch_fns(arrays, causal)
    reps, failed = {}, {}
    for impl in IMPLS:
        try:
            for part in (0, 1):
                fns[impl][part]()  # warm-up: pipeline JIT, first touch of memory
                one = _time(fns[impl][part])
                reps[(impl, part)] = 1 if smoke else max(1, min(50, int(0.3 / max(one, 1e-6))))
        except HeliosError as e:  # e.g. the dense scores exceed one binding range
            failed[impl] = f"{type(e).__name__}: {e}"
            reps.pop((impl, 0), None)
    times = {key: [] for key in reps}
    for _ in range(rounds):
        for key, n in reps.items():
            times[key].append(_time(fns[key[0]][key[1]], n))
    res = {"bench": "attention", "dtype": dtype or "fp32", "B": B, "H": H, "Hk": Hk or H, "T": T, "D": D, "causal": causal}
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
                res[f"{impl}_peak_mib"] = _peak_mib(impl, B, H, T, D, causal, dtype, Hk)
        res["torch_peak_mib"] = round(_torch_peak_bytes(B, H, T, D, causal, Hk) / 2**20, 2)
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
                   pair_ratio=round(pairs / K.flash_attn_pairs(T, T, causal), 4))

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
            reps[(impl, part)] = 1 if args.smoke else max(1, min(50, int(0.3 / max(_time(fns[impl][part]), 1e-6))))
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


# -- cuda:N: the tensor-core flash kernels against PyTorch's flash backend on the same GPU --------

GPU_TOKENS = 16384     # B * T of every GPU configuration (FlashAttention's benchmark: batch = 16384 // T)
GPU_MODEL_DIM = 2048   # H * D (its heads = 2048 // head dim)
GPU_TOL = 5e-2         # largest max |helios - peer| / max |peer| a result may show (bf16 and fp16 alike)


def attention_flops(B: int, H: int, T: int, D: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs of one attention by the FlashAttention papers' convention:
    forward 4 B H Tq Tk D (Q K^T and P V, 2 FLOPs a multiply-add), halved when causal;
    backward 2.5 x the forward (its five products against the forward's two)."""
    fwd = 4.0 * B * H * T * T * D / (2 if causal else 1)
    return fwd, 2.5 * fwd


def gpu_shape(T: int, D: int, batch: int | None, heads: int | None) -> tuple[int, int]:
    """(B, H) of a GPU configuration: --batch / --heads where given, else B = 16384 // T and
    H = 2048 // D (at least 1 each), so every configuration holds 16384 tokens of a
    2048-wide model, as FlashAttention's benchmark sizes its runs."""
    return batch or max(1, GPU_TOKENS // T), heads or max(1, GPU_MODEL_DIM // D)


def _skip_gpu(reason: str) -> int:
    print(json.dumps({"bench": "attention_gpu", "skipped": True, "reason": reason}))
    return 0


def _max_diff(got, ref) -> tuple[float, float]:
    """(max |got - ref|, that over max |ref|) of two float32 arrays; NaN anywhere gives NaN."""
    d = float(np.abs(got - ref).max())
    return d, d / max(float(np.abs(ref).max()), 1e-30)


def _kernel_names(col) -> list[str]:
    return sorted({e.name for e in col.events})


def _gpu_operands(B: int, H: int, T: int, D: int, dtype: str, peer_dev: str) -> tuple:
    """(Helios' q, k, v, g on the current device in ``dtype``, the peer's on ``peer_dev``): drawn by
    torch (seed 0) and rounded to the dtype, the same values on both sides (the emulated run's
    float32 peer gets the rounded values too); q, k, v require grad."""
    import torch

    import helios as hl

    hdt = {"bf16": hl.bfloat16, "fp16": hl.float16}[dtype]
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype] if peer_dev == "cuda" else torch.float32
    gen = torch.Generator(device=peer_dev).manual_seed(0)
    lowp = torch.bfloat16 if dtype == "bf16" else torch.float16
    host = [torch.randn((B, H, T, D), generator=gen, device=peer_dev).to(lowp).float().cpu().numpy() for _ in range(4)]
    # (uploaded as float32 and cast on the device: exact, and no host-side rounding of 33M values)
    ours = tuple(hl.tensor(a).to(hdt).requires_grad_(i < 3) for i, a in enumerate(host))
    theirs = tuple(torch.from_numpy(a).to(device=peer_dev, dtype=tdt).requires_grad_(i < 3) for i, a in enumerate(host))
    return ours, theirs


def _sdpa_calls(sdpa, operands, causal: bool) -> tuple:
    """(forward, forward + backward) of ``sdpa`` (Helios' or torch's) on ``operands`` (q, k, v, g):
    the forward records autograd, as in training; forward + backward drops the gradients after
    and returns dq."""
    q, k, v, g = operands

    def fwd():
        return sdpa(q, k, v, is_causal=causal)

    def fwd_bwd():
        sdpa(q, k, v, is_causal=causal).backward(g)
        r = q.grad
        q.grad = k.grad = v.grad = None
        return r

    return fwd, fwd_bwd


def _check(res: dict, ours, theirs, fwd_h, fwd_t, tol: float) -> None:
    """One forward + backward on each side, Helios' profiled: fills ``res`` with the differences of
    the output and dq, dk, dv, ``numerics_ok``, and the kernels that ran (``tensor_cores``:
    whether they were flash_wgmma_fwd / flash_wgmma_bwd)."""
    import helios as hl
    from helios.profile import profile

    with profile() as pf:
        o = fwd_h()
        hl.synchronize()
    with profile() as pb:
        o.backward(ours[3])
        hl.synchronize()
    q, k, v, _ = ours
    got = [t.numpy().astype(np.float32, copy=False) for t in (o, q.grad, k.grad, v.grad)]
    q.grad = k.grad = v.grad = None
    del o
    to = fwd_t()
    to.backward(theirs[3])
    tq, tk, tv, _ = theirs
    ref = [t.detach().float().cpu().numpy() for t in (to, tq.grad, tk.grad, tv.grad)]
    tq.grad = tk.grad = tv.grad = None
    del to
    rels = []
    for name, a, b in zip(("fwd", "dq", "dk", "dv"), got, ref):
        d, rel = _max_diff(a, b)
        res[f"max_abs_diff_{name}"] = float(f"{d:.3e}")
        res[f"rel_diff_{name}"] = float(f"{rel:.3e}")
        rels.append(rel)
    res["numerics_ok"] = all(rel <= tol for rel in rels)  # (a NaN is not)
    res["tol"] = tol
    res["helios_kernels_fwd"], res["helios_kernels_bwd"] = _kernel_names(pf.collector), _kernel_names(pb.collector)
    res["tensor_cores"] = ("flash_wgmma_fwd" in res["helios_kernels_fwd"]
                           and "flash_wgmma_bwd" in res["helios_kernels_bwd"])


def _helios_block(fn, n: int) -> float:
    """Seconds a call of ``fn`` (Helios) over ``n`` calls in a row, ended by a synchronize and a
    read-back of one element."""
    import helios as hl

    t0 = time.perf_counter()
    for _ in range(n):
        r = fn()
    hl.synchronize()
    r[0, 0, 0, 0].item()
    return (time.perf_counter() - t0) / n


def _torch_block(fn, n: int, cuda: bool) -> float:
    """Seconds a call of ``fn`` (torch) over ``n`` calls in a row: CUDA events around the block
    with ``cuda``, else wall time (a float32 peer on the CPU: only a dry run of this path has one)."""
    import torch

    if not cuda:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def _timed_rounds(calls: dict, rounds: int, smoke: bool) -> tuple[dict, dict]:
    """(seconds a call in each round, calls a block) by (side, part) for ``calls``: (side, part) ->
    (block timer, fn).  Blocks last ~0.1 s (one call with --smoke); the rounds interleave every
    (side, part), so both sides see the same clocks and temperature."""
    reps = {}
    for key, (block, fn) in calls.items():
        block(fn, 1)  # warm-up (the peer's first call; Helios' ran in the check)
        one = block(fn, 1)
        reps[key] = 1 if smoke else max(1, min(100, int(0.1 / max(one, 1e-6))))
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, (block, fn) in calls.items():
            times[key].append(block(fn, reps[key]))
    return times, reps


def _rates(res: dict, times: dict, B: int, H: int, T: int, D: int, causal: bool) -> None:
    """Fills ``res`` with each side's ms and TFLOP/s of the forward, the backward ((forward +
    backward) - forward) and both, from the median of ``times``, and Helios' ratios to the peer."""
    f_fwd, f_bwd = attention_flops(B, H, T, D, causal)
    flops = {"fwd": f_fwd, "bwd": f_bwd, "fwd_bwd": f_fwd + f_bwd}
    rate = {}
    for side in ("helios", "peer"):
        fwd = statistics.median(times[(side, "fwd")])
        both = statistics.median(times[(side, "fwd_bwd")])
        secs = {"fwd": fwd, "bwd": both - fwd, "fwd_bwd": both}
        for part, t in secs.items():
            res[f"{side}_{part}_ms"] = round(t * 1e3, 4)
            rate[(side, part)] = flops[part] / t if t > 0 else None  # (a backward within the noise: none)
            res[f"{side}_{part}_tflops"] = round(rate[(side, part)] / 1e12, 2) if rate[(side, part)] else None
    for part in flops:
        h, p = rate[("helios", part)], rate[("peer", part)]
        res[f"ratio_{part}"] = round(h / p, 3) if h and p else None


def bench_gpu(B: int, H: int, T: int, D: int, causal: bool, dtype: str, rounds: int, peer_dev: str,
              emulated: bool, smoke: bool, tol: float) -> dict:
    """One configuration on the current cuda:N device against torch on ``peer_dev`` (see the
    module docstring): the numerics check, the kernels the profiler saw, and (unless emulated)
    the timed rounds."""
    import contextlib
    import functools

    import torch.nn.functional as TF

    import helios.nn.functional as F

    res = {"bench": "attention_gpu", "dtype": dtype, "B": B, "H": H, "T": T, "D": D, "causal": causal}
    ours, theirs = _gpu_operands(B, H, T, D, dtype, peer_dev)
    h_fwd, h_fwd_bwd = _sdpa_calls(F.scaled_dot_product_attention, ours, causal)
    t_fwd, t_fwd_bwd = _sdpa_calls(TF.scaled_dot_product_attention, theirs, causal)
    if peer_dev == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        forced = sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # an error, not a silent fallback, if it cannot run
    else:
        forced = contextlib.nullcontext()
    with forced:
        _check(res, ours, theirs, h_fwd, t_fwd, tol)
        if emulated:  # the CPU emulator's times mean nothing: the check is the point
            return res
        torch_block = functools.partial(_torch_block, cuda=peer_dev == "cuda")
        calls = {("helios", "fwd"): (_helios_block, h_fwd), ("helios", "fwd_bwd"): (_helios_block, h_fwd_bwd),
                 ("peer", "fwd"): (torch_block, t_fwd), ("peer", "fwd_bwd"): (torch_block, t_fwd_bwd)}
        times, reps = _timed_rounds(calls, rounds, smoke)
    _rates(res, times, B, H, T, D, causal)
    res["reps"] = {f"{s}_{p}": n for (s, p), n in reps.items()}
    res["rounds"] = rounds
    return res


def gpu_main(args) -> int:
    """--device cuda:N: one JSON line per (D, causal, T); exit status 1 when a result is off."""
    from helios.cuda_ptx import driver

    emulated = driver.emulator_requested()
    ok, why = driver.driver_status()
    if not ok and not emulated:
        return _skip_gpu(f"no usable CUDA driver: {why}")
    try:
        import torch
    except ImportError:
        return _skip_gpu("torch is not installed (the peer)")
    if not emulated and not torch.cuda.is_available():
        return _skip_gpu("torch has no CUDA device (the peer needs one)")
    from helios.runtime import get_runtime, set_device

    set_device(args.device)
    rt = get_runtime()
    peer_dev = "cpu" if emulated else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    common = {"device": rt.name, "device_name": rt.info["name"],
              "peer": f"torch_sdpa_flash_{args.dtype}" if peer_dev == "cuda" else "torch_cpu_float32",
              **({"emulated": True} if emulated else {}), **({"smoke": True} if args.smoke else {})}
    if peer_dev == "cuda":
        common["peer_device_name"] = torch.cuda.get_device_name()
    causals = [args.causal] if args.causal is not None else ([True] if args.smoke else [True, False])
    bad = []
    for D in args.head_dim:
        for causal in causals:
            for T in args.T:
                B, H = gpu_shape(T, D, args.batch, args.heads)
                try:
                    res = bench_gpu(B, H, T, D, causal, args.dtype, args.rounds, peer_dev, emulated, args.smoke, args.tol)
                except Exception as e:  # one configuration's failure is its line, not the run's end
                    msg = str(e).strip().splitlines()
                    res = {"bench": "attention_gpu", "dtype": args.dtype, "B": B, "H": H, "T": T, "D": D,
                           "causal": causal, "failed": f"{type(e).__name__}: {msg[0] if msg else ''}"}
                print(json.dumps({**res, **common}), flush=True)
                if "failed" in res or not res["numerics_ok"] or (args.require_wgmma and not res["tensor_cores"]):
                    bad.append(f"T={T} D={D} causal={causal}")
    if bad:
        print(f"attention: off (failed, numerics beyond --tol{', or not on the tensor-core kernels' if args.require_wgmma else ''}):"
              f" {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Helios flash vs dense attention vs PyTorch CPU, same run; with --device "
                                             "cuda:N, the tensor-core flash kernels vs PyTorch's flash backend on the GPU")
    ap.add_argument("--device", default=None,
                    help="Helios device (default: HELIOS_DEVICE or the best one); cuda:N runs the GPU comparison")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                    help="--device cuda:N: the operands' dtype (bf16); other devices: q, k, v in it and the dense path "
                         "under its autocast (default float32)")
    ap.add_argument("--T", type=int, nargs="+", default=None,
                    help="sequence lengths (default 64 256 1024 2048; cuda:N 1024 2048 4096 8192 16384)")
    ap.add_argument("--batch", type=int, default=None, help="default 1; cuda:N 16384 // T")
    ap.add_argument("--heads", type=int, default=None, help="default 4; cuda:N 2048 // head dim")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads, dividing --heads (grouped-query attention; default as many as --heads)")
    ap.add_argument("--head-dim", type=int, nargs="+", default=None, help="one run each (default 64; cuda:N 64 128)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, the median kept (default 5; --smoke 1)")
    ap.add_argument("--causal", dest="causal", action="store_const", const=True, default=None,
                    help="causal only (the default on the default device; cuda:N runs both)")
    ap.add_argument("--no-causal", dest="causal", action="store_const", const=False, help="non-causal only")
    ap.add_argument("--smoke", action="store_true",
                    help="one tiny causal configuration, one round of one call: T 64, B 1, H 2, D 32 (cuda:N: T 128, "
                         "B 1, H 1, D 64; with HELIOS_CUDA_DEVICE=emulator it runs without a GPU, the check only, "
                         "against torch CPU)")
    ap.add_argument("--tol", type=float, default=GPU_TOL,
                    help="cuda:N: largest max |helios - peer| / max |peer| of the output and each gradient")
    ap.add_argument("--require-wgmma", action="store_true",
                    help="cuda:N: exit 1 unless the profiler saw flash_wgmma_fwd and flash_wgmma_bwd run")
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
    if args.kv_heads is not None and (args.sparse or args.dilated or (args.device or "").startswith("cuda")):
        ap.error("--kv-heads times flash against dense attention on Vulkan devices; not with --sparse, --dilated "
                 "or --device cuda:N")
    if args.device and args.device.startswith("cuda"):
        if args.sparse or args.dilated or args.gpu_rows or args.child:
            ap.error("--sparse, --dilated and --gpu-rows time the Vulkan kernels; not with --device cuda:N")
        args.dtype = args.dtype or "bf16"
        if args.smoke:
            args.T, args.batch, args.heads = args.T or [128], args.batch or 1, args.heads or 1
            args.head_dim, args.rounds = args.head_dim or [64], args.rounds or 1
        args.T = args.T or [1024, 2048, 4096, 8192, 16384]
        args.head_dim = args.head_dim or [64, 128]
        args.rounds = args.rounds or 5
        return gpu_main(args)
    if args.require_wgmma:
        ap.error("--require-wgmma goes with --device cuda:N")
    if args.dtype and (args.sparse or args.dilated):
        ap.error("--dtype times flash against dense attention; not with --sparse or --dilated")
    if args.smoke:
        args.T, args.batch, args.heads = args.T or [64], args.batch or 1, args.heads or 2
        args.head_dim, args.rounds = args.head_dim or [32], args.rounds or 1
    args.T = args.T or [64, 256, 1024, 2048]
    args.batch, args.heads = args.batch or 1, args.heads or 4
    args.head_dim = args.head_dim or [64]
    args.rounds = args.rounds or 5
    args.causal = True if args.causal is None else args.causal
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        ap.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.child:
        print(json.dumps(_child(args.child, args.batch, args.heads, args.T[0], args.head_dim[0], args.causal, args.dtype,
                                args.kv_heads)))
        return 0
    from helios.runtime import get_runtime, set_device

    if args.device:
        set_device(args.device)
        os.environ["HELIOS_DEVICE"] = args.device  # the peak-memory children's device too
    info = get_runtime().info
    common = {"device": info["name"], "lp_num_threads": os.environ.get("LP_NUM_THREADS", f"default ({os.cpu_count()})")}
    if args.sparse or args.dilated:
        for D in args.head_dim:
            for T in args.T:
                for kind in ("sparse",) * args.sparse + ("dilated",) * args.dilated:
                    res = bench_sparse(kind, args.batch, args.heads, T, D, args.causal, args.rounds, args)
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
            for D in args.head_dim:
                for T in args.T:
                    res = bench_T(args.batch, args.heads, T, D, args.causal, args.rounds, args.memory, args.smoke,
                                  args.dtype, args.kv_heads)
                    print(json.dumps({**res, **common, "gpu_rows": rows}), flush=True)
    finally:
        flash._FA_GPU_WG = default_rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
