"""The matmul kernels: the lavapipe register-block kernel (its tile choice and layouts) and the
shared-memory GPU kernel, bias and the fused epilogues of helios.fused_kernels."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import fused_kernels
from helios._shape import broadcast_strides, collapse, numel
from helios.errors import ShapeError
from helios.tensor import Tensor
from helios._kernels.core import bind, empty, loop_run, narrow_view
from helios._kernels import coopmat
import helios._kernels as kern  # the other kernel families (bound once the package has loaded)


# Push words: the product's 16 (shapes, offsets, strides); matmul_epi's then the offsets of E and
# U; both kernels' last, C's row length when strided (0: contiguous) and whether a bias is added.
_P_MATMUL = struct.Struct("<18I")
_P_MATMUL_EPI = struct.Struct("<20I")
_P_MATMUL_COOP = struct.Struct("<18I")  # the cooperative-matrix kernel's: matmul_epi's without the last two


# -- matmul ----------------------------------------------------------------------------------
# matmul kernel configurations (see kernels_spirv/glsl/matmul.comp).
# GPUs: shared-memory tiles BM x BN x BK with WX x WY invocations (4x4 register blocks).
_MM_GPU_SPEC = (64, 64, 16, 16, 16)
# CPU drivers (lavapipe): subgroup register blocks of TM x TN per lane (the variant suffix)
# and WY subgroups per workgroup, picked per shape by _mm_cpu_tile(); None = automatic, a
# (TM, TN) / WY here forces them (bench/matmul.py --tiles / --wy sweeps them).
_MM_CPU_TILE: tuple | None = None
_MM_CPU_WY: int | None = None
_MM_SG = 8  # the subgroup size the CPU kernel is written for
_MM_KB = 8  # the K step of its main loop (KB in matmul.glsl)
_MM_CPU_TALL_F32 = 256  # fp32 outputs of this many rows or more take the 16-row block
# Whether the CPU kernel's fp32 epilogues run on vec4s where offsets allow (EVEC); False forces
# the per-element epilogue (tests/test_cpu_fast_paths.py compares the two bit for bit).
_MM_EPI_VEC = True


def _mm_cpu_tile(M: int, N: int, dtype: dt.DType = dt.float32) -> tuple:
    """(TM, TN, WY) of the CPU kernel for an M x N output of ``dtype``.

    Per K step a subgroup loads TM values of A and 8 * TN of B for TM * TN vector
    multiply-adds.  16-bit operands are unpacked in registers after each texel load.  For them
    32x8 (2.8x fewer loads per multiply-add than 8x16) ran 1.35-1.45x faster at 1024^3 when
    they were storage-buffer loads, and with rgba32ui texel fetches still beats 16x8 at 5 of 6
    shapes (0.95-1.19x, bench/README.md "matmul"); 64x8 is ~10 % faster again but JITs ~5x
    longer.  fp32 operands are rgba32f texels, used as fetched, cheap enough that the smaller
    16x8 block, with fewer accumulators to spill, is faster: 1.03-1.35x over 32x8 at the GPT
    shapes and 1024^3 (bench/README.md "matmul"), in workgroups of 64 rows.  Shorter outputs
    keep 8-row blocks in workgroups of 16 rows (below 64 rows a taller block would compute
    mostly clamped rows), with 16 columns a lane when N >= 512 and M < 64.  fp32 takes the
    16-row block from 256 rows (_MM_CPU_TALL_F32) because below that the two blocks ran equally
    fast (64-255 rows at the GPT shapes, within this machine's noise) while each block and each
    workgroup height is a pipeline of its own, which lavapipe builds again in every process
    (16x8: 25-95 ms, 8x8: 11-35 ms): one family of small-M kernels instead of two took a
    multi-rank training test's matmul pipeline building from 14.0 to 8.0 CPU-s.  WY keeps ~128
    rows a workgroup on tall 16-bit outputs (one B panel reused from cache) and 64 on shorter
    ones.
    The block does not change any sum: every output is the same K loop in the same order.
    """
    f32 = dtype is dt.float32
    if _MM_CPU_TILE is not None:
        tm, tn = _MM_CPU_TILE
    elif M >= (_MM_CPU_TALL_F32 if f32 else 64):
        tm, tn = (16, 8) if f32 else (32, 8)
    else:
        tm, tn = 8, 16 if N >= 512 and M < 64 else 8
    if f32:
        rows = 64 if tm == 16 else 16
    else:
        rows = 128 if M >= 512 else 64 if M >= 64 else 16
    wy = _MM_CPU_WY or max(1, rows // tm)
    return tm, tn, wy


def _mm_cpu_config(M: int, N: int, oa: int, ob: int, oc: int, ca, cb, sam: int, sak: int, sbk: int, sbn: int,
                   tile: tuple = (8, 8, 4)) -> tuple:
    """Specialization constants (WY, AMODE, BMODE, CVEC, AWIDE, BWIDE) of the CPU kernel.

    A K-contiguous A (row-major) or N-contiguous B is read in vectors along that dim, an
    M-contiguous A (a transposed view) or K-contiguous B (B^T) along the other; 8-wide
    when 8-aligned, 4-wide when 4-aligned, else with scalar loads.
    """
    tm, tn, wy = tile

    def fits(inner, outer, offs, run, e):
        return inner == 1 and outer % e == 0 and all(o % e == 0 for o in offs) and run % e == 0 and run >= (e if run else 0)

    def pick(k_inner, k_outer, t_inner, t_outer, offs, t_run, t_tile):
        # -> (mode, wide): mode 1 = K-contiguous, 2 = the M/N dim contiguous
        for e in (8, 4):
            if fits(k_inner, k_outer, offs, 0, e):
                return 1, int(e == 8)
            if t_tile % e == 0 and fits(t_inner, t_outer, offs, t_run, e):
                return 2, int(e == 8)
        return 0, 0

    amode, awide = pick(sak, sam, sam, sak, (oa, *ca), M, tm)
    # B: mode 1 is N-contiguous, 2 K-contiguous in the kernel; pick() returns 1 for the K-run
    bk, bwide = pick(sbk, sbn, sbn, sbk, (ob, *cb), N, tn)
    bmode = {0: 0, 1: 2, 2: 1}[bk]
    cvec = int(N % 4 == 0 and oc % 4 == 0)
    return (wy, amode, bmode, cvec, awide, bwide)


def _cpu_mm_kernel(rt) -> bool:
    """Whether matmuls on ``rt`` use the CPU-driver kernel (lavapipe, subgroups of _MM_SG lanes)."""
    return rt.info.get("type") == "cpu" and int(rt.info["limits"].get("subgroup_size", 0)) == _MM_SG


def matmul_any_layout(a: Tensor, b: Tensor, out: Tensor | None = None, compute: dt.DType | None = None) -> Tensor:
    """a @ b like matmul (no bias), possibly returned as a transposed view.

    The CPU kernel gives each subgroup 8 lanes x TN >= 8 columns, so an output narrower
    than 64 columns leaves lanes idle; a narrow, tall product is then computed as
    (b^T a^T)^T, the same sums with the wide dim as N (an attention [64, 64] @ [64, 32]
    measured ~1.1 ms instead of 1.3-2.2 ms).  For callers that accept any strides; ``out``
    as in matmul() (then returned, the product stored in its layout either way); ``compute`` as
    matmul()'s."""
    rt = a._st.rt
    M, N = a.shape[-2], b.shape[-1]
    if N < 8 * _MM_SG and M >= 2 * N and N % 8 == 0 and _cpu_mm_kernel(rt):
        if out is not None:
            matmul(_swap_last(b), _swap_last(a), out=_swap_last(out), compute=compute)
            return out
        return _swap_last(matmul(_swap_last(b), _swap_last(a), compute=compute))
    return matmul(a, b, out=out, compute=compute)


def _swap_last(x: Tensor) -> Tensor:
    """A raw (untracked) view of ``x`` with its last two dims swapped."""
    sh, st = list(x.shape), list(x._strides)
    sh[-1], sh[-2], st[-1], st[-2] = sh[-2], sh[-1], st[-2], st[-1]
    return Tensor(x._st, tuple(sh), tuple(st), x._off, x.dtype)


# The epilogue codes of matmul_epi (EPI in matmul.glsl) by fused kernel name.
_MM_EPI = {"linear+residual": 1, "linear+gelu": 2, "matmul+gelu_tanh_bwd": 3}


def matmul_epilogue(name: str, a: Tensor, b: Tensor, bias: Tensor | None, e: Tensor | None,
                    out: Tensor | None = None, compute: dt.DType | None = None) -> tuple:
    """One fused matmul kernel (helios.fused_kernels): ``name`` is "linear+residual" (a @ b + bias,
    rounded to the dtype, + ``e``), "linear+gelu" (u = a @ b + bias; gelu_tanh(u)) or
    "matmul+gelu_tanh_bwd" ((a @ b) * gelu_tanh'(``e``)).  ``e`` has the output's shape and
    dtype and is contiguous, as is ``out`` when given.  Returns (out, u) with u the stored
    pre-activation of "linear+gelu", else None.  Bit for bit the unfused kernels.  ``compute``:
    as matmul()'s (float32 slots in a 16-bit product; u is then of ``compute``)."""
    code = _MM_EPI.get(name)
    if code is None:
        raise ValueError(f"matmul_epilogue: name must be one of {sorted(_MM_EPI)}, got {name!r}")
    if b.ndim != 2 or a.ndim < 2 or a.shape[-1] != b.shape[0] or a.shape[-1] == 0:
        raise ShapeError(f"matmul_epilogue: expected a [..., K] @ [K, N] product with K > 0, got {a.shape} and {b.shape}")
    u = None
    if code == 2:
        u = empty(a.shape[:-1] + (b.shape[1],), compute or a.dtype, a._st.rt)
    elif e is None:
        raise ValueError(f"matmul_epilogue: {name} needs e (the tensor its epilogue reads)")
    r = matmul(a, b, bias, out, _epi=(name, code, e, u), compute=compute)
    return r, u


def matmul_bias_grad(a: Tensor, b: Tensor, out: Tensor, bsum: Tensor, compute: dt.DType | None = None) -> bool:
    """out = a @ b and bsum = b summed over its rows, in one dispatch (helios.fused_kernels
    "matmul+bias_grad": a Linear layer's weight gradient x^T g and bias gradient, g = ``b``);
    True when done, False, with nothing dispatched, where this kernel cannot take them (the
    caller then runs the matmul and the reduction).

    It takes 2-D a [M, K] (K > 0) and b [K, N] with b contiguous along N: float32 ones on the
    CPU-driver kernel; float32, float16 or bfloat16 ones on the GPU shared-memory kernel (not
    where a matrix engine takes the dtype); float16 or bfloat16 ones where the cooperative-matrix
    kernel runs the product (coopmat.choice_for).  ``out`` as matmul()'s (contiguous or a transposed
    contiguous [M, N]) and ``bsum`` a contiguous [N] of the same dtype apart from it, in any
    storage (every kernel stores it through the bias binding).  The sums are the column
    reduction's (reduce.comp MODE 1: k = 0 .. K-1 in order from 0.0, in float32), bit for bit.

    ``compute`` (autocast's weight gradient: bfloat16 on the CPU-driver kernel, bfloat16 or
    float16 on the shared-memory and cooperative-matrix kernels): a and b each ``compute`` or
    float32 (rounded as they are loaded, as matmul()'s ``compute``), ``out`` and ``bsum`` float32
    gradient slots, each receiving its rounded value widened: bit for bit the 16-bit product and
    column sum (a sum of 16-bit values is float32, rounded by the sum's own cast) cast to float32."""
    if not (a.ndim == 2 and b.ndim == 2 and out.ndim == 2 and bsum.ndim == 1):
        return False
    (M, K), N = a.shape, b.shape[1]
    rt = out._st.rt
    if (K == 0 or M == 0 or N < 2 or b.shape[0] != K or out.shape != (M, N) or bsum.shape != (N,)
            or b._strides[1] != 1 or bsum._strides[0] != 1 or a._st.rt is not rt or b._st.rt is not rt
            or bsum._st.rt is not rt):
        return False
    cpu = _cpu_mm_kernel(rt)
    if _k_runs(rt, K) > 1:  # matmul() cuts the product; the column sums are then the reduction's own
        return False
    coop = not cpu and coopmat.choice_for(rt, (compute or a.dtype).name, M, N, K).coopmat
    shared = not cpu and not coop and not rt.has_gemm((compute or a.dtype).name)  # the GPU shared-memory kernel
    if compute is not None:  # float32 slots of a 16-bit product (the mixed CPU kernel's variants, the GPU kernels' constants)
        if not ((compute is dt.bfloat16 and cpu) or (compute in (dt.bfloat16, dt.float16) and (shared or coop))) or not (
                out.dtype is dt.float32 and bsum.dtype is dt.float32 and a.dtype in (compute, dt.float32)
                and b.dtype in (compute, dt.float32)):
            return False
    elif any(t.dtype is not a.dtype for t in (b, out, bsum)):
        return False
    elif not (a.dtype is dt.float32 and cpu) and not (a.dtype.kind == "float" and shared) and not coop:
        return False
    if not (out.is_contiguous() or _swap_last(out).is_contiguous()):
        return False
    if bsum._st is out._st and bsum._off < out._off + M * N and out._off < bsum._off + N:  # overlapping slots
        return False
    matmul(a, b, out=out, _bsum=bsum, compute=compute)
    return True


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, out: Tensor | None = None, _epi: tuple | None = None,
           _bsum: Tensor | None = None, compute: dt.DType | None = None, _residual: Tensor | None = None) -> Tensor:
    """Batched a @ b (+ ``bias`` over the last dim) with broadcast batch dims; both >= 2-D
    and of the same float dtype; ``bias`` 1-D of size N with unit stride, added in the
    kernel's epilogue.  (``_epi``: matmul_epilogue's fused epilogue; ``_bsum``:
    matmul_bias_grad's column sums of b, checked there; ``_residual``: a float32 tensor of a
    float32 ``out``'s shape added to the rounded product of a matrix engine's ``compute``
    product, in its epilogue where it can: _mixed_apart's linear+residual.)

    ``compute`` (bfloat16 or float16; autocast's products): the product in that dtype where
    a, b, the bias, ``out`` and the epilogue's e may each be it or float32, bit for bit casts
    around the product in ``compute``: float32 operands rounded to it, a float32 ``out`` (new
    when not given: ``compute``) getting the rounded result widened, and linear+residual's
    float32 e added to the rounded product in float32 (so ``out`` must then be float32).
    The 16-bit kernels do the casts as they load and store (the mixed storage of
    kernels_spirv/glsl/matmul.glsl and matmul_coop.comp).  A matrix engine rounds and widens a
    float32 ``out`` in its epilogue (its ``round_out``); its float32 operands are cast by
    kernels around the product.

    Operands may be any strided views (transposes, broadcast batches): the kernel variant
    and its load paths are chosen here from strides and alignment.  ``out`` (optional, the
    result's shape and dtype) receives the product instead of a new tensor: contiguous, or
    the transposed view of a contiguous tensor (the kernel then stores each matrix
    transposed), e.g. a parameter's slot in a flat gradient buffer; or, with one or two
    batch dims [B, H], heads interleaved in rows of L elements, strides (M*L, N, L, 1) or
    transposed (N*L, M, 1, L) (the matmul kernel's CLD store; see _check_mm_out).
    """
    from helios._shape import broadcast_shapes

    M, K = a.shape[-2], a.shape[-1]
    K2, N = b.shape[-2], b.shape[-1]
    if K != K2:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} are not aligned (inner dims {K} != {K2})")
    batch = broadcast_shapes("matmul", a.shape[:-2], b.shape[:-2])
    rt = a._st.rt
    mixed = _mixed_slots(compute, a, b, bias, out, _epi)
    # A 16-bit product whose one float32 slot is out: a matrix engine rounds and widens it itself
    # (a fused epilogue's product is not the engine's: it takes the casts around it below).
    widen = mixed == _OUT_F32 and K > 0 and _epi is None and _bsum is None and rt.has_gemm(compute.name)
    if mixed is not None:
        if not widen and (K == 0 or not _mixed_in_kernel(rt, compute, mixed)):
            return _matmul_with_casts(a, b, bias, out, _epi, compute)
        a_dtype = compute  # the kernel's (its variant's) dtype; the slots flagged in ``mixed`` hold float32
    else:
        a_dtype = a.dtype
    ct = cld = 0
    if out is None:
        out = empty(batch + (M, N), a_dtype, rt)
    else:
        ct, cld = _check_mm_out(out, batch + (M, N), out.dtype if mixed else a_dtype)
    if out.numel() == 0:
        return out
    _check_bias(bias, a.dtype, N, mixed)
    if K == 0:
        return _empty_sum(out, bias, bool(ct or cld))
    plan = _batch_plan(a, b, batch, M, bool(ct or cld), bool(cld))
    if plan is None:  # three or more unmergeable batch dims: make the operands contiguous
        return matmul(kern.copy(a.expand(batch + (M, K))), kern.copy(b.expand(batch + (K, N))), bias, out, _epi,
                      compute=compute)
    Mc, nb, cbatch = plan
    if _epi is not None:
        _check_epi(_epi, out, batch + (M, N), ct or cld, a_dtype)
    if _epi is None and _bsum is None and _engine_took(a, b, bias, out, widen, nb, Mc, N, K, _residual):
        return out
    if widen:  # the engine declined it: the product, then its cast (and the residual's add)
        kern.copy_into(out, matmul(a, b, bias))
        if _residual is not None:
            kern.binary_("add", out, _residual)
        return out
    if nb > 65535:
        raise ShapeError(f"matmul: {nb} batch matrices exceed the 65535 the kernel dispatches at once; reshape the batch")
    runs = _k_runs(rt, K)
    if runs > 1:
        return _matmul_split_k(a, b, bias, out, _epi, compute, runs)
    _dispatch(a, b, bias, out, _epi, _bsum, mixed, a_dtype, (Mc, N, K, nb), cbatch, (ct, cld))
    return out


