"""First contact with a GPU: every variant once, small, each in its own process under a short deadline.

    python -m helios.cuda_ptx.smoke [VARIANT ...] [--timeout 60]

One JSON line per (variant, B layout): ``{"name", "b_major", "status", "rel_err",
"seconds", "detail"}`` with status ``ok``, ``wrong`` (relative error over the
variant's tolerance), ``error`` (the launch failed; ``detail`` holds the message)
or ``hang`` (no answer before the deadline: a wrong mbarrier phase looks like
this).  Each 16-bit variant runs with B stored both ways; fp8 K-major only.

A hung kernel would hold every later GPU test of its variant for that test's whole
deadline, so ``scripts/gpu_check.sh`` runs this first and hands the hung ones to the
tests as ``HELIOS_GPU_SKIP`` (``name:b_major`` items, comma-separated) and leaves
them out of the benchmark.  Exit status 0 when every run is ``ok``, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time

from helios.errors import DeviceError

from .config import variants
from .runner import run_isolated

# Odd sizes: the zero padding to tile multiples is exercised too.
SHAPE = (300, 520, 200)

LAUNCH_CHECK = textwrap.dedent("""
    import json, numpy as np
    import helios.cuda_ptx as cp
    from helios.cuda_ptx import dtypes
    from helios.cuda_ptx.runner import GemmLaunch
    name, b_major, m, n, k = {args!r}
    cfg = cp.variants()[name].with_(b_major=b_major)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    launch = GemmLaunch(cfg, m, n, k)
    launch.upload(a, b)
    launch.run()
    c = launch.result()
    launch.close()
    r = lambda x: dtypes.decode(dtypes.encode(x, cfg.in_dtype), cfg.in_dtype).astype(np.float64)
    ref = r(a) @ r(b)
    tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
    print(json.dumps({{"rel_err": float(np.abs(c - ref).max() / np.abs(ref).max()), "tiles": tiles,
                      "ctas": launch.grid[0] * launch.grid[1], "sm_count": launch.ctx.sm_count}}))
""")


def launch_check(name: str, b_major: str, m: int, n: int, k: int) -> str:
    """Python source that runs variant ``name`` with B stored ``b_major`` once through
    :class:`runner.GemmLaunch` on normal random inputs and prints one JSON line:
    ``rel_err`` (max |C - ref| / max |ref|, ref from the inputs rounded to the input
    dtype), ``tiles``, ``ctas`` (launched) and ``sm_count``.  Run it with :func:`runner.run_isolated`."""
    return LAUNCH_CHECK.format(args=(name, b_major, m, n, k))


def tolerance(in_dtype: str) -> float:
    """Relative error an fp32 output may show: fp32 accumulation, except Hopper's fp8
    wgmma, which accumulates with fewer bits."""
    return 2e-3 if in_dtype == "e4m3" else 1e-5


def layouts(name: str) -> list[str]:
    """The B layouts variant ``name`` is smoke-tested with: its own first, then the other
    where the kernel can read it (not for fp8, which wgmma reads K-major only)."""
    cfg = variants()[name]
    own = cfg.b_major
    other = "n" if own == "k" else "k"
    return [own] if cfg.in_dtype == "e4m3" else [own, other]


def smoke_one(name: str, b_major: str, timeout: float) -> dict:
    """Run one launch check; classify it as ok / wrong / error / hang."""
    t0 = time.perf_counter()
    out = {"name": name, "b_major": b_major, "status": "ok", "rel_err": None, "seconds": None, "detail": ""}
    try:
        r = run_isolated(launch_check(name, b_major, *SHAPE), timeout=timeout)
    except DeviceError as e:
        out.update(status="hang", detail=str(e).splitlines()[0])
    else:
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            out.update(status="error", detail=(r.stderr.strip().splitlines() or ["no output"])[-1])
        else:
            err = json.loads(lines[-1])["rel_err"]
            out["rel_err"] = err
            if not err < tolerance(variants()[name].in_dtype):  # NaN counts as wrong
                out["status"] = "wrong"
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: smoke-test the named variants (default all), one JSON line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="variants (default: all of variants())")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per run before it counts as hung")
    args = ap.parse_args(argv)
    vs = variants()
    unknown = [n for n in args.names if n not in vs]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(vs)}")
    ok = True
    for name in args.names or list(vs):
        for b_major in layouts(name):
            res = smoke_one(name, b_major, args.timeout)
            ok &= res["status"] == "ok"
            print(json.dumps(res), flush=True)
    return 0 if ok else 1


def skipped_on_gpu() -> set[tuple[str, str]]:
    """``(name, b_major)`` pairs listed in ``HELIOS_GPU_SKIP`` (``name:b_major``, comma-separated)."""
    items = [s.strip() for s in os.environ.get("HELIOS_GPU_SKIP", "").split(",") if s.strip()]
    return {tuple(s.split(":", 1)) for s in items if ":" in s}


if __name__ == "__main__":
    raise SystemExit(main())
