"""How a GEMM's operands are laid out for a kernel: padding, B's storage order, TMA boxes.

Shared by the GPU runner and the CPU emulator so both hand a kernel exactly the
same bytes and tensor maps.  Nothing here needs a driver.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helios.errors import ShapeError

from . import dtypes
from .config import IN_DTYPES, OUT_DTYPES, GemmConfig


@dataclass(frozen=True)
class Padded:
    """Problem extents rounded up to the kernel's tile multiples."""

    m: int
    n: int
    k: int


@dataclass(frozen=True)
class TmaBox:
    """A TMA tensor map over a row-major ``rows x cols`` matrix (``cols`` contiguous).

    ``operand`` is ``"a"``, ``"b"`` or ``"c"``; the box copied per TMA instruction is
    ``box_rows x box_cols`` elements, 128-byte swizzled (``box_cols * itemsize == 128``).
    ``batch`` > 0 (a batched kernel): the map has that many more dimensions outside the
    matrix's two, the batch dimensions, whose box extent is 1 (one matrix per copy); their
    extents and strides are the caller's (see :meth:`box`).
    """

    operand: str
    rows: int
    cols: int
    box_rows: int
    box_cols: int
    dtype: str = "bf16"  # element type: an input dtype, or "f32"/"bf16" for C
    batch: int = 0

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return OUT_DTYPES[self.dtype] if self.dtype in OUT_DTYPES else IN_DTYPES[self.dtype][0]

    def box(self) -> tuple[int, ...]:
        """The box extents innermost first, as ``Context.tensor_map_nd`` takes them: the matrix's
        ``box_cols, box_rows``, then 1 for each batch dimension."""
        return (self.box_cols, self.box_rows) + (1,) * self.batch


def matmul_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``a @ b`` for 2-D ``a`` (M x K) and ``b`` (K x N); :class:`ShapeError` otherwise."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ShapeError(f"gemm expects (M, K) @ (K, N); got {a.shape} @ {b.shape}")
    return a.shape[0], b.shape[1], a.shape[1]


