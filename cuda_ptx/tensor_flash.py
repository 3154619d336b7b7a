"""Tensor-core flash attention for ``cuda:N`` tensors: the :mod:`gen_flash` kernels on device memory.

:meth:`CudaRuntime.flash <helios.cuda_ptx.tensor_runtime.CudaRuntime.flash>` hands the
operands of a 16-bit attention here, as addresses and element strides, instead of running
the translated GLSL kernel (SIMT fp32 arithmetic).  Each of Q, K, V and dO is read through
a 4-D tensor map (D, T, H, B) built from its own strides, so per-head views of a packed
QKV tensor are read in place and TMA zero-fills the rows past T.  O, L, dQ, dK and dV are
written contiguous ([B, H, T, D] and [B, H, T]).

What it takes (:meth:`TensorCoreFlash.accepts`): a Hopper GPU (sm_90), bf16 or fp16, head
dim 64 or 128, the head-dim stride 1 and every other stride and each base a multiple of
16 bytes (TMA's rules), as many query heads as a multiple of the K/V heads (grouped-query
attention reads the shared K/V head in place), and extents below 2^31.  Anything else runs
the generic kernel; ``HELIOS_DEBUG=1`` says which ran and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from helios.backend import attention_pairs

from . import gen_flash
from .driver import Context
from .render import render

DTYPES = {"bfloat16": "bf16", "float16": "fp16"}  # Helios dtype names -> the generator's


@dataclass(frozen=True)
class Operand:
    """A [B, H, T, D] tensor on the device: its address and element strides of B, H and T
    (D's stride is 1)."""

    ptr: int
    strides: tuple[int, int, int]


@dataclass(frozen=True)
class Problem:
    """The shape of one attention: batch, query heads, K/V heads, query and key lengths, head dim."""

    B: int
    H: int
    Hk: int
    Tq: int
    Tk: int
    D: int

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.H // self.Hk


class _Kernel:
    """One loaded flash kernel: its config, function and threads per CTA."""

    __slots__ = ("cfg", "fn", "threads")

    def __init__(self, cfg, fn, threads: int):
        self.cfg, self.fn, self.threads = cfg, fn, threads


def why_not(dtype: str, pb: Problem, operands: list[Operand]) -> str | None:
    """Why this attention cannot run on the tensor-core kernels (one phrase), or None if it can."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (bf16 / fp16 only)"
    if pb.D not in gen_flash.HEAD_DIMS:
        return f"head dim {pb.D} (the kernels take {gen_flash.HEAD_DIMS})"
    if pb.Hk < 1 or pb.H % pb.Hk:
        return f"{pb.H} query heads are not a multiple of {pb.Hk} K/V heads"
    if min(pb.B, pb.H, pb.Tq, pb.Tk) < 1 or max(pb.Tq, pb.Tk) >= 1 << 31 or pb.B * pb.H > 65535:
        return f"extents B={pb.B} H={pb.H} Tq={pb.Tq} Tk={pb.Tk}"
    for op in operands:
        if not _rows_16_bytes(op):
            return f"an operand's base or strides are not multiples of 16 bytes ({op.ptr:#x}, {op.strides})"
    return None


def _rows_16_bytes(op: Operand) -> bool:
    """Whether every row of 16-bit [B, H, T, D] ``op`` starts 16-byte aligned (TMA's rule for an
    operand, the dQ pass's 16-byte loads of O and dO): its base and strides multiples of 16 bytes,
    the strides non-negative."""
    return op.ptr % 16 == 0 and all((s * 2) % 16 == 0 and s >= 0 for s in op.strides)


def out_strides_why_not(out: Operand) -> str | None:
    """Why the kernels cannot write an output at ``out`` (one phrase), or None if they can: they
    store pairs of 2-byte values (4-byte words), so the base and the strides must be even, and
    each stride must fit in 32 bits."""
    if out.ptr % 4 or any(s % 2 or not 0 <= s < 1 << 32 for s in out.strides):
        return f"base or strides not multiples of 4 bytes, or strides past 2^32 ({out.ptr:#x}, {out.strides})"
    return None


def d_inputs_why_not(o: Operand, do: Operand) -> str | None:
    """Why the dQ pass cannot compute D = rowsum(dO * O) from ``o`` and ``do`` (one phrase), or None if
    it can: it reads their rows 16 bytes a load, so the bases and the strides must be multiples of 16
    bytes (and fit in 32 bits)."""
    for name, t in (("O", o), ("dO", do)):
        if not _rows_16_bytes(t) or any(s >= 1 << 32 for s in t.strides):
            return f"{name}'s base or strides are not multiples of 16 bytes ({t.ptr:#x}, {t.strides})"
    return None


class TensorCoreFlash:
    """The three flash kernels (forward, dQ, dK/dV) on one driver context (see the module docstring)."""

    MAX_MAPS = 4096  # tensor maps kept for reuse (a model's steps see the same operands again)

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._kernels: dict[tuple, _Kernel] = {}
        self._maps: dict[tuple, bytes] = {}

    def kernel(self, pass_: str, dtype: str, head_dim: int, block_mask: bool = False) -> _Kernel:
        """The loaded kernel of one pass (built and loaded on first use); ``block_mask``: the form
        whose streamed blocks each lie in one 64-row group (see ``gen_flash.default_config``)."""
        cfg = gen_flash.default_config(pass_, DTYPES[dtype], head_dim, block_mask)
        key = cfg.name
        kern = self._kernels.get(key)
        if kern is None:
            built = gen_flash.generate(cfg)
            fn = self.ctx.load_kernel(render(built), built.name, built.shared_bytes, "sm_90a")
            kern = self._kernels[key] = _Kernel(cfg, fn, built.threads)
        return kern

    def _map(self, dtype: str, op: Operand, heads: int, pb: Problem, t_len: int, rows: int) -> bytes:
        """The 4-D tensor map (D, T, heads, B) of an operand, boxes of 64 columns x ``rows`` rows."""
        sb, sh, st = op.strides
        key = (op.ptr, dtype, heads, pb.B, t_len, pb.D, op.strides, rows)
        m = self._maps.get(key)
        if m is None:
            if len(self._maps) >= self.MAX_MAPS:
                self._maps.clear()
            m = self._maps[key] = self.ctx.tensor_map_nd(
                op.ptr, DTYPES[dtype], (pb.D, t_len, heads, pb.B), (st * 2, sh * 2, sb * 2),
                (gen_flash.BOX_COLS, rows, 1, 1))
        return m

    def _prepared(self, kern: _Kernel, grid: tuple[int, int, int], args: list) -> tuple:
        """A prepared launch (``Context.prepare_launch``) with ``args``: tensor maps (bytes), ("u64" | "u32" | "f32",
        value) pairs."""
        return self.ctx.prepare_launch(kern.fn, grid, (kern.threads, 1, 1), args)

    def run(self, launches: list[tuple]) -> None:
        """Issue the launches of :meth:`forward_launches` or :meth:`backward_launches` on the default stream (asynchronously)."""
        for launch in launches:
            self.ctx.launch_prepared(launch, "flash_wgmma")

    def forward_launches(self, dtype: str, pb: Problem, q: Operand, k: Operand, v: Operand, o: Operand, lse: int,
                         scale: float, causal: bool, mask: tuple | None = None) -> list[tuple]:
        """The prepared launch (one, in a list; :meth:`run` issues it) that writes O ([B, H, Tq, D]
        at ``o``, any strides: see :func:`out_strides`) and L (float32 [B, H, Tq] at ``lse``) of
        softmax(Q K^T * scale) V.  ``mask`` = (address, block size): an int32 [ceil(Tq / bs),
        ceil(Tk / bs)] block mask (0 = skipped), bs a multiple of 64."""
        kern = self.kernel("fwd", dtype, pb.D, mask is not None)
        cfg = kern.cfg
        args = [self._map(dtype, q, pb.H, pb, pb.Tq, cfg.bm), self._map(dtype, k, pb.Hk, pb, pb.Tk, cfg.bn),
                self._map(dtype, v, pb.Hk, pb, pb.Tk, cfg.bn), ("u64", o.ptr), ("u64", lse),
                *self._dims(pb), ("f32", scale * gen_flash.LOG2E), ("u32", int(causal)), *self._mask(pb, mask),
                *self._out_strides(o)]
        return [self._prepared(kern, (-(-pb.Tq // cfg.bm), pb.B * pb.H, 1), args)]

    def backward_launches(self, dtype: str, pb: Problem, q: Operand, k: Operand, v: Operand, do: Operand, lse: int,
                          delta: int, dq: Operand | None, dk: Operand | None, dv: Operand | None, scale: float,
                          causal: bool, mask: tuple | None = None, o: Operand | None = None) -> list[tuple]:
        """The prepared launches (:meth:`run` issues them) that write dQ ([B, H, Tq, D] at ``dq``) and
        dK, dV ([B, Hk, Tk, D], with the same strides: one pass writes both) given the forward's L
        and D = rowsum(dO * O) (float32 [B, H, Tq] at ``lse`` and ``delta``); outputs of any strides
        (:func:`out_strides`); a pass whose outputs are None has no launch; ``mask``: the forward's.
        With the forward's ``o`` (rows 16-byte aligned: :func:`d_inputs_why_not`), the dQ pass computes
        D itself and stores it at ``delta`` for the dK/dV pass (dQ must then be wanted)."""
        tail = [*self._dims(pb), ("f32", scale * gen_flash.LOG2E), ("f32", scale), ("u32", int(causal)),
                *self._mask(pb, mask)]
        sparse = mask is not None
        launches = []
        if o is not None:
            why = "dQ is not wanted (the dQ pass computes D)" if dq is None else d_inputs_why_not(o, do)
            if why is not None:
                raise ValueError(f"backward_launches: o given, but {why}")
        no_d = [("u32", 0), ("u64", 0), ("u64", 0)] + [("u32", 0)] * 6  # gen_flash.D_PARAMS: D is read
        if dq is not None:
            kern = self.kernel("dq", dtype, pb.D, sparse)
            bm, bn = kern.cfg.bm, kern.cfg.bn
            d_args = no_d if o is None else [("u32", 1), ("u64", o.ptr), ("u64", do.ptr),
                                             *(("u32", x) for x in (*o.strides, *do.strides))]
            args = [self._map(dtype, q, pb.H, pb, pb.Tq, bm), self._map(dtype, k, pb.Hk, pb, pb.Tk, bn),
                    self._map(dtype, v, pb.Hk, pb, pb.Tk, bn), self._map(dtype, do, pb.H, pb, pb.Tq, bm),
                    ("u64", lse), ("u64", delta), ("u64", dq.ptr), ("u64", 0), *tail, *self._out_strides(dq), *d_args]
            launches.append(self._prepared(kern, (-(-pb.Tq // bm), pb.B * pb.H, 1), args))
        if dk is not None or dv is not None:
            if dk is None or dv is None:
                raise ValueError("backward_launches: dk and dv are computed together; pass both addresses")
            if dk.strides != dv.strides:
                raise ValueError(f"backward_launches: dk and dv share one set of strides, got {dk.strides} and {dv.strides}")
            kern = self.kernel("dkv", dtype, pb.D, sparse)
            bm, bn = kern.cfg.bm, kern.cfg.bn
            args = [self._map(dtype, q, pb.H, pb, pb.Tq, bn), self._map(dtype, k, pb.Hk, pb, pb.Tk, bm),
                    self._map(dtype, v, pb.Hk, pb, pb.Tk, bm), self._map(dtype, do, pb.H, pb, pb.Tq, bn),
                    ("u64", lse), ("u64", delta), ("u64", dk.ptr), ("u64", dv.ptr), *tail, *self._out_strides(dk), *no_d]
            launches.append(self._prepared(kern, (-(-pb.Tk // bm), pb.B * pb.Hk, 1), args))
        return launches

    @staticmethod
    def _out_strides(out: Operand) -> list:
        """An output's stride parameters (gen_flash.OUT_STRIDES)."""
        why = out_strides_why_not(out)
        if why is not None:
            raise ValueError(f"flash output: {why}")
        return [("u32", s) for s in out.strides]

    @staticmethod
    def _mask(pb: Problem, mask: tuple | None) -> list:
        """The kernels' block-mask parameters: address (0: none), block size, key blocks per row."""
        if mask is None:
            return [("u64", 0), ("u32", 64), ("u32", 1)]
        ptr, bs = mask
        if bs <= 0 or bs % 64:
            raise ValueError(f"block mask: the block size must be a positive multiple of 64, got {bs}")
        return [("u64", ptr), ("u32", bs), ("u32", -(-pb.Tk // bs))]

    @staticmethod
    def _dims(pb: Problem) -> list:
        return [("u32", pb.Tq), ("u32", pb.Tk), ("u32", pb.H), ("u32", pb.group)]


def flops(pb: Problem, causal: bool, backward: bool = False, pairs: int | None = None) -> int:
    """FLOPs an attention's products take (forward: 2; backward: the 5 of a fused backward, not the
    7 these kernels run, so rates compare with other implementations): 2 D per product per
    (query, key) pair; ``pairs``: those one head computes (a block mask's), else all (causal: half)."""
    if pairs is None:
        pairs = attention_pairs(pb.Tq, pb.Tk, causal)
    return (5 if backward else 2) * 2 * pb.D * pairs * pb.B * pb.H


# -- numpy in, numpy out (tests, and checks on a GPU) ---------------------------------------------


def _bits(x, dtype: str):
    import numpy as np

    from .dtypes import f32_to_bf16_bits

    x = np.ascontiguousarray(x, dtype=np.float32)
    return f32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype(np.float16).view(np.uint16)


def _values(bits, dtype: str):
    import numpy as np

    from .dtypes import bf16_bits_to_f32

    return (bf16_bits_to_f32(bits) if dtype == "bfloat16" else bits.view(np.float16)).astype(np.float64)


def rounded(x, dtype: str = "bfloat16"):
    """``x`` rounded to the 16-bit ``dtype`` and widened to float64: the values the kernels see."""
    return _values(_bits(x, dtype), dtype)


def attention_numpy(ctx: Context, q, k, v, do=None, scale: float | None = None, causal: bool = False,
                    dtype: str = "bfloat16", engine: TensorCoreFlash | None = None, block_mask=None,
                    block_size: int = 128) -> dict:
    """Run the kernels on numpy [B, H, T, D] arrays (k and v may have fewer heads): returns
    ``{"o", "lse"}`` and, with ``do`` (the upstream gradient), ``{"dq", "dk", "dv", "delta"}``,
    all float64; inputs are rounded to ``dtype`` first (see :func:`rounded`).  D = rowsum(dO * O)
    is the dQ pass's, from the kernel's O.
    ``ctx`` may be a GPU's context or an emulated one (``emu_driver.emulated_context``).
    ``block_mask``: boolean [ceil(Tq / block_size), ceil(Tk / block_size)], the blocks computed."""
    import numpy as np

    engine = engine or TensorCoreFlash(ctx)
    B, H, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    pb = Problem(B, H, Hk, Tq, Tk, D)
    scale = D ** -0.5 if scale is None else float(scale)
    held = []

    def upload(arr) -> int:
        ptr = ctx.alloc(max(arr.nbytes, 16))
        held.append(ptr)
        ctx.upload(ptr, np.ascontiguousarray(arr))
        return ptr

    def operand(x) -> Operand:
        ptr = upload(_bits(x, dtype))
        return Operand(ptr, (x.shape[1] * x.shape[2] * D, x.shape[2] * D, D))

    def fetch(ptr: int, shape, kind: str):
        host = np.empty(int(np.prod(shape)), np.float32 if kind == "f32" else np.uint16)
        ctx.download(host, ptr)
        return (host.astype(np.float64) if kind == "f32" else _values(host, dtype)).reshape(shape)

    try:
        ops = [operand(x) for x in (q, k, v)]
        o, lse = upload(np.zeros(B * H * Tq * D, np.uint16)), upload(np.zeros(B * H * Tq, np.float32))
        o_at = Operand(o, (H * Tq * D, Tq * D, D))
        mask = None if block_mask is None else (upload(np.asarray(block_mask, np.int32)), block_size)
        engine.run(engine.forward_launches(dtype, pb, *ops, o_at, lse, scale, causal, mask))
        ctx.synchronize()
        out = {"o": fetch(o, (B, H, Tq, D), dtype), "lse": fetch(lse, (B, H, Tq), "f32")}
        if do is None:
            return out
        dop = operand(do)
        grads = [upload(np.zeros(n * D, np.uint16)) for n in (B * H * Tq, B * Hk * Tk, B * Hk * Tk)]
        outs = [Operand(ptr, (heads * t * D, t * D, D)) for ptr, heads, t in zip(grads, (H, Hk, Hk), (Tq, Tk, Tk))]
        delta = upload(np.full(B * H * Tq, np.nan, np.float32))  # the dQ pass writes it
        engine.run(engine.backward_launches(dtype, pb, *ops, dop, lse, delta, *outs, scale, causal, mask, o=o_at))
        ctx.synchronize()
        out["delta"] = fetch(delta, (B, H, Tq), "f32")
        for name, ptr, shape in zip(("dq", "dk", "dv"), grads, ((B, H, Tq, D), (B, Hk, Tk, D), (B, Hk, Tk, D))):
            out[name] = fetch(ptr, shape, dtype)
        return out
    finally:
        for ptr in held:
            ctx.free(ptr)


def reference(q, k, v, do=None, scale: float | None = None, causal: bool = False, block_mask=None,
              block_size: int = 128) -> dict:
    """float64 attention (and its gradients given ``do``) with K/V heads shared by groups of query
    heads; causal rows see keys j <= i; ``block_mask`` keeps only its blocks of ``block_size``.  The
    oracle of :func:`attention_numpy`."""
    import numpy as np

    H, Hk, D = q.shape[1], k.shape[1], q.shape[3]
    scale = D ** -0.5 if scale is None else float(scale)
    kk, vv = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
    s = np.einsum("bhtd,bhsd->bhts", q, kk) * scale
    tq, tk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(tk)[None, :] <= np.arange(tq)[:, None], s, -np.inf)
    if block_mask is not None:
        keep = np.asarray(block_mask, bool)[np.arange(tq)[:, None] // block_size, np.arange(tk)[None, :] // block_size]
        s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l_ = e.sum(-1, keepdims=True)
    p = e / l_
    out = {"o": p @ vv, "lse": (m + np.log(l_))[..., 0]}
    if do is None:
        return out
    dv = np.einsum("bhts,bhtd->bhsd", p, do)
    dp = do @ vv.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = ds @ kk * scale
    dk = np.einsum("bhts,bhtd->bhsd", ds, q) * scale
    B, Tk = k.shape[0], k.shape[2]
    out["dq"] = dq
    out["dk"] = dk.reshape(B, Hk, H // Hk, Tk, D).sum(2)
    out["dv"] = dv.reshape(B, Hk, H // Hk, Tk, D).sum(2)
    return out


__all__ = ["DTYPES", "Operand", "Problem", "TensorCoreFlash", "attention_numpy", "d_inputs_why_not", "flops",
           "out_strides_why_not", "reference", "rounded", "why_not"]
