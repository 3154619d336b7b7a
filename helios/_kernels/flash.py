"""The flash-attention kernels (forward and backward; the subgroup kernel lavapipe runs and the
shared-memory GPU kernel), their block masks and launch plans."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios.backend import attention_pairs
from helios.errors import ShapeError
from helios.runtime import get_runtime
from helios.tensor import Tensor
from helios._kernels import coopmat
from helios._kernels.core import bind, empty, empty_in_layout, groups_for
import helios._kernels as kern  # the other kernel families (bound once the package has loaded)


# -- flash attention -------------------------------------------------------------------------
# flash_attn kernel (see kernels_spirv/glsl/flash_attn.comp).  Its passes (the MODE
# specialization constant): forward, backward preprocess D = rowsum(dO * O), dQ, dK and dV.
_P_FLASH = struct.Struct("<4If26I")
FLASH_HEAD_DIMS = (32, 64, 128)  # the variants compiled (flash_attn.variants)
_FA_FWD, _FA_PRE, _FA_DQ, _FA_DKV = 0, 1, 2, 3
_FA_SG_ROWS = 8   # rows a subgroup owns in the CPU kernel (NR in the GLSL)
_FA_GPU_WG = 64   # rows a workgroup owns in the GPU kernel
# Which kernel runs: None = the CPU kernel on CPU drivers with 8-lane subgroups (as matmul
# picks its kernel), else the shared-memory one; "gpu" / "cpu" force one (tests run the GPU
# kernel on lavapipe this way).
_FA_KERNEL: str | None = None
_FA_CPU_WY: int | None = None  # subgroups per workgroup of the CPU kernel; None = automatic
# lavapipe (llvmpipe) stops all the loops of an invocation once they have run 65,535 iterations
# together, with no error: a pass's sums then silently stop short.  _fa_cpu_loops bounds an
# invocation's count; passes that could come near the cap are refused.
_FA_CPU_LOOP_CAP = 60_000


def _fa_cpu_loops(mode: int, D: int, G: int, Tq: int, Tk: int) -> int:
    """An upper bound on the loop iterations one invocation of the subgroup kernel's pass ``mode``
    runs (tiles of 64 streamed rows; per tile the head-dim loops of its products, the lanes' loop
    of its sums and a margin).  Measured on lavapipe at head dim 128: the dK / dV pass right at
    72,000 query rows and wrong from 78,000 (54 to 58 iterations a tile, where this bound counts
    64), the dQ pass right at 90,000 keys and wrong from 120,000, the forward right at 140,000; at
    head dim 32 the dK / dV pass right at 130,000."""
    if mode == _FA_DKV:  # every query tile of the G query heads that share a K/V head
        return G * -(-Tq // 64) * (D // 4 + 32)
    if mode == _FA_DQ:   # two products a key tile, and D's sum over the head dim
        return -(-Tk // 64) * (D // 4 + 32) + D
    if mode == _FA_FWD:
        return -(-Tk // 64) * (D // 8 + 32)
    return D


def fa_subgroup_kernel_runs_on(rt) -> bool:
    """Whether ``rt`` can run flash attention's subgroup kernel: it is written for subgroups of
    exactly _FA_SG_ROWS lanes (one row per lane) and loads 8 values as 64-bit words."""
    return int(rt.info["limits"].get("subgroup_size", 0)) == _FA_SG_ROWS and bool(rt.features.get("int64"))


def _fa_cpu(rt) -> bool:
    """Whether flash attention on ``rt`` runs the subgroup kernel (CPU drivers)."""
    if _FA_KERNEL == "cpu" and not fa_subgroup_kernel_runs_on(rt):
        # on 32-lane subgroups it would compute garbage, not fail: refuse instead
        raise RuntimeError(f"flash attention: the subgroup kernel needs {_FA_SG_ROWS}-lane subgroups and 64-bit "
                           f"integers; {rt.info.get('name', 'this device')} has "
                           f"{rt.info['limits'].get('subgroup_size')}-lane subgroups")
    if _FA_KERNEL is not None:
        return _FA_KERNEL == "cpu"
    return kern._cpu_mm_kernel(rt) and fa_subgroup_kernel_runs_on(rt)


def flash_attn_supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the flash kernels take these [B, H, T, D] operands: one float dtype, a compiled
    head dim shared by q, k and v, the same B, non-empty, and B * H within one dispatch.  k and v
    may have fewer heads Hk than q where Hk divides H (grouped-query attention: query head h
    reads K/V head h // (H / Hk), in place, and the backward sums each group's dK, dV in the
    kernel)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q._st.rt.is_host:
        return False
    B, H, Tq, D = q.shape
    Hk = k.shape[1]
    return (q.dtype is k.dtype is v.dtype and q.dtype.kind == "float" and D in FLASH_HEAD_DIMS
            and k.shape[0] == v.shape[0] == B and v.shape[1] == Hk and 0 < Hk and H % Hk == 0
            and k.shape[3] == v.shape[3] == D and k.shape[2] == v.shape[2]
            and Tq > 0 and k.shape[2] > 0 and 0 < B * H <= 65535)


# -- the device's own flash kernels (tensor cores: cuda:N on Hopper) ---------------------------


def _engine_operand(t: Tensor) -> tuple:
    """(handle, byte offset, element strides of B, H, T) of a [B, H, T, D] operand or output (O, dQ,
    dK, dV; D's stride 1)."""
    return (t._st.handle, t._off * t.dtype.itemsize, tuple(t._strides[:3]))


def _engine_out(t: Tensor) -> tuple:
    """(handle, byte offset) of a contiguous output (L, D, a block mask)."""
    return (t._st.handle, t._off * t.dtype.itemsize)


def _engine_reads(t: Tensor) -> bool:
    """Whether the engine's tensor maps can read [B, H, T, D] ``t`` where it is: unit stride along
    the head dim, the offset and the other strides multiples of 16 bytes."""
    isz = t.dtype.itemsize
    return t._strides[-1] == 1 and (t._off * isz) % 16 == 0 and all((s * isz) % 16 == 0 for s in t._strides[:3])


def _engine_takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the runtime's flash engine may take these operands at all (its dtype and head dim,
    unit head-dim strides); the engine checks addresses and strides itself."""
    rt = q._st.rt
    if not rt.has_flash(q.dtype.name, q.shape[-1]):
        return False
    return all(t._strides[-1] == 1 or t.shape[-1] == 1 for t in (q, k, v))


def _problem(q: Tensor, k: Tensor) -> tuple:
    """(B, H, Hk, Tq, Tk, D) of an attention."""
    B, H, Tq, D = q.shape
    return (B, H, k.shape[1], Tq, k.shape[2], D)


def _engine_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, block_mask, token_major: bool):
    """(O, L) from the device's flash engine, or None where it declines (the caller runs flash_attn);
    O as flash_attn_fwd's ``token_major`` asks."""
    if not _engine_takes(q, k, v):
        return None
    rt = q._st.rt
    o = _new_o(q, token_major)
    lse = empty(q.shape[:3], dt.float32, rt)
    if _run_engine("fwd", (q, k, v), (), (o, lse), scale, causal, block_mask):
        return o, lse
    return None


