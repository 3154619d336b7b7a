"""Elementwise ops: arithmetic with broadcasting and Python scalars, unary math and
activations, comparisons and logic, ``where`` / ``masked_fill``.  Each kernel op's code comes from
the op table (kernels_spirv/ew_ops.py); its backward sits next to its forward here."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from helios import _kernels as K
from helios import dtypes as dt
from helios import fused_kernels
from helios._shape import broadcast_shapes
from helios.autograd.tape import NO_CONTEXT, Function
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


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
        gb = g * where(logical_and(eq(a, 0.0), ge(b, 0.0)), 0.0, pow(a, b) * F.log(a))
    return ga, gb


def _tie_weights(a: Tensor, b: Tensor, dtype, a_wins_if) -> Tensor:
    """The share of a maximum's (or minimum's) gradient that goes to ``a``: 1 where ``a`` was
    picked, 0 where ``b`` was, 1/2 on ties (PyTorch's rule), and 1 where either is NaN
    (NaN propagates, and so does the gradient, to both)."""
    lose = F.to(lt(a, b) if a_wins_if == "gt" else gt(a, b), dtype)
    tie = F.to(eq(a, b), dtype)
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
        return F.to(x, dt.float32)
    return x


def add(a, b, alpha: float = 1.0) -> Tensor:
    """a + alpha * b, broadcasting."""
    if isinstance(b, F.Number) and isinstance(a, Tensor):
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "add_s", float(b * alpha), 0.0)
    a, b = F._promote_pair(F._check_tensor(a, "add"), F._as_tensor_like(b, a), "add")
    if alpha != 1.0:
        b = b * alpha
    return _Add.apply(a, b)


def sub(a, b, alpha: float = 1.0) -> Tensor:
    """a - alpha * b, broadcasting."""
    if isinstance(b, F.Number) and isinstance(a, Tensor):
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "add_s", float(-b * alpha), 0.0)
    a, b = F._promote_pair(F._check_tensor(a, "sub"), F._as_tensor_like(b, a), "sub")
    if alpha != 1.0:
        b = b * alpha
    return _Sub.apply(a, b)


def rsub(x: Tensor, s, alpha: float = 1.0) -> Tensor:
    """s - alpha * x (PyTorch's rsub)."""
    if alpha != 1.0:
        x = mul(x, alpha)
    if isinstance(s, F.Number):
        x = _float_result(x, s)
        return _UnaryScalar.apply(x, "rsub_s", float(s), 0.0)
    return sub(F._as_tensor_like(s, x), x)


def mul(a, b) -> Tensor:
    """a * b, broadcasting."""
    if isinstance(b, F.Number) and isinstance(a, Tensor):
        if a.dtype is dt.bool_ and isinstance(b, bool):
            return logical_and(a, b)  # bool * bool stays bool
        if a.dtype is dt.bool_:
            a = F.to(a, dt.int64 if isinstance(b, int) else dt.float32)
        a = _float_result(a, b)
        return _UnaryScalar.apply(a, "mul_s", float(b), 0.0)
    a, b = F._promote_pair(F._check_tensor(a, "mul"), F._as_tensor_like(b, a), "mul")
    return _Mul.apply(a, b)


def div(a, b, rounding_mode: str | None = None) -> Tensor:
    """a / b: true division (integer inputs give float32), or with ``rounding_mode`` "trunc"
    (round toward zero) or "floor" (round down), which keep integer dtypes and, as in
    PyTorch, carry no gradient."""
    if rounding_mode is not None:
        return _div_rounded(a, b, rounding_mode)
    if isinstance(b, F.Number) and isinstance(a, Tensor):
        if a.dtype.kind != "float":
            a = F.to(a, dt.float32)
        return _UnaryScalar.apply(a, "div_s", float(b), 0.0)
    a, b = F._promote_pair(F._check_tensor(a, "div"), F._as_tensor_like(b, a), "div")
    if a.dtype.kind != "float":
        a, b = F.to(a, dt.float32), F.to(b, dt.float32)
    return _Div.apply(a, b)


def _div_rounded(a, b, mode: str) -> Tensor:
    if mode not in ("trunc", "floor"):
        raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {mode!r}")
    a = F._check_tensor(a, "div")
    if isinstance(b, F.Number):
        b = F.scalar_tensor(b, dt.scalar_result(a.dtype, b) if not isinstance(b, bool) else a.dtype, a._st.rt)
    a, b = F._promote_pair(a, F._as_tensor_like(b, a), "div")
    if a.dtype is dt.bool_:
        a, b = F.to(a, dt.int64), F.to(b, dt.int64)
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
    if isinstance(s, F.Number):
        if x.dtype.kind != "float":
            x = F.to(x, dt.float32)
        return _UnaryScalar.apply(x, "rdiv_s", float(s), 0.0)
    return div(F._as_tensor_like(s, x), x)


def pow(a, b) -> Tensor:
    """a ** b elementwise (either may be a number), with C's special cases: a negative base
    with a non-integer exponent gives NaN, 0 ** negative gives inf, x ** 0 gives 1.

    dtypes as in PyTorch: an integer (or bool) tensor to an integer power stays integer
    (exact, by repeated squaring; a negative scalar exponent is refused), any float makes
    the result float."""
    if isinstance(a, F.Number) and isinstance(b, Tensor):
        return rpow(b, a)
    F._check_tensor(a, "pow")
    if isinstance(b, F.Number):
        if a.dtype.kind != "float" and not isinstance(b, float):
            b = int(b)
            if b < 0:
                raise DTypeError(f"pow: integers to negative integer powers are not allowed ({a.dtype.name} tensor ** {b}); "
                                 "convert the tensor to a floating-point dtype first")
            if a.dtype is dt.bool_:
                a = F.to(a, dt.int64)
            return K.binary("pow", a, F.scalar_tensor(b, a.dtype, a._st.rt))
        a = _float_result(a, b)
        if b == 1:
            return a * 1.0
        return _UnaryScalar.apply(a, "pow_s", float(b), 0.0)
    a, b = F._promote_pair(a, F._as_tensor_like(b, a), "pow")
    if a.dtype.kind != "float":
        if a.dtype is dt.bool_:
            a, b = F.to(a, dt.int64), F.to(b, dt.int64)
        return K.binary("pow", a, b)
    return _Pow.apply(a, b)


def rpow(x: Tensor, s) -> Tensor:
    """s ** x (``s`` a number or a tensor)."""
    if isinstance(s, Tensor):
        return pow(s, x)
    if isinstance(s, (int, bool)) and x.dtype.kind != "float":
        t = dt.int64 if x.dtype is dt.bool_ else x.dtype
        return pow(F.scalar_tensor(int(s), t, x._st.rt), F.to(x, t))
    xf = x if x.dtype.kind == "float" else F.to(x, dt.float32)
    return pow(F._as_tensor_like(float(s), xf), xf)


def maximum(a: Tensor, b) -> Tensor:
    """Elementwise max (NaN propagates)."""
    a, b = F._promote_pair(F._check_tensor(a, "maximum"), F._as_tensor_like(b, a), "maximum")
    return _Maximum.apply(a, b)


def minimum(a: Tensor, b) -> Tensor:
    """Elementwise min (NaN propagates)."""
    a, b = F._promote_pair(F._check_tensor(a, "minimum"), F._as_tensor_like(b, a), "minimum")
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
    F._check_tensor(x, "clamp")
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        t = F.result_type(x, min, max)
        if t is dt.bool_:
            raise DTypeError("clamp: bool tensors cannot be clamped")
        lo = F.to(F._as_tensor_like(min, x), t) if min is not None else None
        hi = F.to(F._as_tensor_like(max, x), t) if max is not None else None
        return _ClampT.apply(F.to(x, t), lo, hi)
    if x.dtype.kind != "float":
        if not isinstance(min, float) and not isinstance(max, float):
            # integer bounds stay exact (no float32 round trip): max/min kernels of x's dtype
            if x.dtype is dt.bool_:
                raise DTypeError("clamp: bool tensors cannot be clamped")
            lo = F.scalar_tensor(int(min), x.dtype, x._st.rt) if min is not None else None
            hi = F.scalar_tensor(int(max), x.dtype, x._st.rt) if max is not None else None
            return _ClampT.forward(NO_CONTEXT, x, lo, hi)
        x = F.to(x, dt.float32)
    lo = -math.inf if min is None else float(min)
    hi = math.inf if max is None else float(max)
    return _UnaryScalar.apply(x, "clamp", lo, hi)


@dataclass(frozen=True)
class UnaryRule:
    """How a unary kernel op (kernels_spirv/ew_ops.py) becomes a differentiable function.

    ``saves``: what its backward needs ("output", "input" or "nothing"); ``grad(g, saved)``:
    the gradient of the input given the upstream gradient ``g`` (the backward rule, beside its
    forward); ``keeps_ints``: integer tensors stay integer (else they are computed in float32);
    ``public``: exported as ``helios.functional.<name>``, ``helios.<name>`` and the Tensor method
    (False: an internal building block of a public function of another name)."""

    saves: str
    grad: Callable
    keeps_ints: bool = False
    public: bool = True


# Every unary kernel op with its backward: adding one is this entry (after its kernel-table entry)
# and a parity test.  The functions, the exports and the Tensor methods are made from this table.
UNARY_RULES: dict[str, UnaryRule] = {
    "exp": UnaryRule("output", lambda g, y: g * y),
    "log": UnaryRule("input", lambda g, x: g / x),
    "sqrt": UnaryRule("output", lambda g, y: g / (y * 2.0)),
    "rsqrt": UnaryRule("output", lambda g, y: g * (y * y * y) * -0.5),
    "tanh": UnaryRule("output", lambda g, y: K.binary("tanh_bwd", y, g)),
    "sigmoid": UnaryRule("output", lambda g, y: K.binary("sigmoid_bwd", y, g)),
    "relu": UnaryRule("input", lambda g, x: K.binary("relu_bwd", x, g), public=False),  # F.relu: ints too
    "gelu": UnaryRule("input", lambda g, x: K.binary("gelu_bwd", x, g), public=False),  # F.gelu(approximate=)
    "gelu_tanh": UnaryRule("input", lambda g, x: K.binary("gelu_tanh_bwd", x, g), public=False),
    "abs": UnaryRule("input", lambda g, x: g * K.unary("clamp", x * 1e30, -1.0, 1.0), keeps_ints=True),  # sign(x)
    "sin": UnaryRule("input", lambda g, x: g * F.cos(x)),
    "cos": UnaryRule("input", lambda g, x: F.neg(g * F.sin(x))),
    "neg": UnaryRule("nothing", lambda g, _: F.neg(g), keeps_ints=True, public=False),  # F.neg refuses bool
}


class _Unary(Function):
    """A unary kernel op of :data:`UNARY_RULES`, differentiable by its rule."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        y = K.unary(op, x)
        saves = UNARY_RULES[op].saves
        if saves != "nothing":
            ctx.save_for_backward(y if saves == "output" else x)
        return y

    @staticmethod
    def backward(ctx, g):
        rule = UNARY_RULES[ctx.op]
        saved = ctx.saved_tensors[0] if rule.saves != "nothing" else None
        return rule.grad(g, saved), None


def _unary(op):
    keeps_ints = UNARY_RULES[op].keeps_ints

    def f(x: Tensor) -> Tensor:
        F._check_tensor(x, op)
        if x.dtype.kind != "float" and not keeps_ints:
            x = F.to(x, dt.float32)
        return _Unary.apply(x, op)

    f.__name__ = f.__qualname__ = op
    f.__doc__ = f"Elementwise {op}."
    return f


# The functions of the table: public ones under their name, the others as _name.
UNARY_FUNCTIONS = {(op if rule.public else f"_{op}"): _unary(op) for op, rule in UNARY_RULES.items()}
globals().update(UNARY_FUNCTIONS)
PUBLIC_UNARY = tuple(op for op, rule in UNARY_RULES.items() if rule.public)


def neg(x: Tensor) -> Tensor:
    """-x."""
    if x.dtype is dt.bool_:
        raise DTypeError("neg: negation of a bool tensor is not supported; use logical_not")
    return _Unary.apply(x, "neg")


def relu(x: Tensor) -> Tensor:
    """max(x, 0) elementwise (integer tensors stay integer, as in PyTorch)."""
    F._check_tensor(x, "relu")
    if x.dtype.kind != "float":
        if x.dtype is dt.bool_:
            raise DTypeError("relu: bool tensors are not supported; convert to an integer or float dtype")
        return K.binary("maximum", x, F.scalar_tensor(0, x.dtype, x._st.rt))
    return _Unary.apply(x, "relu")


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU: exact (erf) with approximate="none", or the tanh approximation with "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dtype.kind != "float":
        x = F.to(x, dt.float32)
    return _Unary.apply(x, "gelu" if approximate == "none" else "gelu_tanh")


def square(x: Tensor) -> Tensor:
    """x * x (integer tensors stay integer, bool becomes int64, as in PyTorch)."""
    F._check_tensor(x, "square")
    if x.dtype.kind != "float":
        x = F.to(x, dt.int64) if x.dtype is dt.bool_ else x
        return K.binary("mul", x, x)
    return pow(x, 2)


# -- comparisons and logic (not differentiable) ---------------------------------------------------
def _compare(op):
    def f(a, b) -> Tensor:
        a = F._check_tensor(a, op)
        b = F._as_tensor_like(b, a)
        a, b = F._promote_pair(a, b, op)
        return K.binary(op, a, b)

    f.__name__ = op
    f.__doc__ = f"Elementwise comparison {op} (bool result)."
    return f


eq, ne, lt, le, gt, ge = (_compare(o) for o in ("eq", "ne", "lt", "le", "gt", "ge"))


def _logical(op):
    def f(a, b) -> Tensor:
        a = F.to(F._check_tensor(a, op), dt.bool_)
        b = F.to(F._as_tensor_like(b, a), dt.bool_)
        return K.binary(op, a, b)

    return f


logical_and = _logical("and")
logical_or = _logical("or")
logical_xor = _logical("xor")


def logical_not(x: Tensor) -> Tensor:
    return K.binary("eq", F.to(x, dt.bool_), F.scalar_tensor(False, dt.bool_, x._st.rt))


class _Where(Function):
    @staticmethod
    def forward(ctx, cond, a, b):
        ctx.save_for_backward(cond)
        return K.where(cond, a, b)

    @staticmethod
    def backward(ctx, g):
        (cond,) = ctx.saved_tensors
        zero = F.scalar_tensor(0.0, g.dtype, g._st.rt)
        ga = K.where(cond, g, zero) if ctx.needs_input_grad[1] else None
        gb = K.where(cond, zero, g) if ctx.needs_input_grad[2] else None
        return None, ga, gb


def where(cond: Tensor, a, b) -> Tensor:
    """Elementwise ``a`` where ``cond`` else ``b`` (broadcasting; a or b may be scalars)."""
    F._check_tensor(cond, "where")
    if cond.dtype is not dt.bool_:
        cond = F.to(cond, dt.bool_)
    like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
    if like is None:
        like = F.scalar_tensor(float(a) if isinstance(a, float) or isinstance(b, float) else a, dt.float32, cond._st.rt)
    a, b = F._as_tensor_like(a, like), F._as_tensor_like(b, like)
    a, b = F._promote_pair(a, b, "where")
    return _Where.apply(cond, a, b)


def masked_fill(x: Tensor, mask: Tensor, value) -> Tensor:
    """``x`` with ``value`` where ``mask`` is true (x and mask broadcast; the result keeps x's
    dtype, as in PyTorch).  ``value`` is a number or a 0-d tensor (differentiable)."""
    F._check_tensor(x, "masked_fill")
    broadcast_shapes("masked_fill", x.shape, mask.shape)
    if isinstance(value, Tensor):
        if value.ndim:
            raise ShapeError(f"masked_fill: value must be a number or a 0-d tensor, got shape {value.shape}")
        return where(mask, F.to(value, x.dtype), x)
    return where(mask, F.scalar_tensor(value, x.dtype, x._st.rt), x)


# -- activations, normalisation, losses ------------------------------------------------------------
def silu(x: Tensor, inplace: bool = False) -> Tensor:
    """x * sigmoid(x) (swish).  ``inplace`` is accepted and gives a new tensor."""
    F._check_tensor(x, "silu")
    if x.dtype.kind != "float":
        raise DTypeError(f"silu: expected a floating-point tensor, got {x.dtype.name}")
    return x * F.sigmoid(x)


class _SiluMul(Function):
    """silu(gate) * up keeping only gate and up for backward (the separate ops keep sigmoid(gate)
    and silu(gate) too): the backward recomputes them, and issues its ops in two chains that the
    elementwise queue runs as two kernels, where the separate ops' backward took four dispatches."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return K.binary("mul", K.binary("mul", gate, K.unary("sigmoid", gate)), up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        g = F.contiguous(g)
        # the separate ops' values in their order: sigmoid, its product with gate, then the two
        # products' gradients (each g times the other operand) and sigmoid's, summed last
        s = K.unary("sigmoid", gate)
        d_up = K.binary("mul", g, K.binary("mul", gate, s))
        d_silu = K.binary("mul", g, up)
        d_gate = K.binary("add", K.binary("mul", d_silu, s), K.binary("sigmoid_bwd", s, K.binary("mul", d_silu, gate)))
        return d_gate, d_up


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (a SwiGLU MLP's gating), bit for bit ``F.silu(gate) * up``.  Of two
    contiguous float tensors of one shape and dtype, with fusion on, it keeps only gate and up
    for backward, not the two intermediates, and its backward is two fused elementwise kernels;
    anything else runs the separate ops."""
    if (fused_kernels.ENABLED and isinstance(gate, Tensor) and isinstance(up, Tensor) and gate.shape == up.shape
            and gate.dtype is up.dtype and gate.dtype.kind == "float" and gate._st.rt is up._st.rt
            and gate.is_contiguous() and up.is_contiguous()):
        return _SiluMul.apply(gate, up)
    return silu(gate) * up


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """x where x > 0, else negative_slope * x.  ``inplace`` is accepted and gives a new tensor."""
    F._check_tensor(x, "leaky_relu")
    if x.dtype.kind != "float":
        raise DTypeError(f"leaky_relu: expected a floating-point tensor, got {x.dtype.name}")
    return where(gt(x, 0.0), x, x * float(negative_slope))
