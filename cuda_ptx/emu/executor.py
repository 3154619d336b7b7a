"""A CPU emulator for PTX: the GEMM generators' kernels and the SPIR-V translator's, every thread modelled.

Why: no GPU is needed to find the bugs that cost GPU time -- a wrong mbarrier parity
(hangs), a missing wait (garbage), a divergent ``.aligned`` instruction, a wgmma
accumulator touched while in flight, an address off the end of a buffer.  The
emulator runs the *PTX text* (see :mod:`ptx_parse`), so the renderer is checked too.

Model
-----
* Each thread has its own program counter (Volta-style independent scheduling).
  Warps take turns; within a warp the lanes at the lowest PC run together, which
  reconverges structured code.  ``.aligned`` warp instructions (``ldmatrix``,
  ``mma.sync``, ``bar.sync``, ``wgmma.fence/commit_group/wait_group``) must be reached
  by every live lane of the warp; ``wgmma.mma_async`` and ``setmaxnreg`` by every lane
  of all four warps, at the same instruction -- else :class:`EmulationError`.
* Asynchronous work completes late on purpose: TMA copies land a random number of
  scheduler rounds after issue (seeded), ``cp.async`` copies land only at the
  ``cp.async.wait_group`` that must cover them, and ``wgmma.mma_async`` reads shared
  memory and its accumulators only at the ``wgmma.wait_group`` that retires it.  A
  kernel missing a wait therefore reads stale data and computes a wrong product.
* Registers carry a per-thread "written" bit: reading one never written is an error,
  as is touching an accumulator of an in-flight wgmma, or feeding wgmma accumulators
  written by ordinary instructions without a ``wgmma.fence`` in between.
* Deadlock (every warp blocked or spinning, nothing in flight) raises with what
  each warp waits on: the emulator's version of a GPU hang.
* Clusters (``.reqnctapercluster``): the CTAs of a cluster run together, their warps'
  turns interleaved (:class:`Cluster`).  ``mapa`` gives shared::cluster addresses of a
  peer's shared memory (``state.SMEM_CLUSTER_BASE``); ``mbarrier.arrive`` may target
  a peer's barrier; a multicast TMA copy lands in each CTA of its mask separately, each
  at its own random time; ``barrier.cluster.arrive/wait`` is the cluster-wide barrier.
  Touching a peer's barrier before it was initialised and published (``fence.mbarrier_init``
  or a releasing ``barrier.cluster.arrive`` by its initialising thread), or a peer that
  has exited, is an error -- the missing ``barrier.cluster`` after init or before exit --
  and so is a CTA leaving while a peer thread's arrival on its barriers is not ordered
  before the exit by that thread's releasing ``barrier.cluster.arrive``.

* Compute kernels (what the SPIR-V -> PTX translator writes: no async copies, tensor
  cores, mbarriers or clusters; :func:`ops.is_compute_program`) run on :class:`Grid`
  instead: every CTA of a launch in one numpy vector, the threads at the lowest PC
  together, with handlers compiled once per program -- fast enough for thousands of
  launches (a tiny GPT's training step).  See :class:`Grid` for its barrier and
  shared-memory model.

Instruction semantics live in :mod:`emu_ops`.
"""

from __future__ import annotations

import numpy as np

from . import ops as emu_ops
from .state import (PARAM_BASE, SMEM_BASE, SMEM_CLUSTER_BASE, SMEM_CLUSTER_STRIDE, BulkStore, ClusterBarrier,
                        CpAsyncOp, EmulationError, GlobalMemory, MBarrier, TensorMap, WarpWgmma)
from .ptx_parse import FloatArg, ImmArg, MemArg, PtxProgram, RegArg, SpecialArg, SymArg

STORE_DTYPE = {"pred": np.bool_, "b16": np.uint16, "b32": np.uint32, "u32": np.uint32, "s32": np.uint32,
               "f32": np.uint32, "b64": np.uint64, "u64": np.uint64, "s64": np.uint64, "f64": np.uint64}
VIEW = {"pred": np.bool_, "b16": np.uint16, "u16": np.uint16, "f16": np.uint16, "bf16": np.uint16,
        "b32": np.uint32, "u32": np.uint32, "s32": np.int32, "f32": np.float32, "bf16x2": np.uint32,
        "b64": np.uint64, "u64": np.uint64, "s64": np.int64, "f64": np.float64}

VIEW_SIZE = {t: np.dtype(v).itemsize for t, v in VIEW.items()}

KIND_PLAIN, KIND_WARP, KIND_WARPGROUP, KIND_BAR = 0, 1, 2, 3
TMA_MAX_DELAY = 48  # rounds; a quarter of the copies land at once, all whenever nothing else can move
TURN_BUDGET = 64  # instructions a warp runs per turn before the next warp gets one
MAX_ROUNDS = 2_000_000


def instr_kind(op: str) -> int:
    """How an instruction synchronises: plain, whole warp, whole warpgroup, or a CTA barrier."""
    if op.startswith(("wgmma.mma_async", "setmaxnreg.")):
        return KIND_WARPGROUP
    if op.startswith("barrier.cluster"):
        return KIND_WARP if op.endswith(".aligned") else KIND_PLAIN
    if op.startswith("bar.sync") or op.startswith("barrier.sync"):
        return KIND_BAR
    if op.startswith(("ldmatrix.", "mma.sync", "wgmma.")):
        return KIND_WARP
    return KIND_PLAIN


def warp_tables(prog: PtxProgram) -> tuple[list, list, list, list]:
    """Per instruction of ``prog``, what the warp scheduler needs: its kind (instr_kind), its
    handler, whether it branches, and whether it is straight-line code (see Cta._straight_run;
    False past the last one).  Made once per program and kept on it: a launch makes a Cta per
    CTA, and the lists only read the program."""
    if prog.warp_tables is None:
        kinds = [instr_kind(i.op) for i in prog.instrs]
        handlers = [emu_ops.handler_for(i, prog) for i in prog.instrs]
        is_branch = [i.op.startswith("bra") for i in prog.instrs]
        straight = [k == KIND_PLAIN and emu_ops.runs_straight(i) for k, i in zip(kinds, prog.instrs)] + [False]
        prog.warp_tables = (kinds, handlers, is_branch, straight)
    return prog.warp_tables


