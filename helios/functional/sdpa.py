"""scaled_dot_product_attention: the flash kernel (memory linear in T) and the dense path
it falls back to (masks, dropout, head dims the kernel does not take)."""

from __future__ import annotations

import builtins
import math

from helios import _kernels as K
from helios import amp as _amp
from helios import dtypes as dt
from helios._shape import broadcast_shapes
from helios.autograd.tape import Function
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


class _FlashAttention(Function):
    """softmax(q k^T * scale) v on [B, H, T, D] operands by the flash kernel: O and the
    per-row log-sum-exp L are all the forward keeps (O(T) memory), the backward recomputes
    the probabilities from them.  O is stored token-major (as PyTorch's flash kernels store
    it), so merging the heads for the output projection is a view; the backward reads O's
    gradient where it is and writes q's, k's and v's where the tape offers (split_heads'
    fused QKV gradient): no layout copies either way (K.flash_attn_fwd / flash_attn_bwd, on
    the Vulkan kernels and on the device's own flash engine, cuda:N's, alike)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        o, lse = K.flash_attn_fwd(q, k, v, scale, causal, token_major=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal = scale, causal
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        n = ctx.needs_input_grad
        dq, dk, dv = K.flash_attn_bwd(q, k, v, o, lse, g, ctx.scale, ctx.causal, need_q=n[0], need_kv=n[1] or n[2],
                                      dest=tuple(ctx.grad_out(i) for i in range(3)))
        return dq, dk if n[1] else None, dv if n[2] else None, None, None


def _as_bhtd(t_: Tensor, batch: tuple) -> Tensor:
    """``t_`` [..., T, D] broadcast to ``batch`` leading dims and seen as [B, H, T, D] (a
    view where the dims allow; broadcast dims keep stride 0, which the kernel reads)."""
    t_ = F.expand(t_, batch + t_.shape[-2:]) if t_.shape[:-2] != batch else t_
    if len(batch) <= 2:
        return F.reshape(t_, (1,) * (2 - len(batch)) + t_.shape)
    return F.reshape(t_, (-1, batch[-1]) + t_.shape[-2:])


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v, PyTorch's signature: q [..., L, E], k [..., S, E],
    v [..., S, Ev]; ``attn_mask`` bool (True = attend) or additive float, broadcasting to
    [..., L, S]; ``is_causal`` keeps key j <= query i; ``scale`` defaults to 1/sqrt(E);
    ``enable_gqa`` lets k and v have fewer heads (dim -3) than q, each shared by a group.

    Without a mask and dropout, with q, k and v of one float dtype and a head dim E = Ev of
    32, 64 or 128, this runs the flash-attention kernel (kernels_spirv/glsl/flash_attn.comp):
    no L x S matrix exists in the forward or the backward, memory grows with L + S, and with
    ``enable_gqa`` the shared K/V heads are read in place (4-D operands).  Anything
    else (``attn_mask``, ``dropout_p`` > 0, other head dims, mixed dtypes) takes the dense
    path: scores, softmax and weights materialised as [..., L, S] tensors."""
    for t_ in (query, key, value):
        F._check_tensor(t_, "scaled_dot_product_attention")
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
        if attn_mask is None and dropout_p == 0.0 and query.ndim == 4 and key.ndim == value.ndim == 4 \
                and K.flash_attn_supported(query, key, value):  # the kernels share K/V heads: no copies
            return _FlashAttention.apply(query, key, value, s, bool(is_causal))
        key = F.repeat_interleave(key, hq // hk, dim=-3)
        value = F.repeat_interleave(value, hq // hk, dim=-3)
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
                return F.reshape(o, batch + o.shape[-2:])
    return _sdpa_dense(query, key, value, attn_mask, dropout_p, is_causal, s)


def _sdpa_dense(query: Tensor, key: Tensor, value: Tensor, attn_mask, dropout_p: float, is_causal: bool,
                s: float) -> Tensor:
    """scaled_dot_product_attention with the [..., L, S] scores materialised (masks, dropout,
    any head dim); 16-bit operands are computed in float32."""
    L, S = query.shape[-2], key.shape[-2]
    out_dtype = query.dtype
    if builtins.any(t_.dtype.itemsize == 2 for t_ in (query, key, value)):  # 16-bit: computed in float32
        query, key, value = F._wide(query, key, value)
        if attn_mask is not None and attn_mask.dtype.kind == "float":
            attn_mask = F.to(attn_mask, dt.float32)
    scores = F.matmul(query, F.transpose(key, -2, -1))
    if is_causal and L == S and L > 0:
        attn = F.attention_softmax(scores, s, causal=True)
    else:
        scores = scores * s
        if is_causal:
            attn_mask = F._tri_mask(K.empty((L, S), dt.bool_, query._st.rt), 0, False)
        if attn_mask is not None:
            if attn_mask.dtype is dt.bool_:
                scores = F.masked_fill(scores, F.logical_not(attn_mask), -math.inf)
            else:
                scores = scores + attn_mask
        attn = F.softmax(scores, -1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    return F.to(F.matmul(attn, value), out_dtype)
