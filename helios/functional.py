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
from helios import _transfer
from helios import amp as _amp
from helios import dtypes as dt
from helios import graph
from helios._shape import (broadcast_shapes, contiguous_strides, infer_reshape, norm_dim, norm_dims, numel,
                           view_strides)
from helios.autograd.tape import NO_CONTEXT, Function, is_grad_enabled
from helios.errors import DTypeError, InPlaceError, ShapeError
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
    key = (value, type(value), math.copysign(1.0, value) if isinstance(value, float) else 0, dtype, id(rt))
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


_KIND_RANK = {"bool": 0, "int": 1, "float": 2}


def result_type(*operands) -> dt.DType:
    """The dtype PyTorch's type promotion gives ``operands`` (tensors, numbers, None): tensors
    with dims promote each other; 0-d tensors, then Python numbers, only count where they
    are of a higher kind (bool < int < float) than everything before them."""
    tensors = [o for o in operands if isinstance(o, Tensor)]
    dims = [t.dtype for t in tensors if t.ndim]
    zero_d = [t.dtype for t in tensors if not t.ndim]
    out = None
    for rank, group in enumerate((dims, zero_d) if dims else (zero_d,)):
        for d in group:
            if out is None:
                out = d
            elif rank == 0:
                out = dt.promote(out, d)
            elif _KIND_RANK[d.kind] > _KIND_RANK[out.kind]:
                out = d
    for o in operands:
        if isinstance(o, Number) and not isinstance(o, Tensor):
            kind = "bool" if isinstance(o, bool) else "int" if isinstance(o, int) else "float"
            if out is None:
                out = {"bool": dt.bool_, "int": dt.int64, "float": dt.float32}[kind]
            elif _KIND_RANK[kind] > _KIND_RANK[out.kind]:
                out = dt.int64 if kind == "int" else dt.float32
    if out is None:
        raise TypeError("result_type: expected at least one tensor or number")
    return out


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
        dest = ctx.grad_out(0)  # a float32 master weight's slot under autocast: convert straight into it
        if dest is not None and dest.dtype is ctx.src and dest.shape == g.shape:
            K.copy_into(dest, g)
            return dest, None
        return K.copy(g, ctx.src), None


def check_memory_format(op: str, memory_format) -> None:
    """Accept PyTorch's memory_format arguments that Helios honours: None, "preserve_format"
    and "contiguous_format" (results are row-major); any other layout is a ShapeError."""
    if memory_format is None:
        return
    name = str(memory_format).rsplit(".", 1)[-1]
    if name not in ("preserve_format", "contiguous_format"):
        raise ShapeError(f"{op}: memory_format {name!r} is not supported: Helios results are row-major "
                         "(contiguous_format); permute the tensor for another layout")


def to(x: Tensor, *args, dtype=None, device=None, non_blocking: bool = False, copy: bool = False,
       memory_format=None) -> Tensor:
    """``x`` as ``dtype`` and/or on ``device``, with PyTorch's forms: ``to(dtype)``,
    ``to(device, dtype)``, ``to(other)`` (other's dtype and device), then ``non_blocking``
    and ``copy`` (True: always a new tensor; ``non_blocking`` changes nothing, every op is
    asynchronous).  The same tensor when nothing changes.
    Devices: "cpu" (host memory: see helios.runtime.HostRuntime) and "vulkan:N"; a move is
    differentiable (the gradient moves back) and is followed by the dtype cast, if any."""
    _check_tensor(x, "to")
    device, dtype, copy = _transfer.parse_to_args(args, {"device": device, "dtype": dtype, "copy": copy})
    if device is not None and get_runtime(device) is not x._st.rt:
        x, copy = _transfer.to_device(x, device), False  # a new tensor already
    d = x.dtype if dtype is None else dtype
    check_memory_format("to", memory_format)
    if d is x.dtype:
        return clone(x) if copy else x
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
    gb = None
    if ctx.needs_input_grad[1]:
        if b.dtype.kind == "float" and b.dtype.itemsize == 2:
            # In float32 and rounded once, as PyTorch does: in half precision b * b leaves the
            # normal range for |b| < 0.008 and g * a / (b * b) lost a percent on a GPU.
            gb = neg(g.to(dt.float32) * a.to(dt.float32) / (b.to(dt.float32) * b.to(dt.float32))).to(b.dtype)
        else:
            gb = neg(g * a / (b * b))
    return ga, gb


def _bwd_pow(ctx, g):
    # PyTorch's rules: d/da = b * a^(b-1), zero where b == 0 (even at a == 0, where the
    # formula is 0 * inf); d/db = a^b * log(a), zero where a == 0 and b >= 0 (0 * -inf).
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = g * where(eq(b, 0.0), 0.0, b * pow(a, b - 1.0))
    if ctx.needs_input_grad[1]:
        gb = g * where(logical_and(eq(a, 0.0), ge(b, 0.0)), 0.0, pow(a, b) * log(a))
    return ga, gb


def _tie_weights(a: Tensor, b: Tensor, dtype, a_wins_if) -> Tensor:
    """The share of a maximum's (or minimum's) gradient that goes to ``a``: 1 where ``a`` was
    picked, 0 where ``b`` was, 1/2 on ties (PyTorch's rule), and 1 where either is NaN
    (NaN propagates, and so does the gradient, to both)."""
    lose = to(lt(a, b) if a_wins_if == "gt" else gt(a, b), dtype)
    tie = to(eq(a, b), dtype)
    return rsub(lose + tie * 0.5, 1.0)


def _bwd_maximum(ctx, g):
    a, b = ctx.saved_tensors
    ga = g * _tie_weights(a, b, g.dtype, "gt") if ctx.needs_input_grad[0] else None
    gb = g * _tie_weights(b, a, g.dtype, "gt") if ctx.needs_input_grad[1] else None
    return ga, gb


def _bwd_minimum(ctx, g):
    a, b = ctx.saved_tensors
    ga = g * _tie_weights(a, b, g.dtype, "lt") if ctx.needs_input_grad[0] else None
    gb = g * _tie_weights(b, a, g.dtype, "lt") if ctx.needs_input_grad[1] else None
    return ga, gb


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
            if p0 == 0.0:  # x ** 0 is constant (PyTorch: a zero gradient, also at x == 0)
                r = K.fill(K.empty(g.shape, g.dtype, g._st.rt), 0)
            else:
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


def rsub(x: Tensor, s, alpha: float = 1.0) -> Tensor:
    """s - alpha * x (PyTorch's rsub)."""
    if alpha != 1.0:
        x = mul(x, alpha)
    if isinstance(s, Number):
        x = _float_result(x, s)
        return _UnaryScalar.apply(x, "rsub_s", float(s), 0.0)
    return sub(_as_tensor_like(s, x), x)


def mul(a, b) -> Tensor:
    """a * b, broadcasting."""
    if isinstance(b, Number) and isinstance(a, Tensor):
        if a.dtype is dt.bool_ and isinstance(b, bool):
            return logical_and(a, b)  # bool * bool stays bool
        if a.dtype is dt.bool_:
            a = to(a, dt.int64 if isinstance(b, int) else dt.float32)
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "mul_s", float(b), 0.0)
    a, b = _promote_pair(_check_tensor(a, "mul"), _as_tensor_like(b, a), "mul")
    return _Mul.apply(a, b)


def div(a, b, rounding_mode: str | None = None) -> Tensor:
    """a / b: true division (integer inputs give float32), or with ``rounding_mode`` "trunc"
    (round toward zero) or "floor" (round down), which keep integer dtypes and, as in
    PyTorch, carry no gradient."""
    if rounding_mode is not None:
        return _div_rounded(a, b, rounding_mode)
    if isinstance(b, Number) and isinstance(a, Tensor):
        if a.dtype.kind != "float":
            a = to(a, dt.float32)
        return _UnaryScalar.apply(a, "div_s", float(b), 0.0)
    a, b = _promote_pair(_check_tensor(a, "div"), _as_tensor_like(b, a), "div")
    if a.dtype.kind != "float":
        a, b = to(a, dt.float32), to(b, dt.float32)
    return _Div.apply(a, b)


def _div_rounded(a, b, mode: str) -> Tensor:
    if mode not in ("trunc", "floor"):
        raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {mode!r}")
    a = _check_tensor(a, "div")
    if isinstance(b, Number):
        b = scalar_tensor(b, dt.scalar_result(a.dtype, b) if not isinstance(b, bool) else a.dtype, a._st.rt)
    a, b = _promote_pair(a, _as_tensor_like(b, a), "div")
    if a.dtype is dt.bool_:
        a, b = to(a, dt.int64), to(b, dt.int64)
    if a.dtype.kind == "int" and _host_has_zero(b):
        raise ZeroDivisionError("div: integer division by zero")
    return _DivRounded.apply(a, b, "div_trunc" if mode == "trunc" else "div_floor")


class _DivRounded(Function):
    """Rounded division: a step function, so (as in PyTorch) its gradient is zero."""

    @staticmethod
    def forward(ctx, a, b, op):
        return K.binary(op, a, b)

    @staticmethod
    def backward(ctx, g):
        return None, None, None


def _host_has_zero(t: Tensor) -> bool:
    """Whether the host copy of ``t`` (when it has a current one) holds a zero."""
    h = t._host
    return h is not None and h[0] == t._st.version and h[1].size == t.numel() and not h[1].all()


def rdiv(x: Tensor, s) -> Tensor:
    """s / x."""
    if isinstance(s, Number):
        if x.dtype.kind != "float":
            x = to(x, dt.float32)
        return _UnaryScalar.apply(x, "rdiv_s", float(s), 0.0)
    return div(_as_tensor_like(s, x), x)


def pow(a, b) -> Tensor:
    """a ** b elementwise (either may be a number), with C's special cases: a negative base
    with a non-integer exponent gives NaN, 0 ** negative gives inf, x ** 0 gives 1.

    dtypes as in PyTorch: an integer (or bool) tensor to an integer power stays integer
    (exact, by repeated squaring; a negative scalar exponent is refused), any float makes
    the result float."""
    if isinstance(a, Number) and isinstance(b, Tensor):
        return rpow(b, a)
    _check_tensor(a, "pow")
    if isinstance(b, Number):
        if a.dtype.kind != "float" and not isinstance(b, float):
            b = int(b)
            if b < 0:
                raise DTypeError(f"pow: integers to negative integer powers are not allowed ({a.dtype.name} tensor ** {b}); "
                                 "convert the tensor to a floating-point dtype first")
            if a.dtype is dt.bool_:
                a = to(a, dt.int64)
            return K.binary("pow", a, scalar_tensor(b, a.dtype, a._st.rt))
        a = _float_result(a, b)
        if b == 1:
            return a * 1.0
        return _UnaryScalar.apply(a, "pow_s", float(b), 0.0)
    a, b = _promote_pair(a, _as_tensor_like(b, a), "pow")
    if a.dtype.kind != "float":
        if a.dtype is dt.bool_:
            a, b = to(a, dt.int64), to(b, dt.int64)
        return K.binary("pow", a, b)
    return _Pow.apply(a, b)


def rpow(x: Tensor, s) -> Tensor:
    """s ** x (``s`` a number or a tensor)."""
    if isinstance(s, Tensor):
        return pow(s, x)
    if isinstance(s, (int, bool)) and x.dtype.kind != "float":
        t = dt.int64 if x.dtype is dt.bool_ else x.dtype
        return pow(scalar_tensor(int(s), t, x._st.rt), to(x, t))
    xf = x if x.dtype.kind == "float" else to(x, dt.float32)
    return pow(_as_tensor_like(float(s), xf), xf)


def maximum(a: Tensor, b) -> Tensor:
    """Elementwise max (NaN propagates)."""
    a, b = _promote_pair(_check_tensor(a, "maximum"), _as_tensor_like(b, a), "maximum")
    return _Maximum.apply(a, b)


def minimum(a: Tensor, b) -> Tensor:
    """Elementwise min (NaN propagates)."""
    a, b = _promote_pair(_check_tensor(a, "minimum"), _as_tensor_like(b, a), "minimum")
    return _Minimum.apply(a, b)


class _ClampT(Function):
    """clamp with tensor bounds (either may be None), with PyTorch's gradients: x's where
    lo <= x <= hi, lo's where x < lo (and lo < hi), hi's where x > hi (or hi < lo)."""

    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.save_for_backward(x, lo, hi)
        y = x
        if lo is not None:
            y = K.binary("maximum", y, lo)
        if hi is not None:
            y = K.binary("minimum", y, hi)
        if y is x:
            y = K.copy(x)
        return y

    @staticmethod
    def backward(ctx, g):
        x, lo, hi = ctx.saved_tensors
        n = ctx.needs_input_grad
        gx = glo = ghi = None
        if n[0]:
            inside = None
            if lo is not None:
                inside = ge(x, lo)
            if hi is not None:
                inside = le(x, hi) if inside is None else logical_and(inside, le(x, hi))
            gx = g if inside is None else where(inside, g, 0.0)
        if lo is not None and n[1]:
            m = lt(x, lo) if hi is None else logical_and(lt(x, lo), lt(lo, hi))
            glo = where(m, g, 0.0)
        if hi is not None and n[2]:
            m = gt(x, hi) if lo is None else logical_or(gt(x, hi), lt(hi, lo))
            ghi = where(m, g, 0.0)
        return gx, glo, ghi


