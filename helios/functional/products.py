"""Matrix products: matmul (batched, broadcast), linear and its fused variants (the epilogues
of helios.fused_kernels), mm/bmm/addmm/baddbmm/outer, einsum."""

from __future__ import annotations

import builtins

from helios import _kernels as K
from helios import amp as _amp
from helios import fused_kernels
from helios import dtypes as dt
from helios._shape import broadcast_shapes, numel
from helios.autograd.tape import Function, is_grad_enabled
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


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
        ga = _mm_grad(ctx, 0, g, F.transpose(b, -1, -2)) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            if b.ndim == 2 and a.ndim > 2:
                # B was shared by every batch matrix (a Linear weight): its gradient is one
                # [K, B*M] @ [B*M, N] product instead of B products summed afterwards, so
                # no [B, K, N] intermediate is written and no batch reduction runs.
                gb = _mm_grad(ctx, 1, F.transpose(F._rows(a), 0, 1), F._rows(g))
            else:
                gb = _mm_grad(ctx, 1, F.transpose(a, -1, -2), g)
        return ga, gb


def _heads_out(a: Tensor, b: Tensor, dtype=None):
    """Where a [B, H, M, K] @ [B, H, K, N] product goes when B's heads are interleaved in rows
    (split_heads' v: head h is columns h*N .. h*N+N-1 of rows L >= H*N elements apart): a
    new [B, M, H*N] buffer with the heads interleaved the same way, viewed as [B, H, M, N].
    Attention's y.transpose(1, 2).reshape(B, T, C) is then a view, not a copy.  None for
    any other operands (a new contiguous result).  ``dtype``: the product's, where a and b
    may differ (autocast's mixed products); else their one dtype."""
    if a.ndim != 4 or b.ndim != 4 or a.shape[:2] != b.shape[:2] or (dtype is None and a.dtype is not b.dtype):
        return None
    Bn, H, M, N = a.shape[0], a.shape[1], a.shape[2], b.shape[3]
    if H < 2 or b._strides[3] != 1 or b._strides[1] != N or b._strides[2] < H * N:
        return None
    L = H * N
    dtype = dtype or a.dtype
    buf = K.empty((Bn, M, L), dtype, a._st.rt)
    return Tensor(buf._st, (Bn, H, M, N), (M * L, N, L, 1), buf._off, dtype)


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


class _AutocastMatmul(Function):
    """a @ b under autocast, in the autocast dtype ``low``, where a or b is float32 (the tied
    output embedding, attention's float32 softmax times v): one product that rounds the float32
    operand as it loads it, and backward writes each gradient in its operand's dtype, bit for
    bit matmul()'s casts, product and the casts' backward (as _AutocastLinear).  Operands are
    >= 2-D with equal batch dims, or b 2-D (a weight shared by every batch matrix)."""

    op_name = "matmul"

    @staticmethod
    def forward(ctx, a, b, low):
        a, b = _autocast_operands(ctx, low, a, b)
        ctx.save_for_backward(a, b)
        if a.ndim > 2 and b.ndim > 2:  # as _Matmul: heads interleaved, any layout
            return K.matmul_any_layout(a, b, out=_heads_out(a, b, low), compute=low)
        return K.matmul(a, b, compute=low)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g, low = _in_dtype(g, ctx.low), ctx.low
        n = ctx.needs_input_grad
        ga = gb = None
        if n[0]:
            ga = _batched_grad(g, F.transpose(b, -1, -2), _slot(ctx, 0, a, ctx.dtypes[0]), low)
        if n[1]:
            if b.ndim == 2 and a.ndim > 2:  # the shared weight's gradient as one product, as _Matmul's
                gb = _batched_grad(F.transpose(F._rows(a), 0, 1), F._rows(g), _slot(ctx, 1, b, ctx.dtypes[1]), low)
            else:
                gb = _batched_grad(F.transpose(a, -1, -2), g, _slot(ctx, 1, b, ctx.dtypes[1]), low)
        return ga, gb, None


def _batched_grad(a: Tensor, b: Tensor, out: Tensor, low) -> Tensor:
    """a @ b in ``low`` stored into ``out`` (a gradient slot: any dtype matmul(compute=) takes), the
    batched products through matmul_any_layout as _mm_grad sends them (the same sums)."""
    if a.ndim > 2:
        return K.matmul_any_layout(a, b, out=out, compute=low)
    return K.matmul(a, b, out=out, compute=low)