class Cta:
    """One CTA of a kernel: registers, shared memory, barriers, async queues, and the scheduler."""

    def __init__(self, prog: PtxProgram, threads: int, shared_bytes: int, params: dict[str, object],
                 memory: GlobalMemory, ctaid: tuple[int, int, int], nctaid: tuple[int, int, int],
                 seed: int | np.random.SeedSequence = 0, max_tma_delay: int = TMA_MAX_DELAY) -> None:
        if threads % 32:
            raise EmulationError(f"CTA of {threads} threads is not a whole number of warps")
        self.prog, self.T, self.mem = prog, threads, memory
        self.params = params
        self.param_names = [p.name for p in prog.params]
        self.ctaid, self.nctaid = ctaid, nctaid
        self.smem = np.zeros(SMEM_BASE + shared_bytes, np.uint8)
        self.rng = np.random.default_rng(seed)
        self.max_tma_delay = max_tma_delay
        self.regs: dict[str, np.ndarray] = {}
        self._constants: dict[tuple, np.ndarray] = {}  # (immediate, lanes, type) -> its array
        self.written: dict[str, np.ndarray] = {}
        self.pc = np.zeros(threads, np.int64)
        self.alive = np.ones(threads, bool)
        self.nwarps = threads // 32
        self.blocked: list[tuple | None] = [None] * self.nwarps
        self.bars: dict[int, dict] = {}
        self.mbars: dict[int, MBarrier] = {}
        self.tma_queue: list[tuple[int, object]] = []
        self.cp_open: dict[int, list[CpAsyncOp]] = {}
        self.cp_groups: dict[int, list[list[CpAsyncOp]]] = {}
        # Bulk (TMA) stores, tracked per thread: not yet committed, and committed groups.
        self.bulk_open: dict[int, list[BulkStore]] = {}
        self.bulk_groups: dict[int, list[list[BulkStore]]] = {}
        self.bulk_pending: list[BulkStore] = []  # issued, not yet landed (their boxes must not change)
        # The proxy model: ordinary st.shared writes are seen by the async proxy (a TMA
        # store reading shared memory) only after the writing thread's fence.proxy.async.
        # Each written byte remembers its writer and the write's sequence number; a thread's
        # fence makes everything it wrote up to then visible.
        self.smem_writer = np.full(self.smem.size, -1, np.int32)
        self.smem_seq = np.zeros(self.smem.size, np.int64)
        self.fenced_upto = np.zeros(threads, np.int64)
        self.write_seq = 0
        initial = min(255, (65536 // max(threads, 1)) // 8 * 8)
        self.nreg = [initial] * ((threads + 127) // 128)  # per-warpgroup register budget (setmaxnreg)
        self.wgmma = [WarpWgmma() for _ in range(self.nwarps)]
        self.round = 0
        self.step = 0  # warp turns so far: the clock asynchronous copies land by
        self.kinds, self.handlers, self.is_branch, self.straight = warp_tables(prog)
        self.warp_lanes = [np.arange(32 * w, 32 * w + 32) for w in range(self.nwarps)]
        for lanes in self.warp_lanes:
            lanes.flags.writeable = False  # handed to every handler, turn after turn
        # Per warp, the registers all 32 of its lanes have written (``written`` never clears):
        # a read or write by the whole warp skips the per-lane check or mark for them.
        self.warp_wrote: list[set[str]] = [set() for _ in range(self.nwarps)]
        self.current = None  # (warp, instr) being executed, for messages
        # Cluster membership; a CTA launched without a cluster is a cluster of one.
        self.peers: list[Cta] = [self]
        self.rank = 0
        self.cluster_dims = (1, 1, 1)
        self.cluster_barrier = ClusterBarrier(threads)
        self.cb_arrived = np.zeros(threads, bool)  # arrived at barrier.cluster, not yet past its wait
        self.cb_generation = np.zeros(threads, np.int64)  # the barrier generation each thread arrived in
        self.unordered_remote: dict[int, set[int]] = {}  # thread -> ranks it arrived on, not yet released
        self.exited = False

    # -- messages ----------------------------------------------------------------------
    def where(self) -> str:
        """'CTA (x,y) warp w, line L: <instr>' for the instruction being executed."""
        w, ins = self.current if self.current else (None, None)
        loc = f"CTA {self.ctaid[:2]}"
        if w is not None:
            loc += f" warp {w}"
        if ins is not None:
            loc += f", PTX line {ins.line}: {ins.text}"
        return loc

    def fail(self, what: str) -> EmulationError:
        return EmulationError(f"{self.where()}: {what}")

    # -- registers -----------------------------------------------------------------------
    def _reg(self, name: str) -> np.ndarray:
        r = self.regs.get(name)
        if r is None:
            r = np.zeros(self.T, STORE_DTYPE[self.prog.reg_type(name)])
            self.regs[name] = r
            self.written[name] = np.zeros(self.T, bool)
        return r

    def wgmma_state(self, lanes: np.ndarray) -> WarpWgmma:
        """The wgmma bookkeeping of the warp ``lanes`` belong to."""
        return self.wgmma[int(lanes[0]) // 32]

    def read(self, arg, lanes: np.ndarray, typ: str) -> np.ndarray:
        """Operand ``arg`` for ``lanes`` as a numpy array of PTX type ``typ``."""
        view = VIEW[typ]
        if arg.__class__ is RegArg:  # the common case first: every check, fewest numpy calls
            name = arg.name
            r = self.regs.get(name)
            if r is None:
                r = self._reg(name)
            w = int(lanes[0]) >> 5
            whole_warp = lanes is self.warp_lanes[w]
            if not whole_warp or name not in self.warp_wrote[w]:
                written = self.written[name][lanes]
                if np.count_nonzero(written) != lanes.size:
                    raise self.fail(f"register {name} read by thread {int(lanes[~written][0])} before anything wrote it")
                if whole_warp:
                    self.warp_wrote[w].add(name)
            if name in self.wgmma[w].locked:
                raise self.fail(f"register {name} read while a wgmma writing it is in flight (no wgmma.wait_group)")
            v = r[lanes]
            if v.itemsize != VIEW_SIZE[typ]:
                raise self.fail(f"register {name} ({v.itemsize * 8}-bit) used as .{typ}")
            return v if v.dtype.type is view else v.view(view)
        n = lanes.size
        if arg.__class__ is ImmArg or arg.__class__ is FloatArg:
            # The same constant every time: made once, read-only (a handler may not change it in place).
            key = (arg, n, typ)
            v = self._constants.get(key)
            if v is None:
                v = self._constant(arg, n, typ)
                v.flags.writeable = False
                self._constants[key] = v
            return v
        if isinstance(arg, SpecialArg):
            return self._special(arg.name, lanes).astype(view)
        if isinstance(arg, SymArg):
            return np.full(n, self.symbol(arg.name), np.uint64).astype(view)
        raise self.fail(f"operand {arg} cannot be read as a value")

    @staticmethod
    def _constant(arg, n: int, typ: str) -> np.ndarray:
        """Immediate ``arg`` for ``n`` lanes as PTX type ``typ``."""
        view = VIEW[typ]
        if isinstance(arg, FloatArg):
            return np.full(n, arg.bits, np.uint32).view(np.float32)
        if np.issubdtype(view, np.floating):
            return np.full(n, arg.value, view)
        bits = VIEW_SIZE[typ] * 8
        return np.full(n, arg.value & ((1 << bits) - 1), VIEW["u64"] if bits == 64 else np.uint32).astype(view)

    def write(self, arg, lanes: np.ndarray, value: np.ndarray) -> None:
        """Store ``value`` (one per lane) into register operand ``arg``; ``_`` discards."""
        if arg.__class__ is not RegArg:
            if isinstance(arg, SymArg) and arg.name == "_":
                return
            raise self.fail(f"destination {arg} is not a register")
        name = arg.name
        r = self.regs.get(name)
        if r is None:
            r = self._reg(name)
        if lanes.size == 0:
            return
        w = int(lanes[0]) >> 5
        st = self.wgmma[w]
        if name in st.locked:
            raise self.fail(f"register {name} written while a wgmma accumulating into it is in flight")
        if name in st.inputs:
            raise self.fail(f"register {name} written while an in-flight wgmma reads it as part of its A fragment "
                            "(no wgmma.wait_group retired it)")
        st.dirty.add(name)
        if value.__class__ is not np.ndarray:
            value = np.asarray(value)
        if r.dtype.type is np.bool_:
            r[lanes] = value.astype(bool)
        else:
            if value.itemsize != r.itemsize:
                raise self.fail(f"writing {value.itemsize * 8}-bit value into {name}")
            r[lanes] = value if value.dtype == r.dtype else value.view(r.dtype)
        if lanes is not self.warp_lanes[w]:
            self.written[name][lanes] = True
        elif name not in self.warp_wrote[w]:
            self.written[name][lanes] = True
            self.warp_wrote[w].add(name)

    def _special(self, name: str, lanes: np.ndarray) -> np.ndarray:
        axis = "xyz".index(name[-1]) if name[-2] == "." else 0
        if name == "%cluster_ctarank":
            return np.full(lanes.size, self.rank)
        if name == "%cluster_nctarank":
            return np.full(lanes.size, len(self.peers))
        if name.startswith("%clusterid"):
            return np.full(lanes.size, self.ctaid[axis] // self.cluster_dims[axis])
        if name.startswith("%nclusterid"):
            return np.full(lanes.size, self.nctaid[axis] // self.cluster_dims[axis])
        if name.startswith("%cluster_ctaid"):
            return np.full(lanes.size, self.ctaid[axis] % self.cluster_dims[axis])
        if name.startswith("%cluster_nctaid"):
            return np.full(lanes.size, self.cluster_dims[axis])
        if name.startswith("%tid"):
            return lanes if axis == 0 else np.zeros(lanes.size, np.int64)
        if name.startswith("%ntid"):
            return np.full(lanes.size, self.T if axis == 0 else 1)
        if name.startswith("%ctaid"):
            return np.full(lanes.size, self.ctaid[axis])
        if name.startswith("%nctaid"):
            return np.full(lanes.size, self.nctaid[axis])
        if name == "%laneid":
            return lanes % 32
        if name == "%warpid":
            return lanes // 32
        raise self.fail(f"special register {name} is not modelled")

    def symbol(self, name: str) -> int:
        """Address of a symbol: ``smem`` or a kernel parameter (in the parameter window)."""
        if name == "smem":
            return SMEM_BASE
        if name in self.param_names:
            return PARAM_BASE + 256 * self.param_names.index(name)
        raise self.fail(f"unknown symbol {name}")

    def param_value(self, name: str):
        if name not in self.params:
            raise self.fail(f"kernel parameter {name} was not supplied")
        return self.params[name]

    def tensor_map_at(self, addr: int) -> TensorMap:
        """The tensor map parameter whose address is ``addr``."""
        i, rem = divmod(addr - PARAM_BASE, 256)
        if rem or not 0 <= i < len(self.param_names):
            raise self.fail(f"{addr:#x} is not the address of a kernel parameter (TMA needs a CUtensorMap)")
        tm = self.params.get(self.param_names[i])
        if not isinstance(tm, TensorMap):
            raise self.fail(f"parameter {self.param_names[i]} is not a tensor map")
        return tm

    def address(self, arg: MemArg, lanes: np.ndarray) -> np.ndarray:
        """Per-lane byte address of a memory operand ``[base+off]`` (as int64)."""
        if not isinstance(arg, MemArg):
            raise self.fail(f"expected a memory operand, got {arg}")
        if isinstance(arg.base, SymArg):
            base = np.full(lanes.size, self.symbol(arg.base.name), np.int64)
        else:
            typ = self.prog.reg_type(arg.base.name)
            base = self.read(arg.base, lanes, "u64" if typ == "b64" else "u32").astype(np.int64)
        return base + arg.offset

    # -- shared memory -------------------------------------------------------------------
    def smem_index(self, addrs: np.ndarray, size: int) -> np.ndarray:
        """Byte indices into the shared array for per-lane accesses of ``size`` bytes (checked)."""
        return self.smem_span(addrs, size)[0]

    def smem_span(self, addrs: np.ndarray, size: int) -> tuple[np.ndarray, int, int]:
        """(:meth:`smem_index`'s byte indices, the lowest byte, the highest byte) of per-lane accesses
        of ``size`` bytes (checked): the span lets a store test what it may overlap at once."""
        addrs = np.asarray(addrs, np.int64)
        listed = addrs.tolist()  # min and max of a warp's addresses cost less on a list
        lo, hi = (min(listed), max(listed) + size - 1) if listed else (0, -1)
        if listed and (lo < SMEM_BASE or hi >= self.smem.size):
            bad = addrs[(addrs < SMEM_BASE) | (addrs + size > self.smem.size)][0]
            raise self.fail(f"shared address {int(bad):#x} (+{size}) outside the "
                            f"{self.smem.size - SMEM_BASE}-byte dynamic shared block at {SMEM_BASE:#x}")
        if np.any(addrs % size):
            raise self.fail(f"misaligned shared access of {size} bytes at {int(addrs[addrs % size != 0][0]):#x}")
        return addrs[:, None] + np.arange(size), lo, hi

    def resolve_shared(self, addr: int) -> tuple[Cta, int]:
        """The CTA and shared::cta address a shared::cluster address names (a shared::cta
        address names the executing CTA); raises for a rank outside the cluster or a peer
        that has exited (its shared memory is gone)."""
        if addr < SMEM_CLUSTER_BASE:
            return self, addr
        rank, off = divmod(addr - SMEM_CLUSTER_BASE, SMEM_CLUSTER_STRIDE)
        if rank >= len(self.peers):
            raise self.fail(f"shared::cluster address {addr:#x} names CTA rank {rank} of a cluster of {len(self.peers)}")
        peer = self.peers[rank]
        if peer.exited:
            raise self.fail(f"shared::cluster access to CTA rank {rank}, which has exited: a CTA must not leave "
                            "while peers may still use its shared memory (barrier.cluster before exit)")
        return peer, SMEM_BASE + off

    def barrier_in(self, owner: Cta, local: int) -> MBarrier:
        """The mbarrier at shared address ``local`` of CTA ``owner`` (this one or a peer), as
        this CTA may use it: initialised, and a peer's published to the cluster."""
        b = owner.mbars.get(local)
        if b is None:
            raise self.fail(f"mbarrier at shared {local:#x} of CTA rank {owner.rank} used before its mbarrier.init"
                            + (" (a peer's barrier: a barrier.cluster between the init and first use orders it)"
                               if owner is not self else ""))
        if owner is not self and not b.published:
            raise self.fail(f"mbarrier at shared {local:#x} of CTA rank {owner.rank} used by a peer, but it is "
                            "not published to the cluster (fence.mbarrier_init.release.cluster after the init, or a "
                            ".release barrier.cluster.arrive)")
        return b

    def publish_barriers(self, lanes: np.ndarray) -> None:
        """The barriers these threads initialised become usable by the cluster's peers."""
        mine = set(lanes.tolist())
        for b in self.mbars.values():
            if b.init_thread in mine:
                b.published = True


    def mbar(self, addr: int) -> MBarrier:
        b = self.mbars.get(addr)
        if b is None:
            raise self.fail(f"mbarrier at shared {addr:#x} used before mbarrier.init")
        return b

    # -- scheduling ----------------------------------------------------------------------
    def run(self) -> None:
        """Run the CTA to completion (every thread executed ``ret``)."""
        with np.errstate(all="ignore"):  # float results overflow, divide by zero ... as on the GPU: no warnings
            self._run()

    def _run(self) -> None:
        order = np.arange(self.nwarps)
        while self.alive.any():
            progress = self.run_round(order)
            progress += self._tick_async(force=progress == 0)
            if progress == 0:
                raise EmulationError(f"CTA {self.ctaid[:2]}: deadlock -- no thread can make progress\n" + self.describe())
        self._check_idle_at_exit()

    def run_round(self, order: np.ndarray) -> int:
        """One scheduler round: every warp gets a turn, in a shuffled ``order``; returns the progress made."""
        self.round += 1
        if self.round > MAX_ROUNDS:
            raise EmulationError(f"CTA {self.ctaid[:2]}: no end after {MAX_ROUNDS} scheduler rounds")
        self.rng.shuffle(order)
        progress = 0
        for w in order:
            progress += self._turn(int(w))
            self.step += 1
            progress += self._tick_async(force=False)  # copies land between warps' turns too
        return progress

    def describe(self) -> str:
        """One line per warp: where it is and what it waits for (for deadlock reports)."""
        lines = []
        for w in range(self.nwarps):
            lanes = np.arange(32 * w, 32 * w + 32)
            live = lanes[self.alive[lanes]]
            if live.size == 0:
                lines.append(f"  warp {w}: exited")
                continue
            p = int(self.pc[live].min())
            ins = self.prog.instrs[p] if p < len(self.prog.instrs) else None
            what = f"blocked at {self.blocked[w][0]}" if self.blocked[w] else "spinning"
            text = f"line {ins.line}: {ins.text}" if ins else "end"
            lines.append(f"  warp {w}: {live.size} live lanes, {what}, {text}")
        for a, b in sorted(self.mbars.items()):
            lines.append(f"  mbarrier {a:#x}: phase {b.phase}, {b.pending}/{b.count} arrivals pending, tx {b.tx}")
        return "\n".join(lines)

    def _turn(self, w: int) -> int:
        """Run warp ``w`` for up to TURN_BUDGET instructions; returns how many made progress."""
        useful = 0
        lanes_all = self.warp_lanes[w]
        alive_w = self.alive[32 * w:32 * w + 32]  # views: they see what handlers change
        pc_w = self.pc[32 * w:32 * w + 32]
        blk = self.blocked[w]
        if blk is not None and self.kinds[blk[1]] == KIND_WARPGROUP:
            useful += self._release_warpgroup(w // 4)  # e.g. setmaxnreg.inc once registers were freed
        instrs = self.prog.instrs
        budget = TURN_BUDGET
        while budget > 0:
            budget -= 1
            if self.blocked[w] is not None:
                break
            # The lanes at the lowest PC run; a converged warp (the usual case) is all of them,
            # found with list operations, which cost less than numpy's on 32 values.
            live = np.count_nonzero(alive_w)
            if live == 32:
                lanes, pcs = lanes_all, pc_w
            elif live:
                lanes, pcs = lanes_all[alive_w], pc_w[alive_w]
            else:
                break
            pc_list = pcs.tolist()
            p = min(pc_list)
            if p >= len(instrs):
                raise EmulationError(f"CTA {self.ctaid[:2]} warp {w}: ran off the end of the kernel without ret")
            grp = lanes if pc_list.count(p) == live else lanes[pcs == p]
            if grp is lanes_all and self.straight[p]:
                ran, made_progress = self._straight_run(w, p, budget + 1)
                useful += made_progress
                budget -= ran - 1
                continue
            ins = instrs[p]
            self.current = (w, ins)
            kind = self.kinds[p]
            if kind != KIND_PLAIN:
                if grp.size != lanes.size:
                    raise self.fail(f"only lanes {_ranges(grp)} of the warp reached this .aligned/collective "
                                    f"instruction; lanes {_ranges(np.setdiff1d(lanes, grp))} are elsewhere")
                if ins.pred is not None:
                    raise self.fail("a guarded collective instruction is not modelled")
                if kind == KIND_WARPGROUP:
                    self.blocked[w] = ("warpgroup instruction", p)
                    useful += self._release_warpgroup(w // 4)
                    break
                if kind == KIND_BAR:
                    useful += self._arrive_bar(w, ins, lanes)
                    break
            act = grp
            if ins.pred is not None:
                g = self.read(ins.pred_arg, grp, "pred")
                act = grp[~g] if ins.negate else grp[g]
                if ins.op == "bra.uni" and 0 < act.size < grp.size:
                    raise self.fail("bra.uni with lanes that disagree on the guard (a divergent branch marked uniform)")
            if grp is lanes_all:
                pc_w += 1
            else:
                self.pc[grp] += 1
            if act.size == 0:
                continue  # guarded off for every lane: nothing happens, not even progress
            result = self.handlers[p](self, ins, act)
            if result == "spin":
                break
            if not self.is_branch[p]:
                useful += 1
        self.current = None
        return useful

    def _straight_run(self, w: int, p: int, budget: int) -> tuple[int, int]:
        """Run converged warp ``w`` from instruction ``p`` through the straight-line instructions
        after it, at most ``budget`` of them; returns how many it passed and how many of those
        some lane executed (the others were guarded off for every lane).

        What the scheduler's loop would do one instruction at a time, without finding the warp's
        lanes and lowest PC again after each: none of these instructions branches, exits,
        blocks or waits, so the whole warp stays at the next one."""
        instrs, handlers, straight = self.prog.instrs, self.handlers, self.straight
        lanes_all = self.warp_lanes[w]
        n = executed = 0
        try:
            while n < budget and straight[p]:
                ins = instrs[p]
                self.current = (w, ins)
                n += 1
                p += 1
                if ins.pred is None:
                    handlers[p - 1](self, ins, lanes_all)
                else:
                    g = self.read(ins.pred_arg, lanes_all, "pred")
                    act = lanes_all[~g] if ins.negate else lanes_all[g]
                    if not act.size:
                        continue
                    handlers[p - 1](self, ins, act)
                executed += 1
        finally:
            self.pc[32 * w:32 * w + 32] += n
        return n, executed

    def _release_warpgroup(self, g: int) -> int:
        """If all four warps of warpgroup ``g`` wait at the same instruction, run it for 128 lanes."""
        warps = range(4 * g, min(4 * g + 4, self.nwarps))
        states = [self.blocked[w] for w in warps]
        if any(s is None or not isinstance(s[1], int) or self.kinds[s[1]] != KIND_WARPGROUP for s in states):
            return 0
        pcs = {s[1] for s in states}
        if len(pcs) != 1:
            lines = sorted(self.prog.instrs[p].line for p in pcs)
            raise EmulationError(f"CTA {self.ctaid[:2]} warpgroup {g}: its warps wait at different warpgroup "
                                 f"instructions (PTX lines {lines})")
        p = pcs.pop()
        lanes = np.arange(128 * g, 128 * g + 128)
        if not self.alive[lanes].all():
            raise EmulationError(f"CTA {self.ctaid[:2]} warpgroup {g}: some threads exited before a warpgroup instruction")
        ins = self.prog.instrs[p]
        self.current = (4 * g, ins)
        if ins.op.startswith("setmaxnreg.inc"):
            # .inc waits until the other warpgroups have released enough registers (.dec).
            want = int(ins.args[0].value)
            if 128 * (sum(self.nreg) - self.nreg[g] + want) > 65536:
                for w in warps:
                    self.blocked[w] = (f"setmaxnreg.inc {want} (waiting for free registers)", p)
                return 0
        self.pc[lanes] += 1
        for w in warps:
            self.blocked[w] = None
        self.handlers[p](self, ins, lanes)
        return 1

    def _arrive_bar(self, w: int, ins, lanes: np.ndarray) -> int:
        """``bar.sync id[, count]``: the warp waits until ``count`` threads (default: all) arrived."""
        bid = int(self.read(ins.args[0], lanes[:1], "u32")[0])
        expected = int(self.read(ins.args[1], lanes[:1], "u32")[0]) if len(ins.args) > 1 else self.T
        st = self.bars.setdefault(bid, {"expected": expected, "arrived": 0, "warps": []})
        if st["expected"] != expected:
            raise self.fail(f"bar.sync {bid} used with thread counts {st['expected']} and {expected} at once")
        st["arrived"] += lanes.size
        st["warps"].append(w)
        self.blocked[w] = (f"bar.sync {bid} ({st['arrived']}/{expected} arrived)", int(self.pc[lanes[0]]))
        if st["arrived"] > expected:
            raise self.fail(f"bar.sync {bid}: {st['arrived']} threads arrived for a count of {expected}")
        if st["arrived"] == expected:
            for v in st["warps"]:
                vl = np.arange(32 * v, 32 * v + 32)
                vl = vl[self.alive[vl]]
                self.pc[vl] += 1
                self.blocked[v] = None
            del self.bars[bid]
        return 1

    def _tick_async(self, force: bool) -> int:
        """Land TMA copies whose delay has passed (all of the oldest ones when ``force``)."""
        if not self.tma_queue:
            return 0
        ready = [op for op in self.tma_queue if op[0] <= self.step]
        if not ready and force:
            # Nothing else can move: some copy lands (any one -- they may complete out of order).
            ready = [self.tma_queue[int(self.rng.integers(len(self.tma_queue)))]]
        for op in ready:
            self.tma_queue.remove(op)
            op[1]()
        return len(ready)

    def schedule_tma(self, complete) -> tuple:
        """Queue an asynchronous copy: a quarter land right after this warp's turn (before the
        other warps move: exposes missing "slot is free" barriers), the rest up to
        ``max_tma_delay`` rounds later (exposes missing "data has landed" waits)."""
        late = self.rng.random() >= 0.25
        delay = int(self.rng.integers(1, self.max_tma_delay * self.nwarps + 1)) if late else 0
        entry = (self.step + delay, complete)
        self.tma_queue.append(entry)
        return entry

    def _check_idle_at_exit(self) -> None:
        for w, st in enumerate(self.wgmma):
            if st.open_ops or st.groups:
                raise EmulationError(f"CTA {self.ctaid[:2]} warp {w}: exited with wgmma operations in flight")
        for w, groups in self.cp_groups.items():
            if groups or self.cp_open.get(w):
                raise EmulationError(f"CTA {self.ctaid[:2]} warp {w}: exited with cp.async copies never waited for")
        for t, groups in self.bulk_groups.items():
            if groups or self.bulk_open.get(t):
                raise EmulationError(f"CTA {self.ctaid[:2]} thread {t}: exited with bulk (TMA) stores never waited for "
                                     "(cp.async.bulk.wait_group): the CTA's shared memory may go before they read it")
        if self.tma_queue:
            raise EmulationError(f"CTA {self.ctaid[:2]}: exited with {len(self.tma_queue)} TMA copies in flight")


class Cluster:
    """The CTAs of one thread-block cluster, run together: each round every live CTA
    takes a scheduler round (in a shuffled order) and their copies land in between.

    The CTAs of a cluster are launched together but need not keep pace: each starts up to
    ``MAX_START_SKEW`` rounds after the first, and in any round a CTA sits out with
    probability ``SIT_OUT``.  So one CTA's producer can reach a peer before the peer has
    initialised its barriers, or after it has left -- the orderings ``barrier.cluster``
    exists to prevent.  The cluster ends when every CTA has; a CTA that finishes first is
    checked for idle async work and marked exited, after which a peer touching its shared
    memory is an error.  Deadlock is judged over the whole cluster, in rounds where every
    live CTA ran.
    """

    MAX_START_SKEW = 6
    SIT_OUT = 0.25

    def __init__(self, ctas: list[Cta], dims: tuple[int, int, int], seed: int | np.random.SeedSequence = 0) -> None:
        self.ctas = ctas
        barrier = ClusterBarrier(sum(c.T for c in ctas))
        for rank, c in enumerate(ctas):
            c.peers, c.rank, c.cluster_dims, c.cluster_barrier = ctas, rank, dims, barrier
        self.rng = np.random.default_rng(seed)
        self.start = self.rng.integers(0, self.MAX_START_SKEW + 1, len(ctas))
        self.start -= self.start.min()

    def _check_no_unordered_arrivals_on(self, leaving: Cta) -> None:
        """A CTA may leave only once every peer's remote arrival on its barriers is ordered
        before its exit (a releasing barrier.cluster.arrive by the arriving thread)."""
        for peer in self.ctas:
            late = [t for t, ranks in peer.unordered_remote.items() if leaving.rank in ranks]
            if late:
                raise EmulationError(
                    f"CTA {leaving.ctaid[:2]} exited while the remote mbarrier arrivals of CTA {peer.ctaid[:2]} "
                    f"thread {late[0]} on its barriers were not ordered before the exit: the arriving thread "
                    "needs a .release barrier.cluster.arrive (not .relaxed) before the final wait")

    def run(self) -> None:
        """Run every CTA of the cluster to completion."""
        with np.errstate(all="ignore"):  # as Cta.run: float exceptions are results, not warnings
            self._run()

    def _run(self) -> None:
        orders = [np.arange(c.nwarps) for c in self.ctas]
        rnd = 0
        while not all(c.exited for c in self.ctas):
            live = [i for i, c in enumerate(self.ctas) if not c.exited]
            ready = [i for i in live if rnd >= self.start[i]]
            run = [i for i in ready if self.rng.random() >= self.SIT_OUT] or ready
            everyone = len(run) == len(live)
            rnd += 1
            progress = 0
            for i in self.rng.permutation(run):
                c = self.ctas[i]
                progress += c.run_round(orders[i])
                if not c.alive.any():  # gone at once: a peer's later access this round is an error
                    c._check_idle_at_exit()
                    self._check_no_unordered_arrivals_on(c)
                    c.exited = True
            if progress == 0 and everyone:
                # Nothing could move: land one copy, from any CTA that has some in flight.
                waiting = [c for c in self.ctas if c.tma_queue]
                if waiting:
                    progress += waiting[int(self.rng.integers(len(waiting)))]._tick_async(force=True)
                if progress == 0:
                    raise EmulationError("cluster of CTAs " + ", ".join(str(c.ctaid[:2]) for c in self.ctas)
                                         + ": deadlock -- no thread can make progress\n"
                                         + "\n".join(f" CTA {c.ctaid[:2]} (rank {c.rank}):\n{c.describe()}"
                                                     for c in self.ctas if not c.exited))


_ranges = emu_ops.lane_ranges  # one definition, shared with the instruction handlers


class Grid:
    """A launch of a compute kernel run as one numpy vector: every thread of every CTA given.

    For programs :func:`ops.is_compute_program` accepts (no async copies, tensor
    cores, mbarriers or clusters: nothing that communicates across CTAs), the threads of
    all CTAs execute together: each step, every live thread at the lowest program counter
    runs that instruction as one vector operation (``ops.compile_program`` compiled
    it once per program).  Lanes that branch apart wait at their higher PCs and rejoin
    when the lowest ones reach them, which reconverges structured code.  ``bar.sync 0``
    holds a thread until every thread of every CTA of the vector that had not exited
    when the barrier opened has reached a ``bar.sync`` -- equivalent to per-CTA barriers
    for programs with no cross-CTA communication -- and a thread exiting while the
    barrier is open is a deadlock, as is a barrier only some threads reach.

    Shared memory is one block per CTA.  Lockstep execution alone would hide a missing
    barrier, so a store to shared memory becomes visible to *other* threads only at the
    next ``bar.sync`` (a thread sees its own stores at once): a kernel that reads another
    thread's shared data without a barrier in between reads the value from before, as a
    GPU may, and computes a wrong result.  ``.local`` arrays are per thread.  Registers
    carry a written bit, as in :class:`Cta` (``shfl`` reading a lane that never wrote
    its register is exempt: PTX leaves that value unspecified).
    """

    BIG = np.int64(1) << 62
    MAX_STEPS = 5_000_000  # instruction steps of one batch before it counts as an endless loop

    def __init__(self, prog: PtxProgram, block: tuple[int, int, int], shared_bytes: int, params: dict[str, object],
                 memory: GlobalMemory, ctas: list[tuple[int, int, int]], nctaid: tuple[int, int, int]) -> None:
        self.ops, self.comp = emu_ops.compile_program(prog)
        self.prog, self.mem, self.params = prog, memory, params
        self.block, self.nctaid, self.ctas = block, nctaid, ctas
        T = block[0] * block[1] * block[2]
        n_cta = len(ctas)
        N = T * n_cta
        self.T, self.N, self.n_cta = T, N, n_cta
        self.regs = [np.zeros(N, st) for st in self.comp.store]
        self.written = [np.zeros(N, bool) for _ in self.comp.store]
        self.complete = [False] * len(self.comp.store)
        # a register every thread holds the same value in is kept as one numpy scalar (loop
        # counters, parameters, addresses derived from them): its ops cost no vector work
        self.uni: list = [None] * len(self.comp.store)
        self.tid_lin = np.tile(np.arange(T, dtype=np.int64), n_cta)
        self.cta_idx = np.repeat(np.arange(n_cta, dtype=np.int64), T)
        self.lane = (self.tid_lin % 32).astype(np.uint32)
        nw = (T + 31) // 32
        self.warp_key = self.cta_idx * nw + self.tid_lin // 32
        self.n_warps = n_cta * nw
        self._all = np.arange(N, dtype=np.int64)
        self._special: dict[str, np.ndarray] = {}
        self.S = shared_bytes
        self.Sp = max(16, (shared_bytes + 15) // 16 * 16)
        self.smem = np.zeros(n_cta * self.Sp, np.uint8)
        self.snap = np.zeros_like(self.smem)
        self.writer = np.full(self.smem.size, -1, np.int64)
        self.smem_off = self.cta_idx * self.Sp
        self.dirty = False
        self.L = self.comp.local_bytes
        self.lmem = np.zeros(N * self.L, np.uint8) if self.L else None
        self.lmem_off = self._all * self.L
        self.steps = 0

    # -- what handlers use ---------------------------------------------------------------
    def gid(self, sel) -> np.ndarray:
        """Vector indices of ``sel`` (every thread for None)."""
        return self._all if sel is None else sel

    def count(self, sel) -> int:
        return self.N if sel is None else sel.size

    def who(self, g: int) -> str:
        """'thread (x, y, z) of CTA (x, y, z)' for vector index ``g``."""
        t, c = int(self.tid_lin[g]), self.ctas[int(self.cta_idx[g])]
        bx, by, _ = self.block
        return f"thread {(t % bx, t // bx % by, t // (bx * by))} of CTA {tuple(c)}"

    def special(self, name: str) -> np.ndarray:
        v = self._special.get(name)
        if v is None:
            bx, by, bz = self.block
            t = self.tid_lin
            axis = "xyz".index(name[-1]) if name[-2] == "." else 0
            cta = np.asarray(self.ctas, np.int64).reshape(-1, 3)
            if name.startswith("%tid"):
                v = (t % bx, t // bx % by, t // (bx * by))[axis]
            elif name.startswith("%ntid"):
                v = np.full(self.N, self.block[axis])
            elif name.startswith("%ctaid"):
                v = cta[self.cta_idx, axis]
            elif name.startswith("%nctaid"):
                v = np.full(self.N, self.nctaid[axis])
            elif name == "%laneid":
                v = t % 32
            elif name == "%warpid":
                v = t // 32
            else:
                raise EmulationError(f"special register {name} is not modelled for compute kernels")
            v = self._special[name] = np.asarray(v).astype(np.uint32)
        return v

    def param_value(self, name: str) -> int:
        v = self.params.get(name)
        if v is None:
            raise EmulationError(f"kernel parameter {name} was not supplied")
        if isinstance(v, TensorMap):
            raise EmulationError(f"parameter {name} is a tensor map, read as a number")
        return int(v)

    def check_written(self, s: int, sel) -> None:
        w = self.written[s]
        if np.count_nonzero(w) == w.size:
            self.complete[s] = True
            return
        sub = w if sel is None else w[sel]
        if np.count_nonzero(sub) != sub.size:
            g = int(self.gid(sel)[np.flatnonzero(~sub)[0]])
            c = self.ctas[int(self.cta_idx[g])]
            raise EmulationError(f"register {self.comp.names[s]} read by thread {int(self.tid_lin[g])} before "
                                 f"anything wrote it (CTA {tuple(c)})")

    def _check(self, space: str, rel: np.ndarray, sel, size: int, limit: int) -> None:
        """Bounds (``0 <= rel``, ``rel + size <= limit``) and alignment of per-lane offsets."""
        if rel.min() >= 0 and rel.max() <= limit - size and (size == 1 or not (rel & (size - 1)).any()):
            return
        bad = (rel < 0) | (rel + size > limit) | (rel % size != 0)
        i = int(np.flatnonzero(bad)[0])
        r = int(rel[i])
        why = "misaligned" if 0 <= r and r + size <= limit else "out of range"
        raise EmulationError(f"{why} .{space} access of {size} bytes at offset {r} (of {limit} bytes) by "
                             f"{self.who(int(self.gid(sel)[i]))}")

    def _global_aligned(self, addr: np.ndarray, sel, size: int, what: str) -> None:
        if size > 1 and (addr & (size - 1)).any():
            i = int(np.flatnonzero(addr & (size - 1))[0])
            raise EmulationError(f"misaligned global {what} of {size} bytes at {int(addr[i]):#x} by "
                                 f"{self.who(int(self.gid(sel)[i]))}")

    def _smem_bytes(self, addr: np.ndarray, sel, size: int) -> np.ndarray:
        """Checked byte indices into the batch's shared array for per-lane shared addresses."""
        rel = addr - SMEM_BASE
        self._check("shared", rel, sel, size, self.S)
        return rel + (self.smem_off if sel is None else self.smem_off[sel])

    def _lmem_bytes(self, addr: np.ndarray, sel, size: int) -> np.ndarray:
        rel = addr - emu_ops.LMEM_BASE
        self._check("local", rel, sel, size, self.L)
        return rel + (self.lmem_off if sel is None else self.lmem_off[sel])

    def _lmem_uniform(self, addr: np.ndarray, size: int, esize: int):
        """The element index when every lane accesses the same in-range, aligned offset of its
        own local array (loop counters are usually uniform), else None (the general path)."""
        lo = int(addr if addr.ndim == 0 else addr[0]) - emu_ops.LMEM_BASE
        if 0 <= lo <= self.L - size and lo % size == 0 and (addr.ndim == 0 or addr.min() == addr.max()):
            return lo // esize
        return None

    @staticmethod
    def _elements(byte: np.ndarray, esize: int, vec: int) -> np.ndarray:
        """Element indices (``[lanes]`` or ``[lanes, vec]``) of accesses starting at ``byte``."""
        e = byte >> _SHIFT[esize] if esize > 1 else byte
        return e if vec == 1 else e[:, None] + np.arange(vec)

    def load(self, space: str, addr, sel, esize: int, vec: int, dt) -> np.ndarray:
        """Per-lane loads of ``vec`` elements of ``dt``: ``[lanes, vec]``."""
        n = self.N if sel is None else sel.size
        size = esize * vec
        if space == "local":
            e = self._lmem_uniform(addr, size, esize)
            if e is not None:  # every lane the same element of its own array: one strided column
                col = self.lmem.view(dt).reshape(self.N, -1)[:, e: e + vec]
                return col if sel is None else col[sel]
        if addr.ndim == 0:
            addr = np.full(n, addr, np.int64)
        if space == "global":
            self._global_aligned(addr, sel, size, "load")
            return self.mem.gather(addr, esize, vec, dt)
        if space == "shared":
            byte = self._smem_bytes(addr, sel, size)
            out = self.smem.view(dt)[self._elements(byte, esize, vec)]
            if self.dirty:  # another thread's store of this barrier interval is not visible yet
                bidx = byte[:, None] + np.arange(size)
                w = self.writer[bidx]
                stale = (w >= 0) & (w != self.gid(sel)[:, None])
                if stale.any():
                    raw = self.smem[bidx]
                    raw[stale] = self.snap[bidx][stale]
                    return np.ascontiguousarray(raw).view(dt).reshape(n, vec)
            return out if vec > 1 else out[:, None]
        if space == "local":
            out = self.lmem.view(dt)[self._elements(self._lmem_bytes(addr, sel, size), esize, vec)]
            return out if vec > 1 else out[:, None]
        raise EmulationError(f"loads from .{space} are not modelled")

    def store(self, space: str, addr, sel, esize: int, vec: int, vals: np.ndarray) -> None:
        """Per-lane stores of ``vals`` (``[lanes, vec]``)."""
        n = self.N if sel is None else sel.size
        size = esize * vec
        dt = vals.dtype
        if space == "local":
            e = self._lmem_uniform(addr, size, esize)
            if e is not None:
                mat = self.lmem.view(dt).reshape(self.N, -1)
                if sel is None:
                    mat[:, e: e + vec] = vals
                else:
                    mat[sel, e: e + vec] = vals
                return
        if addr.ndim == 0:
            addr = np.full(n, addr, np.int64)
        if space == "global":
            self._global_aligned(addr, sel, size, "store")
            self.mem.scatter(addr, esize, vals)
            return
        if vec == 1:
            vals = vals[:, 0]
        if space == "shared":
            byte = self._smem_bytes(addr, sel, size)
            self.smem.view(dt)[self._elements(byte, esize, vec)] = vals
            self.writer[byte[:, None] + np.arange(size) if size > 1 else byte] = \
                self.gid(sel)[:, None] if size > 1 else self.gid(sel)
            self.dirty = True
        elif space == "local":
            self.lmem.view(dt)[self._elements(self._lmem_bytes(addr, sel, size), esize, vec)] = vals
        else:
            raise EmulationError(f"stores to .{space} are not modelled")

    def _barrier_done(self) -> None:
        """A barrier completed: every shared store so far becomes visible to every thread."""
        if self.dirty:
            self.snap[:] = self.smem
            self.writer.fill(-1)
            self.dirty = False

    def _pred(self, s: int, sel) -> np.ndarray:
        if self.uni[s] is not None:
            return self.uni[s]
        if not self.complete[s]:
            self.check_written(s, sel)
        r = self.regs[s]
        return r if sel is None else r[sel]

    # -- the scheduler -------------------------------------------------------------------
    def run(self) -> None:
        """Run every thread to its ``ret``/``exit``."""
        with np.errstate(all="ignore"):
            try:
                self._run()
            except EmulationError as e:
                if getattr(e, "located", False):
                    raise
                ins = self.ops[self._p].ins if 0 <= self._p < len(self.ops) else None
                where = f"{self.prog.name}, PTX line {ins.line}: {ins.text}: " if ins else f"{self.prog.name}: "
                err = EmulationError(where + str(e))
                err.located = True
                raise err from None

    def _run(self) -> None:
        ops, N, BIG = self.ops, self.N, self.BIG
        n_ops = len(ops)
        alive = np.ones(N, bool)
        pc = np.zeros(N, np.int64)
        waiting = np.zeros(N, bool)
        nwait, n_alive = 0, N
        uniform, upc, live = True, self.comp.start, None
        next_pc = np.array([op.next for op in ops] + [n_ops], np.int64)
        open_alive = None
        steps = 0
        self._p = 0
        while True:
            steps += 1
            if steps > self.MAX_STEPS:
                raise EmulationError(f"no end after {self.MAX_STEPS} instruction steps (an endless loop?)")
            if uniform:
                p, sel = upc, live
            else:
                cand = alive & ~waiting if nwait else alive
                pcm = np.where(cand, pc, BIG)
                p = int(np.minimum.reduce(pcm))
                if p == BIG:
                    if nwait == 0:
                        self.steps = steps
                        return
                    self._p = -1
                    self._release(waiting, open_alive, pc)
                    pc[waiting] = next_pc[pc[waiting]]
                    waiting[:] = False
                    nwait = 0
                    self._barrier_done()
                    continue
                sel = np.flatnonzero(pcm == p)
                if nwait == 0 and sel.size == n_alive:  # every live thread is here again
                    uniform, upc = True, p
                    live = None if n_alive == N else sel
            self._p = p
            if p >= n_ops:
                raise EmulationError("ran off the end of the kernel without ret")
            op = ops[p]
            act = sel
            if op.guard is not None:
                g = self._pred(op.guard, sel)
                if op.negate:
                    g = ~g
                on = np.count_nonzero(g)  # one count instead of all() and any(): fewer numpy calls
                if on == g.size:
                    act = sel
                elif on == 0:
                    act = _EMPTY
                else:
                    act = np.flatnonzero(g) if sel is None else sel[g]
            kind = op.kind
            nxt = op.next
            if kind == 0:  # plain
                if act is not _EMPTY:
                    op.fn(self, act)
            elif kind == 1:  # bra
                if act is sel:
                    nxt = op.target
                elif act is not _EMPTY:
                    if uniform:
                        uniform = False
                        pc[self.gid(live)] = nxt
                    else:
                        pc[sel] = nxt
                    pc[act] = op.target
                    continue
            elif kind == 2:  # ret / exit
                if act is not _EMPTY:
                    gone = self.gid(act)
                    alive[gone] = False
                    n_alive -= gone.size
                    if n_alive == 0:
                        self.steps = steps
                        return
                    if uniform:
                        live = np.flatnonzero(alive)
            elif kind == 3:  # bar.sync 0
                if uniform:
                    self._barrier_done()  # every live thread is here
                else:
                    if nwait == 0:
                        open_alive = alive.copy()
                    waiting[sel] = True
                    nwait += sel.size
                    continue
            if uniform:
                upc = nxt
            else:
                pc[sel] = nxt

    def _release(self, waiting: np.ndarray, open_alive: np.ndarray, pc: np.ndarray) -> None:
        """Every live thread waits at a barrier: it completes unless a CTA that has threads
        waiting lost some of the threads it counted when the barrier opened (they exited)."""
        per_cta_wait = np.bincount(self.cta_idx[waiting], minlength=self.n_cta)
        per_cta_open = np.bincount(self.cta_idx[open_alive], minlength=self.n_cta)
        short = np.flatnonzero((per_cta_wait > 0) & (per_cta_wait < per_cta_open))
        if short.size:
            c = int(short[0])
            g = int(np.flatnonzero(waiting & (self.cta_idx == c))[0])
            ins = self.ops[int(pc[g])].ins
            err = EmulationError(
                f"{self.prog.name}: deadlock -- CTA {tuple(self.ctas[c])}: bar.sync 0 ({per_cta_wait[c]}/"
                f"{per_cta_open[c]} arrived) at PTX line {ins.line}: {ins.text}; the other threads exited "
                "without reaching it")
            err.located = True
            raise err


_SHIFT = {2: 1, 4: 2, 8: 3, 16: 4}


class _Empty:
    """No thread executes (every guard false)."""


_EMPTY = _Empty()
