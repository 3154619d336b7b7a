"""Reductions: sum, mean, var/std, max/min (values and indices), argmax/argmin, norms,
count_nonzero, amax/amin."""

from __future__ import annotations

import builtins
import math

from helios import _kernels as K
from helios import amp as _amp
from helios import dtypes as dt
from helios._shape import norm_dim, norm_dims, numel
from helios.autograd.tape import NO_CONTEXT, Function
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


# -- reductions ----------------------------------------------------------------------------------
def _keep(t: Tensor, shape: tuple, dims: tuple, keepdim: bool) -> Tensor:
    if not keepdim:
        return t
    return F.reshape(t, tuple(1 if i in dims else s for i, s in enumerate(shape)))


class _Sum(Function):
    @staticmethod
    def forward(ctx, x, dims, keepdim, scale):
        ctx.shape, ctx.dims, ctx.keepdim, ctx.scale = x.shape, dims, keepdim, scale
        v, _ = K.reduce("sum", x, dims, scale)
        if x.dtype.kind == "float" and v.dtype is not x.dtype:
            v = K.copy(v, x.dtype)
        return _keep(v, x.shape, dims, keepdim)

    @staticmethod
    def backward(ctx, g):
        if not ctx.keepdim:
            g = F.reshape(g, tuple(1 if i in ctx.dims else s for i, s in enumerate(ctx.shape)))
        if ctx.scale != 1.0:
            g = g * ctx.scale
        return F.expand(g, ctx.shape), None, None, None


def _reduce_dims(dim, ndim: int, op: str) -> tuple:
    """The dims a reduction runs over: None or an empty sequence = all of them (PyTorch's
    rule), else an int or a sequence of ints; dim 0 or -1 of a 0-d tensor names none."""
    if isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int or a sequence of ints, got {dim!r}")
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    return norm_dims(dim, ndim, op)


