"""Rotary position embedding (rotary.comp): RoPE's forward and backward in one dispatch each.

``rotary_fwd(x, cos, sin)`` is ``x * cos + roll(x, D/2, -1) * sin`` and ``rotary_bwd`` its
gradient with respect to x, bit for bit what the separate ops (a roll's two copies, two
products, a sum; in the backward two products, the roll's copies and the sum of x's two
gradients) compute: see the kernel's header for the rounding order.  With ``out_dtype`` a
16-bit x's float32 result is stored in that dtype ("rotary+cast": what a cast after it
stores), and its gradient comes in it ("cast+rotary_bwd").
"""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import fused_kernels
from helios._kernels.core import bind, empty, empty_in_layout, grid
from helios.tensor import Tensor

_P_ROTARY = struct.Struct("<17I")
F32, F16, BF16 = dt.float32, dt.float16, dt.bfloat16
# (x's dtype, the tables' dtype, the output's) the kernel has variants for: one dtype; a 16-bit x
# with float32 tables (autocast's promotion); and that result stored in x's dtype
_VARIANTS = {(F32, F32, F32): "f32", (F16, F16, F16): "f16", (BF16, BF16, BF16): "bf16",
             (F16, F32, F32): "f16_f32", (BF16, F32, F32): "bf16_f32",
             (F16, F32, F16): "f16_f32_f16", (BF16, F32, BF16): "bf16_f32_bf16"}


def rotary_supported(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: dt.DType | None = None) -> bool:
    """Whether rotary.comp takes x [B, H, T, D] with tables cos and sin [T, D] (unit column
    strides, one row stride), all on one device, and the output in ``out_dtype`` (None: the
    tables' dtype)."""
    if cos._st.rt is not x._st.rt or sin._st.rt is not x._st.rt:
        return False
    if x.ndim != 4 or cos.shape != x.shape[2:] or sin.shape != cos.shape or sin.dtype is not cos.dtype:
        return False
    if (x.dtype, cos.dtype, out_dtype or cos.dtype) not in _VARIANTS or x.shape[-1] < 2:
        return False
    return cos._strides[1] == 1 and sin._strides[1] == 1 and cos._strides[0] == sin._strides[0]


def _launch(src: Tensor, cos: Tensor, sin: Tensor, out: Tensor, variant: str, name: str) -> Tensor:
    n = out.numel()
    if n == 0:
        return out
    _, H, T, D = src.shape
    (bi, oi), (bc, oc), (bs, os_), (bo, oo) = bind(src), bind(cos), bind(sin), bind(out, True)
    rt = src._st.rt
    push = _P_ROTARY.pack(n, D, H, T, oi, *src._strides, oc, os_, cos._strides[0], oo, *out._strides)
    itemsizes = 2 * src.dtype.itemsize + 2 * cos.dtype.itemsize + out.dtype.itemsize
    rt.dispatch(rt.pipeline("rotary", variant), [bi, bc, bs, bo], push, grid(n), fused_kernels.dispatch_name(name, rt),
                3 * n, n * itemsizes)
    return out


def rotary_fwd(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: dt.DType | None = None) -> Tensor:
    """x * cos + roll(x, D/2, -1) * sin for x [B, H, T, D] (any strides) and tables [T, D]
    (rotary_supported): a new contiguous tensor in the tables' dtype (the promotion), or stored
    rounded to ``out_dtype``."""
    out = empty(x.shape, out_dtype or cos.dtype, x._st.rt)
    cast = out.dtype is not cos.dtype
    return _launch(x, cos, sin, out, _VARIANTS[(x.dtype, cos.dtype, out.dtype)] + "_fwd", "rotary+cast" if cast else "rotary")


def rotary_bwd(g: Tensor, cos: Tensor, sin: Tensor, x_dtype: dt.DType, x_strides: tuple) -> Tensor:
    """The gradient of rotary_fwd(x, cos, sin[, out_dtype]) with respect to x, from the output's
    gradient g (the output's dtype, any strides): in x's dtype, laid out with x's strides where
    they are dense."""
    key = (x_dtype, cos.dtype, g.dtype)
    if key not in _VARIANTS:
        raise ValueError(f"rotary_bwd: a {g.dtype.name} gradient for an output of {cos.dtype.name} tables "
                         f"and a {x_dtype.name} input")
    out = empty_in_layout(g.shape, x_strides, x_dtype, g._st.rt)
    cast = g.dtype is not cos.dtype
    return _launch(g, cos, sin, out, _VARIANTS[key] + "_bwd", "cast+rotary_bwd" if cast else "rotary_bwd")
