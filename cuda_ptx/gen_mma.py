"""Rung 2: ``mma.sync.m16n8k16`` fed by ``ldmatrix`` from a multi-stage ``cp.async`` ring (sm_80+).

Per CTA a ``bm x bn`` tile, ``warps_m x warps_n`` warps each owning a
``(bm/warps_m) x (bn/warps_n)`` sub-tile of 16x8 mma tiles.  Shared rows are padded by
16 bytes so the eight 16-byte rows an ``ldmatrix`` phase reads fall in distinct
banks.  B N-major is read with ``ldmatrix.trans``; B K-major with plain ``ldmatrix``.

The lane -> (row, col) maps are :mod:`layout` ``BitMap`` objects, emitted here and
evaluated by the numpy simulation (:func:`simulate_tile`), which checks that the
addresses this generator computes reproduce ``A @ B``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout as L
from . import ops
from .config import IN_DTYPES, GemmConfig
from .ir import Builder, Kernel

PAD = 8  # elements of padding per shared row (16 bytes)


@dataclass(frozen=True)
class MmaPlan:
    """Derived geometry of an mma.sync kernel (shared strides, chunk counts, warp tiles)."""

    cfg: GemmConfig

    @property
    def wm(self) -> int:
        return self.cfg.bm // self.cfg.warps_m

    @property
    def wn(self) -> int:
        return self.cfg.bn // self.cfg.warps_n

    @property
    def a_stride(self) -> int:  # bytes per A shared row (bm rows x bk)
        return (self.cfg.bk + PAD) * 2

    @property
    def b_rows(self) -> int:
        return self.cfg.bk if self.cfg.b_major == "n" else self.cfg.bn

    @property
    def b_stride(self) -> int:
        inner = self.cfg.bn if self.cfg.b_major == "n" else self.cfg.bk
        return (inner + PAD) * 2

    @property
    def a_bytes(self) -> int:
        return self.cfg.bm * self.a_stride

    @property
    def stage_bytes(self) -> int:
        return self.a_bytes + self.b_rows * self.b_stride

    def chunks(self, rows: int, inner: int) -> tuple[int, int]:
        """(16-byte chunks per row, chunks per thread) for a rows x inner bf16 tile."""
        per_row = inner * 2 // 16
        total = rows * per_row
        if total % self.cfg.threads:
            raise ValueError(f"tile {rows}x{inner} does not split into {self.cfg.threads} threads")
        return per_row, total // self.cfg.threads


def generate(cfg: GemmConfig) -> Kernel:
    """Build the mma.sync kernel for ``cfg``."""
    cfg.validate()
    plan = MmaPlan(cfg)
    T = cfg.threads
    b = Builder(cfg.kernel_name, cfg.target, cfg.version, T)
    b.kernel.maxntid = (T, 1, 1)
    pa, pb, pc = b.param("a", "u64"), b.param("b", "u64"), b.param("c", "u64")
    b.param("M", "u32")
    pn, pk = b.param("N", "u32"), b.param("K", "u32")
    b.shared("ring", plan.stage_bytes * cfg.stages, align=128, shape=(cfg.stages, plan.stage_bytes))

    a_g, b_g, c_g = (ops.ld_param_ptr(b, p) for p in (pa, pb, pc))
    n_r, k_r = ops.ld_param(b, pn, "u32"), ops.ld_param(b, pk, "u32")
    tid = b.sreg("%tid.x")
    lane = b.binop("and", "b32", tid, 31)
    warp = b.binop("shr", "u32", tid, 5)
    wm = b.binop("div", "u32", warp, cfg.warps_n)
    wn = b.binop("rem", "u32", warp, cfg.warps_n)
    m0, n0 = ops.tile_origin(b, cfg)
    ring = ops.smem_base(b)
    kt_n = b.binop("shr", "u32", k_r, cfg.bk.bit_length() - 1)  # K / bk (bk is a power of two)

    issue = _copy_issuer(b, plan, tid, ring, (a_g, b_g), (m0, n0), (n_r, k_r))
    a_ld, b_ld = _ldmatrix_bases(b, plan, lane, wm, wn)
    mt, nt = plan.wm // 16, plan.wn // 8
    acc = [[[b.mov("f32", 0.0) for _ in range(4)] for _ in range(nt)] for _ in range(mt)]
    _main_loop(b, plan, issue, ring, kt_n, (a_ld, b_ld), acc)

    # ---- epilogue: C fragment (row g / g+8, cols q, q+1) -------------------------------
    row0 = b.binop("add", "u32", m0, b.mad("u32", wm, plan.wm, L.GROUP.emit(b, lane)))
    col0 = b.binop("add", "u32", n0, b.mad("u32", wn, plan.wn, L.QUAD2.emit(b, lane)))
    base = b.mad("u32", row0, n_r, col0)
    n8 = b.binop("shl", "b32", n_r, 3)
    for i in range(mt):
        for half in range(2):
            rbase = b.mad("u32", n8, 2 * i + half, base)  # +(16i + 8half) rows
            for j in range(nt):
                off = b.binop("add", "u32", rbase, 8 * j)
                ops.store_c(b, cfg, c_g, off, acc[i][j][2 * half: 2 * half + 2])
    return b.build()


def _copy_issuer(b: Builder, plan: MmaPlan, tid, ring, ptrs: tuple, origin: tuple, nk: tuple):
    """The cp.async producers: thread tid copies the 16-byte chunks tid + T*i of each k-tile of A
    and B (``ptrs``: their global pointers, ``origin``: the tile's m0, n0, ``nk``: N and K).  Emits
    the per-thread addresses; returns ``issue(slot_off, guard)``, which emits one k-tile's copies
    into the ring slot at byte offset ``slot_off`` and advances the sources."""
    cfg, T = plan.cfg, plan.cfg.threads
    (a_g, b_g), (m0, n0), (n_r, k_r) = ptrs, origin, nk
    a_per_row, a_n = plan.chunks(cfg.bm, cfg.bk)
    a_row = b.binop("div", "u32", tid, a_per_row)
    a_col = b.binop("mul.lo", "u32", b.binop("rem", "u32", tid, a_per_row), 8)
    a_src = ops.addr(b, a_g, b.mad("u32", b.binop("add", "u32", m0, a_row), k_r, a_col), 2)
    a_dst = b.mad("u32", a_row, plan.a_stride, b.binop("shl", "b32", a_col, 1))
    a_rows_step = T // a_per_row  # rows between a thread's consecutive chunks
    a_src_step = b.reg("u64")
    b.emit("mul.wide.u32", a_src_step, k_r, a_rows_step * 2)
    if cfg.b_major == "n":
        b_per_row, b_n = plan.chunks(cfg.bk, cfg.bn)
        b_row = b.binop("div", "u32", tid, b_per_row)
        b_col = b.binop("mul.lo", "u32", b.binop("rem", "u32", tid, b_per_row), 8)
        b_src = ops.addr(b, b_g, b.mad("u32", b_row, n_r, b.binop("add", "u32", n0, b_col)), 2)
        b_src_step = b.reg("u64")
        b.emit("mul.wide.u32", b_src_step, n_r, (T // b_per_row) * 2)
        b_ktile = b.reg("u64")
        b.emit("mul.wide.u32", b_ktile, n_r, cfg.bk * 2)
    else:
        b_per_row, b_n = plan.chunks(cfg.bn, cfg.bk)
        b_row = b.binop("div", "u32", tid, b_per_row)
        b_col = b.binop("mul.lo", "u32", b.binop("rem", "u32", tid, b_per_row), 8)
        b_src = ops.addr(b, b_g, b.mad("u32", b.binop("add", "u32", n0, b_row), k_r, b_col), 2)
        b_src_step = a_src_step if b_per_row == a_per_row else b.reg("u64")
        if b_per_row != a_per_row:
            b.emit("mul.wide.u32", b_src_step, k_r, (T // b_per_row) * 2)
        b_ktile = b.mov("u64", cfg.bk * 2)
    b_dst = b.mad("u32", b_row, plan.b_stride, b.binop("shl", "b32", b_col, 1))
    b_rows_step = T // b_per_row
    ptr = b.reg("u64")

    def issue(slot_off, guard) -> None:
        """Copy one k-tile of A and B into the ring slot at byte offset ``slot_off``."""
        base = b.binop("add", "u32", ring, slot_off)
        da = b.binop("add", "u32", base, a_dst)
        db = b.binop("add", "u32", base, b_dst)
        b.emit("mov.u64", ptr, a_src)
        for i in range(a_n):
            b.emit("cp.async.cg.shared.global", f"[{da}+{i * a_rows_step * plan.a_stride}]", f"[{ptr}]", 16,
                   pred=guard)
            if i + 1 < a_n:
                b.emit("add.u64", ptr, ptr, a_src_step)
        b.emit("mov.u64", ptr, b_src)
        for i in range(b_n):
            b.emit("cp.async.cg.shared.global",
                   f"[{db}+{plan.a_bytes + i * b_rows_step * plan.b_stride}]", f"[{ptr}]", 16, pred=guard)
            if i + 1 < b_n:
                b.emit("add.u64", ptr, ptr, b_src_step)
        b.emit("cp.async.commit_group")
        b.emit("add.u64", a_src, a_src, cfg.bk * 2)
        b.emit("add.u64", b_src, b_src, b_ktile)

    return issue


def _ldmatrix_bases(b: Builder, plan: MmaPlan, lane, wm, wn) -> tuple:
    """(A's, B's) ldmatrix lane base addresses: bytes within a stage, the warp's sub-tile included."""
    cfg = plan.cfg
    a_ld = b.mad("u32", b.binop("add", "u32", b.binop("mul.lo", "u32", wm, plan.wm), L.LDM_A_ROW.emit(b, lane)),
                 plan.a_stride, b.binop("shl", "b32", L.LDM_A_COL.emit(b, lane), 1))
    if cfg.b_major == "n":
        b_ld_row, b_ld_col = L.LDM_BN_ROW.emit(b, lane), L.LDM_BN_COL.emit(b, lane)
        b_ld_col = b.mad("u32", wn, plan.wn, b_ld_col)
    else:
        b_ld_row = b.mad("u32", wn, plan.wn, L.LDM_BK_ROW.emit(b, lane))
        b_ld_col = L.LDM_BK_COL.emit(b, lane)
    b_ld = b.mad("u32", b_ld_row, plan.b_stride, b.binop("shl", "b32", b_ld_col, 1))
    return a_ld, b.binop("add", "u32", b_ld, plan.a_bytes)


def _main_loop(b: Builder, plan: MmaPlan, issue, ring, kt_n, ld_bases: tuple, acc: list) -> None:
    """The prologue (stages-1 k-tiles in flight), then per k-tile: wait for its copies, issue the
    tile stages-1 ahead, and run its ldmatrix loads and mma.sync products into ``acc``."""
    cfg = plan.cfg
    ty = IN_DTYPES[cfg.in_dtype][1]
    a_ld, b_ld = ld_bases
    mt, nt = len(acc), len(acc[0])
    af = [b.regs("b32", 4) for _ in range(mt)]
    bf = [b.regs("b32", 4) for _ in range(nt // 2)]
    for s in range(cfg.stages - 1):
        guard = b.setp("lt", "u32", s, kt_n) if s else None
        issue(s * plan.stage_bytes, guard)
    rd = b.mov("u32", 0)
    wr = b.mov("u32", (cfg.stages - 1) * plan.stage_bytes)
    ring_end = cfg.stages * plan.stage_bytes
    kt = b.reg("u32")
    nxt = b.reg("u32")
    wrap = b.reg("pred")
    ld_a, ld_b = b.reg("u32"), b.reg("u32")
    with b.loop(kt, 0, kt_n, 1):
        b.emit("cp.async.wait_group", cfg.stages - 2)
        # Everyone is past the previous tile: its slot may be overwritten.
        ops.bar_sync(b)
        b.emit("add.u32", nxt, kt, cfg.stages - 1)
        g = b.setp("lt", "u32", nxt, kt_n)
        issue(wr, g)
        b.emit("add.u32", wr, wr, plan.stage_bytes)
        b.emit("setp.ge.u32", wrap, wr, ring_end)
        b.emit("sub.u32", wr, wr, ring_end, pred=wrap)
        b.emit("add.u32", ld_a, ring, rd)
        b.emit("add.u32", ld_b, ld_a, b_ld)
        b.emit("add.u32", ld_a, ld_a, a_ld)
        trans = ".trans" if cfg.b_major == "n" else ""
        for kk in range(cfg.bk // 16):
            for i in range(mt):
                off = i * 16 * plan.a_stride + kk * 32
                b.emit("ldmatrix.sync.aligned.m8n8.x4.shared.b16", ops.reg_vector(af[i]), f"[{ld_a}+{off}]")
            for p in range(nt // 2):
                off = (kk * 16 * plan.b_stride + p * 32) if cfg.b_major == "n" else (p * 16 * plan.b_stride + kk * 32)
                b.emit(f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16", ops.reg_vector(bf[p]), f"[{ld_b}+{off}]")
            for i in range(mt):
                for j in range(nt):
                    bj = bf[j // 2][2 * (j % 2): 2 * (j % 2) + 2]
                    b.emit(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32",
                           ops.reg_vector(acc[i][j]), ops.reg_vector(af[i]), ops.reg_vector(bj), ops.reg_vector(acc[i][j]))
        b.emit("add.u32", rd, rd, plan.stage_bytes)
        b.emit("setp.ge.u32", wrap, rd, ring_end)
        b.emit("sub.u32", rd, rd, ring_end, pred=wrap)
    b.emit("cp.async.wait_group", 0)


# ---------------------------------------------------------------------------------------
# numpy simulation of one CTA tile through the same maps


def simulate_tile(cfg: GemmConfig, A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Run one ``bm x bk`` @ ``bk x bn`` CTA tile through the kernel's data path in numpy.

    Shared memory is filled the way the cp.async chunks are addressed, each warp's
    lanes read it at the ``ldmatrix`` addresses of the generator's BitMaps, the
    fragments go through :func:`layout.mma_m16n8k16`, and the accumulators are
    scattered to C by the epilogue's (row, col) map.  ``B`` is ``bk x bn``; for
    K-major configs it is stored transposed, as the kernel expects.
    """
    plan = MmaPlan(cfg)
    smem = np.zeros(plan.stage_bytes, np.uint8)
    a16 = A.astype(np.float16)  # any 16-bit type: bytes are only moved
    for r in range(cfg.bm):
        smem[r * plan.a_stride: r * plan.a_stride + cfg.bk * 2] = a16[r].view(np.uint8)
    bst = np.ascontiguousarray((B if cfg.b_major == "n" else B.T).astype(np.float16))
    for r in range(bst.shape[0]):
        o = plan.a_bytes + r * plan.b_stride
        smem[o: o + bst.shape[1] * 2] = bst[r].view(np.uint8)

    def row8(off: int) -> np.ndarray:
        return smem[off: off + 16].view(np.float16).astype(np.float64)

    lane = np.arange(32)
    C = np.full((cfg.bm, cfg.bn), np.nan)
    mt, nt = plan.wm // 16, plan.wn // 8
    for w in range(cfg.warps_m * cfg.warps_n):
        wm, wn = w // cfg.warps_n, w % cfg.warps_n
        acc = np.zeros((mt, nt, 32, 4))
        for kk in range(cfg.bk // 16):
            afr = []
            for i in range(mt):
                rows = wm * plan.wm + 16 * i + L.LDM_A_ROW(lane)
                cols = L.LDM_A_COL(lane) + 16 * kk
                afr.append(L.ldmatrix([row8(int(r * plan.a_stride + c * 2)) for r, c in zip(rows, cols)]))
            bfr = []
            for p in range(nt // 2):
                if cfg.b_major == "n":
                    rows = L.LDM_BN_ROW(lane) + 16 * kk
                    cols = wn * plan.wn + 16 * p + L.LDM_BN_COL(lane)
                else:
                    rows = wn * plan.wn + 16 * p + L.LDM_BK_ROW(lane)
                    cols = L.LDM_BK_COL(lane) + 16 * kk
                offs = [plan.a_bytes + int(r * plan.b_stride + c * 2) for r, c in zip(rows, cols)]
                bfr.append(L.ldmatrix([row8(o) for o in offs], trans=cfg.b_major == "n"))
            for i in range(mt):
                for j in range(nt):
                    bj = bfr[j // 2][:, 2 * (j % 2): 2 * (j % 2) + 2, :]
                    acc[i, j] = L.mma_m16n8k16(afr[i], bj, acc[i, j])
        g, q = L.GROUP(lane), L.QUAD2(lane)
        for i in range(mt):
            for j in range(nt):
                for reg in range(4):
                    r = wm * plan.wm + 16 * i + g + 8 * (reg // 2)
                    c = wn * plan.wn + 8 * j + q + reg % 2
                    C[r, c] = acc[i, j, :, reg]
    return C
