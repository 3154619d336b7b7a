"""GEMM TFLOP/s of every helios.cuda_ptx variant against torch.matmul (cuBLAS), same GPU, same run.

    python bench/ptx_gemm.py [--sizes 4096 8192] [--variants wgmma_ws wgmma_fp8] [--iters 20] [--b-major k|n]

One JSON line per (variant, size): {"bench", "helios", "peer", "ratio", "unit", "rel_err",
"peer_rel_err", "b_major", ...}; errors are max |C - ref| / max |ref| against an fp32
reference from the inputs as rounded to the kernel's input dtype.  ``--b-major`` picks
how B is stored on the device for every variant: ``k`` (default) ``N x K`` as a Linear
weight, ``n`` ``K x N`` (the wgmma rungs then read it through ``imm-trans-b``); fp8 has
no N-major form and is reported as skipped under ``n``.  The peer multiplies the same
storage (a transposed view for ``k``).  Without a GPU it prints one line saying it
skipped and why, and exits 0.

``HELIOS_CUDA_DEVICE=emulator`` dry-runs the whole script without a GPU: the kernels on
the CPU emulator, the peer with torch on the CPU.  Its lines carry ``"emulated": true``
and their rates mean nothing; it exists to check the script (use small ``--sizes``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _skip(reason: str, b_major: str) -> int:
    print(json.dumps({"bench": "ptx_gemm", "skipped": True, "b_major": b_major, "reason": reason}))
    return 0


def _torch_time_ms(torch, fn, iters: int, dev: str) -> float:
    fn()
    if dev == "cpu":  # the emulated dry run
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


SETTABLE = ("inflight", "group_m", "stages", "tma_store", "persistent", "cluster")
WS_ONLY = ("persistent", "cluster")  # need the warp-specialised producer layout


def _applicable(cfg, overrides: dict) -> dict:
    """The ``--set`` overrides that apply to ``cfg``: none off the wgmma kinds, and
    ``persistent``/``cluster`` only on warp-specialised configs."""
    if cfg.kind != "wgmma":
        return {}
    return {k: v for k, v in overrides.items() if cfg.producer or k not in WS_ONLY}


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The command line, and the ``--set`` overrides as {field: value}."""
    ap = argparse.ArgumentParser(description="helios.cuda_ptx GEMM vs cuBLAS")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--b-major", choices=("k", "n"), default="k",
                    help="B stored N x K (k, as a Linear weight) or K x N (n) on the device")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=INT",
                    help="override an integer GemmConfig field on every wgmma variant, e.g. "
                         "--set inflight=0 --set group_m=0 --set tma_store=0 (A/B of the pipeline choices); "
                         "persistent= and cluster= apply to the warp-specialised ones only")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.overrides:
        field, _, value = item.partition("=")
        if field not in SETTABLE or not value.lstrip("-").isdigit():
            ap.error(f"--set takes {'=, '.join(SETTABLE)}= with an integer, got {item!r}")
        overrides[field] = bool(int(value)) if field in ("tma_store", "persistent") else int(value)
    return args, overrides


def _peer(torch, cfg, ra, rb, b_major: str, dev: str):
    """The peer's product on the same rounded inputs: torch._scaled_mm for fp8, else
    torch.matmul (cuBLAS) on B stored as the kernel stores it."""
    if cfg.in_dtype == "e4m3":
        pa = ra.to(torch.float8_e4m3fn)
        pb = rb.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major B for _scaled_mm
        one = torch.ones((), device=dev)
        out_t = torch.float32 if cfg.out_dtype == "f32" else torch.bfloat16
        return lambda: torch._scaled_mm(pa, pb, scale_a=one, scale_b=one, out_dtype=out_t)
    tdt = torch.bfloat16 if cfg.in_dtype == "bf16" else torch.float16
    pa, pb = ra.to(tdt), rb.to(tdt)
    if b_major == "k":  # the same storage as the kernel's: N x K, multiplied transposed
        pb = pb.t().contiguous().t()
    return lambda: torch.matmul(pa, pb)