def _autocast_matmul_dtype(a: Tensor, b: Tensor):
    """The autocast dtype when a @ b runs as an _AutocastMatmul (autocast and fusion on, a and b
    >= 2-D with equal batch dims or b 2-D, aligned with K > 0, each float32 or the autocast
    dtype and one float32, on one device), else None."""
    low = _amp.active_dtype()
    if low is None or not fused_kernels.ENABLED or not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return None
    ok = (low, dt.float32)
    if not (a.ndim >= 2 and b.ndim >= 2 and (b.ndim == 2 or a.shape[:-2] == b.shape[:-2])
            and a.shape[-1] == b.shape[-2] > 0 and a.numel() > 0 and b.numel() > 0
            and a.dtype in ok and b.dtype in ok and dt.float32 in (a.dtype, b.dtype) and b._st.rt is a._st.rt):
        return None
    return low


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with PyTorch's rules: 1-D operands, batched and broadcast batch dims."""
    F._check_tensor(a, "matmul"), F._check_tensor(b, "matmul")
    low = _autocast_matmul_dtype(a, b)
    if low is not None:  # autocast, the casts in the product's kernel
        return _AutocastMatmul.apply(a, b, low)
    if _amp.state.dtype is not None:  # autocast: in the low dtype
        a, b = _amp.low(a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: both arguments need at least 1 dim, got shapes {a.shape} and {b.shape}")
    a, b = F._promote_pair(a, b, "matmul")
    if a.dtype.kind != "float":
        raise DTypeError(f"matmul: expected floating-point tensors, got {a.dtype.name}")
    squeeze_a = a.ndim == 1
    squeeze_b = b.ndim == 1
    if squeeze_a:
        a = F.unsqueeze(a, 0)
    if squeeze_b:
        b = F.unsqueeze(b, -1)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} are not aligned ({a.shape[-1]} != {b.shape[-2]})")
    out = _Matmul.apply(a, b)
    if squeeze_a:
        out = F.squeeze(out, -2)
    if squeeze_b:
        out = F.squeeze(out, -1)
    return out


