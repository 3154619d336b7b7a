"""Rotary position embedding (rotary.comp): RoPE's forward and backward in one dispatch each.

``rotary_fwd(x, cos, sin)`` is ``x * cos + roll(x, D/2, -1) * sin`` and ``rotary_bwd`` its
gradient with respect to x, bit for bit what the separate ops (a roll's two copies, two
products, a sum; in the backward two products, the roll's copies and the sum of x's two
gradients) compute: see the kernel's header for the rounding order.
"""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import fused_kernels
from helios._kernels.core import bind, empty, grid
from helios._shape import contiguous_strides, numel
from helios.tensor import Storage, Tensor

_P_ROTARY = struct.Struct("<17I")
# (x's dtype, the tables' dtype) the kernel has variants for: one dtype, or a 16-bit x with
# float32 tables (autocast's promotion)
_VARIANTS = {(dt.float32, dt.float32): "f32", (dt.float16, dt.float16): "f16", (dt.bfloat16, dt.bfloat16): "bf16",
             (dt.float16, dt.float32): "f16_f32", (dt.bfloat16, dt.float32): "bf16_f32"}


def rotary_supported(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether rotary.comp takes x [B, H, T, D] with tables cos and sin [T, D] (unit column
    strides, one row stride) of a dtype pair it has a variant for."""
    if x.ndim != 4 or cos.shape != x.shape[2:] or sin.shape != cos.shape or sin.dtype is not cos.dtype:
        return False
    if (x.dtype, cos.dtype) not in _VARIANTS or x.shape[-1] < 2:
        return False
    return cos._strides[1] == 1 and sin._strides[1] == 1 and cos._strides[0] == sin._strides[0]


def _dense_in_layout(shape: tuple, strides: tuple, dtype: dt.DType, rt) -> Tensor:
    """A new tensor of ``shape`` in ``dtype`` with ``strides`` where they lay its elements out
    densely in some order of the dims (a transposed view's: its gradient then reaches the view's
    base without a copy), else a contiguous one."""
    order = sorted(range(len(shape)), key=lambda d: -strides[d])
    dense = contiguous_strides(tuple(shape[d] for d in order))
    if any(shape[d] > 1 and strides[d] != s for d, s in zip(order, dense)):
        return empty(shape, dtype, rt)
    laid = [0] * len(shape)
    for d, s in zip(order, dense):
        laid[d] = s
    return Tensor(Storage(rt, max(numel(shape), 1) * dtype.itemsize, "activations"), tuple(shape), tuple(laid), 0, dtype)


def _launch(src: Tensor, cos: Tensor, sin: Tensor, out: Tensor, variant: str, name: str) -> Tensor:
    n = out.numel()
    if n == 0:
        return out
    B, H, T, D = src.shape
    (bi, oi), (bc, oc), (bs, os_), (bo, oo) = bind(src), bind(cos), bind(sin), bind(out, True)
    rt = src._st.rt
    push = _P_ROTARY.pack(n, D, H, T, oi, *src._strides, oc, os_, cos._strides[0], oo, *out._strides)
    itemsizes = 2 * src.dtype.itemsize + 2 * cos.dtype.itemsize + out.dtype.itemsize
    rt.dispatch(rt.pipeline("rotary", variant), [bi, bc, bs, bo], push, grid(n), fused_kernels.dispatch_name(name, rt),
                3 * n, n * itemsizes)
    return out


def rotary_fwd(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + roll(x, D/2, -1) * sin for x [B, H, T, D] (any strides) and tables [T, D]
    (rotary_supported): a new contiguous tensor in the tables' dtype (the promotion)."""
    out = empty(x.shape, cos.dtype, x._st.rt)
    return _launch(x, cos, sin, out, _VARIANTS[(x.dtype, cos.dtype)] + "_fwd", "rotary")


def rotary_bwd(g: Tensor, cos: Tensor, sin: Tensor, x_dtype: dt.DType, x_strides: tuple) -> Tensor:
    """The gradient of rotary_fwd(x, cos, sin) with respect to x, from the output's gradient g
    (the tables' dtype, any strides): in x's dtype, laid out with x's strides where they are
    dense."""
    if g.dtype is not cos.dtype or (x_dtype, cos.dtype) not in _VARIANTS:
        raise ValueError(f"rotary_bwd: a {g.dtype.name} gradient for an output of {cos.dtype.name} "
                         f"from a {x_dtype.name} input")
    out = _dense_in_layout(g.shape, x_strides, x_dtype, g._st.rt)
    return _launch(g, cos, sin, out, _VARIANTS[(x_dtype, cos.dtype)] + "_bwd", "rotary_bwd")
