"""Flash attention on Hopper tensor cores: ``wgmma`` for both products, TMA for the tiles (``sm_90a``).

Three kernels, one per pass, built from the same pieces:

* ``fwd``  -- O = softmax(Q K^T * scale) V and the log-sum-exp L of every query row;
* ``dq``   -- dQ = dS K, one CTA per query block walking the key blocks;
* ``dkv``  -- dK = dS^T Q and dV = P^T dO, one CTA per key block walking the query blocks
  (of every query head that shares the K/V head, for grouped-query attention).

The backward is split in two so that every output row is accumulated in the registers of
one warpgroup and written once: no atomics, so reruns are bit-identical (the project's
rule).  The price is recomputing S and dP in both passes: 7 products instead of
FlashAttention-2's 5 (its dQ is accumulated with atomic adds across key blocks).

Layout of a CTA (:class:`FlashConfig`): warpgroup 0 is the producer (one thread issues TMA
loads into shared memory; the warpgroup gives its registers away with
``setmaxnreg.dec``), warpgroups 1 and 2 are consumers that own 64 rows each of the CTA's
128-row block and run the products and the softmax (``setmaxnreg.inc``).  The stationary
tiles (Q in ``fwd``/``dq``; K and V in ``dkv``) are loaded once; the streamed ones (K and V,
or Q and dO) go through a ring of ``stages`` slots ordered by ``full`` (TMA bytes landed)
and ``empty`` (consumers done) mbarriers, as in the GEMM ladder (:mod:`gen_wgmma`).

Operands are [B, H, T, D] tensors with any strides whose last is 1 (multiples of 16
bytes): each is read through a 4-D tensor map (D, T, H, B), so TMA zero-fills the rows
past T (tails) and a per-head view of a packed QKV tensor is read in place.  Every tile is
stored as 64-column boxes of 128-byte rows (128B swizzle).  A tile read as a K-major
wgmma operand (contraction over D) uses the K-major descriptor (SBO 1024 between 8-row
atoms, +32 bytes per k16 step, +box bytes per 64 columns); the same tile read as an
MN-major operand (contraction over the rows: V in ``P V``, dO in ``P^T dO``, Q in
``dS^T Q``, K in ``dS K``) uses the MN-major one (LBO = box bytes between 64-column boxes,
SBO 1024 between 8-row groups, +2048 bytes per 16 rows, ``imm-trans-b = 1``).

The softmax operand of the second product (P, P^T, dS, dS^T) never touches shared
memory: a wgmma accumulator's registers for 16 consecutive columns are exactly the A
fragment of a k16 step (``layout.wgmma_d_map``; rows g and g + 8, columns 2q, 2q + 1 and
2q + 8, 2q + 9), so they are rounded in pairs and fed to ``wgmma`` with A in registers.

Scores are scaled into base 2 (``scale * log2 e``) so each exponential is one ``ex2``;
the saved L is the natural log-sum-exp of the scaled scores, as the other kernels keep it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from helios.errors import ShapeError

from . import layout as L
from . import ops
from .config import MAX_DYN_SMEM
from .ir import Builder, Kernel, Reg

PASSES = ("fwd", "dq", "dkv")
DTYPES = {"bf16": ("bf16", "cvt.rn.bf16x2.f32"), "fp16": ("f16", "cvt.rn.f16x2.f32")}
HEAD_DIMS = (64, 128)
BOX_COLS = 64  # head-dim columns per TMA box: one 128-byte swizzle row of a 16-bit type
ROW_BYTES = 128
SBO = 1024  # bytes between 8-row atoms (K-major) or 8-row groups (MN-major)
LOG2E = 1.4426950408889634
NEG_INF = float("-inf")
CONSUMER_ROWS = 64  # rows of the CTA block one consumer warpgroup owns (one wgmma m64)
TMA_LOAD = "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"


@dataclass(frozen=True)
class FlashConfig:
    """One flash kernel: the pass, the 16-bit dtype, the head dim and the block shape.

    ``bm``: rows of the CTA's stationary block (queries for ``fwd``/``dq``, keys for
    ``dkv``), 64 per consumer warpgroup; ``bn``: rows of each streamed block (keys, or
    queries for ``dkv``); ``stages``: ring slots of streamed blocks; ``maxnreg``: the
    (producer, consumer) register budgets handed out with ``setmaxnreg``.
    """

    pass_: str = "fwd"
    dtype: str = "bf16"
    head_dim: int = 64
    bm: int = 128
    bn: int = 128
    stages: int = 2
    maxnreg: tuple[int, int] = (24, 240)

    @property
    def name(self) -> str:
        """The kernel's entry name, as the trace shows it (``flash_wgmma_fwd_bf16_d64``; ``_n32`` where
        the streamed block is not the pass's default)."""
        base = f"flash_wgmma_{self.pass_}_{self.dtype}_d{self.head_dim}"
        return base if self.bn == default_config(self.pass_, self.dtype, self.head_dim).bn else f"{base}_n{self.bn}"

    @property
    def consumers(self) -> int:
        return self.bm // CONSUMER_ROWS

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def chunks(self) -> int:
        """64-column boxes per row of a tile (head dim / 64)."""
        return self.head_dim // BOX_COLS

    def tile_bytes(self, rows: int) -> int:
        """Shared bytes of a ``rows x head_dim`` tile."""
        return rows * self.head_dim * 2

    def validate(self) -> None:
        """Refuse a config the generator does not build, naming the field."""
        if self.pass_ not in PASSES:
            raise ValueError(f"pass_: one of {PASSES}, got {self.pass_!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ShapeError(f"head_dim: one of {HEAD_DIMS}, got {self.head_dim}")
        if self.bm % CONSUMER_ROWS or not 1 <= self.consumers <= 2:
            raise ShapeError(f"bm: 64 or 128 rows (64 per consumer warpgroup), got {self.bm}")
        if self.bn % 16 or not 16 <= self.bn <= 256:
            raise ShapeError(f"bn: a multiple of 16 in 16..256, got {self.bn}")
        if self.stages < 1:
            raise ShapeError(f"stages: at least 1, got {self.stages}")


def default_config(pass_: str, dtype: str, head_dim: int, block_mask: bool = False) -> FlashConfig:
    """The block shape each pass runs at: what fits the consumers' 240 registers.

    ``fwd``: S (bn/2) + O (D/2) + P (bn/4) accumulator registers a thread; ``dq``: S, dP
    (bn/2 each) + dQ (D/2) + dS (bn/4); ``dkv``: S^T, dP^T (bn/2) + dK, dV (D/2 each).
    """
    if pass_ == "fwd":
        bn = 128
    elif pass_ == "dq":
        bn = 128 if head_dim == 64 else 64
    else:  # dK and dV take 128 registers at D = 128: 48-query blocks leave room for S^T and dP^T
        bn = 64 if head_dim == 64 else 32 if block_mask else 48  # block masks: blocks inside 64-row groups
    return FlashConfig(pass_=pass_, dtype=dtype, head_dim=head_dim, bn=bn)


# -- small emitters ------------------------------------------------------------------------


def _desc(b: Builder, addr: Reg, const: int) -> Reg:
    """A fresh register holding the wgmma descriptor of the tile at shared ``addr`` (ops.smem_desc)."""
    out = b.reg("b64")
    ops.smem_desc(b, out, addr, const)
    return out


def _quad_reduce(b: Builder, x: Reg, op: str) -> None:
    """``x = op(x over the 4 lanes of a quad)``: the lanes that hold one accumulator row."""
    t = b.reg("f32")
    for m in (1, 2):
        b.emit("shfl.sync.bfly.b32", t, x, m, 0x1F, 0xFFFFFFFF)
        b.emit(f"{op}.f32", x, x, t)


def _row_of(i: int) -> int:
    """Which of a thread's two accumulator rows (g, g + 8) register ``i`` belongs to."""
    return (i // 2) % 2


def _col_off(i: int) -> int:
    """Register ``i``'s column relative to the thread's first column (``2 q``)."""
    return 8 * (i // 4) + i % 2


# -- the kernel ------------------------------------------------------------------------------


class _Flash:
    """Builds one flash kernel; the methods emit its parts in order (see :func:`generate`)."""

    def __init__(self, cfg: FlashConfig):
        cfg.validate()
        self.cfg = cfg
        self.b = b = Builder(cfg.name, "sm_90a", "8.0", cfg.threads)
        b.kernel.maxntid = (cfg.threads, 1, 1)
        b.kernel.minnctapersm = 1
        self.ptx_t, self.pack_op = DTYPES[cfg.dtype]
        self.D = cfg.head_dim
        self.S = cfg.stages

    # -- declarations
    def params(self, names: list[tuple[str, str]]) -> dict:
        """Declare the kernel parameters (name, kind) in order; tensor maps made generic addresses."""
        b = self.b
        ps = {n: b.param(n, k) for n, k in names}
        out = {}
        for n, k in names:
            if k == "tmap":
                g = b.reg("u64")
                b.emit("mov.b64", g, ps[n])
                b.emit("cvta.param.u64", g, g)
                out[n] = g
            elif k == "u64":
                r, g = b.reg("u64"), b.reg("u64")
                b.emit("ld.param.u64", r, f"[{ps[n]}]")
                b.emit("cvta.to.global.u64", g, r)
                out[n] = g
            else:
                r = b.reg(k)
                b.emit(f"ld.param.{k}", r, f"[{ps[n]}]")
                out[n] = r
        return out

    def layout_shared(self, stationary: list[tuple[str, int]], streamed: list[tuple[str, int]]) -> None:
        """Place the stationary tiles, the ring of streamed tiles and the barriers in shared memory.

        Barriers: ``once`` (stationary tiles landed), then per slot ``full`` and ``empty``."""
        b, S = self.b, self.S
        self.stat_off, self.stat_bytes = {}, 0
        for name, rows in stationary:
            t = b.shared(name, self.cfg.tile_bytes(rows), align=1024, dtype=self.cfg.dtype, swizzle=128)
            self.stat_off[name] = t.offset
            self.stat_bytes += t.nbytes
        self.slot_bytes = sum(self.cfg.tile_bytes(rows) for _, rows in streamed)
        ring = b.shared("ring", self.slot_bytes * S, align=1024, shape=(S, self.slot_bytes), dtype=self.cfg.dtype,
                        swizzle=128)
        self.ring_off = ring.offset
        self.in_slot = {}
        off = 0
        for name, rows in streamed:
            self.in_slot[name] = off
            off += self.cfg.tile_bytes(rows)
        bars = b.shared("bars", 8 * (1 + 2 * S), align=8, dtype="b64")
        if b.kernel.shared_bytes > MAX_DYN_SMEM:
            raise ShapeError(f"{self.cfg.name}: {b.kernel.shared_bytes} B of shared memory exceed the {MAX_DYN_SMEM} B "
                             "an sm_90 CTA can have; use fewer stages or smaller blocks")
        self.smem = b.mov("u32", "smem")
        self.once = b.binop("add", "u32", self.smem, bars.offset)
        self.full0 = b.binop("add", "u32", self.once, 8)
        self.empty0 = b.binop("add", "u32", self.full0, 8 * S)

    def init_barriers(self, tid: Reg) -> None:
        """Thread 0 initialises the barriers and publishes them to the async proxy; all meet after."""
        b = self.b
        release = 4 * self.cfg.consumers  # one arrival per consumer warp (its lane 0)
        with b.if_(b.setp("eq", "u32", tid, 0)):
            b.emit("mbarrier.init.shared::cta.b64", f"[{self.once}]", 1)
            for s in range(self.S):
                b.emit("mbarrier.init.shared::cta.b64", f"[{self.full0}+{8 * s}]", 1)
                b.emit("mbarrier.init.shared::cta.b64", f"[{self.empty0}+{8 * s}]", release)
            b.emit("fence.mbarrier_init.release.cluster")
            b.emit("fence.proxy.async.shared::cta")
        b.emit("bar.sync", 0)

    # -- producer
    def load_tile(self, tmap: Reg, dst: Reg | int, dst_off: int, rows: int, t0: Reg, head: Reg, batch: Reg,
                  bar: Reg) -> None:
        """TMA copies of a ``rows x D`` tile at row ``t0`` of (``head``, ``batch``): one box per 64 columns."""
        b = self.b
        for c in range(self.cfg.chunks):
            d0 = b.mov("u32", BOX_COLS * c)
            b.emit(TMA_LOAD, f"[{dst}+{dst_off + c * rows * ROW_BYTES}]",
                   f"[{tmap}, {{{d0}, {t0}, {head}, {batch}}}]", f"[{bar}]")

    # -- consumer arithmetic
    def zeros(self, n: int) -> list[Reg]:
        return [self.b.mov("f32", 0.0) for _ in range(n)]

    def mma_ss(self, acc: list[Reg], a_addr: Reg, a_rows: int, b_addr: Reg, b_rows: int, n: int,
               first: bool) -> None:
        """``acc (+)= A B^T`` over the head dim: A a K-major ``64 x D`` slice, B a K-major ``n x D`` tile.

        ``a_rows`` / ``b_rows``: rows of the tiles the slices sit in (their 64-column boxes are
        that many rows x 128 bytes apart).  ``first``: the first k-step overwrites ``acc``."""
        b = self.b
        kconst = L.encode_desc(0, 16, SBO, 128)
        da, db = _desc(b, a_addr, kconst), _desc(b, b_addr, kconst)
        zero, one = self._scale_preds()
        for kk in range(self.D // 16):
            chunk, within = divmod(kk, 4)
            dak = b.binop("add", "s64", da, (chunk * a_rows * ROW_BYTES + within * 32) >> 4) if kk else da
            dbk = b.binop("add", "s64", db, (chunk * b_rows * ROW_BYTES + within * 32) >> 4) if kk else db
            b.emit(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{self.ptx_t}.{self.ptx_t}", ops.reg_vector(acc), dak, dbk,
                   zero if first and kk == 0 else one, 1, 1, 0, 0)

    def mma_rs(self, acc: list[Reg], a_frags: list[list[Reg]], b_addr: Reg, b_rows: int) -> None:
        """``acc += A B`` with A in registers (k16 fragments over ``16 * len(a_frags)`` rows of B) and
        B an MN-major ``b_rows x D`` tile (the contraction runs down its rows)."""
        b = self.b
        mconst = L.encode_desc(0, b_rows * ROW_BYTES, SBO, 128)
        db = _desc(b, b_addr, mconst)
        _, one = self._scale_preds()
        for kk, frag in enumerate(a_frags):
            dbk = b.binop("add", "s64", db, (kk * 16 * ROW_BYTES) >> 4) if kk else db
            b.emit(f"wgmma.mma_async.sync.aligned.m64n{self.D}k16.f32.{self.ptx_t}.{self.ptx_t}", ops.reg_vector(acc),
                   ops.reg_vector(frag), dbk, one, 1, 1, 1)

    def _scale_preds(self) -> tuple[Reg, Reg]:
        if not hasattr(self, "_preds"):
            b = self.b
            zero = b.reg("pred")
            b.emit("setp.ne.u32", zero, self._zero_reg(), self._zero_reg())
            one = b.reg("pred")
            b.emit("setp.eq.u32", one, self._zero_reg(), self._zero_reg())
            self._preds = (zero, one)
        return self._preds

    def _zero_reg(self) -> Reg:
        if not hasattr(self, "_zero"):
            self._zero = self.b.mov("u32", 0)
        return self._zero

    def pack(self, vals: list[Reg]) -> list[list[Reg]]:
        """Round an accumulator's values in pairs into k16 A fragments: 16 columns -> 4 registers."""
        b = self.b
        frags = []
        for t in range(len(vals) // 8):
            regs = []
            for j in range(4):
                r = b.reg("b32")
                b.emit(self.pack_op, r, vals[8 * t + 2 * j + 1], vals[8 * t + 2 * j])  # hi, lo
                regs.append(r)
            frags.append(regs)
        return frags

    def mask(self, vals: list[Reg], lo: list[Reg | None], hi: list[Reg]) -> None:
        """Set to -inf every value whose column offset ``o`` (from the thread's first column) is
        outside ``lo[row] <= o < hi[row]`` (signed; ``lo[row]`` None: no lower bound)."""
        b = self.b
        p = b.reg("pred")
        q = b.reg("pred")
        for i, v in enumerate(vals):
            h = _row_of(i)
            b.emit("setp.gt.s32", p, hi[h], _col_off(i))
            if lo[h] is not None:
                b.emit("setp.le.s32", q, lo[h], _col_off(i))
                b.emit("and.pred", p, p, q)
            b.emit("selp.f32", v, v, NEG_INF, p)


def _geometry(f: _Flash, heads: Reg):
    """(block index, head, batch) of this CTA: grid (blocks, batches x ``heads``), the last blocks
    launched first (causal query blocks late in T do the most work)."""
    b = f.b
    blk = b.binop("sub", "u32", b.binop("sub", "u32", b.sreg("%nctaid.x"), 1), b.sreg("%ctaid.x"))
    y = b.sreg("%ctaid.y")
    return blk, b.binop("rem", "u32", y, heads), b.binop("div", "u32", y, heads)


def generate(cfg: FlashConfig) -> Kernel:
    """Build the kernel for ``cfg``."""
    cfg.validate()
    if cfg.pass_ == "fwd":
        return _forward(cfg)
    if cfg.pass_ == "dq":
        return _backward_dq(cfg)
    return _backward_dkv(cfg)


# -- pieces shared by the passes -------------------------------------------------------------


def _producer(f: _Flash, stationary, n_iter: Reg, stream, live=None) -> None:
    """Warpgroup 0: give registers away; thread 0 loads the stationary tiles once (``stationary(bar)``)
    and then ``n_iter`` streamed slots (``stream(it, dst, full)``), each into a free ring slot;
    ``live(it)`` (a predicate) skips the blocks a block mask leaves out for the whole CTA."""
    b, cfg = f.b, f.cfg
    b.emit("setmaxnreg.dec.sync.aligned.u32", cfg.maxnreg[0])
    with b.if_(b.setp("eq", "u32", b.sreg("%tid.x"), 0)):
        b.emit("mbarrier.arrive.expect_tx.shared::cta.b64", "_", f"[{f.once}]", f.stat_bytes)
        stationary(f.once)
        slot, phase, par, it = b.mov("u32", 0), b.mov("u32", 0), b.reg("u32"), b.reg("u32")
        with b.if_(b.setp("ne", "u32", n_iter, 0)):
            with b.loop(it, 0, n_iter, 1), _only_if(b, live, it):
                # a fresh barrier counts the phase before 0 as complete: the first lap passes at once
                b.emit("xor.b32", par, phase, 1)
                ops.mbar_wait(b, b.mad("u32", slot, 8, f.empty0), par)
                full = b.mad("u32", slot, 8, f.full0)
                b.emit("mbarrier.arrive.expect_tx.shared::cta.b64", "_", f"[{full}]", f.slot_bytes)
                stream(it, b.mad("u32", slot, f.slot_bytes, b.binop("add", "u32", f.smem, f.ring_off)), full)
                ops.ring_advance(b, slot, phase, f.S)


@contextlib.contextmanager
def _only_if(b: Builder, live, it):
    """The statements inside run where ``live(it)`` holds (all of them without ``live``)."""
    if live is None:
        yield
        return
    with b.if_(live(it)):
        yield


def _consume(f: _Flash, n_iter: Reg, body, live=None) -> None:
    """A consumer warpgroup's loop: wait for the stationary tiles, then per streamed slot wait until
    it is full, run ``body(it, slot_addr)`` and hand the slot back (lane 0 of each warp); the blocks
    where ``live(it)`` fails were never loaded (the producer's ``live``) and are passed over."""
    b = f.b
    slot, phase, it = b.mov("u32", 0), b.mov("u32", 0), b.reg("u32")
    lane0 = b.setp("eq", "u32", b.binop("and", "b32", b.sreg("%tid.x"), 31), 0)
    ops.mbar_wait(b, f.once, b.mov("u32", 0))
    with b.if_(b.setp("ne", "u32", n_iter, 0)):
        with b.loop(it, 0, n_iter, 1), _only_if(b, live, it):
            ops.mbar_wait(b, b.mad("u32", slot, 8, f.full0), phase)
            body(it, b.mad("u32", slot, f.slot_bytes, b.binop("add", "u32", f.smem, f.ring_off)))
            b.emit("mbarrier.arrive.shared::cta.b64", "_", f"[{b.mad('u32', slot, 8, f.empty0)}]", pred=lane0)
            ops.ring_advance(b, slot, phase, f.S)


class _Rows:
    """A consumer thread's place: its warpgroup's index and first row, the rows of its two
    accumulator halves (g and g + 8 of its warp's 16), its first column 2q, its lane."""

    def __init__(self, f: _Flash, m0: Reg):
        b = f.b
        tid = b.sreg("%tid.x")
        self.cidx = b.binop("sub", "u32", b.binop("shr", "u32", tid, 7), 1)
        wtid = b.binop("and", "b32", tid, 127)
        self.lane = b.binop("and", "b32", tid, 31)
        self.first = b.mad("u32", self.cidx, CONSUMER_ROWS, m0)
        r0 = b.mad("u32", b.binop("shr", "u32", wtid, 5), 16, self.first)
        r0 = b.binop("add", "u32", r0, L.GROUP.emit(b, self.lane))
        self.rows = [r0, b.binop("add", "u32", r0, 8)]
        self.col2q = L.QUAD2.emit(b, self.lane)

    def slice_addr(self, f: _Flash, tile: str) -> Reg:
        """Shared address of this warpgroup's 64-row slice of a stationary tile."""
        b = f.b
        return b.mad("u32", self.cidx, CONSUMER_ROWS * ROW_BYTES, b.binop("add", "u32", f.smem, f.stat_off[tile]))


class _BlockMask:
    """A block mask (``mask``: int32 [ceil(Tq / bs), ceil(Tk / bs)], 0 = skipped; a null pointer: no
    mask) read by the kernel: whether the block pair holding a query and a key position is computed.

    The mask's block size is a multiple of 64 and every block the kernels stream or hold starts on
    a multiple of 64 rows and spans 64-row chunks that each lie in one mask block, so a chunk's
    liveness is one lookup.  Positions past the end are clamped to the last row / key."""

    def __init__(self, f: _Flash, p: dict):
        b = self.b = f.b
        self.ptr, self.bs, self.nk = p["mask"], p["mask_bs"], p["mask_nk"]
        self.on = b.setp("ne", "u64", self.ptr, 0)
        self.q_last = b.binop("sub", "u32", p["Tq"], 1)
        self.k_last = b.binop("sub", "u32", p["Tk"], 1)

    def live(self, qpos: Reg, kpos: Reg) -> Reg:
        """A predicate: the mask keeps the block pair of (``qpos``, ``kpos``) (true without a mask)."""
        b = self.b
        qi = b.binop("div", "u32", b.binop("min", "u32", qpos, self.q_last), self.bs)
        ki = b.binop("div", "u32", b.binop("min", "u32", kpos, self.k_last), self.bs)
        a = b.reg("u64")
        b.emit("mul.wide.u32", a, b.mad("u32", qi, self.nk, ki), 4)
        b.emit("add.u64", a, a, self.ptr)
        v = b.mov("u32", 1)
        b.emit("ld.global.u32", v, f"[{a}]", pred=self.on)
        return b.setp("ne", "u32", v, 0)

    def any(self, pairs) -> Reg:
        """Whether any of the (query position, key position) pairs' blocks is kept."""
        b = self.b
        out = None
        for q, k in pairs:
            p = self.live(q, k)
            if out is not None:
                b.emit("or.pred", p, p, out)
            out = p
        return out


def _chunk_starts(b: Builder, n0: Reg, rows: int) -> list[Reg]:
    """The first row of each 64-row chunk of a block of ``rows`` rows starting at ``n0``."""
    return [n0] + [b.binop("add", "u32", n0, 64 * j) for j in range(1, -(-rows // 64))]


def _kill_dead_chunks(f: _Flash, s: list[Reg], chunk_live: list[Reg]) -> None:
    """-inf for the scores of 64-key chunks of the block the mask leaves out (registers 32 j .. 32 j +
    31 hold chunk j's columns, ``layout.wgmma_d_map``)."""
    b = f.b
    if len(chunk_live) < 2:
        return  # the chunk is the block: a dead one was skipped whole
    for j, live in enumerate(chunk_live):
        with b.if_(live, negate=True):
            for r in s[32 * j: 32 * (j + 1)]:
                b.emit("mov.f32", r, NEG_INF)


def _key_limits(f: _Flash, rows: list[Reg], first: Reg, tk: Reg, causal: Reg) -> tuple[list[Reg], Reg]:
    """Each row's key limit (keys < limit are seen: Tk, or causal min(row + 1, Tk)) and the limit
    of the warpgroup's first row, the smallest (a block below it needs no mask)."""
    b = f.b
    out = []
    for r in [*rows, first]:
        lim = b.binop("min", "u32", b.binop("add", "u32", r, 1), tk)
        b.emit("mov.u32", lim, tk, pred=causal, negate=True)
        out.append(lim)
    return out[:2], out[2]


def _mask_keys(f: _Flash, s: list[Reg], n0: Reg, bn: int, rows: _Rows, lims: list[Reg], lim_min: Reg) -> None:
    """-inf for the scores of keys at or past each row's limit, in the blocks that reach past the
    warpgroup's smallest limit (the causal diagonal, the tail of Tk) only."""
    b = f.b
    with b.if_(b.setp("gt", "u32", b.binop("add", "u32", n0, bn), lim_min)):
        col0 = b.binop("add", "u32", n0, rows.col2q)
        hi = [b.binop("sub", "s32", lims[h], col0) for h in range(2)]
        f.mask(s, [None, None], hi)


def _row_stat(f: _Flash, ptr: Reg, idx: Reg, inside: Reg, default: float, mult: float | None = None) -> Reg:
    """``ptr[idx]`` (f32) where ``inside``, else ``default``; times ``mult`` if given."""
    b = f.b
    v = b.mov("f32", default)
    a = b.reg("u64")
    b.emit("mul.wide.u32", a, idx, 4)
    b.emit("add.u64", a, a, ptr)
    b.emit("ld.global.f32", v, f"[{a}]", pred=inside)
    if mult is not None:
        b.emit("mul.f32", v, v, mult)
    return v


def _row_addr(b: Builder, base: Reg, strides: tuple, batch: Reg, head: Reg, row: Reg) -> Reg:
    """The byte address of element 0 of ``row`` of (``batch``, ``head``) of the 16-bit [B, heads, T, D]
    tensor at ``base`` with element strides ``strides`` (registers), in 64 bits."""
    a, term = b.reg("u64"), b.reg("u64")
    for i, x in enumerate((batch, head, row)):
        b.emit("mul.wide.u32", a if i == 0 else term, x, strides[i])
        if i:
            b.emit("add.u64", a, a, term)
    b.emit("shl.b64", a, a, 1)
    b.emit("add.u64", a, a, base)
    return a


def _store_rows(f: _Flash, acc: list[Reg], rows: _Rows, out: Reg, strides: tuple, batch: Reg, head: Reg,
                t_len: Reg, mult: list[Reg | None]) -> None:
    """Store a warpgroup's ``64 x D`` accumulator to the [B, heads, T, D] tensor at ``out`` whose
    element strides of B, heads and T are the registers ``strides`` (D's is 1), at ``batch`` and
    ``head``: pairs of columns rounded to the dtype (each row's values times ``mult[row]`` first),
    rows >= T skipped.  (A contiguous tensor's strides are (heads T D, T D, D); token-major O and
    the columns of a fused QKV gradient are others.)"""
    b = f.b
    col = b.reg("u64")
    b.emit("mul.wide.u32", col, rows.col2q, 2)  # the thread's first column, in bytes
    for h in range(2):
        inside = b.setp("lt", "u32", rows.rows[h], t_len)
        base = _row_addr(b, out, strides, batch, head, rows.rows[h])
        b.emit("add.u64", base, base, col)
        idx = [i for i in range(len(acc)) if _row_of(i) == h]
        for j in range(0, len(idx), 2):
            lo, hi = acc[idx[j]], acc[idx[j + 1]]
            if mult[h] is not None:
                lo, hi = b.binop("mul", "f32", lo, mult[h]), b.binop("mul", "f32", hi, mult[h])
            pk = b.reg("b32")
            b.emit(f.pack_op, pk, hi, lo)
            b.emit("st.global.b32", f"[{base}+{_col_off(idx[j]) * 2}]", pk, pred=inside)


def _out_stride_regs(p: dict) -> tuple:
    """The outputs' stride parameters (OUT_STRIDES) as registers."""
    return p["out_sb"], p["out_sh"], p["out_st"]


def _roles(f: _Flash, producer, consumer) -> None:
    """Warpgroup 0 runs ``producer()``, the others ``consumer()`` (after taking registers)."""
    b = f.b
    is_prod = b.setp("lt", "u32", b.sreg("%tid.x"), 128)
    with b.if_(is_prod):
        producer()
    with b.if_(is_prod, negate=True):
        b.emit("setmaxnreg.inc.sync.aligned.u32", f.cfg.maxnreg[1])
        consumer()


# -- forward -----------------------------------------------------------------------------------

# out_sb, out_sh, out_st: the element strides of B, heads and T of the outputs (O; dQ; dK and dV, which
# share them), which may be any layout with D's stride 1 (token-major O, a fused QKV gradient's columns)
OUT_STRIDES = [("out_sb", "u32"), ("out_sh", "u32"), ("out_st", "u32")]
FWD_PARAMS = [("tmap_q", "tmap"), ("tmap_k", "tmap"), ("tmap_v", "tmap"), ("o", "u64"), ("lse", "u64"),
              ("Tq", "u32"), ("Tk", "u32"), ("H", "u32"), ("group", "u32"), ("scale_log2", "f32"),
              ("causal", "u32"), ("mask", "u64"), ("mask_bs", "u32"), ("mask_nk", "u32"), *OUT_STRIDES]


def _query_block_setup(f: _Flash, p: dict):
    """(m0, head, kv head, batch, causal predicate, key blocks to visit) of a query-block CTA
    (``fwd``, ``dq``): grid (query blocks, B x H), the last query blocks (the most keys, when
    causal) launched first."""
    b, cfg = f.b, f.cfg
    qblk, head, batch = _geometry(f, p["H"])
    m0 = b.binop("mul.lo", "u32", qblk, cfg.bm)
    kv_head = b.binop("div", "u32", head, p["group"])
    causal = b.setp("ne", "u32", p["causal"], 0)
    seen = b.binop("min", "u32", b.binop("add", "u32", m0, cfg.bm), p["Tk"])  # causal: up to the block's last row
    b.emit("mov.u32", seen, p["Tk"], pred=causal, negate=True)
    n_kv = b.binop("div", "u32", b.binop("add", "u32", seen, cfg.bn - 1), cfg.bn)
    return m0, head, kv_head, batch, causal, n_kv


def _forward(cfg: FlashConfig) -> Kernel:
    """O and L for one query block of one head: stream K/V blocks through an online softmax."""
    f = _Flash(cfg)
    b = f.b
    p = f.params(FWD_PARAMS)
    f.layout_shared([("q", cfg.bm)], [("k", cfg.bn), ("v", cfg.bn)])
    f.init_barriers(b.sreg("%tid.x"))
    m0, head, kv_head, batch, causal, n_kv = _query_block_setup(f, p)
    mask = _BlockMask(f, p)
    live = _query_block_live(f, mask, m0)

    def stream(it, dst, full):
        t0 = b.binop("mul.lo", "u32", it, cfg.bn)
        f.load_tile(p["tmap_k"], dst, f.in_slot["k"], cfg.bn, t0, kv_head, batch, full)
        f.load_tile(p["tmap_v"], dst, f.in_slot["v"], cfg.bn, t0, kv_head, batch, full)

    _roles(f, lambda: _producer(f, lambda bar: f.load_tile(p["tmap_q"], f.smem, f.stat_off["q"], cfg.bm, m0, head,
                                                            batch, bar), n_kv, stream, live),
           lambda: _forward_consumer(f, p, m0, head, batch, causal, n_kv, mask, live))
    return b.build()


def _query_block_live(f: _Flash, mask: _BlockMask, m0: Reg):
    """``live(it)`` of a query-block CTA: some 64-row group of it keeps some 64-key chunk of block ``it``."""
    b, cfg = f.b, f.cfg

    def live(it):
        n0 = b.binop("mul.lo", "u32", it, cfg.bn)
        return mask.any([(r, c) for r in _chunk_starts(b, m0, cfg.bm) for c in _chunk_starts(b, n0, cfg.bn)])

    return live


def _warpgroup_chunks(f: _Flash, mask: _BlockMask, rows: "_Rows", it: Reg):
    """(start of key block ``it``, each of its 64-key chunks' liveness for this warpgroup's rows, any)."""
    b, cfg = f.b, f.cfg
    n0 = b.binop("mul.lo", "u32", it, cfg.bn)
    chunks = [mask.live(rows.first, c) for c in _chunk_starts(b, n0, cfg.bn)]
    any_ = b.reg("pred")
    b.emit("mov.pred", any_, chunks[0])
    for c in chunks[1:]:
        b.emit("or.pred", any_, any_, c)
    return n0, chunks, any_


def _forward_consumer(f: _Flash, p: dict, m0, head, batch, causal, n_kv, mask, live) -> None:
    """One consumer warpgroup: its 64 query rows against every key block, then O and L stored."""
    b, cfg = f.b, f.cfg
    rows = _Rows(f, m0)
    q_addr = rows.slice_addr(f, "q")
    o_acc = f.zeros(f.D // 2)
    m_run = [b.mov("f32", NEG_INF) for _ in range(2)]
    l_run = f.zeros(2)
    s_acc = f.zeros(cfg.bn // 2)  # written once so the first scale-d = 0 wgmma reads defined registers
    lims, lim_min = _key_limits(f, rows.rows, rows.first, p["Tk"], causal)

    def body(it, slot):
        n0, chunks, any_live = _warpgroup_chunks(f, mask, rows, it)
        with b.if_(any_live):
            b.emit("wgmma.fence.sync.aligned")
            f.mma_ss(s_acc, q_addr, cfg.bm, b.binop("add", "u32", slot, f.in_slot["k"]), cfg.bn, cfg.bn, first=True)
            b.emit("wgmma.commit_group.sync.aligned")
            b.emit("wgmma.wait_group.sync.aligned", 0)
            _kill_dead_chunks(f, s_acc, chunks)
            _mask_keys(f, s_acc, n0, cfg.bn, rows, lims, lim_min)
            _online_softmax(f, s_acc, o_acc, m_run, l_run, p["scale_log2"])
            probs = f.pack(s_acc)
            b.emit("wgmma.fence.sync.aligned")
            f.mma_rs(o_acc, probs, b.binop("add", "u32", slot, f.in_slot["v"]), cfg.bn)
            b.emit("wgmma.commit_group.sync.aligned")
            b.emit("wgmma.wait_group.sync.aligned", 0)

    _consume(f, n_kv, body, live)
    bh = b.mad("u32", batch, p["H"], head)
    inv = []
    for h in range(2):
        r = b.reg("f32")
        b.emit("rcp.rn.f32", r, l_run[h])
        inv.append(r)
    _store_rows(f, o_acc, rows, p["o"], _out_stride_regs(p), batch, head, p["Tq"], inv)
    q0 = b.setp("eq", "u32", b.binop("and", "b32", rows.lane, 3), 0)
    for h in range(2):  # L = (m + log2 l) ln 2, by the quad's first lane
        lse = b.reg("f32")
        b.emit("lg2.approx.ftz.f32", lse, l_run[h])
        b.emit("add.f32", lse, lse, m_run[h])
        b.emit("mul.f32", lse, lse, math.log(2.0))
        st = b.reg("pred")
        b.emit("and.pred", st, b.setp("lt", "u32", rows.rows[h], p["Tq"]), q0)
        ptr = b.reg("u64")
        b.emit("mul.wide.u32", ptr, b.mad("u32", bh, p["Tq"], rows.rows[h]), 4)
        b.emit("add.u64", ptr, ptr, p["lse"])
        b.emit("st.global.f32", f"[{ptr}]", lse, pred=st)


def _online_softmax(f: _Flash, s: list[Reg], o: list[Reg], m_run: list[Reg], l_run: list[Reg], scale_log2) -> None:
    """Fold one block of scores into the running max / sum and rescale O; ``s`` becomes P.

    Per row (base 2): m' = max(m, max_j s_j * c), P_j = 2^(s_j c - m'), l = l 2^(m - m') +
    sum_j P_j, O *= 2^(m - m').  A row whose scores are all masked so far keeps m = -inf;
    it subtracts 0 instead, so its P stays 0 rather than NaN."""
    b = f.b
    for h in range(2):
        idx = [i for i in range(len(s)) if _row_of(i) == h]
        mx = b.mov("f32", NEG_INF)
        for i in idx:
            b.emit("max.f32", mx, mx, s[i])
        _quad_reduce(b, mx, "max")
        m_new = b.reg("f32")
        b.emit("mul.f32", mx, mx, scale_log2)
        b.emit("max.f32", m_new, m_run[h], mx)
        m_use = b.reg("f32")
        b.emit("selp.f32", m_use, 0.0, m_new, b.setp("eq", "f32", m_new, NEG_INF))
        neg_m = b.reg("f32")
        b.emit("neg.f32", neg_m, m_use)
        corr = b.binop("sub", "f32", m_run[h], m_use)
        b.emit("ex2.approx.ftz.f32", corr, corr)
        total = b.mov("f32", 0.0)
        for i in idx:
            b.emit("fma.rn.f32", s[i], s[i], scale_log2, neg_m)
            b.emit("ex2.approx.ftz.f32", s[i], s[i])
            b.emit("add.f32", total, total, s[i])
        _quad_reduce(b, total, "add")
        b.emit("fma.rn.f32", l_run[h], l_run[h], corr, total)
        b.emit("mov.f32", m_run[h], m_new)
        for i in range(len(o)):
            if _row_of(i) == h:
                b.emit("mul.f32", o[i], o[i], corr)


# -- backward ----------------------------------------------------------------------------------

# d_here (dq only; 0 in dkv): the dq kernel computes D = rowsum(dO * O) itself from O and dO in global
# memory (o_in, do_in: addresses; o_s*, do_s*: element strides of B, heads and T; rows 16-byte
# aligned) and stores it at ``delta`` for the dkv kernel, instead of reading it there.
D_PARAMS = [("d_here", "u32"), ("o_in", "u64"), ("do_in", "u64"), ("o_sb", "u32"), ("o_sh", "u32"), ("o_st", "u32"),
            ("do_sb", "u32"), ("do_sh", "u32"), ("do_st", "u32")]
BWD_PARAMS = [("tmap_q", "tmap"), ("tmap_k", "tmap"), ("tmap_v", "tmap"), ("tmap_do", "tmap"), ("lse", "u64"),
              ("delta", "u64"), ("out0", "u64"), ("out1", "u64"), ("Tq", "u32"), ("Tk", "u32"), ("H", "u32"),
              ("group", "u32"), ("scale_log2", "f32"), ("scale", "f32"), ("causal", "u32"), ("mask", "u64"),
              ("mask_bs", "u32"), ("mask_nk", "u32"), *OUT_STRIDES, *D_PARAMS]


def _prob_and_grad(f: _Flash, s: Reg, dp: Reg, neg_lse2: Reg, delta: Reg, scale_log2) -> None:
    """One score and its dP in place: ``s`` <- P = 2^(s c - L log2 e), ``dp`` <- dS = P (dP - D);
    ``neg_lse2`` holds -L log2 e and ``delta`` D of the value's query."""
    b = f.b
    b.emit("fma.rn.f32", s, s, scale_log2, neg_lse2)
    b.emit("ex2.approx.ftz.f32", s, s)
    b.emit("sub.f32", dp, dp, delta)
    b.emit("mul.f32", dp, dp, s)


def _halves(f: _Flash, word: Reg) -> tuple[Reg, Reg]:
    """The two 16-bit values of ``word`` (low first) as f32 registers."""
    b = f.b
    lo, hi = b.reg("f32"), b.reg("f32")
    if f.cfg.dtype == "bf16":  # a bf16 is the top half of its f32
        b.emit("shl.b32", lo, word, 16)
        b.emit("and.b32", hi, word, 0xFFFF0000)
        return lo, hi
    top = b.binop("shr", "b32", word, 16)
    for half, dst in ((word, lo), (top, hi)):
        h = b.reg("b16")
        b.emit("cvt.u16.u32", h, half)  # the low 16 bits
        b.emit("cvt.f32.f16", dst, h)
    return lo, hi


def _row_delta(f: _Flash, p: dict, rows: "_Rows", h: int, idx: Reg, inside: Reg, batch: Reg, head: Reg) -> Reg:
    """D of the thread's query row ``rows.rows[h]`` (``idx``: its index in ``delta``): read from
    ``delta``, or where ``d_here`` rowsum(dO * O) from O and dO in global memory, stored there.  The
    4 lanes of a quad share the row: each sums 8-value runs q, q + 4, ... of the head dim (16 bytes
    a load) and the quad adds the 4 sums."""
    b = f.b
    here = b.setp("ne", "u32", p["d_here"], 0)
    read = b.reg("pred")
    b.emit("and.pred", read, inside, b.setp("eq", "u32", p["d_here"], 0))
    v = _row_stat(f, p["delta"], idx, read, 0.0)
    with b.if_(here):
        row = rows.rows[h]
        quad = b.binop("and", "b32", rows.lane, 3)
        at_o = _row_addr(b, p["o_in"], (p["o_sb"], p["o_sh"], p["o_st"]), batch, head, row)
        at_do = _row_addr(b, p["do_in"], (p["do_sb"], p["do_sh"], p["do_st"]), batch, head, row)
        first = b.reg("u64")
        b.emit("mul.wide.u32", first, quad, 16)  # run q's byte offset
        b.emit("add.u64", at_o, at_o, first)
        b.emit("add.u64", at_do, at_do, first)
        s = b.mov("f32", 0.0)
        for run in range(f.D // 32):  # this lane's runs: q + 4 run
            wo, wd = [b.mov("b32", 0) for _ in range(4)], [b.mov("b32", 0) for _ in range(4)]
            for words, at in ((wo, at_o), (wd, at_do)):
                b.emit("ld.global.v4.b32", "{" + ", ".join(str(w) for w in words) + "}", f"[{at}+{64 * run}]",
                       pred=inside)
            for x, y in zip(wd, wo):
                for a, c in zip(_halves(f, x), _halves(f, y)):
                    b.emit("fma.rn.f32", s, a, c, s)
        _quad_reduce(b, s, "add")
        b.emit("mov.f32", v, s)
        store = b.reg("pred")
        b.emit("and.pred", store, inside, b.setp("eq", "u32", quad, 0))
        a = b.reg("u64")
        b.emit("mul.wide.u32", a, idx, 4)
        b.emit("add.u64", a, a, p["delta"])
        b.emit("st.global.f32", f"[{a}]", v, pred=store)
    return v


def _backward_dq(cfg: FlashConfig) -> Kernel:
    """dQ of one query block of one head: S = Q K^T and dP = dO V^T per key block, dS = P (dP - D),
    dQ += dS K; dQ scaled once at the end.  ``out0`` is dQ ([B, H, Tq, D]); ``out1`` unused."""
    f = _Flash(cfg)
    b = f.b
    p = f.params(BWD_PARAMS)
    f.layout_shared([("q", cfg.bm), ("do", cfg.bm)], [("k", cfg.bn), ("v", cfg.bn)])
    f.init_barriers(b.sreg("%tid.x"))
    m0, head, kv_head, batch, causal, n_kv = _query_block_setup(f, p)
    mask = _BlockMask(f, p)
    live = _query_block_live(f, mask, m0)

    def stationary(bar):
        f.load_tile(p["tmap_q"], f.smem, f.stat_off["q"], cfg.bm, m0, head, batch, bar)
        f.load_tile(p["tmap_do"], f.smem, f.stat_off["do"], cfg.bm, m0, head, batch, bar)

    def stream(it, dst, full):
        t0 = b.binop("mul.lo", "u32", it, cfg.bn)
        f.load_tile(p["tmap_k"], dst, f.in_slot["k"], cfg.bn, t0, kv_head, batch, full)
        f.load_tile(p["tmap_v"], dst, f.in_slot["v"], cfg.bn, t0, kv_head, batch, full)

    def consumer():
        rows = _Rows(f, m0)
        q_addr, do_addr = rows.slice_addr(f, "q"), rows.slice_addr(f, "do")
        bh = b.mad("u32", batch, p["H"], head)
        lse2, delta = [], []
        for h in range(2):
            inside = b.setp("lt", "u32", rows.rows[h], p["Tq"])
            idx = b.mad("u32", bh, p["Tq"], rows.rows[h])
            lse2.append(_row_stat(f, p["lse"], idx, inside, 0.0, -LOG2E))
            delta.append(_row_delta(f, p, rows, h, idx, inside, batch, head))
        lims, lim_min = _key_limits(f, rows.rows, rows.first, p["Tk"], causal)
        dq = f.zeros(f.D // 2)
        s, dp = f.zeros(cfg.bn // 2), f.zeros(cfg.bn // 2)

        def body(it, slot):
            n0, chunks, any_live = _warpgroup_chunks(f, mask, rows, it)
            with b.if_(any_live):
                k_addr = b.binop("add", "u32", slot, f.in_slot["k"])
                b.emit("wgmma.fence.sync.aligned")
                f.mma_ss(s, q_addr, cfg.bm, k_addr, cfg.bn, cfg.bn, first=True)
                f.mma_ss(dp, do_addr, cfg.bm, b.binop("add", "u32", slot, f.in_slot["v"]), cfg.bn, cfg.bn, first=True)
                b.emit("wgmma.commit_group.sync.aligned")
                b.emit("wgmma.wait_group.sync.aligned", 0)
                _kill_dead_chunks(f, s, chunks)
                _mask_keys(f, s, n0, cfg.bn, rows, lims, lim_min)
                for i in range(len(s)):
                    _prob_and_grad(f, s[i], dp[i], lse2[_row_of(i)], delta[_row_of(i)], p["scale_log2"])
                ds = f.pack(dp)
                b.emit("wgmma.fence.sync.aligned")
                f.mma_rs(dq, ds, k_addr, cfg.bn)
                b.emit("wgmma.commit_group.sync.aligned")
                b.emit("wgmma.wait_group.sync.aligned", 0)

        _consume(f, n_kv, body, live)
        _store_rows(f, dq, rows, p["out0"], _out_stride_regs(p), batch, head, p["Tq"], [p["scale"]] * 2)

    _roles(f, lambda: _producer(f, stationary, n_kv, stream, live), consumer)
    return b.build()


def _backward_dkv(cfg: FlashConfig) -> Kernel:
    """dK and dV of one key block of one K/V head: per query block of every query head sharing it,
    S^T = K Q^T, dP^T = V dO^T, P^T and dS^T = P^T (dP^T - D) with each column's (query's) L and D,
    dV += P^T dO, dK += dS^T Q; dK scaled once at the end.  ``out0`` is dK, ``out1`` dV
    ([B, H / group, Tk, D]).  Grid (key blocks, B x K/V heads)."""
    f = _Flash(cfg)
    b = f.b
    p = f.params(BWD_PARAMS)
    f.layout_shared([("k", cfg.bm), ("v", cfg.bm)], [("q", cfg.bn), ("do", cfg.bn)])
    f.init_barriers(b.sreg("%tid.x"))
    kblk, kv_head, batch = _geometry(f, b.binop("div", "u32", p["H"], p["group"]))
    k0 = b.binop("mul.lo", "u32", kblk, cfg.bm)
    causal = b.setp("ne", "u32", p["causal"], 0)
    # query blocks that see this key block: all, or (causal) those from the one holding row k0
    first_q = b.binop("div", "u32", k0, cfg.bn)
    b.emit("mov.u32", first_q, 0, pred=causal, negate=True)
    n_q = b.binop("div", "u32", b.binop("add", "u32", p["Tq"], cfg.bn - 1), cfg.bn)
    per_head = b.binop("sub", "u32", b.binop("max", "u32", n_q, first_q), first_q)
    n_iter = b.binop("mul.lo", "u32", per_head, p["group"])
    mask = _BlockMask(f, p)

    def which(it):
        """(query head, first query row) of iteration ``it``: heads of the group outermost."""
        hq = b.binop("div", "u32", it, per_head)
        qb = b.binop("add", "u32", first_q, b.binop("rem", "u32", it, per_head))
        return b.mad("u32", kv_head, p["group"], hq), b.binop("mul.lo", "u32", qb, cfg.bn)

    def live(it):
        """Whether a block mask keeps query block ``it`` against either 64-key group of the CTA (the
        streamed block lies in one 64-row group: bn divides 64 with a mask)."""
        return mask.any([(which(it)[1], c) for c in _chunk_starts(b, k0, cfg.bm)])

    def stationary(bar):
        f.load_tile(p["tmap_k"], f.smem, f.stat_off["k"], cfg.bm, k0, kv_head, batch, bar)
        f.load_tile(p["tmap_v"], f.smem, f.stat_off["v"], cfg.bm, k0, kv_head, batch, bar)

    def stream(it, dst, full):
        head, q0 = which(it)
        f.load_tile(p["tmap_q"], dst, f.in_slot["q"], cfg.bn, q0, head, batch, full)
        f.load_tile(p["tmap_do"], dst, f.in_slot["do"], cfg.bn, q0, head, batch, full)

    def consumer():
        rows = _Rows(f, k0)
        k_addr, v_addr = rows.slice_addr(f, "k"), rows.slice_addr(f, "v")
        dk, dv = f.zeros(f.D // 2), f.zeros(f.D // 2)
        s, dp = f.zeros(cfg.bn // 2), f.zeros(cfg.bn // 2)

        def body(it, slot):
            head, q0 = which(it)
            with b.if_(mask.live(q0, rows.first)):
                q_slot, do_slot = (b.binop("add", "u32", slot, f.in_slot[t]) for t in ("q", "do"))
                b.emit("wgmma.fence.sync.aligned")
                f.mma_ss(s, k_addr, cfg.bm, q_slot, cfg.bn, cfg.bn, first=True)
                f.mma_ss(dp, v_addr, cfg.bm, do_slot, cfg.bn, cfg.bn, first=True)
                b.emit("wgmma.commit_group.sync.aligned")
                b.emit("wgmma.wait_group.sync.aligned", 0)
                col0 = b.binop("add", "u32", q0, rows.col2q)
                # causal: query (column) c sees key (row) r only when r <= c
                with b.if_(causal):
                    with b.if_(b.setp("lt", "u32", q0, b.binop("add", "u32", rows.first, CONSUMER_ROWS))):
                        lo = [b.binop("sub", "s32", r, col0) for r in rows.rows]
                        big = b.mov("s32", 1 << 30)
                        f.mask(s, lo, [big, big])
                # each column's (query's) L and D, loaded just before the values that use them (registers
                # i and i + 2 share a column); +inf / 0 past Tq, so that P is 0 there
                stat0 = b.mad("u32", b.mad("u32", batch, p["H"], head), p["Tq"], col0)
                for off in sorted({_col_off(i) for i in range(len(s))}):
                    inside = b.setp("lt", "u32", b.binop("add", "u32", col0, off), p["Tq"])
                    at = b.binop("add", "u32", stat0, off)
                    neg_lse2 = _row_stat(f, p["lse"], at, inside, math.inf, -LOG2E)
                    delta = _row_stat(f, p["delta"], at, inside, 0.0)
                    for i in range(len(s)):
                        if _col_off(i) == off:
                            _prob_and_grad(f, s[i], dp[i], neg_lse2, delta, p["scale_log2"])
                probs, ds = f.pack(s), f.pack(dp)
                b.emit("wgmma.fence.sync.aligned")
                f.mma_rs(dv, probs, do_slot, cfg.bn)
                f.mma_rs(dk, ds, q_slot, cfg.bn)
                b.emit("wgmma.commit_group.sync.aligned")
                b.emit("wgmma.wait_group.sync.aligned", 0)

        _consume(f, n_iter, body, live)
        _store_rows(f, dk, rows, p["out0"], _out_stride_regs(p), batch, kv_head, p["Tk"], [p["scale"]] * 2)
        _store_rows(f, dv, rows, p["out1"], _out_stride_regs(p), batch, kv_head, p["Tk"], [None, None])

    _roles(f, lambda: _producer(f, stationary, n_iter, stream, live), consumer)
    return b.build()