def _k_runs(rt, K: int) -> int:
    """The runs the CPU kernel's K loop is cut into on ``rt``: 1 unless its loop of K // 8 steps
    and K % 8 tail steps would pass the driver's loop limit (core.loop_run)."""
    cap = loop_run(rt)
    if cap is None or not _cpu_mm_kernel(rt) or K // _MM_KB + K % _MM_KB <= cap:
        return 1
    return -(-K // (cap * _MM_KB))


def _matmul_split_k(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor, epi: tuple | None,
                    compute: dt.DType | None, runs: int) -> Tensor:
    """matmul() where one pass over K would outrun the driver's loop limit (:func:`_k_runs`):
    float32 products of ``runs`` runs of K, summed in order (the bias in the first), then the
    rounding to the product's dtype and the epilogue as kernels of their own.  The same sums in
    float32 as one pass, added in another order.  ``out`` is filled and returned."""
    dtype = compute or a.dtype

    def wide(x):  # an operand as the product reads it: a float32 slot rounded to ``compute``, then float32
        if x is not None and compute is not None and x.dtype is dt.float32:
            x = kern.copy(x, compute)
        return x if x is None or x.dtype is dt.float32 else kern.copy(x, dt.float32)

    K = a.shape[-1]
    per = -(-K // runs)
    acc = None
    for k0 in range(0, K, per):
        n = min(per, K - k0)
        part = matmul(wide(narrow_view(a, -1, k0, n)), wide(narrow_view(b, -2, k0, n)), wide(bias) if acc is None else None)
        acc = part if acc is None else kern.binary_("add", acc, part)
    r = acc if dtype is dt.float32 else kern.copy(acc, dtype)
    if epi is not None:
        r = _unfused_epilogue(epi, r)
    kern.copy_into(out, r)
    return out


def _unfused_epilogue(epi: tuple, r: Tensor) -> Tensor:
    """matmul_epi's epilogue ``epi`` = (name, code, e, u) on the rounded product ``r``, as the
    unfused kernels it matches bit for bit: + e (in e's dtype), gelu_tanh (u gets r), or gelu_tanh's
    backward at e."""
    _, code, e, u = epi
    if code == 1:
        return kern.binary("add", r if r.dtype is e.dtype else kern.copy(r, e.dtype), e)
    if code == 2:
        kern.copy_into(u, r)
        return kern.unary("gelu_tanh", r)
    return kern.binary("gelu_tanh_bwd", e, r)


def _check_bias(bias: Tensor | None, dtype: dt.DType, N: int, mixed: tuple | None) -> None:
    """A bias is a unit-stride vector of N elements, of the operands' dtype (or a float32 slot of a mixed product)."""
    if bias is not None and (bias.shape != (N,) or (bias.dtype is not dtype and not mixed) or (N > 1 and bias._strides[0] != 1)):
        raise ShapeError(f"matmul: bias must be a unit-stride {dtype.name} vector of shape ({N},), "
                         f"got {bias.dtype.name} {bias.shape} with strides {bias._strides}")


def _batch_plan(a: Tensor, b: Tensor, batch: tuple, M: int, strided_out: bool, cld: bool) -> tuple | None:
    """How the kernel walks the batch: (rows M, batch matrices, (the two batch dims' shape, A's
    strides, B's strides)), or None where three or more batch dims do not merge."""
    nb = numel(batch)
    sa = broadcast_strides(a.shape[:-2], a._strides[:-2], batch)
    sb = broadcast_strides(b.shape[:-2], b._strides[:-2], batch)
    if cld:  # the kernel's z0 / z1 must be the out's two batch dims, unmerged
        cshape, ca, cb = list(batch), list(sa), list(sb)
    else:
        cshape, (ca, cb) = collapse(batch, sa, sb)
    if len(cshape) > 2:
        return None
    if len(cshape) == 1 and cb[0] == 0 and ca[0] == M * a._strides[-2] and not strided_out:
        # B is shared by every batch matrix and A's batches follow each other along M (a
        # Linear layer on [B, T, C]): one [nb*M, K] @ [K, N] product.  Each output is the
        # same K-loop as before, so results are bit-identical; the taller grid lets the
        # tile choice use tall workgroups that reuse each B panel from cache.
        M, nb, cshape, ca, cb = M * nb, 1, [], [], []
    while len(cshape) < 2:
        cshape, ca, cb = [1] + cshape, [0] + ca, [0] + cb
    return M, nb, (cshape, ca, cb)


def _engine_took(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor, widen: bool, nb: int, M: int, N: int,
                 K: int, residual: Tensor | None = None) -> bool:
    """Run the product on the device's matrix engine where it takes the dtype and the layout;
    False, with nothing run, where it does not.  ``M`` is the batch-folded row count of one product.
    ``residual``: matmul()'s ``_residual`` (added to ``out`` when True comes back)."""
    if a.dtype not in _ENGINE_DTYPES or not a._st.rt.has_gemm(a.dtype.name):
        return False
    if nb == 1:  # one product (a Linear's batch folded into M above): the matrices as 2-D views
        a2, b2, c2 = (Tensor(t._st, shape, t._strides[-2:], t._off, t.dtype)
                      for t, shape in ((a, (M, K)), (b, (K, N)), (out, (M, N))))
        r2 = None if residual is None else Tensor(residual._st, (M, N), residual._strides[-2:], residual._off, residual.dtype)
        return _on_matrix_engine(a2, b2, bias, c2, widen, r2)
    return _on_matrix_engine(a, b, bias, out, widen, residual)  # a batch of products: one launch for all


def _dispatch(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor, epi: tuple | None, bsum: Tensor | None,
              mixed: tuple | None, a_dtype: dt.DType, mnk: tuple, batch: tuple, cstore: tuple) -> None:
    """One dispatch of matmul.glsl (``matmul``, ``matmul_epi``) or the cooperative-matrix kernel for
    :func:`matmul`'s checked product: ``mnk`` = (M, N, K, batch matrices), ``batch`` = the two
    collapsed batch dims (their shape, A's strides, B's strides), ``cstore`` = (CT, CLD), how C is
    stored (_check_mm_out); ``a_dtype`` the kernel's dtype, ``mixed`` its float32 slots."""
    rt = a._st.rt
    M, N, K, nb = mnk
    cshape, ca, cb = batch
    ct, cld = cstore
    cpu = _cpu_mm_kernel(rt)
    tile = None if cpu else coopmat.choice_for(rt, a_dtype.name, M, N, K).tile  # tensor cores (coopmat.py)
    (ba, oa), (bb, ob) = bind(a), bind(b)
    (bc, oc), (bz, oz) = _bind_c_and_bias(out, bias, bsum, ct, cld, (ba, oa))
    # matmul_epi's and the cooperative-matrix kernel's E / U bindings: unused ones repeat C (never read
    # or written: EPI picks what the epilogue touches).
    be, oe = bind(epi[2]) if epi is not None and epi[2] is not None else (bc, 0)
    bu, ou = bind(epi[3], True) if epi is not None and epi[3] is not None else (bc, 0)
    strides = (a._strides[-2], a._strides[-1], b._strides[-2], b._strides[-1])  # sam, sak, sbk, sbn
    kernel = "matmul" if epi is None else "matmul_epi"
    # matmul.glsl's constants: the bias and C's row length are push words, so their old ids (GPU 5
    # and 7, CPU 6 and 8) stay 0 around CT.  matmul_epi: CT (0 there), id 8 and the epilogue code at id 9.
    ct_spec = (0, ct, 0) if ct or bsum is not None else (0,)
    epi_spec = () if epi is None else (0, 0, epi[1])
    if cpu:
        tm, tn, wy = _mm_cpu_tile(M, N, a_dtype)
        spec = _mm_cpu_config(M, N, oa, ob, oc, ca, cb, *strides, (tm, tn, wy))
        if ct or cld:  # vec4 stores run along C's contiguous dim (M when transposed)
            spec = spec[:3] + (int((M if ct else N) % 4 == 0 and oc % 4 == 0 and cld % 4 == 0),) + spec[4:]
        spec = spec + ct_spec + epi_spec
        if bsum is not None:  # BSUM at constant id 10 (9 is matmul_epi's EPI)
            spec = spec + (0, 1)
        elif epi is not None and _MM_EPI_VEC and a_dtype is dt.float32 and spec[3] and not (ct or cld):
            # EVEC (constant id 11): the fp32 epilogue on vec4s when E's and U's offsets allow
            if oe % 4 == 0 and ou % 4 == 0:
                spec = spec + (0, 1)
        pid = rt.pipeline(kernel, f"{a_dtype.tag}{_texel_mix(mixed)}_sg{tm}x{tn}", _with_mixed(spec, mixed))
        groups = ((N + _MM_SG * tn - 1) // (_MM_SG * tn), (M + tm * spec[0] - 1) // (tm * spec[0]), nb)
    elif tile is not None:
        kernel = coopmat.KERNEL
        modes = coopmat.load_modes(M, N, K, (oa, ob), (strides[0], strides[1], *ca), (strides[2], strides[3], *cb))
        spec = tile.spec(int(bias is not None), ct, cld, epi[1] if epi else 0, int(bsum is not None), *modes, mixed)
        pid = rt.pipeline(kernel, a_dtype.tag, spec, coopmat.required_subgroup(rt, tile.subgroup))
        groups = tile.grid(M, N, nb)
    else:
        spec = _MM_GPU_SPEC + ct_spec + ((0,) + epi_spec if epi else ())
        if bsum is not None:  # BSUM at constant id 10 (8 unused, 9 matmul_epi's EPI)
            spec = spec + (0, 0, 1)
        pid = rt.pipeline(kernel, a_dtype.tag, _with_mixed(spec, mixed))
        groups = ((N + _MM_GPU_SPEC[1] - 1) // _MM_GPU_SPEC[1], (M + _MM_GPU_SPEC[0] - 1) // _MM_GPU_SPEC[0], nb)
    words = (M, N, K, cshape[1], oa, ob, oc, oz, ca[0], ca[1], *strides[:2], cb[0], cb[1], *strides[2:])
    if kernel == coopmat.KERNEL:  # bias, CT and CLD are its constants
        bufs, push = [ba, bb, bc, bz, be, bu], _P_MATMUL_COOP.pack(*words, oe, ou)
    elif epi is not None:
        bufs, push = [ba, bb, bc, bz, be, bu], _P_MATMUL_EPI.pack(*words, oe, ou, cld, int(bias is not None))
    else:
        bufs, push = [ba, bb, bc, bz], _P_MATMUL.pack(*words, cld, int(bias is not None))
    rt.dispatch(pid, bufs, push, groups, *_name_and_cost(rt, a, b, out, epi, bsum, mixed, mnk))


def _name_and_cost(rt, a: Tensor, b: Tensor, out: Tensor, epi: tuple | None, bsum: Tensor | None,
                   mixed: tuple | None, mnk: tuple) -> tuple:
    """(the trace's name, FLOPs, bytes moved) of a matmul.glsl dispatch: a fused epilogue, a bias
    gradient or the casts of float32 slots are named (fused_kernels.dispatch_name) and counted."""
    M, N, K, nb = mnk
    flops = 2 * nb * M * N * K
    nbytes = nb * (M * K * a.dtype.itemsize + K * N * b.dtype.itemsize + M * N * out.dtype.itemsize)
    name = "matmul+bias_grad" if bsum is not None else "matmul" if epi is None else epi[0]
    if bsum is not None:
        flops, nbytes = flops + K * N, nbytes + N * out.dtype.itemsize
    elif epi is not None:
        nbytes += nb * M * N * sum(t.dtype.itemsize for t in epi[2:] if t is not None)
    if mixed:  # the casts it does are named in the trace
        name = fused_kernels.dispatch_name("cast+" + name, rt)
    elif name != "matmul":
        name = fused_kernels.dispatch_name(name, rt)
    return name, flops, nbytes


def _empty_sum(out: Tensor, bias: Tensor | None, strided: bool) -> Tensor:
    """``out`` of a product with K = 0: zeros, plus the bias where there is one."""
    if strided:
        kern.copy_into(out, scalar_zero(out.dtype, out._st.rt))
    else:
        kern.fill(out, 0)
    if bias is not None:
        kern.copy_into(out, kern.binary("add", out, bias))
    return out


def _bind_c_and_bias(out: Tensor, bias: Tensor | None, bsum: Tensor | None, ct: int, cld: int,
                     a_binding: tuple) -> tuple:
    """((binding, element offset) of C, (binding, offset) of binding 3) for matmul's kernels.

    C: the span a strided (CLD) C covers, or the transposed view's contiguous tensor (CT).
    Binding 3: the bias; else the column sums (``bsum``: BSUM stores through it); else A again
    (read-only, never read: has_bias 0)."""
    if cld:
        span = 1 + sum((sz - 1) * st for sz, st in zip(out.shape, out._strides))
        c = bind(Tensor(out._st, (span,), (1,), out._off, out.dtype), True)
    else:
        c = bind(_swap_last(out) if ct else out, True)
    if bias is not None:
        z = bind(bias)
    elif bsum is not None:
        z = bind(bsum, True)
    else:
        z = (a_binding[0], 0)
    return c, z


# -- autocast's casts in the product (matmul(..., compute=)) ------------------------------------
def _mixed_slots(compute: dt.DType | None, a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor | None,
                 epi: tuple | None) -> tuple | None:
    """The mixed-storage flags (AF32, BF32, CF32, BIASF32, EF32) of a product in ``compute`` whose
    float32 slots get them; None when every slot is ``compute`` (a plain product) or ``compute`` is
    None.  A ValueError for a slot of a third dtype, or linear+residual's float32 e without a
    float32 out (the sum would be rounded twice)."""
    if compute is None:
        return None
    if compute not in (dt.bfloat16, dt.float16):
        raise ValueError(f"matmul: compute must be bfloat16 or float16, got {compute.name}")
    e = epi[2] if epi is not None else None
    slots = (a, b, out, bias, e)
    for name, t in zip(("a", "b", "out", "bias", "e"), slots):
        if t is not None and t.dtype not in (compute, dt.float32):
            raise ValueError(f"matmul: {name} must be {compute.name} or float32 in a {compute.name} product, "
                             f"got {t.dtype.name}")
    flags = tuple(int(t is not None and t.dtype is dt.float32) for t in slots)
    if not any(flags):
        return None
    if flags[4] and (epi[1] != 1 or not flags[2]):
        raise ValueError("matmul: a float32 e is linear+residual's, with a float32 out")
    return flags


def casts_operands_first(rt, compute: dt.DType, a32: bool, b32: bool) -> bool:
    """Whether matmul(a, b, compute=) on ``rt``, A and / or B float32 as flagged, casts them to
    ``compute`` with kernels of their own before the product (its kernel reads ``compute`` only:
    a matrix engine, float16 on the CPU-driver kernel), rather than rounding them as it loads
    them.  Where it does, a caller that uses an operand in several products casts it once itself."""
    return (a32 or b32) and not _mixed_in_kernel(rt, compute, (int(a32), int(b32), 0, 0, 0))


def _mixed_in_kernel(rt, compute: dt.DType, mixed: tuple) -> bool:
    """Whether the 16-bit kernel matmul() dispatches for this product takes its float32 slots
    ``mixed`` (the shared-memory and cooperative-matrix kernels do; the CPU-driver kernel has
    variants for a float32 A or B in bfloat16 only (matmul.variants); a matrix engine takes none)."""
    if _cpu_mm_kernel(rt):
        return compute is dt.bfloat16 or not (mixed[0] or mixed[1])
    return not rt.has_gemm(compute.name)


def _texel_mix(mixed: tuple | None) -> str:
    """The CPU kernel's variant suffix for a float32 A and / or B ("a32", "b32", "ab32"; "" for
    none): a variant declares how it reads each operand (an rgba32f view for float32, rgba32ui
    for 16-bit)."""
    return "" if mixed is None else ("", "a32", "b32", "ab32")[mixed[0] + 2 * mixed[1]]


def _with_mixed(spec: tuple, mixed: tuple | None) -> tuple:
    """The kernel's constants with the mixed-storage flags at ids 12-16 (the ids between left at
    their defaults, 0); ``spec`` unchanged for a plain product."""
    if mixed is None:
        return spec
    return spec + (0,) * (12 - len(spec)) + mixed


def _matmul_with_casts(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor | None, epi: tuple | None,
                       compute: dt.DType) -> Tensor:
    """matmul(..., compute=) as separate kernels where the product's kernel takes no float32
    slots: each float32 operand cast to ``compute``, the product, then the result cast into a
    float32 ``out`` (linear+residual: the rounded product cast to float32 and added to e).  On a
    matrix engine the product itself stores the rounded result widened into ``out`` (matmul's
    ``widen``), and linear+residual's e is added to it, in the engine's epilogue where it can
    (_on_matrix_engine), else in place."""
    def low(t):
        return t if t is None or t.dtype is compute else kern.copy(t, compute)

    a, b, bias = low(a), low(b), low(bias)
    e = epi[2] if epi is not None else None
    residual32 = epi is not None and epi[1] == 1 and e.dtype is dt.float32
    if epi is not None and not residual32:
        epi = (epi[0], epi[1], low(e), epi[3])
    if out is None or out.dtype is compute:  # (a float32 e has a float32 out: _mixed_slots)
        return matmul(a, b, bias, out, epi)
    if a.shape[-1] and a._st.rt.has_gemm(compute.name) and (epi is None or (residual32 and out.is_contiguous())):
        # the matrix engine stores the rounded product widened into out (matmul's ``widen``) and
        # adds the residual to it, in its epilogue where it can, else in place (the same float32 sum)
        matmul(a, b, bias, out, compute=compute, _residual=e if residual32 else None)
        return out
    y = matmul(a, b, bias, None, None if residual32 else epi)
    if residual32:
        kern.copy_into(out, kern.binary("add", e, kern.copy(y, dt.float32)))
    else:
        kern.copy_into(out, y)
    return out


# Input dtypes a device's matrix engine (Runtime.gemm: tensor cores on cuda:N) may take.
_ENGINE_DTYPES = (dt.bfloat16, dt.float16)
# _mixed_slots' flags of a 16-bit product whose only float32 slot is its output.
_OUT_F32 = (0, 0, 1, 0, 0)


def _on_matrix_engine(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor, widen: bool = False,
                      residual: Tensor | None = None) -> bool:
    """out = a @ b (+ bias) on the device's matrix engine (``rt.gemm``), every product of the batch
    in one call: a [..., M, K] and b [..., K, N] of any strides, whose batch dims broadcast to
    those of out [*batch, M, N] (2-D for one product); False, with nothing recorded, where the
    engine cannot take them.  ``widen``: out is float32 and gets each result rounded to a's
    dtype and widened (the engine's ``round_out``), the product and its cast in one launch.

    The engine reads each matrix of A and B row-major or transposed and writes C row-major, with
    rows, offsets and batch strides on the 16-byte grid (TMA's rules; a batch stride of 0
    broadcasts an operand).  An operand in another layout (rows whose length or pitch is off
    that grid, neither dim contiguous) is first copied into rows padded to it.  A bfloat16
    product is stored straight into ``out`` (or, without bias, into its transpose, as out^T =
    b^T a^T, for a transposed ``out``), the bias added in the kernel's epilogue before the one
    rounding; otherwise (float16, whose output the kernel does not write, or an ``out`` it
    cannot write) C is a float32 buffer, bias included, and ``out`` gets it rounded once.

    ``residual`` (with ``widen``: a float32 tensor of out's shape, contiguous) is added to out:
    in the kernel's epilogue, after the rounding, where C is out itself and one product (the
    engine's ``residual``), else by an add in place after it (the same float32 sums)."""
    rt = a._st.rt
    batch, (M, N), K = out.shape[:-2], out.shape[-2:], a.shape[-1]
    isz = a.dtype.itemsize
    if bias is not None and (N % 2 or (bias._off * isz) % 4):  # the epilogue loads the bias in pairs, as words
        return False
    target, swapped = None, False
    if a.dtype is dt.bfloat16 or widen:
        if _engine_rows(out) is not None:
            target = out
        elif bias is None and _engine_rows(_swap_last(out)) is not None:
            target, swapped = _swap_last(out), True
    if target is None:
        target = _engine_buffer(out.shape, dt.float32, rt)
    if swapped:  # out^T = b^T @ a^T
        a, b = _swap_last(b), _swap_last(a)
        M, N = N, M
    ra, a_major = _engine_operand(a, "k", "m")
    if ra is None:
        a = _engine_copy(a)
        ra, a_major = _engine_rows(a), "k"
    rb, b_major = _engine_operand(b, "n", "k")
    if rb is None:
        b = _engine_copy(b)
        rb, b_major = _engine_rows(b), "n"
    rc = _engine_rows(target)
    # the batch dims, merged where all three operands allow: (extent, A's, B's and C's strides)
    shape, strides = collapse(batch, broadcast_strides(a.shape[:-2], a._strides[:-2], batch),
                              broadcast_strides(b.shape[:-2], b._strides[:-2], batch), target._strides[:-2])
    vec = None if bias is None else (bias._st.handle, bias._off * isz)
    res = None
    if residual is not None and target is out and not swapped and len(shape) == 0 and residual.is_contiguous():
        res = (residual._st.handle, residual._off * residual.dtype.itemsize, residual._strides[-2] if M > 1 else N)
    args = ((a._st.handle, ra[0] * isz, ra[1], a_major), (b._st.handle, rb[0] * isz, rb[1], b_major),
            (target._st.handle, rc[0] * target.dtype.itemsize, rc[1]), M, N, K, a.dtype.name,
            target.dtype.name, vec, tuple(zip(shape, *strides)), widen)
    if res is not None and not rt.gemm(*args, res):
        res = None  # the engine declined the residual's add: the product alone, then the add
    if res is None and not rt.gemm(*args):
        return False
    if target is not out and not swapped:
        kern.copy_into(out, target)
    if residual is not None and res is None:
        kern.binary_("add", out, residual)
    return True


def _engine_operand(x: Tensor, rows_major: str, cols_major: str) -> tuple:
    """((element offset, row pitch), major) for operand ``x`` [..., R, C] as the engine reads each of its
    matrices: their rows (``rows_major``) where they are contiguous, else their transposes'
    (``cols_major``: a transposed view of row-major matrices); (None, None) where neither is readable."""
    if x.shape[-1] == 1 or x._strides[-1] == 1:
        return _engine_rows(x), rows_major
    return _engine_rows(_swap_last(x)), cols_major


def _engine_rows(x: Tensor) -> tuple | None:
    """(element offset, row pitch) of ``x`` [..., R, C] whose matrices are stored as rows with unit inner
    stride, the pitch at least a row, the offset, pitch and batch strides (of dims longer than 1)
    16-byte aligned; None otherwise (the engine cannot read it as it is)."""
    rows, cols = x.shape[-2:]
    if cols > 1 and x._strides[-1] != 1:
        return None
    isz = x.dtype.itemsize
    # a single row's pitch is never stepped over: any value on the 16-byte grid will do
    pitch = x._strides[-2] if rows > 1 else -(-cols * isz // 16) * 16 // isz
    if pitch < cols or (pitch * isz) % 16 or (x._off * isz) % 16:
        return None
    if any((st * isz) % 16 for n, st in zip(x.shape[:-2], x._strides[:-2]) if n > 1):
        return None
    return x._off, pitch


def _engine_buffer(shape: tuple, dtype: dt.DType, rt) -> Tensor:
    """A new tensor of ``shape`` [..., R, C] whose rows are padded to whole 16-byte units, so the engine
    can read or write it whatever C is; the padding is never touched (the tensor maps end at C)."""
    unit = 16 // dtype.itemsize
    pitch = -(-shape[-1] // unit) * unit
    buf = empty(tuple(shape[:-1]) + (pitch,), dtype, rt)
    return Tensor(buf._st, tuple(shape), buf._strides, buf._off, dtype)


def _engine_copy(x: Tensor) -> Tensor:
    """``x`` [..., R, C] copied into an :func:`_engine_buffer` (its own batch dims: a broadcast stays one
    copy)."""
    y = _engine_buffer(x.shape, x.dtype, x._st.rt)
    kern.copy_into(y, x)
    return y


def _check_epi(epi: tuple, out: Tensor, shape: tuple, strided: bool, dtype: dt.DType) -> None:
    """A ShapeError unless the fused epilogue's C and its E / U are contiguous [.., M, N], U of the
    product's ``dtype`` and E of out's (either, in a product with float32 slots)."""
    name, _, e, u = epi
    if strided:
        raise ShapeError(f"{name}: out must be contiguous")
    for what, t, want in (("e", e, (out.dtype, dtype)), ("u", u, (dtype,))):
        if t is not None and (t.shape != shape or t.dtype not in want or not t.is_contiguous()):
            raise ShapeError(f"{name}: {what} must be a contiguous {want[0].name} tensor of shape {shape}, "
                             f"got {t.dtype.name} {t.shape} with strides {t._strides}")


def _check_mm_out(out: Tensor, shape: tuple, dtype: dt.DType) -> tuple:
    """(CT, CLD) of the matmul kernel's store for ``out``: (0, 0) contiguous, (1, 0) the
    transposed view of a contiguous tensor, (0, L) / (1, L) heads interleaved in rows of L
    elements ([B, H, M, N] with strides (M*L, N, L, 1), or (N*L, M, 1, L) transposed: head h
    of a [B, M, H*N] buffer's rows).  A ShapeError naming ``out`` otherwise."""
    if out.shape != shape or out.dtype is not dtype:
        raise ShapeError(f"matmul: out must be a {dtype.name} tensor of shape {shape}, got {out.dtype.name} {out.shape}")
    if out.is_contiguous():
        return 0, 0
    if _swap_last(out).is_contiguous():
        return 1, 0
    if len(shape) in (3, 4):
        M, N = shape[-2:]
        st = ((0,) * (4 - len(shape))) + tuple(out._strides)
        if st[3] == 1 and st[2] >= N and st[1] == N and (shape[0] == 1 or len(shape) == 3 or st[0] == M * st[2]):
            return 0, st[2]
        if st[2] == 1 and st[3] >= M and st[1] == M and (shape[0] == 1 or len(shape) == 3 or st[0] == N * st[3]):
            return 1, st[3]
    raise ShapeError(f"matmul: out must be contiguous, a transposed contiguous tensor or heads interleaved in rows, "
                     f"got shape {shape} with strides {out._strides}")


def scalar_zero(dtype: dt.DType, rt) -> Tensor:
    """A one-element zero of ``dtype`` on ``rt`` (a copy source that broadcasts)."""
    return kern._scalar_host(0, dtype, rt)
