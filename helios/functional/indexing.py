"""Index-driven ops: gather/scatter/index_add, sort/argsort/topk, cumsum/cumprod,
flip/roll/repeat/tile/repeat_interleave, multinomial."""

from __future__ import annotations

import builtins
import math
from collections import namedtuple

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios._shape import norm_dim, numel
from helios.autograd.tape import Function, is_grad_enabled
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


# -- gather, scatter, index_add --------------------------------------------------------------------
SortResult = namedtuple("SortResult", ["values", "indices"])
TopKResult = namedtuple("TopKResult", ["values", "indices"])


def _host_ready(t: Tensor):
    """The host copy of ``t``'s values when it has a current one (uploaded, unchanged), else None."""
    h = t._host
    if h is not None and h[0] == t._st.version and h[1].size == t.numel():
        return h[1]
    return None


def _index_tensor(index, like: Tensor, op: str) -> Tensor:
    """``index`` as an int64 tensor on like's device (lists and arrays are uploaded)."""
    if not isinstance(index, Tensor):
        index = K.from_numpy(np.asarray(index, dtype=np.int64), dt.int64, like._st.rt)
    if index.dtype.kind != "int":
        raise DTypeError(f"{op}: the index must be int32 or int64, got {index.dtype.name}")
    return index if index.dtype is dt.int64 else K.copy(index, dt.int64)


def _check_range(index: Tensor, n: int, op: str, dim: int, allow_negative: bool = True) -> None:
    """An IndexError for an index out of [-n, n) (or [0, n)), where its values are on the host
    (an uploaded index); indices computed on the device are clamped by the kernels instead."""
    h = _host_ready(index)
    if h is None or not h.size:
        return
    lo = -n if allow_negative else 0
    bad = h[(h < lo) | (h >= n)]
    if bad.size:
        raise IndexError(f"{op}: index {int(bad.reshape(-1)[0])} is out of bounds for dim {dim} with size {n}")


def _check_gather_shapes(op: str, x: Tensor, d: int, index: Tensor, src: Tensor | None = None) -> None:
    if index.ndim != x.ndim and not (index.ndim <= 1 and x.ndim <= 1):
        raise ShapeError(f"{op}: index has {index.ndim} dims, input has {x.ndim}; they must have the same number of dims")
    for i in range(index.ndim):
        if i != d and x.ndim and index.shape[i] > x.shape[i]:
            raise ShapeError(f"{op}: index shape {index.shape} is larger than input shape {x.shape} at dim {i}")
        if src is not None and src.ndim and index.shape[i] > src.shape[i]:
            raise ShapeError(f"{op}: index shape {index.shape} is larger than src shape {src.shape} at dim {i}")


def _as_nd(t: Tensor, nd: int) -> Tensor:
    return F.reshape(t, (1,) * nd) if t.ndim < nd else t


class _Gather(Function):
    @staticmethod
    def forward(ctx, x, d, index):
        ctx.save_for_backward(index)
        ctx.d, ctx.shape = d, x.shape
        return K.gather(x, d, index)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        zeros = K.fill(K.empty(ctx.shape, g.dtype, g._st.rt), 0)
        return _scatter_raw(zeros, ctx.d, index, g, "add"), None, None


def gather(x: Tensor, dim: int, index, *, sparse_grad: bool = False) -> Tensor:
    """torch.gather: ``out[i][j][k] = x[index[i][j][k]][j][k]`` for dim 0 (and so on): ``index``
    is an integer tensor with x's number of dims, no larger than x outside ``dim``; negative
    indices count from the end.  Differentiable in x (the gradient is a scatter-add)."""
    F._check_tensor(x, "gather")
    index = _index_tensor(index, x, "gather")
    d = norm_dim(dim, x.ndim, "gather")
    _check_gather_shapes("gather", x, d, index)
    n = x.shape[d] if x.ndim else 1
    if index.numel() and n == 0:
        raise IndexError(f"gather: index out of range for dim {d} of size 0")
    _check_range(index, n, "gather", d)
    nd = builtins.max(x.ndim, index.ndim, 1)
    out = _Gather.apply(_as_nd(x, nd), d, _as_nd(index, nd))
    return F.reshape(out, index.shape)


