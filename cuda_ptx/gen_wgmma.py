"""Rungs 3-6: ``wgmma.mma_async`` fed by TMA through an mbarrier ring (``sm_90a``).

One generator covers the Hopper rungs; the config picks the shape:

* one consumer warpgroup, thread 0 issuing TMA between tiles (``wgmma_tma``,
  ``wgmma_pipe`` with a deeper ring and two m64 blocks);
* warp specialisation (``producer=True``): warpgroup 0 only issues TMA and gives
  registers back with ``setmaxnreg.dec``; the consumer warpgroups take them with
  ``setmaxnreg.inc`` and each owns ``bm / consumers`` rows (``wgmma_ws``);
* fp8 e4m3 (``wgmma_fp8``): same pipeline, ``k32`` instructions (QGMMA);
* persistent (``persistent=True``, ``wgmma_persistent``): the warp-specialised kernel
  with one CTA per SM, each role looping over the CTA's tiles with the ring position
  carried across them (:func:`_persistent_walk`);
* clusters (``cluster=2``, ``wgmma_cluster``): pairs of CTAs on vertically adjacent tiles,
  each loading half of their shared B tile and multicasting it into both, and releasing
  each slot to both producers (:func:`_cluster_walk`, ``load_b_share``);
* batched (``batched=d``, persistent with ``tma_store``): one launch for a batch of products;
  the tile walk runs over (batch, tile), batch outermost, and every TMA load and store is
  ``2 + d``-dimensional with the batch indices as its outer coordinates (a broadcast
  operand's are 0: ``batch_mask``, see :class:`config.GemmConfig`).

Shared memory per ring slot: the A tile (``bm`` rows x 128 bytes, K-major) then the
B tile, both written by TMA with the 128-byte swizzle and read by wgmma through
descriptors (:func:`layout.encode_desc`):

* ``b_major="k"`` (B stored ``N x K``): ``bn`` rows x 128 bytes, one TMA copy; K-major
  descriptor (LBO 16, unused; SBO 1024 between 8-row N groups), ``imm-trans-b = 0``,
  +32 bytes per k16 step.
* ``b_major="n"`` (B stored ``K x N``, bf16/fp16 only): ``bn / 64`` boxes of ``bk``
  K-rows x 64 N-columns (8 KiB each), one TMA copy per box at ``{n0 + 64 j, k0}``;
  MN-major descriptor (LBO 8192 between 64-column boxes, SBO 1024 between 8-row K
  groups), ``imm-trans-b = 1``, +2048 bytes (16 K-rows) per k16 step.

A is K-major (stored ``M x K``) by default.  ``a_major="m"`` (A stored ``K x M``, i.e. the
transpose of a row-major matrix: the weight gradient's X^T, bf16/fp16 only) mirrors N-major
B: ``bm / 64`` boxes of ``bk`` K-rows x 64 M-columns at ``{m0 + 64 j, k0}``, each one
m64 block's operand; MN-major descriptor, ``imm-trans-a = 1``, +2048 bytes per k16 step.

``full[s]`` (TMA bytes landed) and ``empty[s]`` (consumers done) mbarriers order it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helios.errors import ShapeError

from . import layout as L
from . import ops
from .config import IN_DTYPES, MAX_DYN_SMEM, OUT_DTYPES, GemmConfig
from .ir import Builder, Kernel

SWIZZLE = 128
SBO = 1024  # bytes between 8-row atoms of a K-major 128B-swizzled tile
LBO = 16  # unused by swizzled K-major layouts; 1 (encoded) by convention
K_STEP_BYTES = 32  # one wgmma consumes 32 bytes of K: k16 bf16/fp16, k32 fp8
# MN-major (N-major B) 128B-swizzled tile, as TMA writes a bk x 64 box of B (K x N):
ATOM_BYTES = 128  # one swizzle row: 64 N-elements of a 16-bit type
C_BOX_ROW = 128  # tma_store: bytes per row of a C box (the 128-byte swizzle width)
C_BOX_BYTES = 64 * C_BOX_ROW  # a C box: 64 rows (one wgmma m-block)
LBO_MN = 8192  # bytes between 64-column boxes along N (one box: bk=64 K-rows x 128 B)
SBO_MN = 1024  # bytes between 8-row groups along K (8 K-rows x 128 B)


@dataclass(frozen=True)
class WgmmaPlan:
    """Geometry of a wgmma kernel: slot layout, per-consumer m blocks, descriptor constants."""

    cfg: GemmConfig

    @property
    def a_bytes(self) -> int:
        return self.cfg.bm * 128

    @property
    def n_major(self) -> bool:
        """B is read N-major (``imm-trans-b = 1``) from ``bk x 64`` TMA boxes."""
        return self.cfg.b_major == "n"

    @property
    def m_major(self) -> bool:
        """A is read M-major (``imm-trans-a = 1``) from ``bk x 64`` TMA boxes, one per m64 block."""
        return self.cfg.a_major == "m"

    @property
    def a_boxes(self) -> int:
        """TMA copies of A per k-tile: ``bm / 64`` for M-major, 1 for K-major."""
        return self.cfg.bm // 64 if self.m_major else 1

    @property
    def desc_a_const(self) -> int:
        """A's descriptor with a zero start: MN-major as N-major B's, or K-major."""
        return self._desc_const(self.m_major)

    @property
    def a_step_bytes(self) -> int:
        """How far A's descriptor start moves per wgmma: 32 bytes of K, or 16 K-rows (M-major)."""
        return self._step_bytes(self.m_major)

    @property
    def trans_a(self) -> int:
        """``imm-trans-a``: 1 reads A M-major (transposed), 0 K-major."""
        return int(self.m_major)

    @property
    def b_box_cols(self) -> int:
        """N-columns per TMA box of N-major B: one 128-byte swizzle row."""
        return ATOM_BYTES // self.cfg.in_bytes

    @property
    def b_boxes(self) -> int:
        """TMA copies of B per k-tile: ``bn / 64`` for N-major, 1 for K-major."""
        return self.cfg.bn // self.b_box_cols if self.n_major else 1

    @property
    def b_box_bytes(self) -> int:
        """Bytes one TMA copy of B writes."""
        return self.cfg.bk * ATOM_BYTES if self.n_major else self.cfg.bn * 128

    @property
    def b_bytes(self) -> int:
        return self.b_boxes * self.b_box_bytes

    @property
    def stage_bytes(self) -> int:
        return self.a_bytes + self.b_bytes  # multiple of 1024: bm, bn are multiples of 8

    @property
    def rows_per_consumer(self) -> int:
        return self.cfg.bm // self.cfg.consumers

    @property
    def mblocks(self) -> int:
        return self.rows_per_consumer // 64

    @property
    def ksteps(self) -> int:
        return 128 // K_STEP_BYTES

    @property
    def k_inst(self) -> int:
        return K_STEP_BYTES // self.cfg.in_bytes

    @property
    def desc_const(self) -> int:
        """The K-major descriptor (A, and B when K-major) with a zero start; the kernel ORs in ``addr >> 4``."""
        return L.encode_desc(0, LBO, SBO, SWIZZLE)

    @property
    def desc_b_const(self) -> int:
        """B's descriptor with a zero start: MN-major (LBO between boxes, SBO between K groups) or K-major."""
        return self._desc_const(self.n_major)

    @property
    def b_step_bytes(self) -> int:
        """How far B's descriptor start moves per wgmma: 32 bytes of K (K-major) or 16 K-rows (N-major)."""
        return self._step_bytes(self.n_major)

    @property
    def trans_b(self) -> int:
        """``imm-trans-b``: 1 reads B N-major (transposed), 0 K-major."""
        return int(self.n_major)

    def _desc_const(self, mn_major: bool) -> int:
        """An operand's descriptor with a zero start: the MN-major one (A M-major, B N-major: LBO
        between 64-column boxes, SBO between 8-row K groups) or the K-major one."""
        return L.encode_desc(0, LBO_MN, SBO_MN, SWIZZLE) if mn_major else self.desc_const

    def _step_bytes(self, mn_major: bool) -> int:
        """How far an operand's descriptor start moves per wgmma: 16 K-rows of 128 bytes when it
        is MN-major, else 32 bytes of K."""
        return self.k_inst * ATOM_BYTES if mn_major else K_STEP_BYTES

    def a_offset(self, consumer: int, mb: int, kk: int) -> int:
        """Byte offset in a slot where consumer ``consumer``'s m-block ``mb`` k-step ``kk`` starts
        (64 rows x 128 bytes K-major, or one 64-column box M-major: 8 KiB per m-block either way)."""
        return (consumer * self.rows_per_consumer + mb * 64) * 128 + kk * self.a_step_bytes

    def b_offset(self, kk: int) -> int:
        """Byte offset in a slot where B's operand for k-step ``kk`` starts."""
        return self.a_bytes + kk * self.b_step_bytes

    def b_box_offset(self, j: int) -> int:
        """Byte offset in a slot of B's TMA box ``j`` (N-columns ``64 j ..``)."""
        return self.a_bytes + j * self.b_box_bytes


