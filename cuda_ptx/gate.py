"""The gate every generated kernel passes without a GPU.

For one :class:`GemmConfig`: ptxas accepts the PTX for the config's target; ``-v``
reports 0 bytes of spill and no stack frame; none of the informational notes that
mean a silent slowdown appear (C7508 setmaxnreg ignored, C7510 wgmma across a call,
C7511 wgmma serialised, C7517/C7519 injected waits/arrives -- ptxas prints these as
``info``, so ``-Werror`` does not catch them); and the SASS holds the instructions
the rung is about (HMMA, HGMMA, QGMMA, UTMALDG, USETMAXREG, UTMALDG.2D.MULTICAST...),
and no GPU-scope fence (``MEMBAR.ALL.GPU``) beyond one per releasing cluster arrive.  For 16-bit wgmma
kernels the SASS must also say how B is read: every HGMMA carries ``.tnspB`` when B is
N-major (``imm-trans-b = 1``) and none does when B is K-major.  Last, the same PTX
runs on the CPU emulator (:mod:`emulate`) over a problem two tiles wide whose K wraps
the stage ring, and must give the exact product of integer-valued inputs with no
hang, fault or misuse reported.

:func:`gate_configs` is what the gate covers: the ladder of :func:`variants` plus the
N-major-B twin of each 16-bit wgmma rung (``wgmma_tma_nmajor``...), the form
``gemm()`` runs them in, plus the persistent rung reading A M-major (``.tnspA`` on every HGMMA),
as the tensor-core matmul of ``cuda:N`` runs a weight gradient, and with the bias epilogue
(bf16 and fp16 inputs) as it runs a Linear layer.  :func:`flash_gate_configs` adds the flash-attention
kernels of :mod:`gen_flash` (every pass, dtype and head dim: both products on HGMMA, 4-D TMA loads, no
spills or notes, and their numerics on the emulated driver against float64 attention).
``python -m helios.cuda_ptx.gate`` gates all of those and prints one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from helios.errors import DeviceError

from . import toolchain
from .config import GemmConfig, variants
from .emit import emit_gemm
from .emu.state import EmulationError
from .emu.launch import emulate_gemm

FORBIDDEN_NOTES = ("C7508", "C7510", "C7511", "C7517", "C7519")
TNSP_B = ".tnspB"  # SASS marks an HGMMA that reads B MN-major (imm-trans-b = 1)
TNSP_A = ".tnspA"  # ... and one that reads A MN-major (imm-trans-a = 1)


def gate_configs() -> dict[str, GemmConfig]:
    """Everything the gate checks, by name: the ladder, then N-major-B twins of the 16-bit wgmma rungs,
    then the M-major-A forms the tensor-core matmul of ``cuda:N`` runs (helios.cuda_ptx.tensor_gemm)."""
    from .tensor_gemm import VARIANT

    out = variants()
    for name, cfg in list(out.items()):
        if cfg.kind == "wgmma" and cfg.in_bytes == 2 and cfg.b_major == "k":
            twin = f"{name}_nmajor"
            out[twin] = cfg.with_(name=twin, b_major="n")
    for suffix, b_major in (("_amajor", "k"), ("_amajor_nmajor", "n")):
        name = VARIANT + suffix
        out[name] = out[VARIANT].with_(name=name, a_major="m", b_major=b_major, out_dtype="bf16")
    for suffix, in_dtype, out_dtype in (("_bias", "bf16", "bf16"), ("_bias_fp16", "fp16", "f32")):
        name = VARIANT + suffix  # a Linear layer's x @ W^T + b in one kernel
        out[name] = out[VARIANT].with_(name=name, in_dtype=in_dtype, out_dtype=out_dtype, bias=True)
    # autocast's gradients into float32 slots: the product rounded to the input dtype, stored widened
    for suffix, in_dtype in (("_round", "bf16"), ("_round_fp16", "fp16")):
        out[VARIANT + suffix] = out[VARIANT].with_(name=VARIANT + suffix, in_dtype=in_dtype, out_dtype="f32",
                                                   round_out=True)
    # a projection under autocast: bias, the rounded product widened, its float32 residual added
    out[VARIANT + "_residual"] = out[VARIANT].with_(name=VARIANT + "_residual", in_dtype="bf16", out_dtype="f32",
                                                    bias=True, round_out=True, residual=True)
    # batched products (bmm, per-head attention products): the batch walk and (2 + d)-D tensor maps
    for name, extra in (("_batched", {"batched": 1}), ("_batched2_nmajor", {"batched": 2, "b_major": "n"})):
        out[VARIANT + name] = out[VARIANT].with_(name=VARIANT + name, **extra)
    return out


def expected_opcodes(cfg: GemmConfig) -> dict[str, str]:
    """SASS opcodes (prefix match on the full instruction) the kernel must contain, with why."""
    if cfg.kind == "simt":
        return {"FFMA": "fp32 FMA main loop"}
    if cfg.kind == "mma_sync":
        trans = "LDSM.16.MT88" if cfg.b_major == "n" else "LDSM.16.M88"
        return {
            "HMMA.16816.F32": "mma.sync m16n8k16",
            "LDSM.16.M88.4": "ldmatrix.x4 of A",
            trans: "ldmatrix of B",
            "LDGSTS": "cp.async",
        }
    exp = {
        ("QGMMA" if cfg.in_dtype == "e4m3" else "HGMMA") + f".64x{cfg.bn}x": "wgmma m64nN",
        "UTMALDG": "TMA load (cp.async.bulk.tensor)",
        "SYNCS": "mbarrier",
        "WARPGROUP.ARRIVE": "wgmma.fence",
    }
    if cfg.maxnreg:
        exp["USETMAXREG"] = "setmaxnreg"
    if cfg.tma_store:
        exp["UTMASTG"] = "TMA store of C (cp.async.bulk.tensor global.shared::cta)"
    if cfg.cluster > 1:
        exp["UTMALDG.2D.MULTICAST"] = "TMA multicast of B's share into every CTA of the cluster"
        exp["SYNCS.ARRIVE.TRANS64.RED"] = "mbarrier arrive on a peer CTA's barrier (slot release)"
        exp["UCGABAR_ARV"] = "barrier.cluster.arrive"
        exp["UCGABAR_WAIT"] = "barrier.cluster.wait"
    return exp


@dataclass
class GateReport:
    """Outcome of the gate for one variant."""

    name: str
    arch: str
    ok: bool
    registers: int
    spill_bytes: int
    notes: list[str]
    found: dict[str, int]
    failures: list[str] = field(default_factory=list)
    emulated: dict = field(default_factory=dict)


def emulation_check(cfg: GemmConfig, ptx: str, seed: int = 0) -> tuple[dict, str | None]:
    """Run ``ptx`` on the CPU emulator: (what ran, failure text or None).

    The problem is ``cluster bm x 2bn x (stages + 2) bk``: two tiles per CTA of a cluster
    (two CTAs or clusters, or one persistent CTA or cluster that walks both), and enough
    k-tiles that every ring slot is refilled; inputs are small integers, so the product
    is exact.
    """
    m, n, k = cfg.bm * cfg.cluster, 2 * cfg.bn, (cfg.stages + 2) * cfg.bk
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, (m, k)).astype(np.float32)
    b = rng.integers(-3, 4, (k, n)).astype(np.float32)
    t0 = time.perf_counter()
    ran = {"shape": [m, n, k], "seed": seed}
    try:
        c = emulate_gemm(a, b, cfg, out_dtype=cfg.out_dtype, ptx=ptx, seed=seed)
    except (EmulationError, DeviceError) as e:  # DeviceError: the emulated driver refused it (wrong kernel name, ...)
        return ran, f"emulator: {e}"
    ran["seconds"] = round(time.perf_counter() - t0, 2)
    want = a @ b
    rounded_to = "bf16" if cfg.out_dtype == "bf16" else cfg.in_dtype if cfg.round_out else None
    if rounded_to is not None:  # the kernel rounds C to a 16-bit type (round_out: and widens it again)
        from .dtypes import decode, encode

        want = decode(encode(want, rounded_to), rounded_to)
    bad = int(np.sum(~(c == want)))
    return ran, (f"emulator: {bad} of {c.size} elements of C differ from A @ B" if bad else None)


def count_prefixed(sass_text: str, prefix: str, contains: str | None = None) -> int:
    """How many SASS instructions start with ``prefix`` (e.g. ``HGMMA.64x256x``) and, if
    given, hold ``contains`` in their operands (e.g. ``.tnspB``)."""
    n = 0
    for line in sass_text.splitlines():
        s = line.split("*/", 1)[-1].strip() if line.lstrip().startswith("/*") else ""
        if s.startswith("@"):
            s = s.split(None, 1)[-1]
        # the encoding comment after ';' is hex only; match within the instruction
        if s.startswith(prefix) and (contains is None or contains in s.split(";", 1)[0]):
            n += 1
    return n


def _judge(ptx: str, target: str, expected: dict[str, str]):
    """Compile ``ptx`` (cached), read ptxas -v and the SASS: (ptxas info, SASS text, counts of the
    ``expected`` opcodes, failures: spills, forbidden notes, missing opcodes)."""
    comp = toolchain.compile_ptx(ptx, target)
    text = toolchain.sass(comp.cubin)
    info = comp.info
    failures = []
    spill = info.spill_stores + info.spill_loads
    if spill or info.stack_frame:
        failures.append(f"spills: {info.spill_stores} B stores, {info.spill_loads} B loads, stack {info.stack_frame} B")
    bad = [n for n in info.notes if n in FORBIDDEN_NOTES]
    if bad:
        lines = [ln for ln in info.log.splitlines() if any(n in ln for n in bad)]
        failures.append("ptxas notes " + ", ".join(bad) + ": " + " | ".join(lines))
    found = {}
    for prefix, why in expected.items():
        found[prefix] = count_prefixed(text, prefix)
        if not found[prefix]:
            failures.append(f"SASS lacks {prefix} ({why})")
    return info, text, found, failures


def run_gate(cfg: GemmConfig, ptx: str | None = None, emulate: bool = True) -> GateReport:
    """Compile ``cfg``'s kernel (or the given ``ptx`` for it; cached), read ptxas -v and the SASS, judge
    them, and (``emulate``) run the PTX on the CPU emulator."""
    if ptx is None:
        ptx = emit_gemm(cfg)
    info, text, found, failures = _judge(ptx, cfg.target, expected_opcodes(cfg))
    spill = info.spill_stores + info.spill_loads
    # GPU-scope fences belong only to barrier.cluster.arrive.release (one before the exit; the
    # arrive after init is .relaxed); a cluster-scope release on the per-slot arrives would put
    # one in every k-tile.
    gpu_fences, allowed = count_prefixed(text, "MEMBAR.ALL.GPU"), ptx.count("barrier.cluster.arrive.release")
    if gpu_fences > allowed:
        failures.append(f"{gpu_fences} MEMBAR.ALL.GPU for {allowed} releasing cluster arrives "
                        "(a .release.cluster mbarrier arrive?)")
    if cfg.kind == "wgmma" and cfg.in_bytes == 2:
        hgmma = count_prefixed(text, "HGMMA")
        for marker, transposed, operand in ((TNSP_B, cfg.b_major == "n", "B is N-major: imm-trans-b"),
                                            (TNSP_A, cfg.a_major == "m", "A is M-major: imm-trans-a")):
            n = count_prefixed(text, "HGMMA", marker)
            if transposed:
                found["HGMMA " + marker] = n
                if n != hgmma:
                    failures.append(f"{hgmma - n} of {hgmma} HGMMA lack {marker} ({operand} = 1)")
            elif n:
                failures.append(f"{n} HGMMA carry {marker} but the operand is not transposed ({operand} must not be 1)")
    emulated = {}
    if emulate:
        emulated, why = emulation_check(cfg, ptx)
        if why:
            failures.append(why)
    return GateReport(cfg.name, cfg.target, not failures, info.registers, spill, info.notes, found, failures, emulated)


# -- flash attention (helios.cuda_ptx.gen_flash) -------------------------------------------------


def flash_gate_configs() -> dict:
    """The flash kernels the tensor-core attention of ``cuda:N`` runs: every pass, dtype and head dim."""
    from . import gen_flash

    out = {}
    for pass_ in gen_flash.PASSES:
        for dtype in gen_flash.DTYPES:
            for d in gen_flash.HEAD_DIMS:
                cfg = gen_flash.default_config(pass_, dtype, d)
                out[cfg.name] = cfg
    for dtype in gen_flash.DTYPES:  # the block-mask form of dK / dV at D = 128 (32-query blocks)
        cfg = gen_flash.default_config("dkv", dtype, 128, block_mask=True)
        out[cfg.name] = cfg
    return out


def flash_expected_opcodes(cfg) -> dict[str, str]:
    """SASS a flash kernel must contain: both products on wgmma, 4-D TMA loads, mbarriers,
    register hand-over, the exponentials on the SFU."""
    first = cfg.bn  # S = Q K^T (fwd, dq) or S^T = K Q^T (dkv): N = the streamed block's rows
    return {
        f"HGMMA.64x{first}x16": "the scores' wgmma (m64nNk16, N = the streamed block)",
        f"HGMMA.64x{cfg.head_dim}x16": "the second product's wgmma (N = head dim, A from registers)",
        "UTMALDG.4D": "TMA loads of [B, H, T, D] tiles",
        "SYNCS": "mbarrier",
        "WARPGROUP.ARRIVE": "wgmma.fence",
        "USETMAXREG": "setmaxnreg",
        "MUFU.EX2": "ex2 of the softmax",
    }


def flash_emulation_check(cfg, seed: int = 0) -> tuple[dict, str | None]:
    """Run the kernel's pass on the emulated driver against float64 attention: 2 query heads
    sharing 1 K/V head, causal, ragged lengths (a tail in every block walk); forward for
    ``fwd``, forward + backward for the backward passes.  (what ran, failure text or None)."""
    from . import tensor_flash as tf
    from .emu.driver import emulated_context

    dtype = {"bf16": "bfloat16", "fp16": "float16"}[cfg.dtype]
    tq, tk = 100, 100
    shape = (1, 2, 1, tq, tk, cfg.head_dim)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, tq, cfg.head_dim))
    k, v = (rng.standard_normal((1, 1, tk, cfg.head_dim)) for _ in range(2))
    do = rng.standard_normal(q.shape) if cfg.pass_ != "fwd" else None
    t0 = time.perf_counter()
    ran = {"shape": list(shape), "causal": True, "seed": seed}
    try:
        got = tf.attention_numpy(emulated_context(sm_count=4, seed=seed), q, k, v, do, causal=True, dtype=dtype)
    except (EmulationError, DeviceError) as e:
        return ran, f"emulator: {e}"
    ran["seconds"] = round(time.perf_counter() - t0, 2)
    r = [None if x is None else tf.rounded(x, dtype) for x in (q, k, v, do)]
    want = tf.reference(*r, causal=True)
    keys = {"fwd": ("o", "lse"), "dq": ("dq",), "dkv": ("dk", "dv")}[cfg.pass_]
    bad = []
    for key in keys:
        err = float(np.abs(got[key] - want[key]).max())
        tol = 0.02 * max(1.0, float(np.abs(want[key]).max()))  # 16-bit inputs, P and dS rounded to 16 bits
        ran[f"{key}_max_err"] = round(err, 5)
        if not err <= tol:
            bad.append(f"{key} max error {err:.3g} > {tol:.3g}")
    return ran, ("emulator: " + "; ".join(bad) if bad else None)


def run_flash_gate(cfg, emulate: bool = True) -> GateReport:
    """The gate for one flash kernel (:mod:`gen_flash`): ptxas, spills and notes, SASS, and (``emulate``)
    its numerics on the emulated driver against float64 attention."""
    from .gen_flash import generate
    from .render import render

    info, _, found, failures = _judge(render(generate(cfg)), "sm_90a", flash_expected_opcodes(cfg))
    emulated = {}
    if emulate:
        emulated, why = flash_emulation_check(cfg)
        if why:
            failures.append(why)
    return GateReport(cfg.name, "sm_90a", not failures, info.registers, info.spill_stores + info.spill_loads,
                      info.notes, found, failures, emulated)


def main(argv: list[str] | None = None) -> int:
    """CLI: gate every config of :func:`gate_configs` (or those named), one JSON line each; exit 1 on any failure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="configs to gate (default: all of gate_configs())")
    ap.add_argument("--no-emulate", action="store_true", help="skip running each kernel on the CPU emulator")
    args = ap.parse_args(argv)
    vs, fl = gate_configs(), flash_gate_configs()
    unknown = [n for n in args.names if n not in vs and n not in fl]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(vs) + list(fl)}")
    names = args.names or list(vs) + list(fl)
    ok = True
    for n in names:
        rep = run_gate(vs[n], emulate=not args.no_emulate) if n in vs else run_flash_gate(fl[n], not args.no_emulate)
        ok &= rep.ok
        print(json.dumps(asdict(rep)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