def _scatter_raw(base: Tensor, d: int, index: Tensor, src, mode: str) -> Tensor:
    """A new contiguous tensor: ``base`` with src's elements written (``mode`` "replace") or
    added ("add") at the positions ``index`` names along ``d`` (no autograd).  Duplicate
    destinations combine in the sources' order: deterministic, no atomics."""
    out = K.copy(base)
    M = index.numel()
    if M == 0 or out.numel() == 0:
        return out
    pos = K.gather(out, d, index, positions=True)  # int64 destinations, in index's shape
    if isinstance(src, Tensor):
        sv = src
        if sv.shape != index.shape:
            shape, strides, off = F._basic_index(sv, tuple(slice(0, s) for s in index.shape))
            sv = Tensor(sv._st, shape, strides, off, sv.dtype)
        sv = K.copy(sv, out.dtype)
    else:
        sv = K.fill(K.empty(index.shape, out.dtype, out._st.rt), src)
    keys, order = K.sort_rows(F.reshape(pos, (1, M)))
    keys = Tensor(keys._st, (M,), (1,), 0, dt.int64)
    order = Tensor(order._st, (M,), (1,), 0, dt.int32)
    K.scatter_rows(Tensor(out._st, (out.numel(), 1), (1, 1), 0, out.dtype), keys, order,
                   Tensor(sv._st, (M, 1), (1, 1), sv._off, sv.dtype), mode)
    return out


class _Scatter(Function):
    """scatter (mode "replace") and scatter_add ("add"); ``src`` is a tensor or a number."""

    @staticmethod
    def forward(ctx, x, d, index, src, mode):
        ctx.save_for_backward(index)
        ctx.d, ctx.mode, ctx.src_shape = d, mode, src.shape if isinstance(src, Tensor) else None
        return _scatter_raw(x, d, index, src, mode)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        gx = gs = None
        if ctx.needs_input_grad[0]:
            gx = g if ctx.mode == "add" else _scatter_raw(g, ctx.d, index, 0, "replace")
        if ctx.src_shape is not None and ctx.needs_input_grad[3]:
            picked = K.gather(g, ctx.d, index)
            if picked.shape != ctx.src_shape:  # src was larger than the index: zeros elsewhere
                gs = K.fill(K.empty(ctx.src_shape, g.dtype, g._st.rt), 0)
                shape, strides, off = F._basic_index(gs, tuple(slice(0, s) for s in index.shape))
                K.copy_into(Tensor(gs._st, shape, strides, off, g.dtype), picked)
            else:
                gs = picked
        return gx, None, None, gs, None


def _scatter_args(op: str, x: Tensor, dim, index, src, value):
    F._check_tensor(x, op)
    if src is not None and value is not None:
        raise TypeError(f"{op}: give src or value, not both")
    if src is None:
        src = value
    if src is None:
        raise TypeError(f"{op}: missing the values to write (src or value)")
    index = _index_tensor(index, x, op)
    d = norm_dim(dim, x.ndim, op)
    if isinstance(src, Tensor):
        if src.dtype is not x.dtype:
            raise DTypeError(f"{op}: src ({src.dtype.name}) must have the input's dtype ({x.dtype.name})")
        if src.ndim != index.ndim and index.numel():
            raise ShapeError(f"{op}: index has {index.ndim} dims, src has {src.ndim}; they must have the same number of dims")
    elif not isinstance(src, F.Number):
        raise TypeError(f"{op}: src must be a tensor or a number, got {type(src).__name__}")
    _check_gather_shapes(op, x, d, index, src if isinstance(src, Tensor) else None)
    _check_range(index, x.shape[d] if x.ndim else 1, op, d)
    return d, index, src


def _scatter_op(op: str, mode: str, x: Tensor, d: int, index: Tensor, src) -> Tensor:
    if index.numel() == 0:
        return F.clone(x)
    nd = builtins.max(x.ndim, 1)
    xs, ix = _as_nd(x, nd), _as_nd(index, nd)
    ss = _as_nd(src, nd) if isinstance(src, Tensor) else src
    return F.reshape(_Scatter.apply(xs, d, ix, ss, mode), x.shape)