def generate(cfg: GemmConfig) -> Kernel:
    """Build the wgmma kernel for ``cfg``."""
    return _WgmmaKernel(cfg).build()


class _WgmmaKernel:
    """Emits one wgmma kernel: the declarations and barriers (``__init__``), then the roles --
    a producer and consumer warpgroups (warp-specialised), or one warpgroup that is both."""

    def __init__(self, cfg: GemmConfig):
        cfg.validate()  # refuses fp8 with N-major B: wgmma has no transpose for 8-bit types
        self.cfg, self.plan, self.S = cfg, WgmmaPlan(cfg), cfg.stages
        self.ptx_in = IN_DTYPES[cfg.in_dtype][1]
        b = self.b = Builder(cfg.kernel_name, cfg.target, cfg.version, cfg.threads)
        # .maxntid + .minnctapersm 1 are what lets ptxas honour setmaxnreg (else note C7508).
        b.kernel.maxntid = (cfg.threads, 1, 1)
        b.kernel.minnctapersm = 1
        if cfg.cluster > 1:
            b.kernel.cluster = (cfg.cluster, 1, 1)
        self._declare()
        self._prologue()
        self._init_barriers()

    def _declare(self) -> None:
        """Kernel parameters and shared memory (ring, barriers, C staging)."""
        b, cfg, plan, S = self.b, self.cfg, self.plan, self.S
        self.tma_params = [b.param("tmap_a", "tmap"), b.param("tmap_b", "tmap")]
        if cfg.tma_store:
            self.tma_params.append(b.param("tmap_c", "tmap"))
        self.pc = b.param("c", "u64")
        self.pm, self.pn, self.pk = b.param("M", "u32"), b.param("N", "u32"), b.param("K", "u32")
        self.pbias = (b.param("bias", "u64"), b.param("bias_n", "u32")) if cfg.bias else None
        # residual: a float32 matrix's address, row pitch, rows and columns
        self.pres = ((b.param("res", "u64"), b.param("res_ld", "u32"), b.param("res_m", "u32"), b.param("res_n", "u32"))
                     if cfg.residual else None)
        # batched: the batch extents (outermost first) and which batch dimensions A and B have
        self.pbatch = [b.param(f"batch{i}", "u32") for i in range(cfg.batched)]
        self.pbatch_mask = b.param("batch_mask", "u32") if cfg.batched else None
        b.shared("ring", plan.stage_bytes * S, align=1024, shape=(S, plan.stage_bytes), dtype=cfg.in_dtype,
                 swizzle=SWIZZLE)
        self.bars = b.shared("bars", 16 * S, align=8, shape=(2, S), dtype="b64")
        # tma_store: per consumer warpgroup, two C boxes (64 rows x 128 B) filled in turn
        self.cstage = b.shared("cstage", cfg.consumers * 2 * C_BOX_BYTES, align=1024) if cfg.tma_store else None
        if b.kernel.shared_bytes > MAX_DYN_SMEM:
            raise ShapeError(f"{cfg.name}: {b.kernel.shared_bytes} B of shared memory exceed the {MAX_DYN_SMEM} B "
                             "an sm_90 CTA can have; use fewer stages or a smaller tile")

    def _prologue(self) -> None:
        """Parameters loaded, tensor maps made generic, the tile walk, barrier addresses."""
        b, cfg = self.b, self.cfg
        # C's pointer stays a parameter either way (the runner passes the same list); TMA stores use tmap_c.
        self.c_g = None if cfg.tma_store else ops.ld_param_ptr(b, self.pc)
        self.bias = (ops.ld_param_ptr(b, self.pbias[0]), ops.ld_param(b, self.pbias[1], "u32")) if cfg.bias else None
        self.res = ((ops.ld_param_ptr(b, self.pres[0]), *(ops.ld_param(b, q, "u32") for q in self.pres[1:]))
                    if cfg.residual else None)
        self.n_r, k_r = ops.ld_param(b, self.pn, "u32"), ops.ld_param(b, self.pk, "u32")
        self.tmaps = []
        for p in self.tma_params:
            g = b.reg("u64")
            b.emit("mov.b64", g, p)
            b.emit("cvta.param.u64", g, g)
            self.tmaps.append(g)
        self.tid = b.sreg("%tid.x")
        # Where this CTA's tile starts (one tile per CTA), or a loop over its tiles (persistent).
        self.rank = b.sreg("%cluster_ctarank") if cfg.cluster > 1 else None
        if cfg.cluster > 1:
            self.for_each_tile, self.origin = _cluster_walk(b, cfg, self.pm, self.n_r, self.rank)
        else:
            self.origin = None if cfg.persistent else ops.tile_origin(b, cfg)
            self.for_each_tile = (_persistent_walk(b, cfg, self.pm, self.n_r, self.pbatch) if cfg.persistent
                                  else (lambda body: body(*self.origin)))
        self.ring = ops.smem_base(b)
        self.full0 = b.binop("add", "u32", self.ring, self.bars.offset)
        self.empty0 = b.binop("add", "u32", self.full0, 8 * self.S)
        self.kt_n = b.binop("shr", "u32", k_r, cfg.bk.bit_length() - 1)
        self.is_t0 = b.setp("eq", "u32", self.tid, 0)

    def _init_barriers(self) -> None:
        """Thread 0 initialises the ring's barriers; everyone (every CTA of a cluster) meets after."""
        b, cfg, S = self.b, self.cfg, self.S
        n_consumer_threads = 128 * cfg.consumers
        # A persistent or cluster kernel's consumers release a slot once per warp (lane 0, after
        # the warp's own wgmma.wait_group) instead of once per thread: 8 arrivals a slot instead
        # of 256.  In a cluster every CTA's consumers arrive on every CTA's empty barriers: the
        # producers multicast B into all of them, so a slot is free only when all are done.
        self.per_warp_release = cfg.persistent or cfg.cluster > 1
        release_arrivals = (4 * cfg.consumers if self.per_warp_release else n_consumer_threads) * cfg.cluster

        b.comment("thread 0 initialises the barriers; the fences publish them to the async (TMA) proxy")
        with b.if_(self.is_t0):
            for s in range(S):
                b.emit("mbarrier.init.shared::cta.b64", f"[{self.full0}+{8 * s}]", 1)
                b.emit("mbarrier.init.shared::cta.b64", f"[{self.empty0}+{8 * s}]", release_arrivals)
            b.emit("fence.mbarrier_init.release.cluster")
            b.emit("fence.proxy.async.shared::cta")
        if cfg.cluster > 1:
            # Every CTA's barriers exist before a peer arrives on them or multicasts into them;
            # fence.mbarrier_init.release.cluster above published them, so .relaxed suffices.
            _cluster_sync(b, "relaxed")
        else:
            ops.bar_sync(b, 0)

        # A batched kernel's maps have the batch dimensions outside the matrix's two.
        self.tma = f"cp.async.bulk.tensor.{2 + cfg.batched}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        self.tma_multicast = self.tma + ".multicast::cluster"
        if cfg.cluster > 1:
            self.everyone = b.reg("b16")  # ctaMask: B's copies land in every CTA of the cluster
            b.emit("mov.b16", self.everyone, (1 << cfg.cluster) - 1)

    # -- loads ---------------------------------------------------------------------------------
    def load_tile(self, kt, slot, m0, n0, a_co: str = "", b_co: str = "") -> None:
        """Arm ``full[slot]`` with the slot's byte count and start its TMA copies (A, then B's boxes).

        ``a_co`` / ``b_co``: a batched kernel's outer coordinates of A's / B's copies, as
        ``", c2, c3.."`` (appended after the matrix coordinates); empty otherwise."""
        b, cfg, plan, tma, tmaps = self.b, self.cfg, self.plan, self.tma, self.tmaps
        fb = b.mad("u32", slot, 8, self.full0)
        # expect_tx = every byte the copies below write: A + all of B's boxes.
        b.emit("mbarrier.arrive.expect_tx.shared::cta.b64", "_", f"[{fb}]", plan.stage_bytes)
        dst = b.mad("u32", slot, plan.stage_bytes, self.ring)
        k0 = b.binop("mul.lo", "u32", kt, cfg.bk)
        if not plan.m_major:  # tensor coordinates are innermost first: A is M x K (K contiguous)
            b.emit(tma, f"[{dst}]", f"[{tmaps[0]}, {{{k0}, {m0}{a_co}}}]", f"[{fb}]")
        for j in range(plan.a_boxes if plan.m_major else 0):  # A stored K x M: bk x 64 boxes along M
            mj = b.binop("add", "u32", m0, 64 * j) if j else m0
            b.emit(tma, f"[{dst}+{j * 64 * 128}]", f"[{tmaps[0]}, {{{mj}, {k0}{a_co}}}]", f"[{fb}]")
        if cfg.cluster > 1:
            self.load_b_share(k0, dst, fb, n0)
            return
        if not plan.n_major:  # B stored N x K: one bn x bk box
            b.emit(tma, f"[{dst}+{plan.a_bytes}]", f"[{tmaps[1]}, {{{k0}, {n0}{b_co}}}]", f"[{fb}]")
            return
        for j in range(plan.b_boxes):  # B stored K x N: bk x 64 boxes side by side along N
            nj = b.binop("add", "u32", n0, j * plan.b_box_cols) if j else n0
            b.emit(tma, f"[{dst}+{plan.b_box_offset(j)}]", f"[{tmaps[1]}, {{{nj}, {k0}{b_co}}}]", f"[{fb}]")

    def load_b_share(self, k0, dst, fb, n0) -> None:
        """This CTA's 1/cluster of the B tile, multicast to the same slot offset in every CTA
        of the cluster; each copy also counts its bytes on every CTA's ``full`` barrier, so
        the ``expect_tx`` of the whole slot is met once all the CTAs' shares have landed."""
        b, cfg, plan, rank = self.b, self.cfg, self.plan, self.rank
        if not plan.n_major:  # bn / cluster rows of the N x K box each
            rows = cfg.bn // cfg.cluster
            nb = b.mad("u32", rank, rows, n0)
            db_ = b.mad("u32", rank, rows * 128, dst)
            b.emit(self.tma_multicast, f"[{db_}+{plan.a_bytes}]", f"[{self.tmaps[1]}, {{{k0}, {nb}}}]", f"[{fb}]",
                   self.everyone)
            return
        per = plan.b_boxes // cfg.cluster  # 64-column boxes each
        nb = b.mad("u32", rank, per * plan.b_box_cols, n0)
        db_ = b.mad("u32", rank, per * plan.b_box_bytes, dst)
        for jj in range(per):
            nj = b.binop("add", "u32", nb, jj * plan.b_box_cols) if jj else nb
            b.emit(self.tma_multicast, f"[{db_}+{plan.b_box_offset(jj)}]", f"[{self.tmaps[1]}, {{{nj}, {k0}}}]",
                   f"[{fb}]", self.everyone)

    def wait(self, bar_addr, parity) -> None:
        ops.mbar_wait(self.b, bar_addr, parity)

    def advance(self, slot, phase) -> None:
        ops.ring_advance(self.b, slot, phase, self.S)

    # -- the consumers' main loop and epilogue ---------------------------------------------------------
    def consumer(self, cidx, wtid, release) -> None:
        """Math warpgroup ``cidx`` (a register or int), thread ``wtid`` within it: main loop + epilogue per tile.

        The ring position (``slot``, ``phase``) runs on across the tiles of a persistent
        kernel.  There the first k-step of each tile's wgmmas passes ``scale-d = 0``
        (D = A B, not D + A B), which clears the previous tile's accumulators for free.
        """
        b, cfg, plan, ptx_in = self.b, self.cfg, self.plan, self.ptx_in
        n_acc = cfg.bn // 2
        acc = [[b.mov("f32", 0.0) for _ in range(n_acc)] for _ in range(plan.mblocks)]
        one = b.mov("u32", 1)
        scale_d = b.setp("ne", "u32", one, 0)
        keep = b.reg("pred") if cfg.persistent else None  # scale-d of a tile's first k-step: false on k-tile 0
        slot, phase = b.mov("u32", 0), b.mov("u32", 0)
        cons_a = b.binop("mul.lo", "u32", cidx, plan.rows_per_consumer * 128)
        kt = b.reg("u32")
        da, db = b.reg("b64"), b.reg("b64")
        dak, dbk = b.reg("b64"), b.reg("b64")
        addr = b.reg("u32")
        prev = b.mov("u32", 0)  # slot of the previous k-tile, released one tile late when inflight

        def tile(m0, n0, batch=()) -> None:
            with b.loop(kt, 0, self.kt_n, 1):
                self.wait(b.mad("u32", slot, 8, self.full0), phase)
                b.emit("mad.lo.u32", addr, slot, plan.stage_bytes, self.ring)
                b.emit("add.u32", addr, addr, cons_a)
                ops.smem_desc(b, da, addr, plan.desc_a_const)
                b.emit("mad.lo.u32", addr, slot, plan.stage_bytes, self.ring)
                b.emit("add.u32", addr, addr, plan.a_bytes)
                ops.smem_desc(b, db, addr, plan.desc_b_const)
                if cfg.persistent:
                    b.emit("setp.ne.u32", keep, kt, 0)
                b.emit("wgmma.fence.sync.aligned")
                for kk in range(plan.ksteps):
                    b.emit("add.s64", dbk, db, (kk * plan.b_step_bytes) >> 4)
                    sd = keep if cfg.persistent and kk == 0 else scale_d
                    for mb in range(plan.mblocks):
                        b.emit("add.s64", dak, da, (mb * 64 * 128 + kk * plan.a_step_bytes) >> 4)
                        shape = f"m64n{cfg.bn}k{plan.k_inst}"
                        if cfg.in_dtype == "e4m3":
                            b.emit(f"wgmma.mma_async.sync.aligned.{shape}.f32.{ptx_in}.{ptx_in}",
                                   ops.reg_vector(acc[mb]), dak, dbk, sd, 1, 1)
                        else:
                            # imm-trans-a = 1 reads A M-major; imm-trans-b = 1 reads B N-major.
                            b.emit(f"wgmma.mma_async.sync.aligned.{shape}.f32.{ptx_in}.{ptx_in}",
                                   ops.reg_vector(acc[mb]), dak, dbk, sd, 1, 1, plan.trans_a, plan.trans_b)
                b.emit("wgmma.commit_group.sync.aligned")
                if cfg.inflight == 0:
                    b.emit("wgmma.wait_group.sync.aligned", 0)
                    release(kt, slot)
                else:
                    # Keep this tile's wgmmas running while the previous tile's slot is handed
                    # back: wait_group 1 retires everything but the newest group.
                    b.emit("wgmma.wait_group.sync.aligned", 1)
                    has_prev = b.setp("ne", "u32", kt, 0)
                    with b.if_(has_prev):
                        # only the single-warpgroup release refills, so only it needs the k-tile
                        release(None if cfg.producer else b.binop("sub", "u32", kt, 1), prev)
                    b.emit("mov.u32", prev, slot)
                self.advance(slot, phase)
            if cfg.inflight:
                b.emit("wgmma.wait_group.sync.aligned", 0)
                if cfg.persistent:  # the next tile's loads need the last k-tile's slot back
                    release(None, prev)  # persistent is warp-specialised: release_ws needs no k-tile
            if cfg.tma_store:
                _epilogue_tma(b, cfg, plan, self.tmaps[2], self.ring, self.cstage, m0, n0, cidx, wtid, acc, self.bias,
                              batch, self.res)
            else:
                _epilogue(b, cfg, plan, self.c_g, self.n_r, m0, n0, cidx, wtid, acc)

        self.for_each_tile(tile)
        if cfg.tma_store:
            # The stores read this CTA's shared memory: it must outlive them.
            with b.if_(b.setp("eq", "u32", wtid, 0)):
                b.emit("cp.async.bulk.wait_group", 0)

    # -- roles ----------------------------------------------------------------------------------
    def warp_specialised(self) -> None:
        """Warpgroup 0 produces (thread 0 streams every tile's k-tiles), the others consume."""
        b, cfg = self.b, self.cfg
        wg = b.binop("shr", "u32", self.tid, 7)
        is_prod = b.setp("eq", "u32", wg, 0)
        with b.if_(is_prod):
            self._producer()
        with b.if_(is_prod, negate=True):
            b.emit("setmaxnreg.inc.sync.aligned.u32", cfg.maxnreg[1])
            cidx = b.binop("sub", "u32", wg, 1)
            wtid = b.binop("and", "b32", self.tid, 127)
            lane0 = b.setp("eq", "u32", b.binop("and", "b32", self.tid, 31), 0) if self.per_warp_release else None

            def release_ws(kt, slot) -> None:
                bar = b.mad("u32", slot, 8, self.empty0)
                if cfg.cluster == 1:
                    b.emit("mbarrier.arrive.shared::cta.b64", "_", f"[{bar}]", pred=lane0)
                    return
                for r in range(cfg.cluster):  # the same barrier in CTA r of the cluster (this one included)
                    remote = b.reg("u32")
                    b.emit("mapa.shared::cluster.u32", remote, bar, r)
                    b.emit("mbarrier.arrive.shared::cluster.b64", "_", f"[{remote}]", pred=lane0)

            self.consumer(cidx, wtid, release_ws)

    def _producer(self) -> None:
        b, cfg = self.b, self.cfg
        b.comment("producer warpgroup: hand registers to the consumers, thread 0 streams tiles")
        b.emit("setmaxnreg.dec.sync.aligned.u32", cfg.maxnreg[0])
        with b.if_(self.is_t0):
            slot, phase = b.mov("u32", 0), b.mov("u32", 0)
            kt = b.reg("u32")
            par = b.reg("u32")
            # batched: 1 where A (B) has batch dimension i, 0 where it is broadcast there
            has = _batch_flags(b, self.pbatch_mask, cfg.batched)

            def produce(m0, n0, batch=()) -> None:
                # a broadcast operand reads batch coordinate 0 (its map's extent there is 1);
                # TMA coordinates are innermost first, so the batch indices go innermost first
                a_co, b_co = ("".join(f", {b.binop('mul.lo', 'u32', batch[i], flags[i])}"
                                      for i in reversed(range(len(batch)))) for flags in has)
                with b.loop(kt, 0, self.kt_n, 1):
                    # A fresh barrier counts as having completed the phase before phase 0,
                    # so the first lap's wait on parity 1 passes at once.
                    b.emit("xor.b32", par, phase, 1)
                    self.wait(b.mad("u32", slot, 8, self.empty0), par)
                    self.load_tile(kt, slot, m0, n0, a_co, b_co)
                    self.advance(slot, phase)

            self.for_each_tile(produce)

    def single_warpgroup(self) -> None:
        """One warpgroup: thread 0 fills the ring before the loop and refills each slot as it is freed."""
        b, cfg, S = self.b, self.cfg, self.S
        m0, n0 = self.origin
        with b.if_(self.is_t0):
            for s in range(S):
                g = b.setp("lt", "u32", s, self.kt_n)
                with b.if_(g):
                    self.load_tile(b.mov("u32", s), b.mov("u32", s), m0, n0)
        nxt = b.reg("u32")

        def release_single(kt, slot) -> None:
            # All consumer threads are done with the slot before thread 0 refills it.
            ops.bar_sync(b, 1, 128 * cfg.consumers)
            b.emit("add.u32", nxt, kt, S)
            more = b.setp("lt", "u32", nxt, self.kt_n)
            refill = b.reg("pred")
            b.emit("and.pred", refill, more, self.is_t0)
            with b.if_(refill):
                self.load_tile(nxt, slot, m0, n0)

        self.consumer(b.mov("u32", 0), self.tid, release_single)

    def build(self) -> Kernel:
        """Emit the roles and finish the kernel."""
        b = self.b
        if self.cfg.producer:
            self.warp_specialised()
        else:
            self.single_warpgroup()
        if self.cfg.cluster > 1:
            b.comment("no CTA leaves while a peer may still arrive on its barriers")
            _cluster_sync(b)
        return b.build()


