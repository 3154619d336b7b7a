"""Sparse attention on the flash kernel: block-sparse attention and LongNet's dilated attention.

* :func:`block_sparse_attention`: softmax(q k^T * scale) v restricted to the blocks of a
  block mask, the mask either given (a boolean [T / block_size, T / block_size] array) or
  built from a :class:`BlockPattern` (local windows, dilated blocks, global tokens,
  BigBird's random blocks, a user's mask, combined with ``|``).  The flash kernel
  (kernels_spirv/glsl/flash_attn.comp) skips masked blocks whole in the forward and both
  backward passes, so the time follows the number of computed blocks; the result equals
  dense attention with the element mask the block mask expands to.
* :func:`dilated_attention`: LongNet (Ding et al., 2023) as torchscale computes it: per
  (segment w, dilation r) pattern the sequence is cut into segments of w, each head keeps
  every r-th token of a segment from its head group's offset, flash attention runs on the
  gathered sub-sequences (segments batched), and the patterns' outputs are combined with
  softmax weights over their log-sum-exps.  That equals dense attention with the additive
  bias log c_qk, c_qk the number of patterns selecting both q and k in one segment.
* :class:`FlashAttentionLSE`: the flash kernel as an autograd Function returning (O, L), with
  the gradient through L (what dilated attention's combination needs).

Operands are PyTorch's layout [batch, heads, T, head_dim]; both functions are differentiable.
"""

from __future__ import annotations

import math

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios import functional as HF
from helios.autograd.tape import Function
from helios.errors import ShapeError
from helios.tensor import Tensor

__all__ = ["BlockPattern", "FlashAttentionLSE", "block_sparse_attention", "dilated_attention"]


