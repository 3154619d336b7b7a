"""Ring attention (context parallelism): the sequence split over the W ranks of a group.

    qs, ks, vs = (ring_shard(t, "zigzag", rank, W) for t in (q, k, v))   # [B, H, T/W, D] each
    o = ring_attention(qs, ks, vs, layout="zigzag", is_causal=True)      # this rank's output shard
    full = ring_unshard([o_0, ..., o_{W-1}], "zigzag")                   # [B, H, T, D] again

Each rank keeps its queries and passes its keys and values around the ring: at step t rank r
holds the K/V block of rank r - t, sends it on to rank r + 1 and receives the next one from
rank r - 1.  The exchange is posted (``isend``/``irecv`` on the communicator's thread) before
the block is computed, so the transfer overlaps the flash kernel.  Each block gives a partial
output and the log-sum-exp of its rows; they are merged on the device
(``l = logaddexp(l1, l2)``, ``o = o1 * exp(l1 - l) + o2 * exp(l2 - l)``), so after W steps the
rank holds exactly the softmax over the whole sequence.  Nothing of size T x T, or T x T/W,
exists: a rank's memory is that of its T/W tokens plus two K/V blocks in flight.

Backward (the standard ring backward): with the merged O and log-sum-exp saved, the flash
backward of each block gives that block's exact share of dQ and its exact dK, dV.  The K/V
blocks go around the ring again, and each block's dK/dV accumulator travels with it: every
rank adds its share and passes it on, and after W hops the accumulator is back on the rank
that owns the block, complete.

Layouts (which tokens rank r of W holds, in local order):

* ``contiguous``: chunk r of W equal chunks.  Causal work is unbalanced: rank r computes r
  full blocks and one diagonal block.
* ``zigzag``: chunks r and 2W - 1 - r of 2W, concatenated in that order.  Under a causal
  mask every rank computes one diagonal block and W - 1 half blocks (keys of an earlier
  rank: all queries against its first chunk; of a later rank: the second chunk's queries
  against all its keys), the same work on every rank.
* ``stripe``: token t lives on rank t mod W (tokens r, r + W, r + 2W, ...).  Under a causal
  mask a block from rank s <= r is "query i sees key j <= i" and one from s > r is
  "key j < i", the flash kernel's causal mask shifted by one row; the work differs between
  ranks by at most T/W - 1 pairs per block.

The sequence length must divide into the layout's chunks (W for contiguous and stripe, 2W
for zigzag): ``ring_shard`` refuses any other length by name (pad the sequence first; under a
causal mask padding at the end changes no real token's output).  Every rank's shard has the
same shape, which ``ring_attention`` checks against its peers' messages (a mismatch is a
size error from the comm layer naming the peer).
"""

from __future__ import annotations

import math

import numpy as np

import helios.comm as dist
from helios import dtypes as dt
from helios import flash, flat
from helios import functional as F
from helios.autograd.tape import Function, no_grad
from helios.tensor import Tensor

LAYOUTS = ("contiguous", "zigzag", "stripe")