def _run_engine(pass_: str, qkvg: tuple, stats: tuple, outs: tuple, scale: float, causal: bool,
                block_mask: FlashBlockMask | None, after: tuple = ()) -> bool:
    """Hand one pass to the runtime's flash engine: ``qkvg`` the [B, H, T, D] operands (q, k, v
    and, backward, dO), ``stats`` contiguous L and D, ``after`` [B, H, T, D] inputs after them (the
    backward's O), ``outs`` the outputs (None: not wanted), ``block_mask`` the blocks computed (None: all).
    Where it declines grouped-query operands (bases or strides TMA cannot read), it runs on
    contiguous copies, keeping them on tensor cores (the SIMT kernel could read them in place;
    which is faster for such operands is not measured)."""
    q, k = qkvg[0], qkvg[1]
    rt = q._st.rt
    outs = tuple(None if t is None else _engine_operand(t) if t.ndim == 4 else _engine_out(t) for t in outs)
    args = (pass_, q.dtype.name, _problem(q, k),
            tuple(_engine_operand(t) for t in qkvg) + tuple(_engine_out(t) for t in stats) + tuple(_engine_operand(t) for t in after),
            outs, float(scale), bool(causal),
            None if block_mask is None else (*_engine_out(block_mask.dev), block_mask.block_size, block_mask.pairs))
    if rt.flash(*args):
        return True
    if k.shape[1] == q.shape[1]:
        return False
    copies = tuple(kern.copy(t) for t in qkvg)
    if not rt.flash(*args[:3], tuple(_engine_operand(t) for t in copies) + args[3][len(qkvg):], *args[4:]):
        raise RuntimeError(f"flash attention: the tensor-core kernel declined grouped-query operands {args[2]} "
                           "even as contiguous copies")
    return True