class _Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return K.matmul(x, F.transpose(w, 0, 1), b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return _linear_grads(ctx, g, x, w)


def _linear_grads(ctx, g, x, w, idx: tuple = (0, 1, 2)) -> tuple:
    """(gx, gw, gb) of linear(x, w, b) for the output gradient g, where x, w and b are inputs
    ``idx`` of ctx (None for x: its gradient is not computed here)."""
    n = ctx.needs_input_grad
    gx = matmul(g, w) if idx[0] is not None and n[idx[0]] else None
    gw = gb = None
    if n[idx[1]]:
        g2, x2 = F._rows(g), F._rows(x)
        # The same sums either way round; the CPU matmul is faster with the wider dim as
        # N (measured: [512, 1024] @ [1024, 128] ~15 GFLOP/s, [128, 1024] @ [1024, 512] ~20),
        # so a wide-output weight gets (x^T g)^T, a transposed view.
        # Into the weight's free slot, the transposed product is stored transposed.
        dest = _direct_dest(ctx, idx[1], w.shape, g2, x2)
        # With both free slots (float32 for the bias) the first form also yields the bias
        # gradient (helios.fused_kernels "matmul+bias_grad"): the kernel adds up the columns of g2
        # it loads anyway, the column reduction's sums, in the product's dispatch.  Every
        # weight takes it then, whatever its shape: on lavapipe the fused first form measured
        # 2.48 ms against 2.89 ms for the second form plus the reduction at 1024 rows, 512 in,
        # 128 out (the tiny GPT's MLP output), the same at 256 x 128 x 32, and the same as the
        # second form's product alone for square weights.  (matmul_bias_grad dispatches nothing
        # and returns False where it cannot fuse: then the forms below.)
        bdest = (_direct_dest(ctx, idx[2], (g.shape[-1],), g)
                 if fused_kernels.ENABLED and dest is not None and n[idx[2]] and g.ndim >= 2 and g.is_contiguous() else None)
        if bdest is not None and bdest.dtype is not dt.float32:
            bdest = None
        if bdest is not None and K.matmul_bias_grad(F.transpose(x2, 0, 1), g2, F.transpose(dest, 0, 1), bdest):
            gw, gb = dest, bdest
        elif w.shape[0] > w.shape[1]:
            if dest is not None:
                K.matmul(F.transpose(x2, 0, 1), g2, out=F.transpose(dest, 0, 1))
                gw = dest
            else:
                gw = F.transpose(matmul(F.transpose(x2, 0, 1), g2), 0, 1)
        elif dest is not None:
            gw = K.matmul(F.transpose(g2, 0, 1), x2, out=dest)
        else:
            gw = matmul(F.transpose(g2, 0, 1), x2)
    if n[idx[2]] and gb is None:
        dest = _direct_dest(ctx, idx[2], (g.shape[-1],), g)
        if dest is not None and g.ndim >= 2 and dest.dtype is dt.float32:
            # sum() of a float32 gradient over the leading dims, written into the slot
            gb, _ = K.reduce("sum", g, tuple(range(g.ndim - 1)), 1.0, out=dest)
        else:
            gb = F.sum_to_shape(g, (g.shape[-1],))
    return gx, gw, gb


class _LinearResidual(Function):
    """residual + linear(x, w, b) as one matmul (helios.fused_kernels "linear+residual")."""

    op_name = "linear+residual"

    @staticmethod
    def forward(ctx, x, w, b, residual):
        ctx.save_for_backward(x, w)
        out, _ = K.matmul_epilogue("linear+residual", x, F.transpose(w, 0, 1), b, residual)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        # the add's backward: the residual's gradient is g itself, as add() returns it
        return _linear_grads(ctx, g, x, w) + ((g if ctx.needs_input_grad[3] else None),)


class _LinearGelu(Function):
    """gelu_tanh(linear(x, w, b)) as one matmul (helios.fused_kernels "linear+gelu"): the kernel
    stores the pre-activation u for backward along with gelu(u)."""

    op_name = "linear+gelu"

    @staticmethod
    def forward(ctx, x, w, b):
        y, u = K.matmul_epilogue("linear+gelu", x, F.transpose(w, 0, 1), b, None)
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
    gelu_tanh_bwd in the product's epilogue (helios.fused_kernels "matmul+gelu_tanh_bwd")."""

    op_name = "mlp+residual"

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, residual):
        h, u = K.matmul_epilogue("linear+gelu", x, F.transpose(w1, 0, 1), b1, None)
        out, _ = K.matmul_epilogue("linear+residual", h, F.transpose(w2, 0, 1), b2, residual)
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


class _AutocastLinear(Function):
    """linear(x, w, b) under autocast, in the autocast dtype ``low``, with the casts of its float32
    operands done by the product's kernel (K.matmul's ``compute``): no cast kernels forward and
    none for their gradients backward, bit for bit linear()'s casts, product and the casts'
    backward.  x, w and b may each be float32 or ``low``; the result is ``low``.  Where the
    product's kernel reads ``low`` only, the operands' casts are kernels of their own, made once
    (_autocast_operands); on a matrix engine the gradients' casts ride in the backward products."""

    op_name = "linear"

    @staticmethod
    def forward(ctx, x, w, b, low):
        x, w, b = _autocast_operands(ctx, low, x, w, b)
        ctx.save_for_backward(x, w)
        return K.matmul(x, F.transpose(w, 0, 1), b, compute=low)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return _autocast_linear_grads(ctx, _grad_operand(g, ctx.low), x, w, ctx.low) + (None,)


class _AutocastLinearGelu(Function):
    """gelu_tanh(linear(x, w, b)) under autocast: _AutocastLinear's product with linear+gelu's
    epilogue (the pre-activation u stored in ``low`` for backward), bit for bit the casts, the
    product and the GELU."""

    op_name = "linear+gelu"

    @staticmethod
    def forward(ctx, x, w, b, low):
        x, w, b = _autocast_operands(ctx, low, x, w, b)
        y, u = K.matmul_epilogue("linear+gelu", x, F.transpose(w, 0, 1), b, None, compute=low)
        ctx.save_for_backward(x, w, u)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, u = ctx.saved_tensors
        gu = K.binary("gelu_tanh_bwd", u, _in_dtype(g, ctx.low))  # gelu's backward, as _LinearGelu's
        return _autocast_linear_grads(ctx, gu, x, w, ctx.low) + (None,)