def scatter(x: Tensor, dim: int, index, src=None, value=None, *, reduce: str | None = None) -> Tensor:
    """torch.scatter: a copy of ``x`` with ``src``'s elements (a tensor, or one number) written at
    the positions ``index`` names along ``dim`` (``x[index[i][j]][j] = src[i][j]`` for dim 0);
    where an index repeats, the last write wins.  ``reduce="add"`` is scatter_add.
    Differentiable in x and src."""
    d, index, src = _scatter_args("scatter", x, dim, index, src, value)
    if reduce is not None:
        if reduce != "add":
            raise ValueError(f"scatter: reduce must be None or 'add', got {reduce!r} (use scatter_reduce semantics elsewhere)")
        return _scatter_op("scatter", "add", x, d, index, src)
    return _scatter_op("scatter", "replace", x, d, index, src)


def scatter_add(x: Tensor, dim: int, index, src: Tensor) -> Tensor:
    """torch.scatter_add: a copy of ``x`` with src's elements added at the positions ``index``
    names along ``dim``; repeated indices accumulate, in a fixed order (deterministic)."""
    d, index, src = _scatter_args("scatter_add", x, dim, index, src, None)
    if not isinstance(src, Tensor):
        raise TypeError("scatter_add: src must be a tensor")
    return _scatter_op("scatter_add", "add", x, d, index, src)


def scatter_(x: Tensor, dim: int, index, src=None, value=None, *, reduce: str | None = None) -> Tensor:
    """In-place :func:`scatter`."""
    recorded = F._check_inplace(x, "scatter_", src, value)
    return F.finish_inplace(x, scatter(x, dim, index, src, value, reduce=reduce), recorded)


def scatter_add_(x: Tensor, dim: int, index, src: Tensor) -> Tensor:
    """In-place :func:`scatter_add`."""
    recorded = F._check_inplace(x, "scatter_add_", src)
    return F.finish_inplace(x, scatter_add(x, dim, index, src), recorded)


class _IndexAdd(Function):
    @staticmethod
    def forward(ctx, x, d, index, source, alpha):
        ctx.save_for_backward(index)
        ctx.d, ctx.alpha = d, alpha
        xt = F.movedim_front(x, d)
        out = K.copy(xt)
        L, C = index.numel(), numel(xt.shape[1:])
        if L and C and out.shape[0]:
            src = K.copy(F.movedim_front(source, d))
            if alpha != 1 and src.dtype is dt.bool_:
                src = K.fill(src, False) if not alpha else src  # bool: alpha False adds nothing
            elif alpha != 1:
                src = K.unary("mul_s", src, float(alpha))
            wrapped = K.where(K.binary("lt", index, F.scalar_tensor(0, dt.int64, index._st.rt)),
                              K.unary("add_s", index, float(out.shape[0])), index)
            keys, order = K.sort_rows(F.reshape(F.contiguous(wrapped), (1, L)))
            K.scatter_rows(Tensor(out._st, (out.shape[0], C), (C, 1), 0, out.dtype), Tensor(keys._st, (L,), (1,), 0, dt.int64),
                           Tensor(order._st, (L,), (1,), 0, dt.int32), Tensor(src._st, (L, C), (C, 1), 0, src.dtype), "add")
        if d == 0:
            return out
        inv = list(range(1, d + 1)) + [0] + list(range(d + 1, x.ndim))
        return K.copy(Tensor(out._st, x.shape, tuple(out._strides[i] for i in inv), 0, out.dtype))

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        gs = None
        if ctx.needs_input_grad[3]:
            gs = F._gather(g, ctx.d, index)
            if ctx.alpha != 1:
                gs = gs * ctx.alpha
        return (g if ctx.needs_input_grad[0] else None), None, None, gs, None


