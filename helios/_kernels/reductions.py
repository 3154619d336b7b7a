"""Reductions over any dims (sum, max/min and their indices, sum of squares), the clip's fused
sum of squares and coefficient, 1-d gathers and raw concatenation."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios._shape import collapse, numel
from helios.errors import ShapeError
from helios.tensor import Tensor
from helios._kernels.core import _elems_per_dispatch, bind, column_chunks, empty, grid, groups_for, narrow_view
import helios._kernels as kern  # the other kernel families (bound once the package has loaded)


REDUCE = {"sum": 0, "max": 1, "min": 2, "argmax": 3, "argmin": 4, "sumsq": 5}  # sumsq: sum of squares (floats)
_P_REDUCE = struct.Struct("<9If2I")
# Rows shorter than 256 on a CPU device are reduced an invocation a row (reduce.comp's MODE 2),
# this many rows a workgroup.  MODE 0 gives each row a workgroup whose shared-memory tree and
# barriers llvmpipe runs lane by lane.  On lavapipe (2 cores, replayed dispatches) a [512, 64]
# row sum took 2.09 ms that way and 0.32 ms in registers, a [16384, 2] one 11.9 and 1.8 ms,
# with the same bits; a LLaMA's RMSNorm is such a sum.
ROWS_PER_GROUP = 64


# -- reductions ------------------------------------------------------------------------------
def _value_dtype(x: Tensor) -> dt.DType:
    return dt.float32 if x.dtype.kind == "float" else dt.int64


def reduce(op: str, x: Tensor, dims: tuple, scale: float = 1.0, out: Tensor | None = None):
    """Reduce ``x`` over ``dims`` (sorted, unique).  Returns (values, indices or None) with
    the kept dims in order (no keepdim).  Values are float32 for float inputs (sums of
    16-bit floats accumulate in float32) and int64 for integer/bool inputs; indices int64.
    ``out`` (optional, a contiguous tensor of the values' shape and dtype; not for the arg
    reductions) receives the values, which are then returned as ``out``."""
    rt = x._st.rt
    kept = [d for d in range(x.ndim) if d not in dims]
    out_shape = tuple(x.shape[d] for d in kept)
    R = numel(tuple(x.shape[d] for d in dims))
    vdt = _value_dtype(x)
    arg = op in ("argmax", "argmin")
    n_out = numel(out_shape)
    if out is not None:
        if arg or out.shape != out_shape or out.dtype is not vdt or not out.is_contiguous():
            raise ShapeError(f"reduce: out must be a contiguous {vdt.name} tensor of shape {out_shape} "
                             f"(and op not an arg reduction), got {out.dtype.name} {out.shape}")
        if R == 0 or n_out == 0 or x._st.nbytes > rt.max_range or kern._too_wide(x):  # rare paths: reduce, then copy
            v, _ = reduce(op, x, dims, scale)
            kern.copy_into(out, v)
            return out, None
    if R == 0 or n_out == 0:
        if R == 0 and op != "sum" and n_out:
            raise ShapeError(f"{op}: cannot reduce over a dimension of size 0 (shape {x.shape}, dims {dims})")
        # an empty sum is 0, scaled like any other (a mean's scale 1/0 = nan gives nan, as PyTorch)
        vals = kern.fill(empty(out_shape, vdt, rt), 0.0 * scale if vdt.kind == "float" else 0)
        return vals, (kern.fill(empty(out_shape, dt.int64, rt), 0) if arg else None)
    if x._st.nbytes > rt.max_range and len(kept) == 0 and x.is_contiguous():
        return _reduce_all_windows(op, x, scale)
    if kern._too_wide(x):
        return _reduce_wide(op, x, dims, kept, out_shape, scale)
    # Describe the reduced dims as one axis (R, s_k) and the kept dims as <= 2 axes.
    kshape, (kstr,) = collapse(tuple(x.shape[d] for d in kept), tuple(x._strides[d] for d in kept))
    rshape, (rstr,) = collapse(tuple(x.shape[d] for d in dims), tuple(x._strides[d] for d in dims))
    if len(rshape) == 1 and (rstr[0] == 1 and len(kshape) <= 1):
        rows = kshape[0] if kshape else 1
        s_row = kstr[0] if kshape else 0
        return _reduce_rows(op, x, rows, R, s_row, rstr[0], x._off, out_shape, scale, out=out)
    if len(rshape) == 1 and len(kshape) <= 2 and (not kshape or rstr[0] != 1):
        outer, inner = (1, kshape[0]) if len(kshape) == 1 else ((kshape[0], kshape[1]) if kshape else (1, 1))
        s_row = kstr[0] if len(kshape) == 2 else 0
        s_in = kstr[-1] if kshape else 0
        return _reduce_cols(op, x, outer, R, inner, s_row, rstr[0], s_in, out_shape, scale, out)
    # General case: gather the reduced dims last in a contiguous copy, then reduce rows.
    xc = kern.copy(x.permute(*kept, *dims))
    return _reduce_rows(op, xc, n_out, R, R, 1, 0, out_shape, scale, out=out)


def rows_in_registers(rt, R: int) -> bool:
    """Whether rows of ``R`` elements are reduced an invocation a row (reduce.comp's MODE 2, the
    same bits as a workgroup a row): on CPU devices, for rows shorter than 256."""
    return R < 256 and rt.info["type"] == "cpu"


def _reduce_dest(out: Tensor | None, n: int, vdt: dt.DType, rt):
    """(values tensor of n elements, its binding, its element offset there) for a reduction:
    ``out`` flattened when given, else a new tensor."""
    vals = empty((n,), vdt, rt) if out is None else Tensor(out._st, (n,), (1,), out._off, vdt)
    bo, oo = bind(vals, True)
    return vals, bo, oo


def _reduce_rows(op, x, rows, R, s_row, s_k, off, out_shape, scale, idx_in=None, out=None, clip=None):
    rt = x._st.rt
    vdt = _value_dtype(x)
    arg = op in ("argmax", "argmin")
    nchunks = 1
    if R > 8192 and rows < 64:
        nchunks = min((R + 4095) // 4096, 1024)
    chunk = (R + nchunks - 1) // nchunks
    total = rows * nchunks
    final_clip = clip is not None and nchunks == 1  # this pass ends with the clip's scalar chain
    vals, bo, oo = _reduce_dest(out if nchunks == 1 else None, 2 if final_clip else total, vdt, rt)
    idx = empty((total,), dt.int64, rt) if arg else vals
    wg = 256 if R >= 256 else 64 if R >= 64 else 16
    in_registers = not final_clip and rows_in_registers(rt, R)  # (rows that short take one chunk)
    if in_registers:  # MODE 2: an invocation a row, the tree of a wg-wide workgroup replayed in its registers
        spec = (REDUCE[op], 2, ROWS_PER_GROUP, idx_in is not None, False, wg)
    else:
        spec = (REDUCE[op], 0, wg, idx_in is not None) + ((True,) if final_clip else ())
    pid = rt.pipeline("reduce", x.dtype.tag, spec)
    bx, ox = bind(x)
    bi, oi = bind(idx_in) if idx_in is not None else (bx, 0)
    final_scale = clip if final_clip else scale if nchunks == 1 else 1.0  # CLIP: max_norm in `scale`
    name = op
    if op == "sumsq" or final_clip:
        from helios import fused_kernels

        name = fused_kernels.dispatch_name(("sum_squares" if op == "sumsq" else "sum") + ("+clip_coef" if final_clip else ""), rt)
    rt.dispatch(pid, [bx, bi, bo, bind(idx, True)[0]],
                _P_REDUCE.pack(R, rows, 1, nchunks, chunk, ox + off - x._off, s_row, s_k, 0, final_scale, oi, oo),
                groups_for(-(-total // ROWS_PER_GROUP) if in_registers else total), name, rows * R, rows * R * x.dtype.itemsize)
    vals._st.version += int(out is not None and nchunks == 1)  # a write into the caller's tensor
    if nchunks > 1:  # the partials are summed as they are (already squared)
        second = {"argmax": "argmax", "argmin": "argmin", "sumsq": "sum"}.get(op, op)
        v2, i2 = _reduce_rows(second, vals, rows, nchunks, nchunks, 1, 0, out_shape, scale, idx if arg else None, out, clip)
        return v2, i2
    if final_clip:  # (norm, coef), two scalars of one buffer
        return Tensor(vals._st, (), (), vals._off, vdt), Tensor(vals._st, (), (), vals._off + 1, vdt)
    if out is not None:
        return out, None
    return vals.reshape(out_shape), (idx.reshape(out_shape) if arg else None)


def sum_squares_fits(x: Tensor) -> bool:
    """Whether sum_squares / clip_coef reduce ``x`` as reduce("sum") reduces a contiguous
    copy of it: a contiguous float tensor inside one binding window (the row path)."""
    return (x.dtype.kind == "float" and x.is_contiguous() and x.numel() > 0
            and x._st.nbytes <= x._st.rt.max_range and not kern._too_wide(x))


def sum_squares(x: Tensor) -> Tensor:
    """sum(x * x) over all of ``x`` (float32, shape ()) in one reduction, each square
    rounded to float32 before it is added (helios.fused_kernels "sum_squares"): bit for bit
    reduce("sum") of x * x.  ``x`` must pass sum_squares_fits."""
    if not sum_squares_fits(x):
        raise ShapeError(f"sum_squares: x must be a contiguous float tensor in one binding window, got {x.dtype.name} "
                         f"{x.shape} with strides {x._strides}")
    return _reduce_rows("sumsq", x, 1, x.numel(), 0, 1, x._off, (), 1.0)[0]


def clip_coef(x: Tensor, max_norm: float, square: bool = True) -> tuple:
    """(norm, coef) of the gradient clip over ``x`` in one reduction (two when x is long):
    norm = sqrt(sum(x * x)) (``square`` False: of sum(x), x already a sum of squares) and
    coef = clamp(max_norm / (norm + 1e-6), max=1), both float32 scalars on the device, bit
    for bit the separate sqrt, add_s, rdiv_s and clamp (helios.fused_kernels "clip_coef").  ``x``
    must pass sum_squares_fits."""
    if not sum_squares_fits(x):
        raise ShapeError(f"clip_coef: x must be a contiguous float tensor in one binding window, got {x.dtype.name} "
                         f"{x.shape} with strides {x._strides}")
    return _reduce_rows("sumsq" if square else "sum", x, 1, x.numel(), 0, 1, x._off, (), 1.0, clip=float(max_norm))


def _reduce_cols(op, x, outer, R, inner, s_row, s_k, s_in, out_shape, scale, out=None, idx_in=None):
    """Reduce element (o, k, i) at s_row*o + s_k*k + s_in*i over k, an invocation per output
    (o, i); on GPUs long columns go in runs (:func:`column_chunks`) whose [runs, n] partials a
    second pass reduces in order (``idx_in``: the partials' arg indices)."""
    rt = x._st.rt
    vdt = _value_dtype(x)
    arg = op in ("argmax", "argmin")
    n = outer * inner
    runs, per_run = column_chunks(rt, R, n)
    vals, bo, oo = _reduce_dest(out if runs == 1 else None, runs * n, vdt, rt)
    idx = empty((runs * n,), dt.int64, rt) if arg else vals
    pid = rt.pipeline("reduce", x.dtype.tag, (REDUCE[op], 1, 256, idx_in is not None))
    bx, ox = bind(x)
    bi, oi = bind(idx_in) if idx_in is not None else (bx, 0)
    rt.dispatch(pid, [bx, bi, bo, bind(idx, True)[0]],
                _P_REDUCE.pack(R, outer, inner, runs, per_run, ox, s_row, s_k, s_in, scale if runs == 1 else 1.0, oi, oo),
                grid(runs * n), op, n * R, n * R * x.dtype.itemsize)
    if runs > 1:  # the partials are reduced as they are (already squared)
        second = {"sumsq": "sum"}.get(op, op)
        return _reduce_cols(second, vals, 1, runs, n, 0, n, 1, out_shape, scale, out, idx if arg else None)
    if out is not None:
        out._st.version += 1
        return out, None
    return vals.reshape(out_shape), (idx.reshape(out_shape) if arg else None)


def _reduce_wide(op, x, dims, kept, out_shape, scale):
    """Reduce a tensor that spans more than one binding window: a full reduction goes by
    windows over a contiguous copy; otherwise the kept dim that spans the most is halved,
    the halves reduced, and the results joined."""
    if all(x.shape[k] == 1 for k in kept):
        v, i = _reduce_all_windows(op, x if x.is_contiguous() else kern.copy(x), scale)
        return v.reshape(out_shape), (i.reshape(out_shape) if i is not None else None)
    d = max((k for k in kept if x.shape[k] > 1), key=lambda k: (x.shape[k] - 1) * abs(x._strides[k]))
    h = x.shape[d] // 2
    res = [reduce(op, narrow_view(x, d, s, n), dims, scale) for s, n in ((0, h), (h, x.shape[d] - h))]
    j = kept.index(d)
    return cat_raw([r[0] for r in res], j), (cat_raw([r[1] for r in res], j) if res[0][1] is not None else None)


def _reduce_all_windows(op, x, scale):
    """Full reduction of a contiguous tensor larger than one binding window."""
    n = x.numel()
    step = _elems_per_dispatch(x)
    parts_v, parts_i = [], []
    for s in range(0, n, step):
        m = min(step, n - s)
        v, i = _reduce_rows(op, Tensor(x._st, (m,), (1,), x._off + s, x.dtype), 1, m, m, 1, x._off + s, (), 1.0)
        parts_v.append(v.reshape((1,)))
        if i is not None:
            parts_i.append(i.reshape((1,)) + s)
    vals = cat_raw(parts_v, 0)
    if op in ("argmax", "argmin"):
        idx_all = cat_raw(parts_i, 0)
        v, j = _reduce_rows(op, vals, 1, len(parts_v), len(parts_v), 1, 0, (), 1.0)
        return v, gather_1d(idx_all, j)
    v, _ = _reduce_rows(op, vals, 1, len(parts_v), len(parts_v), 1, 0, (), scale)
    return v, None


def gather_1d(src: Tensor, index: Tensor) -> Tensor:
    """src[index] for a 1-D src and a 0-d int64 index (host read; used on tiny partials)."""
    i = int(index.item())
    return Tensor(src._st, (), (), src._off + i, src.dtype).contiguous()


def cat_raw(parts: list, dim: int) -> Tensor:
    """Concatenate same-dtype tensors along ``dim`` into a new tensor."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = empty(tuple(shape), parts[0].dtype, parts[0]._st.rt)
    pos = 0
    for p in parts:
        k = p.shape[dim]
        if k:
            kern.copy_into(out.narrow(dim, pos, k), p)
        pos += k
    return out