class _AutocastLinearResidual(Function):
    """residual + linear(x, w, b) under autocast with a float32 residual: the product in ``low``
    rounded and added to the residual in float32 in its kernel's epilogue (linear+residual), the
    result float32, bit for bit the casts, the product, the promoting cast and the add.  (On a
    matrix engine too: its product rounded, widened and added to the residual in its epilogue.)"""

    op_name = "linear+residual"

    @staticmethod
    def forward(ctx, x, w, b, residual, low):
        x, w, b = _autocast_operands(ctx, low, x, w, b)
        ctx.save_for_backward(x, w)
        return _product_plus_residual(x, w, b, residual, low)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        # the add's backward passes g to both; the product's share goes through the promoting
        # cast's backward (g rounded to low), as the separate ops do: the products round it
        grads = _autocast_linear_grads(ctx, _grad_operand(g, ctx.low), x, w, ctx.low)
        return grads + ((g if ctx.needs_input_grad[3] else None), None)


class _AutocastMLPResidual(Function):
    """residual + linear(gelu_tanh(linear(x, w1, b1)), w2, b2) under autocast with a float32
    residual: _AutocastLinearGelu's and _AutocastLinearResidual's forward kernels, and a backward
    that multiplies c_proj's input gradient by gelu'(u) in the product that makes it (its
    "matmul+gelu_tanh_bwd" epilogue, as _MLPResidual's) instead of a kernel of its own: bit for bit
    those two Functions, one dispatch fewer and no hidden gradient stored."""

    op_name = "mlp+residual"

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, residual, low):
        x, w1, b1, w2, b2 = _autocast_operands(ctx, low, x, w1, b1, w2, b2)
        h, u = K.matmul_epilogue("linear+gelu", x, F.transpose(w1, 0, 1), b1, None, compute=low)
        ctx.save_for_backward(x, w1, u, h, w2)
        return _product_plus_residual(h, w2, b2, residual, low)

    @staticmethod
    def backward(ctx, g):
        x, w1, u, h, w2 = ctx.saved_tensors
        n, low = ctx.needs_input_grad, ctx.low
        gp = _grad_operand(g, low)  # c_proj's output gradient as its products read it
        _, gw2, gb2 = _autocast_linear_grads(ctx, gp, h, w2, low, (None, 3, 4))
        gx = gw1 = gb1 = None
        if n[0] or n[1] or n[2]:
            gu, _ = K.matmul_epilogue("matmul+gelu_tanh_bwd", gp, w2, None, u, compute=low)
            gx, gw1, gb1 = _autocast_linear_grads(ctx, gu, x, w1, low)
        return gx, gw1, gb1, gw2, gb2, (g if n[5] else None), None


def _product_plus_residual(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor, low) -> Tensor:
    """residual + linear(x, w, b) of an autocast projection: the product in ``low``, rounded and
    added to the float32 ``residual`` in one linear+residual kernel, into a new float32 tensor."""
    out = K.empty(residual.shape, residual.dtype, residual._st.rt)
    K.matmul_epilogue("linear+residual", x, F.transpose(w, 0, 1), b, residual, out=out, compute=low)
    return out


def _autocast_operands(ctx, low, a: Tensor, b: Tensor, *rest: Tensor | None) -> tuple:
    """An autocast product's operands (a linear's x, w, b; a matmul's a, b) as its kernel reads
    them, keeping on ctx what its backward needs besides the saved tensors: the autocast dtype
    and the operands' dtypes (their gradients').

    A kernel that rounds float32 operands as it loads them (K.matmul's ``compute``) takes them
    as they are.  Where the product's kernel reads ``low`` only (K.casts_operands_first: a matrix
    engine, whose TMA reads memory as it is; float16 on the CPU-driver kernel), the float32
    operands are cast to ``low`` here, once: backward's products then read these copies
    instead of casting them again (a matrix engine also stores float32 gradients rounded and
    widened in its epilogue), and the saved activation is the 16-bit one."""
    operands = (a, b, *rest)
    ctx.low, ctx.dtypes = low, tuple(t.dtype if t is not None else None for t in operands)
    if not K.casts_operands_first(a._st.rt, low, a.dtype is dt.float32, b.dtype is dt.float32):
        return operands
    return tuple(_in_dtype(t, low) if t is not None else None for t in operands)


