"""Rung 1: the SIMT GEMM (CUDA cores, fp32 FMA), any sm_80+.

64x64 tile per CTA, 256 threads, BK=16.  Each K step the CTA stages A (transposed,
so a thread reads a column as a row) and B into shared memory as fp32, then each
thread accumulates a 4x4 micro-tile at rows ``ty + 16*i`` and cols ``tx + 16*j``
(strided, so a warp's shared loads hit distinct banks or broadcast).
"""

from __future__ import annotations

from . import ops
from .config import GemmConfig
from .ir import Builder, Kernel

TM = TN = 4  # micro-tile per thread
TILE = 64
BK = 16


def thread_map(tid: int) -> tuple[list[int], list[int]]:
    """Rows and columns of the 64x64 tile that thread ``tid`` accumulates (the model checks it)."""
    ty, tx = tid // 16, tid % 16
    return [ty + 16 * i for i in range(TM)], [tx + 16 * j for j in range(TN)]


def generate(cfg: GemmConfig) -> Kernel:
    """Build the SIMT kernel for ``cfg`` (bf16/fp16 in, f32/bf16 out, B N- or K-major)."""
    b = Builder(cfg.kernel_name, cfg.target, cfg.version, cfg.threads)
    k = b.kernel
    k.maxntid = (256, 1, 1)
    pa, pb, pc = b.param("a", "u64"), b.param("b", "u64"), b.param("c", "u64")
    pm, pn, pk = b.param("M", "u32"), b.param("N", "u32"), b.param("K", "u32")
    as_t = b.shared("As", BK * TILE * 4, shape=(BK, TILE), dtype="f32")
    bs_t = b.shared("Bs", BK * TILE * 4, shape=(BK, TILE), dtype="f32")
    esz = cfg.in_bytes

    a_g, b_g, c_g = (ops.ld_param_ptr(b, p) for p in (pa, pb, pc))
    n_r = ops.ld_param(b, pn, "u32")
    k_r = ops.ld_param(b, pk, "u32")
    del pm  # M only bounds the grid (blockIdx.y covers M / 64 tiles)
    tid = b.sreg("%tid.x")
    m0, n0 = ops.tile_origin(b, cfg)  # cfg.bm == cfg.bn == TILE (validated)
    ty = b.binop("shr", "u32", tid, 4)
    tx = b.binop("and", "b32", tid, 15)
    smem = ops.smem_base(b)
    as_base = b.binop("add", "u32", smem, as_t.offset)
    bs_base = b.binop("add", "u32", smem, bs_t.offset)

    # Per-thread load slots: 4 elements of A (64x16) and 4 of B (16x64) per K step.
    # A element idx=tid+256*i: row idx/16, col idx%16 -> stored at As[col][row].
    a_src, a_dst, b_src, b_dst = [], [], [], []
    for i in range(4):
        idx = b.binop("add", "u32", tid, 256 * i)
        r = b.binop("shr", "u32", idx, 4)
        c = b.binop("and", "b32", idx, 15)
        grow = b.binop("add", "u32", m0, r)
        off = b.mad("u32", grow, k_r, c)  # (m0+r)*K + c
        a_src.append(ops.addr(b, a_g, off, esz))
        a_dst.append(b.binop("add", "u32", as_base, b.mad("u32", c, TILE * 4, b.binop("shl", "b32", r, 2))))
        if cfg.b_major == "n":
            # B[k0 + r][n0 + c], r = idx/64, c = idx%64 -> Bs[r][c]
            r2 = b.binop("shr", "u32", idx, 6)
            c2 = b.binop("and", "b32", idx, 63)
            off2 = b.mad("u32", r2, n_r, b.binop("add", "u32", n0, c2))
            b_src.append(ops.addr(b, b_g, off2, esz))
            b_dst.append(b.binop("add", "u32", bs_base, b.mad("u32", r2, TILE * 4, b.binop("shl", "b32", c2, 2))))
        else:
            # Bt[n0 + c][k0 + r] (N x K storage), c = idx/16, r = idx%16 -> Bs[r][c]
            c2 = b.binop("shr", "u32", idx, 4)
            r2 = b.binop("and", "b32", idx, 15)
            off2 = b.mad("u32", b.binop("add", "u32", n0, c2), k_r, r2)
            b_src.append(ops.addr(b, b_g, off2, esz))
            b_dst.append(b.binop("add", "u32", bs_base, b.mad("u32", r2, TILE * 4, b.binop("shl", "b32", c2, 2))))
    # Per K step the A pointers move by BK elements, the B pointers by BK rows (N-major) or BK elements.
    b_step = b.reg("u64")
    if cfg.b_major == "n":
        b.emit("mul.wide.u32", b_step, n_r, BK * esz)
    else:
        b.emit("mov.u64", b_step, BK * esz)

    acc = [[b.mov("f32", 0.0) for _ in range(TN)] for _ in range(TM)]
    a_rd = b.binop("add", "u32", as_base, b.binop("shl", "b32", ty, 2))
    b_rd = b.binop("add", "u32", bs_base, b.binop("shl", "b32", tx, 2))
    f = b.reg("f32")
    kk = b.reg("u32")
    with b.loop(kk, 0, k_r, BK):
        for i in range(4):
            ops.load_in_f32(b, cfg, f, a_src[i])
            b.emit("st.shared.f32", f"[{a_dst[i]}]", f)
            ops.load_in_f32(b, cfg, f, b_src[i])
            b.emit("st.shared.f32", f"[{b_dst[i]}]", f)
            b.emit("add.u64", a_src[i], a_src[i], BK * esz)
            b.emit("add.u64", b_src[i], b_src[i], b_step)
        b.emit("bar.sync", 0)
        av = b.regs("f32", TM)
        bv = b.regs("f32", TN)
        for q in range(BK):
            for i in range(TM):
                b.emit("ld.shared.f32", av[i], f"[{a_rd}+{(q * TILE + 16 * i) * 4}]")
            for j in range(TN):
                b.emit("ld.shared.f32", bv[j], f"[{b_rd}+{(q * TILE + 16 * j) * 4}]")
            for i in range(TM):
                for j in range(TN):
                    b.emit("fma.rn.f32", acc[i][j], av[i], bv[j], acc[i][j])
        b.emit("bar.sync", 0)

    # Epilogue: C[m0 + ty + 16i][n0 + tx + 16j]
    for i in range(TM):
        row = b.binop("add", "u32", m0, b.binop("add", "u32", ty, 16 * i))
        for j in range(TN):
            col = b.binop("add", "u32", n0, b.binop("add", "u32", tx, 16 * j))
            off = b.mad("u32", row, n_r, col)
            ops.store_c(b, cfg, c_g, off, [acc[i][j]])
    return b.build()