def index_add(x: Tensor, dim: int, index, source: Tensor, *, alpha=1) -> Tensor:
    """torch.index_add: a copy of ``x`` with ``alpha * source`` added along ``dim`` at the rows
    a 1-D integer ``index`` names (``out[index[i]] += alpha * source[i]`` for dim 0); repeated
    indices accumulate in a fixed order.  Differentiable in x and source."""
    F._check_tensor(x, "index_add"), F._check_tensor(source, "index_add")
    index = _index_tensor(index, x, "index_add")
    if index.ndim > 1:
        raise ShapeError(f"index_add: the index must be 0-d or 1-D, got shape {index.shape}")
    d = norm_dim(dim, x.ndim, "index_add")
    if source.dtype is not x.dtype:
        raise DTypeError(f"index_add: source ({source.dtype.name}) must have the input's dtype ({x.dtype.name})")
    nd = builtins.max(x.ndim, 1)
    xs, ss = _as_nd(x, nd), _as_nd(source, nd)
    want = tuple(index.numel() if i == d else s for i, s in enumerate(xs.shape))
    if ss.shape != want:
        raise ShapeError(f"index_add: source must have shape {want} (the input's, with dim {d} the index's length), got {source.shape}")
    _check_range(index, xs.shape[d], "index_add", d)
    return F.reshape(_IndexAdd.apply(xs, d, F.reshape(index, (index.numel(),)), ss, alpha), x.shape)


def index_add_(x: Tensor, dim: int, index, source: Tensor, *, alpha=1) -> Tensor:
    """In-place :func:`index_add`."""
    recorded = F._check_inplace(x, "index_add_", source)
    return F.finish_inplace(x, index_add(x, dim, index, source, alpha=alpha), recorded)


# -- sorting ---------------------------------------------------------------------------------------
class _SortValues(Function):
    """Values of a sort (or the first k of one) along ``d``; ``idx`` (int64) says where each
    came from, so the gradient scatters back to those places (they are distinct)."""

    @staticmethod
    def forward(ctx, x, d, values, idx):
        ctx.save_for_backward(idx)
        ctx.d, ctx.shape = d, x.shape
        return F._view(values, values.shape, values._strides, values._off)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        zeros = K.fill(K.empty(ctx.shape, g.dtype, g._st.rt), 0)
        return _scatter_raw(zeros, ctx.d, idx, F.contiguous(g), "replace"), None, None, None


def _sort_impl(x: Tensor, d: int, descending: bool, k: int | None = None):
    """(values, int64 indices) of x sorted along d, the first k of them (no autograd)."""
    n = x.shape[d]
    k = n if k is None else k
    xt = F.movedim(x, d, -1) if d != x.ndim - 1 else x  # the sorted dim last
    rest = xt.shape[:-1]
    rows = numel(rest)
    if rows * k == 0:
        v, p = K.empty(rest + (k,), x.dtype, x._st.rt), K.empty(rest + (k,), dt.int64, x._st.rt)
    else:
        src = xt if xt.is_contiguous() else K.copy(xt)
        sv, sp = K.sort_rows(Tensor(src._st, (rows, n), (n, 1), src._off, src.dtype), descending)
        v = F.reshape(K.copy(Tensor(sv._st, (rows, k), sv._strides, 0, sv.dtype)), rest + (k,))
        p = F.reshape(K.copy(Tensor(sp._st, (rows, k), sp._strides, 0, dt.int32), dt.int64), rest + (k,))
    if d != x.ndim - 1:
        v, p = F.movedim(v, -1, d), F.movedim(p, -1, d)
    return v, p


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """(values, indices) of ``x`` sorted along ``dim``.  The sort is always stable (equal
    values keep their order; ``stable`` is accepted for PyTorch's signature); NaN sorts as
    the largest value.  Differentiable in the values."""
    F._check_tensor(x, "sort")
    d = norm_dim(dim, x.ndim, "sort")
    if x.ndim == 0:
        return SortResult(F.clone(x), K.fill(K.empty((), dt.int64, x._st.rt), 0))
    v, p = _sort_impl(x.detach(), d, descending)
    if x.requires_grad and is_grad_enabled() and x.dtype.kind == "float":
        v = _SortValues.apply(x, d, v, p)
    return SortResult(v, p)


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    """The indices that sort ``x`` along ``dim`` (stable; see :func:`sort`)."""
    return sort(x, dim, descending, stable).indices