def _cluster_sync(b: Builder, sem: str = "release") -> None:
    """Every thread of every CTA in the cluster meets here (``barrier.cluster``).

    ``sem="release"`` makes each thread's earlier memory operations -- its remote
    ``mbarrier.arrive`` on a peer's barrier too -- complete before the peer passes the
    wait (ptxas: ``MEMBAR.ALL.GPU`` before the arrive); ``"relaxed"`` orders nothing.
    Not ``.aligned``: it follows code where a warp's lanes parted (thread 0 initialising
    the barriers, or streaming every tile as the producer), and the plain form does not
    need the warp to have reconverged."""
    b.emit(f"barrier.cluster.arrive.{sem}")
    b.emit("barrier.cluster.wait.acquire")


def _cluster_walk(b: Builder, cfg: GemmConfig, pm, n_r, rank):
    """``(for_each_tile, origin)`` of a cluster kernel: clusters take blocks of ``cluster``
    vertically adjacent tiles (one B tile), CTA ``rank`` the block's ``rank``-th row of tiles.

    Blocks are walked like tiles (:func:`ops.tile_at`), grouped by ``ceil(group_m / cluster)``
    block-rows, so that a group spans the same ``group_m`` rows of tiles as without
    clusters.  A plain kernel's cluster takes block ``%clusterid.x``; a persistent one's
    loops over blocks ``%clusterid.x, + %nclusterid.x, ...``.  ``origin`` is the plain
    kernel's ``(m0, n0)``.
    """
    unit = cfg.with_(bm=cfg.bm * cfg.cluster, group_m=-(-cfg.group_m // cfg.cluster))
    m_r = ops.ld_param(b, pm, "u32")
    tiles_n = b.binop("div", "u32", n_r, cfg.bn)
    blocks_m = b.binop("div", "u32", m_r, unit.bm)
    rank_row = b.binop("mul.lo", "u32", rank, cfg.bm)
    first = b.sreg("%clusterid.x")

    def at(block):
        m0, n0 = ops.tile_at(b, unit, block, tiles_n, blocks_m)
        return b.binop("add", "u32", m0, rank_row), n0

    if not cfg.persistent:
        origin = at(first)
        return (lambda body: body(*origin)), origin
    n_blocks = b.binop("mul.lo", "u32", tiles_n, blocks_m)
    step = b.sreg("%nclusterid.x")

    def walk(body) -> None:
        blk = b.reg("u32")
        with b.loop(blk, first, n_blocks, step):
            body(*at(blk))

    return walk, None


def _persistent_walk(b: Builder, cfg: GemmConfig, pm, n_r, pbatch=()):
    """``for_each_tile(body)`` of a persistent kernel: emit a loop over tiles ``ctaid.x,
    ctaid.x + nctaid.x, ...`` (in the order of :func:`ops.tile_at`) around ``body(m0, n0)``.

    Each role (producer, consumers) runs its own copy of the loop, so all see the same
    tiles in the same order.  A batched kernel (``pbatch``: the batch extents' parameters,
    outermost first) walks ``batch x tiles`` with the batch outermost, so consecutive CTAs
    share one product's A and B panels as without a batch, and calls ``body(m0, n0,
    batch)`` with the tile's batch indices (registers, outermost first).
    """
    m_r = ops.ld_param(b, pm, "u32")
    tiles_n = b.binop("div", "u32", n_r, cfg.bn)
    tiles_m = b.binop("div", "u32", m_r, cfg.bm)
    n_tiles = b.binop("mul.lo", "u32", tiles_n, tiles_m)
    extents = [ops.ld_param(b, p, "u32") for p in pbatch]
    total = n_tiles
    for e in extents:
        total = b.binop("mul.lo", "u32", total, e)

    def walk(body) -> None:
        t = b.reg("u32")
        with b.loop(t, b.sreg("%ctaid.x"), total, b.sreg("%nctaid.x")):
            if not extents:
                body(*ops.tile_at(b, cfg, t, tiles_n, tiles_m))
                return
            flat = b.binop("div", "u32", t, n_tiles)  # the product this tile belongs to
            m0, n0 = ops.tile_at(b, cfg, b.binop("rem", "u32", t, n_tiles), tiles_n, tiles_m)
            batch = []
            for e in reversed(extents[1:]):  # innermost dimension first; the outermost takes what is left
                batch.append(b.binop("rem", "u32", flat, e))
                flat = b.binop("div", "u32", flat, e)
            batch.append(flat)
            body(m0, n0, batch[::-1])

    return walk


def _batch_flags(b: Builder, pmask, dims: int) -> tuple[list, list]:
    """Per batch dimension (outermost first), 1 where A has it and 0 where A is broadcast along it,
    and the same for B: bits ``2 i`` and ``2 i + 1`` of the ``batch_mask`` parameter.  Empty
    lists for an unbatched kernel (``dims`` = 0)."""
    if not dims:
        return [], []
    mask = ops.ld_param(b, pmask, "u32")
    flags = [b.binop("and", "b32", b.binop("shr", "u32", mask, bit), 1) for bit in range(2 * dims)]
    return flags[0::2], flags[1::2]


def _epilogue_tma(b: Builder, cfg: GemmConfig, plan: WgmmaPlan, tmap_c, smem, cstage, m0, n0, cidx, wtid,
                  acc, bias=None, batch=(), residual=None) -> None:
    """Write a consumer's accumulators through shared memory and TMA bulk stores.

    ``batch``: a batched kernel's batch indices of this tile (outermost first), C's outer
    coordinates (C always has every batch dimension).

    ``bias`` (``cfg.bias``): (global address, length) of an N-vector of the input dtype; each
    thread loads the pair of it under its pair of columns (one 32-bit load, predicated off past
    the length) and adds it to both rows it holds before the conversion.

    ``residual`` (``cfg.residual``): (global address, row pitch, rows, columns) of a float32 matrix;
    each thread loads the pair under each of its pairs of columns (one 8-byte load, predicated off
    past the rows and columns) and adds it to the rounded pair before the store.

    C goes out in boxes of 64 rows x 128 bytes (32 fp32 or 64 bf16 columns), through two
    staging buffers per consumer warpgroup used in turn.  For each box: thread 0 waits
    until the store issued from this buffer two boxes ago has read it
    (``cp.async.bulk.wait_group.read 1``), a warpgroup barrier tells the others, every
    thread writes its pairs into the 128B-swizzled box and fences them to the async proxy
    (``fence.proxy.async``), a second barrier, and thread 0 issues the store and commits it.
    The swizzle (16-byte chunk ``c`` of row ``r`` at chunk ``c ^ (r % 8)``) spreads a
    warp's eight rows over all banks; a thread's rows are ``16 warp + g (+8)``, so
    ``r % 8 = g``.
    """
    osz = OUT_DTYPES[cfg.out_dtype]
    box_cols = C_BOX_ROW // osz
    warp = b.binop("shr", "u32", wtid, 5)
    lane = b.binop("and", "b32", wtid, 31)
    g = L.GROUP.emit(b, lane)
    qb = b.binop("mul.lo", "u32", L.QUAD2.emit(b, lane), osz)  # byte of a thread's pair within 8 columns
    q_chunk = b.binop("shr", "u32", qb, 4)
    q_byte = b.binop("and", "b32", qb, 15)
    # this thread's row (r = 16 warp + g) in a box, plus its byte within a 16-byte chunk
    row_base = b.binop("shl", "b32", b.mad("u32", warp, 16, g), C_BOX_ROW.bit_length() - 1)  # r * 128
    row_base = b.binop("add", "u32", row_base, q_byte)
    buf0 = b.mad("u32", cidx, 2 * C_BOX_BYTES, b.binop("add", "u32", smem, cstage.offset))
    bar_id = b.binop("add", "u32", cidx, 2)  # named barriers 2, 3: one per consumer warpgroup
    is_w0 = b.setp("eq", "u32", wtid, 0)
    row0 = b.mad("u32", cidx, plan.rows_per_consumer, m0)
    chunk, t = b.reg("u32"), b.reg("u32")
    store = f"cp.async.bulk.tensor.{2 + len(batch)}d.global.shared::cta.bulk_group"
    outer = "".join(f", {r}" for r in reversed(batch))  # TMA coordinates are innermost first
    col_q = b.binop("add", "u32", n0, L.QUAD2.emit(b, lane))  # this thread's first column of each 8
    if bias is not None:
        bias_g, bias_n = bias
        bcol, word, blo, bhi = b.reg("u32"), b.reg("b32"), b.reg("f32"), b.reg("f32")
        inside = b.reg("pred")
    if residual is not None:
        row_t = b.mad("u32", warp, 16, g)  # the thread's row in a 64-row block (and row_t + 8)
    i = 0
    for mb in range(plan.mblocks):
        for box in range(cfg.bn // box_cols):
            buf = b.binop("add", "u32", buf0, (i % 2) * C_BOX_BYTES)
            with b.if_(is_w0):
                b.emit("cp.async.bulk.wait_group.read", 1)
            ops.bar_sync(b, bar_id, 128)
            for jj in range(box_cols // 8):
                j = box * (box_cols // 8) + jj
                if bias is not None:
                    b.emit("add.u32", bcol, col_q, 8 * j)
                    b.emit("setp.lt.u32", inside, bcol, bias_n)
                    _load_pair(b, cfg.in_dtype, ops.addr(b, bias_g, bcol, 2), inside, word, blo, bhi)
                b.emit("add.u32", chunk, q_chunk, jj * 8 * osz // 16)
                b.emit("xor.b32", chunk, chunk, g)
                b.emit("shl.b32", chunk, chunk, 4)
                b.emit("add.u32", t, row_base, chunk)
                b.emit("add.u32", t, t, buf)
                for half in range(2):
                    lo, hi = acc[mb][4 * j + 2 * half], acc[mb][4 * j + 2 * half + 1]
                    if bias is not None:
                        lo, hi = b.binop("add", "f32", lo, blo), b.binop("add", "f32", hi, bhi)
                    dst = f"[{t}+{half * 8 * C_BOX_ROW}]"  # row + 8: same chunk order (r % 8 unchanged)
                    if cfg.out_dtype == "f32":
                        if cfg.round_out:
                            lo, hi = _round_pair(b, cfg.in_dtype, lo, hi)
                        if residual is not None:
                            row = b.binop("add", "u32", row0, mb * 64 + half * 8)
                            lo, hi = _add_residual_pair(b, residual, b.binop("add", "u32", row, row_t),
                                                        b.binop("add", "u32", col_q, 8 * j), lo, hi)
                        b.emit("st.shared.v2.f32", dst, f"{{{lo}, {hi}}}")
                    else:
                        r = b.reg("b32")
                        b.emit("cvt.rn.bf16x2.f32", r, hi, lo)
                        b.emit("st.shared.b32", dst, r)
            b.emit("fence.proxy.async.shared::cta")
            ops.bar_sync(b, bar_id, 128)
            with b.if_(is_w0):
                col = b.binop("add", "u32", n0, box * box_cols)
                row = b.binop("add", "u32", row0, mb * 64)
                b.emit(store, f"[{tmap_c}, {{{col}, {row}{outer}}}]", f"[{buf}]")
                b.emit("cp.async.bulk.commit_group")
            i += 1


def _add_residual_pair(b: Builder, residual, row, col, lo, hi) -> tuple:
    """``lo``, ``hi`` (C's columns ``col``, ``col + 1`` of ``row``) plus the float32 residual there (0
    past its rows or columns; its columns are even, so a pair lies all inside or all past them):
    new registers."""
    res_g, res_ld, res_m, res_n = residual
    inside = b.reg("pred")
    b.emit("and.pred", inside, b.setp("lt", "u32", row, res_m), b.setp("lt", "u32", col, res_n))
    at = b.reg("u64")
    b.emit("mul.wide.u32", at, b.mad("u32", row, res_ld, col), 4)  # (row pitch x rows < 2^32: accepts)
    b.emit("add.u64", at, at, res_g)
    rlo, rhi = b.mov("f32", 0.0), b.mov("f32", 0.0)
    b.emit("ld.global.v2.f32", f"{{{rlo}, {rhi}}}", f"[{at}]", pred=inside)
    return b.binop("add", "f32", lo, rlo), b.binop("add", "f32", hi, rhi)


def _round_pair(b: Builder, in_dtype: str, lo, hi) -> tuple:
    """``lo``, ``hi`` (f32) rounded to the 16-bit ``in_dtype`` (to nearest even) and widened back to
    f32: new registers, exact in f32 (``round_out``)."""
    wlo, whi = b.reg("f32"), b.reg("f32")
    if in_dtype == "bf16":  # one cvt for the pair; bf16 is the top half of an f32: a shift and a mask widen it
        r = b.reg("b32")
        b.emit("cvt.rn.bf16x2.f32", r, hi, lo)
        b.emit("shl.b32", wlo, r, 16)
        b.emit("and.b32", whi, r, 0xFFFF0000)
        return wlo, whi
    for src, dst in ((lo, wlo), (hi, whi)):  # fp16: value by value, narrowed and widened by cvt
        h = b.reg("b16")
        b.emit("cvt.rn.f16.f32", h, src)
        b.emit("cvt.f32.f16", dst, h)
    return wlo, whi


def _load_pair(b: Builder, in_dtype: str, ptr, pred, word, lo, hi) -> None:
    """``lo``, ``hi`` = the two 16-bit values at ``ptr`` as f32, where ``pred`` holds (else 0).

    bf16 is the top half of an f32: one 32-bit load, then a shift and a mask widen the pair;
    fp16 is loaded value by value and widened by cvt."""
    if in_dtype == "bf16":
        b.emit("mov.b32", word, 0)
        b.emit("ld.global.b32", word, f"[{ptr}]", pred=pred)
        b.emit("shl.b32", lo, word, 16)
        b.emit("and.b32", hi, word, 0xFFFF0000)
        return
    for dst, off in ((lo, 0), (hi, 2)):
        h = b.reg("b16")
        b.emit("mov.b16", h, 0)
        b.emit("ld.global.b16", h, f"[{ptr}+{off}]", pred=pred)
        b.emit("cvt.f32.f16", dst, h)


def _epilogue(b: Builder, cfg: GemmConfig, plan: WgmmaPlan, c_g, n_r, m0, n0, cidx, wtid, acc) -> None:
    """Write each consumer's accumulators: pairs (i, i+1) are adjacent columns (layout.wgmma_d_map)."""
    osz = 4 if cfg.out_dtype == "f32" else 2
    warp = b.binop("shr", "u32", wtid, 5)
    lane = b.binop("and", "b32", wtid, 31)
    row = b.mad("u32", cidx, plan.rows_per_consumer, m0)
    row = b.mad("u32", warp, 16, row)
    row = b.binop("add", "u32", row, L.GROUP.emit(b, lane))
    col = b.binop("add", "u32", n0, L.QUAD2.emit(b, lane))
    base = b.mad("u32", row, n_r, col)
    n8 = b.binop("shl", "b32", n_r, 3)
    for mb in range(plan.mblocks):
        for half in range(2):
            off = b.mad("u32", n8, 8 * mb + half, base)
            ptr = ops.addr(b, c_g, off, osz)
            for j in range(cfg.bn // 8):
                lo, hi = acc[mb][4 * j + 2 * half], acc[mb][4 * j + 2 * half + 1]
                if cfg.out_dtype == "f32":
                    b.emit("st.global.v2.f32", f"[{ptr}+{j * 8 * osz}]", f"{{{lo}, {hi}}}")
                else:
                    r = b.reg("b32")
                    b.emit("cvt.rn.bf16x2.f32", r, hi, lo)
                    b.emit("st.global.b32", f"[{ptr}+{j * 8 * osz}]", r)


# ---------------------------------------------------------------------------------------
# numpy simulation of one CTA tile through TMA, descriptors and the accumulator map


def simulate_tile(cfg: GemmConfig, A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """One ``bm x bk`` @ ``bk x bn`` tile through the kernel's data path, in numpy.

    TMA writes A (``bm x bk``) and B into a slot with the 128-byte swizzle
    (:func:`layout.tma_store_box`): B^T (``bn x bk``) as one box for ``b_major="k"``,
    B (``bk x bn``) as ``bn / 64`` boxes of 64 columns for ``b_major="n"``.  Each
    consumer builds its descriptors with the same constants and offsets as the
    generator, :func:`layout.wgmma_gather` (K-major) / :func:`layout.wgmma_gather_mn`
    (N-major B) read the operands those descriptors name, products accumulate into the
    per-thread registers of :func:`layout.wgmma_d_map`, and the epilogue's (row, col)
    arithmetic scatters them to C.  Inputs are exchanged as float16 bytes (bf16 and
    fp16 are both 2 bytes; fp8 configs use a 1-byte stand-in), so integer-valued
    inputs compare exactly.
    """
    cfg.validate()
    plan = WgmmaPlan(cfg)
    dt = np.float16 if cfg.in_bytes == 2 else np.int8
    smem = np.zeros(plan.stage_bytes, np.uint8)
    if plan.m_major:
        for j in range(plan.a_boxes):  # the TMA copy at {m0 + 64 j, k0} of A stored K x M
            box = np.ascontiguousarray(A[j * 64: (j + 1) * 64, :].T.astype(dt))  # bk x 64
            smem[j * 8192: (j + 1) * 8192] = L.tma_store_box(box, SWIZZLE)
    else:
        smem[: plan.a_bytes] = L.tma_store_box(A.astype(dt), SWIZZLE)
    if plan.n_major:
        for j in range(plan.b_boxes):  # the TMA copy at {n0 + 64 j, k0}
            box = np.ascontiguousarray(B[:, j * plan.b_box_cols: (j + 1) * plan.b_box_cols].astype(dt))
            o = plan.b_box_offset(j)
            smem[o: o + plan.b_box_bytes] = L.tma_store_box(box, SWIZZLE)
    else:
        smem[plan.a_bytes:] = L.tma_store_box(np.ascontiguousarray(B.T.astype(dt)), SWIZZLE)
    C = np.full((cfg.bm, cfg.bn), np.nan)
    rmap, cmap = L.wgmma_d_map(cfg.bn)
    for c in range(cfg.consumers):
        acc = np.zeros((plan.mblocks, 128, cfg.bn // 2))
        for kk in range(plan.ksteps):
            db = plan.desc_b_const | (plan.b_offset(kk) >> 4)
            if plan.n_major:
                bt = L.wgmma_gather_mn(smem, db, cfg.bn, plan.k_inst, dt).astype(np.float64)  # bn x k
            else:
                bt = L.wgmma_gather(smem, db, cfg.bn, K_STEP_BYTES, dt).astype(np.float64)  # bn x k
            for mb in range(plan.mblocks):
                da = plan.desc_a_const | (plan.a_offset(c, mb, kk) >> 4)
                if plan.m_major:
                    a = L.wgmma_gather_mn(smem, da, 64, plan.k_inst, dt).astype(np.float64)  # 64 x k
                else:
                    a = L.wgmma_gather(smem, da, 64, K_STEP_BYTES, dt).astype(np.float64)  # 64 x k
                d = a @ bt.T
                acc[mb] += d[rmap, cmap]
        wt = np.arange(128)[:, None]
        for mb in range(plan.mblocks):
            for i in range(cfg.bn // 2):
                # the epilogue: row = c*rows + 16*warp + g + 8*mb*8/8 + 8*half, col = 8*j + q + e
                j, half, e = i // 4, (i // 2) % 2, i % 2
                row = c * plan.rows_per_consumer + mb * 64 + 16 * (wt[:, 0] // 32) + L.GROUP(wt[:, 0] % 32) + 8 * half
                col = 8 * j + L.QUAD2(wt[:, 0] % 32) + e
                C[row, col] = acc[mb, :, i]
    return C
