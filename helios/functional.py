"""The differentiable ops of the Tensor API (PyTorch naming), built on helios._kernels.

Each op is a small :class:`~helios.autograd.Function` (forward on raw kernels,
backward in Helios ops) plus a public function that handles Python scalars, dtype
promotion and argument checking.  Tensor methods and operators forward here.
"""

from __future__ import annotations

import builtins
import math
from collections import namedtuple

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios._shape import (broadcast_shapes, contiguous_strides, infer_reshape, norm_dim, norm_dims, numel,
                           view_strides)
from helios.autograd.tape import NO_CONTEXT, Function, is_grad_enabled
from helios.errors import DeviceError, DTypeError, ShapeError
from helios.runtime import get_runtime
from helios.tensor import Tensor

Number = (int, float, bool)
MaxMin = namedtuple("MaxMin", ["values", "indices"])


# -- helpers -------------------------------------------------------------------------------------
def _check_tensor(x, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: expected a helios.Tensor, got {type(x).__name__}")
    return x


_scalar_cache: dict = {}


def scalar_tensor(value, dtype: dt.DType, rt) -> Tensor:
    """A cached 0-d device tensor holding ``value`` (for comparisons and where with scalars)."""
    key = (value, type(value), dtype, id(rt))
    t = _scalar_cache.get(key)
    if t is None:
        if len(_scalar_cache) > 512:
            _scalar_cache.clear()
        t = K.from_numpy(np.array(value, dtype=np.float32 if dtype is dt.bfloat16 else dtype.np_storage), dtype, rt)
        _scalar_cache[key] = t
    return t


def _as_tensor_like(x, like: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Number):
        return scalar_tensor(x, dt.scalar_result(like.dtype, x), like._st.rt)
    if isinstance(x, np.ndarray):
        return K.from_numpy(x, dt.from_numpy_dtype(x.dtype), like._st.rt)
    raise TypeError(f"expected a helios.Tensor or a number, got {type(x).__name__}")


def _promote_pair(a: Tensor, b: Tensor, op: str):
    if a._st.rt is not b._st.rt:
        raise ShapeError(f"{op}: tensors are on different devices ({a.device} and {b.device})")
    if a.dtype is b.dtype:
        return a, b
    # a 0-d tensor does not promote a float tensor's dtype (like a Python scalar)
    if b.ndim == 0 and a.ndim > 0 and (a.dtype.kind == "float" or b.dtype.kind != "float"):
        return a, to(b, a.dtype)
    if a.ndim == 0 and b.ndim > 0 and (b.dtype.kind == "float" or a.dtype.kind != "float"):
        return to(a, b.dtype), b
    t = dt.promote(a.dtype, b.dtype)
    return to(a, t), to(b, t)


def sum_to_shape(g: Tensor, shape: tuple) -> Tensor:
    """Sum a broadcast gradient back to ``shape`` (the inverse of broadcasting)."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1]
    out = sum(g, dim=dims, keepdim=True) if dims else g
    return reshape(out, shape)


# -- casting, copies -----------------------------------------------------------------------------
class _Cast(Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src = x.dtype
        return K.copy(x, dtype)

    @staticmethod
    def backward(ctx, g):
        return K.copy(g, ctx.src), None


def to(x: Tensor, dtype=None, *args, **kw) -> Tensor:
    """``x`` as ``dtype`` (a copy; the same tensor if it already is).  Devices: only "vulkan:N"."""
    if isinstance(dtype, str) and dtype.startswith("vulkan"):
        if get_runtime(dtype) is not x._st.rt:
            raise DeviceError(f"to({dtype!r}): moving tensors between devices is not supported; create the tensor there")
        return x
    d = dt.as_dtype(dtype)
    if d is x.dtype:
        return x
    if d.kind != "float" and x.requires_grad:
        return K.copy(x, d)  # integer results carry no gradient
    return _Cast.apply(x, d)


class _Contiguous(Function):
    @staticmethod
    def forward(ctx, x):
        return K.copy(x)

    @staticmethod
    def backward(ctx, g):
        return g


def contiguous(x: Tensor) -> Tensor:
    """``x`` itself if contiguous, else a contiguous copy."""
    return x if x.is_contiguous() else _Contiguous.apply(x)


def clone(x: Tensor) -> Tensor:
    """A copy with its own storage (differentiable)."""
    return _Contiguous.apply(x)


# -- elementwise ---------------------------------------------------------------------------------
def _binary_fn(name, bwd):
    cls = type(f"_{name.capitalize()}", (Function,), {
        "forward": staticmethod(lambda ctx, a, b: (ctx.save_for_backward(a, b), K.binary(name, a, b))[1]),
        "backward": staticmethod(bwd),
    })
    return cls


def _bwd_add(ctx, g):
    return g, g


def _bwd_sub(ctx, g):
    return g, (neg(g) if ctx.needs_input_grad[1] else None)


def _bwd_mul(ctx, g):
    a, b = ctx.saved_tensors
    return (g * b if ctx.needs_input_grad[0] else None), (g * a if ctx.needs_input_grad[1] else None)


def _bwd_div(ctx, g):
    a, b = ctx.saved_tensors
    ga = g / b if ctx.needs_input_grad[0] else None
    gb = neg(g * a / (b * b)) if ctx.needs_input_grad[1] else None
    return ga, gb


def _bwd_pow(ctx, g):
    a, b = ctx.saved_tensors
    ga = g * b * pow(a, b - 1.0) if ctx.needs_input_grad[0] else None
    gb = g * pow(a, b) * log(a) if ctx.needs_input_grad[1] else None
    return ga, gb


def _bwd_maximum(ctx, g):
    a, b = ctx.saved_tensors
    pick_a = to(a >= b, g.dtype)
    return g * pick_a, g * (1.0 - pick_a)


def _bwd_minimum(ctx, g):
    a, b = ctx.saved_tensors
    pick_a = to(a <= b, g.dtype)
    return g * pick_a, g * (1.0 - pick_a)


_Add = _binary_fn("add", _bwd_add)
_Sub = _binary_fn("sub", _bwd_sub)
_Mul = _binary_fn("mul", _bwd_mul)
_Div = _binary_fn("div", _bwd_div)
_Pow = _binary_fn("pow", _bwd_pow)
_Maximum = _binary_fn("maximum", _bwd_maximum)
_Minimum = _binary_fn("minimum", _bwd_minimum)


class _UnaryScalar(Function):
    """x op scalar for add_s, mul_s, div_s, rsub_s, rdiv_s, pow_s, clamp."""

    @staticmethod
    def forward(ctx, x, op, p0, p1):
        if ctx is not NO_CONTEXT:  # the hot path of `x + 1.0` keeps nothing when nothing records
            ctx.op, ctx.p0, ctx.p1 = op, p0, p1
            if op in ("rdiv_s", "pow_s", "clamp"):
                ctx.save_for_backward(x)
        return K.unary(op, x, p0, p1)

    @staticmethod
    def backward(ctx, g):
        op, p0, p1 = ctx.op, ctx.p0, ctx.p1
        if op == "add_s":
            r = g
        elif op == "mul_s":
            r = g * p0
        elif op == "div_s":
            r = g / p0
        elif op == "rsub_s":
            r = neg(g)
        elif op == "rdiv_s":
            (x,) = ctx.saved_tensors
            r = neg(g) * p0 / (x * x)
        elif op == "pow_s":
            (x,) = ctx.saved_tensors
            r = g * p0 if p0 == 1.0 else g * (pow(x, p0 - 1.0) * p0)
        else:  # clamp: gradient passes where the input was inside [p0, p1]
            (x,) = ctx.saved_tensors
            inside = logical_and(x >= p0, x <= p1)
            r = where(inside, g, 0.0)
        return r, None, None, None


def _float_result(x: Tensor, s) -> Tensor:
    """Lift an int/bool tensor to float32 when a float scalar meets it."""
    if x.dtype.kind != "float" and isinstance(s, float):
        return to(x, dt.float32)
    return x


def add(a, b, alpha: float = 1.0) -> Tensor:
    """a + alpha * b, broadcasting."""
    if isinstance(b, Number) and isinstance(a, Tensor):
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "add_s", float(b * alpha), 0.0)
    a, b = _promote_pair(_check_tensor(a, "add"), _as_tensor_like(b, a), "add")
    if alpha != 1.0:
        b = b * alpha
    return _Add.apply(a, b)


def sub(a, b, alpha: float = 1.0) -> Tensor:
    """a - alpha * b, broadcasting."""
    if isinstance(b, Number) and isinstance(a, Tensor):
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "add_s", float(-b * alpha), 0.0)
    a, b = _promote_pair(_check_tensor(a, "sub"), _as_tensor_like(b, a), "sub")
    if alpha != 1.0:
        b = b * alpha
    return _Sub.apply(a, b)


def rsub(x: Tensor, s) -> Tensor:
    """s - x."""
    if isinstance(s, Number):
        x = _float_result(x, s)
        return _UnaryScalar.apply(x, "rsub_s", float(s), 0.0)
    return sub(_as_tensor_like(s, x), x)


def mul(a, b) -> Tensor:
    """a * b, broadcasting."""
    if isinstance(b, Number) and isinstance(a, Tensor):
        if a.dtype is dt.bool_:
            a = to(a, dt.int64 if isinstance(b, int) and not isinstance(b, bool) else dt.float32)
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "mul_s", float(b), 0.0)
    a, b = _promote_pair(_check_tensor(a, "mul"), _as_tensor_like(b, a), "mul")
    return _Mul.apply(a, b)


def div(a, b) -> Tensor:
    """a / b (true division: integer inputs give float32)."""
    if isinstance(b, Number) and isinstance(a, Tensor):
        if a.dtype.kind != "float":
            a = to(a, dt.float32)
        return _UnaryScalar.apply(a, "div_s", float(b), 0.0)
    a, b = _promote_pair(_check_tensor(a, "div"), _as_tensor_like(b, a), "div")
    if a.dtype.kind != "float":
        a, b = to(a, dt.float32), to(b, dt.float32)
    return _Div.apply(a, b)


def rdiv(x: Tensor, s) -> Tensor:
    """s / x."""
    if isinstance(s, Number):
        if x.dtype.kind != "float":
            x = to(x, dt.float32)
        return _UnaryScalar.apply(x, "rdiv_s", float(s), 0.0)
    return div(_as_tensor_like(s, x), x)


def pow(a, b) -> Tensor:
    """a ** b (elementwise; b a scalar or a tensor)."""
    if isinstance(b, Number):
        a = _float_result(a, b) if a.dtype.kind == "float" or isinstance(b, float) else to(a, dt.float32)
        if b == 1:
            return a * 1.0
        return _UnaryScalar.apply(a, "pow_s", float(b), 0.0)
    a, b = _promote_pair(_check_tensor(a, "pow"), _as_tensor_like(b, a), "pow")
    if a.dtype.kind != "float":
        a, b = to(a, dt.float32), to(b, dt.float32)
    return _Pow.apply(a, b)


def rpow(x: Tensor, s) -> Tensor:
    """s ** x."""
    return pow(_as_tensor_like(float(s), x if x.dtype.kind == "float" else to(x, dt.float32)), x)


def maximum(a: Tensor, b) -> Tensor:
    """Elementwise max (NaN propagates)."""
    a, b = _promote_pair(_check_tensor(a, "maximum"), _as_tensor_like(b, a), "maximum")
    return _Maximum.apply(a, b)


def minimum(a: Tensor, b) -> Tensor:
    """Elementwise min (NaN propagates)."""
    a, b = _promote_pair(_check_tensor(a, "minimum"), _as_tensor_like(b, a), "minimum")
    return _Minimum.apply(a, b)


def clamp(x: Tensor, min=None, max=None) -> Tensor:
    """Clamp into [min, max] (either may be None)."""
    lo = -math.inf if min is None else float(min)
    hi = math.inf if max is None else float(max)
    if x.dtype.kind != "float":
        if min is not None and max is not None and isinstance(min, int) and isinstance(max, int):
            return K.unary("clamp", x, lo, hi)
        x = to(x, dt.float32)
    return _UnaryScalar.apply(x, "clamp", lo, hi)


class _Unary(Function):
    """exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, gelu_tanh, abs, neg, sin, cos."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        y = K.unary(op, x)
        if op in ("exp", "sqrt", "rsqrt", "tanh", "sigmoid"):
            ctx.save_for_backward(y)
        elif op not in ("neg",):
            ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        op = ctx.op
        if op == "neg":
            return neg(g), None
        (s,) = ctx.saved_tensors
        if op == "exp":
            r = g * s
        elif op == "log":
            r = g / s
        elif op == "sqrt":
            r = g / (s * 2.0)
        elif op == "rsqrt":
            r = g * (s * s * s) * -0.5
        elif op == "tanh":
            r = K.binary("tanh_bwd", s, g)
        elif op == "sigmoid":
            r = K.binary("sigmoid_bwd", s, g)
        elif op == "relu":
            r = K.binary("relu_bwd", s, g)
        elif op == "gelu":
            r = K.binary("gelu_bwd", s, g)
        elif op == "gelu_tanh":
            r = K.binary("gelu_tanh_bwd", s, g)
        elif op == "abs":
            r = g * K.unary("clamp", s * 1e30, -1.0, 1.0)  # sign(x), 0 at 0
        elif op == "sin":
            r = g * cos(s)
        elif op == "cos":
            r = neg(g * sin(s))
        else:
            raise AssertionError(op)
        return r, None


def _unary(op):
    def f(x: Tensor) -> Tensor:
        _check_tensor(x, op)
        if x.dtype.kind != "float" and op != "neg" and op != "abs":
            x = to(x, dt.float32)
        return _Unary.apply(x, op)

    f.__name__ = op
    f.__doc__ = f"Elementwise {op}."
    return f


exp = _unary("exp")
log = _unary("log")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
tanh = _unary("tanh")
sigmoid = _unary("sigmoid")
relu = _unary("relu")
abs = _unary("abs")
sin = _unary("sin")
cos = _unary("cos")
_neg = _unary("neg")


def neg(x: Tensor) -> Tensor:
    """-x."""
    if x.dtype is dt.bool_:
        raise DTypeError("neg: negation of a bool tensor is not supported; use logical_not")
    return _neg(x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU: exact (erf) with approximate="none", or the tanh approximation with "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dtype.kind != "float":
        x = to(x, dt.float32)
    return _Unary.apply(x, "gelu" if approximate == "none" else "gelu_tanh")


def square(x: Tensor) -> Tensor:
    return pow(x, 2)


# -- comparisons and logic (not differentiable) ---------------------------------------------------
def _compare(op):
    def f(a, b) -> Tensor:
        a = _check_tensor(a, op)
        b = _as_tensor_like(b, a)
        a, b = _promote_pair(a, b, op)
        return K.binary(op, a, b)

    f.__name__ = op
    f.__doc__ = f"Elementwise comparison {op} (bool result)."
    return f


eq, ne, lt, le, gt, ge = (_compare(o) for o in ("eq", "ne", "lt", "le", "gt", "ge"))


def _logical(op):
    def f(a, b) -> Tensor:
        a = to(_check_tensor(a, op), dt.bool_)
        b = to(_as_tensor_like(b, a), dt.bool_)
        return K.binary(op, a, b)

    return f


logical_and = _logical("and")
logical_or = _logical("or")
logical_xor = _logical("xor")


def logical_not(x: Tensor) -> Tensor:
    return K.binary("eq", to(x, dt.bool_), scalar_tensor(False, dt.bool_, x._st.rt))


class _Where(Function):
    @staticmethod
    def forward(ctx, cond, a, b):
        ctx.save_for_backward(cond)
        return K.where(cond, a, b)

    @staticmethod
    def backward(ctx, g):
        (cond,) = ctx.saved_tensors
        zero = scalar_tensor(0.0, g.dtype, g._st.rt)
        ga = K.where(cond, g, zero) if ctx.needs_input_grad[1] else None
        gb = K.where(cond, zero, g) if ctx.needs_input_grad[2] else None
        return None, ga, gb


def where(cond: Tensor, a, b) -> Tensor:
    """Elementwise ``a`` where ``cond`` else ``b`` (broadcasting; a or b may be scalars)."""
    _check_tensor(cond, "where")
    if cond.dtype is not dt.bool_:
        cond = to(cond, dt.bool_)
    like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
    if like is None:
        like = scalar_tensor(float(a) if isinstance(a, float) or isinstance(b, float) else a, dt.float32, cond._st.rt)
    a, b = _as_tensor_like(a, like), _as_tensor_like(b, like)
    a, b = _promote_pair(a, b, "where")
    return _Where.apply(cond, a, b)


def masked_fill(x: Tensor, mask: Tensor, value) -> Tensor:
    """``x`` with ``value`` where ``mask`` is true (mask broadcasts to x)."""
    broadcast_shapes("masked_fill", x.shape, mask.shape)
    return where(mask, scalar_tensor(value, dt.scalar_result(x.dtype, value) if x.dtype.kind != "float" else x.dtype, x._st.rt), x)


# -- reductions ----------------------------------------------------------------------------------
def _keep(t: Tensor, shape: tuple, dims: tuple, keepdim: bool) -> Tensor:
    if not keepdim:
        return t
    return reshape(t, tuple(1 if i in dims else s for i, s in enumerate(shape)))


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
            g = reshape(g, tuple(1 if i in ctx.dims else s for i, s in enumerate(ctx.shape)))
        if ctx.scale != 1.0:
            g = g * ctx.scale
        return expand(g, ctx.shape), None, None, None


def sum(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """Sum over ``dim`` (None = all dims; int or sequence)."""
    _check_tensor(x, "sum")
    if dtype is not None:
        x = to(x, dtype)
    dims = norm_dims(dim, x.ndim, "sum")
    return _Sum.apply(x, dims, keepdim, 1.0)


def mean(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Mean over ``dim`` (None = all dims)."""
    _check_tensor(x, "mean")
    if x.dtype.kind != "float":
        raise DTypeError(f"mean: expected a floating-point tensor, got {x.dtype.name} (use .to(helios.float32))")
    dims = norm_dims(dim, x.ndim, "mean")
    R = numel(tuple(x.shape[d] for d in dims))
    return _Sum.apply(x, dims, keepdim, 1.0 / R if R else math.nan)


def var(x: Tensor, dim=None, keepdim: bool = False, correction: int = 1, unbiased: bool | None = None) -> Tensor:
    """Variance over ``dim`` with Bessel's ``correction`` (1 = unbiased, like torch)."""
    if unbiased is not None:
        correction = 1 if unbiased else 0
    dims = norm_dims(dim, x.ndim, "var")
    R = numel(tuple(x.shape[d] for d in dims))
    mu = mean(x, dim=dims, keepdim=True)
    d = x - mu
    return sum(d * d, dim=dims, keepdim=keepdim) / builtins.max(R - correction, 0)


def std(x: Tensor, dim=None, keepdim: bool = False, correction: int = 1) -> Tensor:
    return sqrt(var(x, dim, keepdim, correction))


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
        idx = reshape(ctx.idx, tuple(1 if i == dim else s for i, s in enumerate(shape)))
        pos = reshape(K.arange(shape[dim], 0, 1, dt.int64), tuple(shape[dim] if i == dim else 1 for i in range(len(shape))))
        if not ctx.keepdim:
            g = reshape(g, tuple(1 if i == dim else s for i, s in enumerate(shape)))
        return where(eq(pos, idx), g, 0.0), None, None, None


def _maxmin(op):
    def f(x: Tensor, dim=None, keepdim: bool = False):
        _check_tensor(x, op)
        if dim is None:
            flat = reshape(x, (-1,)) if x.ndim != 1 else x
            if flat.numel() == 0:
                raise ShapeError(f"{op}(): the tensor is empty; give dim= or a non-empty tensor")
            return _MaxMin.apply(flat, op, 0, False)
        d = norm_dim(dim, x.ndim, op)
        if x.ndim == 0:
            return MaxMin(x, K.fill(K.empty((), dt.int64, x._st.rt), 0))
        values = _MaxMin.apply(x, op, d, keepdim)
        idx = values._node.ctx.idx if values._node is not None else None
        if idx is None:
            _, idx = K.reduce("arg" + op, x, (d,))
        return MaxMin(values, _keep(idx, x.shape, (d,), keepdim))

    f.__name__ = op
    f.__doc__ = f"{op} over all elements, or (values, indices) over ``dim``."
    return f


max = _maxmin("max")
min = _maxmin("min")


def argmax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the (first) maximum over ``dim`` (None = of the flattened tensor)."""
    if dim is None:
        return K.reduce("argmax", reshape(x, (-1,)), (0,))[1]
    d = norm_dim(dim, x.ndim, "argmax")
    return _keep(K.reduce("argmax", x, (d,))[1], x.shape, (d,), keepdim)


def argmin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the (first) minimum over ``dim`` (None = of the flattened tensor)."""
    if dim is None:
        return K.reduce("argmin", reshape(x, (-1,)), (0,))[1]
    d = norm_dim(dim, x.ndim, "argmin")
    return _keep(K.reduce("argmin", x, (d,))[1], x.shape, (d,), keepdim)


# -- views ---------------------------------------------------------------------------------------
def _shape_arg(shape: tuple) -> tuple:
    """Accept both f(x, 2, 3) and f(x, (2, 3))."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return shape


def _view(x: Tensor, shape, strides, off) -> Tensor:
    t = Tensor(x._st, tuple(shape), tuple(strides), off, x.dtype)
    return t


class _Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        st = view_strides(x.shape, x._strides, shape)
        if st is None:
            return _view(K.copy(x), shape, contiguous_strides(shape), 0)
        return _view(x, shape, st, x._off)

    @staticmethod
    def backward(ctx, g):
        return reshape(g, ctx.shape), None


def reshape(x: Tensor, *shape) -> Tensor:
    """``x`` with a new shape (a view when the strides allow, else a copy); one dim may be -1."""
    shape = _shape_arg(shape)
    shape = infer_reshape("reshape", x.shape, tuple(int(s) for s in shape))
    if shape == x.shape:
        return x
    return _Reshape.apply(x, shape)


def view(x: Tensor, *shape) -> Tensor:
    """Like reshape, but never copies: a ShapeError if the strides do not allow a view."""
    shape = _shape_arg(shape)
    shape = infer_reshape("view", x.shape, tuple(int(s) for s in shape))
    if view_strides(x.shape, x._strides, shape) is None:
        raise ShapeError(f"view: a tensor of shape {x.shape} with strides {x._strides} cannot be viewed as {shape} "
                         "without a copy; use reshape() or contiguous() first")
    return reshape(x, shape)


class _Permute(Function):
    @staticmethod
    def forward(ctx, x, perm):
        ctx.perm = perm
        return _view(x, [x.shape[p] for p in perm], [x._strides[p] for p in perm], x._off)

    @staticmethod
    def backward(ctx, g):
        inv = [0] * len(ctx.perm)
        for i, p in enumerate(ctx.perm):
            inv[p] = i
        return permute(g, *inv), None


def permute(x: Tensor, *dims) -> Tensor:
    """Reorder dims (a view)."""
    dims = _shape_arg(dims)
    perm = tuple(norm_dim(d, x.ndim, "permute") for d in dims)
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"permute: {dims} is not a permutation of the {x.ndim} dims of a tensor of shape {x.shape}")
    if perm == tuple(range(x.ndim)):
        return x
    return _Permute.apply(x, perm)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dims (a view)."""
    if x.ndim < 2 and dim0 in (0, -1) and dim1 in (0, -1):
        return x
    d0, d1 = norm_dim(dim0, x.ndim, "transpose"), norm_dim(dim1, x.ndim, "transpose")
    perm = list(range(x.ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(x, *perm)


class _Expand(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        from helios._shape import broadcast_strides

        return _view(x, shape, broadcast_strides(x.shape, x._strides, shape), x._off)

    @staticmethod
    def backward(ctx, g):
        return sum_to_shape(g, ctx.shape), None


def expand(x: Tensor, *shape) -> Tensor:
    """Broadcast size-1 dims to ``shape`` without copying (-1 keeps a dim)."""
    shape = _shape_arg(shape)
    pad = len(shape) - x.ndim
    if pad < 0:
        raise ShapeError(f"expand: target {shape} has fewer dims than the tensor's shape {x.shape}")
    full = []
    for i, s in enumerate(shape):
        j = i - pad
        cur = x.shape[j] if j >= 0 else 1
        s = cur if s == -1 else s
        if cur != 1 and cur != s:
            raise ShapeError(f"expand: cannot expand shape {x.shape} to {tuple(shape)} (dim {i}: {cur} -> {s})")
        full.append(s)
    full = tuple(full)
    if full == x.shape:
        return x
    return _Expand.apply(x, full)


def squeeze(x: Tensor, dim=None) -> Tensor:
    """Drop size-1 dims (all, or the given one(s) when of size 1)."""
    dims = norm_dims(dim, x.ndim, "squeeze") if dim is not None else tuple(range(x.ndim))
    shape = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return reshape(x, shape)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """Insert a size-1 dim at ``dim``."""
    d = norm_dim(dim, x.ndim + 1, "unsqueeze")
    shape = x.shape[:d] + (1,) + x.shape[d:]
    return reshape(x, shape)


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = norm_dim(start_dim, x.ndim, "flatten"), norm_dim(end_dim, x.ndim, "flatten")
    return reshape(x, x.shape[:s] + (numel(x.shape[s:e + 1]),) + x.shape[e + 1:])


class _Slice(Function):
    """A basic-indexing view: new shape, strides and offset over the same storage."""

    @staticmethod
    def forward(ctx, x, shape, strides, off):
        ctx.src = (x.shape, x._strides, x._off)
        ctx.view = (shape, strides, off)
        return _view(x, shape, strides, off)

    @staticmethod
    def backward(ctx, g):
        # Zeros laid out exactly like the source's storage span, so the same (strides,
        # offset) arithmetic places the gradient where the view's elements came from.
        src_shape, src_strides, src_off = ctx.src
        shape, strides, off = ctx.view
        span = 1 + builtins.sum((s - 1) * st for s, st in zip(src_shape, src_strides)) if numel(src_shape) else 0
        buf = K.fill(K.empty((span,), g.dtype, g._st.rt), 0)
        K.copy_into(Tensor(buf._st, shape, strides, off - src_off, g.dtype), g)
        src_view = Tensor(buf._st, src_shape, src_strides, 0, g.dtype)
        return (src_view if src_view.is_contiguous() else K.copy(src_view)), None, None, None


def _basic_index(x: Tensor, idx):
    """(shape, strides, offset) of x[idx] for ints, slices, None and Ellipsis."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    n_real = builtins.sum(1 for i in idx if i is not None and i is not Ellipsis)
    if n_real > x.ndim:
        raise IndexError(f"too many indices for a tensor of {x.ndim} dims: {idx}")
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    expanded = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - n_real))
        else:
            expanded.append(i)
    while builtins.sum(1 for i in expanded if i is not None) < x.ndim:
        expanded.append(slice(None))
    shape, strides, off = [], [], x._off
    d = 0
    for i in expanded:
        if i is None:
            shape.append(1)
            strides.append(0)
            continue
        size, st = x.shape[d], x._strides[d]
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            i = int(i)
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for dim {d} of size {size}")
            off += (i % size) * st
        elif isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise ValueError("slice step must be positive")
            n = builtins.max(0, (stop - start + step - 1) // step)
            if n:
                off += start * st
            shape.append(n)
            strides.append(st * step)
        else:
            raise IndexError(f"unsupported index {i!r}: use ints, slices, None, ... or a single integer tensor")
        d += 1
    return tuple(shape), tuple(strides), off


def getitem(x: Tensor, idx) -> Tensor:
    """x[idx] for ints, slices (with steps), None, ... (views) or an integer tensor/list (a gather on dim 0)."""
    if isinstance(idx, (Tensor, list, np.ndarray)):
        return index_select(x, 0, idx)
    shape, strides, off = _basic_index(x, idx)
    return _Slice.apply(x, shape, strides, off)


def setitem(x: Tensor, idx, value) -> None:
    """x[idx] = value (in place)."""
    _check_inplace(x, "setitem")
    shape, strides, off = _basic_index(x, idx)
    target = Tensor(x._st, shape, strides, off, x.dtype)
    if isinstance(value, Tensor):
        if value.shape != shape:
            broadcast_shapes("setitem", value.shape, shape)
        K.copy_into(target, value)  # the copy kernel converts dtypes
    else:
        K.copy_into(target, scalar_tensor(value, x.dtype, x._st.rt))
    x._st.version += 1


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    """The slice [start, start+length) of ``dim`` (a view)."""
    d = norm_dim(dim, x.ndim, "narrow")
    idx = [slice(None)] * x.ndim
    idx[d] = slice(start, start + length)
    return getitem(x, tuple(idx))


def index_select(x: Tensor, dim: int, index) -> Tensor:
    """Rows of ``x`` along ``dim`` picked by an integer index tensor (differentiable in x)."""
    if not isinstance(index, Tensor):
        index = K.from_numpy(np.asarray(index, dtype=np.int64), dt.int64, x._st.rt)
    d = norm_dim(dim, x.ndim, "index_select")
    xt = movedim_front(x, d)
    rest = xt.shape[1:]
    table = reshape(contiguous(xt), (xt.shape[0], numel(rest)))
    out = embedding(index, table)
    out = reshape(out, index.shape + rest)
    if d != 0:
        nd = index.ndim
        perm = list(range(nd, nd + d)) + list(range(nd)) + list(range(nd + d, out.ndim))
        out = permute(out, *perm)
    return out


def movedim_front(x: Tensor, d: int) -> Tensor:
    if d == 0:
        return x
    return permute(x, d, *[i for i in range(x.ndim) if i != d])


# -- joining and splitting -----------------------------------------------------------------------
class _Cat(Function):
    @staticmethod
    def forward(ctx, dim, *parts):
        ctx.dim = dim
        ctx.sizes = [p.shape[dim] for p in parts]
        return K.cat_raw(list(parts), dim)

    @staticmethod
    def backward(ctx, g):
        out, pos = [None], 0
        for s in ctx.sizes:
            out.append(narrow(g, ctx.dim, pos, s))
            pos += s
        return tuple(out)


def cat(tensors, dim: int = 0) -> Tensor:
    """Concatenate along ``dim`` (shapes must match elsewhere)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    ref = tensors[0]
    d = norm_dim(dim, ref.ndim, "cat")
    t = ref.dtype
    for x in tensors[1:]:
        t = dt.promote(t, x.dtype)
    for i, x in enumerate(tensors):
        if x.ndim != ref.ndim or builtins.any(a != b for j, (a, b) in enumerate(zip(x.shape, ref.shape)) if j != d):
            raise ShapeError(f"cat: tensor {i} has shape {x.shape}, which does not match {ref.shape} outside dim {d}")
    tensors = [to(x, t) for x in tensors]
    return _Cat.apply(d, *tensors)


def stack(tensors, dim: int = 0) -> Tensor:
    """Stack same-shape tensors along a new dim."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expected a non-empty list of tensors")
    for i, x in enumerate(tensors):
        if x.shape != tensors[0].shape:
            raise ShapeError(f"stack: tensor {i} has shape {x.shape}, expected {tensors[0].shape} like tensor 0")
    d = norm_dim(dim, tensors[0].ndim + 1, "stack")
    return cat([unsqueeze(x, d) for x in tensors], d)


class _Split(Function):
    """Views of consecutive pieces of ``dim``; backward concatenates the pieces' gradients
    (one buffer, zeros for pieces that got none) instead of padding each piece to full size."""

    @staticmethod
    def forward(ctx, x, sizes, d):
        ctx.sizes, ctx.dim, ctx.shape = sizes, d, x.shape
        out, pos = [], 0
        for s in sizes:
            shape, strides, off = _basic_index(x, (slice(None),) * d + (slice(pos, pos + s),))
            out.append(_view(x, shape, strides, off))
            pos += s
        return tuple(out)

    @staticmethod
    def backward(ctx, grads):
        rt = next(g for g in grads if g is not None)._st.rt
        dtype = next(g for g in grads if g is not None).dtype
        parts = []
        for g, s in zip(grads, ctx.sizes):
            if g is None:
                shape = list(ctx.shape)
                shape[ctx.dim] = s
                g = K.fill(K.empty(tuple(shape), dtype, rt), 0)
            parts.append(g)
        return K.cat_raw(parts, ctx.dim), None, None


def split(x: Tensor, split_size_or_sections, dim: int = 0) -> tuple:
    """Split into chunks of a size (the last may be smaller) or of the given sizes (views)."""
    d = norm_dim(dim, x.ndim, "split")
    n = x.shape[d]
    if isinstance(split_size_or_sections, int):
        s = split_size_or_sections
        if s <= 0:
            raise ValueError(f"split: split_size must be positive, got {s}")
        sizes = [builtins.min(s, n - i) for i in range(0, n, s)] or [0]
    else:
        sizes = list(split_size_or_sections)
        if builtins.sum(sizes) != n:
            raise ShapeError(f"split: sections {sizes} sum to {builtins.sum(sizes)}, but dim {d} has size {n}")
    if len(sizes) == 1:
        return (x,)
    return _Split.apply(x, tuple(sizes), d)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple:
    """Split into ``chunks`` nearly equal parts (views)."""
    d = norm_dim(dim, x.ndim, "chunk")
    size = -(-x.shape[d] // chunks)
    return split(x, builtins.max(size, 1), d)


def _tri_mask(x: Tensor, diagonal: int, upper: bool) -> Tensor:
    rows, cols = x.shape[-2], x.shape[-1]
    r = reshape(K.arange(rows, 0, 1, dt.int64, x._st.rt), (rows, 1))
    c = reshape(K.arange(cols, 0, 1, dt.int64, x._st.rt), (1, cols))
    return ge(c - r, diagonal) if upper else le(c - r, diagonal)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    """Lower triangle of the last two dims (others zeroed)."""
    return where(_tri_mask(x, diagonal, False), x, 0)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    """Upper triangle of the last two dims (others zeroed)."""
    return where(_tri_mask(x, diagonal, True), x, 0)


# -- linear algebra and NN ops -------------------------------------------------------------------
class _Matmul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        # Batched products (attention) may come back as a transposed view (see
        # K.matmul_any_layout); their users take any strides.
        return K.matmul_any_layout(a, b) if a.ndim > 2 and b.ndim > 2 else K.matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = matmul(g, transpose(b, -1, -2)) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            if b.ndim == 2 and a.ndim > 2:
                # B was shared by every batch matrix (a Linear weight): its gradient is one
                # [K, B*M] @ [B*M, N] product instead of B products summed afterwards, so
                # no [B, K, N] intermediate is written and no batch reduction runs.
                gb = matmul(transpose(reshape(a, (-1, a.shape[-1])), 0, 1), reshape(g, (-1, g.shape[-1])))
            else:
                gb = matmul(transpose(a, -1, -2), g)
        return ga, gb


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with PyTorch's rules: 1-D operands, batched and broadcast batch dims."""
    _check_tensor(a, "matmul"), _check_tensor(b, "matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: both arguments need at least 1 dim, got shapes {a.shape} and {b.shape}")
    a, b = _promote_pair(a, b, "matmul")
    if a.dtype.kind != "float":
        raise DTypeError(f"matmul: expected floating-point tensors, got {a.dtype.name}")
    squeeze_a = a.ndim == 1
    squeeze_b = b.ndim == 1
    if squeeze_a:
        a = unsqueeze(a, 0)
    if squeeze_b:
        b = unsqueeze(b, -1)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} are not aligned ({a.shape[-1]} != {b.shape[-2]})")
    out = _Matmul.apply(a, b)
    if squeeze_a:
        out = squeeze(out, -2)
    if squeeze_b:
        out = squeeze(out, -1)
    return out


class _Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return K.matmul(x, transpose(w, 0, 1), b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        n = ctx.needs_input_grad
        gx = matmul(g, w) if n[0] else None
        gw = None
        if n[1]:
            g2, x2 = reshape(g, (-1, g.shape[-1])), reshape(x, (-1, x.shape[-1]))
            # The same sums either way round; the CPU matmul is faster with the wider dim as
            # N (measured: [512, 1024] @ [1024, 128] ~15 GFLOP/s, [128, 1024] @ [1024, 512] ~20),
            # so a wide-output weight gets (x^T g)^T, a transposed view.
            if w.shape[0] > w.shape[1]:
                gw = transpose(matmul(transpose(x2, 0, 1), g2), 0, 1)
            else:
                gw = matmul(transpose(g2, 0, 1), x2)
        gb = sum_to_shape(g, (g.shape[-1],)) if n[2] else None
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T + bias (PyTorch's F.linear); the bias is added in the matmul's epilogue."""
    _check_tensor(x, "linear"), _check_tensor(weight, "linear")
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: expected input [..., {weight.shape[-1]}] and a 2-D weight, got {x.shape} and {weight.shape}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ShapeError(f"linear: expected a bias of shape ({weight.shape[0]},), got {bias.shape}")
    # Mixed dtypes and 1-D inputs take the general path (promotion, vector matmul).
    if (x.ndim < 2 or x.dtype is not weight.dtype or x.dtype.kind != "float"
            or (bias is not None and bias.dtype is not x.dtype)):
        y = matmul(x, transpose(weight, 0, 1))
        return y if bias is None else y + bias
    return _Linear.apply(x, weight, bias)


class _Softmax(Function):
    @staticmethod
    def forward(ctx, x, log_):
        y = K.softmax_rows(1 if log_ else 0, x)
        ctx.log_ = log_
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return K.softmax_rows(3 if ctx.log_ else 2, y, contiguous(g)), None


def _softmax_impl(x: Tensor, dim: int, log_: bool) -> Tensor:
    _check_tensor(x, "softmax")
    if x.dtype.kind != "float":
        x = to(x, dt.float32)
    if x.ndim == 0:
        return _softmax_impl(reshape(x, (1,)), 0, log_).reshape(())
    d = norm_dim(dim, x.ndim, "softmax")
    if d != x.ndim - 1:
        return transpose(_softmax_impl(transpose(x, d, -1), -1, log_), d, -1)
    return _Softmax.apply(contiguous(x), log_)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) along ``dim`` (numerically stable)."""
    return _softmax_impl(x, dim, False)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """x - logsumexp(x) along ``dim``."""
    return _softmax_impl(x, dim, True)


class _SplitHeads(Function):
    """[B, T, 3C] -> q, k, v as [B, H, T, C/H] views; backward writes each head-major
    gradient straight into its slot of one [B, T, 3C] buffer (one strided copy each,
    where reshape + split would copy twice)."""

    @staticmethod
    def forward(ctx, x, n_head):
        B, T, C3 = x.shape
        C = C3 // 3
        D = C // n_head
        sb, st, sc = x._strides
        ctx.shape = x.shape
        return tuple(_view(x, (B, n_head, T, D), (sb, D * sc, st, sc), x._off + i * C * sc) for i in range(3))

    @staticmethod
    def backward(ctx, grads):
        ref = next(g for g in grads if g is not None)
        B, T, C3 = ctx.shape
        out = K.empty(ctx.shape, ref.dtype, ref._st.rt)
        _, H, _, D = ref.shape
        for i, g in enumerate(grads):
            dst = Tensor(out._st, (B, H, T, D), (T * C3, D, C3, 1), out._off + i * (C3 // 3), ref.dtype)
            if g is None:
                K.copy_into(dst, scalar_tensor(0.0, ref.dtype, ref._st.rt))
            else:
                K.copy_into(dst, g)
        return out, None


def split_heads(qkv: Tensor, n_head: int) -> tuple:
    """q, k, v of shape [B, n_head, T, C/n_head] from a fused [B, T, 3C] projection
    (the same views as split(qkv, C, 2) then reshape and transpose(1, 2))."""
    _check_tensor(qkv, "split_heads")
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ShapeError(f"split_heads: expected [B, T, 3C] with 3C divisible by 3 * {n_head}, got {qkv.shape}")
    return _SplitHeads.apply(qkv, n_head)


class _AttentionSoftmax(Function):
    @staticmethod
    def forward(ctx, x, scale, causal):
        y = K.softmax_rows(0, x, scale=scale, causal=causal)
        ctx.scale, ctx.causal = scale, causal
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        # Masked entries have y = 0, so the mask needs no separate backward: the kernel
        # writes their gradient as 0 and scales the rest.
        return K.softmax_rows(2, y, contiguous(g), scale=ctx.scale, causal=ctx.causal), None, None


def attention_softmax(scores: Tensor, scale: float = 1.0, causal: bool = False) -> Tensor:
    """softmax(scores * scale) over the last dim, with a causal mask over the last two dims
    (query i sees keys 0..i) when ``causal``: one kernel for what is otherwise a scale, a
    where and a softmax (the same arithmetic, so the same values)."""
    _check_tensor(scores, "attention_softmax")
    if scores.dtype.kind != "float":
        raise DTypeError(f"attention_softmax: expected floating-point scores, got {scores.dtype.name}")
    if causal and (scores.ndim < 2 or scores.shape[-1] != scores.shape[-2]):
        raise ShapeError(f"attention_softmax: a causal mask needs square [..., T, T] scores, got {scores.shape}")
    return _AttentionSoftmax.apply(contiguous(scores), float(scale), bool(causal))


class _LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, w, b, eps):
        y, mean_, rstd = K.layer_norm_fwd(x, w, b, eps)
        ctx.save_for_backward(x, w, mean_, rstd)
        ctx.has_b = b is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, mean_, rstd = ctx.saved_tensors
        g = contiguous(g)
        dx = K.layer_norm_bwd_input(x, w, g, mean_, rstd) if ctx.needs_input_grad[0] else None
        need_w = w is not None and ctx.needs_input_grad[1]
        need_b = ctx.has_b and ctx.needs_input_grad[2]
        dw = db = None
        if need_w or need_b:
            dw, db = K.layer_norm_bwd_params(x, g, mean_, rstd, need_w, need_b)
        return dx, dw, db, None


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim(s) ``normalized_shape``."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if x.shape[x.ndim - len(normalized_shape):] != normalized_shape:
        raise ShapeError(f"layer_norm: input shape {x.shape} does not end with normalized_shape {normalized_shape}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != normalized_shape:
            raise ShapeError(f"layer_norm: {name} has shape {p.shape}, expected {normalized_shape}")
    C = numel(normalized_shape)
    x2 = reshape(contiguous(x), x.shape[: x.ndim - len(normalized_shape)] + (C,))
    w = reshape(contiguous(weight), (C,)) if weight is not None else None
    b = reshape(contiguous(bias), (C,)) if bias is not None else None
    y = _LayerNorm.apply(x2, w, b, float(eps))
    return reshape(y, x.shape)


class _Embedding(Function):
    @staticmethod
    def forward(ctx, idx, w):
        ctx.save_for_backward(idx)
        ctx.V = w.shape[0]
        return K.embedding_fwd(w, idx)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        host = _host_indices(idx)
        # Group positions by row on the host (stable sort): deterministic, atomics-free backward.
        order = np.argsort(host.reshape(-1), kind="stable").astype(np.int64)
        counts = np.bincount(host.reshape(-1), minlength=ctx.V)
        rowptr = np.zeros(ctx.V + 1, np.int32)
        np.cumsum(counts, out=rowptr[1:])
        rt = g._st.rt
        pos = K.from_numpy(order, dt.int64, rt)
        rp = K.from_numpy(rowptr, dt.int32, rt)
        C = g.shape[-1]
        return None, K.embedding_bwd(reshape(contiguous(g), (-1, C)), pos, rp, ctx.V)


def _host_indices(idx: Tensor) -> np.ndarray:
    """The index values on the host: from the upload's copy when unchanged, else a read-back."""
    if idx._host is not None and idx._host[0] == idx._st.version and idx.is_contiguous() and idx._off == 0 \
            and idx._host[1].size == idx.numel():
        return idx._host[1].reshape(idx.shape)
    return idx.numpy()


def embedding(idx: Tensor, weight: Tensor) -> Tensor:
    """weight[idx]: rows of a [V, C] table picked by integer indices of any shape."""
    if not isinstance(idx, Tensor):
        idx = K.from_numpy(np.asarray(idx, np.int64), dt.int64, weight._st.rt)
    if idx.dtype.kind != "int":
        raise DTypeError(f"embedding: indices must be int32 or int64, got {idx.dtype.name}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-D [num_embeddings, dim], got {weight.shape}")
    if idx.dtype is not dt.int64:
        idx = K.copy(idx, dt.int64)
    idx = contiguous(idx)
    if idx._host is not None and idx._host[0] == idx._st.version and idx._host[1].size:
        lo, hi = int(idx._host[1].min()), int(idx._host[1].max())
        if lo < 0 or hi >= weight.shape[0]:
            raise IndexError(f"embedding: index {lo if lo < 0 else hi} is out of range for a table of {weight.shape[0]} rows")
    return _Embedding.apply(idx, contiguous(weight))


class _CrossEntropy(Function):
    @staticmethod
    def forward(ctx, x, t, n_valid):
        loss, lse = K.cross_entropy_fwd(x, t)
        ctx.save_for_backward(x, t, lse)
        ctx.n = n_valid
        total, _ = K.reduce("sum", loss, (0,), 1.0 / builtins.max(n_valid, 1))
        return total if x.dtype is dt.float32 else K.copy(total, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, t, lse = ctx.saved_tensors
        gl = expand(reshape(to(g, dt.float32) * (1.0 / builtins.max(ctx.n, 1)), (1,)), (x.shape[0],))
        return K.cross_entropy_bwd(x, t, lse, contiguous(gl)), None, None


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Mean cross entropy of ``logits`` [N, V] (or [..., V]) against integer ``targets`` [N] (or [...]).

    Targets equal to ``ignore_index`` (or any negative value) contribute nothing and are
    excluded from the mean."""
    if reduction != "mean":
        raise ValueError(f"cross_entropy: only reduction='mean' is supported, got {reduction!r}")
    if not isinstance(targets, Tensor):
        targets = K.from_numpy(np.asarray(targets, np.int64), dt.int64, logits._st.rt)
    if targets.dtype.kind != "int":
        raise DTypeError(f"cross_entropy: targets must be integer class indices, got {targets.dtype.name}")
    if logits.shape[:-1] != targets.shape:
        raise ShapeError(f"cross_entropy: logits {logits.shape} need targets of shape {logits.shape[:-1]}, got {targets.shape}")
    V = logits.shape[-1]
    x = reshape(contiguous(logits), (-1, V))
    t = reshape(contiguous(to(targets, dt.int64)), (-1,))
    host = _host_indices(t) if t._host is not None else None
    if host is not None:
        bad = host[(host >= V) & (host != ignore_index)]
        if bad.size:
            raise IndexError(f"cross_entropy: target {int(bad[0])} is out of range for {V} classes")
        n_valid = int(np.count_nonzero((host >= 0) & (host < V)))
        if ignore_index >= 0:
            n_valid -= int(np.count_nonzero(host == ignore_index))
            t = where(eq(t, ignore_index), -1, t) if (host == ignore_index).any() else t
    else:
        n_valid = int(K.reduce("sum", K.binary("ge", t, scalar_tensor(0, dt.int64, t._st.rt)), (0,))[0].item())
    if x.dtype.kind != "float":
        x = to(x, dt.float32)
    return _CrossEntropy.apply(x, t, n_valid)


class _Dropout(Function):
    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return _mask_scale(x, mask, scale)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return _mask_scale(g, mask, ctx.scale), None, None


def _mask_scale(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    zero = scalar_tensor(0.0, x.dtype, x._st.rt)
    return K.unary("mul_s", K.where(mask, x, zero), scale)


def dropout(x: Tensor, p: float = 0.5, training: bool = True, generator=None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (identity when not training)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    from helios.random import default_generator

    gen = generator or default_generator()
    seed, offset = gen.next_offset()
    mask = K.rng(x.shape, dt.bool_, 2, seed, offset, float(p), 0.0, x._st.rt)
    return _Dropout.apply(x, mask, 1.0 / (1.0 - p))


# -- in-place ops (only outside autograd) --------------------------------------------------------
def _check_inplace(x: Tensor, op: str) -> None:
    if is_grad_enabled() and (x.requires_grad):
        raise RuntimeError(f"{op}: in-place op on a tensor that requires grad is not supported "
                           "(it would corrupt the tape); use the out-of-place form, or wrap the update in helios.no_grad()")


def copy_(x: Tensor, src) -> Tensor:
    """Copy ``src`` (a tensor broadcastable to x, a numpy array or a number) into ``x`` in place."""
    _check_inplace(x, "copy_")
    if isinstance(src, np.ndarray):
        if src.shape != x.shape:
            broadcast_shapes("copy_", src.shape, x.shape)
        if x.is_contiguous() and src.shape == x.shape and x.dtype is not dt.bfloat16 and not x._st.nbytes > x._st.rt.max_range:
            host = np.ascontiguousarray(src, dtype=x.dtype.np_storage)
            x._st.rt.dev.write(x._st.handle, x._off * x.dtype.itemsize, host.reshape(-1).view(np.uint8))
            x._st.version += 1
            return x
        src = K.from_numpy(src, dt.from_numpy_dtype(src.dtype) if src.dtype != np.float64 else x.dtype, x._st.rt)
    if isinstance(src, Number):
        src = scalar_tensor(src, x.dtype, x._st.rt)
    if src.shape != x.shape:
        broadcast_shapes("copy_", src.shape, x.shape)
    K.copy_into(x, src)
    x._st.version += 1
    return x


def _inplace_binary(name, fn):
    def f(x: Tensor, other, *args, **kw) -> Tensor:
        _check_inplace(x, name)
        r = fn(x, other, *args, **kw)
        if r.shape != x.shape:
            raise ShapeError(f"{name}: result shape {r.shape} does not fit the in-place target {x.shape}")
        K.copy_into(x, r)
        x._st.version += 1
        return x

    f.__name__ = name
    f.__doc__ = f"In-place {name.rstrip('_')}."
    return f


add_ = _inplace_binary("add_", add)
sub_ = _inplace_binary("sub_", sub)
mul_ = _inplace_binary("mul_", mul)
div_ = _inplace_binary("div_", div)
masked_fill_ = _inplace_binary("masked_fill_", masked_fill)


def clamp_(x: Tensor, min=None, max=None) -> Tensor:
    _check_inplace(x, "clamp_")
    K.copy_into(x, clamp(x, min, max))
    x._st.version += 1
    return x


def zero_(x: Tensor) -> Tensor:
    return fill_(x, 0)


def fill_(x: Tensor, value) -> Tensor:
    """Set every element to ``value`` in place."""
    _check_inplace(x, "fill_")
    if x.is_contiguous():
        K.fill(x, value)
    else:
        K.copy_into(x, scalar_tensor(value, x.dtype, x._st.rt))
    x._st.version += 1
    return x


def full_like(x: Tensor, value, dtype=None) -> Tensor:
    """A new tensor of x's shape filled with ``value``."""
    return K.fill(K.empty(x.shape, dt.as_dtype(dtype) if dtype else x.dtype, x._st.rt), value)


def zeros_like(x: Tensor, dtype=None) -> Tensor:
    return full_like(x, 0, dtype)


def ones_like(x: Tensor, dtype=None) -> Tensor:
    return full_like(x, 1, dtype)


# -- attach the methods to Tensor ----------------------------------------------------------------
def _install_methods() -> None:
    import helios.tensor as tensor_mod

    tensor_mod.F = __import__("helios.functional", fromlist=["_"])
    direct = ["exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "abs", "sin", "cos", "neg", "gelu", "square",
              "maximum", "minimum", "clamp", "clamp_", "sum", "mean", "var", "std", "max", "min", "argmax", "argmin",
              "reshape", "view", "permute", "transpose", "expand", "squeeze", "unsqueeze", "flatten", "narrow",
              "contiguous", "clone", "to", "matmul", "softmax", "log_softmax", "masked_fill", "masked_fill_",
              "split", "chunk", "tril", "triu", "add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge",
              "copy_", "add_", "sub_", "mul_", "div_", "zero_", "fill_", "index_select", "logical_not", "logical_and",
              "logical_or"]
    g = globals()
    for name in direct:
        setattr(Tensor, name, g[name])
    Tensor.T = property(lambda self: permute(self, *reversed(range(self.ndim))))
    Tensor.mT = property(lambda self: transpose(self, -2, -1))
    Tensor.float = lambda self: to(self, dt.float32)
    Tensor.half = lambda self: to(self, dt.float16)
    Tensor.bfloat16 = lambda self: to(self, dt.bfloat16)
    Tensor.long = lambda self: to(self, dt.int64)
    Tensor.int = lambda self: to(self, dt.int32)
    Tensor.bool = lambda self: to(self, dt.bool_)
    Tensor.expand_as = lambda self, o: expand(self, o.shape)
    Tensor.view_as = lambda self, o: view(self, o.shape)
    Tensor.type_as = lambda self, o: to(self, o.dtype)


_install_methods()