def msort(x: Tensor) -> Tensor:
    """``x`` sorted along dim 0."""
    return sort(x, 0).values


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """(values, indices) of the ``k`` largest (``largest=False``: smallest) entries along
    ``dim``, largest first (smallest first).  Equal values come in their original order; NaN
    counts as the largest.  Differentiable in the values."""
    F._check_tensor(x, "topk")
    d = norm_dim(dim, x.ndim, "topk")
    n = x.shape[d] if x.ndim else 1
    k = int(k)
    if not 0 <= k <= n:
        raise IndexError(f"topk: k ({k}) is out of range for dim {d} of size {n}")
    if x.ndim == 0:
        return TopKResult(F.clone(x), K.fill(K.empty((), dt.int64, x._st.rt), 0))
    v, p = _sort_impl(x.detach(), d, largest, k)
    if x.requires_grad and is_grad_enabled() and x.dtype.kind == "float":
        v = _SortValues.apply(x, d, v, p)
    return TopKResult(v, p)


# -- scans -----------------------------------------------------------------------------------------
class _Cumsum(Function):
    @staticmethod
    def forward(ctx, x, d):
        ctx.d = d
        return K.scan("sum", x, d)

    @staticmethod
    def backward(ctx, g):
        return K.scan("sum", g, ctx.d, reverse=True), None


class _Cumprod(Function):
    @staticmethod
    def forward(ctx, x, d):
        y = K.scan("prod", x, d)
        ctx.save_for_backward(x, y)
        ctx.d = d
        return y

    @staticmethod
    def backward(ctx, g):
        # PyTorch's rule, zeros included: before the first zero of a row, dy_j/dx_k = y_j / x_k;
        # at the first zero, the sum over j >= k of g_j * prod_{i <= j, i != k} x_i; after it, 0.
        x, y = ctx.saved_tensors
        d = ctx.d
        zero = F.eq(x, 0.0)
        seen = K.scan("sum", zero, d)  # zeros up to and including each position
        before = F.eq(seen, 0)
        first = F.logical_and(zero, F.eq(seen, 1))
        rev = lambda t: K.scan("sum", F.contiguous(t), d, reverse=True)  # noqa: E731
        safe_x = F.where(before, x, 1.0)
        g_before = rev(F.where(before, g * y, 0.0)) / safe_x
        skip_first = K.scan("prod", F.where(first, 1.0, x), d)
        g_first = rev(g * skip_first)
        return F.where(before, g_before, F.where(first, g_first, 0.0)), None


def _cum(op: str, x: Tensor, dim: int, dtype) -> Tensor:
    F._check_tensor(x, op)
    if dtype is not None:
        x = F.to(x, dtype)
    d = norm_dim(dim, x.ndim, op)
    if x.ndim == 0:
        r = _cum(op, F.reshape(x, (1,)), 0, None)
        return F.reshape(r, ())
    if x.dtype.kind != "float":
        r = K.scan("sum" if op == "cumsum" else "prod", x, d)
        return r if dtype is None else F.to(r, x.dtype)  # an integer dtype asked for is kept
    return (_Cumsum if op == "cumsum" else _Cumprod).apply(x, d)


def cumsum(x: Tensor, dim: int, *, dtype=None) -> Tensor:
    """Running sums along ``dim`` (integer and bool inputs give int64, as in PyTorch)."""
    return _cum("cumsum", x, dim, dtype)


def cumprod(x: Tensor, dim: int, *, dtype=None) -> Tensor:
    """Running products along ``dim`` (integer and bool inputs give int64); the gradient is
    exact where the input has zeros, as PyTorch's."""
    return _cum("cumprod", x, dim, dtype)


# -- rearranging -----------------------------------------------------------------------------------
def _dims_arg(dims, op: str) -> tuple:
    if isinstance(dims, int):
        return (dims,)
    return tuple(dims)


class _Flip(Function):
    @staticmethod
    def forward(ctx, x, dims):
        ctx.dims = dims
        return _flip_raw(x, dims)

    @staticmethod
    def backward(ctx, g):
        return _flip_raw(g, ctx.dims), None


def _flip_raw(x: Tensor, dims: tuple) -> Tensor:
    rt = x._st.rt
    for d in dims:
        n = x.shape[d]
        rev = K.arange(n, n - 1, -1, dt.int64, rt)
        idx = Tensor(rev._st, x.shape, tuple(1 if i == d else 0 for i in range(x.ndim)), 0, dt.int64)
        x = K.gather(x, d, idx)
    return x if dims else K.copy(x)


