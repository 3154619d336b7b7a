"""float16 and bfloat16 GEMM on a Vulkan GPU's cooperative matrices (matmul_coop.comp) against the
shared-memory kernel and cuBLAS in the same dtype (torch.matmul on CUDA), on the same GPU, in one process.

    python bench/vulkan_coopmat.py [--sizes 4096] [--layouts nn nt tn] [--dtypes float16 bfloat16]
                                   [--rounds 5] [--attn-T 1024 4096] [--attn-head-dims 64 128] [--smoke]

For each dtype, square size and layout (``nt`` = A @ B^T, ``tn`` = A^T @ B, transposed views as in
bench/matmul.py, whose timing this reuses: warm-up, then rounds of back-to-back products timed
to ``helios.synchronize()``, the median kept) it times the default device's product three
ways: with the cooperative-matrix kernel allowed (what helios.matmul chooses: ``kernel`` and
``tile`` say which it took and ``reason`` why), with it switched off (``coopmat.set_enabled(False)``:
the shared-memory kernel), and cuBLAS in the same dtype on CUDA.  Each line also carries the
coopmat run's error against numpy's fp32 product of the same 16-bit values (``rel_err``: max
|diff| / max |ref|), so speed is never reported for a wrong result.  One JSON line per dtype,
shape and layout: {"bench": "vulkan_coopmat", "device", "dtype", "size", "layout", "kernel",
"tile", "reason", "coopmat_gflops", "plain_gflops", "cublas_gflops", "ratio_vs_cublas",
"speedup_vs_plain", "rel_err"}; ``cublas_skipped`` says why there is no peer (no torch, no CUDA).

Then flash attention in each dtype (``--attn-T``, ``--attn-head-dims``, causal and not; batch x heads =
16384 // T x 2048 // head dim, as bench/attention.py's GPU runs): ``scaled_dot_product_attention``'s
forward, and forward + backward, with cooperative matrices allowed (flash_coop.comp where the device
lists them) and switched off (flash_attn.comp's shared-memory kernel), against PyTorch's SDPA in
the same dtype on CUDA.  One JSON line each: {"bench": "vulkan_flash_coop", "dtype", "T", "D", "causal", "kernel",
"plan", "reason", "coop_fwd_ms", "coop_fwd_bwd_ms", "plain_fwd_ms", "plain_fwd_bwd_ms",
"torch_fwd_ms", "torch_fwd_bwd_ms", "coop_fwd_tflops", "coop_fwd_bwd_tflops", "ratio_fwd_vs_torch",
"ratio_fwd_bwd_vs_torch", "rel_err"} (rel_err: the coopmat run's output and gradients against the
shared-memory kernel's, max |diff| / max |ref|); ``torch_skipped`` says why there is no peer.

Where the device lists no cooperative matrices (lavapipe) both Helios runs take the same kernel
and ``kernel`` says "matmul" / "flash_attn".  ``--smoke`` (tests/test_bench_smoke.py): 64^3, nn and
nt, and attention at T 64, head dim 64, causal, batch 1, 2 heads; one round; figures meaningless.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import matmul as mm  # noqa: E402 - bench/matmul.py: operands, timing and the CUDA peer

from helios._kernels import coopmat  # noqa: E402
from helios.runtime import get_runtime  # noqa: E402


def bench_one(size: int, layout: str, rounds: int, rng, dtype: str = "float16") -> dict:
    """The line of one square product of ``dtype`` operands: coopmat allowed, switched off, and cuBLAS."""
    rt = get_runtime()
    choice = coopmat.choice_for(rt, dtype, size, size, size)
    row = {"dtype": dtype, "size": size, "layout": layout, "kernel": choice.kernel,
           "tile": choice.tile.label() if choice.tile else None, "reason": choice.reason}
    fast = mm.bench_shape(size, size, size, layout, dtype, rounds, rng, numpy_peer=False)
    was = coopmat.set_enabled(False)
    try:
        plain = mm.bench_shape(size, size, size, layout, dtype, rounds, rng, numpy_peer=False)
    finally:
        coopmat.set_enabled(was)
    row.update(coopmat_gflops=fast["helios_gflops"], plain_gflops=plain["helios_gflops"], rel_err=fast["rel_err"],
               plain_rel_err=plain["rel_err"], speedup_vs_plain=round(fast["helios_gflops"] / plain["helios_gflops"], 3))
    peer = mm.cuda_peer_gflops(size, size, size, layout, rounds, dtype)
    if isinstance(peer, str):
        row["cublas_skipped"] = peer
    else:
        row.update(cublas_gflops=round(peer, 1), ratio_vs_cublas=round(fast["helios_gflops"] / peer, 4))
    return row


def _timed(fn, rounds: int) -> float:
    """Milliseconds per call of ``fn`` (which ends synchronised): one warm-up call, then the median of ``rounds``."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _helios_attention(q, k, v, g, causal: bool, rounds: int, dtype: str = "float16") -> tuple:
    """(forward ms, forward + backward ms, [O, dQ, dK, dV] as numpy) of helios SDPA on ``dtype`` operands."""
    import helios as hl
    import helios.nn.functional as F

    hq, hk, hv = (hl.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    hg = hl.tensor(g, dtype=dtype)

    def fwd():
        with hl.no_grad():
            F.scaled_dot_product_attention(hq, hk, hv, is_causal=causal)
        hl.synchronize()

    def fwd_bwd():
        for t in (hq, hk, hv):
            t.grad = None
        F.scaled_dot_product_attention(hq, hk, hv, is_causal=causal).backward(hg)
        hl.synchronize()

    f, fb = _timed(fwd, rounds), _timed(fwd_bwd, rounds)
    o = F.scaled_dot_product_attention(hq, hk, hv, is_causal=causal)
    return f, fb, [o.numpy()] + [t.grad.numpy() for t in (hq, hk, hv)]


def _torch_attention(q, k, v, g, causal: bool, rounds: int, dtype: str = "float16"):
    """(forward ms, forward + backward ms) of PyTorch's SDPA in ``dtype`` on CUDA, or why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device for the PyTorch peer"
    tq, tk, tv = (torch.tensor(x, dtype=getattr(torch, dtype), device="cuda", requires_grad=True) for x in (q, k, v))
    tg = torch.tensor(g, dtype=getattr(torch, dtype), device="cuda")

    def fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        torch.cuda.synchronize()

    def fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tg)
        torch.cuda.synchronize()

    return _timed(fwd, rounds), _timed(fwd_bwd, rounds)


def bench_attention(T: int, D: int, causal: bool, B: int, H: int, rounds: int, rng, dtype: str = "float16") -> dict:
    """The line of one attention shape: flash_coop allowed, switched off, and PyTorch CUDA."""
    from helios import flash

    rt = get_runtime()
    ch = coopmat.flash_choice_for(rt, dtype, D)
    row = {"bench": "vulkan_flash_coop", "dtype": dtype, "B": B, "H": H, "T": T, "D": D, "causal": causal,
           "kernel": ch.kernel, "plan": "; ".join(f"pass {p.mode}: {p.label()}" for p in ch.plans) or None,
           "reason": ch.reason}
    q, k, v, g = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4))
    cf, cfb, got = _helios_attention(q, k, v, g, causal, rounds, dtype)
    was = coopmat.set_enabled(False)
    try:
        pf, pfb, want = _helios_attention(q, k, v, g, causal, rounds, dtype)
    finally:
        coopmat.set_enabled(was)
    flops = 4 * B * H * flash.pairs(T, T, causal) * D  # the forward; the backward is 2.5x it
    row.update(coop_fwd_ms=round(cf, 3), coop_fwd_bwd_ms=round(cfb, 3), plain_fwd_ms=round(pf, 3),
               plain_fwd_bwd_ms=round(pfb, 3), coop_fwd_tflops=round(flops / cf / 1e9, 3),
               coop_fwd_bwd_tflops=round(3.5 * flops / cfb / 1e9, 3),
               rel_err=max(float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max() / max(1e-6, np.abs(b).max()))
                           for a, b in zip(got, want)))
    peer = _torch_attention(q, k, v, g, causal, rounds, dtype)
    if isinstance(peer, str):
        row["torch_skipped"] = peer
    else:
        row.update(torch_fwd_ms=round(peer[0], 3), torch_fwd_bwd_ms=round(peer[1], 3),
                   ratio_fwd_vs_torch=round(peer[0] / cf, 4), ratio_fwd_bwd_vs_torch=round(peer[1] / cfb, 4))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Helios 16-bit matmul on cooperative matrices vs its shared-memory kernel and cuBLAS")
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="square sizes (default 4096; --smoke 64; none: no GEMM)")
    ap.add_argument("--layouts", nargs="+", default=None, choices=["nn", "nt", "tn", "tt"],
                    help="default nn nt tn; --smoke nn nt")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"],
                    help="operand dtypes of the GEMMs and the attention (default both)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, median kept (default 5; --smoke 1)")
    ap.add_argument("--attn-T", type=int, nargs="*", default=None,
                    help="attention sequence lengths (default 1024 4096; --smoke 64; none: no attention)")
    ap.add_argument("--attn-head-dims", type=int, nargs="+", default=None, help="default 64 128; --smoke 64")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 64^3, nn and nt, attention at T 64; one round")
    args = ap.parse_args(argv)
    sizes = args.sizes if args.sizes is not None else ([64] if args.smoke else [4096])
    layouts = args.layouts or (["nn", "nt"] if args.smoke else ["nn", "nt", "tn"])
    rounds = args.rounds or (1 if args.smoke else 5)
    rt = get_runtime()
    common = {"bench": "vulkan_coopmat", "device": rt.name, "device_name": (getattr(rt, "info", None) or {}).get("name"),
              "coopmat_shapes": [s.label() for s in coopmat.shapes_of(getattr(rt, "info", None) or {})]}
    rng = np.random.default_rng(0)
    for dtype, size, layout in itertools.product(args.dtypes, sizes, layouts):
        print(json.dumps({**common, **bench_one(size, layout, rounds, rng, dtype)}), flush=True)
    attn_T = args.attn_T if args.attn_T is not None else ([64] if args.smoke else [1024, 4096])
    head_dims = args.attn_head_dims or ([64] if args.smoke else [64, 128])
    for dtype, D, T, causal in itertools.product(args.dtypes, head_dims, attn_T, (True,) if args.smoke else (False, True)):
        B, H = (1, 2) if args.smoke else (max(1, 16384 // T), max(1, 2048 // D))
        print(json.dumps({**common, **bench_attention(T, D, causal, B, H, rounds, rng, dtype)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