# What the last ring_attention call on this rank computed (see ring_attention_stats).
_STATS: dict = {}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def ring_positions(T: int, layout: str, rank: int, world: int) -> np.ndarray:
    """The global token positions rank ``rank`` of ``world`` holds under ``layout``, in its
    local order (int64, length T / world): what the model needs for position embeddings and
    the loss's targets of a shard."""
    _check_layout(layout)
    T, rank, world = int(T), int(rank), int(world)
    if world < 1:
        raise ValueError(f"ring_shard: world must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"ring_shard: rank {rank} is not in 0..{world - 1}")
    chunks = 2 * world if layout == "zigzag" else world
    if T <= 0 or T % chunks:
        raise ValueError(f"ring_shard: T = {T} does not split into {chunks} equal chunks for layout {layout!r} with "
                         f"{world} ranks; pad the sequence to a multiple of {chunks}")
    if layout == "contiguous":
        n = T // world
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
    if layout == "stripe":
        return np.arange(rank, T, world, dtype=np.int64)
    c = T // chunks
    lo, hi = rank * c, (2 * world - 1 - rank) * c
    return np.concatenate([np.arange(lo, lo + c), np.arange(hi, hi + c)]).astype(np.int64)


def ring_shard(x, layout: str, rank: int, world: int, dim: int = -2):
    """Rank ``rank``'s shard of a whole-sequence tensor ``x`` (sequence along ``dim``; -2 fits
    [B, H, T, D], 1 fits token ids [B, T]).  ``x`` is a numpy array (a numpy array comes back)
    or a Helios tensor (a differentiable Helios tensor comes back)."""
    if isinstance(x, Tensor):
        d = dim % x.ndim
        pos = ring_positions(x.shape[d], layout, rank, world)
        if layout == "contiguous":
            return F.narrow(x, d, int(pos[0]), len(pos))
        return F.index_select(x, d, pos)
    x = np.asarray(x)
    d = dim % x.ndim
    return np.take(x, ring_positions(x.shape[d], layout, rank, world), axis=d)


def ring_unshard(shards, layout: str, dim: int = -2):
    """The whole-sequence tensor from every rank's shard (a list in rank order): the inverse
    of :func:`ring_shard`.  numpy arrays or Helios tensors (then differentiable)."""
    shards = list(shards)
    if not shards:
        raise ValueError("ring_unshard: shards is empty; give one shard per rank, in rank order")
    world = len(shards)
    ref = shards[0]
    d = dim % ref.ndim
    n = ref.shape[d]
    for i, s in enumerate(shards):
        if tuple(s.shape) != tuple(ref.shape):
            raise ValueError(f"ring_unshard: shard {i} has shape {tuple(s.shape)}, shard 0 has {tuple(ref.shape)}")
    T = n * world
    pos = np.concatenate([ring_positions(T, layout, r, world) for r in range(world)])
    inverse = np.empty(T, np.int64)
    inverse[pos] = np.arange(T, dtype=np.int64)
    if isinstance(ref, Tensor):
        whole = F.cat(shards, d)
        return whole if layout == "contiguous" else F.index_select(whole, d, inverse)
    return np.take(np.concatenate([np.asarray(s) for s in shards], axis=d), inverse, axis=d)


# -- the ring -------------------------------------------------------------------------------------
def _plan(layout: str, causal: bool, r: int, s: int, n: int):
    """The flash call for rank r's queries against rank s's keys, each n local tokens:
    (query start, query rows, key start, key rows, causal), or None when no query of r sees
    any key of s.  The kernel's causal mask is "local key j <= local query i"."""
    if not causal:
        return 0, n, 0, n, False
    if layout == "contiguous":
        return None if s > r else (0, n, 0, n, s == r)
    if layout == "zigzag":
        c = n // 2
        if s == r:
            return 0, n, 0, n, True  # chunks r < 2W-1-r in order: the local mask is the global one
        if s < r:
            return 0, n, 0, c, False  # every query sees s's first chunk, none its last
        return c, c, 0, n, False  # only the last chunk's queries, and they see all of s
    # stripe: query i of r is token r + iW, key j of s is token s + jW.
    if s <= r:
        return 0, n, 0, n, True  # j <= i
    # j <= i - 1: queries 1.. against keys ..n-2 under the plain mask; query 0 sees nothing.
    return (1, n - 1, 0, n - 1, True) if n > 1 else None


def _rows(x: Tensor, start: int, length: int, full: int) -> Tensor:
    """Rows [start, start + length) of dim 2, contiguous (the flash backward reads its O,
    log-sum-exp and gradient operands as dense arrays)."""
    if start == 0 and length == full:
        return x
    return flat.copy(F.narrow(x, 2, start, length))


def _place(part: Tensor, start: int, full: int) -> Tensor:
    """``part`` (rows along dim 2) inside zeros of ``full`` rows, starting at ``start``."""
    m = part.shape[2]
    if start == 0 and m == full:
        return part
    pieces = []
    if start:
        pieces.append(flat.zeros(part.shape[:2] + (start,) + part.shape[3:], part.dtype, part.device))
    pieces.append(part)
    if full - start - m:
        pieces.append(flat.zeros(part.shape[:2] + (full - start - m,) + part.shape[3:], part.dtype, part.device))
    return F.cat(pieces, 2)


def _peers(group):
    """(this rank in the group, group size, global rank of the next, of the previous)."""
    W = dist.get_world_size(group)
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError("ring_attention: group does not contain this rank; call it on the group's members only")
    ranks = list(range(W)) if group is None else list(group.ranks)
    return me, W, ranks[(me + 1) % W], ranks[(me - 1) % W]


def _exchange(sends: list, recvs: list, me: int, nxt: int, prv: int, group) -> list:
    """Post each of ``sends`` -> next and ``recvs`` <- previous.  The communicator runs a rank's
    operations one after another: even ranks send first and odd ranks receive first, so
    every send meets a posted receive instead of all ranks sending at once around the ring
    (which the engine only resolves by parking messages after a stall)."""
    if me % 2 == 0:
        return [dist.isend(t, nxt, group) for t in sends] + [dist.irecv(t, prv, group) for t in recvs]
    return [dist.irecv(t, prv, group) for t in recvs] + [dist.isend(t, nxt, group) for t in sends]


def _empty_like(t: Tensor) -> Tensor:
    return flat.empty(t.shape, t.dtype, t.device)


def _add_rows(acc: Tensor | None, part: Tensor, start: int, full: int) -> Tensor:
    """``acc`` + ``part`` at rows [start, ...) of dim 2, in place when ``acc`` exists (it is a
    buffer of this rank's own: a received accumulator or an earlier sum).  A part of the
    rows is added through a temporary of its own size, not a zero-padded whole."""
    if acc is None:
        return _place(part, start, full)
    m = part.shape[2]
    if m == full:
        return flat.add_(acc, part)
    rows = F.narrow(acc, 2, start, m)
    flat.copy_into(rows, rows + part)
    return acc


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _merge(o: Tensor, lse: Tensor, ob: Tensor, lb: Tensor, start: int, n: int):
    """(o, lse) with the block result (ob, lb) of rows [start, start + rows) merged in,
    through the log-sum-exp (o in float32)."""
    m = lb.shape[2]
    o_old, l_old = (o, lse) if m == n else (F.narrow(o, 2, start, m), F.narrow(lse, 2, start, m))
    top = F.maximum(l_old, lb)
    l_new = top + F.log(F.exp(l_old - top) + F.exp(lb - top))
    o_new = o_old * F.unsqueeze(F.exp(l_old - l_new), -1) + ob * F.unsqueeze(F.exp(lb - l_new), -1)
    if m == n:
        return o_new, l_new
    o_parts, l_parts = [], []
    if start:
        o_parts.append(F.narrow(o, 2, 0, start))
        l_parts.append(F.narrow(lse, 2, 0, start))
    o_parts.append(o_new)
    l_parts.append(l_new)
    if n - start - m:
        o_parts.append(F.narrow(o, 2, start + m, n - start - m))
        l_parts.append(F.narrow(lse, 2, start + m, n - start - m))
    return F.cat(o_parts, 2), F.cat(l_parts, 2)


class _RingAttention(Function):
    """The ring forward and backward on this rank's shards (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale, box):
        with no_grad():
            me, W, nxt, prv = _peers(group)
            n = q.shape[2]
            # k and v are the caller's tensors: contiguous ones travel as they are.
            kv = [t if t.is_contiguous() else flat.copy(t) for t in (k, v)]
            o = lse = None
            pairs, blocks = 0, 0
            for step in range(W):
                s = (me - step) % W
                works, nkv = [], None
                if step < W - 1:
                    nkv = [_empty_like(t) for t in kv]
                    works = _exchange(kv, nkv, me, nxt, prv, group)  # the next block travels while this one computes
                plan = _plan(layout, causal, me, s, n)
                if plan is not None:
                    qa, qm, ka, km, c = plan
                    qs = q if qm == n else F.narrow(q, 2, qa, qm)
                    ks, vs = (t if km == n else F.narrow(t, 2, ka, km) for t in kv)
                    ob, lb = flash.forward(qs, ks, vs, scale, c)
                    ob = ob if ob.dtype is dt.float32 else F.to(ob, dt.float32)
                    pairs += flash.pairs(qm, km, c)
                    blocks += 1
                    if o is None:  # step 0 is the diagonal block: every row sees at least its own key
                        o, lse = ob, lb
                    else:
                        o, lse = _merge(o, lse, ob, lb, qa, n)
                    # Drop this step's views and partial results now: they would keep the old
                    # block alive while the next one is allocated.
                    qs = ks = vs = ob = lb = None
                _wait(works)
                if nkv is not None:
                    kv = nkv
            out = o if o.dtype is q.dtype else F.to(o, q.dtype)
            out = flat.copy(out) if not out.is_contiguous() else out
            lse = flat.copy(lse) if not lse.is_contiguous() else lse
        _STATS.clear()
        _STATS.update(layout=layout, world=W, rank=me, causal=causal, tokens=n, blocks=blocks,
                      pairs=pairs * q.shape[0] * q.shape[1])
        box["lse"] = lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        group, layout, causal, scale = ctx.group, ctx.layout, ctx.causal, ctx.scale
        with no_grad():
            me, W, nxt, prv = _peers(group)
            n = q.shape[2]
            g = g if g.is_contiguous() and g.dtype is q.dtype else flat.copy(g, q.dtype)
            kv = [t if t.is_contiguous() else flat.copy(t) for t in (k, v)]
            dq = None
            cache: dict = {}  # the row slices of q, O, L and dO a layout reuses at every step

            def rows(start: int, m: int):
                if (start, m) not in cache:
                    # q as a view (the kernel reads strided queries); O, L and dO as dense rows.
                    cache[start, m] = (F.narrow(q, 2, start, m),) + tuple(_rows(t, start, m, n) for t in (o, lse, g))
                return cache[start, m]

            acc_works, acc_in = [], [None, None]
            for step in range(W):
                s = (me - step) % W
                works, nkv = [], None
                if step < W - 1:
                    nkv = [_empty_like(t) for t in kv]
                    works = _exchange(kv, nkv, me, nxt, prv, group)
                plan = _plan(layout, causal, me, s, n)
                part = None
                if plan is not None:
                    qa, qm, ka, km, c = plan
                    qs, os_, ls, gs = rows(qa, qm)
                    ks, vs = (t if km == n else F.narrow(t, 2, ka, km) for t in kv)
                    dqb, dkb, dvb = flash.backward(qs, ks, vs, os_, ls, gs, scale, c)
                    dq = _add_rows(dq, dqb, qa, n)
                    part = (dkb, dvb, ka)
                # Block s's dK/dV accumulators arrive (while the kernel ran) from the rank that
                # had the block last step.
                _wait(acc_works)
                acc = acc_in
                if part is not None:
                    acc = [_add_rows(acc[0], part[0], part[2], n), _add_rows(acc[1], part[1], part[2], n)]
                acc = [a if a is not None else flat.fill_(_empty_like(k), 0) for a in acc]
                if W > 1:  # pass them on with the block; after the last step they go home to their owner
                    acc_in = [_empty_like(a) for a in acc]
                    acc_works = _exchange(acc, acc_in, me, nxt, prv, group)
                else:
                    acc_in = acc
                # The sends hold what they send; nothing of this step is needed past here.
                acc = part = qs = ks = vs = os_ = ls = gs = dqb = dkb = dvb = None
                _wait(works)
                if nkv is not None:
                    kv = nkv
            _wait(acc_works)
            if dq is None:
                dq = flat.fill_(_empty_like(q), 0)
        return dq, acc_in[0], acc_in[1], None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, layout: str = "contiguous", is_causal: bool = False,
                   scale: float | None = None, return_lse: bool = False):
    """softmax(q k^T * scale) v over the whole sequence, from this rank's shards.

    ``q``, ``k``, ``v``: this rank's [B, H, T/W, D] shards (``ring_shard`` of the whole
    tensors), the same shape on every rank of ``group`` (None: the world).  ``layout``:
    ``"contiguous"``, ``"zigzag"`` or ``"stripe"`` (the module docstring says which tokens a
    rank holds).  ``is_causal``: token i sees tokens j <= i in global positions.  ``scale``
    defaults to 1/sqrt(D).  Returns this rank's output shard (differentiable in q, k and v),
    or ``(output, lse)`` with ``return_lse``: the float32 [B, H, T/W] log-sum-exp of each
    query row over the whole sequence (not differentiable).

    Every rank of the group must call it with the same arguments (it is a collective).
    The operands run through the flash kernel: one float dtype, head dim 32, 64 or 128."""
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"ring_attention: {name} must be a Helios tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"ring_attention: {name} must be [batch, heads, T/W, head_dim], got shape {t.shape}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring_attention: q, k and v shards must have one shape, got {q.shape}, {k.shape}, {v.shape}")
    if not flash.supported(q, k, v):
        raise ValueError(f"ring_attention: q (shape {q.shape}, {q.dtype.name}) is not something the flash kernel takes: "
                         f"a device tensor, one float dtype for q, k and v, head dim in {flash.HEAD_DIMS}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"ring_attention: a zigzag shard holds two equal chunks, but q has an odd {q.shape[2]} tokens")
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    box: dict = {}
    out = _RingAttention.apply(q, k, v, group, layout, bool(is_causal), s, box)
    return (out, box["lse"]) if return_lse else out


def ring_attention_stats() -> dict:
    """What the last ``ring_attention`` forward on this rank computed: layout, world, rank,
    causal, tokens (local), blocks (flash calls) and pairs (query-key pairs, B * H included),
    counted from the shapes handed to the kernel.  Empty before the first call."""
    return dict(_STATS)