def flip(x: Tensor, *dims_args, dims=None) -> Tensor:
    """``x`` with the order of ``dims`` reversed (a copy, as in PyTorch); ``flip(x, (0, 1))``,
    ``flip(x, dims=[0])`` and the method's ``x.flip(0, 1)`` all work."""
    F._check_tensor(x, "flip")
    if dims is None:
        if not dims_args:
            raise TypeError("flip: missing the dims to flip")
        dims = F._shape_arg(dims_args)
    ds = _dims_arg(dims, "flip")
    if x.ndim == 0:
        for d in ds:
            norm_dim(d, 0, "flip")
        return F.clone(x)
    nd = tuple(norm_dim(d, x.ndim, "flip") for d in ds)
    if len(set(nd)) != len(nd):
        raise ValueError(f"flip: dims {tuple(ds)} name a dim twice")
    if x.numel() == 0:
        return F.clone(x)
    return _Flip.apply(x, tuple(d for d in nd if x.shape[d] > 1))


def roll(x: Tensor, shifts, dims=None) -> Tensor:
    """Rotate ``x`` by ``shifts`` along ``dims`` (elements pushed off one end come back at the
    other); without dims, the flattened tensor is rolled and the shape restored."""
    F._check_tensor(x, "roll")
    shifts = _dims_arg(shifts, "roll")
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        if len(shifts) != 1:
            raise ValueError(f"roll: without dims, shifts must be one number, got {shifts}")
        return F.reshape(roll(F.flatten(x), shifts[0], 0), x.shape)
    dims = _dims_arg(dims, "roll")
    if len(shifts) != len(dims):
        raise ValueError(f"roll: shifts {shifts} and dims {dims} must have the same length")
    out = x
    for s, d in zip(shifts, dims):
        d = norm_dim(d, x.ndim, "roll")
        n = x.shape[d] if x.ndim else 1
        if n == 0 or int(s) % n == 0:
            continue
        s = int(s) % n
        out = F.cat([F.narrow(out, d, n - s, s), F.narrow(out, d, 0, n - s)], d)
    return out if out is not x else F.clone(x)


def repeat(x: Tensor, *sizes) -> Tensor:
    """``x`` tiled ``sizes[i]`` times along each dim (sizes may add leading dims; a copy)."""
    F._check_tensor(x, "repeat")
    sizes = tuple(int(s) for s in F._shape_arg(sizes))
    if len(sizes) < x.ndim:
        raise ShapeError(f"repeat: {len(sizes)} repeat counts for a tensor of {x.ndim} dims; give at least one per dim")
    if builtins.any(s < 0 for s in sizes):
        raise ValueError(f"repeat: repeat counts must be non-negative, got {sizes}")
    shape = (1,) * (len(sizes) - x.ndim) + x.shape
    xv = F.reshape(x, shape)
    inter = tuple(v for s in shape for v in (1, s))
    big = tuple(v for r, s in zip(sizes, shape) for v in (r, s))
    out = F.reshape(F.contiguous(F.expand(F.reshape(xv, inter), big)), tuple(r * s for r, s in zip(sizes, shape)))
    return F.clone(out) if out is x else out


def tile(x: Tensor, dims) -> Tensor:
    """``x`` repeated ``dims[i]`` times along each dim; missing leading counts are 1 (torch.tile)."""
    F._check_tensor(x, "tile")
    dims = _dims_arg(dims, "tile")
    dims = (1,) * (x.ndim - len(dims)) + tuple(dims)
    return repeat(x, dims)