def clamp(x: Tensor, min=None, max=None) -> Tensor:
    """Clamp into [min, max] (either may be None, a number or a tensor that broadcasts); NaN
    stays NaN, and min > max gives max everywhere, as in PyTorch."""
    _check_tensor(x, "clamp")
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        t = result_type(x, min, max)
        if t is dt.bool_:
            raise DTypeError("clamp: bool tensors cannot be clamped")
        lo = to(_as_tensor_like(min, x), t) if min is not None else None
        hi = to(_as_tensor_like(max, x), t) if max is not None else None
        return _ClampT.apply(to(x, t), lo, hi)
    if x.dtype.kind != "float":
        if not isinstance(min, float) and not isinstance(max, float):
            # integer bounds stay exact (no float32 round trip): max/min kernels of x's dtype
            if x.dtype is dt.bool_:
                raise DTypeError("clamp: bool tensors cannot be clamped")
            lo = scalar_tensor(int(min), x.dtype, x._st.rt) if min is not None else None
            hi = scalar_tensor(int(max), x.dtype, x._st.rt) if max is not None else None
            return _ClampT.forward(NO_CONTEXT, x, lo, hi)
        x = to(x, dt.float32)
    lo = -math.inf if min is None else float(min)
    hi = math.inf if max is None else float(max)
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
_relu = _unary("relu")
abs = _unary("abs")
sin = _unary("sin")
cos = _unary("cos")
_neg = _unary("neg")


def neg(x: Tensor) -> Tensor:
    """-x."""
    if x.dtype is dt.bool_:
        raise DTypeError("neg: negation of a bool tensor is not supported; use logical_not")
    return _neg(x)