def sum(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """Sum over ``dim`` (None or () = all dims; int or sequence); integer and bool tensors sum to int64."""
    F._check_tensor(x, "sum")
    if dtype is not None:
        x = F.to(x, dtype)
    if _amp.state.dtype is not None:  # autocast: summed in float32
        (x,) = _amp.fp32(x)
    dims = _reduce_dims(dim, x.ndim, "sum")
    return _Sum.apply(x, dims, keepdim, 1.0)


def mean(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """Mean over ``dim`` (None or () = all dims); ``dtype`` converts the input first."""
    F._check_tensor(x, "mean")
    if dtype is not None:
        x = F.to(x, dtype)
    if x.dtype.kind != "float":
        raise DTypeError(f"mean: expected a floating-point tensor, got {x.dtype.name} (use .to(helios.float32))")
    dims = _reduce_dims(dim, x.ndim, "mean")
    R = numel(tuple(x.shape[d] for d in dims))
    return _Sum.apply(x, dims, keepdim, 1.0 / R if R else math.nan)


def _var_args(op: str, x: Tensor, dim, unbiased, correction) -> tuple:
    """(dims, correction) from PyTorch's two signatures: ``op(x, dim=None, *, correction=1,
    keepdim=False)`` and the older ``op(x, unbiased)`` / ``op(x, dim, unbiased, keepdim)``."""
    F._check_tensor(x, op)
    if isinstance(dim, bool):  # op(x, False): the bool is `unbiased`, not dim 0
        if unbiased is not None:
            raise TypeError(f"{op}: got unbiased twice ({dim!r} as the second argument and unbiased={unbiased!r})")
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise TypeError(f"{op}: give unbiased or correction, not both")
    if correction is None:
        correction = 0 if unbiased is False else 1
    return _reduce_dims(dim, x.ndim, op), correction


def var(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction=None) -> Tensor:
    """Variance over ``dim``, divided by ``max(0, N - correction)`` (correction 1 by default:
    Bessel's, like PyTorch; ``unbiased=False`` is correction 0).  ``var(x, False)`` reads the
    bool as ``unbiased``, as PyTorch does."""
    dims, correction = _var_args("var", x, dim, unbiased, correction)
    R = numel(tuple(x.shape[d] for d in dims))
    mu = mean(x, dim=dims, keepdim=True) if dims else x
    d = x - mu
    return sum(d * d, dim=dims, keepdim=keepdim) / builtins.max(R - correction, 0)


class _StdSqrt(Function):
    """sqrt of a variance, with PyTorch's std gradient: 0 where the std is 0 (not inf * 0)."""

    @staticmethod
    def forward(ctx, v):
        y = K.unary("sqrt", v)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return F.where(F.eq(y, 0.0), 0.0, g / (y * 2.0))


def std(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction=None) -> Tensor:
    """Standard deviation: the square root of :func:`var` (same arguments)."""
    dims, correction = _var_args("std", x, dim, unbiased, correction)
    return _StdSqrt.apply(var(x, dims, keepdim=keepdim, correction=correction))


class _MaxMin(Function):
    @staticmethod
    def forward(ctx, x, op, dim, keepdim):
        v, idx = K.reduce("arg" + op, x, (dim,))
        if v.dtype is not x.dtype:
            v = K.copy(v, x.dtype)
        ctx.shape, ctx.dim, ctx.keepdim = x.shape, dim, keepdim
        ctx.idx = idx
        ctx.dtype = x.dtype
        return _keep(v, x.shape, (dim,), keepdim)

    @staticmethod
    def backward(ctx, g):
        # scatter g to the arg positions: one-hot of the index along dim
        shape, dim = ctx.shape, ctx.dim
        idx = F.reshape(ctx.idx, tuple(1 if i == dim else s for i, s in enumerate(shape)))
        pos = F.reshape(K.arange(shape[dim], 0, 1, dt.int64), tuple(shape[dim] if i == dim else 1 for i in range(len(shape))))
        if not ctx.keepdim:
            g = F.reshape(g, tuple(1 if i == dim else s for i, s in enumerate(shape)))
        return F.where(F.eq(pos, idx), g, 0.0), None, None, None


class _MaxMinAll(Function):
    """max() / min() over every element; the gradient is shared evenly by every element equal
    to the result (PyTorch's rule for ties; a NaN result shares it among the NaNs)."""

    @staticmethod
    def forward(ctx, x, op):
        v, _ = K.reduce(op, x, tuple(range(x.ndim)))
        if v.dtype is not x.dtype:
            v = K.copy(v, x.dtype)
        ctx.save_for_backward(x, v)
        return v

    @staticmethod
    def backward(ctx, g):
        x, v = ctx.saved_tensors
        hit = F.logical_or(F.eq(x, v), F.logical_and(F.ne(v, v), F.ne(x, x)))
        m = F.to(hit, g.dtype)
        return m * (g / sum(m)), None


def _maxmin(op):
    def f(x: Tensor, dim=None, keepdim: bool = False):
        F._check_tensor(x, op)
        if isinstance(dim, Tensor):  # max(x, other): the elementwise maximum, as torch.max(input, other)
            return (F.maximum if op == "max" else F.minimum)(x, dim)
        if dim is None:
            if x.numel() == 0:
                raise ShapeError(f"{op}(): the tensor is empty; give dim= or a non-empty tensor")
            return _MaxMinAll.apply(x, op)
        d = norm_dim(dim, x.ndim, op)
        if x.ndim == 0:
            return F.MaxMin(F.clone(x), K.fill(K.empty((), dt.int64, x._st.rt), 0))
        values = _MaxMin.apply(x, op, d, keepdim)
        idx = values._node.ctx.idx if values._node is not None else None
        if idx is None:
            _, idx = K.reduce("arg" + op, x, (d,))
        return F.MaxMin(values, _keep(idx, x.shape, (d,), keepdim))

    f.__name__ = op
    f.__doc__ = f"{op} over all elements, or (values, indices) over ``dim``."
    return f


max = _maxmin("max")
min = _maxmin("min")


def _argext(op: str, x: Tensor, dim, keepdim: bool) -> Tensor:
    F._check_tensor(x, op)
    if dim is not None:
        norm_dim(dim, x.ndim, op)
    if x.ndim == 0:
        return K.fill(K.empty((), dt.int64, x._st.rt), 0)
    if dim is None:
        r = K.reduce(op, F.reshape(x, (-1,)), (0,))[1]
        return F.reshape(r, (1,) * x.ndim) if keepdim else r
    d = norm_dim(dim, x.ndim, op)
    return _keep(K.reduce(op, x, (d,))[1], x.shape, (d,), keepdim)


def argmax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the (first) maximum over ``dim`` (None = of the flattened tensor; a NaN counts
    as the maximum, as in PyTorch)."""
    return _argext("argmax", x, dim, keepdim)


def argmin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the (first) minimum over ``dim`` (None = of the flattened tensor)."""
    return _argext("argmin", x, dim, keepdim)


# -- norms -----------------------------------------------------------------------------------------
class _PNorm(Function):
    """sum(|x|^p)^(1/p) over ``dims`` for a finite p > 0, with PyTorch's gradient
    x |x|^(p-2) g / norm^(p-1), which is 0 where the norm is 0."""

    @staticmethod
    def forward(ctx, x, p, dims, keepdim):
        ax = K.unary("abs", x)
        s = K.reduce("sum", ax if p == 1 else (K.binary("mul", ax, ax) if p == 2 else K.unary("pow_s", ax, p)), dims)[0]
        if s.dtype is not x.dtype:
            s = K.copy(s, x.dtype)
        nrm = s if p == 1 else (K.unary("sqrt", s) if p == 2 else K.unary("pow_s", s, 1.0 / p))
        ctx.p, ctx.dims, ctx.keepdim, ctx.shape = p, dims, keepdim, x.shape
        ctx.save_for_backward(x, nrm)
        return _keep(nrm, x.shape, dims, keepdim)

    @staticmethod
    def backward(ctx, g):
        x, nrm = ctx.saved_tensors
        kshape = tuple(1 if i in ctx.dims else s for i, s in enumerate(ctx.shape))
        g, nrm = F.reshape(g, kshape), F.reshape(nrm, kshape)
        p = ctx.p
        if p == 1:
            r = g * K.unary("clamp", x * 1e30, -1.0, 1.0)  # sign(x), 0 at 0
        elif p == 2:
            r = F.where(F.eq(nrm, 0.0), 0.0, x * (g / nrm))
        else:
            ax = F.abs(x)
            scale = F.where(F.eq(nrm, 0.0), 0.0, g / F.pow(nrm, p - 1))
            r = x * F.pow(ax, p - 2) * scale if p >= 2 else F.where(F.eq(x, 0.0), 0.0, x * F.pow(ax, p - 2)) * scale
        return r, None, None, None


def norm(x: Tensor, p="fro", dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """torch.norm: vector p-norms over ``dim`` (None: every element) for any number p
    (``inf``: the largest |x|, ``-inf``: the smallest, 0: the count of non-zeros), and the
    Frobenius norm (``"fro"``, the 2-norm of the elements).  The gradient of the 2-norm (and
    of every p >= 1) is 0 where the norm is 0, as in PyTorch."""
    F._check_tensor(x, "norm")
    if dtype is not None:
        x = F.to(x, dtype)
    if _amp.state.dtype is not None:  # autocast: in float32
        (x,) = _amp.fp32(x)
    if x.dtype.kind != "float":
        raise DTypeError(f"norm: expected a floating-point tensor, got {x.dtype.name}")
    if isinstance(p, str):
        if p == "nuc":
            raise ShapeError("norm: the nuclear norm (p='nuc') needs a singular value decomposition, which Helios "
                             "does not have; use p='fro' or a number")
        if p != "fro":
            raise ValueError(f"norm: p must be a number, 'fro' or 'nuc', got {p!r}")
        p = 2
    if isinstance(dim, int):
        dim = (dim,)
    dims = _reduce_dims(dim, x.ndim, "norm")
    if x.ndim == 0:
        dims = ()
    p = float(p)
    if not dims and x.ndim:
        dims = tuple(range(x.ndim))
    if x.ndim == 0:
        return F.abs(x) if p != 0 else F.to(F.ne(x, 0.0), x.dtype)
    if math.isinf(p):
        a = F.abs(x)
        if x.numel() == 0 and p > 0:
            return sum(a, dim=list(dims), keepdim=keepdim)  # the norm of nothing is 0
        return amax(a, dims, keepdim) if p > 0 else amin(a, dims, keepdim)
    if p == 0:
        return _CountNonzero.apply(x, dims, keepdim)
    if p < 0:
        return F.pow(sum(F.pow(F.abs(x), p), dim=list(dims), keepdim=keepdim), 1.0 / p)
    return _PNorm.apply(x, p, dims, keepdim)


class _CountNonzero(Function):
    """The 0-"norm": the number of non-zeros, a step function (a zero gradient, as PyTorch's)."""

    @staticmethod
    def forward(ctx, x, dims, keepdim):
        ctx.shape = x.shape
        v = K.reduce("sum", K.copy(K.binary("ne", x, F.scalar_tensor(0.0, x.dtype, x._st.rt)), x.dtype), dims)[0]
        return _keep(v if v.dtype is x.dtype else K.copy(v, x.dtype), x.shape, dims, keepdim)

    @staticmethod
    def backward(ctx, g):
        return K.fill(K.empty(ctx.shape, g.dtype, g._st.rt), 0), None, None


class _AMaxMin(Function):
    """amax / amin over dims; the gradient is shared evenly by the entries equal to the result."""

    @staticmethod
    def forward(ctx, x, op, dims, keepdim):
        v = x
        for d in sorted(dims, reverse=True):
            v = K.reduce(op, v, (d,))[0]
        if v.dtype is not x.dtype:
            v = K.copy(v, x.dtype)
        ctx.save_for_backward(x, v)
        ctx.dims, ctx.shape = dims, x.shape
        return _keep(v, x.shape, dims, keepdim)

    @staticmethod
    def backward(ctx, g):
        x, v = ctx.saved_tensors
        kshape = tuple(1 if i in ctx.dims else s for i, s in enumerate(ctx.shape))
        v, g = F.reshape(v, kshape), F.reshape(g, kshape)
        m = F.to(F.logical_or(F.eq(x, v), F.logical_and(F.ne(v, v), F.ne(x, x))), g.dtype)
        return m * (g / sum(m, dim=list(ctx.dims), keepdim=True)), None, None, None


def amax(x: Tensor, dim=(), keepdim: bool = False) -> Tensor:
    """The largest value over ``dim`` (() = every dim); NaN propagates; ties share the gradient."""
    F._check_tensor(x, "amax")
    dims = _reduce_dims(dim, x.ndim, "amax") if x.ndim else ()
    if not dims:
        return F.clone(x)
    return _AMaxMin.apply(x, "max", dims, keepdim) if x.dtype.kind == "float" else _AMaxMin.forward(NO_CONTEXT, x, "max", dims, keepdim)


def amin(x: Tensor, dim=(), keepdim: bool = False) -> Tensor:
    """The smallest value over ``dim`` (() = every dim); NaN propagates; ties share the gradient."""
    F._check_tensor(x, "amin")
    dims = _reduce_dims(dim, x.ndim, "amin") if x.ndim else ()
    if not dims:
        return F.clone(x)
    return _AMaxMin.apply(x, "min", dims, keepdim) if x.dtype.kind == "float" else _AMaxMin.forward(NO_CONTEXT, x, "min", dims, keepdim)
