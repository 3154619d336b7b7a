"""Sorting, scans, gathers and scatters along a dim."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios._shape import numel
from helios.errors import ShapeError
from helios.tensor import Tensor
from helios._kernels.core import _pad, bind, empty, grid, groups_for, loop_run, workgroup_for_run
import helios._kernels as kern  # the other kernel families (bound once the package has loaded)


# -- sorting, scans, gathers and scatters ----------------------------------------------------------
_P_SORT = struct.Struct("<6I")
_P_SCAN = struct.Struct("<4I")
_P_GATHER = struct.Struct("<6I6i6i6i")
_P_SCATTER = struct.Struct("<7I")
_SORT_BLOCK = 512  # elements a workgroup sorts in shared memory (sort.comp)


def sort_rows(x: Tensor, descending: bool = False):
    """Stable sort of each row of the contiguous 2-D ``x`` [rows, n] (see sort.comp).

    Returns (values [rows, n] in x's dtype, positions [rows, n] int32), both views of the
    padded working buffers (row stride P, the next power of two >= n)."""
    rt = x._st.rt
    rows, n = x.shape
    P = 1
    while P < n:
        P <<= 1
    total = rows * P
    keys = empty((rows, P), x.dtype, rt)
    pos = empty((rows, P), dt.int32, rt)
    if rows * n == 0:
        return keys[:, :n] if n else keys, pos[:, :n] if n else pos
    bk, bp, (bx, ox) = bind(keys, True)[0], bind(pos, True)[0], bind(x)
    blocks = groups_for((total + _SORT_BLOCK - 1) // _SORT_BLOCK)
    tag = x.dtype.tag
    nbytes = total * (x.dtype.itemsize + 4)
    rt.dispatch(rt.pipeline("sort", tag, (0, descending)), [bk, bp, bx], _P_SORT.pack(total, P, n, 0, 0, ox), blocks,
                "sort", 0, nbytes)
    k = 2 * _SORT_BLOCK
    while k <= P:
        j = k // 2
        while j >= _SORT_BLOCK:
            rt.dispatch(rt.pipeline("sort", tag, (1, descending)), [bk, bp, bx], _P_SORT.pack(total, P, n, k, j, ox),
                        groups_for((total // 2 + 255) // 256), "sort", 0, nbytes)
            j //= 2
        rt.dispatch(rt.pipeline("sort", tag, (2, descending)), [bk, bp, bx], _P_SORT.pack(total, P, n, k, 0, ox), blocks,
                    "sort", 0, nbytes)
        k *= 2
    keys._st.version += 1
    pos._st.version += 1
    view = (rows, n), (P, 1)
    return Tensor(keys._st, *view, 0, x.dtype), Tensor(pos._st, *view, 0, dt.int32)


_SCAN_OUT = {"float32": dt.float32, "float16": dt.float16, "bfloat16": dt.bfloat16}


def scan(op: str, x: Tensor, dim: int, reverse: bool = False) -> Tensor:
    """Inclusive cumsum ("sum") or cumprod ("prod") of ``x`` along ``dim`` (see scan.comp).
    Float inputs keep their dtype; integer and bool inputs give int64."""
    rt = x._st.rt
    if not x.is_contiguous():
        x = kern.copy(x)
    out = empty(x.shape, _SCAN_OUT.get(x.dtype.name, dt.int64), rt)
    if out.numel() == 0:
        return out
    n = x.shape[dim]
    inner = numel(x.shape[dim + 1:])
    rows = out.numel() // n
    cap = loop_run(rt)  # an invocation a row walks all n of it
    per_thread = (rows >= 64 or n <= 64) and (cap is None or n <= cap)
    # a workgroup a row: each invocation walks its share twice, the first its WG partials once
    wg = 64 if per_thread else workgroup_for_run(rt, n, 256, 2, "cum" + op)
    groups = groups_for((rows + wg - 1) // wg) if per_thread else groups_for(rows)
    bx, ox = bind(x)
    pid = rt.pipeline("scan", x.dtype.tag, ({"sum": 0, "prod": 1}[op], reverse, wg, per_thread))
    rt.dispatch(pid, [bx, bind(out, True)[0]], _P_SCAN.pack(n, rows, inner, ox), groups, "cum" + op, out.numel(),
                out.numel() * (x.dtype.itemsize + out.dtype.itemsize))
    return out


def gather(x: Tensor, dim: int, index: Tensor, positions: bool = False) -> Tensor:
    """torch.gather on the device: out[i] = x[..., index[i], ...] along ``dim`` (int64
    ``index`` of x's ndim, any strides; negative indices count from the end).  With
    ``positions`` the result is instead each element's int64 position in ``x`` (strides
    and offset included): the destinations of a scatter."""
    rt = index._st.rt
    out = empty(index.shape, dt.int64 if positions else x.dtype, rt)
    n = out.numel()
    if n == 0:
        return out
    nd = index.ndim
    if nd > 6:
        raise ShapeError(f"gather: at most 6 dims are supported, got {nd}")
    shape, sx, si = index.shape or (1,), x._strides or (0,), index._strides or (0,)
    bi, oi = bind(index)
    if positions:
        bx, ox = bi, x._off
        pid = rt.pipeline("gather", "i64", (1,))
    else:
        bx, ox = bind(x)
        pid = rt.pipeline("gather", x.dtype.tag, (0,))
    rt.dispatch(pid, [bx, bi, bind(out, True)[0]],
                _P_GATHER.pack(n, max(nd, 1), dim, ox, oi, x.shape[dim] if x.ndim else 1, *_pad(shape), *_pad(sx), *_pad(si)),
                grid(n), "gather", 0, n * (out.dtype.itemsize + 8))
    return out


def scatter_rows(out: Tensor, keys: Tensor, order: Tensor, src: Tensor, mode: str) -> None:
    """out[keys[s], :] (+)= src[order[s], :] in place (see scatter.comp): ``out`` [nrows, C]
    and ``src`` [M, C] contiguous, ``keys`` int64 [M] sorted stably, ``order`` int32 [M]."""
    rt = out._st.rt
    M = keys.numel()
    C = out.shape[1]
    if M == 0 or C == 0 or out.shape[0] == 0:
        return
    gy = (M + 3) // 4
    gz = (gy + 65534) // 65535
    gy = min(gy, 65535)
    (bo, oo), (bk, ok), (br, orr), (bs, os_) = bind(out, True), bind(keys), bind(order), bind(src)
    pid = rt.pipeline("scatter", out.dtype.tag, ({"add": 0, "replace": 1}[mode],))
    rt.dispatch(pid, [bk, br, bs, bo], _P_SCATTER.pack(C, M, out.shape[0], os_, oo, ok, orr), ((C + 63) // 64, gy, gz),
                "scatter_" + mode, M * C, 2 * M * C * out.dtype.itemsize)
    out._st.version += 1