def _measure(torch, ctx, cfg, a, b, iters: int, dev: str) -> dict:
    """One variant at one size: the kernel's and the peer's times and errors against the fp32
    reference of the inputs as rounded to the kernel's input dtype, as the result line's fields."""
    from helios.cuda_ptx import dtypes
    from helios.cuda_ptx.runner import GemmLaunch

    (m, k), n = a.shape, b.shape[1]
    launch = GemmLaunch(cfg, m, n, k, ctx)
    launch.upload(a, b)
    launch.run()
    c = launch.result()
    ms = ctx.time_ms(launch.run, iters)
    launch.close()
    ra = torch.from_numpy(dtypes.decode(dtypes.encode(a, cfg.in_dtype), cfg.in_dtype)).to(dev)
    rb = torch.from_numpy(dtypes.decode(dtypes.encode(b, cfg.in_dtype), cfg.in_dtype)).to(dev)
    ref = ra @ rb  # fp32, TF32 off
    scale = ref.abs().max().item()
    err = (torch.from_numpy(c).to(dev) - ref).abs().max().item() / scale
    peer = _peer(torch, cfg, ra, rb, cfg.b_major, dev)
    pms = _torch_time_ms(torch, peer, iters, dev)
    perr = (peer().float() - ref).abs().max().item() / scale
    flops = 2.0 * m * n * k
    h, p = flops / ms / 1e9, flops / pms / 1e9
    return {
        "bench": f"gemm_{cfg.name}_{cfg.in_dtype}_{m}", "helios": round(h, 1), "peer": round(p, 1),
        "ratio": round(h / p, 3), "unit": "TFLOP/s", "rel_err": err, "peer_rel_err": perr,
        "peer_name": "torch._scaled_mm" if cfg.in_dtype == "e4m3" else "torch.matmul (cuBLAS)",
        "b_major": cfg.b_major, "inflight": cfg.inflight, "group_m": cfg.group_m, "stages": cfg.stages,
        "persistent": cfg.persistent, "tma_store": cfg.tma_store, "cluster": cfg.cluster,
        "ctas": launch.grid[0] * launch.grid[1], "device": ctx.name,
    }


def _skip_reason(cfg, name: str, b_major: str, ctx) -> str | None:
    """Why a variant cannot run here as asked, or None."""
    if cfg.in_dtype == "e4m3" and b_major == "n":
        return "fp8 wgmma reads B K-major only; run it with --b-major k"
    if cfg.target == "sm_90a" and ctx.cc != (9, 0):
        return f"{name} needs sm_90a, device is sm_{ctx.cc[0]}{ctx.cc[1]}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Every variant at every size, one JSON line each (or one line saying why none ran)."""
    args, overrides = _parse_args(argv)
    from helios.cuda_ptx import driver, variants

    emulated = driver.emulator_requested()
    ok, why = driver.driver_status()
    if not ok and not emulated:
        return _skip(f"no usable CUDA driver: {why}", args.b_major)
    try:
        import torch
    except ImportError:
        return _skip("torch is not installed (the cuBLAS peer)", args.b_major)
    if not torch.cuda.is_available() and not emulated:
        return _skip("torch has no CUDA device (the cuBLAS peer needs one)", args.b_major)
    import numpy as np

    dev = "cpu" if emulated else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx = driver.context()
    vs = variants()
    bmaj = args.b_major
    for size in args.sizes:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((size, size), dtype=np.float32)
        b = rng.standard_normal((size, size), dtype=np.float32)
        for name in args.variants or list(vs):
            cfg = vs[name]
            reason = _skip_reason(cfg, name, bmaj, ctx)
            if reason is not None:
                print(json.dumps({"bench": f"gemm_{name}_{size}", "skipped": True, "b_major": bmaj, "reason": reason}))
                continue
            cfg = cfg.with_(b_major=bmaj, **_applicable(cfg, overrides))
            line = _measure(torch, ctx, cfg, a, b, args.iters, dev)
            print(json.dumps({**line, **({"emulated": True} if emulated else {})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
