"""Neural-network ops: softmax/log_softmax, the GPT's head split and attention softmax,
layer_norm/rms_norm, rotary embedding, embedding, cross_entropy and the other losses, dropout, one_hot, pad."""

from __future__ import annotations

import builtins
import math

import numpy as np

from helios import _kernels as K
from helios import amp as _amp
from helios import dtypes as dt
from helios import fused_kernels
from helios import graph
from helios._shape import norm_dim, numel
from helios.autograd.tape import NO_CONTEXT, Function
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


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
        return K.softmax_rows(3 if ctx.log_ else 2, y, F.contiguous(g)), None


def _softmax_impl(x: Tensor, dim: int, log_: bool) -> Tensor:
    F._check_tensor(x, "softmax")
    if x.dtype.kind != "float":
        x = F.to(x, dt.float32)
    if x.ndim == 0:
        return _softmax_impl(F.reshape(x, (1,)), 0, log_).reshape(())
    d = norm_dim(dim, x.ndim, "softmax")
    if d != x.ndim - 1:
        return F.transpose(_softmax_impl(F.transpose(x, d, -1), -1, log_), d, -1)
    return _Softmax.apply(F.contiguous(x), log_)


def softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """exp(x) / sum(exp(x)) along ``dim`` (numerically stable); ``dtype`` converts x first."""
    if dtype is None and _amp.state.dtype is not None:  # autocast: in float32
        (x,) = _amp.fp32(x)
    return _softmax_impl(x if dtype is None else F.to(x, dtype), dim, False)


def log_softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """x - logsumexp(x) along ``dim``; ``dtype`` converts x first."""
    if dtype is None and _amp.state.dtype is not None:  # autocast: in float32
        (x,) = _amp.fp32(x)
    return _softmax_impl(x if dtype is None else F.to(x, dtype), dim, True)


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
        return tuple(F._view(x, (B, n_head, T, D), (sb, D * sc, st, sc), x._off + i * C * sc) for i in range(3))

    @staticmethod
    def backward(ctx, grads):
        ref = next(g for g in grads if g is not None)
        out, ctx.gbuf = getattr(ctx, "gbuf", None), None  # a new buffer for another pass (retain_graph)
        if out is None or out.dtype is not ref.dtype:
            out = K.empty(ctx.shape, ref.dtype, ref._st.rt)
        for i, g in enumerate(grads):
            dst = _SplitHeads._head_view(ctx, out, i)
            if g is None:
                K.copy_into(dst, F.scalar_tensor(0.0, ref.dtype, ref._st.rt))
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
    F._check_tensor(qkv, "split_heads")
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ShapeError(f"split_heads: expected [B, T, 3C] with 3C divisible by 3 * {n_head}, got {qkv.shape}")
    return _SplitHeads.apply(qkv, n_head)


class _AttentionSoftmax(Function):
    """softmax(x * scale) with an optional causal mask, one kernel each way.  ``cast`` (autocast
    with 16-bit scores): float32 probabilities from the 16-bit scores, and backward rounds the
    gradient to the scores' dtype, in the kernels (helios.fused_kernels "cast+softmax")."""

    @staticmethod
    def forward(ctx, x, scale, causal, cast=False):
        y = K.softmax_rows(0, x, scale=scale, causal=causal, out_dtype=dt.float32 if cast else None)
        ctx.scale, ctx.causal, ctx.grad_dtype = scale, causal, x.dtype
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        # Masked entries have y = 0, so the mask needs no separate backward: the kernel
        # writes their gradient as 0 and scales the rest.
        dx = K.softmax_rows(2, y, F.contiguous(g), scale=ctx.scale, causal=ctx.causal,
                            out_dtype=ctx.grad_dtype)
        return dx, None, None, None