def repeat_interleave(x: Tensor, repeats, dim: int | None = None, *, output_size: int | None = None) -> Tensor:
    """Each element (or slice along ``dim``) repeated ``repeats`` times in place: a number, or
    one count per element (a tensor or list; its values are read on the host, as PyTorch
    reads them to size the result).  Without dim, the flattened tensor."""
    F._check_tensor(x, "repeat_interleave")
    if dim is None:
        x, d = F.flatten(x), 0
    else:
        d = norm_dim(dim, x.ndim, "repeat_interleave")
    n = x.shape[d] if x.ndim else 1
    if isinstance(repeats, int) or (isinstance(repeats, Tensor) and repeats.numel() == 1 and n != 1) \
            or (isinstance(repeats, Tensor) and repeats.ndim == 0):
        r = int(repeats.item()) if isinstance(repeats, Tensor) else int(repeats)
        if r < 0:
            raise ValueError(f"repeat_interleave: repeats must be non-negative, got {r}")
        if x.ndim == 0:
            x, d = F.reshape(x, (1,)), 0
        shape = x.shape
        out = F.expand(F.unsqueeze(x, d + 1), shape[:d + 1] + (r,) + shape[d + 1:])
        return F.reshape(F.contiguous(out), shape[:d] + (shape[d] * r,) + shape[d + 1:])
    reps = F._host_indices(repeats) if isinstance(repeats, Tensor) else np.asarray(repeats, np.int64)
    reps = reps.reshape(-1).astype(np.int64)
    if reps.size != n:
        raise ShapeError(f"repeat_interleave: {reps.size} repeat counts for dim {d} of size {n}")
    if (reps < 0).any():
        raise ValueError("repeat_interleave: repeats must be non-negative")
    idx = np.repeat(np.arange(n, dtype=np.int64), reps)
    return F.index_select(x, d, K.from_numpy(idx, dt.int64, x._st.rt))


# -- sampling --------------------------------------------------------------------------------------
def multinomial(input: Tensor, num_samples: int, replacement: bool = False, *, generator=None) -> Tensor:
    """Indices drawn from the categories of each row of ``input`` (non-negative weights, not
    necessarily normalised; 1-D or 2-D), ``num_samples`` per row, with or without
    replacement, from the Philox stream of ``generator`` (default: helios.random's, which
    ``helios.manual_seed`` seeds).  Without replacement, each row's draw is the top
    ``num_samples`` of log(w) + Gumbel noise (the same distribution as drawing one at a
    time); with replacement each sample is the argmax of its own noise."""
    F._check_tensor(input, "multinomial")
    if input.ndim not in (1, 2):
        raise ShapeError(f"multinomial: expects a 1-D or 2-D tensor of weights, got shape {input.shape}")
    if input.dtype.kind != "float":
        raise DTypeError(f"multinomial: expects floating-point weights, got {input.dtype.name}")
    n = input.shape[-1]
    num_samples = int(num_samples)
    if num_samples <= 0:
        raise ValueError(f"multinomial: num_samples must be positive, got {num_samples}")
    if n == 0:
        raise ShapeError("multinomial: the weights have no categories")
    if not replacement and num_samples > n:
        raise ValueError(f"multinomial: cannot draw {num_samples} samples without replacement from {n} categories")
    h = _host_ready(input)
    if h is not None:
        rows_h = h.reshape(-1, n).astype(np.float64)
        if not np.isfinite(rows_h).all() or (rows_h < 0).any():
            raise ValueError("multinomial: weights must be finite and non-negative")
        if (rows_h.sum(1) <= 0).any():
            raise ValueError("multinomial: a row of weights sums to 0")
        if not replacement and ((rows_h > 0).sum(1) < num_samples).any():
            raise ValueError(f"multinomial: a row has fewer than {num_samples} non-zero weights to draw without replacement")
    from helios.random import default_generator

    w = F.to(input, dt.float32) if input.dtype is not dt.float32 else input
    w2 = F.reshape(w, (-1, n))
    rows = w2.shape[0]
    S = 1 if not replacement else num_samples
    gen = generator or default_generator()
    seed, offset = gen.next_offset()
    u = K.rng((rows, S, n), dt.float32, 0, seed, offset, 0.0, 1.0, w2._st.rt)
    logw = F.log(F.unsqueeze(w2, 1))
    keys = F.where(F.gt(F.unsqueeze(w2, 1), 0.0), logw - F.log(F.neg(F.log(u))), -math.inf)
    with F._no_grad_ctx():
        if replacement or num_samples == 1:  # one draw per noise row: Gumbel-max, no sort
            out = F.argmax(keys, dim=-1)
        else:
            out = F.reshape(topk(F.reshape(keys, (rows, n)), num_samples, dim=-1).indices, (rows, num_samples))
    return F.reshape(out, (num_samples,)) if input.ndim == 1 else out