def _fa_addressable(t: Tensor) -> bool:
    """Whether the kernels can read or write [B, H, T, D] ``t`` where it is: unit stride along
    the head dim, the other strides and the offset multiples of 4 (4-value loads and stores)."""
    return t._strides[-1] == 1 and t._off % 4 == 0 and all(s % 4 == 0 for s in t._strides[:3])


def _fa_operand(t: Tensor) -> Tensor:
    """``t`` itself when the kernel can read it in place (see _fa_addressable), else a contiguous copy."""
    return t if _fa_addressable(t) else kern.copy(t)


def _rows_at(t: Tensor, off: int) -> tuple:
    """(offset in its binding, strides of B, H and T) of a [B, H, T, D] tensor: how the kernels
    address its rows."""
    return (off, *t._strides[:3])


_NO_ROWS = (0, 0, 0, 0)  # an operand a pass does not touch


def _aligned8(at: tuple) -> bool:
    """Whether every row of an operand addressed by ``at`` (see _rows_at) starts 8-aligned."""
    return all(x % 8 == 0 for x in at)


def flash_attn_pairs(Tq: int, Tk: int, causal: bool) -> int:
    """(query, key) pairs one head of flash_attn_fwd computes: causal rows i see min(i + 1, Tk)
    keys (the device contract's ``attention_pairs``, which the CUDA backend counts too)."""
    return attention_pairs(Tq, Tk, causal)


FLASH_BLOCK = 64  # block sizes of a block mask are multiples of this: every tile and row group of both kernels