def relu(x: Tensor) -> Tensor:
    """max(x, 0) elementwise (integer tensors stay integer, as in PyTorch)."""
    _check_tensor(x, "relu")
    if x.dtype.kind != "float":
        if x.dtype is dt.bool_:
            raise DTypeError("relu: bool tensors are not supported; convert to an integer or float dtype")
        return K.binary("maximum", x, scalar_tensor(0, x.dtype, x._st.rt))
    return _relu(x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU: exact (erf) with approximate="none", or the tanh approximation with "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dtype.kind != "float":
        x = to(x, dt.float32)
    return _Unary.apply(x, "gelu" if approximate == "none" else "gelu_tanh")


def square(x: Tensor) -> Tensor:
    """x * x (integer tensors stay integer, bool becomes int64, as in PyTorch)."""
    _check_tensor(x, "square")
    if x.dtype.kind != "float":
        x = to(x, dt.int64) if x.dtype is dt.bool_ else x
        return K.binary("mul", x, x)
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
    """``x`` with ``value`` where ``mask`` is true (x and mask broadcast; the result keeps x's
    dtype, as in PyTorch).  ``value`` is a number or a 0-d tensor (differentiable)."""
    _check_tensor(x, "masked_fill")
    broadcast_shapes("masked_fill", x.shape, mask.shape)
    if isinstance(value, Tensor):
        if value.ndim:
            raise ShapeError(f"masked_fill: value must be a number or a 0-d tensor, got shape {value.shape}")
        return where(mask, to(value, x.dtype), x)
    return where(mask, scalar_tensor(value, x.dtype, x._st.rt), x)


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
    _check_tensor(x, "sum")
    if dtype is not None:
        x = to(x, dtype)
    if _amp.state.dtype is not None:  # autocast: summed in float32
        (x,) = _amp.fp32(x)
    dims = _reduce_dims(dim, x.ndim, "sum")
    return _Sum.apply(x, dims, keepdim, 1.0)


def mean(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """Mean over ``dim`` (None or () = all dims); ``dtype`` converts the input first."""
    _check_tensor(x, "mean")
    if dtype is not None:
        x = to(x, dtype)
    if x.dtype.kind != "float":
        raise DTypeError(f"mean: expected a floating-point tensor, got {x.dtype.name} (use .to(helios.float32))")
    dims = _reduce_dims(dim, x.ndim, "mean")
    R = numel(tuple(x.shape[d] for d in dims))
    return _Sum.apply(x, dims, keepdim, 1.0 / R if R else math.nan)


def _var_args(op: str, x: Tensor, dim, unbiased, correction) -> tuple:
    """(dims, correction) from PyTorch's two signatures: ``op(x, dim=None, *, correction=1,
    keepdim=False)`` and the older ``op(x, unbiased)`` / ``op(x, dim, unbiased, keepdim)``."""
    _check_tensor(x, op)
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
        return where(eq(y, 0.0), 0.0, g / (y * 2.0))


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
        idx = reshape(ctx.idx, tuple(1 if i == dim else s for i, s in enumerate(shape)))
        pos = reshape(K.arange(shape[dim], 0, 1, dt.int64), tuple(shape[dim] if i == dim else 1 for i in range(len(shape))))
        if not ctx.keepdim:
            g = reshape(g, tuple(1 if i == dim else s for i, s in enumerate(shape)))
        return where(eq(pos, idx), g, 0.0), None, None, None


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
        hit = logical_or(eq(x, v), logical_and(ne(v, v), ne(x, x)))
        m = to(hit, g.dtype)
        return m * (g / sum(m)), None


def _maxmin(op):
    def f(x: Tensor, dim=None, keepdim: bool = False):
        _check_tensor(x, op)
        if isinstance(dim, Tensor):  # max(x, other): the elementwise maximum, as torch.max(input, other)
            return (maximum if op == "max" else minimum)(x, dim)
        if dim is None:
            if x.numel() == 0:
                raise ShapeError(f"{op}(): the tensor is empty; give dim= or a non-empty tensor")
            return _MaxMinAll.apply(x, op)
        d = norm_dim(dim, x.ndim, op)
        if x.ndim == 0:
            return MaxMin(clone(x), K.fill(K.empty((), dt.int64, x._st.rt), 0))
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


def _argext(op: str, x: Tensor, dim, keepdim: bool) -> Tensor:
    _check_tensor(x, op)
    if dim is not None:
        norm_dim(dim, x.ndim, op)
    if x.ndim == 0:
        return K.fill(K.empty((), dt.int64, x._st.rt), 0)
    if dim is None:
        r = K.reduce(op, reshape(x, (-1,)), (0,))[1]
        return reshape(r, (1,) * x.ndim) if keepdim else r
    d = norm_dim(dim, x.ndim, op)
    return _keep(K.reduce(op, x, (d,))[1], x.shape, (d,), keepdim)


def argmax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the (first) maximum over ``dim`` (None = of the flattened tensor; a NaN counts
    as the maximum, as in PyTorch)."""
    return _argext("argmax", x, dim, keepdim)


def argmin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the (first) minimum over ``dim`` (None = of the flattened tensor)."""
    return _argext("argmin", x, dim, keepdim)


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
        out = _view(x, shape, st, x._off)
        if x._host is not None and x.is_contiguous():  # the same elements in the same order: the host copy holds
            out._host = x._host
        return out

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

    @staticmethod
    def grad_dest(node, i: int, resolve):
        """The input's gradient destination (if its producer offers one), permuted: a
        gradient written there comes out of backward as that destination's view."""
        d = resolve(node.inputs[0])
        if d is None:
            return None
        perm = node.ctx.perm
        return _view(d, [d.shape[p] for p in perm], [d._strides[p] for p in perm], d._off)


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


def _is_array_index(i) -> bool:
    return isinstance(i, (Tensor, list, np.ndarray))


def getitem(x: Tensor, idx) -> Tensor:
    """x[idx] with PyTorch's indexing: ints, slices (with steps), None and ... give views;
    integer tensors, lists and arrays and bool masks (advanced indexing) give a gather."""
    _check_tensor(x, "getitem")
    if isinstance(idx, Tensor) and idx.dtype.kind == "int" and idx.ndim and x.ndim:
        # x[t]: rows of dim 0, negative indices counted from the end (no host round trip)
        n = x.shape[0]
        h = idx._host
        if h is not None and h[0] == idx._st.version and h[1].size == idx.numel() and h[1].size:
            if h[1].min() < -n or h[1].max() >= n:
                bad = int(h[1].min()) if h[1].min() < -n else int(h[1].max())
                raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {n}")
        t = idx if idx.dtype is dt.int64 else to(idx, dt.int64)
        return _gather(x, 0, where(lt(t, 0), t + n, t))
    items = idx if isinstance(idx, tuple) else (idx,)
    if builtins.any(_is_array_index(i) for i in items):
        return _advanced_getitem(x, items)
    shape, strides, off = _basic_index(x, idx)
    return _Slice.apply(x, shape, strides, off)


def _index_host(i) -> np.ndarray:
    """An advanced index on the host: int64, or bool for a mask."""
    a = _host_indices(i) if isinstance(i, Tensor) else np.asarray(i)
    if a.dtype == np.bool_:
        return a
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise IndexError(f"tensors used as indices must be integer or bool, got {a.dtype}")
    return a.astype(np.int64)


def _advanced_getitem(x: Tensor, items: tuple) -> Tensor:
    """x[items] where some items are index arrays (PyTorch's rules): the basic items (ints,
    slices, None, ...) make a view first; the index arrays (a bool mask counts as one array per
    dim it covers) broadcast together to the result's index shape, which replaces their dims,
    in place when they are next to each other, else in front."""
    entries = []  # ("adv", int64 array) or ("basic", item)
    for i in items:
        if _is_array_index(i):
            a = _index_host(i)
            if a.dtype == np.bool_:
                if a.ndim == 0:
                    raise IndexError("a 0-d bool index is not supported; use None to add a dim")
                entries.extend(("adv", nz.astype(np.int64), a.shape[k], k) for k, nz in enumerate(np.nonzero(a)))
            else:
                entries.append(("adv", a, None, None))
        else:
            entries.append(("basic", i, None, None))
    used = builtins.sum(1 for e in entries if e[0] == "adv" or (e[1] is not None and e[1] is not Ellipsis))
    if used > x.ndim:
        raise IndexError(f"too many indices for a tensor of {x.ndim} dims")
    if builtins.sum(1 for e in entries if e[0] == "basic" and e[1] is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    full = []
    for e in entries:
        if e[0] == "basic" and e[1] is Ellipsis:
            full.extend([("basic", slice(None), None, None)] * (x.ndim - used))
        else:
            full.append(e)
    if not builtins.any(e[0] == "basic" and e[1] is Ellipsis for e in entries):
        full.extend([("basic", slice(None), None, None)] * (x.ndim - used))
    basic, adv_pos, arrays, vdim = [], [], [], 0
    for kind, i, mask_size, _ in full:
        if kind == "adv":
            basic.append(slice(None))
            adv_pos.append(vdim)
            arrays.append((i, mask_size))
            vdim += 1
        else:
            basic.append(i)
            if not (isinstance(i, (int, np.integer)) and not isinstance(i, bool)):
                vdim += 1
    shape, strides, off = _basic_index(x, tuple(basic))
    view = _Slice.apply(x, shape, strides, off)
    sizes = [view.shape[p] for p in adv_pos]
    wrapped = []
    for (a, mask_size), n, p in zip(arrays, sizes, adv_pos):
        if mask_size is not None and mask_size != n:
            raise IndexError(f"the shape of the mask does not match the indexed tensor's dim {p} ({mask_size} vs {n})")
        if a.size and (a.min() < -n or a.max() >= n):
            bad = int(a.min()) if a.min() < -n else int(a.max())
            raise IndexError(f"index {bad} is out of bounds for dimension {p} with size {n}")
        wrapped.append(np.where(a < 0, a + n, a))
    try:
        bcast = np.broadcast_arrays(*wrapped)
    except ValueError:
        raise IndexError("shape mismatch: indexing arrays could not be broadcast together with shapes "
                         + ", ".join(str(a.shape) for a in wrapped)) from None
    lin = np.zeros(bcast[0].shape, np.int64)
    for a, n in zip(bcast, sizes):
        lin = lin * n + a
    rest = [d for d in range(view.ndim) if d not in adv_pos]
    order = adv_pos + rest
    vp = permute(view, *order) if order != list(range(view.ndim)) else view
    flat = reshape(vp, (numel(tuple(sizes)),) + tuple(view.shape[d] for d in rest))
    out = _gather(flat, 0, K.from_numpy(lin, dt.int64, x._st.rt))
    p0 = adv_pos[0]
    if adv_pos == list(range(p0, p0 + len(adv_pos))) and p0 > 0:
        nb = lin.ndim
        out = permute(out, *(list(range(nb, nb + p0)) + list(range(nb)) + list(range(nb + p0, out.ndim))))
    return out


def setitem(x: Tensor, idx, value) -> None:
    """x[idx] = value (in place); integer arrays, lists and bool masks in ``idx`` write the
    elements x[idx] reads (see :func:`_advanced_setitem`)."""
    _check_inplace(x, "setitem")
    items = idx if isinstance(idx, tuple) else (idx,)
    if builtins.any(_is_array_index(i) for i in items):
        _advanced_setitem(x, items, value)
        return
    shape, strides, off = _basic_index(x, idx)
    target = Tensor(x._st, shape, strides, off, x.dtype)
    if isinstance(value, Tensor):
        if value.shape != shape:
            broadcast_shapes("setitem", value.shape, shape)
        K.copy_into(target, value)  # the copy kernel converts dtypes
    else:
        K.copy_into(target, scalar_tensor(value, x.dtype, x._st.rt))
    x._st.version += 1


def narrow(x: Tensor, dim: int, start, length: int) -> Tensor:
    """The slice [start, start+length) of ``dim`` (a view); ``start`` may be negative (from
    the end) or a 0-d integer tensor, as in PyTorch."""
    _check_tensor(x, "narrow")
    d = norm_dim(dim, x.ndim, "narrow")
    start = int(start.item()) if isinstance(start, Tensor) else int(start)
    length = int(length.item()) if isinstance(length, Tensor) else int(length)
    size = x.shape[d] if x.ndim else 1
    if start < 0:
        start += size
    if not 0 <= start <= size or length < 0 or start + length > size:
        raise IndexError(f"narrow: start {start} with length {length} is out of range for dim {d} of size {size}")
    idx = [slice(None)] * x.ndim
    idx[d] = slice(start, start + length)
    return getitem(x, tuple(idx))


def index_select(x: Tensor, dim: int, index) -> Tensor:
    """Entries of ``x`` along ``dim`` picked by a 1-D (or 0-d) integer index (differentiable in x)."""
    _check_tensor(x, "index_select")
    if not isinstance(index, Tensor):
        index = K.from_numpy(np.asarray(index, dtype=np.int64), dt.int64, x._st.rt)
    if index.dtype.kind != "int":
        raise DTypeError(f"index_select: the index must be int32 or int64, got {index.dtype.name}")
    d = norm_dim(dim, x.ndim, "index_select")
    if x.ndim == 0:  # a 0-d tensor has one entry: the result is 0-d too
        if index.numel() != 1:
            raise IndexError(f"index_select: a 0-d tensor needs a one-element index, got shape {index.shape}")
        return reshape(_gather(reshape(x, (1,)), 0, reshape(index, (1,))), ())
    if index.ndim == 0:
        index = reshape(index, (1,))
    return _gather(x, d, index)


def _gather(x: Tensor, d: int, index: Tensor) -> Tensor:
    """x's entries along dim ``d`` at an integer ``index`` of any shape (the index's dims
    replace dim ``d``)."""
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


def _rows(t: Tensor) -> Tensor:
    """``t`` as a matrix [rows, last dim] (explicit sizes: reshape(-1, n) is ambiguous when
    the tensor is empty)."""
    return reshape(t, (numel(t.shape[:-1]), t.shape[-1]))


def movedim_front(x: Tensor, d: int) -> Tensor:
    if d == 0:
        return x
    return permute(x, d, *[i for i in range(x.ndim) if i != d])


# -- joining and splitting -----------------------------------------------------------------------
class _Cat(Function):
    @staticmethod
    def forward(ctx, dim, skip, *parts):
        ctx.dim = dim
        ctx.sizes = [None if s else p.shape[dim] for p, s in zip(parts, skip)]
        return K.cat_raw([p for p, s in zip(parts, skip) if not s], dim)

    @staticmethod
    def backward(ctx, g):
        out, pos = [None, None], 0
        for s in ctx.sizes:
            if s is None:  # a skipped (0,) tensor: an empty gradient
                out.append(K.empty((0,), g.dtype, g._st.rt))
                continue
            out.append(narrow(g, ctx.dim, pos, s))
            pos += s
        return tuple(out)


def cat(tensors, dim: int = 0) -> Tensor:
    """Concatenate along ``dim`` (shapes must match elsewhere).  As in PyTorch, 1-D empty
    tensors (shape (0,)) are skipped when other tensors have more dims."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    skip = tuple(x.shape == (0,) for x in tensors)
    if builtins.all(skip) or not builtins.any(skip):
        skip = (False,) * len(tensors)
    ref = next(x for x, s in zip(tensors, skip) if not s)
    d = norm_dim(dim, ref.ndim, "cat")
    t = ref.dtype
    for x in tensors:
        t = dt.promote(t, x.dtype)
    for i, (x, s) in enumerate(zip(tensors, skip)):
        if s:
            continue
        if x.ndim != ref.ndim or builtins.any(a != b for j, (a, b) in enumerate(zip(x.shape, ref.shape)) if j != d):
            raise ShapeError(f"cat: tensor {i} has shape {x.shape}, which does not match {ref.shape} outside dim {d}")
    tensors = [to(x, t) for x in tensors]
    return _Cat.apply(d, skip, *tensors)


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
        if a.ndim > 2 and b.ndim > 2:
            return K.matmul_any_layout(a, b, out=_heads_out(a, b))
        return K.matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = _mm_grad(ctx, 0, g, transpose(b, -1, -2)) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            if b.ndim == 2 and a.ndim > 2:
                # B was shared by every batch matrix (a Linear weight): its gradient is one
                # [K, B*M] @ [B*M, N] product instead of B products summed afterwards, so
                # no [B, K, N] intermediate is written and no batch reduction runs.
                gb = _mm_grad(ctx, 1, transpose(_rows(a), 0, 1), _rows(g))
            else:
                gb = _mm_grad(ctx, 1, transpose(a, -1, -2), g)
        return ga, gb


def _heads_out(a: Tensor, b: Tensor):
    """Where a [B, H, M, K] @ [B, H, K, N] product goes when B's heads are interleaved in rows
    (split_heads' v: head h is columns h*N .. h*N+N-1 of rows L >= H*N elements apart): a
    new [B, M, H*N] buffer with the heads interleaved the same way, viewed as [B, H, M, N].
    Attention's y.transpose(1, 2).reshape(B, T, C) is then a view, not a copy.  None for
    any other operands (a new contiguous result)."""
    if a.ndim != 4 or b.ndim != 4 or a.shape[:2] != b.shape[:2] or a.dtype is not b.dtype:
        return None
    Bn, H, M, N = a.shape[0], a.shape[1], a.shape[2], b.shape[3]
    if H < 2 or b._strides[3] != 1 or b._strides[1] != N or b._strides[2] < H * N:
        return None
    L = H * N
    buf = K.empty((Bn, M, L), a.dtype, a._st.rt)
    return Tensor(buf._st, (Bn, H, M, N), (M * L, N, L, 1), buf._off, a.dtype)


def _direct_dest(ctx, i: int, shape: tuple, *operands: Tensor):
    """Input i's free gradient slot (Context.grad_out) if a product of ``operands`` can be
    written there unchanged: the slot has ``shape`` and the operands' one dtype, and no
    autocast would convert them first (the product must be the one matmul() computes)."""
    dest = ctx.grad_out(i)
    if dest is None or _amp.state.dtype is not None or dest.shape != shape:
        return None
    return dest if all(o.dtype is dest.dtype for o in operands) else None


def _mm_grad(ctx, i: int, a: Tensor, b: Tensor) -> Tensor:
    """a @ b as the gradient of input i: straight into its destination when it has one (a
    leaf's free slot, or a buffer the input's producer gathers its gradients in), else
    matmul() (which also handles broadcasting and 1-D operands).  Batched products go
    through matmul_any_layout as matmul() does, so each sum is the one computed without a
    destination."""
    if a.ndim >= 2 and b.ndim >= 2 and a.shape[:-2] == b.shape[:-2]:
        dest = _direct_dest(ctx, i, a.shape[:-1] + b.shape[-1:], a, b)
        if dest is not None:
            return K.matmul_any_layout(a, b, out=dest) if a.ndim > 2 else K.matmul(a, b, out=dest)
    return matmul(a, b)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with PyTorch's rules: 1-D operands, batched and broadcast batch dims."""
    _check_tensor(a, "matmul"), _check_tensor(b, "matmul")
    if _amp.state.dtype is not None:  # autocast: in the low dtype
        a, b = _amp.low(a, b)
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
        return _linear_grads(ctx, g, x, w)


def _linear_grads(ctx, g, x, w, idx: tuple = (0, 1, 2)) -> tuple:
    """(gx, gw, gb) of linear(x, w, b) for the output gradient g, where x, w and b are inputs
    ``idx`` of ctx (None for x: its gradient is not computed here)."""
    n = ctx.needs_input_grad
    gx = matmul(g, w) if idx[0] is not None and n[idx[0]] else None
    gw = None
    if n[idx[1]]:
        g2, x2 = _rows(g), _rows(x)
        # The same sums either way round; the CPU matmul is faster with the wider dim as
        # N (measured: [512, 1024] @ [1024, 128] ~15 GFLOP/s, [128, 1024] @ [1024, 512] ~20),
        # so a wide-output weight gets (x^T g)^T, a transposed view.
        # Into the weight's free slot, the transposed product is stored transposed.
        dest = _direct_dest(ctx, idx[1], w.shape, g2, x2)
        if w.shape[0] > w.shape[1]:
            if dest is not None:
                gw = K.matmul(transpose(x2, 0, 1), g2, out=transpose(dest, 0, 1))
                gw = dest
            else:
                gw = transpose(matmul(transpose(x2, 0, 1), g2), 0, 1)
        elif dest is not None:
            gw = K.matmul(transpose(g2, 0, 1), x2, out=dest)
        else:
            gw = matmul(transpose(g2, 0, 1), x2)
    gb = None
    if n[idx[2]]:
        dest = _direct_dest(ctx, idx[2], (g.shape[-1],), g)
        if dest is not None and g.ndim >= 2 and dest.dtype is dt.float32:
            # sum() of a float32 gradient over the leading dims, written into the slot
            gb, _ = K.reduce("sum", g, tuple(range(g.ndim - 1)), 1.0, out=dest)
        else:
            gb = sum_to_shape(g, (g.shape[-1],))
    return gx, gw, gb


class _LinearResidual(Function):
    """residual + linear(x, w, b) as one matmul (helios.fusion "linear+residual")."""

    op_name = "linear+residual"

    @staticmethod
    def forward(ctx, x, w, b, residual):
        ctx.save_for_backward(x, w)
        out, _ = K.matmul_epilogue("linear+residual", x, transpose(w, 0, 1), b, residual)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        # the add's backward: the residual's gradient is g itself, as add() returns it
        return _linear_grads(ctx, g, x, w) + ((g if ctx.needs_input_grad[3] else None),)


class _LinearGelu(Function):
    """gelu_tanh(linear(x, w, b)) as one matmul (helios.fusion "linear+gelu"): the kernel
    stores the pre-activation u for backward along with gelu(u)."""

    op_name = "linear+gelu"

    @staticmethod
    def forward(ctx, x, w, b):
        y, u = K.matmul_epilogue("linear+gelu", x, transpose(w, 0, 1), b, None)
        ctx.save_for_backward(x, w, u)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, u = ctx.saved_tensors
        # gelu's backward (as _Unary's), then the linear's on its result
        return _linear_grads(ctx, K.binary("gelu_tanh_bwd", u, g), x, w)


class _MLPResidual(Function):
    """residual + linear(gelu_tanh(linear(x, w1, b1)), w2, b2): the forward is the two fused
    matmuls (linear+gelu, linear+residual); backward computes the hidden gradient with
    gelu_tanh_bwd in the product's epilogue (helios.fusion "matmul+gelu_tanh_bwd")."""

    op_name = "mlp+residual"

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, residual):
        h, u = K.matmul_epilogue("linear+gelu", x, transpose(w1, 0, 1), b1, None)
        out, _ = K.matmul_epilogue("linear+residual", h, transpose(w2, 0, 1), b2, residual)
        ctx.save_for_backward(x, w1, u, h, w2)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w1, u, h, w2 = ctx.saved_tensors
        n = ctx.needs_input_grad
        _, gw2, gb2 = _linear_grads(ctx, g, h, w2, (None, 3, 4))  # c_proj's parameters
        gx = gw1 = gb1 = None
        if n[0] or n[1] or n[2]:
            # c_proj's input gradient g @ w2 times gelu'(u), in one kernel; then c_fc's
            gu, _ = K.matmul_epilogue("matmul+gelu_tanh_bwd", g, w2, None, u)
            gx, gw1, gb1 = _linear_grads(ctx, gu, x, w1)
        return gx, gw1, gb1, gw2, gb2, (g if n[5] else None)


def mlp_residual(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, residual: Tensor) -> Tensor:
    """residual + linear(gelu(linear(x, w1, b1), approximate="tanh"), w2, b2), the GPT MLP
    block with its residual add, in fused kernels (helios.fusion: linear+gelu and
    linear+residual forward, matmul+gelu_tanh_bwd backward), bit for bit the separate ops;
    where the fused kernels do not apply the separate ops run."""
    hidden = x.shape[:-1] + (w1.shape[0],) if isinstance(x, Tensor) and isinstance(w1, Tensor) else None
    if (_fusible_linear(x, w1, b1) and isinstance(w2, Tensor) and w2.ndim == 2 and w2.shape[1] == w1.shape[0]
            and w2.dtype is x.dtype and w1.shape[0] > 0
            and (b2 is None or (isinstance(b2, Tensor) and b2.shape == (w2.shape[0],) and b2.dtype is x.dtype
                                and (b2.shape[0] == 1 or b2._strides[0] == 1)))
            and isinstance(residual, Tensor) and residual.dtype is x.dtype
            and residual.shape == hidden[:-1] + (w2.shape[0],) and residual.is_contiguous()):
        return _MLPResidual.apply(x, w1, b1, w2, b2, residual)
    return linear_residual(linear_gelu(x, w1, b1), w2, b2, residual)


def _fusible_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether linear(x, weight, bias) is the plain one-kernel linear a fused kernel can
    extend: fusion on, no autocast conversion, one float dtype, a [..., K] input with K > 0,
    a unit-stride bias."""
    from helios import fusion

    return (fusion.ENABLED and _amp.state.dtype is None and isinstance(x, Tensor) and isinstance(weight, Tensor)
            and x.ndim >= 2 and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and x.shape[-1] > 0
            and x.numel() > 0 and x.dtype is weight.dtype and x.dtype.kind == "float"
            and (bias is None or (isinstance(bias, Tensor) and bias.shape == (weight.shape[0],)
                                  and bias.dtype is x.dtype and (bias.shape[0] == 1 or bias._strides[0] == 1))))


def linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """residual + linear(x, weight, bias): one matmul whose epilogue adds the residual
    (helios.fusion "linear+residual"), bit for bit the separate ops; where the fused kernel
    does not apply (fusion off, autocast, mixed dtypes, a residual of another shape or
    layout) the separate ops run."""
    if (_fusible_linear(x, weight, bias) and isinstance(residual, Tensor) and residual.dtype is x.dtype
            and residual.shape == x.shape[:-1] + (weight.shape[0],) and residual.is_contiguous()):
        return _LinearResidual.apply(x, weight, bias, residual)
    return residual + linear(x, weight, bias)


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """gelu(linear(x, weight, bias), approximate="tanh"): one matmul that stores the
    pre-activation and its GELU (helios.fusion "linear+gelu"), bit for bit the separate ops;
    where the fused kernel does not apply the separate ops run."""
    if _fusible_linear(x, weight, bias):
        return _LinearGelu.apply(x, weight, bias)
    return gelu(linear(x, weight, bias), approximate="tanh")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T + bias (PyTorch's F.linear); the bias is added in the matmul's epilogue."""
    _check_tensor(x, "linear"), _check_tensor(weight, "linear")
    if _amp.state.dtype is not None:  # autocast: in the low dtype (the bias too: one rounding in the epilogue)
        x, weight, bias = _amp.low(x, weight, bias)
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: expected input [..., {weight.shape[-1]}] and a 2-D weight, got {x.shape} and {weight.shape}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ShapeError(f"linear: expected a bias of shape ({weight.shape[0]},), got {bias.shape}")
    # Mixed dtypes and 1-D inputs take the general path (promotion, vector matmul).
    if (x.ndim < 2 or x.dtype is not weight.dtype or x.dtype.kind != "float"
            or (bias is not None and bias.dtype is not x.dtype)):
        y = matmul(x, transpose(weight, 0, 1))
        return y if bias is None else y + bias
    if bias is not None and bias.shape[0] > 1 and bias._strides[0] != 1:
        bias = contiguous(bias)  # the matmul epilogue reads the bias with unit stride
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


def softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """exp(x) / sum(exp(x)) along ``dim`` (numerically stable); ``dtype`` converts x first."""
    if dtype is None and _amp.state.dtype is not None:  # autocast: in float32
        (x,) = _amp.fp32(x)
    return _softmax_impl(x if dtype is None else to(x, dtype), dim, False)


def log_softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """x - logsumexp(x) along ``dim``; ``dtype`` converts x first."""
    if dtype is None and _amp.state.dtype is not None:  # autocast: in float32
        (x,) = _amp.fp32(x)
    return _softmax_impl(x if dtype is None else to(x, dtype), dim, True)


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
        ctx.shape, ctx.n_head, ctx.dtype, ctx.rt = x.shape, n_head, x.dtype, x._st.rt
        return tuple(_view(x, (B, n_head, T, D), (sb, D * sc, st, sc), x._off + i * C * sc) for i in range(3))

    @staticmethod
    def backward(ctx, grads):
        ref = next(g for g in grads if g is not None)
        out, ctx.gbuf = getattr(ctx, "gbuf", None), None  # a new buffer for another pass (retain_graph)
        if out is None or out.dtype is not ref.dtype:
            out = K.empty(ctx.shape, ref.dtype, ref._st.rt)
        for i, g in enumerate(grads):
            dst = _SplitHeads._head_view(ctx, out, i)
            if g is None:
                K.copy_into(dst, scalar_tensor(0.0, ref.dtype, ref._st.rt))
            elif not (g._st is dst._st and g._off == dst._off and g._strides == dst._strides):
                K.copy_into(dst, g)  # else: its producer wrote it in place (grad_dest)
        return out, None

    @staticmethod
    def _head_view(ctx, buf: Tensor, i: int) -> Tensor:
        B, T, C3 = ctx.shape
        D = C3 // 3 // ctx.n_head
        return Tensor(buf._st, (B, ctx.n_head, T, D), (T * C3, D, C3, 1), buf._off + i * (C3 // 3), buf.dtype)

    @staticmethod
    def grad_dest(node, i: int, resolve):
        """Where the gradient of output i (q, k or v) may be written: its heads' columns of the
        one [B, T, 3C] buffer backward returns (allocated on the first request of a pass)."""
        ctx = node.ctx
        buf = getattr(ctx, "gbuf", None)
        if buf is None:
            buf = ctx.gbuf = K.empty(ctx.shape, ctx.dtype, ctx.rt)
        return _SplitHeads._head_view(ctx, buf, i)


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
    if _amp.state.dtype is not None:  # autocast: in float32, as softmax
        (scores,) = _amp.fp32(scores)
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
        dx = None
        if ctx.needs_input_grad[0]:
            from helios import fusion

            # the gradient x already has from its other uses, added in the kernel's store
            acc = ctx.grad_pending(0) if fusion.ENABLED and hasattr(ctx, "grad_pending") else None
            dx = K.layer_norm_bwd_input(x, w, g, mean_, rstd, acc)
        need_w = w is not None and ctx.needs_input_grad[1]
        need_b = ctx.has_b and ctx.needs_input_grad[2]
        dw = db = None
        if need_w or need_b:  # into the parameters' free slots when both share one buffer
            dw, db = K.layer_norm_bwd_params(x, g, mean_, rstd, need_w, need_b, ctx.grad_out(1), ctx.grad_out(2))
        return dx, dw, db, None


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim(s) ``normalized_shape``."""
    if _amp.state.dtype is not None:  # autocast: in float32
        x, weight, bias = _amp.fp32(x, weight, bias)
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
        gr = graph.capturing()
        if gr is not None and gr.made_inside(idx):
            raise graph.GraphCaptureError("embedding backward inside hl.graph.capture: its indices are grouped on "
                                          "the host, so they must come from outside the step (an input of "
                                          "capture(inputs=...)), not be computed inside it")
        order, rowptr = _group_by_row(_host_indices(idx), ctx.V)
        rt = g._st.rt
        pos = K.from_numpy(order, dt.int64, rt)
        rp = K.from_numpy(rowptr, dt.int32, rt)
        if gr is not None:  # a replay groups its own indices (the capture's inputs hold them by then)
            graph.before_replay(lambda: _regroup(idx, ctx.V, pos, rp))
        g2 = _rows(contiguous(g))
        dest = ctx.grad_out(1)  # the table's free gradient slot, if any
        if dest is not None and (dest.dtype is not g2.dtype or dest.shape != (ctx.V, g2.shape[-1])):
            dest = None
        return None, K.embedding_bwd(g2, pos, rp, ctx.V, out=dest)


def _group_by_row(host: np.ndarray, V: int) -> tuple:
    """Positions sorted by row (stable) and each row's start in them: the embedding backward sums
    each row's gradients in that order, deterministic and without atomics."""
    order = np.argsort(host.reshape(-1), kind="stable").astype(np.int64)
    rowptr = np.zeros(V + 1, np.int32)
    np.cumsum(np.bincount(host.reshape(-1), minlength=V), out=rowptr[1:])
    return order, rowptr


def _regroup(idx: Tensor, V: int, pos: Tensor, rp: Tensor) -> None:
    """A graph replay's embedding backward: the new indices' grouping into the buffers it reads."""
    order, rowptr = _group_by_row(_host_indices(idx), V)
    rt = pos._st.rt
    rt.write(pos._st.handle, pos._off * 8, order.view(np.uint8))
    rt.write(rp._st.handle, rp._off * 4, rowptr.view(np.uint8))


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


def _check_targets(host: np.ndarray, C: int, ignore_index: int) -> None:
    bad = host[(host >= C) & (host != ignore_index)]
    if bad.size:
        raise IndexError(f"cross_entropy: target {int(bad[0])} is out of range for {C} classes")


def _valid_targets(host: np.ndarray, C: int, ignore_index: int) -> tuple:
    """(how many targets count, whether ignored ones must be remapped to -1 for the kernel)."""
    n_valid = int(np.count_nonzero((host >= 0) & (host < C) & (host != ignore_index)))
    return n_valid, bool(ignore_index >= 0 and (host == ignore_index).any())


def _same_targets(targets: Tensor, C: int, ignore_index: int, captured: tuple) -> None:
    """Before a graph replay: the new targets are in range and count as many as the captured ones."""
    host = _host_ready(targets)
    host = (targets.numpy() if host is None else host).reshape(-1)
    _check_targets(host, C, ignore_index)
    now = _valid_targets(host, C, ignore_index)
    if now != captured:
        raise graph.GraphCaptureError(f"replay: cross_entropy counts {now[0]} valid targets (ignored ones remapped: "
                                      f"{now[1]}), the graph was captured with {captured[0]} ({captured[1]}); the "
                                      "mean's divisor is a constant of the graph: capture again for such batches")


class _CrossEntropy(Function):
    @staticmethod
    def forward(ctx, x, t, n_valid):
        loss, lse = K.cross_entropy_fwd(x, t)
        ctx.save_for_backward(x, t, lse)
        ctx.n = n_valid
        # the mean over no valid target is nan, as in PyTorch (its gradient stays 0)
        total, _ = K.reduce("sum", loss, (0,), 1.0 / n_valid if n_valid else math.nan)
        return total if x.dtype is dt.float32 else K.copy(total, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, t, lse = ctx.saved_tensors
        gl = expand(reshape(to(g, dt.float32) * (1.0 / builtins.max(ctx.n, 1)), (1,)), (x.shape[0],))
        return K.cross_entropy_bwd(x, t, lse, gl), None, None  # the kernel reads the expanded value once per row


def cross_entropy(logits: Tensor, targets, weight: Tensor | None = None, size_average=None, ignore_index: int = -100,
                  reduce=None, reduction: str = "mean") -> Tensor:
    """Cross entropy with PyTorch's layouts: ``logits`` (C), (N, C) or (N, C, d1, ...) with the
    classes on dim 1 (dim 0 of a 1-D input), ``targets`` either class indices of the logits'
    shape without the class dim, or class probabilities of the logits' shape.

    ``weight`` rescales each class; index targets equal to ``ignore_index`` (or negative)
    contribute nothing and are not counted.
    ``reduction``: "mean" (over the targets' total weight, or the number of rows for
    probabilities), "sum", or "none" (one loss per target)."""
    _check_tensor(logits, "cross_entropy")
    if _amp.state.dtype is not None:  # autocast: in float32
        logits, weight = _amp.fp32(logits, weight)
    if size_average is not None or reduce is not None:
        raise TypeError("cross_entropy: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(targets, Tensor):
        targets = K.from_numpy(np.asarray(targets, np.int64), dt.int64, logits._st.rt)
    if logits.ndim == 0:
        raise ShapeError("cross_entropy: logits need at least 1 dim (the classes), got a 0-d tensor")
    cdim = 0 if logits.ndim == 1 else 1
    C = logits.shape[cdim]
    probs = targets.dtype.kind == "float"
    if probs and targets.shape != logits.shape:
        raise DTypeError(f"cross_entropy: {targets.dtype.name} targets are class probabilities and need the logits' shape "
                         f"{logits.shape}, got {targets.shape}; class indices must be int32 or int64")
    if not probs and targets.dtype.kind != "int":
        raise DTypeError(f"cross_entropy: targets must be integer class indices or float probabilities, got {targets.dtype.name}")
    index_shape = logits.shape[:cdim] + logits.shape[cdim + 1:]
    if not probs and targets.shape != index_shape:
        raise ShapeError(f"cross_entropy: logits {logits.shape} need targets of shape {index_shape}, got {targets.shape}")
    if weight is not None and weight.shape != (C,):
        raise ShapeError(f"cross_entropy: weight must have shape ({C},) (one per class), got {weight.shape}")
    rows = numel(index_shape)

    def classes_last(t: Tensor) -> Tensor:
        if t.ndim > 2:
            t = permute(t, 0, *range(2, t.ndim), 1)
        return reshape(contiguous(t), (rows, C))

    x = classes_last(logits)
    if x.dtype.kind != "float":
        x = to(x, dt.float32)
    if probs:
        t = to(classes_last(targets), x.dtype)
        if weight is not None:
            t = t * reshape(to(weight, x.dtype), (1, C))
        per = neg(sum(log_softmax(x, -1) * t, dim=1))
        if reduction == "none":
            return reshape(per, index_shape)
        total = sum(per)
        return total if reduction == "sum" else total / rows if rows else total * math.nan
    t = reshape(contiguous(to(targets, dt.int64)), (rows,))
    # The upload's host copy of the targets (a reshape of them has none): no read-back for the count.
    host = _host_ready(targets) if targets.is_contiguous() and targets._off == 0 else None
    if host is not None:
        host = host.reshape(-1)
        _check_targets(host, C, ignore_index)
    if weight is None and reduction == "mean":
        # the fused kernel: a negative target contributes nothing and is not counted
        if host is not None:
            n_valid, remap = _valid_targets(host, C, ignore_index)
            if remap:
                t = where(eq(t, ignore_index), -1, t)
            if graph.capturing() is not None:  # the count is a constant of the kernels: a replay checks it holds
                graph.before_replay(lambda: _same_targets(targets, C, ignore_index, (n_valid, remap)))
        else:
            if ignore_index >= 0:  # the kernel skips negative targets only: ignored ones become -1
                t = where(eq(t, ignore_index), -1, t)
            n_valid = int(K.reduce("sum", K.binary("ge", t, scalar_tensor(0, dt.int64, t._st.rt)), (0,))[0].item())
        return _CrossEntropy.apply(x, t, n_valid)
    valid = logical_and(ne(t, ignore_index), ge(t, 0))
    safe = where(valid, t, 0)
    logp = log_softmax(x, -1)
    onehot = to(eq(reshape(safe, (rows, 1)), reshape(K.arange(C, 0, 1, dt.int64, x._st.rt), (1, C))), logp.dtype)
    nll = neg(sum(logp * onehot, dim=1))
    w = to(valid, nll.dtype)
    if weight is not None:
        w = w * _gather(to(weight, nll.dtype), 0, safe)
    per = nll * w
    if reduction == "none":
        return reshape(per, index_shape)
    total = sum(per)
    return total if reduction == "sum" else total / sum(w)


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
        raise InPlaceError(f"{op}: in-place op on a tensor that requires grad is not supported "
                           "(it would corrupt the tape); use the out-of-place form, or wrap the update in helios.no_grad()")


def copy_(x: Tensor, src) -> Tensor:
    """Copy ``src`` (a tensor broadcastable to x, a numpy array or a number) into ``x`` in place."""
    _check_inplace(x, "copy_")
    if isinstance(src, np.ndarray):
        if src.shape != x.shape:
            broadcast_shapes("copy_", src.shape, x.shape)
        if x.is_contiguous() and src.shape == x.shape and x.dtype is not dt.bfloat16 and not x._st.nbytes > x._st.rt.max_range:
            host = np.ascontiguousarray(src, dtype=x.dtype.np_storage)
            x._st.rt.write(x._st.handle, x._off * x.dtype.itemsize, host.reshape(-1).view(np.uint8))
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


def full_like(x: Tensor, value, dtype=None, *, device=None, requires_grad: bool = False, layout=None,
              memory_format=None) -> Tensor:
    """A new tensor of x's shape filled with ``value`` (x's dtype and device unless given)."""
    _check_tensor(x, "full_like")
    check_layout("full_like", layout)
    check_memory_format("full_like", memory_format)
    rt = x._st.rt if device is None else get_runtime(str(device))
    out = K.fill(K.empty(x.shape, dt.as_dtype(dtype) if dtype is not None else x.dtype, rt), value)
    return out.requires_grad_(True) if requires_grad else out


def zeros_like(x: Tensor, dtype=None, **kw) -> Tensor:
    """A new tensor of zeros of x's shape (keywords as :func:`full_like`)."""
    return full_like(x, 0, dtype, **kw)


def ones_like(x: Tensor, dtype=None, **kw) -> Tensor:
    """A new tensor of ones of x's shape (keywords as :func:`full_like`)."""
    return full_like(x, 1, dtype, **kw)


def check_layout(op: str, layout) -> None:
    """Accept PyTorch's layout argument where it names the only layout Helios has (strided)."""
    if layout is not None and str(layout).rsplit(".", 1)[-1] != "strided":
        raise ShapeError(f"{op}: layout {layout!r} is not supported: Helios tensors are strided (dense)")


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
    return reshape(t, (1,) * nd) if t.ndim < nd else t


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
    _check_tensor(x, "gather")
    index = _index_tensor(index, x, "gather")
    d = norm_dim(dim, x.ndim, "gather")
    _check_gather_shapes("gather", x, d, index)
    n = x.shape[d] if x.ndim else 1
    if index.numel() and n == 0:
        raise IndexError(f"gather: index out of range for dim {d} of size 0")
    _check_range(index, n, "gather", d)
    nd = builtins.max(x.ndim, index.ndim, 1)
    out = _Gather.apply(_as_nd(x, nd), d, _as_nd(index, nd))
    return reshape(out, index.shape)


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
            shape, strides, off = _basic_index(sv, tuple(slice(0, s) for s in index.shape))
            sv = Tensor(sv._st, shape, strides, off, sv.dtype)
        sv = K.copy(sv, out.dtype)
    else:
        sv = K.fill(K.empty(index.shape, out.dtype, out._st.rt), src)
    keys, order = K.sort_rows(reshape(pos, (1, M)))
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
                shape, strides, off = _basic_index(gs, tuple(slice(0, s) for s in index.shape))
                K.copy_into(Tensor(gs._st, shape, strides, off, g.dtype), picked)
            else:
                gs = picked
        return gx, None, None, gs, None


def _scatter_args(op: str, x: Tensor, dim, index, src, value):
    _check_tensor(x, op)
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
    elif not isinstance(src, Number):
        raise TypeError(f"{op}: src must be a tensor or a number, got {type(src).__name__}")
    _check_gather_shapes(op, x, d, index, src if isinstance(src, Tensor) else None)
    _check_range(index, x.shape[d] if x.ndim else 1, op, d)
    return d, index, src


def _scatter_op(op: str, mode: str, x: Tensor, d: int, index: Tensor, src) -> Tensor:
    if index.numel() == 0:
        return clone(x)
    nd = builtins.max(x.ndim, 1)
    xs, ix = _as_nd(x, nd), _as_nd(index, nd)
    ss = _as_nd(src, nd) if isinstance(src, Tensor) else src
    return reshape(_Scatter.apply(xs, d, ix, ss, mode), x.shape)


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


def _inplace_result(x: Tensor, op: str, r: Tensor) -> Tensor:
    _check_inplace(x, op)
    K.copy_into(x, r)
    x._st.version += 1
    return x


def scatter_(x: Tensor, dim: int, index, src=None, value=None, *, reduce: str | None = None) -> Tensor:
    """In-place :func:`scatter`."""
    _check_inplace(x, "scatter_")
    return _inplace_result(x, "scatter_", scatter(x, dim, index, src, value, reduce=reduce))


def scatter_add_(x: Tensor, dim: int, index, src: Tensor) -> Tensor:
    """In-place :func:`scatter_add`."""
    _check_inplace(x, "scatter_add_")
    return _inplace_result(x, "scatter_add_", scatter_add(x, dim, index, src))


class _IndexAdd(Function):
    @staticmethod
    def forward(ctx, x, d, index, source, alpha):
        ctx.save_for_backward(index)
        ctx.d, ctx.alpha = d, alpha
        xt = movedim_front(x, d)
        out = K.copy(xt)
        L, C = index.numel(), numel(xt.shape[1:])
        if L and C and out.shape[0]:
            src = K.copy(movedim_front(source, d))
            if alpha != 1 and src.dtype is dt.bool_:
                src = K.fill(src, False) if not alpha else src  # bool: alpha False adds nothing
            elif alpha != 1:
                src = K.unary("mul_s", src, float(alpha))
            wrapped = K.where(K.binary("lt", index, scalar_tensor(0, dt.int64, index._st.rt)),
                              K.unary("add_s", index, float(out.shape[0])), index)
            keys, order = K.sort_rows(reshape(contiguous(wrapped), (1, L)))
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
            gs = _gather(g, ctx.d, index)
            if ctx.alpha != 1:
                gs = gs * ctx.alpha
        return (g if ctx.needs_input_grad[0] else None), None, None, gs, None


def index_add(x: Tensor, dim: int, index, source: Tensor, *, alpha=1) -> Tensor:
    """torch.index_add: a copy of ``x`` with ``alpha * source`` added along ``dim`` at the rows
    a 1-D integer ``index`` names (``out[index[i]] += alpha * source[i]`` for dim 0); repeated
    indices accumulate in a fixed order.  Differentiable in x and source."""
    _check_tensor(x, "index_add"), _check_tensor(source, "index_add")
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
    return reshape(_IndexAdd.apply(xs, d, reshape(index, (index.numel(),)), ss, alpha), x.shape)


def index_add_(x: Tensor, dim: int, index, source: Tensor, *, alpha=1) -> Tensor:
    """In-place :func:`index_add`."""
    _check_inplace(x, "index_add_")
    return _inplace_result(x, "index_add_", index_add(x, dim, index, source, alpha=alpha))


# -- sorting ---------------------------------------------------------------------------------------
class _SortValues(Function):
    """Values of a sort (or the first k of one) along ``d``; ``idx`` (int64) says where each
    came from, so the gradient scatters back to those places (they are distinct)."""

    @staticmethod
    def forward(ctx, x, d, values, idx):
        ctx.save_for_backward(idx)
        ctx.d, ctx.shape = d, x.shape
        return _view(values, values.shape, values._strides, values._off)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        zeros = K.fill(K.empty(ctx.shape, g.dtype, g._st.rt), 0)
        return _scatter_raw(zeros, ctx.d, idx, contiguous(g), "replace"), None, None, None


def _sort_impl(x: Tensor, d: int, descending: bool, k: int | None = None):
    """(values, int64 indices) of x sorted along d, the first k of them (no autograd)."""
    n = x.shape[d]
    k = n if k is None else k
    xt = movedim(x, d, -1) if d != x.ndim - 1 else x  # the sorted dim last
    rest = xt.shape[:-1]
    rows = numel(rest)
    if rows * k == 0:
        v, p = K.empty(rest + (k,), x.dtype, x._st.rt), K.empty(rest + (k,), dt.int64, x._st.rt)
    else:
        src = xt if xt.is_contiguous() else K.copy(xt)
        sv, sp = K.sort_rows(Tensor(src._st, (rows, n), (n, 1), src._off, src.dtype), descending)
        v = reshape(K.copy(Tensor(sv._st, (rows, k), sv._strides, 0, sv.dtype)), rest + (k,))
        p = reshape(K.copy(Tensor(sp._st, (rows, k), sp._strides, 0, dt.int32), dt.int64), rest + (k,))
    if d != x.ndim - 1:
        v, p = movedim(v, -1, d), movedim(p, -1, d)
    return v, p


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """(values, indices) of ``x`` sorted along ``dim``.  The sort is always stable (equal
    values keep their order; ``stable`` is accepted for PyTorch's signature); NaN sorts as
    the largest value.  Differentiable in the values."""
    _check_tensor(x, "sort")
    d = norm_dim(dim, x.ndim, "sort")
    if x.ndim == 0:
        return SortResult(clone(x), K.fill(K.empty((), dt.int64, x._st.rt), 0))
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
    _check_tensor(x, "topk")
    d = norm_dim(dim, x.ndim, "topk")
    n = x.shape[d] if x.ndim else 1
    k = int(k)
    if not 0 <= k <= n:
        raise IndexError(f"topk: k ({k}) is out of range for dim {d} of size {n}")
    if x.ndim == 0:
        return TopKResult(clone(x), K.fill(K.empty((), dt.int64, x._st.rt), 0))
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
        zero = eq(x, 0.0)
        seen = K.scan("sum", zero, d)  # zeros up to and including each position
        before = eq(seen, 0)
        first = logical_and(zero, eq(seen, 1))
        rev = lambda t: K.scan("sum", contiguous(t), d, reverse=True)  # noqa: E731
        safe_x = where(before, x, 1.0)
        g_before = rev(where(before, g * y, 0.0)) / safe_x
        skip_first = K.scan("prod", where(first, 1.0, x), d)
        g_first = rev(g * skip_first)
        return where(before, g_before, where(first, g_first, 0.0)), None


def _cum(op: str, x: Tensor, dim: int, dtype) -> Tensor:
    _check_tensor(x, op)
    if dtype is not None:
        x = to(x, dtype)
    d = norm_dim(dim, x.ndim, op)
    if x.ndim == 0:
        r = _cum(op, reshape(x, (1,)), 0, None)
        return reshape(r, ())
    if x.dtype.kind != "float":
        r = K.scan("sum" if op == "cumsum" else "prod", x, d)
        return r if dtype is None else to(r, x.dtype)  # an integer dtype asked for is kept
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
    _check_tensor(x, "flip")
    if dims is None:
        if not dims_args:
            raise TypeError("flip: missing the dims to flip")
        dims = _shape_arg(dims_args)
    ds = _dims_arg(dims, "flip")
    if x.ndim == 0:
        for d in ds:
            norm_dim(d, 0, "flip")
        return clone(x)
    nd = tuple(norm_dim(d, x.ndim, "flip") for d in ds)
    if len(set(nd)) != len(nd):
        raise ValueError(f"flip: dims {tuple(ds)} name a dim twice")
    if x.numel() == 0:
        return clone(x)
    return _Flip.apply(x, tuple(d for d in nd if x.shape[d] > 1))


def roll(x: Tensor, shifts, dims=None) -> Tensor:
    """Rotate ``x`` by ``shifts`` along ``dims`` (elements pushed off one end come back at the
    other); without dims, the flattened tensor is rolled and the shape restored."""
    _check_tensor(x, "roll")
    shifts = _dims_arg(shifts, "roll")
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        if len(shifts) != 1:
            raise ValueError(f"roll: without dims, shifts must be one number, got {shifts}")
        return reshape(roll(flatten(x), shifts[0], 0), x.shape)
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
        out = cat([narrow(out, d, n - s, s), narrow(out, d, 0, n - s)], d)
    return out if out is not x else clone(x)


def repeat(x: Tensor, *sizes) -> Tensor:
    """``x`` tiled ``sizes[i]`` times along each dim (sizes may add leading dims; a copy)."""
    _check_tensor(x, "repeat")
    sizes = tuple(int(s) for s in _shape_arg(sizes))
    if len(sizes) < x.ndim:
        raise ShapeError(f"repeat: {len(sizes)} repeat counts for a tensor of {x.ndim} dims; give at least one per dim")
    if builtins.any(s < 0 for s in sizes):
        raise ValueError(f"repeat: repeat counts must be non-negative, got {sizes}")
    shape = (1,) * (len(sizes) - x.ndim) + x.shape
    xv = reshape(x, shape)
    inter = tuple(v for s in shape for v in (1, s))
    big = tuple(v for r, s in zip(sizes, shape) for v in (r, s))
    out = reshape(contiguous(expand(reshape(xv, inter), big)), tuple(r * s for r, s in zip(sizes, shape)))
    return clone(out) if out is x else out


def tile(x: Tensor, dims) -> Tensor:
    """``x`` repeated ``dims[i]`` times along each dim; missing leading counts are 1 (torch.tile)."""
    _check_tensor(x, "tile")
    dims = _dims_arg(dims, "tile")
    dims = (1,) * (x.ndim - len(dims)) + tuple(dims)
    return repeat(x, dims)


def repeat_interleave(x: Tensor, repeats, dim: int | None = None, *, output_size: int | None = None) -> Tensor:
    """Each element (or slice along ``dim``) repeated ``repeats`` times in place: a number, or
    one count per element (a tensor or list; its values are read on the host, as PyTorch
    reads them to size the result).  Without dim, the flattened tensor."""
    _check_tensor(x, "repeat_interleave")
    if dim is None:
        x, d = flatten(x), 0
    else:
        d = norm_dim(dim, x.ndim, "repeat_interleave")
    n = x.shape[d] if x.ndim else 1
    if isinstance(repeats, int) or (isinstance(repeats, Tensor) and repeats.numel() == 1 and n != 1) \
            or (isinstance(repeats, Tensor) and repeats.ndim == 0):
        r = int(repeats.item()) if isinstance(repeats, Tensor) else int(repeats)
        if r < 0:
            raise ValueError(f"repeat_interleave: repeats must be non-negative, got {r}")
        if x.ndim == 0:
            x, d = reshape(x, (1,)), 0
        shape = x.shape
        out = expand(unsqueeze(x, d + 1), shape[:d + 1] + (r,) + shape[d + 1:])
        return reshape(contiguous(out), shape[:d] + (shape[d] * r,) + shape[d + 1:])
    reps = _host_indices(repeats) if isinstance(repeats, Tensor) else np.asarray(repeats, np.int64)
    reps = reps.reshape(-1).astype(np.int64)
    if reps.size != n:
        raise ShapeError(f"repeat_interleave: {reps.size} repeat counts for dim {d} of size {n}")
    if (reps < 0).any():
        raise ValueError("repeat_interleave: repeats must be non-negative")
    idx = np.repeat(np.arange(n, dtype=np.int64), reps)
    return index_select(x, d, K.from_numpy(idx, dt.int64, x._st.rt))


def t(x: Tensor) -> Tensor:
    """The transpose of a matrix (a view); 0-d and 1-D tensors come back as they are."""
    _check_tensor(x, "t")
    if x.ndim > 2:
        raise ShapeError(f"t: expects a tensor of at most 2 dims, got {x.ndim} (shape {x.shape}); use transpose(dim0, dim1)")
    return transpose(x, 0, 1) if x.ndim == 2 else x


def movedim(x: Tensor, source, destination) -> Tensor:
    """``x`` with the dims ``source`` moved to ``destination`` (a view)."""
    src = tuple(norm_dim(d, x.ndim, "movedim") for d in _dims_arg(source, "movedim"))
    dst = tuple(norm_dim(d, x.ndim, "movedim") for d in _dims_arg(destination, "movedim"))
    if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ValueError(f"movedim: source {source} and destination {destination} must be distinct dims of the same count")
    order = [None] * x.ndim
    for s, t_ in zip(src, dst):
        order[t_] = s
    rest = iter(d for d in range(x.ndim) if d not in src)
    return permute(x, *[o if o is not None else next(rest) for o in order])


# -- products --------------------------------------------------------------------------------------
def _float_mm(op: str, *ts: Tensor) -> None:
    for t_ in ts:
        _check_tensor(t_, op)
        if t_.dtype.kind != "float":
            raise DTypeError(f"{op}: expected floating-point tensors, got {t_.dtype.name} (the matmul kernels are floating-point only)")


def mm(a: Tensor, b: Tensor) -> Tensor:
    """The product of two matrices ([n, m] @ [m, p])."""
    _float_mm("mm", a, b)
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"mm: expected two 2-D tensors, got shapes {a.shape} and {b.shape}")
    return matmul(a, b)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """Batched matrix product of [B, n, m] and [B, m, p] tensors (no broadcasting, as in PyTorch)."""
    _float_mm("bmm", a, b)
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ShapeError(f"bmm: expected [B, n, m] and [B, m, p] tensors, got shapes {a.shape} and {b.shape}")
    return matmul(a, b)


def _beta_alpha(op: str, x: Tensor, prod: Tensor, beta, alpha) -> Tensor:
    broadcast_shapes(op, x.shape, prod.shape)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:  # the input is ignored, NaN and inf included (PyTorch's rule); its gradient is 0
        out = prod if prod.shape == broadcast_shapes(op, x.shape, prod.shape) else expand(prod, x.shape)
        return _ZeroGradFor.apply(out, x) if x.requires_grad and is_grad_enabled() else out
    return prod + (x if beta == 1 else x * beta)


def _wide(*ts: Tensor):
    """16-bit float operands as float32 (a fused multiply-add rounds once, as PyTorch's does)."""
    return tuple(to(t_, dt.float32) if t_.dtype.itemsize == 2 else t_ for t_ in ts)


class _ZeroGradFor(Function):
    """``out`` unchanged, with ``x`` recorded as an input whose gradient is zero (an input an
    op ignores but PyTorch still differentiates, such as addmm's with beta=0)."""

    @staticmethod
    def forward(ctx, out, x):
        ctx.shape = x.shape
        return _view(out, out.shape, out._strides, out._off)  # a new tensor: out keeps its own node

    @staticmethod
    def backward(ctx, g):
        return g, K.fill(K.empty(ctx.shape, g.dtype, g._st.rt), 0)


def addmm(x: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    """beta * x + alpha * (a @ b) for matrices a, b (x broadcasts to the product's shape);
    16-bit inputs are computed in float32 and rounded once."""
    _float_mm("addmm", x, a, b)
    if _amp.state.dtype is not None:  # autocast: in the low dtype
        x, a, b = _amp.low(x, a, b)
    out_dtype = a.dtype
    x, a, b = _wide(x, a, b)
    r = to(_beta_alpha("addmm", x, mm(a, b), beta, alpha), out_dtype)
    if r.shape != (a.shape[0], b.shape[1]):
        raise ShapeError(f"addmm: input {x.shape} does not broadcast to the product's shape {(a.shape[0], b.shape[1])}")
    return r


def baddbmm(x: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    """beta * x + alpha * bmm(a, b) (x broadcasts to [B, n, p]; beta=0 ignores x); 16-bit
    inputs are computed in float32 and rounded once."""
    _float_mm("baddbmm", x, a, b)
    if _amp.state.dtype is not None:  # autocast: in the low dtype
        x, a, b = _amp.low(x, a, b)
    out_dtype = a.dtype
    x, a, b = _wide(x, a, b)
    p = bmm(a, b)
    r = to(_beta_alpha("baddbmm", x, p, beta, alpha), out_dtype)
    if r.shape != p.shape:
        raise ShapeError(f"baddbmm: input {x.shape} does not broadcast to the product's shape {p.shape}")
    return r


def outer(a: Tensor, b: Tensor) -> Tensor:
    """The outer product of two vectors: out[i, j] = a[i] * b[j]."""
    _check_tensor(a, "outer"), _check_tensor(b, "outer")
    if a.ndim != 1 or b.ndim != 1:
        raise ShapeError(f"outer: expected two 1-D tensors, got shapes {a.shape} and {b.shape}")
    return mul(unsqueeze(a, 1), unsqueeze(b, 0))


def _diagonal_view(x: Tensor, d1: int, d2: int) -> Tensor:
    """The diagonal of dims d1 < d2 (equal sizes) as a view: d2 is dropped, d1 steps both."""
    shape = list(x.shape)
    strides = list(x._strides)
    strides[d1] += strides[d2]
    del shape[d2], strides[d2]
    return _Slice.apply(x, tuple(shape), tuple(strides), x._off)


def einsum(equation: str, *operands) -> Tensor:
    """Einstein summation (torch.einsum): explicit (``"bij,bjk->bik"``) or implicit output,
    ``...`` for broadcast dims, repeated labels in one operand (diagonals), any number of
    operands (contracted left to right; each pair as one batched matmul)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError("einsum: expected at least one operand")
    for o in operands:
        _check_tensor(o, "einsum")
    eq_ = equation.replace(" ", "")
    lhs, arrow, rhs = eq_.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum: the equation has {len(terms)} operands, {len(operands)} tensors were given")
    n_ell = 0
    parsed = []
    for term, op in zip(terms, operands):
        if term.count("...") > 1 or "." in term.replace("...", ""):
            raise ValueError(f"einsum: malformed subscripts {term!r}")
        letters = term.replace("...", "")
        if letters and not letters.isalpha():
            raise ValueError(f"einsum: subscripts must be letters, got {term!r}")
        if ("..." in term and op.ndim < len(letters)) or ("..." not in term and op.ndim != len(letters)):
            raise ShapeError(f"einsum: subscripts {term!r} do not match an operand of {op.ndim} dims")
        k = op.ndim - len(letters) if "..." in term else 0
        n_ell = builtins.max(n_ell, k)
        parsed.append((term, k))
    labels = []
    for term, k in parsed:
        pre, has_e, post = term.partition("...")
        labels.append(list(pre) + ([f"\0{n_ell - k + i}" for i in range(k)] if has_e else []) + list(post))
    ell = [f"\0{i}" for i in range(n_ell)]
    if arrow:
        if rhs.count("...") > 1:
            raise ValueError(f"einsum: malformed output {rhs!r}")
        pre, has_e, post = rhs.partition("...")
        out = list(pre) + (ell if has_e else []) + list(post)
        for c in out:
            if not c.startswith("\0") and not builtins.any(c in lab for lab in labels):
                raise ValueError(f"einsum: output label {c!r} does not appear in any operand")
        if len(set(out)) != len(out):
            raise ValueError(f"einsum: output subscripts {rhs!r} repeat a label")
    else:
        counts = {}
        for lab in labels:
            for c in lab:
                counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, n in counts.items() if n == 1 and not c.startswith("\0"))
    # sizes (1 broadcasts) and per-operand diagonals
    sizes: dict = {}
    ops = []
    for lab, op in zip(labels, operands):
        lab = list(lab)
        while True:
            dup = next(((i, j) for i in range(len(lab)) for j in range(i + 1, len(lab)) if lab[i] == lab[j]), None)
            if dup is None:
                break
            i, j = dup
            if op.shape[i] != op.shape[j]:
                raise ShapeError(f"einsum: label {lab[i]!r} repeats with sizes {op.shape[i]} and {op.shape[j]}")
            op = _diagonal_view(op, i, j)
            del lab[j]
        for c, s in zip(lab, op.shape):
            if sizes.get(c, 1) != 1 and s != 1 and sizes[c] != s:
                raise ShapeError(f"einsum: label {c!r} has sizes {sizes[c]} and {s}")
            if s != 1 or c not in sizes:
                sizes[c] = s
        ops.append((op, lab))

    def needed(i: int) -> set:
        keep = set(out)
        for _, lab in ops[i + 1:]:
            keep |= set(lab)
        return keep

    summed_alone = []  # whether a label was summed within one operand (PyTorch's sum: ints become int64)

    def reduce_own(op, lab, keep):
        drop = [k for k, c in enumerate(lab) if c not in keep]
        if drop:
            summed_alone.append(True)
            op = sum(op, dim=drop)
            lab = [c for k, c in enumerate(lab) if k not in drop]
        return op, lab

    cur, clab = reduce_own(*ops[0], needed(0) | (set(ops[1][1]) if len(ops) > 1 else set()))
    for i in range(1, len(ops)):
        b, blab = ops[i]
        keep = needed(i)
        b, blab = reduce_own(b, blab, keep | set(clab))
        cur, clab = _contract(cur, clab, b, blab, keep, sizes)
    cur, clab = reduce_own(cur, clab, set(out))
    shape = tuple(sizes[c] for c in clab)
    if cur.shape != shape:
        cur = expand(cur, shape)
    rdt = result_type(*operands)
    if rdt.kind != "float" and summed_alone:
        rdt = dt.int64
    if cur.dtype is not rdt:  # integer products are summed in int64
        cur = to(cur, rdt)
    return permute(cur, *[clab.index(c) for c in out]) if clab != out else cur


def _contract(a: Tensor, la: list, b: Tensor, lb: list, keep: set, sizes: dict):
    """Multiply two labelled operands and sum the labels they share that are not kept."""
    batch = [c for c in la if c in lb and c in keep]
    summed = [c for c in la if c in lb and c not in keep]
    a_only = [c for c in la if c not in lb]
    b_only = [c for c in lb if c not in la]
    if a.dtype.kind != "float" or b.dtype.kind != "float":
        # integer operands: a broadcast product and a sum (the matmul kernels are float-only)
        full = batch + a_only + b_only + summed

        def lay(t_, lab):
            t_ = permute(t_, *[lab.index(c) for c in full if c in lab])
            present = [c for c in full if c in lab]
            return reshape(t_, tuple(t_.shape[present.index(c)] if c in lab else 1 for c in full))

        prod = mul(lay(a, la), lay(b, lb))
        if summed:
            prod = sum(prod, dim=list(range(len(full) - len(summed), len(full))))
        return prod, batch + a_only + b_only
    def arrange(t_, lab, groups):
        order = [lab.index(c) for g in groups for c in g]
        t_ = permute(t_, *order)
        t_ = expand(t_, tuple(sizes[c] for g in groups for c in g))
        return reshape(t_, tuple(numel(tuple(sizes[c] for c in g)) for g in groups))

    am = arrange(a, la, (batch, a_only, summed))
    bm = arrange(b, lb, (batch, summed, b_only))
    r = matmul(am, bm)
    return reshape(r, tuple(sizes[c] for c in batch + a_only + b_only)), batch + a_only + b_only


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
        g, nrm = reshape(g, kshape), reshape(nrm, kshape)
        p = ctx.p
        if p == 1:
            r = g * K.unary("clamp", x * 1e30, -1.0, 1.0)  # sign(x), 0 at 0
        elif p == 2:
            r = where(eq(nrm, 0.0), 0.0, x * (g / nrm))
        else:
            ax = abs(x)
            scale = where(eq(nrm, 0.0), 0.0, g / pow(nrm, p - 1))
            r = x * pow(ax, p - 2) * scale if p >= 2 else where(eq(x, 0.0), 0.0, x * pow(ax, p - 2)) * scale
        return r, None, None, None


def norm(x: Tensor, p="fro", dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """torch.norm: vector p-norms over ``dim`` (None: every element) for any number p
    (``inf``: the largest |x|, ``-inf``: the smallest, 0: the count of non-zeros), and the
    Frobenius norm (``"fro"``, the 2-norm of the elements).  The gradient of the 2-norm (and
    of every p >= 1) is 0 where the norm is 0, as in PyTorch."""
    _check_tensor(x, "norm")
    if dtype is not None:
        x = to(x, dtype)
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
        return abs(x) if p != 0 else to(ne(x, 0.0), x.dtype)
    if math.isinf(p):
        a = abs(x)
        if x.numel() == 0 and p > 0:
            return sum(a, dim=list(dims), keepdim=keepdim)  # the norm of nothing is 0
        return amax(a, dims, keepdim) if p > 0 else amin(a, dims, keepdim)
    if p == 0:
        return _CountNonzero.apply(x, dims, keepdim)
    if p < 0:
        return pow(sum(pow(abs(x), p), dim=list(dims), keepdim=keepdim), 1.0 / p)
    return _PNorm.apply(x, p, dims, keepdim)


class _CountNonzero(Function):
    """The 0-"norm": the number of non-zeros, a step function (a zero gradient, as PyTorch's)."""

    @staticmethod
    def forward(ctx, x, dims, keepdim):
        ctx.shape = x.shape
        v = K.reduce("sum", K.copy(K.binary("ne", x, scalar_tensor(0.0, x.dtype, x._st.rt)), x.dtype), dims)[0]
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
        v, g = reshape(v, kshape), reshape(g, kshape)
        m = to(logical_or(eq(x, v), logical_and(ne(v, v), ne(x, x))), g.dtype)
        return m * (g / sum(m, dim=list(ctx.dims), keepdim=True)), None, None, None


def amax(x: Tensor, dim=(), keepdim: bool = False) -> Tensor:
    """The largest value over ``dim`` (() = every dim); NaN propagates; ties share the gradient."""
    _check_tensor(x, "amax")
    dims = _reduce_dims(dim, x.ndim, "amax") if x.ndim else ()
    if not dims:
        return clone(x)
    return _AMaxMin.apply(x, "max", dims, keepdim) if x.dtype.kind == "float" else _AMaxMin.forward(NO_CONTEXT, x, "max", dims, keepdim)


def amin(x: Tensor, dim=(), keepdim: bool = False) -> Tensor:
    """The smallest value over ``dim`` (() = every dim); NaN propagates; ties share the gradient."""
    _check_tensor(x, "amin")
    dims = _reduce_dims(dim, x.ndim, "amin") if x.ndim else ()
    if not dims:
        return clone(x)
    return _AMaxMin.apply(x, "min", dims, keepdim) if x.dtype.kind == "float" else _AMaxMin.forward(NO_CONTEXT, x, "min", dims, keepdim)


# -- activations, normalisation, losses ------------------------------------------------------------
def silu(x: Tensor, inplace: bool = False) -> Tensor:
    """x * sigmoid(x) (swish).  ``inplace`` is accepted and gives a new tensor."""
    _check_tensor(x, "silu")
    if x.dtype.kind != "float":
        raise DTypeError(f"silu: expected a floating-point tensor, got {x.dtype.name}")
    return x * sigmoid(x)


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """x where x > 0, else negative_slope * x.  ``inplace`` is accepted and gives a new tensor."""
    _check_tensor(x, "leaky_relu")
    if x.dtype.kind != "float":
        raise DTypeError(f"leaky_relu: expected a floating-point tensor, got {x.dtype.name}")
    return where(gt(x, 0.0), x, x * float(negative_slope))


_EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """x / sqrt(mean(x^2 over the last dims) + eps) * weight, computed in float32 and returned
    in x's dtype; ``eps=None`` is the machine epsilon of x's dtype (PyTorch's F.rms_norm)."""
    _check_tensor(x, "rms_norm")
    if _amp.state.dtype is not None:  # autocast: in float32
        x, weight = _amp.fp32(x, weight)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    ns = tuple(normalized_shape)
    if x.shape[x.ndim - len(ns):] != ns or len(ns) > x.ndim:
        raise ShapeError(f"rms_norm: input shape {x.shape} does not end with normalized_shape {ns}")
    if weight is not None and weight.shape != ns:
        raise ShapeError(f"rms_norm: weight has shape {weight.shape}, expected {ns}")
    if x.dtype.kind != "float":
        raise DTypeError(f"rms_norm: expected a floating-point tensor, got {x.dtype.name}")
    e = _EPS.get(x.dtype.name, _EPS["float32"]) if eps is None else float(eps)
    xf = to(x, dt.float32)
    dims = list(range(x.ndim - len(ns), x.ndim))
    y = xf * rsqrt(mean(xf * xf, dim=dims, keepdim=True) + e) if dims else xf * rsqrt(xf * xf + e)
    if weight is not None:
        y = y * to(weight, dt.float32)
    return to(y, x.dtype)


def _reduce_loss(op: str, per: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return per
    if reduction == "sum":
        return sum(per)
    if reduction == "mean":
        return mean(per)
    raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _loss_pair(op: str, x: Tensor, target):
    _check_tensor(x, op)
    target = _as_tensor_like(target, x)
    return _promote_pair(x, target, op)


def mse_loss(input: Tensor, target, size_average=None, reduce=None, reduction: str = "mean", weight=None) -> Tensor:
    """Mean squared error (input and target broadcast); ``reduction`` "mean", "sum" or "none"."""
    if size_average is not None or reduce is not None:
        raise TypeError("mse_loss: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
    a, b = _loss_pair("mse_loss", input, target)
    d = a - b
    per = d * d
    if weight is not None:
        per = per * weight
    return _reduce_loss("mse_loss", per, reduction)


def l1_loss(input: Tensor, target, size_average=None, reduce=None, reduction: str = "mean") -> Tensor:
    """Mean absolute error (input and target broadcast); ``reduction`` "mean", "sum" or "none"."""
    if size_average is not None or reduce is not None:
        raise TypeError("l1_loss: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
    a, b = _loss_pair("l1_loss", input, target)
    return _reduce_loss("l1_loss", abs(a - b), reduction)


def nll_loss(input: Tensor, target, weight: Tensor | None = None, size_average=None, ignore_index: int = -100,
             reduce=None, reduction: str = "mean") -> Tensor:
    """Negative log likelihood of log-probabilities ``input`` ((C), (N, C) or (N, C, d1, ...),
    classes on dim 1) at the class indices ``target``: -weight[t] * input[n, t].  Targets
    equal to ``ignore_index`` count for nothing; "mean" divides by the kept targets' total weight."""
    _check_tensor(input, "nll_loss")
    if size_average is not None or reduce is not None:
        raise TypeError("nll_loss: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"nll_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    target = _index_tensor(target, input, "nll_loss")
    if input.ndim == 0:
        raise ShapeError("nll_loss: input needs at least 1 dim (the classes), got a 0-d tensor")
    cdim = 0 if input.ndim == 1 else 1
    C = input.shape[cdim]
    want = input.shape[:cdim] + input.shape[cdim + 1:]
    if target.shape != want:
        raise ShapeError(f"nll_loss: input {input.shape} needs a target of shape {want}, got {target.shape}")
    if weight is not None and weight.shape != (C,):
        raise ShapeError(f"nll_loss: weight must have shape ({C},) (one per class), got {weight.shape}")
    h = _host_ready(target)
    if h is not None and h.size:
        bad = h[((h < 0) | (h >= C)) & (h != ignore_index)]
        if bad.size:
            raise IndexError(f"nll_loss: target {int(bad[0])} is out of range for {C} classes")
    valid = ne(target, ignore_index)
    safe = where(valid, target, 0)
    picked = squeeze(gather(input, cdim, unsqueeze(safe, cdim)), cdim) if input.ndim > 1 else \
        reshape(gather(input, 0, reshape(safe, (1,))), ())
    w = to(valid, input.dtype)
    if weight is not None:
        w = w * reshape(gather(to(weight, input.dtype), 0, reshape(safe, (-1,))), safe.shape)
    per = neg(picked) * w
    if reduction == "none":
        return per
    if reduction == "sum":
        return sum(per)
    return sum(per) / sum(w)


def one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
    """int64 one-hot vectors of the class indices ``x`` (a new last dim of ``num_classes``;
    -1: the largest index + 1, which reads the values on the host, as PyTorch does)."""
    _check_tensor(x, "one_hot")
    if x.dtype is not dt.int64:
        raise DTypeError(f"one_hot: expects an int64 tensor of class indices, got {x.dtype.name}")
    if num_classes == -1:
        if x.numel() == 0:
            raise ShapeError("one_hot: cannot infer the number of classes from an empty tensor; give num_classes")
        num_classes = int(max(x).item()) + 1
    h = _host_ready(x)
    if h is not None and h.size and (h.min() < 0 or h.max() >= num_classes):
        raise IndexError(f"one_hot: class values must be in [0, {num_classes}), got {int(h.min() if h.min() < 0 else h.max())}")
    classes = K.arange(num_classes, 0, 1, dt.int64, x._st.rt)
    return to(eq(unsqueeze(x, -1), classes), dt.int64)


def pad(x: Tensor, pad, mode: str = "constant", value: float | None = None) -> Tensor:
    """Pad (or, with negative amounts, crop) the last dims: ``pad`` is (left, right) for the
    last dim, then (top, bottom) for the one before, and so on.  ``mode`` "constant" fills
    with ``value`` (0); "reflect" mirrors without repeating the edge, "replicate" repeats
    the edge, "circular" wraps around."""
    _check_tensor(x, "pad")
    pad = tuple(int(p) for p in pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ShapeError(f"pad: expects an even number of pad amounts, at most two per dim of a {x.ndim}-dim tensor, got {pad}")
    pairs = [(pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]  # last dim first
    if mode == "constant":
        return _pad_constant(x, pairs, 0 if value is None else value)
    if mode not in ("reflect", "replicate", "circular"):
        raise ValueError(f"pad: mode must be 'constant', 'reflect', 'replicate' or 'circular', got {mode!r}")
    if value is not None and value != 0:
        raise ValueError(f"pad: a value is only used by mode='constant', not {mode!r}")
    out = x
    for i, (lo, hi) in enumerate(pairs):
        d = x.ndim - 1 - i
        n = x.shape[d]
        j = np.arange(-lo, n + hi, dtype=np.int64)
        if mode == "replicate":
            if n == 0:
                raise ShapeError(f"pad: cannot replicate-pad dim {d} of size 0")
            j = np.clip(j, 0, n - 1)
        elif mode == "reflect":
            if builtins.max(lo, hi) >= n:
                raise ShapeError(f"pad: reflect padding ({lo}, {hi}) must be smaller than dim {d}'s size {n}")
            period = 2 * (n - 1) if n > 1 else 1
            j = np.abs(j) % period if n > 1 else np.zeros_like(j)
            j = np.where(j >= n, period - j, j)
        else:  # circular: negative amounts crop first, the rest wraps around what is left
            c0, c1 = builtins.max(-lo, 0), n - builtins.max(-hi, 0)
            m = c1 - c0
            if m <= 0 or builtins.max(lo, hi) > m:
                raise ShapeError(f"pad: circular padding ({lo}, {hi}) can be at most dim {d}'s size {n}")
            j = c0 + np.arange(-builtins.max(lo, 0), m + builtins.max(hi, 0), dtype=np.int64) % m
        out = index_select(out, d, K.from_numpy(j, dt.int64, x._st.rt))
    return out


class _PadConstant(Function):
    @staticmethod
    def forward(ctx, x, pairs, value):
        ctx.pairs = pairs
        shape = list(x.shape)
        src, dst = [slice(None)] * x.ndim, [slice(None)] * x.ndim
        for i, (lo, hi) in enumerate(pairs):
            d = x.ndim - 1 - i
            n = x.shape[d]
            shape[d] = n + lo + hi
            if shape[d] < 0:
                raise ShapeError(f"pad: padding ({lo}, {hi}) makes dim {d} of size {n} negative")
            src[d] = slice(builtins.max(-lo, 0), builtins.max(n - builtins.max(-hi, 0), builtins.max(-lo, 0)))
            dst[d] = slice(builtins.max(lo, 0), builtins.max(lo, 0) + builtins.max(src[d].stop - src[d].start, 0))
        out = K.fill(K.empty(tuple(shape), x.dtype, x._st.rt), value)
        if out.numel():
            so, st, oo = _basic_index(out, tuple(dst))
            si, sst, oi = _basic_index(x, tuple(src))
            if numel(so):
                K.copy_into(Tensor(out._st, so, st, oo, x.dtype), Tensor(x._st, si, sst, oi, x.dtype))
        return out

    @staticmethod
    def backward(ctx, g):
        return _PadConstant.forward(NO_CONTEXT, g, [(-lo, -hi) for lo, hi in ctx.pairs], 0), None, None


def _pad_constant(x: Tensor, pairs, value) -> Tensor:
    return _PadConstant.apply(x, pairs, value)


class _FlashAttention(Function):
    """softmax(q k^T * scale) v on [B, H, T, D] operands by the flash kernel: O and the
    per-row log-sum-exp L are all the forward keeps (O(T) memory), the backward recomputes
    the probabilities from them."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        o, lse = K.flash_attn_fwd(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal = scale, causal
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        n = ctx.needs_input_grad
        dq, dk, dv = K.flash_attn_bwd(q, k, v, o, lse, g, ctx.scale, ctx.causal, need_q=n[0], need_kv=n[1] or n[2])
        return dq, dk if n[1] else None, dv if n[2] else None, None, None


def _as_bhtd(t_: Tensor, batch: tuple) -> Tensor:
    """``t_`` [..., T, D] broadcast to ``batch`` leading dims and seen as [B, H, T, D] (a
    view where the dims allow; broadcast dims keep stride 0, which the kernel reads)."""
    t_ = expand(t_, batch + t_.shape[-2:]) if t_.shape[:-2] != batch else t_
    if len(batch) <= 2:
        return reshape(t_, (1,) * (2 - len(batch)) + t_.shape)
    return reshape(t_, (-1, batch[-1]) + t_.shape[-2:])


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v, PyTorch's signature: q [..., L, E], k [..., S, E],
    v [..., S, Ev]; ``attn_mask`` bool (True = attend) or additive float, broadcasting to
    [..., L, S]; ``is_causal`` keeps key j <= query i; ``scale`` defaults to 1/sqrt(E);
    ``enable_gqa`` lets k and v have fewer heads (dim -3) than q, each shared by a group.

    Without a mask and dropout, with q, k and v of one float dtype and a head dim E = Ev of
    32, 64 or 128, this runs the flash-attention kernel (kernels_spirv/glsl/flash_attn.comp):
    no L x S matrix exists in the forward or the backward, memory grows with L + S.  Anything
    else (``attn_mask``, ``dropout_p`` > 0, other head dims, mixed dtypes) takes the dense
    path: scores, softmax and weights materialised as [..., L, S] tensors."""
    for t_ in (query, key, value):
        _check_tensor(t_, "scaled_dot_product_attention")
        if t_.dtype.kind != "float":
            raise DTypeError(f"scaled_dot_product_attention: expected floating-point tensors, got {t_.dtype.name}")
    if _amp.state.dtype is not None:  # autocast: in the low dtype (a float mask too)
        query, key, value, attn_mask = _amp.low(query, key, value, attn_mask)
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal, not both")
    if query.ndim < 2 or key.ndim < 2 or value.ndim < 2:
        raise ShapeError(f"scaled_dot_product_attention: expected [..., L, E] operands, got {query.shape}, {key.shape}, "
                         f"{value.shape}")
    E = query.shape[-1]
    s = 1.0 / math.sqrt(E) if scale is None else float(scale)
    if enable_gqa and query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        hq, hk = query.shape[-3], key.shape[-3]
        if hq % hk:
            raise ShapeError(f"scaled_dot_product_attention: {hq} query heads are not a multiple of {hk} key/value heads")
        key = repeat_interleave(key, hq // hk, dim=-3)
        value = repeat_interleave(value, hq // hk, dim=-3)
    if (attn_mask is None and dropout_p == 0.0 and not query._st.rt.is_host and query.dtype is key.dtype is value.dtype
            and E in K.FLASH_HEAD_DIMS and key.shape[-1] == E == value.shape[-1]):
        try:
            batch = broadcast_shapes("scaled_dot_product_attention", query.shape[:-2], key.shape[:-2], value.shape[:-2])
        except ShapeError:
            batch = None
        if batch is not None:
            q4, k4, v4 = (_as_bhtd(t_, batch) for t_ in (query, key, value))
            if K.flash_attn_supported(q4, k4, v4):
                o = _FlashAttention.apply(q4, k4, v4, s, bool(is_causal))
                return reshape(o, batch + o.shape[-2:])
    return _sdpa_dense(query, key, value, attn_mask, dropout_p, is_causal, s)


def _sdpa_dense(query: Tensor, key: Tensor, value: Tensor, attn_mask, dropout_p: float, is_causal: bool,
                s: float) -> Tensor:
    """scaled_dot_product_attention with the [..., L, S] scores materialised (masks, dropout,
    any head dim); 16-bit operands are computed in float32."""
    L, S = query.shape[-2], key.shape[-2]
    out_dtype = query.dtype
    if builtins.any(t_.dtype.itemsize == 2 for t_ in (query, key, value)):  # 16-bit: computed in float32
        query, key, value = _wide(query, key, value)
        if attn_mask is not None and attn_mask.dtype.kind == "float":
            attn_mask = to(attn_mask, dt.float32)
    scores = matmul(query, transpose(key, -2, -1))
    if is_causal and L == S and L > 0:
        attn = attention_softmax(scores, s, causal=True)
    else:
        scores = scores * s
        if is_causal:
            attn_mask = _tri_mask(K.empty((L, S), dt.bool_, query._st.rt), 0, False)
        if attn_mask is not None:
            if attn_mask.dtype is dt.bool_:
                scores = masked_fill(scores, logical_not(attn_mask), -math.inf)
            else:
                scores = scores + attn_mask
        attn = softmax(scores, -1)
    if dropout_p > 0.0:
        attn = dropout(attn, dropout_p)
    return to(matmul(attn, value), out_dtype)


# -- sampling --------------------------------------------------------------------------------------
def multinomial(input: Tensor, num_samples: int, replacement: bool = False, *, generator=None) -> Tensor:
    """Indices drawn from the categories of each row of ``input`` (non-negative weights, not
    necessarily normalised; 1-D or 2-D), ``num_samples`` per row, with or without
    replacement, from the Philox stream of ``generator`` (default: helios.random's, which
    ``helios.manual_seed`` seeds).  Without replacement, each row's draw is the top
    ``num_samples`` of log(w) + Gumbel noise (the same distribution as drawing one at a
    time); with replacement each sample is the argmax of its own noise."""
    _check_tensor(input, "multinomial")
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

    w = to(input, dt.float32) if input.dtype is not dt.float32 else input
    w2 = reshape(w, (-1, n))
    rows = w2.shape[0]
    S = 1 if not replacement else num_samples
    gen = generator or default_generator()
    seed, offset = gen.next_offset()
    u = K.rng((rows, S, n), dt.float32, 0, seed, offset, 0.0, 1.0, w2._st.rt)
    logw = log(unsqueeze(w2, 1))
    keys = where(gt(unsqueeze(w2, 1), 0.0), logw - log(neg(log(u))), -math.inf)
    with _no_grad_ctx():
        if replacement or num_samples == 1:  # one draw per noise row: Gumbel-max, no sort
            out = argmax(keys, dim=-1)
        else:
            out = reshape(topk(reshape(keys, (rows, n)), num_samples, dim=-1).indices, (rows, num_samples))
    return reshape(out, (num_samples,)) if input.ndim == 1 else out


def _no_grad_ctx():
    from helios.autograd.tape import no_grad

    return no_grad()


# -- indexing writes -------------------------------------------------------------------------------
def _advanced_setitem(x: Tensor, items: tuple, value) -> None:
    """x[items] = value where some items are index arrays or masks (PyTorch's rules: the
    value broadcasts to the shape x[items] has; where an index repeats, the last write wins)."""
    rt = x._st.rt
    if isinstance(value, Tensor):
        if value._st.rt is not rt:
            raise ShapeError(f"setitem: the value is on {value.device}, the tensor on {x.device}")
        v = value if value.dtype is x.dtype else K.copy(value, x.dtype)
    else:
        v = scalar_tensor(value, x.dtype, rt)
    # A single bool mask over leading dims with one value: a where, no host round trip.
    if len(items) == 1 and isinstance(items[0], Tensor) and items[0].dtype is dt.bool_ and v.numel() == 1 \
            and 0 < items[0].ndim <= x.ndim and items[0].shape == x.shape[:items[0].ndim]:
        m = reshape(items[0], items[0].shape + (1,) * (x.ndim - items[0].ndim))
        K.copy_into(x, K.where(m, reshape(v, ()), x))
        x._st.version += 1
        return
    n = x.numel()
    # Which elements x[items] names: the same indexing applied to their positions.
    positions = getitem(reshape(K.arange(n, 0, 1, dt.int64, rt), x.shape), items)
    M = positions.numel()
    if M == 0:
        broadcast_shapes("setitem", v.shape, positions.shape)
        return
    if v.shape != positions.shape:
        broadcast_shapes("setitem", v.shape, positions.shape)
        if len(v.shape) > len(positions.shape) or builtins.any(a != b and a != 1 for a, b in
                                                                zip(v.shape[::-1], positions.shape[::-1])):
            raise ShapeError(f"setitem: a value of shape {v.shape} cannot be written to {positions.shape} elements")
    src = K.copy(expand(v, positions.shape) if v.shape != positions.shape else v)
    keys, order = K.sort_rows(reshape(contiguous(positions), (1, M)))
    target = x if x.is_contiguous() else K.copy(x)
    K.scatter_rows(Tensor(target._st, (n, 1), (1, 1), target._off, x.dtype), Tensor(keys._st, (M,), (1,), 0, dt.int64),
                   Tensor(order._st, (M,), (1,), 0, dt.int32), Tensor(src._st, (M, 1), (1, 1), 0, x.dtype), "replace")
    if target is not x:
        K.copy_into(x, target)
    x._st.version += 1


def pin_memory(x: Tensor) -> Tensor:
    """PyTorch's page-locked host copy.  Host (cpu) tensors are returned as they are: Helios
    uploads them without an intermediate staging copy where device memory is host-visible,
    and through its own staging pool elsewhere; a device tensor cannot be pinned."""
    if not x.is_cpu:
        from helios.errors import DeviceError

        raise DeviceError(f"pin_memory: only host (cpu) tensors can be pinned, this one is on {x.device}")
    return x


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
              "logical_or",
              "t", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_add", "index_add_", "sort",
              "argsort", "msort", "topk", "cumsum", "cumprod", "flip", "roll", "repeat", "tile", "repeat_interleave",
              "movedim", "norm", "amax", "amin", "mm", "bmm", "addmm", "baddbmm", "outer", "pin_memory"]
    g = globals()
    for name in direct:
        setattr(Tensor, name, g[name])
    Tensor.T = property(lambda self: permute(self, *reversed(range(self.ndim))))
    Tensor.mT = property(lambda self: transpose(self, -2, -1))
    def cast(d):
        def method(self, memory_format=None):
            return to(self, d, memory_format=memory_format)

        method.__name__ = {"float32": "float", "float16": "half", "int64": "long", "int32": "int"}.get(d.name, d.name)
        method.__doc__ = f"The tensor as {d.name} (the same tensor if it already is)."
        return method

    Tensor.float = cast(dt.float32)
    Tensor.half = cast(dt.float16)
    Tensor.bfloat16 = cast(dt.bfloat16)
    Tensor.long = cast(dt.int64)
    Tensor.int = cast(dt.int32)
    Tensor.bool = cast(dt.bool_)
    Tensor.expand_as = lambda self, o: expand(self, o.shape)
    Tensor.view_as = lambda self, o: view(self, o.shape)
    Tensor.type_as = lambda self, o: to(self, o.dtype)


_install_methods()