def round_up(v: int, m: int) -> int:
    """``v`` rounded up to a multiple of ``m`` (at least ``m``)."""
    return max(m, (v + m - 1) // m * m)


def padded(cfg: GemmConfig, m: int, n: int, k: int) -> Padded:
    """The extents the kernel runs on: each a multiple of its tile (M of a cluster's
    ``cluster x bm`` rows, since the CTAs of a cluster take vertically adjacent tiles).

    :class:`ShapeError` for a problem the kernel cannot address (:func:`check_extents`).
    """
    p = Padded(round_up(m, cfg.bm * cfg.cluster), round_up(n, cfg.bn), round_up(k, cfg.bk))
    check_extents(cfg, p)
    return p


def check_extents(cfg: GemmConfig, p: Padded) -> None:
    """Refuse extents past what the kernels' index arithmetic holds.

    Extents travel as 32-bit parameters and TMA coordinates are signed 32-bit, so each
    must stay below 2^31.  The kernels compute element offsets in 32 bits before widening
    them to byte addresses, so a matrix they address that way must have fewer than 2^32
    elements: A, B and C for simt and mma_sync, C for wgmma kernels that store with
    ``st.global`` (TMA moves A and B, and C with ``tma_store``, by coordinates).
    """
    if max(p.m, p.n, p.k) >= 1 << 31:
        raise ShapeError(f"gemm extents (M, N, K) = {(p.m, p.n, p.k)} padded: each must be below 2^31")
    if cfg.kind != "wgmma":
        offset_indexed = {"A": (p.m, p.k), "B": (p.k, p.n), "C": (p.m, p.n)}
    else:
        offset_indexed = {} if cfg.tma_store else {"C": (p.m, p.n)}
    for name, (rows, cols) in offset_indexed.items():
        if rows * cols >= 1 << 32:
            hint = " (a wgmma config with tma_store=True writes C by coordinates)" if name == "C" else ""
            raise ShapeError(f"{cfg.name}: {name} would have {rows} x {cols} = {rows * cols} elements after padding; "
                             f"the kernel's 32-bit element offsets reach 2^32{hint}")


def grid(cfg: GemmConfig, p: Padded, sm_count: int, clusters: int | None = None, batch: int = 1) -> tuple[int, int]:
    """CTAs to launch, ``(x, y)``: one per tile of C (x along N), or for a persistent
    kernel one per SM, never more than there are tiles (each CTA takes at least one;
    a batched kernel has ``batch`` products' tiles: ``batch`` is the product of its extents).

    Cluster kernels (``cfg.cluster > 1``) get a 1-D grid in whole clusters: one cluster
    per ``cluster x 1`` block of tiles, or for a persistent kernel ``clusters`` of them
    (how many can be resident at once; by default ``sm_count // cluster``).
    """
    tiles_n, tiles_m = p.n // cfg.bn, p.m // cfg.bm
    if cfg.persistent and sm_count < 1:
        raise ValueError(f"a persistent kernel needs sm_count >= 1, got {sm_count}")
    if cfg.cluster > 1:
        if tiles_m % cfg.cluster:
            raise ShapeError(f"M={p.m} is not a whole number of {cfg.cluster} x {cfg.bm}-row blocks: pad it with "
                             "operands.padded(), which rounds M to the cluster's rows")
        blocks = tiles_n * (tiles_m // cfg.cluster)
        if cfg.persistent:
            resident = clusters if clusters is not None else sm_count // cfg.cluster
            if resident < 1:
                raise ValueError(f"a persistent cluster kernel needs room for one cluster of {cfg.cluster} CTAs, "
                                 f"got {resident} resident clusters")
            blocks = min(blocks, resident)
        return blocks * cfg.cluster, 1
    if cfg.persistent:
        return min(tiles_n * tiles_m * batch, sm_count), 1
    return tiles_n, tiles_m


def pad_to(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``x`` zero-padded to ``rows x cols`` (zero rows/columns leave the product unchanged)."""
    if x.shape == (rows, cols):
        return np.ascontiguousarray(x)
    out = np.zeros((rows, cols), x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def encode_operands(cfg: GemmConfig, a: np.ndarray, b: np.ndarray, p: Padded) -> tuple[np.ndarray, np.ndarray]:
    """A (``M x K``) and B (``K x N``, as floats) encoded to the input dtype's bits and padded.

    A is row-major ``M x K``, stored transposed (``K x M``) for ``a_major="m"``; B is ``K x N`` row-major for ``b_major="n"`` and stored
    transposed (``N x K``) for ``b_major="k"``.
    """
    ra = dtypes.encode(a, cfg.in_dtype)
    ra = pad_to(np.ascontiguousarray(ra.T), p.k, p.m) if cfg.a_major == "m" else pad_to(ra, p.m, p.k)
    rb = dtypes.encode(b, cfg.in_dtype)
    if cfg.b_major == "n":
        rb = pad_to(rb, p.k, p.n)
    else:
        rb = pad_to(np.ascontiguousarray(rb.T), p.n, p.k)
    return ra, rb


def tma_boxes(cfg: GemmConfig, p: Padded) -> list[TmaBox]:
    """The tensor maps a wgmma kernel takes, in parameter order (empty for other kinds).

    A is ``M x K`` with a ``bm x bk`` box, or for ``a_major="m"`` stored ``K x M`` with ``bk x 64``
    boxes (``bm / 64`` per k-tile, copied side by side).  B stored ``N x K`` (``b_major="k"``) has one
    ``bn x bk`` box per k-tile (``bn / cluster`` rows in a cluster kernel, where each CTA
    copies its share); B stored ``K x N`` (``b_major="n"``, 16-bit types) has ``bk x 64``
    boxes (64 N-columns = the 128-byte swizzle width), ``bn / 64`` of them per k-tile
    (``bn / 64 / cluster`` copied by each CTA of a cluster), which the kernel copies side
    by side and reads N-major.  With
    ``tma_store``, C (``M x N``, the output dtype) follows, stored in boxes of 64 rows x
    128 bytes.  A batched config's maps each have its ``batched`` batch dimensions too.
    """
    if cfg.kind != "wgmma":
        return []
    d = cfg.in_dtype
    nb = cfg.batched
    if cfg.a_major == "m":  # A stored K x M: bk x 64 boxes, bm / 64 of them per k-tile
        a = TmaBox("a", p.k, p.m, cfg.bk, 128 // cfg.in_bytes, d, nb)
    else:
        a = TmaBox("a", p.m, p.k, cfg.bm, cfg.bk, d, nb)
    if cfg.b_major == "k":  # a cluster's CTAs each load (and multicast) bn / cluster rows
        b = TmaBox("b", p.n, p.k, cfg.bn // cfg.cluster, cfg.bk, d, nb)
    else:
        b = TmaBox("b", p.k, p.n, cfg.bk, 128 // cfg.in_bytes, d, nb)
    if not cfg.tma_store:
        return [a, b]
    return [a, b, TmaBox("c", p.m, p.n, 64, 128 // OUT_DTYPES[cfg.out_dtype], cfg.out_dtype, nb)]