def _in_dtype(g: Tensor, dtype) -> Tensor:
    """``g`` as ``dtype`` (a cast kernel only where it is another dtype)."""
    return g if g.dtype is dtype else K.copy(g, dtype)


def _grad_operand(g: Tensor, low) -> Tensor:
    """An autocast product's output gradient ``g`` as the products of its backward read it: a
    float32 ``g`` as it is where their kernel rounds float32 operands to ``low`` as it loads them
    (the same bits as the cast kernel it saves: a residual stream's gradient), else ``g`` in
    ``low``, cast once for them all (K.casts_operands_first)."""
    if g.dtype is dt.float32 and not K.casts_operands_first(g._st.rt, low, True, False):
        return g
    return _in_dtype(g, low)


def _autocast_linear_grads(ctx, g: Tensor, x: Tensor, w: Tensor, low, idx: tuple = (0, 1, 2)) -> tuple:
    """(gx, gw, gb) of an autocast linear (inputs ``idx`` of ctx: x's, w's, b's; x's None where
    its gradient is not wanted) for its output gradient g (``low``, or float32 where the products round it:
    _grad_operand): each gradient the product of g and the other operand rounded to ``low``,
    stored in its input's dtype (a float32 input gets the rounded gradient widened, as its cast's
    backward gives it), into the input's free gradient slot where it has one."""
    n = ctx.needs_input_grad
    ix, iw, ib = idx
    gx = gw = gb = None
    x_dtype, w_dtype, bias_dtype = (ctx.dtypes[i] if i is not None else None for i in idx)
    if ix is not None and n[ix]:
        gx = K.matmul(g, w, out=_slot(ctx, ix, x, x_dtype), compute=low)
    if n[iw]:
        g2, x2 = F._rows(g), F._rows(x)
        dest = _slot(ctx, iw, w, w_dtype)
        bdest = ctx.grad_out(ib) if n[ib] and fused_kernels.ENABLED and g.is_contiguous() else None
        if (bdest is not None and bdest.shape == (g.shape[-1],) and bdest.dtype is bias_dtype
                and K.matmul_bias_grad(F.transpose(x2, 0, 1), g2, F.transpose(dest, 0, 1), bdest, compute=low)):
            return gx, dest, bdest  # the bias gradient summed in the weight gradient's product
        # the wide-output weight as (x^T g)^T, as _linear_grads picks (the same sums either way)
        if w.shape[0] > w.shape[1]:
            gw = F.transpose(K.matmul(F.transpose(x2, 0, 1), g2, out=F.transpose(dest, 0, 1), compute=low), 0, 1)
        else:
            gw = K.matmul(F.transpose(g2, 0, 1), x2, out=dest, compute=low)
    if n[ib]:
        gb = F.sum_to_shape(_in_dtype(g, low), (g.shape[-1],))  # in low, as the separate product's bias gradient
        if bias_dtype is not low:  # its cast's backward
            dest = ctx.grad_out(ib)
            if dest is not None and dest.shape == gb.shape and dest.dtype is bias_dtype:
                K.copy_into(dest, gb)
                gb = dest
            else:
                gb = K.copy(gb, bias_dtype)
    return gx, gw, gb


def _slot(ctx, i: int, t: Tensor, dtype: dt.DType) -> Tensor:
    """Where input i's gradient goes: its free gradient slot (ctx.grad_out), else a new contiguous
    tensor of ``t``'s shape (``t``: the input or its saved 16-bit copy) and the input's ``dtype``."""
    dest = ctx.grad_out(i)
    if dest is not None and dest.shape == t.shape and dest.dtype is dtype:
        return dest
    return K.empty(t.shape, dtype, t._st.rt)