# -- block patterns ----------------------------------------------------------------------------
class BlockPattern:
    """A rule that marks which (query block, key block) pairs attention computes, turned into
    a boolean block mask for a sequence length and block size by :meth:`block_mask`.
    Patterns combine with ``|`` (a block is computed when any part allows it):
    ``BlockPattern.local(window=256) | BlockPattern.global_(tokens=64)``."""

    def __init__(self, build, text: str):
        self._build = build  # (nq, nk, block_size) -> bool [nq, nk]
        self._text = text

    def __or__(self, other: BlockPattern) -> BlockPattern:
        if not isinstance(other, BlockPattern):
            return NotImplemented
        return BlockPattern(lambda nq, nk, bs: self._build(nq, nk, bs) | other._build(nq, nk, bs),
                            f"{self._text} | {other._text}")

    def __repr__(self) -> str:
        return f"BlockPattern({self._text})"

    def block_mask(self, T: int, block_size: int = 64, Tk: int | None = None) -> np.ndarray:
        """The boolean block mask [ceil(T / block_size), ceil(Tk / block_size)] (Tk defaults to
        T) of this pattern; True = computed.  Rows with no allowed key are refused where the
        mask meets the kernel (block_sparse_attention), where is_causal is known."""
        if int(T) <= 0 or int(block_size) <= 0:
            raise ValueError(f"block_mask: T and block_size must be positive, got {T} and {block_size}")
        Tk = T if Tk is None else int(Tk)
        nq, nk = -(-int(T) // int(block_size)), -(-Tk // int(block_size))
        m = np.asarray(self._build(nq, nk, int(block_size)), dtype=bool)
        assert m.shape == (nq, nk), (m.shape, nq, nk)
        return m

    @staticmethod
    def local(window: int) -> BlockPattern:
        """Sliding window by blocks: query block i sees key block j when their starts are less
        than ``window`` tokens apart (|i - j| * block_size < window): ``window`` = block_size is
        the diagonal alone, 256 with blocks of 64 three blocks each side."""
        w = int(window)
        if w <= 0:
            raise ValueError(f"BlockPattern.local: window must be positive, got {window}")

        def build(nq, nk, bs):
            if w < bs:
                raise ValueError(f"BlockPattern.local: window {w} is under the block size {bs}: no block would be kept")
            d = np.arange(nq)[:, None] - np.arange(nk)[None, :]
            return np.abs(d) * bs < w
        return BlockPattern(build, f"local(window={w})")

    @staticmethod
    def global_(tokens: int) -> BlockPattern:
        """Global tokens (Longformer, BigBird): the blocks holding the first ``tokens`` tokens
        see every key and are seen by every query."""
        n = int(tokens)
        if n <= 0:
            raise ValueError(f"BlockPattern.global_: tokens must be positive, got {tokens}")

        def build(nq, nk, bs):
            g = -(-n // bs)
            m = np.zeros((nq, nk), dtype=bool)
            m[:g, :] = True
            m[:, :g] = True
            return m
        return BlockPattern(build, f"global_(tokens={n})")

    @staticmethod
    def dilated(dilation: int, window: int | None = None) -> BlockPattern:
        """Dilated blocks (the Sparse Transformer's strided pattern by blocks): query block i sees
        key block j when i - j is a multiple of ``dilation``, within ``window`` tokens of block
        starts if given (|i - j| * block_size < window).  The diagonal block is always in."""
        r = int(dilation)
        if r <= 0:
            raise ValueError(f"BlockPattern.dilated: dilation must be positive, got {dilation}")
        w = None if window is None else int(window)
        if w is not None and w <= 0:
            raise ValueError(f"BlockPattern.dilated: window must be positive, got {window}")

        def build(nq, nk, bs):
            d = np.arange(nq)[:, None] - np.arange(nk)[None, :]
            m = d % r == 0
            return m if w is None else m & (np.abs(d) * bs < w)
        return BlockPattern(build, f"dilated(dilation={r}" + ("" if w is None else f", window={w}") + ")")

    @staticmethod
    def random(blocks_per_row: int, seed: int = 0) -> BlockPattern:
        """BigBird's random attention: each query block sees ``blocks_per_row`` key blocks drawn
        without replacement (all of them when there are fewer), from numpy's generator seeded
        with ``seed``: the same mask for the same (T, block_size, seed)."""
        n = int(blocks_per_row)
        if n <= 0:
            raise ValueError(f"BlockPattern.random: blocks_per_row must be positive, got {blocks_per_row}")

        def build(nq, nk, bs):
            rng = np.random.default_rng(seed)
            m = np.zeros((nq, nk), dtype=bool)
            for i in range(nq):
                m[i, rng.choice(nk, size=min(n, nk), replace=False)] = True
            return m
        return BlockPattern(build, f"random(blocks_per_row={n}, seed={seed})")

    @staticmethod
    def from_mask(mask) -> BlockPattern:
        """A user's boolean block mask [query blocks, key blocks] as a pattern (to combine with
        others); its shape must match the T and block size it is used with."""
        m = _host_bool(mask, "BlockPattern.from_mask")

        def build(nq, nk, bs):
            if m.shape != (nq, nk):
                raise ShapeError(f"BlockPattern.from_mask: the mask is {m.shape}, the sequence has {nq} x {nk} blocks "
                                 f"of {bs}")
            return m.copy()
        return BlockPattern(build, f"from_mask({m.shape[0]}x{m.shape[1]})")


def _host_bool(mask, name: str) -> np.ndarray:
    """``mask`` (numpy, nested lists or a helios tensor) as a 2-D numpy bool array."""
    if isinstance(mask, Tensor):
        mask = mask.numpy()
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"{name}: the block mask must be boolean (True = computed), got {m.dtype}")
    if m.ndim != 2:
        raise ShapeError(f"{name}: the block mask must be 2-D [query blocks, key blocks], got shape {m.shape}")
    return m


# -- the kernel as a Function ------------------------------------------------------------------
class FlashAttentionLSE(Function):
    """(O, L) of softmax(q k^T * scale) v on [B, H, T, D] operands by the flash kernel, L the
    float32 log-sum-exp of each query row; differentiable in q, k and v through both O and L
    (K.flash_attn_bwd's ``dlse``).  ``block_mask``: a K.FlashBlockMask or None (dense);
    ``token_major``: O stored as [B, T, H, D] under its [B, H, T, D] view (K.flash_attn_fwd).
    The backward writes q's, k's and v's gradients where the tape offers (split_heads' buffer)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, block_mask, token_major=False):
        o, lse = K.flash_attn_fwd(q, k, v, scale, causal, block_mask=block_mask, token_major=token_major)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal, ctx.block_mask = scale, causal, block_mask
        return o, lse

    @staticmethod
    def backward(ctx, grads):
        go, glse = grads
        q, k, v, o, lse = ctx.saved_tensors
        if go is None:  # only L was used: dO = 0
            go = HF.zeros_like(o)
        if glse is not None and glse.dtype is not dt.float32:
            glse = HF.to(glse, dtype=dt.float32)
        n = ctx.needs_input_grad
        dq, dk, dv = K.flash_attn_bwd(q, k, v, o, lse, go, ctx.scale, ctx.causal, need_q=n[0], need_kv=n[1] or n[2],
                                      block_mask=ctx.block_mask, dlse=glse, dest=tuple(ctx.grad_out(i) for i in range(3)))
        return dq, dk if n[1] else None, dv if n[2] else None, None, None, None, None


def _check_qkv(q, k, v, op: str, same_t: bool) -> None:
    for t in (q, k, v):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected helios tensors, got {type(t).__name__}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ShapeError(f"{op}: expected [batch, heads, T, head_dim] operands, got {q.shape}, {k.shape}, {v.shape}")
    if same_t and k.shape[2] != q.shape[2]:
        raise ShapeError(f"{op}: q and k must have the same T, got {q.shape[2]} and {k.shape[2]}")
    if not K.flash_attn_supported(q, k, v):
        raise ShapeError(f"{op}: the flash kernel takes q, k, v of one float dtype on a Vulkan device, the same batch, "
                         f"K/V heads dividing q's, head_dim in {K.FLASH_HEAD_DIMS}; got {q.dtype.name}/{k.dtype.name}/"
                         f"{v.dtype.name} {q.shape}, {k.shape}, {v.shape}")


# -- block-sparse attention --------------------------------------------------------------------
def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_mask=None, pattern: BlockPattern | None = None,
                           block_size: int = 64, is_causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale) v over the (query block, key block) pairs a block mask allows,
    q [B, H, Tq, D], k and v [B, Hk, Tk, D] (D 32, 64 or 128; Hk dividing H: grouped-query
    attention, query head h reading K/V head h // (H / Hk) in place).  Give ``block_mask``, a boolean
    [ceil(Tq / block_size), ceil(Tk / block_size)] array or tensor (True = computed, the last
    block row and column may be ragged), or ``pattern``, a :class:`BlockPattern`.  The mask
    is shared by every batch and head; ``is_causal`` adds key j <= query i inside the allowed
    blocks.  ``block_size`` must be a multiple of 64 (the kernels' tile).  Masked blocks are
    skipped whole, so the cost follows the density; the result (and its gradients) equal
    dense attention with the element mask the block mask expands to.  A query row without any
    allowed key is refused here, before any kernel runs.  ``scale`` defaults to 1/sqrt(D)."""
    _check_qkv(q, k, v, "block_sparse_attention", same_t=False)
    if (block_mask is None) == (pattern is None):
        raise ValueError("block_sparse_attention: give exactly one of block_mask and pattern")
    Tq, Tk = q.shape[2], k.shape[2]
    if pattern is not None:
        if not isinstance(pattern, BlockPattern):
            raise TypeError(f"block_sparse_attention: pattern must be a BlockPattern, got {type(pattern).__name__}")
        if int(block_size) <= 0 or int(block_size) % K.FLASH_BLOCK:
            raise ValueError(f"block_size: must be a positive multiple of {K.FLASH_BLOCK} (the flash kernels' tile), "
                             f"got {block_size}")
        m = pattern.block_mask(Tq, block_size, Tk)
    else:
        m = _host_bool(block_mask, "block_sparse_attention")
    bm = K.FlashBlockMask(m, block_size, Tq, Tk, bool(is_causal), q.untyped_storage().rt)
    s = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    o, _ = FlashAttentionLSE.apply(q, k, v, s, bool(is_causal), bm, True)  # heads merged for free (a view)
    return o


# -- dilated attention ------------------------------------------------------------------------
def _dilated_positions(T: int, w: int, r: int, offset: int) -> list[tuple[np.ndarray, int]]:
    """The token positions one head group keeps for pattern (w, r) with this offset, as
    (positions, segments) runs of equal-length sub-sequences: the full segments batched
    together, the ragged last one alone."""
    runs = []
    nfull, tail = divmod(T, w)
    n = len(range(offset, w, r))
    if nfull and n:
        pos = (np.arange(nfull)[:, None] * w + offset + r * np.arange(n)[None, :]).reshape(-1)
        runs.append((pos, nfull))
    nt = len(range(offset, tail, r))
    if nt:
        runs.append((nfull * w + offset + r * np.arange(nt), 1))
    return runs


def _head_groups(H: int, r: int) -> list[tuple[int, int, int]]:
    """(first head, heads, offset) of each head group of dilation r: torchscale splits the
    heads into r contiguous groups of ceil(H / r), head h using offset h // ceil(H / r)."""
    g = -(-H // r)
    return [(h0, min(g, H - h0), (h0 // g) % r) for h0 in range(0, H, g)]


def dilated_attention(q: Tensor, k: Tensor, v: Tensor, segments, dilations, is_causal: bool = False,
                      scale: float | None = None) -> Tensor:
    """LongNet's dilated attention, as torchscale computes it, on [B, H, T, D] operands (one T
    for q, k and v; D 32, 64 or 128).  For each pattern (w, r) of ``segments`` and
    ``dilations``: T is cut into segments of w tokens (the last one ragged), the heads into r
    contiguous groups of ceil(H / r), and head h keeps tokens offset, offset + r, ... of each
    segment, offset = (h // ceil(H / r)) mod r; flash attention runs on those sub-sequences
    (causal inside them with ``is_causal``).  The patterns' outputs are combined per token
    with softmax weights over their log-sum-exps, a pattern that does not keep the token
    weighing 0.  Exactly: dense attention with the additive bias log c_qk, c_qk the number
    of patterns keeping q and k in one segment (no attention where 0).  Every token must be
    kept by some pattern for every head (refused otherwise).  Differentiable in q, k, v."""
    _check_qkv(q, k, v, "dilated_attention", same_t=True)
    if k.shape[1] != q.shape[1]:  # its head groups cut q, k and v alike
        raise ShapeError(f"dilated_attention: k and v must have q's {q.shape[1]} heads, got {k.shape[1]} (grouped-query "
                         "heads are not supported here: repeat them first)")
    segs, dils = [int(x) for x in segments], [int(x) for x in dilations]
    if not segs or len(segs) != len(dils):
        raise ValueError(f"dilated_attention: segments and dilations must be non-empty and of one length, "
                         f"got {list(segments)} and {list(dilations)}")
    if any(x <= 0 for x in segs + dils):
        raise ValueError(f"dilated_attention: segments and dilations must be positive, got {segs} and {dils}")
    B, H, T, D = q.shape
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    causal = bool(is_causal)
    # every (head, token) must be kept by some pattern: its output is a softmax over patterns
    covered = np.zeros((H, T), dtype=bool)
    for w, r in zip(segs, dils):
        for h0, hg, off in _head_groups(H, r):
            for pos, _ in _dilated_positions(T, w, r, off):
                covered[h0:h0 + hg, pos] = True
    if not covered.all():
        h, t = (int(x[0]) for x in np.nonzero(~covered))
        raise ValueError(f"dilated_attention: with segments {segs} and dilations {dils} no pattern keeps token {t} of "
                         f"head {h}; add a pattern with dilation 1")
    rt = q.untyped_storage().rt
    outs, lses = [], []
    for w, r in zip(segs, dils):
        o_groups, l_groups = [], []
        for h0, hg, off in _head_groups(H, r):
            qh, kh, vh = (HF.narrow(t, 1, h0, hg) if hg != H else t for t in (q, k, v))
            o_runs, l_runs, pos_all = [], [], []
            for pos, nseg in _dilated_positions(T, w, r, off):
                idx = K.from_numpy(pos.astype(np.int64), dt.int64, rt)
                n = len(pos) // nseg
                # the segments become the kernel's heads, the (batch, head) pairs its batch
                qg, kg, vg = (HF.reshape(HF.index_select(t, 2, idx), (B * hg, nseg, n, D)) for t in (qh, kh, vh))
                o, lse = FlashAttentionLSE.apply(qg, kg, vg, s, causal, None)
                o_runs.append(HF.reshape(o, (B, hg, nseg * n, D)))
                l_runs.append(HF.reshape(lse, (B, hg, nseg * n)))
                pos_all.append(pos)
            pos = np.concatenate(pos_all)
            M = len(pos)
            # back to T positions by a gather from the kept rows plus one padding row (O = 0,
            # L = -inf: weight 0) for the tokens this group does not keep; differentiable
            inv = np.full(T, M, dtype=np.int64)
            inv[pos] = np.arange(M)
            inv_t = K.from_numpy(inv, dt.int64, rt)
            o_cat = HF.cat(o_runs + [HF.zeros_like(HF.narrow(o_runs[0], 2, 0, 1))], 2)
            l_cat = HF.cat(l_runs + [HF.full_like(HF.narrow(l_runs[0], 2, 0, 1), -math.inf)], 2)
            o_groups.append(HF.index_select(o_cat, 2, inv_t))
            l_groups.append(HF.index_select(l_cat, 2, inv_t))
        outs.append(HF.cat(o_groups, 1) if len(o_groups) > 1 else o_groups[0])
        lses.append(HF.cat(l_groups, 1) if len(l_groups) > 1 else l_groups[0])
    if len(outs) == 1:  # one pattern keeps every token (checked): its output as it is
        return outs[0]
    wts = HF.softmax(HF.stack(lses, 0), dim=0)  # [P, B, H, T] float32
    acc = None
    for i, o in enumerate(outs):
        wo = HF.unsqueeze(wts[i], -1) * (o if o.dtype is dt.float32 else HF.to(o, dtype=dt.float32))
        acc = wo if acc is None else acc + wo
    return acc if q.dtype is dt.float32 else HF.to(acc, dtype=q.dtype)
