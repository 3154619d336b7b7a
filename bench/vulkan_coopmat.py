"""float16 GEMM on a Vulkan GPU's cooperative matrices (matmul_coop.comp) against the shared-memory
kernel and cuBLAS float16 (torch.matmul on CUDA), on the same GPU, in one process.

    python bench/vulkan_coopmat.py [--sizes 4096] [--layouts nn nt tn] [--rounds 5] [--smoke]

For each square size and layout (``nt`` = A @ B^T, ``tn`` = A^T @ B, transposed views as in
bench/matmul.py, whose timing this reuses: warm-up, then rounds of back-to-back products timed
to ``helios.synchronize()``, the median kept) it times the default device's product three
ways: with the cooperative-matrix kernel allowed (what helios.matmul chooses: ``kernel`` and
``tile`` say which it took and ``reason`` why), with it switched off (``coopmat.set_enabled(False)``:
the shared-memory kernel), and cuBLAS in float16 on CUDA.  Each line also carries the coopmat
run's error against numpy's fp32 product of the same fp16 values (``rel_err``: max |diff| /
max |ref|), so speed is never reported for a wrong result.  One JSON line per shape and layout:
{"bench": "vulkan_coopmat", "device", "size", "layout", "kernel", "tile", "reason",
"coopmat_gflops", "plain_gflops", "cublas_fp16_gflops", "ratio_vs_cublas", "speedup_vs_plain",
"rel_err"}; ``cublas_skipped`` says why there is no peer (no torch, no CUDA).

Where the device lists no cooperative matrices (lavapipe) both Helios runs take the same kernel
and ``kernel`` says "matmul".  ``--smoke`` (tests/test_bench_smoke.py): 64^3, nn and nt, one
round; figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import matmul as mm  # noqa: E402 - bench/matmul.py: operands, timing and the CUDA peer

from helios._kernels import coopmat  # noqa: E402
from helios.runtime import get_runtime  # noqa: E402


def bench_one(size: int, layout: str, rounds: int, rng) -> dict:
    """The line of one square product: coopmat allowed, switched off, and cuBLAS fp16."""
    rt = get_runtime()
    choice = coopmat.choice_for(rt, "float16", size, size, size)
    row = {"size": size, "layout": layout, "kernel": choice.kernel,
           "tile": choice.tile.label() if choice.tile else None, "reason": choice.reason}
    fast = mm.bench_shape(size, size, size, layout, "float16", rounds, rng, numpy_peer=False)
    was = coopmat.set_enabled(False)
    try:
        plain = mm.bench_shape(size, size, size, layout, "float16", rounds, rng, numpy_peer=False)
    finally:
        coopmat.set_enabled(was)
    row.update(coopmat_gflops=fast["helios_gflops"], plain_gflops=plain["helios_gflops"], rel_err=fast["rel_err"],
               plain_rel_err=plain["rel_err"], speedup_vs_plain=round(fast["helios_gflops"] / plain["helios_gflops"], 3))
    peer = mm.cuda_peer_gflops(size, size, size, layout, rounds, "float16")
    if isinstance(peer, str):
        row["cublas_skipped"] = peer
    else:
        row.update(cublas_fp16_gflops=round(peer, 1), ratio_vs_cublas=round(fast["helios_gflops"] / peer, 4))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Helios fp16 matmul on cooperative matrices vs its shared-memory kernel and cuBLAS")
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="square sizes (default 4096; --smoke 64)")
    ap.add_argument("--layouts", nargs="+", default=None, choices=["nn", "nt", "tn", "tt"],
                    help="default nn nt tn; --smoke nn nt")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, median kept (default 5; --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 64^3, nn and nt, one round")
    args = ap.parse_args(argv)
    sizes = args.sizes or ([64] if args.smoke else [4096])
    layouts = args.layouts or (["nn", "nt"] if args.smoke else ["nn", "nt", "tn"])
    rounds = args.rounds or (1 if args.smoke else 5)
    rt = get_runtime()
    common = {"bench": "vulkan_coopmat", "device": rt.name, "device_name": (getattr(rt, "info", None) or {}).get("name"),
              "coopmat_shapes": [s.label() for s in coopmat.shapes_of(getattr(rt, "info", None) or {})]}
    rng = np.random.default_rng(0)
    for size in sizes:
        for layout in layouts:
            print(json.dumps({**common, **bench_one(size, layout, rounds, rng)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