def mlp_residual(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, residual: Tensor) -> Tensor:
    """residual + linear(gelu(linear(x, w1, b1), approximate="tanh"), w2, b2), the GPT MLP
    block with its residual add, in fused kernels (helios.fused_kernels: linear+gelu and
    linear+residual forward, matmul+gelu_tanh_bwd backward), bit for bit the separate ops;
    where the fused kernels do not apply the separate ops run.  Under autocast, with a float32
    residual, the casts ride in the products' kernels, and backward's gelu_tanh_bwd in a product
    too, except where a matrix engine takes the autocast dtype (linear_gelu's engine product)."""
    low = _autocast_in_product(x, w1, b1)
    if low is not None:  # autocast: the linears with their casts in their kernels
        rt = x._st.rt
        if (not rt.has_gemm(low.name) and _autocast_weights_fit(low, low, w1.shape[0], rt, w2, b2)
                and _float32_residual(residual, rt, x.shape[:-1] + (w2.shape[0],))):
            return _AutocastMLPResidual.apply(x, w1, b1, w2, b2, residual, low)
        return linear_residual(linear_gelu(x, w1, b1), w2, b2, residual)
    if _amp.state.dtype is not None:  # autocast: c_fc in the low dtype, as linear() would cast it
        x, w1, b1 = _amp.low(x, w1, b1)
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
    extend: fusion on, no autocast conversion (none active, or every operand already in its
    dtype), one float dtype, a [..., K] input with K > 0, a unit-stride bias, and a device whose
    matrix engine does not take the dtype (there the engine's product, bias in its epilogue,
    beats the fused kernels' SIMT matmul)."""
    from helios import fused_kernels

    return (fused_kernels.ENABLED and isinstance(x, Tensor) and isinstance(weight, Tensor)
            and _amp.state.dtype in (None, x.dtype)
            and x.ndim >= 2 and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and x.shape[-1] > 0
            and x.numel() > 0 and x.dtype is weight.dtype and x.dtype.kind == "float"
            and (bias is None or (isinstance(bias, Tensor) and bias.shape == (weight.shape[0],)
                                  and bias.dtype is x.dtype and (bias.shape[0] == 1 or bias._strides[0] == 1)))
            and not x._st.rt.has_gemm(x.dtype.name))


def _autocast_in_product(x: Tensor, weight: Tensor, bias: Tensor | None):
    """The autocast dtype when linear(x, weight, bias) runs as an autocast linear whose kernels do
    the casts (_AutocastLinear and its fused forms), else None: autocast and fusion on, a [..., K]
    input with K > 0 and a 2-D weight, each of x, weight and a unit-stride bias float32 or the
    autocast dtype and at least one float32 (else there is no cast to fuse), all on one device.
    (Where a matrix engine takes the autocast dtype, the operands' casts stay kernels of their
    own and the gradients' casts ride in the products: _autocast_operands.)"""
    low = _amp.active_dtype()
    if low is None or not fused_kernels.ENABLED or not isinstance(x, Tensor):
        return None
    if not (x.ndim >= 2 and x.numel() > 0 and x.dtype in (low, dt.float32)):
        return None
    return low if _autocast_weights_fit(low, x.dtype, x.shape[-1], x._st.rt, weight, bias) else None


def _autocast_weights_fit(low, x_dtype: dt.DType, k: int, rt, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``weight`` and ``bias`` make an autocast linear (_autocast_in_product) of an input
    of ``x_dtype`` with ``k`` > 0 features on ``rt``, in autocast dtype ``low``."""
    ok = (low, dt.float32)
    if not (isinstance(weight, Tensor) and weight.ndim == 2 and weight.shape[1] == k > 0 and weight.dtype in ok
            and weight._st.rt is rt):
        return False
    if bias is not None and not (isinstance(bias, Tensor) and bias.shape == (weight.shape[0],) and bias.dtype in ok
                                 and bias._st.rt is rt and (bias.shape[0] == 1 or bias._strides[0] == 1)):
        return False
    return dt.float32 in (x_dtype, weight.dtype, bias.dtype if bias is not None else low)


def _float32_residual(residual, rt, shape: tuple) -> bool:
    """Whether ``residual`` is what an autocast linear+residual adds in float32: a contiguous
    float32 tensor of the product's ``shape`` on ``rt``."""
    return (isinstance(residual, Tensor) and residual.dtype is dt.float32 and residual._st.rt is rt
            and residual.shape == shape and residual.is_contiguous())


def linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """residual + linear(x, weight, bias): one matmul whose epilogue adds the residual
    (helios.fused_kernels "linear+residual"), bit for bit the separate ops; under autocast, with
    a float32 residual, the operands' casts ride in the kernel too; where the fused kernel does
    not apply (fusion off, mixed dtypes, a residual of another shape or layout) the separate
    ops run."""
    low = _autocast_in_product(x, weight, bias)
    if low is not None and _float32_residual(residual, x._st.rt, x.shape[:-1] + (weight.shape[0],)):
        return _AutocastLinearResidual.apply(x, weight, bias, residual, low)
    if (_fusible_linear(x, weight, bias) and isinstance(residual, Tensor) and residual.dtype is x.dtype
            and residual.shape == x.shape[:-1] + (weight.shape[0],) and residual.is_contiguous()):
        return _LinearResidual.apply(x, weight, bias, residual)
    return residual + linear(x, weight, bias)


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """gelu(linear(x, weight, bias), approximate="tanh"): one matmul that stores the
    pre-activation and its GELU (helios.fused_kernels "linear+gelu"), bit for bit the separate ops;
    where the fused kernel does not apply the separate ops run."""
    low = _autocast_in_product(x, weight, bias)
    if low is not None and x._st.rt.has_gemm(low.name):  # the engine's product, then the GELU kernel
        return F.gelu(_AutocastLinear.apply(x, weight, bias, low), approximate="tanh")
    if low is not None:  # autocast, the casts in the product's kernel
        return _AutocastLinearGelu.apply(x, weight, bias, low)
    if _amp.state.dtype is not None:  # autocast: the product in the low dtype (gelu, on neither list, follows it)
        x, weight, bias = _amp.low(x, weight, bias)
    if _fusible_linear(x, weight, bias):
        return _LinearGelu.apply(x, weight, bias)
    return F.gelu(linear(x, weight, bias), approximate="tanh")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T + bias (PyTorch's F.linear); the bias is added in the matmul's epilogue."""
    F._check_tensor(x, "linear"), F._check_tensor(weight, "linear")
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: expected input [..., {weight.shape[-1]}] and a 2-D weight, got {x.shape} and {weight.shape}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ShapeError(f"linear: expected a bias of shape ({weight.shape[0]},), got {bias.shape}")
    low = _autocast_in_product(x, weight, bias)
    if low is not None:  # autocast, the casts in the product's kernel (one dispatch, the same bits)
        return _AutocastLinear.apply(x, weight, bias, low)
    if _amp.state.dtype is not None:  # autocast: in the low dtype (the bias too: one rounding in the epilogue)
        x, weight, bias = _amp.low(x, weight, bias)
    # Mixed dtypes and 1-D inputs take the general path (promotion, vector matmul).
    if (x.ndim < 2 or x.dtype is not weight.dtype or x.dtype.kind != "float"
            or (bias is not None and bias.dtype is not x.dtype)):
        y = matmul(x, F.transpose(weight, 0, 1))
        return y if bias is None else y + bias
    if bias is not None and bias.shape[0] > 1 and bias._strides[0] != 1:
        bias = F.contiguous(bias)  # the matmul epilogue reads the bias with unit stride
    return _Linear.apply(x, weight, bias)


# -- products --------------------------------------------------------------------------------------
def _float_mm(op: str, *ts: Tensor) -> None:
    for t_ in ts:
        F._check_tensor(t_, op)
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
        out = prod if prod.shape == broadcast_shapes(op, x.shape, prod.shape) else F.expand(prod, x.shape)
        return _ZeroGradFor.apply(out, x) if x.requires_grad and is_grad_enabled() else out
    return prod + (x if beta == 1 else x * beta)


def _wide(*ts: Tensor):
    """16-bit float operands as float32 (a fused multiply-add rounds once, as PyTorch's does)."""
    return tuple(F.to(t_, dt.float32) if t_.dtype.itemsize == 2 else t_ for t_ in ts)


class _ZeroGradFor(Function):
    """``out`` unchanged, with ``x`` recorded as an input whose gradient is zero (an input an
    op ignores but PyTorch still differentiates, such as addmm's with beta=0)."""

    @staticmethod
    def forward(ctx, out, x):
        ctx.shape = x.shape
        return F._view(out, out.shape, out._strides, out._off)  # a new tensor: out keeps its own node

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
    r = F.to(_beta_alpha("addmm", x, mm(a, b), beta, alpha), out_dtype)
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
    r = F.to(_beta_alpha("baddbmm", x, p, beta, alpha), out_dtype)
    if r.shape != p.shape:
        raise ShapeError(f"baddbmm: input {x.shape} does not broadcast to the product's shape {p.shape}")
    return r


def outer(a: Tensor, b: Tensor) -> Tensor:
    """The outer product of two vectors: out[i, j] = a[i] * b[j]."""
    F._check_tensor(a, "outer"), F._check_tensor(b, "outer")
    if a.ndim != 1 or b.ndim != 1:
        raise ShapeError(f"outer: expected two 1-D tensors, got shapes {a.shape} and {b.shape}")
    return F.mul(F.unsqueeze(a, 1), F.unsqueeze(b, 0))


def _diagonal_view(x: Tensor, d1: int, d2: int) -> Tensor:
    """The diagonal of dims d1 < d2 (equal sizes) as a view: d2 is dropped, d1 steps both."""
    shape = list(x.shape)
    strides = list(x._strides)
    strides[d1] += strides[d2]
    del shape[d2], strides[d2]
    return F._Slice.apply(x, tuple(shape), tuple(strides), x._off)


def einsum(equation: str, *operands) -> Tensor:
    """Einstein summation (torch.einsum): explicit (``"bij,bjk->bik"``) or implicit output,
    ``...`` for broadcast dims, repeated labels in one operand (diagonals), any number of
    operands (contracted left to right; each pair as one batched matmul)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError("einsum: expected at least one operand")
    for o in operands:
        F._check_tensor(o, "einsum")
    labels, out = _einsum_labels(equation, operands)
    ops, sizes = _einsum_diagonals(labels, operands)

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
            op = F.sum(op, dim=drop)
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
        cur = F.expand(cur, shape)
    rdt = F.result_type(*operands)
    if rdt.kind != "float" and summed_alone:
        rdt = dt.int64
    if cur.dtype is not rdt:  # integer products are summed in int64
        cur = F.to(cur, rdt)
    return F.permute(cur, *[clab.index(c) for c in out]) if clab != out else cur


def _einsum_labels(equation: str, operands) -> tuple[list, list]:
    """(each operand's labels, the output's labels) of an einsum equation: a ``...`` becomes one label
    per broadcast dim ("\\0i", the same i for the same trailing dim of every operand), and an implicit
    output is the broadcast dims then the labels used once, sorted."""
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
    if not arrow:
        counts = {}
        for lab in labels:
            for c in lab:
                counts[c] = counts.get(c, 0) + 1
        return labels, ell + sorted(c for c, n in counts.items() if n == 1 and not c.startswith("\0"))
    if rhs.count("...") > 1:
        raise ValueError(f"einsum: malformed output {rhs!r}")
    pre, has_e, post = rhs.partition("...")
    out = list(pre) + (ell if has_e else []) + list(post)
    for c in out:
        if not c.startswith("\0") and not builtins.any(c in lab for lab in labels):
            raise ValueError(f"einsum: output label {c!r} does not appear in any operand")
    if len(set(out)) != len(out):
        raise ValueError(f"einsum: output subscripts {rhs!r} repeat a label")
    return labels, out


def _einsum_diagonals(labels: list, operands) -> tuple[list, dict]:
    """([(operand, its labels)], {label: size}): a label repeated within one operand becomes that
    operand's diagonal view (its sizes must agree), and a label's size is the one above 1 of its dims
    (1 broadcasts; two other sizes disagree)."""
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
    return ops, sizes


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
            t_ = F.permute(t_, *[lab.index(c) for c in full if c in lab])
            present = [c for c in full if c in lab]
            return F.reshape(t_, tuple(t_.shape[present.index(c)] if c in lab else 1 for c in full))

        prod = F.mul(lay(a, la), lay(b, lb))
        if summed:
            prod = F.sum(prod, dim=list(range(len(full) - len(summed), len(full))))
        return prod, batch + a_only + b_only
    def arrange(t_, lab, groups):
        order = [lab.index(c) for g in groups for c in g]
        t_ = F.permute(t_, *order)
        t_ = F.expand(t_, tuple(sizes[c] for g in groups for c in g))
        return F.reshape(t_, tuple(numel(tuple(sizes[c] for c in g)) for g in groups))

    am = arrange(a, la, (batch, a_only, summed))
    bm = arrange(b, lb, (batch, summed, b_only))
    r = matmul(am, bm)
    return F.reshape(r, tuple(sizes[c] for c in batch + a_only + b_only)), batch + a_only + b_only
