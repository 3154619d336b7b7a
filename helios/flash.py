"""The flash-attention kernels as raw primitives: one forward and one backward of
softmax(q k^T * scale) v on [batch, heads, T, head_dim] blocks, no autograd.

For schedules that compose attention from blocks themselves (ring attention,
``helios.schedule.ring_attention``: each rank runs the kernel on its queries against one key
block at a time and merges the partial results through their log-sum-exps).  Differentiable
attention is ``helios.functional.scaled_dot_product_attention`` and
``helios.attention.FlashAttentionLSE``.

    if flash.supported(q, k, v):
        o, lse = flash.forward(q, k, v, scale, causal=True)          # O in q's dtype, L float32 [B, H, Tq]
        dq, dk, dv = flash.backward(q, k, v, o, lse, do, scale, causal=True)
    flash.pairs(tq, tk, causal=True)                                 # (query, key) pairs computed (FLOPs)
"""

from __future__ import annotations

from helios import _kernels as _K
from helios.tensor import Tensor

__all__ = ["HEAD_DIMS", "backward", "forward", "pairs", "supported"]

HEAD_DIMS: tuple = tuple(_K.FLASH_HEAD_DIMS)
"""The head dims the kernels are compiled for."""


def supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernels take these [B, H, T, D] operands: device tensors of one float dtype,
    a head dim in :data:`HEAD_DIMS` shared by q, k and v, the same B and H (fewer K/V heads only
    where the device's tensor-core kernels run them), non-empty, B * H within one dispatch."""
    return _K.flash_attn_supported(q, k, v)


def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool):
    """``(O, L)``: O = softmax(q k^T * scale) v, contiguous in q's dtype, and L the float32
    log-sum-exp of each query row's scaled scores ([B, H, Tq]).  ``causal``: query i sees keys
    j <= i (of the block as given: a shifted mask is a narrowed block).  Nothing of size
    Tq x Tk is allocated."""
    return _K.flash_attn_fwd(q, k, v, scale, causal)


def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, g: Tensor, scale: float, causal: bool):
    """``(dQ, dK, dV)`` of :func:`forward` given its O and L and the gradient ``g`` reaching O
    (FlashAttention-2's backward: P recomputed from L; deterministic, no atomics).  With the O and
    L of attention over a longer key sequence, it gives this block's exact share of dQ and its
    exact dK, dV (ring attention's backward)."""
    return _K.flash_attn_bwd(q, k, v, o, lse, g, scale, causal)


def pairs(tq: int, tk: int, causal: bool) -> int:
    """The (query, key) pairs one head of :func:`forward` computes: causal rows i see
    min(i + 1, tk) keys."""
    return _K.flash_attn_pairs(tq, tk, causal)