def attention_softmax(scores: Tensor, scale: float = 1.0, causal: bool = False) -> Tensor:
    """softmax(scores * scale) over the last dim, with a causal mask over the last two dims
    (query i sees keys 0..i) when ``causal``: one kernel for what is otherwise a scale, a
    where and a softmax (the same arithmetic, so the same values)."""
    F._check_tensor(scores, "attention_softmax")
    # Autocast computes it in float32, as softmax: 16-bit scores are read by the kernel itself
    # instead of a float32 copy of them (fused_kernels "cast+softmax").
    cast = _amp.active_dtype() is not None and scores.dtype in (dt.bfloat16, dt.float16) and fused_kernels.enabled()
    if not cast:
        (scores,) = _amp.fp32(scores)
    if scores.dtype.kind != "float":
        raise DTypeError(f"attention_softmax: expected floating-point scores, got {scores.dtype.name}")
    if causal and (scores.ndim < 2 or scores.shape[-1] != scores.shape[-2]):
        raise ShapeError(f"attention_softmax: a causal mask needs square [..., T, T] scores, got {scores.shape}")
    return _AttentionSoftmax.apply(F.contiguous(scores), float(scale), bool(causal), cast)


class _LayerNorm(Function):
    """LayerNorm over the last dim of contiguous x; with ``rms`` RMSNorm (the same kernels
    with the mean taken as 0: layernorm.comp's RMS).  ``out_dtype``: a float32 x's result
    stored rounded to that 16-bit dtype ("layer_norm+cast"); its gradient then comes in that
    dtype, which the backward kernels read as it is."""

    @staticmethod
    def forward(ctx, x, w, b, eps, rms=False, out_dtype=None):
        y, mean_, rstd = K.layer_norm_fwd(x, w, b, eps, rms, out_dtype)
        ctx.save_for_backward(x, w, mean_, rstd)
        ctx.has_b = b is not None
        ctx.rms = rms
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, mean_, rstd = ctx.saved_tensors
        g = F.contiguous(g)
        need_w = w is not None and ctx.needs_input_grad[1]
        need_b = ctx.has_b and ctx.needs_input_grad[2]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # the gradient x already has from its other uses, added in the kernel's store
            acc = ctx.grad_pending(0) if fused_kernels.ENABLED and hasattr(ctx, "grad_pending") else None
            if fused_kernels.ENABLED and (need_w or need_b):  # both gradients in one dispatch where it can
                dx, dw, db = K.layer_norm_bwd(x, w, g, mean_, rstd, need_w, need_b, acc,
                                              ctx.grad_out(1), ctx.grad_out(2), ctx.rms)
                return dx, dw, db, None, None, None
            dx = K.layer_norm_bwd_input(x, w, g, mean_, rstd, acc, ctx.rms)
        if need_w or need_b:  # into the parameters' free slots when both share one buffer
            dw, db = K.layer_norm_bwd_params(x, g, mean_, rstd, need_w, need_b, ctx.grad_out(1), ctx.grad_out(2))
        return dx, dw, db, None, None, None


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
               *, feeds_products: bool = False) -> Tensor:
    """LayerNorm over the last dim(s) ``normalized_shape`` (computed in float32 under autocast).

    ``feeds_products``: the caller's promise that one autocast product (a linear or a matmul)
    reads the result and nothing else does: it rounds the result to the autocast dtype as it
    loads it.  Under autocast (fusion on) the result is then stored in that dtype, the values the
    product reads, in half the bytes, and its gradient comes back in it (helios.fused_kernels
    "layer_norm+cast").  (One reader: two would add their 16-bit gradients in 16 bits.)  Without
    autocast it changes nothing."""
    low = None
    if _amp.state.dtype is not None:  # autocast: in float32
        x, weight, bias = _amp.fp32(x, weight, bias)
        low = _amp.active_dtype() if feeds_products and fused_kernels.ENABLED else None
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if x.shape[x.ndim - len(normalized_shape):] != normalized_shape:
        raise ShapeError(f"layer_norm: input shape {x.shape} does not end with normalized_shape {normalized_shape}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != normalized_shape:
            raise ShapeError(f"layer_norm: {name} has shape {p.shape}, expected {normalized_shape}")
    return _normalize_rows(x, normalized_shape, weight, bias, eps, False, low)


def _normalize_rows(x: Tensor, ns: tuple, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool,
                    out_dtype=None) -> Tensor:
    """_LayerNorm (``rms``: RMSNorm) over x's last dims ``ns``, flattened into rows of their
    product; weight and bias (None: none) of shape ``ns``; ``out_dtype``: _LayerNorm's."""
    C = numel(ns)

    def flat(p):
        return F.reshape(F.contiguous(p), (C,)) if p is not None else None

    x2 = F.reshape(F.contiguous(x), x.shape[: x.ndim - len(ns)] + (C,))
    return F.reshape(_LayerNorm.apply(x2, flat(weight), flat(bias), float(eps), rms, out_dtype), x.shape)


class _Embedding(Function):
    @staticmethod
    def forward(ctx, idx, w):
        ctx.save_for_backward(idx)
        ctx.V, ctx.dtype = w.shape[0], w.dtype
        return K.embedding_fwd(w, idx)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return None, _table_grad(ctx, 1, F._rows(F.contiguous(g)), idx, ctx.V, ctx.dtype)


class _EmbeddingAdd(Function):
    """w[idx] + w2[pos] with pos [T] the positions of idx's last dim, one kernel forward
    (helios.fused_kernels "embedding+add").  Backward, each table's gradient in one kernel:
    w2's sums over every row of every batch that took a position, where those are the bits of
    the batch sum then the embedding backward that the separate ops run (each position taken
    once, one run of the column sum), else those two."""

    @staticmethod
    def forward(ctx, idx, w, pos, w2):
        ctx.save_for_backward(idx, pos)
        ctx.V, ctx.V2, ctx.dtype = w.shape[0], w2.shape[0], w.dtype
        return K.embedding_add_fwd(w, idx, w2, pos)

    @staticmethod
    def backward(ctx, g):
        idx, pos = ctx.saved_tensors
        g2 = F._rows(F.contiguous(g))
        dw = _table_grad(ctx, 1, g2, idx, ctx.V, ctx.dtype) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[3]:
            return None, dw, None, None
        batches, T = idx.numel() // pos.numel(), pos.numel()
        host = _host_indices(pos).reshape(-1)  # (read once: _table_grad groups these)
        if np.unique(host).size == T and K.column_chunks(g2._st.rt, batches, g2.numel() // batches)[0] == 1:
            return None, dw, None, _table_grad(ctx, 3, g2, pos, ctx.V2, ctx.dtype, tile=batches, name="sum+embedding_bwd",
                                               host=host)
        per_position = F.sum_to_shape(F.reshape(g2, (batches, T, g2.shape[-1])), (T, g2.shape[-1]))
        return None, dw, None, _table_grad(ctx, 3, per_position, pos, ctx.V2, ctx.dtype, host=host)


def _table_grad(ctx, i: int, g2: Tensor, idx: Tensor, V: int, dtype: dt.DType, tile: int = 1, name=None,
                host: np.ndarray | None = None) -> Tensor:
    """The gradient of an embedding table, input ``i`` of ``ctx``'s node ([V, C]), from the
    gradient g2 [rows, C] of the rows it gave (row r took the table's row idx[r mod idx.numel()]:
    ``tile`` copies of the indices; ``host``: idx's values where the caller has read them): into
    the table's free slot, or added to the gradient its slot already holds (a tied table's:
    "embedding_bwd+acc"), else into new memory."""
    gr = graph.capturing()
    if gr is not None and gr.made_inside(idx):
        raise graph.GraphCaptureError("embedding backward inside hl.graph.capture: its indices are grouped on "
                                      "the host, so they must come from outside the step (an input of "
                                      "capture(inputs=...)), not be computed inside it")
    order, rowptr = _group_by_row(np.tile((_host_indices(idx) if host is None else host).reshape(-1), tile), V)
    rt = g2._st.rt
    pos = K.from_numpy(order, dt.int64, rt)
    rp = K.from_numpy(rowptr, dt.int32, rt)
    if gr is not None:  # a replay groups its own indices (the capture's inputs hold them by then)
        graph.before_replay(lambda: _regroup(idx, V, pos, rp, tile))
    dest = ctx.grad_out(i)  # the table's free gradient slot, if any
    if dest is not None and (dest.dtype is not g2.dtype or dest.shape != (V, g2.shape[-1])):
        dest = None
    if dest is None and fused_kernels.ENABLED and g2.dtype is dtype and hasattr(ctx, "grad_pending"):
        # a tied table's slot that already holds the LM head's gradient: add into it
        # (fused_kernels "embedding_bwd+acc")
        acc = ctx.grad_pending(i)
        if acc is not None:
            return K.embedding_bwd(g2, pos, rp, V, out=acc, add=True, name=name)
    return K.embedding_bwd(g2, pos, rp, V, out=dest, name=name)


def _group_by_row(host: np.ndarray, V: int) -> tuple:
    """Positions sorted by row (stable) and each row's start in them: the embedding backward sums
    each row's gradients in that order, deterministic and without atomics."""
    order = np.argsort(host.reshape(-1), kind="stable").astype(np.int64)
    rowptr = np.zeros(V + 1, np.int32)
    np.cumsum(np.bincount(host.reshape(-1), minlength=V), out=rowptr[1:])
    return order, rowptr


def _regroup(idx: Tensor, V: int, pos: Tensor, rp: Tensor, tile: int = 1) -> None:
    """A graph replay's embedding backward: the new indices' grouping into the buffers it reads."""
    order, rowptr = _group_by_row(np.tile(_host_indices(idx).reshape(-1), tile), V)
    graph.upload(pos, order)  # without waiting for the previous replay, which reads them
    graph.upload(rp, rowptr)


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
    idx = F.contiguous(idx)
    _check_rows(idx, weight.shape[0])
    return _Embedding.apply(idx, F.contiguous(weight))


def embedding_add(idx: Tensor, weight: Tensor, pos: Tensor, pos_weight: Tensor) -> Tensor:
    """embedding(idx, weight) + embedding(pos, pos_weight): a GPT's token rows plus the rows of
    their positions, ``pos`` [T] giving the position of each index of idx's last dim.  One kernel
    each way where idx is [B, T] (int64) and the tables are floating-point ones of one dtype and
    width (helios.fused_kernels "embedding+add", the bits of the separate ops); else the separate ops."""
    if not isinstance(idx, Tensor):
        idx = K.from_numpy(np.asarray(idx, np.int64), dt.int64, weight._st.rt)
    fusible = (fused_kernels.ENABLED and isinstance(pos, Tensor) and idx.ndim == 2 and pos.shape == idx.shape[-1:]
               and idx.numel() > 0 and weight.ndim == pos_weight.ndim == 2 and weight.shape[1] == pos_weight.shape[1]
               and weight.dtype is pos_weight.dtype and weight.dtype.kind == "float"
               and idx.dtype is pos.dtype is dt.int64)
    if not fusible:
        return embedding(idx, weight) + embedding(pos, pos_weight)
    idx, pos = F.contiguous(idx), F.contiguous(pos)
    for i, table in ((idx, weight), (pos, pos_weight)):
        _check_rows(i, table.shape[0])
    return _EmbeddingAdd.apply(idx, F.contiguous(weight), pos, F.contiguous(pos_weight))


def _check_rows(idx: Tensor, V: int) -> None:
    """An IndexError for an index outside a table of V rows, where the upload's host copy tells."""
    if idx._host is not None and idx._host[0] == idx._st.version and idx._host[1].size:
        lo, hi = int(idx._host[1].min()), int(idx._host[1].max())
        if lo < 0 or hi >= V:
            raise IndexError(f"embedding: index {lo if lo < 0 else hi} is out of range for a table of {V} rows")


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
    host = F._host_ready(targets)
    host = (targets.numpy() if host is None else host).reshape(-1)
    _check_targets(host, C, ignore_index)
    now = _valid_targets(host, C, ignore_index)
    if now != captured:
        raise graph.GraphCaptureError(f"replay: cross_entropy counts {now[0]} valid targets (ignored ones remapped: "
                                      f"{now[1]}), the graph was captured with {captured[0]} ({captured[1]}); the "
                                      "mean's divisor is a constant of the graph: capture again for such batches")


class _CrossEntropy(Function):
    """The mean cross entropy over index targets, one kernel each way.  ``cast`` (autocast with
    16-bit logits): the loss is float32 and the 16-bit logits are read as the float32 values a
    cast would store (helios.fused_kernels "cast+cross_entropy")."""

    @staticmethod
    def forward(ctx, x, t, n_valid, cast=False):
        loss, lse = K.cross_entropy_fwd(x, t, cast)
        ctx.save_for_backward(x, t, lse)
        ctx.n, ctx.cast = n_valid, cast
        # the mean over no valid target is nan, as in PyTorch (its gradient stays 0)
        total, _ = K.reduce("sum", loss, (0,), 1.0 / n_valid if n_valid else math.nan)
        return total if x.dtype is dt.float32 or cast else K.copy(total, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, t, lse = ctx.saved_tensors
        gl = F.expand(F.reshape(F.to(g, dt.float32), (1,)), (x.shape[0],))
        # the kernel reads the expanded value once per row and multiplies it by the mean's 1/n
        # (no dispatch of its own for that one multiply)
        return K.cross_entropy_bwd(x, t, lse, gl, ctx.cast, 1.0 / builtins.max(ctx.n, 1)), None, None, None


def cross_entropy(logits: Tensor, targets, weight: Tensor | None = None, size_average=None, ignore_index: int = -100,
                  reduce=None, reduction: str = "mean") -> Tensor:
    """Cross entropy with PyTorch's layouts: ``logits`` (C), (N, C) or (N, C, d1, ...) with the
    classes on dim 1 (dim 0 of a 1-D input), ``targets`` either class indices of the logits'
    shape without the class dim, or class probabilities of the logits' shape.

    ``weight`` rescales each class; index targets equal to ``ignore_index`` (or negative)
    contribute nothing and are not counted.
    ``reduction``: "mean" (over the targets' total weight, or the number of rows for
    probabilities), "sum", or "none" (one loss per target)."""
    F._check_tensor(logits, "cross_entropy")
    if size_average is not None or reduce is not None:
        raise TypeError("cross_entropy: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(targets, Tensor):
        targets = K.from_numpy(np.asarray(targets, np.int64), dt.int64, logits._st.rt)
    cdim, index_shape, probs = _cross_entropy_layout(logits, targets, weight)
    C = logits.shape[cdim]
    # Autocast computes the loss in float32.  The mean over index targets without class weights
    # reads 16-bit logits in its kernel instead of a float32 copy of them (fused_kernels
    # "cast+cross_entropy"); everything else casts first.
    cast_in_kernel = (_amp.active_dtype() is not None and logits.dtype in (dt.bfloat16, dt.float16) and not probs
                      and weight is None and reduction == "mean" and fused_kernels.enabled())
    if not cast_in_kernel:
        logits, weight = _amp.fp32(logits, weight)
    rows = numel(index_shape)

    def classes_last(t: Tensor) -> Tensor:
        if t.ndim > 2:
            t = F.permute(t, 0, *range(2, t.ndim), 1)
        return F.reshape(F.contiguous(t), (rows, C))

    x = classes_last(logits)
    if x.dtype.kind != "float":
        x = F.to(x, dt.float32)
    if probs:
        per = _soft_target_losses(x, F.to(classes_last(targets), x.dtype), weight)
        if reduction == "none":
            return F.reshape(per, index_shape)
        total = F.sum(per)
        return total if reduction == "sum" else total / rows if rows else total * math.nan
    t = F.reshape(F.contiguous(F.to(targets, dt.int64)), (rows,))
    # The upload's host copy of the targets (a reshape of them has none): no read-back for the count.
    host = F._host_ready(targets) if targets.is_contiguous() and targets._off == 0 else None
    if host is not None:
        host = host.reshape(-1)
        _check_targets(host, C, ignore_index)
    if weight is None and reduction == "mean":
        return _fused_mean_loss(x, t, targets, host, ignore_index, cast_in_kernel)
    per, w = _index_target_losses(x, t, weight, ignore_index)
    if reduction == "none":
        return F.reshape(per, index_shape)
    total = F.sum(per)
    return total if reduction == "sum" else total / F.sum(w)


def _cross_entropy_layout(logits: Tensor, targets: Tensor, weight: Tensor | None) -> tuple[int, tuple, bool]:
    """The class dim, the shape of one loss per target, and whether the targets are class
    probabilities (else indices); a mismatch of the three arguments is one error naming it."""
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
    return cdim, index_shape, probs


def _soft_target_losses(x: Tensor, t: Tensor, weight: Tensor | None) -> Tensor:
    """One loss per row of [rows, C] logits against [rows, C] class probabilities."""
    if weight is not None:
        t = t * F.reshape(F.to(weight, x.dtype), (1, x.shape[1]))
    return F.neg(F.sum(log_softmax(x, -1) * t, dim=1))


def _fused_mean_loss(x: Tensor, t: Tensor, targets: Tensor, host, ignore_index: int, cast_in_kernel: bool) -> Tensor:
    """The mean over unweighted index targets ``t`` in one kernel pair: a negative target
    contributes nothing and is not counted.  The count comes from the targets' host copy where
    there is one (under capture a replay checks that it still holds), else from the device."""
    C = x.shape[1]
    if host is not None:
        n_valid, remap = _valid_targets(host, C, ignore_index)
        if remap:
            t = F.where(F.eq(t, ignore_index), -1, t)
        if graph.capturing() is not None:  # the count is a constant of the kernels: a replay checks it holds
            graph.before_replay(lambda: _same_targets(targets, C, ignore_index, (n_valid, remap)))
    else:
        if ignore_index >= 0:  # the kernel skips negative targets only: ignored ones become -1
            t = F.where(F.eq(t, ignore_index), -1, t)
        n_valid = int(K.reduce("sum", K.binary("ge", t, F.scalar_tensor(0, dt.int64, t._st.rt)), (0,))[0].item())
    return _CrossEntropy.apply(x, t, n_valid, cast_in_kernel)


def _index_target_losses(x: Tensor, t: Tensor, weight: Tensor | None, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(one weighted loss per row, each row's weight) of [rows, C] logits against index targets;
    an ignored or negative target weighs 0."""
    rows, C = x.shape
    valid = F.logical_and(F.ne(t, ignore_index), F.ge(t, 0))
    safe = F.where(valid, t, 0)
    logp = log_softmax(x, -1)
    onehot = F.to(F.eq(F.reshape(safe, (rows, 1)), F.reshape(K.arange(C, 0, 1, dt.int64, x._st.rt), (1, C))), logp.dtype)
    nll = F.neg(F.sum(logp * onehot, dim=1))
    w = F.to(valid, nll.dtype)
    if weight is not None:
        w = w * F._gather(F.to(weight, nll.dtype), 0, safe)
    return nll * w, w


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
    zero = F.scalar_tensor(0.0, x.dtype, x._st.rt)
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


_EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """x / sqrt(mean(x^2 over the last dims) + eps) * weight, computed in float32 and returned
    in x's dtype; ``eps=None`` is the machine epsilon of x's dtype (PyTorch's F.rms_norm)."""
    F._check_tensor(x, "rms_norm")
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
    if ns and (weight is None or weight.dtype is x.dtype):  # LayerNorm's kernels with RMS (layernorm.comp)
        return _normalize_rows(x, ns, weight, None, e, True)
    xf = F.to(x, dt.float32)  # a scalar normalized shape, or a weight of another dtype
    dims = list(range(x.ndim - len(ns), x.ndim))
    y = xf * F.rsqrt(F.mean(xf * xf, dim=dims, keepdim=True) + e) if dims else xf * F.rsqrt(xf * xf + e)
    if weight is not None:
        y = y * F.to(weight, dt.float32)
    return F.to(y, x.dtype)


class _Rotary(Function):
    """RoPE in one kernel each way (helios.fused_kernels "rotary"); the tables are constants.
    ``out_dtype``: the result stored in that dtype ("rotary+cast")."""

    @staticmethod
    def forward(ctx, x, cos, sin, out_dtype=None):
        ctx.save_for_backward(cos, sin)
        ctx.x_layout = (x.dtype, x.stride())
        return K.rotary_fwd(x, cos, sin, out_dtype)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return K.rotary_bwd(g, cos, sin, *ctx.x_layout), None, None, None


def rotary(x: Tensor, cos: Tensor, sin_signed: Tensor, *, feeds_products: bool = False) -> Tensor:
    """Rotary position embedding: ``x * cos + roll(x, D/2, -1) * sin_signed`` for x [..., T, D]
    and tables [T, D] (``sin_signed``: sin with its first half negated, so the roll is
    transformers' rotate_half).  The result has the promoted dtype of x and the tables.  A 4-D
    x with constant tables takes one kernel each way (helios.fused_kernels "rotary", the same
    bits); anything else, or fusion off, the separate ops.

    ``feeds_products``: the caller's promise that only autocast products read the result (an
    attention's q or k), which round it to the autocast dtype as they load it.  Under autocast
    a result in float32 from x in that dtype is then stored in it ("rotary+cast", as
    F.layer_norm's ``feeds_products``): the values the products read, in half the bytes."""
    F._check_tensor(x, "rotary")
    fused = fused_kernels.ENABLED and not (cos.requires_grad or sin_signed.requires_grad)
    low = _amp.active_dtype() if feeds_products and fused else None
    out_dtype = low if low is x.dtype and cos.dtype is dt.float32 and sin_signed.dtype is dt.float32 else None
    if fused and K.rotary_supported(x, cos, sin_signed, out_dtype):
        return _Rotary.apply(x, cos, sin_signed, out_dtype)
    return x * cos + F.roll(x, x.shape[-1] // 2, -1) * sin_signed


def _reduce_loss(op: str, per: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return per
    if reduction == "sum":
        return F.sum(per)
    if reduction == "mean":
        return F.mean(per)
    raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _loss_pair(op: str, x: Tensor, target):
    F._check_tensor(x, op)
    target = F._as_tensor_like(target, x)
    return F._promote_pair(x, target, op)


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
    return _reduce_loss("l1_loss", F.abs(a - b), reduction)


def nll_loss(input: Tensor, target, weight: Tensor | None = None, size_average=None, ignore_index: int = -100,
             reduce=None, reduction: str = "mean") -> Tensor:
    """Negative log likelihood of log-probabilities ``input`` ((C), (N, C) or (N, C, d1, ...),
    classes on dim 1) at the class indices ``target``: -weight[t] * input[n, t].  Targets
    equal to ``ignore_index`` count for nothing; "mean" divides by the kept targets' total weight."""
    F._check_tensor(input, "nll_loss")
    if size_average is not None or reduce is not None:
        raise TypeError("nll_loss: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"nll_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    target = F._index_tensor(target, input, "nll_loss")
    if input.ndim == 0:
        raise ShapeError("nll_loss: input needs at least 1 dim (the classes), got a 0-d tensor")
    cdim = 0 if input.ndim == 1 else 1
    C = input.shape[cdim]
    want = input.shape[:cdim] + input.shape[cdim + 1:]
    if target.shape != want:
        raise ShapeError(f"nll_loss: input {input.shape} needs a target of shape {want}, got {target.shape}")
    if weight is not None and weight.shape != (C,):
        raise ShapeError(f"nll_loss: weight must have shape ({C},) (one per class), got {weight.shape}")
    h = F._host_ready(target)
    if h is not None and h.size:
        bad = h[((h < 0) | (h >= C)) & (h != ignore_index)]
        if bad.size:
            raise IndexError(f"nll_loss: target {int(bad[0])} is out of range for {C} classes")
    valid = F.ne(target, ignore_index)
    safe = F.where(valid, target, 0)
    picked = F.squeeze(F.gather(input, cdim, F.unsqueeze(safe, cdim)), cdim) if input.ndim > 1 else \
        F.reshape(F.gather(input, 0, F.reshape(safe, (1,))), ())
    w = F.to(valid, input.dtype)
    if weight is not None:
        w = w * F.reshape(F.gather(F.to(weight, input.dtype), 0, F.reshape(safe, (-1,))), safe.shape)
    per = F.neg(picked) * w
    if reduction == "none":
        return per
    if reduction == "sum":
        return F.sum(per)
    return F.sum(per) / F.sum(w)


def one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
    """int64 one-hot vectors of the class indices ``x`` (a new last dim of ``num_classes``;
    -1: the largest index + 1, which reads the values on the host, as PyTorch does)."""
    F._check_tensor(x, "one_hot")
    if x.dtype is not dt.int64:
        raise DTypeError(f"one_hot: expects an int64 tensor of class indices, got {x.dtype.name}")
    if num_classes == -1:
        if x.numel() == 0:
            raise ShapeError("one_hot: cannot infer the number of classes from an empty tensor; give num_classes")
        num_classes = int(F.max(x).item()) + 1
    h = F._host_ready(x)
    if h is not None and h.size and (h.min() < 0 or h.max() >= num_classes):
        raise IndexError(f"one_hot: class values must be in [0, {num_classes}), got {int(h.min() if h.min() < 0 else h.max())}")
    classes = K.arange(num_classes, 0, 1, dt.int64, x._st.rt)
    return F.to(F.eq(F.unsqueeze(x, -1), classes), dt.int64)


def pad(x: Tensor, pad, mode: str = "constant", value: float | None = None) -> Tensor:
    """Pad (or, with negative amounts, crop) the last dims: ``pad`` is (left, right) for the
    last dim, then (top, bottom) for the one before, and so on.  ``mode`` "constant" fills
    with ``value`` (0); "reflect" mirrors without repeating the edge, "replicate" repeats
    the edge, "circular" wraps around."""
    F._check_tensor(x, "pad")
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
        out = F.index_select(out, d, K.from_numpy(j, dt.int64, x._st.rt))
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
            so, st, oo = F._basic_index(out, tuple(dst))
            si, sst, oi = F._basic_index(x, tuple(src))
            if numel(so):
                K.copy_into(Tensor(out._st, so, st, oo, x.dtype), Tensor(x._st, si, sst, oi, x.dtype))
        return out

    @staticmethod
    def backward(ctx, g):
        return _PadConstant.forward(NO_CONTEXT, g, [(-lo, -hi) for lo, hi in ctx.pairs], 0), None, None


def _pad_constant(x: Tensor, pairs, value) -> Tensor:
    return _PadConstant.apply(x, pairs, value)
