"""State the PTX emulator keeps: global memory, tensor maps, mbarriers, in-flight async work, and its error.

Kept apart from the scheduler (:mod:`emulator`) and the instruction semantics
(:mod:`emu_ops`) so each file has one job.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from helios.errors import HeliosError

# Where things live in the emulated address spaces.  The shared window starts above 0
# (and 1024-aligned, as the 128-byte swizzle needs) so code that assumes a zero base
# is caught; global allocations are spread out with unmapped gaps between them.
SMEM_BASE = 0x400
# The shared::cluster window: CTA ``r`` of a cluster sees the shared block of CTA ``r'`` at
# SMEM_CLUSTER_BASE + r' * SMEM_CLUSTER_STRIDE + (shared::cta address - SMEM_BASE)
# (what ``mapa`` returns); a plain shared::cta address names the executing CTA's own block.
SMEM_CLUSTER_BASE = 0x0100_0000
SMEM_CLUSTER_STRIDE = 0x0010_0000
GLOBAL_BASE = 0x7F00_0000_0000
GLOBAL_GAP = 1 << 20
PARAM_BASE = 0x0000_7E00_0000_0000  # generic address of kernel parameter i: PARAM_BASE + 256 * i


class EmulationError(HeliosError, RuntimeError):
    """The kernel did something a GPU would hang, fault or compute garbage on.

    The message names the CTA, warp, PTX line and instruction, and what went wrong.
    """


@dataclass(frozen=True)
class TensorMap:
    """What ``cuTensorMapEncodeTiled`` would encode: a tensor of rank 1..5, a box, tile mode, 128B swizzle.

    The general form is ``dims`` (element counts, innermost first), ``strides`` (byte
    strides of dims 1..rank-1) and ``box`` (box extents, innermost first); build any rank
    with :meth:`tiled`.  A 2-D map is also written ``TensorMap(base, rows, cols,
    box_rows, box_cols, itemsize[, swizzle, pitch])`` (a row-major matrix; ``pitch``:
    bytes from one row to the next, 0 for dense rows), and both spellings of the same
    map compare equal.  For other ranks the 2-D fields describe what shared memory
    sees: ``cols``/``box_cols`` the inner dimension, ``rows`` and ``pitch`` dimension 1
    (1 and 0 for rank 1), and ``box_rows`` the rows the box lands as, the product of its
    outer extents.
    """

    base: int
    rows: int
    cols: int
    box_rows: int
    box_cols: int
    itemsize: int
    swizzle: int = 128
    pitch: int = 0
    dims: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    box: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.dims:  # the 2-D spelling: fill in the general form
            object.__setattr__(self, "dims", (self.cols, self.rows))
            object.__setattr__(self, "strides", (self.row_pitch,))
            object.__setattr__(self, "box", (self.box_cols, self.box_rows))
        if not 1 <= len(self.dims) <= 5 or len(self.box) != len(self.dims) or len(self.strides) != len(self.dims) - 1:
            raise ValueError(f"tensor map of dims {self.dims}, strides {self.strides}, box {self.box}: "
                             "rank 1..5 with rank - 1 strides and rank box extents")

    @classmethod
    def tiled(cls, base: int, dims, strides, box, itemsize: int, swizzle: int = 128) -> TensorMap:
        """The map of any rank: ``dims`` and ``box`` innermost first, ``strides`` in bytes for dims 1.."""
        dims, strides, box = tuple(map(int, dims)), tuple(map(int, strides)), tuple(map(int, box))
        rows = dims[1] if len(dims) > 1 else 1
        stride = strides[0] if strides else 0
        pitch = 0 if stride == dims[0] * itemsize else stride
        outer = 1
        for b in box[1:]:
            outer *= b
        return cls(base, rows, dims[0], outer, box[0], itemsize, swizzle, pitch, dims, strides, box)

    @property
    def rank(self) -> int:
        """Number of dimensions (1..5)."""
        return len(self.dims)

    @property
    def row_pitch(self) -> int:
        """Bytes from one row (element of dimension 1) to the next."""
        return self.pitch or self.cols * self.itemsize

    @property
    def box_bytes(self) -> int:
        """Bytes one box fills in shared memory."""
        return self.box_rows * self.box_cols * self.itemsize


class GlobalMemory:
    """Device global memory as separate numpy byte buffers at spread-out addresses.

    Every access is bounds-checked against one allocation: an address outside all of
    them raises :class:`EmulationError` (on a GPU: an illegal address that kills the context).
    """

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._bufs: list[np.ndarray] = []
        self._next = GLOBAL_BASE

    @property
    def allocated_bytes(self) -> int:
        """Bytes in live allocations."""
        return sum(b.size for b in self._bufs)

    def alloc(self, nbytes: int, fill: int = 0) -> int:
        """A fresh zero- (or ``fill``-) initialised allocation; returns its address."""
        addr = self._next
        self._bases.append(addr)
        self._bufs.append(np.full(max(nbytes, 1), fill, np.uint8))
        self._next += (nbytes + GLOBAL_GAP + 255) // 256 * 256
        return addr

    def alloc_array(self, arr: np.ndarray) -> int:
        """Allocate and copy ``arr``'s bytes in."""
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        addr = self.alloc(raw.size)
        self._bufs[-1][:] = raw
        return addr

    def free(self, addr: int) -> None:
        """Release the allocation that starts at ``addr``; later accesses to it are illegal."""
        i = bisect.bisect_left(self._bases, addr)
        if i == len(self._bases) or self._bases[i] != addr:
            raise EmulationError(f"free of {addr:#x}, which is not the start of a live allocation")
        del self._bases[i], self._bufs[i]

    def view(self, addr: int, nbytes: int) -> np.ndarray:
        """The bytes ``[addr, addr + nbytes)`` of one allocation (a writable view)."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0 or addr + nbytes > self._bases[i] + self._bufs[i].size:
            raise EmulationError(f"illegal global address {addr:#x} (+{nbytes} bytes): outside every allocation")
        off = addr - self._bases[i]
        return self._bufs[i][off: off + nbytes]

    def _locate(self, addrs: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Allocation buffer and byte offsets for per-lane ``addrs`` (all in one allocation)."""
        lo, hi = int(addrs.min()), int(addrs.max())
        i = bisect.bisect_right(self._bases, lo) - 1
        if i < 0 or hi + size > self._bases[i] + self._bufs[i].size:
            bad = [int(a) for a in addrs if not self._inside(int(a), size)]
            if bad:
                raise EmulationError(f"illegal global address {bad[0]:#x} (+{size} bytes): outside every allocation")
            raise EmulationError("one warp's accesses span two allocations; the emulator does not model that")
        if lo % size or hi % size or np.any(addrs % size):
            raise EmulationError(f"misaligned global access of {size} bytes at {int(addrs[addrs % size != 0][0]):#x}")
        return self._bufs[i], (addrs - self._bases[i]).astype(np.int64)

    def _inside(self, addr: int, size: int) -> bool:
        i = bisect.bisect_right(self._bases, addr) - 1
        return i >= 0 and addr + size <= self._bases[i] + self._bufs[i].size

    def _groups(self, addrs: np.ndarray, size: int):
        """``(allocation, lane indices or None for all, byte offsets)`` per allocation the
        lanes' accesses fall in; an access outside every allocation is an error."""
        lo, hi = int(addrs.min()), int(addrs.max())
        i = bisect.bisect_right(self._bases, lo) - 1
        if i >= 0 and hi + size <= self._bases[i] + self._bufs[i].size:
            return [(i, None, addrs - self._bases[i])]
        bases = np.asarray(self._bases, np.int64)
        ends = bases + np.asarray([b.size for b in self._bufs], np.int64)
        which = np.searchsorted(bases, addrs, side="right") - 1
        bad = (which < 0) | (addrs + size > ends[np.maximum(which, 0)])
        if bad.any():
            a = int(addrs[np.flatnonzero(bad)[0]])
            raise EmulationError(f"illegal global address {a:#x} (+{size} bytes): outside every allocation")
        out = []
        for j in np.unique(which).tolist():
            lanes = np.flatnonzero(which == j)
            out.append((j, lanes, addrs[lanes] - bases[j]))
        return out

    def gather(self, addrs: np.ndarray, esize: int, vec: int, dt) -> np.ndarray:
        """Per-lane loads of ``vec`` consecutive elements of ``dt`` (``esize`` bytes each) at
        aligned int64 ``addrs``, which may fall in different allocations: ``[lanes, vec]``."""
        groups = self._groups(addrs, esize * vec)
        step = np.arange(vec)
        if len(groups) == 1 and groups[0][1] is None:
            buf = self._bufs[groups[0][0]]
            return buf[: buf.size // esize * esize].view(dt)[(groups[0][2] // esize)[:, None] + step]
        out = np.empty((addrs.size, vec), dt)
        for i, lanes, off in groups:
            buf = self._bufs[i]
            out[lanes] = buf[: buf.size // esize * esize].view(dt)[(off // esize)[:, None] + step]
        return out

    def scatter(self, addrs: np.ndarray, esize: int, vals: np.ndarray) -> None:
        """Per-lane stores of ``vals`` (``[lanes, vec]``) at aligned int64 ``addrs``."""
        vec = vals.shape[1]
        step = np.arange(vec)
        for i, lanes, off in self._groups(addrs, esize * vec):
            buf = self._bufs[i]
            view = buf[: buf.size // esize * esize].view(vals.dtype)
            view[(off // esize)[:, None] + step] = vals if lanes is None else vals[lanes]

    def load(self, addrs: np.ndarray, size: int) -> np.ndarray:
        """Per-lane loads of ``size`` bytes: returns uint8 ``[lanes, size]``."""
        buf, off = self._locate(addrs, size)
        return buf[off[:, None] + np.arange(size)]

    def store(self, addrs: np.ndarray, data: np.ndarray) -> None:
        """Per-lane stores: ``data`` is uint8 ``[lanes, size]``."""
        size = data.shape[1]
        buf, off = self._locate(addrs, size)
        buf[off[:, None] + np.arange(size)] = data


@dataclass
class MBarrier:
    """An ``mbarrier`` object: expected arrivals per phase, pending arrivals, transaction bytes, phase."""

    count: int
    pending: int
    tx: int = 0
    phase: int = 0
    # Peers of a cluster may use a barrier only once it is published to the cluster: its
    # initialising thread ran fence.mbarrier_init.release.cluster or a releasing
    # barrier.cluster.arrive after the init.
    published: bool = True
    init_thread: int = -1

    def arrive(self, n: int, where: str) -> bool:
        """``n`` arrivals; returns True when they complete the phase."""
        self.pending -= n
        if self.pending < 0:
            raise EmulationError(
                f"{where}: {-self.pending} more arrivals than the barrier's count {self.count} in phase {self.phase}"
            )
        return self._maybe_complete()

    def expect_tx(self, nbytes: int) -> None:
        self.tx += nbytes

    def complete_tx(self, nbytes: int) -> bool:
        self.tx -= nbytes
        return self._maybe_complete()

    def _maybe_complete(self) -> bool:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            return True
        return False

    def test_parity(self, parity: int) -> bool:
        """``try_wait.parity``: has the phase with this parity completed (i.e. is the current one the other)?"""
        return (self.phase & 1) != (parity & 1)


@dataclass
class WgmmaOp:
    """One ``wgmma.mma_async`` waiting to be retired.

    A comes from shared memory through ``desc_a``, or (the register form) from the
    registers ``a_regs``, whose values the warpgroup's 128 threads held at issue are
    ``a_frag`` (``[thread in warpgroup, register]``, uint32); ``desc_a`` is then None."""

    acc: list[str]
    desc_a: int | None
    desc_b: int
    scale_d: bool
    n: int
    k_bytes: int
    in_dtype: str
    trans_b: bool
    line: int
    trans_a: bool = False
    a_regs: list[str] = field(default_factory=list)
    a_frag: np.ndarray | None = None


@dataclass
class WarpWgmma:
    """One warp's share of the wgmma pipeline: its open and committed groups, locked registers.

    A ``wgmma.mma_async`` is issued by the four warps together, but each warp commits,
    waits and retires its own share (its 16 rows of the accumulator), so a warp that
    passes ``wgmma.wait_group`` says nothing about the other three -- as on the GPU.
    """

    open_ops: list[WgmmaOp] = field(default_factory=list)
    groups: list[list[WgmmaOp]] = field(default_factory=list)
    locked: set[str] = field(default_factory=set)  # accumulators of in-flight wgmmas
    # A-fragment registers of in-flight register-form wgmmas: the tensor core reads them
    # asynchronously, so nothing may write them until the wgmma retires (reading is fine)
    inputs: set[str] = field(default_factory=set)
    dirty: set[str] = field(default_factory=set)  # written by ordinary instructions since the last fence


@dataclass
class CpAsyncOp:
    """One warp-instruction's ``cp.async`` copies: per-lane shared destinations and global sources."""

    dst: np.ndarray
    src: np.ndarray
    size: int


@dataclass
class BulkStore:
    """One thread's ``cp.async.bulk.tensor`` store: a box read from shared memory at
    ``src`` (swizzled as the tensor map says) and written to the tensor at ``coords``
    (innermost first).

    It reads shared memory when it lands, which happens at some later scheduler step or
    at the ``cp.async.bulk.wait_group`` that covers it, whichever comes first.
    """

    src: int
    tmap: TensorMap
    coords: tuple[int, ...]
    landed: bool = False
    queued: tuple | None = None  # its entry in the CTA's async queue, until it lands


@dataclass
class ClusterBarrier:
    """``barrier.cluster``: every thread of the cluster arrives, then waits for the others.

    ``generation`` counts completed barriers; a thread that arrived during generation ``g``
    may pass its wait once ``generation > g``.
    """

    expected: int
    arrived: int = 0
    generation: int = 0

    def arrive(self, n: int) -> None:
        self.arrived += n
        if self.arrived == self.expected:
            self.generation += 1
            self.arrived = 0
