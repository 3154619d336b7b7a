"""Numpy model of the data layouts the generators rely on.

* :class:`BitMap` -- lane/thread index -> row or column, as a sum of bit fields.  The
  generators emit PTX from the *same* objects the model evaluates, so a wrong field
  here shows up as a wrong product in the simulation, not only on a GPU.
* swizzles: the XOR swizzle TMA writes and wgmma reads (``Swizzle<B,M,S>`` on byte
  addresses; 128B = ``Swizzle<3,4,3>``).
* the 64-bit shared-memory matrix descriptor of wgmma: :func:`encode_desc` /
  :func:`decode_desc`, :func:`wgmma_gather` -- which bytes a descriptor names for a
  K-major operand -- and :func:`wgmma_gather_mn`, the same for an MN-major one.
* fragment maps: ``mma.sync.m16n8k16`` A/B/C, ``ldmatrix`` (plain and ``.trans``),
  the wgmma ``m64nNk16`` accumulator and its A operand held in registers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# --------------------------------------------------------------------------------------
# bit-field maps


@dataclass(frozen=True)
class BitMap:
    """``f(x) = sum(((x >> shift) & mask) * mult for shift, mask, mult in terms)``."""

    terms: tuple[tuple[int, int, int], ...]

    def __call__(self, x):
        """Evaluate on an int or a numpy array."""
        return sum(((x >> s) & m) * k for s, m, k in self.terms)

    def emit(self, b, x):
        """Emit PTX computing ``f(x)`` for a u32 register ``x``; returns the register."""
        acc = None
        for s, m, k in self.terms:
            t = b.binop("shr", "u32", x, s) if s else x
            t = b.binop("and", "b32", t, m)
            if acc is None:
                acc = b.binop("mul.lo", "u32", t, k) if k != 1 else t
            else:
                acc = b.mad("u32", t, k, acc)
        return acc if acc is not None else b.mov("u32", 0)


# --------------------------------------------------------------------------------------
# swizzles


def swizzle(addr, bits: int, base: int = 4, shift: int = 3):
    """CUTLASS ``Swizzle<bits, base, shift>`` on byte addresses: bits [base, base+bits) ^= bits
    [base+shift, base+shift+bits).  128B = (3,4,3), 64B = (2,4,3), 32B = (1,4,3)."""
    if bits == 0:
        return addr
    mask = ((1 << bits) - 1) << (base + shift)
    return addr ^ ((addr & mask) >> shift)


SWIZZLE_BITS = {0: 0, 32: 1, 64: 2, 128: 3}
DESC_SWIZZLE_MODE = {0: 0, 128: 1, 64: 2, 32: 3}


def tma_store_box(box: np.ndarray, swizzle_bytes: int) -> np.ndarray:
    """Bytes TMA writes to shared memory for a 2-D ``box`` (rows x inner elements).

    Rows are ``inner * itemsize`` bytes apart (one row = the swizzle width here), and
    the 16-byte chunk of each row is XORed by the row's position in its 8-row atom.
    The destination is 1024-byte aligned, so the swizzle of relative and absolute
    addresses agree.
    """
    raw = np.ascontiguousarray(box).view(np.uint8).reshape(-1)
    out = np.zeros_like(raw)
    lin = np.arange(raw.size)
    out[swizzle(lin, SWIZZLE_BITS[swizzle_bytes])] = raw
    return out


# --------------------------------------------------------------------------------------
# wgmma shared-memory matrix descriptor


def encode_desc(start: int, lbo: int, sbo: int, swizzle_bytes: int, base_offset: int = 0) -> int:
    """The 64-bit wgmma matrix descriptor: start/LBO/SBO in 16-byte units, swizzle mode bits 62-63."""
    for name, v in (("start", start), ("lbo", lbo), ("sbo", sbo)):
        if v % 16 or not 0 <= v >> 4 < (1 << 14):
            raise ValueError(f"descriptor {name}={v} must be a multiple of 16 below 256 KiB")
    return (
        ((start >> 4) & 0x3FFF)
        | (((lbo >> 4) & 0x3FFF) << 16)
        | (((sbo >> 4) & 0x3FFF) << 32)
        | ((base_offset & 7) << 49)
        | (DESC_SWIZZLE_MODE[swizzle_bytes] << 62)
    )


def decode_desc(desc: int) -> dict:
    """Inverse of :func:`encode_desc` (byte values)."""
    mode = (desc >> 62) & 3
    sw = {v: k for k, v in DESC_SWIZZLE_MODE.items()}[mode]
    return {
        "start": (desc & 0x3FFF) << 4,
        "lbo": ((desc >> 16) & 0x3FFF) << 4,
        "sbo": ((desc >> 32) & 0x3FFF) << 4,
        "base_offset": (desc >> 49) & 7,
        "swizzle": sw,
    }


def wgmma_gather(smem: np.ndarray, desc: int, rows: int, k_bytes: int, dtype) -> np.ndarray:
    """The ``rows x k`` K-major operand a swizzled descriptor names in ``smem`` (a uint8 array).

    Row ``r`` of the operand starts at ``start + (r // 8) * SBO + (r % 8) * 128`` (an
    8-row atom of 128-byte rows); byte ``j`` of it sits at that address plus ``j``,
    then swizzled on the absolute address.  ``k_bytes`` is 32 for k16 bf16 and k32 fp8.
    """
    d = decode_desc(desc)
    if d["swizzle"] != 128:
        raise NotImplementedError("model covers the 128-byte swizzle the generators use")
    return smem[_k_major_index(d["start"], d["sbo"], rows, k_bytes)].view(dtype).reshape(rows, -1)


@functools.lru_cache(maxsize=256)  # read-only: the emulator gathers the same few tiles (stages x k-steps) again and again
def _k_major_index(start: int, sbo: int, rows: int, k_bytes: int) -> np.ndarray:
    """The swizzled byte addresses :func:`wgmma_gather` reads, ``[row, byte]``."""
    r = np.arange(rows)[:, None]
    j = np.arange(k_bytes)[None, :]
    idx = swizzle(start + (r // 8) * sbo + (r % 8) * 128 + j, 3)
    idx.flags.writeable = False
    return idx


def wgmma_gather_mn(smem: np.ndarray, desc: int, mn: int, k: int, dtype) -> np.ndarray:
    """The ``mn x k`` operand an MN-major 128B-swizzled descriptor names in ``smem`` (uint8).

    This is what ``wgmma`` reads for B when ``imm-trans-b = 1`` (or A with
    ``imm-trans-a = 1``).  The canonical layout (CUTLASS ``Swizzle<3,4,3> o
    ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))`` in 16-byte units) is a grid of swizzle
    atoms, each ``128 / itemsize`` MN-elements (one 128-byte row) x 8 K-rows = 1024
    bytes:

    * element ``(n, kk)`` sits at ``start + (n // W) * LBO + (kk // 8) * SBO +
      (kk % 8) * 128 + (n % W) * itemsize`` with ``W = 128 // itemsize`` (64 for
      16-bit types), then swizzled on the absolute address;
    * so for MN-major layouts **LBO** is the byte distance between atoms along MN
      and **SBO** the distance between 8-row groups along K (the reverse of what
      the names suggest for K-major, where SBO steps between 8-row MN groups).

    Returns the operand as rows ``n``, columns ``kk`` (i.e. B^T for B, so callers can
    use it like :func:`wgmma_gather`'s result).  ``k`` is in elements (16 for k16).
    """
    d = decode_desc(desc)
    if d["swizzle"] != 128:
        raise NotImplementedError("model covers the 128-byte swizzle the generators use")
    itemsize = np.dtype(dtype).itemsize
    return smem[_mn_major_index(d["start"], d["lbo"], d["sbo"], mn, k, itemsize)].view(dtype).reshape(mn, k)


@functools.lru_cache(maxsize=256)
def _mn_major_index(start: int, lbo: int, sbo: int, mn: int, k: int, itemsize: int) -> np.ndarray:
    """The swizzled byte addresses :func:`wgmma_gather_mn` reads, ``[n, kk, byte]``."""
    w = 128 // itemsize  # MN-elements per swizzle atom row
    n = np.arange(mn)[:, None, None]
    kk = np.arange(k)[None, :, None]
    byte = np.arange(itemsize)[None, None, :]
    idx = swizzle(start + (n // w) * lbo + (kk // 8) * sbo + (kk % 8) * 128 + (n % w) * itemsize + byte, 3)
    idx.flags.writeable = False
    return idx


# --------------------------------------------------------------------------------------
# fragment maps: thread/lane -> (row, col) of the elements it holds

# ldmatrix.x4 address lanes: lane l points at row (l % 8) of matrix l // 8.
LDM_A_ROW = BitMap(((0, 7, 1), (3, 1, 8)))  # A 16x16 at (r0, k0): matrices (r0-7,k0-7),(r8-15,k0-7),(r0-7,k8),(r8,k8)
LDM_A_COL = BitMap(((4, 1, 8),))
LDM_BK_ROW = BitMap(((0, 7, 1), (4, 1, 8)))  # K-major B (rows n): (n0-7,k0),(n0-7,k8),(n8-15,k0),(n8-15,k8)
LDM_BK_COL = BitMap(((3, 1, 8),))
LDM_BN_ROW = BitMap(((0, 7, 1), (3, 1, 8)))  # N-major B (rows k), .trans: (k0-7,n0),(k8-15,n0),(k0,n8),(k8,n8)
LDM_BN_COL = BitMap(((4, 1, 8),))

GROUP = BitMap(((2, 7, 1),))  # lane / 4
QUAD2 = BitMap(((0, 3, 2),))  # 2 * (lane % 4)


def ldmatrix(rows_of_lanes: list[np.ndarray], trans: bool = False) -> np.ndarray:
    """``ldmatrix.x4``: lane ``l`` supplied the 8-element row ``rows_of_lanes[l]``.

    Returns ``regs[lane, j, h]``: element ``h`` (0/1) of register ``j`` of each lane.
    Plain: lane t gets row t//4, cols 2*(t%4)+h of matrix j; ``.trans`` gets the
    transposed matrix, i.e. row 2*(t%4)+h, col t//4.
    """
    mats = np.stack([np.stack(rows_of_lanes[8 * j : 8 * j + 8]) for j in range(4)])  # (4, 8, 8)
    if trans:
        mats = mats.transpose(0, 2, 1)
    t = np.arange(32)
    out = np.empty((32, 4, 2), dtype=mats.dtype)
    for j in range(4):
        for h in range(2):
            out[:, j, h] = mats[j, t // 4, 2 * (t % 4) + h]
    return out


def mma_m16n8k16(a: np.ndarray, bfr: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``mma.sync.m16n8k16.row.col`` on fragments: a[32,4,2], b[32,2,2], c[32,4] -> d[32,4].

    A: reg j of lane t holds row g + 8*(j%2), k q + 8*(j//2) + h (g = t//4, q = 2*(t%4));
    B: reg j holds k q + 8*j + h, col g; C/D: reg j holds row g + 8*(j//2), col q + j%2.
    """
    t = np.arange(32)
    g, q = GROUP(t), QUAD2(t)
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    C = np.zeros((16, 8), np.float64)
    for j in range(4):
        for h in range(2):
            A[g + 8 * (j % 2), q + 8 * (j // 2) + h] = a[:, j, h]
    for j in range(2):
        for h in range(2):
            B[q + 8 * j + h, g] = bfr[:, j, h]
    for j in range(4):
        C[g + 8 * (j // 2), q + j % 2] = c[:, j]
    D = A @ B + C
    return np.stack([D[g + 8 * (j // 2), q + j % 2] for j in range(4)], axis=1)


@functools.lru_cache(maxsize=None)  # read-only views: safe to share
def wgmma_d_map(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Accumulator of ``wgmma m64nNk*`` f32: ``(row, col)[thread, reg]`` for 128 threads x N/2 regs.

    Warp w owns rows 16w..16w+15; within it the mma.sync C pattern repeats every 8 columns:
    reg i -> row 16w + t//4 + 8*((i//2)%2), col 8*(i//4) + 2*(t%4) + i%2.
    """
    th = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    lane = th % 32
    row = 16 * (th // 32) + GROUP(lane) + 8 * ((i // 2) % 2)
    col = 8 * (i // 4) + QUAD2(lane) + i % 2
    return np.broadcast_to(row, (128, n // 2)), np.broadcast_to(col, (128, n // 2))


@functools.lru_cache(maxsize=None)  # read-only views: safe to share
def wgmma_a_map() -> tuple[np.ndarray, np.ndarray]:
    """A of ``wgmma m64nNk16`` (16-bit types) from registers: ``(row, col)[thread, reg, half]``
    of the 64 x 16 tile for 128 threads x 4 ``.b32`` registers x 2 halves (low half first).

    Warp w holds rows 16w..16w+15 in the ``mma.sync.m16n8k16`` A pattern: with g = lane//4,
    q = lane%4, reg j holds row 16w + g + 8*(j%2), cols 8*(j//2) + 2q + half.
    """
    th = np.arange(128)[:, None, None]
    j = np.arange(4)[None, :, None]
    h = np.arange(2)[None, None, :]
    lane = th % 32
    row = 16 * (th // 32) + GROUP(lane) + 8 * (j % 2)
    col = 8 * (j // 2) + QUAD2(lane) + h
    return np.broadcast_to(row, (128, 4, 2)), np.broadcast_to(col, (128, 4, 2))