class FlashBlockMask:
    """A block mask ready for flash_attn_fwd / flash_attn_bwd: ``mask`` boolean
    [ceil(Tq / block_size), ceil(Tk / block_size)] (True = computed; the last block row and
    column may be ragged), uploaded once as one int32 per block pair, with the (query, key)
    pairs it computes counted on the host for the profiler's FLOPs.  Refuses a block size
    the kernels cannot tile and a query row left without any key (its softmax would be 0/0)."""

    def __init__(self, mask, block_size: int, Tq: int, Tk: int, causal: bool, rt=None):
        import numpy as np

        bs = int(block_size)
        if bs <= 0 or bs % FLASH_BLOCK:
            raise ValueError(f"block_size: must be a positive multiple of {FLASH_BLOCK} (the flash kernels' tile), "
                             f"got {block_size}")
        m = np.asarray(mask)
        nq, nk = -(-Tq // bs), -(-Tk // bs)
        if m.dtype != np.bool_ or m.shape != (nq, nk):
            raise ShapeError(f"block_mask: expected a boolean [{nq}, {nk}] mask for Tq = {Tq}, Tk = {Tk} and "
                             f"block_size {bs}, got {m.dtype} {m.shape}")
        # rows of block i span [i * bs, min((i + 1) * bs, Tq)); causal row t sees keys <= t, so
        # the block's first row, which sees the fewest, needs an allowed key block at or before it
        seen = m if not causal else m & (np.arange(nk)[None, :] <= np.arange(nq)[:, None])
        empty_rows = np.flatnonzero(~seen.any(axis=1))
        if empty_rows.size:
            i = int(empty_rows[0])
            raise ValueError(f"block_mask: query block {i} (rows {i * bs}..{min((i + 1) * bs, Tq) - 1}) allows no key"
                             + (" at or before its first row (is_causal)" if causal else "")
                             + f"; {empty_rows.size} such block row(s)")
        self.mask, self.block_size, self.Tq, self.Tk, self.causal = m, bs, Tq, Tk, bool(causal)
        # computed pairs: rows per block times keys per block, causal pairs counted exactly
        qlen = np.minimum(bs, Tq - np.arange(nq) * bs)
        klen = np.minimum(bs, Tk - np.arange(nk) * bs)
        if causal:
            qi = np.arange(nq)[:, None] * bs
            kj = np.arange(nk)[None, :] * bs
            # pairs (t, u) of block (i, j) with u <= t: per row t the keys of block j up to t
            pairs = np.zeros((nq, nk), dtype=np.int64)
            for r in range(bs):  # row offset in the block: vectorised over every block pair
                t = qi + r
                live = r < qlen[:, None]
                pairs += np.where(live, np.clip(t - kj + 1, 0, klen[None, :]), 0)
            self.pairs = int(pairs[m].sum())
        else:
            self.pairs = int((qlen[:, None] * klen[None, :])[m].sum())
        self.key_rows = int(klen[m.any(axis=0)].sum())  # keys some query block reads
        self.dev = kern.from_numpy(m.astype(np.int32), dt.int32, rt or get_runtime())


class _FlashLaunch:
    """The bindings, push constants and grid of one flash_attn call's passes."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                 block_mask: FlashBlockMask | None = None):
        self.rt = rt = q._st.rt
        self.q, self.k, self.v = _fa_operand(q), _fa_operand(k), _fa_operand(v)
        self.B, self.H, self.Tq, self.D = q.shape
        self.Tk, self.Hk = k.shape[2], k.shape[1]  # Hk divides H (flash_attn_supported)
        self.scale, self.causal = float(scale), bool(causal)
        (self.bq, oq), (self.bk, ok), (self.bv, ov) = bind(self.q), bind(self.k), bind(self.v)
        self.offs = [oq, ok, ov]
        self.cpu = _fa_cpu(rt)
        self.variant = f"{q.dtype.tag}_{'sg_' if self.cpu else ''}d{self.D}"
        # passes 0, 2 and 3 on cooperative matrices where the device lists them (float16, bfloat16 on GPUs)
        choice = None if self.cpu else coopmat.flash_choice_for(rt, q.dtype.name, self.D)
        self.coop = choice if choice is not None and choice.coopmat else None
        strides = [s for t in (self.q, self.k, self.v) for s in t._strides[:3]]
        self.strides = strides
        # 8-wide loads need every row start 8-aligned (see WIDE in the GLSL); the backward
        # passes also read dO (dispatch decides per pass)
        self.aligned8 = all(x % 8 == 0 for x in strides + self.offs)
        self.bm = block_mask
        if block_mask is not None:
            if (block_mask.Tq, block_mask.Tk, block_mask.causal) != (self.Tq, self.Tk, self.causal):
                raise ShapeError(f"block_mask: built for Tq = {block_mask.Tq}, Tk = {block_mask.Tk}, causal = "
                                 f"{block_mask.causal}; the call has {self.Tq}, {self.Tk}, {self.causal}")
            self.bmb = bind(block_mask.dev)[0]  # a fresh upload: the kernel indexes it from 0

    def pairs(self) -> int:
        """(query, key) pairs one head computes: the mask's blocks only."""
        return self.bm.pairs if self.bm is not None else attention_pairs(self.Tq, self.Tk, self.causal)

    def key_rows(self) -> int:
        return self.bm.key_rows if self.bm is not None else self.Tk

    def _wy(self, rows: int) -> int:
        if _FA_CPU_WY is not None:
            return _FA_CPU_WY
        # 4 subgroups a workgroup, fewer when a head has fewer row blocks (short sequences)
        return max(1, min(4, -(-rows // _FA_SG_ROWS)))

    def dispatch(self, mode: int, rows: int, bufs: dict, name: str, flops: int, nbytes: int, per_head: bool = True,
                 dlse: bool = False, o: tuple = _NO_ROWS, do: tuple = _NO_ROWS, grads: tuple = (0,) * 5,
                 d_here: bool = False) -> None:
        """Record one pass over ``rows`` rows (per head, or in all with ``per_head=False``).  ``o``
        and ``do``: how O and dO are addressed (_rows_at); ``grads``: the strides of B, H and T of
        the pass's gradient outputs and their offsets (dQ | dK, dV); ``d_here``: the dQ pass
        computes D = rowsum(dO * O) and stores it (flags bit 2, see flash_attn.comp)."""
        rt = self.rt
        BH = self.B * (self.Hk if mode == _FA_DKV else self.H)  # the dK / dV pass: a workgroup column a K/V head
        kernel, variant, subgroup = "flash_attn", self.variant, 0
        # 8-wide loads of Q, K, V (and of dO where the pass reads it)
        wide = self.aligned8 and (mode == _FA_FWD or _aligned8(do))
        if self.cpu:
            G = self.H // self.Hk
            loops = _fa_cpu_loops(mode, self.D, G, self.Tq, self.Tk)
            if loops > _FA_CPU_LOOP_CAP:
                what = f"{self.Tq} query rows x {G} query heads a K/V head" if mode == _FA_DKV else f"{self.Tk} keys"
                raise RuntimeError(f"flash attention: {what} (head dim {self.D}) need about {loops:,} loop iterations "
                                   "in one invocation of the CPU kernel, which the CPU driver stops at 65,535 without an "
                                   "error; use shorter sequences")
            wy = self._wy(rows) if per_head else 4
            # (the CPU kernel reads fp32 two texels per 8 values either way: one pipeline, not two)
            spec = (wy, mode, int(wide and self.q.dtype is not dt.float32))
            per_group = _FA_SG_ROWS * wy
        elif self.coop is not None and mode != _FA_PRE:
            plan = self.coop.plan(mode)
            spec = plan.spec(wide)
            per_group = plan.rows
            kernel, variant = coopmat.FLASH_KERNEL, f"{self.q.dtype.tag}_d{self.D}"
            subgroup = coopmat.required_subgroup(rt, plan.subgroup)
            name = kernel + name[len("flash_attn"):]  # flash_coop, flash_coop_bwd_dq, flash_coop_bwd_dkv
        else:  # WIDE: the preprocess pass's 16-byte loads, where O's and dO's rows start 8-aligned
            spec = (_FA_GPU_WG, mode, int(mode == _FA_PRE and _aligned8(o) and _aligned8(do)))
            per_group = _FA_GPU_WG
        groups = (1, -(-rows // per_group), BH) if per_head else groups_for(-(-rows // per_group))
        pid = rt.pipeline(kernel, variant, spec, subgroup)
        flags = int(self.causal) | (2 if dlse else 0) | (4 if d_here else 0)
        if self.bm is not None and mode != _FA_PRE:
            # the mask goes through a binding this pass leaves unused (see flash_attn.comp)
            bufs = {**bufs, {_FA_FWD: 6, _FA_DQ: 8, _FA_DKV: 7}[mode]: self.bmb}
            flags |= self.bm.block_size << 8
        # unused bindings repeat Q (read-only, never touched by that pass)
        slots = [self.bq, self.bk, self.bv] + [bufs.get(i, self.bq) for i in range(3, 10)]
        # the preprocess pass runs over all rows as one range: its Tk is the rows of a head
        tq, tk = (self.Tq, self.Tk) if per_head else (rows, self.Tq)
        push = _P_FLASH.pack(tq, tk, self.H, flags, self.scale, *self.offs, o[0], do[0], *self.strides,
                             *o[1:], *do[1:], *grads, self.H // self.Hk)
        rt.dispatch(pid, slots, push, groups, name, flops, nbytes)


def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, *,
                   block_mask: FlashBlockMask | None = None, token_major: bool = False):
    """(O, L) of softmax(q k^T * scale) v for [B, H, T, D] operands (see flash_attn_supported):
    O in q's dtype, L the float32 log-sum-exp of each query row's scaled scores.
    ``causal``: query i sees keys j <= i.  Nothing of size T x T is allocated.
    ``block_mask`` (a FlashBlockMask built for these Tq, Tk and ``causal``, shared by every
    batch and head): only its blocks are computed, the others skipped whole.
    O is contiguous, or with ``token_major`` the [B, H, Tq, D] view of a contiguous [B, Tq, H, D]
    tensor, so that ``O.transpose(1, 2).reshape(B, Tq, H * D)`` (the heads as one projection
    reads them) is a view, not a copy (on the device's own flash engine, cuda:N's, too)."""
    took = _engine_fwd(q, k, v, scale, causal, block_mask, token_major)
    if took is not None:
        return took
    fl = _FlashLaunch(q, k, v, scale, causal, block_mask)
    rt, B, H, Tq, D = fl.rt, fl.B, fl.H, fl.Tq, fl.D
    o = _new_o(q, token_major)
    lse = empty((B, H, Tq), dt.float32, rt)
    pairs = B * H * fl.pairs()
    isz = q.dtype.itemsize
    bo, oo = bind(o, True)
    fl.dispatch(_FA_FWD, Tq, {3: bo, 5: bind(lse, True)[0]}, "flash_attn",
                4 * pairs * D, B * H * (2 * Tq + 2 * fl.key_rows()) * D * isz + lse.numel() * 4, o=_rows_at(o, oo))
    return o, lse


def _new_o(q: Tensor, token_major: bool) -> Tensor:
    """A new O for queries ``q`` ([B, H, Tq, D]): contiguous, or the [B, H, Tq, D] view of a
    contiguous [B, Tq, H, D] tensor (``token_major``: see flash_attn_fwd)."""
    B, H, Tq, D = q.shape
    if not token_major:
        return empty((B, H, Tq, D), q.dtype, q._st.rt)
    o = empty((B, Tq, H, D), q.dtype, q._st.rt)
    return Tensor(o._st, (B, H, Tq, D), (Tq * H * D, D, H * D, 1), o._off, o.dtype)


def flash_attn_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, g: Tensor, scale: float, causal: bool,
                   need_q: bool = True, need_kv: bool = True, *, block_mask: FlashBlockMask | None = None,
                   dlse: Tensor | None = None, dest: tuple | None = None):
    """(dQ, dK, dV) of flash attention given its forward's O and L and the upstream gradient
    ``g`` ([B, H, Tq, D], any strides: read in place where the kernels can address it);
    FlashAttention-2's backward: P is recomputed from the
    saved L, dQ is one pass over key tiles and dK, dV one pass over query tiles, each output
    row written by one subgroup (no atomics, deterministic).  Passes not needed are skipped
    (their results are None).  ``block_mask``: the forward's.  ``dlse`` (float32 [B, H, Tq]):
    the gradient reaching L itself, for callers that use L (dL/ds_ij = P_ij adds dlse * P to
    dS: the kernel's D = rowsum(dO * O) becomes D - dlse).  ``dest``: (dQ, dK, dV) tensors to
    write into, any of them None (a backward's ``ctx.grad_out``, e.g. the columns of a fused
    QKV gradient); each the kernels can address (see _grad_dests) is written in place and
    returned, the others are new contiguous tensors."""
    engine = _engine_takes(q, k, v)
    if engine and not _engine_reads(g):
        g = kern.copy(g)  # the engine's operand rules are its own (its tensor maps')
    elif not engine:
        g = _fa_operand(g)
    # the preprocess pass reads only O and dO: on the engine's path it is launched over q alone
    # (no kernel-layout copies of K and V it does not read)
    fl = _FlashLaunch(q, q, q, scale, causal) if engine else _FlashLaunch(q, k, v, scale, causal, block_mask)
    rt, B, H, Tq, Tk, D = fl.rt, fl.B, fl.H, fl.Tq, k.shape[2], fl.D
    (bo, oo), (bg, og) = bind(o), bind(g)
    o_at, do_at = _rows_at(o, oo), _rows_at(g, og)
    bl = bind(lse)[0]
    isz = q.dtype.itemsize
    rows = B * H * Tq
    dsum = empty((B, H, Tq), dt.float32, rt)
    # D = rowsum(dO * O): the dQ pass computes it as it goes (the SIMT one, or the engine's, which
    # reads O's rows as its tensor maps read dO's) where there is one and no dL to fold in (the
    # preprocess pass's binding for dL is L's in the dQ pass), else a pass of its own
    d_in_dq = need_q and dlse is None and (not engine or _engine_reads(o))
    if not d_in_dq:
        _preprocess(fl, rows, o_at, do_at, {3: bo, 4: bg, 6: bind(dsum, True)[0]}, dlse)
    if engine:
        took = _engine_bwd(q, k, v, g, lse, dsum, scale, causal, need_q, need_kv, block_mask, dest,
                           o if d_in_dq else None)
        if took is not None:
            return took
        fl = _FlashLaunch(q, k, v, scale, causal, block_mask)  # the SIMT passes read K and V
    pairs = B * H * fl.pairs()
    stats = {4: bg, 5: bl, 6: bind(dsum)[0]}
    dq, dk, dv = _grads_to(dest, q, k, v, need_q, need_kv)
    if need_q:
        b, off = bind(dq, True)
        d_work = (2 * rows * D, rows * (D * isz + 4)) if d_in_dq else (0, 0)  # O read, D stored
        fl.dispatch(_FA_DQ, Tq, {**stats, 7: b, **({3: bo, 6: bind(dsum, True)[0]} if d_in_dq else {})},
                    "flash_attn_bwd_dq", 6 * pairs * D + d_work[0], B * H * (3 * Tq + 2 * fl.key_rows()) * D * isz + d_work[1],
                    o=o_at, do=do_at, grads=(*dq._strides[:3], off, 0), d_here=d_in_dq)
    if need_kv:
        (bk, ok), (bv, ov) = bind(dk, True), bind(dv, True)
        # Q and dO read per query head; K and V read, dK and dV written per K/V head
        fl.dispatch(_FA_DKV, Tk, {**stats, 8: bk, 9: bv}, "flash_attn_bwd_dkv",
                    8 * pairs * D, B * (2 * H * Tq + fl.Hk * (2 * Tk + 2 * fl.key_rows())) * D * isz, o=o_at, do=do_at,
                    grads=(*dk._strides[:3], ok, ov))
    return dq, dk, dv


def _preprocess(fl: _FlashLaunch, rows: int, o_at: tuple, do_at: tuple, bufs: dict, dlse: Tensor | None) -> None:
    """The backward's preprocess pass: D = rowsum(dO * O) (minus ``dlse``, the gradient of L,
    where given) of all ``rows`` query rows into binding 6 of ``bufs`` (which binds O at 3 and
    dO at 4)."""
    B, H, Tq, D, isz = fl.B, fl.H, fl.Tq, fl.D, fl.q.dtype.itemsize
    if dlse is not None:
        if dlse.shape != (B, H, Tq) or dlse.dtype is not dt.float32:
            raise ShapeError(f"flash_attn_bwd: dlse must be float32 {(B, H, Tq)}, got {dlse.dtype.name} {dlse.shape}")
        if not dlse.is_contiguous():
            dlse = kern.copy(dlse)
        bd, od = bind(dlse)
        if od:  # the pass indexes dL from the start of its binding
            dlse = kern.copy(dlse)
            bd, od = bind(dlse)
        bufs = {**bufs, 5: bd}
    fl.dispatch(_FA_PRE, rows, bufs, "flash_attn_bwd_pre", 2 * rows * D + (rows if dlse is not None else 0),
                2 * rows * D * isz + rows * (8 if dlse is not None else 4), per_head=False, dlse=dlse is not None,
                o=o_at, do=do_at)


def _grad_dests(dest: tuple | None, q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """(dQ, dK, dV) destinations of flash_attn_bwd's ``dest`` the kernels can write in place:
    each of its operand's shape and dtype and addressable (_fa_addressable), dK and dV together
    only (one pass writes both with one set of strides).  None where not."""
    if dest is None:
        return None, None, None
    ok = [d if d is not None and d.shape == t.shape and d.dtype is t.dtype and d._st.rt is t._st.rt
          and _fa_addressable(d) else None for d, t in zip(dest, (q, k, v))]
    if ok[1] is None or ok[2] is None or ok[1]._strides != ok[2]._strides:
        ok[1] = ok[2] = None
    return tuple(ok)


def _grads_to(dest: tuple | None, q: Tensor, k: Tensor, v: Tensor, need_q: bool, need_kv: bool) -> tuple:
    """The (dQ, dK, dV) flash_attn_bwd writes (None where not needed): ``dest``'s where _grad_dests
    allows, else new tensors laid out as q is, and dK and dV both as v is (one pass writes them
    with one set of strides), where those layouts are dense.  v is typically a transposed view of
    its projection's output, whose gradient then needs no copy to reach it."""
    def laid_as(t: Tensor, strides: tuple) -> Tensor:
        new = empty_in_layout(t.shape, strides, t.dtype, t._st.rt)
        return new if _fa_addressable(new) else empty(t.shape, t.dtype, t._st.rt)

    dq_to, dk_to, dv_to = _grad_dests(dest, q, k, v)
    if need_q and dq_to is None:
        dq_to = laid_as(q, q._strides)
    if need_kv and dk_to is None:
        dv_to = laid_as(v, v._strides)
        dk_to = laid_as(k, dv_to._strides)
    return (dq_to if need_q else None), (dk_to if need_kv else None), (dv_to if need_kv else None)


def _engine_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, lse: Tensor, dsum: Tensor, scale: float, causal: bool,
                need_q: bool, need_kv: bool, block_mask: FlashBlockMask | None, dest: tuple | None,
                o: Tensor | None = None):
    """(dQ, dK, dV) from the device's flash engine given L and D = rowsum(dO * O) in ``dsum``, or
    None where it declines; given the forward's ``o`` instead, its dQ pass computes D into ``dsum``.
    dK and dV have K's heads (a GQA group's gradients summed in the kernel).
    ``dest``: flash_attn_bwd's (written in place where _grad_dests allows, as the SIMT kernels do)."""
    if not lse.is_contiguous():
        lse = kern.copy(lse)
    dq, dk, dv = _grads_to(dest, q, k, v, need_q, need_kv)
    if _run_engine("bwd", (q, k, v, g), (lse, dsum), (dq, dk, dv), scale, causal, block_mask, () if o is None else (o,)):
        return dq, dk, dv
    return None
