"""Raw device ops: each function records one or a few dispatches and returns new tensors.

No autograd here (helios.functional builds the differentiable ops on top).  Outputs
are fresh contiguous tensors; inputs may be any strided view: shapes and strides
travel as push constants, dims are collapsed first so most ops index 1-3 dims.
"""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import ew_fusion, fusion, graph
from helios import runtime as _runtime
from helios._shape import broadcast_strides, collapse, contiguous_strides, numel
from helios.errors import DTypeError, ShapeError
from helios.kernels_spirv import ew_ops
from helios.runtime import _debug_operand, get_runtime
from helios.tensor import Storage, Tensor

MAX_DIMS = 6  # elementwise kernels; copy takes 8
WG = 256

# Elementwise op codes, from the op table (kernels_spirv/ew_ops.py: it generates the GLSL switch too).
UNARY = ew_ops.codes("unary")
BINARY = ew_ops.codes("binary")
COMPARE = ew_ops.codes("compare")
INT_UNARY = frozenset(name for name, op in ew_ops.by_name("unary").items() if op.int_glsl)  # the rest: floats only
REDUCE = {"sum": 0, "max": 1, "min": 2, "argmax": 3, "argmin": 4, "sumsq": 5}  # sumsq: sum of squares (floats)

_P_UNARY = struct.Struct("<4I2f2I6i6i")
_P_BINARY = struct.Struct("<5If2I6i6i6i")
_P_WHERE = struct.Struct("<6I6i6i6i6i")
_P_COPY = struct.Struct("<4I8i8i8i")
_P_REDUCE = struct.Struct("<9If2I")
_P_ROWS = struct.Struct("<4I")
_P_SOFTMAX = struct.Struct("<4IfI")
_P_LN = struct.Struct("<4If2I")
_P_EMB = struct.Struct("<5I")
_P_RNG = struct.Struct("<5I2f2I")
_P_IOTA = struct.Struct("<I2fIqq")
_P_MATMUL = struct.Struct("<16I")
_P_MATMUL_EPI = struct.Struct("<18I")  # matmul's words, then the offsets of E and U

_PAD6 = (0,) * 6
_ZERO14 = (0,) * 14  # the unused tail of a contiguous ew_unary push block


def empty(shape: tuple, dtype: dt.DType, rt=None, pool: str = "activations") -> Tensor:
    """A new contiguous tensor with uninitialised contents."""
    rt = rt or get_runtime()
    _check_dtype_supported(rt, dtype)
    n = numel(shape)
    return Tensor(Storage(rt, n * dtype.itemsize, pool), tuple(shape), contiguous_strides(shape), 0, dtype)


def _check_dtype_supported(rt, dtype: dt.DType) -> None:
    f = rt.features
    if dtype.itemsize == 2 and not f.get("storage16", False):
        raise DTypeError(f"{dtype.name} needs 16-bit storage buffers, which {rt.name} ({rt.info['name']}) lacks; use float32")
    if dtype.itemsize == 1 and not f.get("storage8", False):
        raise DTypeError(f"bool needs 8-bit storage buffers, which {rt.name} ({rt.info['name']}) lacks")
    if dtype is dt.int64 and not f.get("int64", False):
        raise DTypeError(f"int64 needs shaderInt64, which {rt.name} ({rt.info['name']}) lacks; use int32")


def grid(n: int) -> tuple:
    """Workgroup counts covering ``n`` invocations at WG per group (x is capped at 65535)."""
    g = (n + WG - 1) // WG
    if g <= 65535:
        return (g, 1, 1)
    return (65535, (g + 65534) // 65535, 1)


def groups_for(count: int) -> tuple:
    """Workgroup counts for ``count`` workgroups (one per row, say), 2-D past 65535."""
    if count <= 65535:
        return (count, 1, 1)
    return (65535, (count + 65534) // 65535, 1)


# An op on part of a storage larger than this binds only that part: the hazard tracker then
# sees which bytes the dispatch touches (a parameter's gradient slot in a flat buffer does
# not make the whole buffer look busy to a collective waiting on another part of it).
_WINDOW_ABOVE = 64 * 1024


def _is_part(t: Tensor) -> bool:
    """Whether ``t`` covers less than its whole storage."""
    return t._off != 0 or t.numel() * t.dtype.itemsize < t._st.nbytes


def bind(t: Tensor, writes: bool = False, span: int | None = None):
    """(binding tuple, element offset inside the bound range) for tensor ``t``.

    Small storages are bound whole, except when ``t`` is part of one above 64 KiB.  A
    storage above the device's maxStorageBufferRange (128 MiB on lavapipe), and such a
    part, is bound as an aligned window around the elements the op touches: ``span``
    elements from the tensor's offset (default: its extent).
    """
    st = t._st
    rt = st.rt
    if st.nbytes <= rt.max_range and not (st.nbytes > _WINDOW_ABOVE and _is_part(t)):
        return (st.handle, 0, max(st.nbytes, 4), writes), t._off
    isz = t.dtype.itemsize
    if span is None:
        span = 1 + sum((s - 1) * abs(x) for s, x in zip(t.shape, t._strides)) if t.numel() else 1
    lo = t._off * isz
    hi = (t._off + span) * isz
    start = lo - lo % rt.align
    size = (hi - start + 3) & ~3
    if size > rt.max_range:
        raise ShapeError(f"an op touches {hi - lo} bytes of one tensor at once, more than the device's "
                         f"maxStorageBufferRange ({rt.max_range}); split the tensor (e.g. with chunk()) first")
    return (st.handle, start, min(size, st.nbytes - start), writes), t._off - start // isz


def _tag(t: Tensor) -> str:
    return t.dtype.tag


def _pad(seq, n=6) -> tuple:
    return tuple(seq) + (0,) * (n - len(seq))


def _elems_per_dispatch(t: Tensor) -> int:
    """How many contiguous elements of ``t`` one dispatch may touch (window limit)."""
    return max(1, (t._st.rt.max_range - t._st.rt.align) // t.dtype.itemsize)


# -- elementwise -----------------------------------------------------------------------------
def unary(op: str, x: Tensor, p0: float = 0.0, p1: float = 0.0, out_dtype: dt.DType | None = None) -> Tensor:
    """out = op(x) elementwise (``p0``/``p1`` are scalar parameters of add_s, clamp...)."""
    if x.dtype.kind != "float" and op not in INT_UNARY:
        x = copy(x, dt.float32)
    if x.dtype is dt.bool_:
        x = copy(x, dt.int64)
    out = empty(x.shape, out_dtype or x.dtype, x._st.rt)
    n = out.numel()
    if n == 0:
        return out
    rt = x._st.rt
    code = UNARY[op]
    if x.is_contiguous():
        mr = rt.max_range
        # Storages within one binding range are bound whole: one dispatch, no window math.
        step = n if x._st.nbytes <= mr and out._st.nbytes <= mr else min(_elems_per_dispatch(x), _elems_per_dispatch(out))
        pid = rt.pipeline("ew_unary", x.dtype.tag, (code, 1))
        for s in range(0, n, step):
            m = min(step, n - s)
            # The first window starts at the tensor itself: no view object on the hot path.
            bx, ox = bind(x if s == 0 else _flat_window(x, s), span=m)
            bo, oo = bind(out if s == 0 else _flat_window(out, s), True, span=m)
            # vec4 path (see ew_unary.comp): 4 aligned elements an invocation
            vec = 4 if (x.dtype is dt.float32 and out.dtype is dt.float32 and m % 4 == 0 and ox % 4 == 0
                        and oo % 4 == 0) else 1
            args = (pid if vec == 1 else rt.pipeline("ew_unary", "f32", (code, 1, 4)), [bx, bo],
                    _P_UNARY.pack(m, 1, ox, oo, p0, p1, *_ZERO14), grid(m // vec), op, m, 2 * m * x.dtype.itemsize)
            q = rt.ew_queue
            if (q is not None and m == n and fusion.ENABLED and ew_fusion.ENABLED and out.dtype is x.dtype
                    and ew_fusion.fusible("unary", op, x.dtype.tag)):
                # held back to be fused with the elementwise ops around it (helios.ew_fusion)
                q.add(ew_fusion.EwOp("unary", op, x.dtype.tag, m, ((bx, ox),), (bo, oo), (p0, p1), args,
                                     _debug_operand[0], _runtime._op_dispatches))
            else:
                rt.dispatch(*args)
        return out
    shape, _ = collapse(x.shape, x._strides)
    if len(shape) > MAX_DIMS:
        return unary(op, copy(x), p0, p1, out_dtype)
    _unary_into(op, code, x, out, p0, p1)
    return out


def _unary_into(op: str, code: int, x: Tensor, out: Tensor, p0: float, p1: float) -> None:
    """Record out = op(x) for a strided ``x`` and a contiguous ``out`` of its shape, in halves
    while either spans more than one binding window."""
    if _too_wide(x) or _too_wide(out):
        lo, hi = _split_outer(x.shape, x, out)
        _unary_into(op, code, *lo, p0, p1)
        _unary_into(op, code, *hi, p0, p1)
        return
    rt = x._st.rt
    n = out.numel()
    shape, (sa,) = collapse(x.shape, x._strides)
    bx, ox = bind(x)
    bo, oo = bind(out, True)
    pid = rt.pipeline("ew_unary", x.dtype.tag, (code, 0))
    rt.dispatch(pid, [bx, bo], _P_UNARY.pack(n, len(shape), ox, oo, p0, p1, 0, 0, *_pad(shape), *_pad(sa)),
                grid(n), op, n, 2 * n * x.dtype.itemsize)


def _too_wide(t: Tensor) -> bool:
    """Whether the elements ``t`` spans do not fit one binding window (maxStorageBufferRange)."""
    rt = t._st.rt
    if t._st.nbytes <= rt.max_range:
        return False
    span = 1 + sum((s - 1) * abs(x) for s, x in zip(t.shape, t._strides)) if t.numel() else 1
    return span * t.dtype.itemsize + rt.align > rt.max_range


def _split_outer(shape: tuple, *views: Tensor) -> tuple[list, list]:
    """Halve the outermost dim of size > 1 of ``shape`` in each view (each of that shape).

    Splitting the outermost dim keeps parts of a contiguous tensor contiguous, and every
    halving shrinks each part's span, so recursion ends with parts that fit a window."""
    d = next(i for i, s in enumerate(shape) if s > 1)
    h = shape[d] // 2

    def part(t: Tensor, start: int, length: int) -> Tensor:
        return Tensor(t._st, t.shape[:d] + (length,) + t.shape[d + 1:], t._strides, t._off + start * t._strides[d], t.dtype)

    return [part(v, 0, h) for v in views], [part(v, h, shape[d] - h) for v in views]


def _flat_window(t: Tensor, start: int) -> Tensor:
    """The contiguous tensor ``t`` seen as 1-D from element ``start`` (no copy)."""
    return Tensor(t._st, (t.numel() - start,), (1,), t._off + start, t.dtype)


def binary(op: str, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """out = op(a, b) elementwise with broadcasting; a and b must share a dtype."""
    compare = op in COMPARE
    if a.dtype is not b.dtype:
        raise DTypeError(f"{op}: dtypes {a.dtype.name} and {b.dtype.name} differ (promote first)")
    shape = a.shape if a.shape == b.shape else _broadcast(op, a.shape, b.shape)
    out_dtype = dt.bool_ if compare else a.dtype
    rt = a._st.rt
    out = empty(shape, out_dtype, rt)
    n = out.numel()
    if n == 0:
        return out
    code = COMPARE[op] if compare else BINARY[op]
    variant = a.dtype.tag + ("_cmp" if compare else "")
    nbytes = n * (2 * a.dtype.itemsize + out_dtype.itemsize)
    if a.shape == b.shape and a.is_contiguous() and b.is_contiguous():
        pid = rt.pipeline("ew_binary", variant, (code, 1))
        mr = rt.max_range
        if a._st.nbytes <= mr and b._st.nbytes <= mr and out._st.nbytes <= mr:
            step = n  # every storage is bound whole: one dispatch
        else:
            step = min(_elems_per_dispatch(a), _elems_per_dispatch(b), _elems_per_dispatch(out))
        for s in range(0, n, step):
            m = min(step, n - s)
            ba, oa = bind(a if s == 0 else _flat_window(a, s), span=m)
            bb, ob = bind(b if s == 0 else _flat_window(b, s), span=m)
            bo, oo = bind(out if s == 0 else _flat_window(out, s), True, span=m)
            # vec4 path (see ew_binary.comp): 4 aligned elements an invocation
            vec = 4 if (a.dtype is dt.float32 and not compare and m % 4 == 0 and oa % 4 == 0 and ob % 4 == 0
                        and oo % 4 == 0) else 1
            args = (pid if vec == 1 else rt.pipeline("ew_binary", variant, (code, 1, 4)), [ba, bb, bo],
                    _P_BINARY.pack(m, 1, oa, ob, oo, alpha, 0, 0, *_PAD6, *_PAD6, *_PAD6),
                    grid(m // vec), op, m, nbytes)
            q = rt.ew_queue
            if (q is not None and m == n and fusion.ENABLED and ew_fusion.ENABLED
                    and ew_fusion.fusible("binary", op, variant)):
                # held back to be fused with the elementwise ops around it (helios.ew_fusion)
                q.add(ew_fusion.EwOp("binary", op, variant, m, ((ba, oa), (bb, ob)), (bo, oo), (alpha,), args,
                                     _debug_operand[0], _runtime._op_dispatches))
            else:
                rt.dispatch(*args)
        return out
    sa = broadcast_strides(a.shape, a._strides, shape)
    sb = broadcast_strides(b.shape, b._strides, shape)
    cshape, _ = collapse(shape, sa, sb)
    if len(cshape) > MAX_DIMS:
        return binary(op, copy(a.expand(shape)), copy(b.expand(shape)), alpha)
    ae = Tensor(a._st, shape, sa, a._off, a.dtype)
    be = Tensor(b._st, shape, sb, b._off, b.dtype)
    pid = rt.pipeline("ew_binary", variant, (code, 0))
    q = rt.ew_queue
    if (q is not None and fusion.ENABLED and ew_fusion.ENABLED and ew_fusion.fusible("binary", op, variant)
            and not (_too_wide(ae) or _too_wide(be) or _too_wide(out))):
        # one operand with the output's shape, contiguous, the other a single element seen
        # everywhere (a 0-d tensor): fusible too, the single element loaded once per element
        bcast = (not any(sa), not any(sb))
        full = b if bcast[0] else a
        if bcast in ((False, True), (True, False)) and full.shape == shape and full.is_contiguous():
            args, ins, o = _binary_args(op, pid, ae, be, out, alpha)
            q.add(ew_fusion.EwOp("binary", op, variant, n, ins, o, (alpha,), args, _debug_operand[0],
                                 _runtime._op_dispatches, bcast))
            return out
    _binary_into(op, pid, ae, be, out, alpha)
    return out


def binary_(op: str, a: Tensor, b: Tensor) -> Tensor:
    """a = op(a, b) in place, ``b`` broadcast to a's shape; ``a`` contiguous.  Each element
    is read and written by the same invocation, so the aliasing is safe; it saves the
    temporary and the copy back of ``a.copy_(op(a, b))``."""
    if not a.is_contiguous():
        raise ShapeError(f"{op}_: the in-place target must be contiguous, got strides {a._strides} for shape {a.shape}")
    if a.dtype is not b.dtype:
        raise DTypeError(f"{op}_: dtypes {a.dtype.name} and {b.dtype.name} differ (promote first)")
    if a.numel():
        be = Tensor(b._st, a.shape, broadcast_strides(b.shape, b._strides, a.shape), b._off, b.dtype)
        _binary_into(op, a._st.rt.pipeline("ew_binary", a.dtype.tag, (BINARY[op], 0)), a, be, a, 1.0)
        a._st.version += 1
    return a


def _binary_into(op: str, pid: int, a: Tensor, b: Tensor, out: Tensor, alpha: float) -> None:
    """Record out = op(a, b) for strided a, b and a contiguous out, all of one shape, in
    halves while any spans more than one binding window."""
    if _too_wide(a) or _too_wide(b) or _too_wide(out):
        lo, hi = _split_outer(out.shape, a, b, out)
        _binary_into(op, pid, *lo, alpha)
        _binary_into(op, pid, *hi, alpha)
        return
    out._st.rt.dispatch(*_binary_args(op, pid, a, b, out, alpha)[0])


def _binary_args(op: str, pid: int, a: Tensor, b: Tensor, out: Tensor, alpha: float) -> tuple:
    """(dispatch arguments, ((binding, offset) of a, of b), (binding, offset) of out) of
    out = op(a, b) for strided a, b and a contiguous out of one shape, each within a window."""
    n = out.numel()
    cshape, (ca, cb) = collapse(out.shape, a._strides, b._strides)
    ba, oa = bind(a)
    bb, ob = bind(b)
    bo, oo = bind(out, True)
    nbytes = n * (a.dtype.itemsize + b.dtype.itemsize + out.dtype.itemsize)
    args = (pid, [ba, bb, bo], _P_BINARY.pack(n, len(cshape), oa, ob, oo, alpha, 0, 0, *_pad(cshape), *_pad(ca),
                                             *_pad(cb)), grid(n), op, n, nbytes)
    return args, ((ba, oa), (bb, ob)), (bo, oo)


def _broadcast(op, s1, s2):
    from helios._shape import broadcast_shapes

    return broadcast_shapes(op, s1, s2)


def where(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """out = cond ? a : b with broadcasting (a and b share a dtype; cond is bool)."""
    from helios._shape import broadcast_shapes

    shape = broadcast_shapes("where", cond.shape, a.shape, b.shape)
    rt = a._st.rt
    out = empty(shape, a.dtype, rt)
    n = out.numel()
    if n == 0:
        return out
    strides = [broadcast_strides(t.shape, t._strides, shape) for t in (cond, a, b)]
    cshape, (sc, sa, sb) = collapse(shape, *strides)
    if len(cshape) > MAX_DIMS:
        return where(copy(cond.expand(shape)), copy(a.expand(shape)), copy(b.expand(shape)))
    (bc, oc), (ba, oa), (bb, ob), (bo, oo) = bind(cond), bind(a), bind(b), bind(out, True)
    pid = rt.pipeline("ew_where", a.dtype.tag)
    rt.dispatch(pid, [bc, ba, bb, bo], _P_WHERE.pack(n, len(cshape), oc, oa, ob, oo, *_pad(cshape), *_pad(sc), *_pad(sa), *_pad(sb)),
                grid(n), "where", 0, n * (3 * a.dtype.itemsize + 1))
    return out


def copy(x: Tensor, dtype: dt.DType | None = None) -> Tensor:
    """A contiguous copy of ``x``, converted to ``dtype`` if given."""
    out = empty(x.shape, dtype or x.dtype, x._st.rt)
    copy_into(out, x)
    return out


def copy_into(dst: Tensor, src: Tensor) -> None:
    """dst[...] = src (src broadcast to dst's shape; any strides on both sides)."""
    n = dst.numel()
    if n == 0:
        return
    rt = dst._st.rt
    if rt.is_host or src._st.rt is not rt:  # cpu tensors, or two devices: through the host
        from helios._transfer import copy_across

        return copy_across(dst, src)
    ss = broadcast_strides(src.shape, src._strides, dst.shape)
    cshape, (cs, cd) = collapse(dst.shape, ss, dst._strides)
    if len(cshape) > 8:
        raise ShapeError(f"copy: a {len(cshape)}-dim strided copy (after merging dims) exceeds the kernel's 8 dims; "
                         f"shape {dst.shape}")
    pid = rt.pipeline("copy", f"{src.dtype.tag}_{dst.dtype.tag}")
    if not cshape:  # a single element
        cshape, cs, cd = [1], [0], [0]
    if len(cshape) == 1 and cs[0] == 1 and cd[0] == 1 and (src._st.nbytes > rt.max_range or dst._st.nbytes > rt.max_range):
        step = min(_elems_per_dispatch(src), _elems_per_dispatch(dst))
        for s in range(0, n, step):
            m = min(step, n - s)
            bs, os_ = bind(Tensor(src._st, (m,), (1,), src._off + s, src.dtype), span=m)
            bd, od = bind(Tensor(dst._st, (m,), (1,), dst._off + s, dst.dtype), True, span=m)
            rt.dispatch(pid, [bs, bd], _P_COPY.pack(m, 1, os_, od, m, *(0,) * 7, 1, *(0,) * 7, 1, *(0,) * 7),
                        grid(m), "copy", 0, m * (src.dtype.itemsize + dst.dtype.itemsize))
        dst._st.version += 1
        return
    if src._st.nbytes > rt.max_range or dst._st.nbytes > rt.max_range:
        se = Tensor(src._st, dst.shape, ss, src._off, src.dtype)
        if _too_wide(se) or _too_wide(dst):  # strided and wider than a window: copy in halves
            for d_part, s_part in _split_outer(dst.shape, dst, se):
                copy_into(d_part, s_part)
            dst._st.version += 1
            return
    bs, os_ = bind(src)
    bd, od = bind(dst, True)
    # vec4 path (see copy.comp): inner runs contiguous on both sides and everything 4-aligned
    vec = 4 if (src.dtype is dt.float32 and dst.dtype is dt.float32 and cs[-1] == 1 and cd[-1] == 1
                and cshape[-1] % 4 == 0 and os_ % 4 == 0 and od % 4 == 0
                and all(x % 4 == 0 for x in cs[:-1] + cd[:-1])) else 1
    if vec == 4:
        pid = rt.pipeline("copy", "f32_f32", (4,))
    rt.dispatch(pid, [bs, bd], _P_COPY.pack(n, len(cshape), os_, od, *_pad(cshape, 8), *_pad(cs, 8), *_pad(cd, 8)),
                grid(n // vec), "copy", 0, n * (src.dtype.itemsize + dst.dtype.itemsize))
    dst._st.version += 1


def fill(t: Tensor, value) -> Tensor:
    """Fill the contiguous tensor ``t`` with ``value`` (recorded, no host wait)."""
    import numpy as np

    n = t.numel()
    if n == 0:
        return t
    if t.dtype is dt.bfloat16:
        bits = int(dt.float32_to_bf16_bits(np.array([value], np.float32))[0])
    else:
        bits = int(np.array([value]).astype(t.dtype.np_storage).view(np.uint8 if t.dtype.itemsize == 1 else
                                                                    {2: np.uint16, 4: np.uint32, 8: np.uint64}[t.dtype.itemsize])[0])
    isz = t.dtype.itemsize
    if isz == 8:
        lo, hi = bits & 0xFFFFFFFF, bits >> 32
        if lo != hi:  # a fill word repeats 4 bytes: 64-bit patterns go through the copy kernel
            src = _scalar_host(value, t.dtype, t._st.rt)
            copy_into(t, src)
            return t
        word = lo
    elif isz == 4:
        word = bits
    elif isz == 2:
        word = bits | (bits << 16)
    else:
        word = bits * 0x01010101
    nbytes = n * isz
    start = t._off * isz
    if start % 4 == 0 and nbytes % 4 == 0:
        t._st.rt.fill(t._st.handle, start, nbytes, word)
    else:
        copy_into(t, _scalar_host(value, t.dtype, t._st.rt))
    t._st.version += 1
    return t


def _scalar_host(value, dtype: dt.DType, rt) -> Tensor:
    import numpy as np

    arr = np.array(value, dtype=np.float32 if dtype is dt.bfloat16 else dtype.np_storage).reshape(())
    return from_numpy(arr, dtype, rt)


def from_numpy(arr, dtype: dt.DType, rt, pool: str = "activations") -> Tensor:
    """Upload a numpy array as a new tensor of ``dtype`` (writes at once; no wait on the device)."""
    import numpy as np

    if dtype is dt.bfloat16:
        host = dt.float32_to_bf16_bits(np.asarray(arr, dtype=np.float32))
    else:
        host = np.array(arr, dtype=dtype.np_storage, order="C", copy=True)  # ascontiguousarray makes 0-d 1-d
    t = empty(host.shape, dtype, rt, pool)
    if host.size:
        rt.write(t._st.handle, 0, host.reshape(-1).view(np.uint8))
    t._host = (t._st.version, host)
    return t


# -- reductions ------------------------------------------------------------------------------
def _value_dtype(x: Tensor) -> dt.DType:
    return dt.float32 if x.dtype.kind == "float" else dt.int64


def reduce(op: str, x: Tensor, dims: tuple, scale: float = 1.0, out: Tensor | None = None):
    """Reduce ``x`` over ``dims`` (sorted, unique).  Returns (values, indices or None) with
    the kept dims in order (no keepdim).  Values are float32 for float inputs (sums of
    16-bit floats accumulate in float32) and int64 for integer/bool inputs; indices int64.
    ``out`` (optional, a contiguous tensor of the values' shape and dtype; not for the arg
    reductions) receives the values, which are then returned as ``out``."""
    rt = x._st.rt
    kept = [d for d in range(x.ndim) if d not in dims]
    out_shape = tuple(x.shape[d] for d in kept)
    R = numel(tuple(x.shape[d] for d in dims))
    vdt = _value_dtype(x)
    arg = op in ("argmax", "argmin")
    n_out = numel(out_shape)
    if out is not None:
        if arg or out.shape != out_shape or out.dtype is not vdt or not out.is_contiguous():
            raise ShapeError(f"reduce: out must be a contiguous {vdt.name} tensor of shape {out_shape} "
                             f"(and op not an arg reduction), got {out.dtype.name} {out.shape}")
        if R == 0 or n_out == 0 or x._st.nbytes > rt.max_range or _too_wide(x):  # rare paths: reduce, then copy
            v, _ = reduce(op, x, dims, scale)
            copy_into(out, v)
            return out, None
    if R == 0 or n_out == 0:
        if R == 0 and op != "sum" and n_out:
            raise ShapeError(f"{op}: cannot reduce over a dimension of size 0 (shape {x.shape}, dims {dims})")
        # an empty sum is 0, scaled like any other (a mean's scale 1/0 = nan gives nan, as PyTorch)
        vals = fill(empty(out_shape, vdt, rt), 0.0 * scale if vdt.kind == "float" else 0)
        return vals, (fill(empty(out_shape, dt.int64, rt), 0) if arg else None)
    if x._st.nbytes > rt.max_range and len(kept) == 0 and x.is_contiguous():
        return _reduce_all_windows(op, x, scale)
    if _too_wide(x):
        return _reduce_wide(op, x, dims, kept, out_shape, scale)
    # Describe the reduced dims as one axis (R, s_k) and the kept dims as <= 2 axes.
    kshape, (kstr,) = collapse(tuple(x.shape[d] for d in kept), tuple(x._strides[d] for d in kept))
    rshape, (rstr,) = collapse(tuple(x.shape[d] for d in dims), tuple(x._strides[d] for d in dims))
    if len(rshape) == 1 and (rstr[0] == 1 and len(kshape) <= 1):
        rows = kshape[0] if kshape else 1
        s_row = kstr[0] if kshape else 0
        return _reduce_rows(op, x, rows, R, s_row, rstr[0], x._off, out_shape, scale, out=out)
    if len(rshape) == 1 and len(kshape) <= 2 and (not kshape or rstr[0] != 1):
        outer, inner = (1, kshape[0]) if len(kshape) == 1 else ((kshape[0], kshape[1]) if kshape else (1, 1))
        s_row = kstr[0] if len(kshape) == 2 else 0
        s_in = kstr[-1] if kshape else 0
        return _reduce_cols(op, x, outer, R, inner, s_row, rstr[0], s_in, out_shape, scale, out)
    # General case: gather the reduced dims last in a contiguous copy, then reduce rows.
    xc = copy(x.permute(*kept, *dims))
    return _reduce_rows(op, xc, n_out, R, R, 1, 0, out_shape, scale, out=out)


def _reduce_dest(out: Tensor | None, n: int, vdt: dt.DType, rt):
    """(values tensor of n elements, its binding, its element offset there) for a reduction:
    ``out`` flattened when given, else a new tensor."""
    vals = empty((n,), vdt, rt) if out is None else Tensor(out._st, (n,), (1,), out._off, vdt)
    bo, oo = bind(vals, True)
    return vals, bo, oo


def _reduce_rows(op, x, rows, R, s_row, s_k, off, out_shape, scale, idx_in=None, out=None, clip=None):
    rt = x._st.rt
    vdt = _value_dtype(x)
    arg = op in ("argmax", "argmin")
    nchunks = 1
    if R > 8192 and rows < 64:
        nchunks = min((R + 4095) // 4096, 1024)
    chunk = (R + nchunks - 1) // nchunks
    total = rows * nchunks
    final_clip = clip is not None and nchunks == 1  # this pass ends with the clip's scalar chain
    vals, bo, oo = _reduce_dest(out if nchunks == 1 else None, 2 if final_clip else total, vdt, rt)
    idx = empty((total,), dt.int64, rt) if arg else vals
    wg = 256 if R >= 256 else 64 if R >= 64 else 16
    pid = rt.pipeline("reduce", x.dtype.tag, (REDUCE[op], 0, wg, idx_in is not None) + ((True,) if final_clip else ()))
    bx, ox = bind(x)
    bi, oi = bind(idx_in) if idx_in is not None else (bx, 0)
    final_scale = clip if final_clip else scale if nchunks == 1 else 1.0  # CLIP: max_norm in `scale`
    name = op
    if op == "sumsq" or final_clip:
        from helios import fusion

        name = fusion.dispatch_name(("sum_squares" if op == "sumsq" else "sum") + ("+clip_coef" if final_clip else ""), rt)
    rt.dispatch(pid, [bx, bi, bo, bind(idx, True)[0]],
                _P_REDUCE.pack(R, rows, 1, nchunks, chunk, ox + off - x._off, s_row, s_k, 0, final_scale, oi, oo),
                groups_for(total), name, rows * R, rows * R * x.dtype.itemsize)
    vals._st.version += int(out is not None and nchunks == 1)  # a write into the caller's tensor
    if nchunks > 1:  # the partials are summed as they are (already squared)
        second = {"argmax": "argmax", "argmin": "argmin", "sumsq": "sum"}.get(op, op)
        v2, i2 = _reduce_rows(second, vals, rows, nchunks, nchunks, 1, 0, out_shape, scale, idx if arg else None, out, clip)
        return v2, i2
    if final_clip:  # (norm, coef), two scalars of one buffer
        return Tensor(vals._st, (), (), vals._off, vdt), Tensor(vals._st, (), (), vals._off + 1, vdt)
    if out is not None:
        return out, None
    return vals.reshape(out_shape), (idx.reshape(out_shape) if arg else None)


def sum_squares_fits(x: Tensor) -> bool:
    """Whether sum_squares / clip_coef reduce ``x`` as reduce("sum") reduces a contiguous
    copy of it: a contiguous float tensor inside one binding window (the row path)."""
    return (x.dtype.kind == "float" and x.is_contiguous() and x.numel() > 0
            and x._st.nbytes <= x._st.rt.max_range and not _too_wide(x))


def sum_squares(x: Tensor) -> Tensor:
    """sum(x * x) over all of ``x`` (float32, shape ()) in one reduction, each square
    rounded to float32 before it is added (helios.fusion "sum_squares"): bit for bit
    reduce("sum") of x * x.  ``x`` must pass sum_squares_fits."""
    if not sum_squares_fits(x):
        raise ShapeError(f"sum_squares: x must be a contiguous float tensor in one binding window, got {x.dtype.name} "
                         f"{x.shape} with strides {x._strides}")
    return _reduce_rows("sumsq", x, 1, x.numel(), 0, 1, x._off, (), 1.0)[0]


def clip_coef(x: Tensor, max_norm: float, square: bool = True) -> tuple:
    """(norm, coef) of the gradient clip over ``x`` in one reduction (two when x is long):
    norm = sqrt(sum(x * x)) (``square`` False: of sum(x), x already a sum of squares) and
    coef = clamp(max_norm / (norm + 1e-6), max=1), both float32 scalars on the device, bit
    for bit the separate sqrt, add_s, rdiv_s and clamp (helios.fusion "clip_coef").  ``x``
    must pass sum_squares_fits."""
    if not sum_squares_fits(x):
        raise ShapeError(f"clip_coef: x must be a contiguous float tensor in one binding window, got {x.dtype.name} "
                         f"{x.shape} with strides {x._strides}")
    return _reduce_rows("sumsq" if square else "sum", x, 1, x.numel(), 0, 1, x._off, (), 1.0, clip=float(max_norm))


def _reduce_cols(op, x, outer, R, inner, s_row, s_k, s_in, out_shape, scale, out=None):
    rt = x._st.rt
    vdt = _value_dtype(x)
    arg = op in ("argmax", "argmin")
    n = outer * inner
    vals, bo, oo = _reduce_dest(out, n, vdt, rt)
    idx = empty((n,), dt.int64, rt) if arg else vals
    pid = rt.pipeline("reduce", x.dtype.tag, (REDUCE[op], 1, 256, False))
    bx, ox = bind(x)
    rt.dispatch(pid, [bx, bx, bo, bind(idx, True)[0]],
                _P_REDUCE.pack(R, outer, inner, 1, R, ox, s_row, s_k, s_in, scale, 0, oo),
                grid(n), op, n * R, n * R * x.dtype.itemsize)
    if out is not None:
        out._st.version += 1
        return out, None
    return vals.reshape(out_shape), (idx.reshape(out_shape) if arg else None)


def _reduce_wide(op, x, dims, kept, out_shape, scale):
    """Reduce a tensor that spans more than one binding window: a full reduction goes by
    windows over a contiguous copy; otherwise the kept dim that spans the most is halved,
    the halves reduced, and the results joined."""
    if all(x.shape[k] == 1 for k in kept):
        v, i = _reduce_all_windows(op, x if x.is_contiguous() else copy(x), scale)
        return v.reshape(out_shape), (i.reshape(out_shape) if i is not None else None)
    d = max((k for k in kept if x.shape[k] > 1), key=lambda k: (x.shape[k] - 1) * abs(x._strides[k]))
    h = x.shape[d] // 2
    res = [reduce(op, Tensor(x._st, x.shape[:d] + (n,) + x.shape[d + 1:], x._strides, x._off + s * x._strides[d], x.dtype),
                  dims, scale) for s, n in ((0, h), (h, x.shape[d] - h))]
    j = kept.index(d)
    return cat_raw([r[0] for r in res], j), (cat_raw([r[1] for r in res], j) if res[0][1] is not None else None)


def _reduce_all_windows(op, x, scale):
    """Full reduction of a contiguous tensor larger than one binding window."""
    n = x.numel()
    step = _elems_per_dispatch(x)
    parts_v, parts_i = [], []
    for s in range(0, n, step):
        m = min(step, n - s)
        v, i = _reduce_rows(op, Tensor(x._st, (m,), (1,), x._off + s, x.dtype), 1, m, m, 1, x._off + s, (), 1.0)
        parts_v.append(v.reshape((1,)))
        if i is not None:
            parts_i.append(i.reshape((1,)) + s)
    vals = cat_raw(parts_v, 0)
    if op in ("argmax", "argmin"):
        idx_all = cat_raw(parts_i, 0)
        v, j = _reduce_rows(op, vals, 1, len(parts_v), len(parts_v), 1, 0, (), 1.0)
        return v, gather_1d(idx_all, j)
    v, _ = _reduce_rows(op, vals, 1, len(parts_v), len(parts_v), 1, 0, (), scale)
    return v, None


def gather_1d(src: Tensor, index: Tensor) -> Tensor:
    """src[index] for a 1-D src and a 0-d int64 index (host read; used on tiny partials)."""
    i = int(index.item())
    return Tensor(src._st, (), (), src._off + i, src.dtype).contiguous()


def cat_raw(parts: list, dim: int) -> Tensor:
    """Concatenate same-dtype tensors along ``dim`` into a new tensor."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = empty(tuple(shape), parts[0].dtype, parts[0]._st.rt)
    pos = 0
    for p in parts:
        k = p.shape[dim]
        if k:
            copy_into(out.narrow(dim, pos, k), p)
        pos += k
    return out


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


def _mm_cpu_tile(M: int, N: int) -> tuple:
    """(TM, TN, WY) of the CPU kernel for an M x N output.

    llvmpipe turns every buffer load into a loop over the 8 lanes (~45 instructions a lane
    for one 32-byte load), so what a register block costs is mostly its loads: per K step a
    subgroup loads TM values of A and 8 * TN of B for TM * TN vector multiply-adds.  32x8
    loads 2.8x less per multiply-add than 8x16 and ran 1.35-1.45x faster at 1024^3 (CPU
    time, fp32, see bench/README.md "matmul"); 64x8 is ~10 % faster again but JITs ~5x
    longer.  Outputs shorter than 64 rows keep 8-row blocks (a 32-row block would compute
    mostly clamped rows), with 16 columns a lane when N >= 512.  WY keeps ~128 rows a
    workgroup on tall outputs (one B panel reused from cache) and fewer on short ones so
    both threads get workgroups.
    """
    if _MM_CPU_TILE is not None:
        tm, tn = _MM_CPU_TILE
    elif M >= 64:
        tm, tn = 32, 8
    else:
        tm, tn = 8, 16 if N >= 512 else 8
    rows = 128 if M >= 512 else 64 if M >= 128 else 16
    wy = _MM_CPU_WY or max(1, rows // tm)
    return tm, tn, wy


def _mm_cpu_config(M: int, N: int, oa: int, ob: int, oc: int, ca, cb, sam: int, sak: int, sbk: int, sbn: int,
                   wide_ok: bool, tile: tuple = (8, 8, 4)) -> tuple:
    """Specialization constants (WY, AMODE, BMODE, CVEC, AWIDE, BWIDE) of the CPU kernel.

    A K-contiguous A (row-major) or N-contiguous B is read in vectors along that dim, an
    M-contiguous A (a transposed view) or K-contiguous B (B^T) along the other; 8-wide
    when 8-aligned (and int64 exists), 4-wide when 4-aligned, else with scalar loads.
    """
    tm, tn, wy = tile

    def fits(inner, outer, offs, run, e):
        return inner == 1 and outer % e == 0 and all(o % e == 0 for o in offs) and run % e == 0 and run >= (e if run else 0)

    def pick(k_inner, k_outer, t_inner, t_outer, offs, t_run, t_tile):
        # -> (mode, wide): mode 1 = K-contiguous, 2 = the M/N dim contiguous
        for e in ((8, 4) if wide_ok else (4,)):
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


def matmul_any_layout(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b like matmul (no bias), possibly returned as a transposed view.

    The CPU kernel gives each subgroup 8 lanes x TN >= 8 columns, so an output narrower
    than 64 columns leaves lanes idle; a narrow, tall product is then computed as
    (b^T a^T)^T, the same sums with the wide dim as N (an attention [64, 64] @ [64, 32]
    measured ~1.1 ms instead of 1.3-2.2 ms).  For callers that accept any strides; ``out``
    as in matmul() (then returned, the product stored in its layout either way)."""
    rt = a._st.rt
    M, N = a.shape[-2], b.shape[-1]
    if N < 8 * _MM_SG and M >= 2 * N and N % 8 == 0 and _cpu_mm_kernel(rt):
        if out is not None:
            matmul(_swap_last(b), _swap_last(a), out=_swap_last(out))
            return out
        return _swap_last(matmul(_swap_last(b), _swap_last(a)))
    return matmul(a, b, out=out)


def _swap_last(x: Tensor) -> Tensor:
    """A raw (untracked) view of ``x`` with its last two dims swapped."""
    sh, st = list(x.shape), list(x._strides)
    sh[-1], sh[-2], st[-1], st[-2] = sh[-2], sh[-1], st[-2], st[-1]
    return Tensor(x._st, tuple(sh), tuple(st), x._off, x.dtype)


# The epilogue codes of matmul_epi (EPI in matmul.glsl) by fused kernel name.
_MM_EPI = {"linear+residual": 1, "linear+gelu": 2, "matmul+gelu_tanh_bwd": 3}


def matmul_epilogue(name: str, a: Tensor, b: Tensor, bias: Tensor | None, e: Tensor | None,
                    out: Tensor | None = None) -> tuple:
    """One fused matmul kernel (helios.fusion): ``name`` is "linear+residual" (a @ b + bias,
    rounded to the dtype, + ``e``), "linear+gelu" (u = a @ b + bias; gelu_tanh(u)) or
    "matmul+gelu_tanh_bwd" ((a @ b) * gelu_tanh'(``e``)).  ``e`` has the output's shape and
    dtype and is contiguous, as is ``out`` when given.  Returns (out, u) with u the stored
    pre-activation of "linear+gelu", else None.  Bit for bit the unfused kernels."""
    code = _MM_EPI.get(name)
    if code is None:
        raise ValueError(f"matmul_epilogue: name must be one of {sorted(_MM_EPI)}, got {name!r}")
    if b.ndim != 2 or a.ndim < 2 or a.shape[-1] != b.shape[0] or a.shape[-1] == 0:
        raise ShapeError(f"matmul_epilogue: expected a [..., K] @ [K, N] product with K > 0, got {a.shape} and {b.shape}")
    u = None
    if code == 2:
        u = empty(a.shape[:-1] + (b.shape[1],), a.dtype, a._st.rt)
    elif e is None:
        raise ValueError(f"matmul_epilogue: {name} needs e (the tensor its epilogue reads)")
    r = matmul(a, b, bias, out, _epi=(name, code, e, u))
    return r, u


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, out: Tensor | None = None, _epi: tuple | None = None) -> Tensor:
    """Batched a @ b (+ ``bias`` over the last dim) with broadcast batch dims; both >= 2-D
    and of the same float dtype; ``bias`` 1-D of size N with unit stride, added in the
    kernel's epilogue.  (``_epi``: matmul_epilogue's fused epilogue.)

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
    ct = cld = 0
    if out is None:
        out = empty(batch + (M, N), a.dtype, rt)
    else:
        ct, cld = _check_mm_out(out, batch + (M, N), a.dtype)
    nb = numel(batch)
    if out.numel() == 0:
        return out
    if bias is not None and (bias.shape != (N,) or bias.dtype is not a.dtype or (N > 1 and bias._strides[0] != 1)):
        raise ShapeError(f"matmul: bias must be a unit-stride {a.dtype.name} vector of shape ({N},), "
                         f"got {bias.dtype.name} {bias.shape} with strides {bias._strides}")
    if K == 0:
        if ct or cld:
            copy_into(out, scalar_zero(out.dtype, rt))
        else:
            fill(out, 0)
        if bias is not None:
            copy_into(out, binary("add", out, bias))
        return out
    sa = broadcast_strides(a.shape[:-2], a._strides[:-2], batch)
    sb = broadcast_strides(b.shape[:-2], b._strides[:-2], batch)
    if cld:  # the kernel's z0 / z1 must be the out's two batch dims, unmerged
        cshape, ca, cb = list(batch), list(sa), list(sb)
    else:
        cshape, (ca, cb) = collapse(batch, sa, sb)
    if len(cshape) > 2:  # three or more unmergeable batch dims: make the operands contiguous
        return matmul(copy(a.expand(batch + (M, K))), copy(b.expand(batch + (K, N))), bias, out)
    if _epi is not None:
        _check_epi(_epi, out, batch + (M, N), ct or cld)
    if len(cshape) == 1 and cb[0] == 0 and ca[0] == M * a._strides[-2] and not (ct or cld):
        # B is shared by every batch matrix and A's batches follow each other along M (a
        # Linear layer on [B, T, C]): one [nb*M, K] @ [K, N] product.  Each output is the
        # same K-loop as before, so results are bit-identical; the taller grid lets the
        # tile choice use tall workgroups that reuse each B panel from cache.
        M, nb, cshape, ca, cb = M * nb, 1, [], [], []
    while len(cshape) < 2:
        cshape, ca, cb = [1] + cshape, [0] + ca, [0] + cb
    if nb > 65535:
        raise ShapeError(f"matmul: {nb} batch matrices exceed the 65535 the kernel dispatches at once; reshape the batch")
    (ba, oa), (bb, ob) = bind(a), bind(b)
    if cld:  # bind the span the strided C covers
        span = 1 + sum((sz - 1) * st for sz, st in zip(out.shape, out._strides))
        bc, oc = bind(Tensor(out._st, (span,), (1,), out._off, out.dtype), True)
    else:
        bc, oc = bind(_swap_last(out) if ct else out, True)
    # Without a bias, binding 3 repeats A (read-only, never read: HAS_BIAS = 0).
    bz, oz = bind(bias) if bias is not None else (ba, 0)
    has_bias = int(bias is not None)
    sam, sak = a._strides[-2], a._strides[-1]
    sbk, sbn = b._strides[-2], b._strides[-1]
    kernel = "matmul" if _epi is None else "matmul_epi"
    # matmul_epi: CT, CLD (0 there) and the epilogue code at constant id 9 (GPU: id 8 unused)
    epi_spec = () if _epi is None else (0, 0, _epi[1])
    if _cpu_mm_kernel(rt):
        tm, tn, wy = _mm_cpu_tile(M, N)
        spec = _mm_cpu_config(M, N, oa, ob, oc, ca, cb, sam, sak, sbk, sbn, bool(rt.features.get("int64")), (tm, tn, wy))
        if ct or cld:  # vec4 stores run along C's contiguous dim (M when transposed)
            spec = spec[:3] + (int((M if ct else N) % 4 == 0 and oc % 4 == 0 and cld % 4 == 0),) + spec[4:]
        spec = spec + (has_bias,) + ((ct, cld) if ct or cld else ()) + epi_spec
        pid = rt.pipeline(kernel, f"{a.dtype.tag}_sg{tm}x{tn}", spec)
        groups = ((N + _MM_SG * tn - 1) // (_MM_SG * tn), (M + tm * spec[0] - 1) // (tm * spec[0]), nb)
    else:
        spec = _MM_GPU_SPEC + (has_bias,) + ((ct, cld) if ct or cld else ()) + ((0,) + epi_spec if _epi else ())
        pid = rt.pipeline(kernel, a.dtype.tag, spec)
        groups = ((N + _MM_GPU_SPEC[1] - 1) // _MM_GPU_SPEC[1], (M + _MM_GPU_SPEC[0] - 1) // _MM_GPU_SPEC[0], nb)
    flops = 2 * nb * M * N * K
    nbytes = (nb * (M * K + K * N + M * N)) * a.dtype.itemsize
    words = (M, N, K, cshape[1], oa, ob, oc, oz, ca[0], ca[1], sam, sak, cb[0], cb[1], sbk, sbn)
    if _epi is None:
        rt.dispatch(pid, [ba, bb, bc, bz], _P_MATMUL.pack(*words), groups, "matmul", flops, nbytes)
        return out
    from helios import fusion

    name, _, e, u = _epi
    # Unused E / U bindings repeat C (never read / written: EPI picks what the epilogue touches).
    be, oe = bind(e) if e is not None else (bc, 0)
    bu, ou = bind(u, True) if u is not None else (bc, 0)
    nbytes += (e is not None) * nb * M * N * a.dtype.itemsize + (u is not None) * nb * M * N * a.dtype.itemsize
    rt.dispatch(pid, [ba, bb, bc, bz, be, bu], _P_MATMUL_EPI.pack(*words, oe, ou), groups,
                fusion.dispatch_name(name, rt), flops, nbytes)
    return out


def _check_epi(epi: tuple, out: Tensor, shape: tuple, strided: bool) -> None:
    """A ShapeError unless the fused epilogue's C and its E / U are contiguous [.., M, N]."""
    name, _, e, u = epi
    if strided:
        raise ShapeError(f"{name}: out must be contiguous")
    for what, t in (("e", e), ("u", u)):
        if t is not None and (t.shape != shape or t.dtype is not out.dtype or not t.is_contiguous()):
            raise ShapeError(f"{name}: {what} must be a contiguous {out.dtype.name} tensor of shape {shape}, "
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
    return _scalar_host(0, dtype, rt)


# -- row ops ---------------------------------------------------------------------------------
def _row_wg(R: int) -> int:
    return 256 if R >= 1024 else 128 if R >= 256 else 64 if R >= 64 else 32


def _row_plan(rt, rows: int, R: int):
    """(workgroup size, one-row-per-invocation?, workgroup counts) for a row kernel.

    On CPU devices (lavapipe) workgroup barriers are expensive and many rows give enough
    parallelism, so short rows go one per invocation; elsewhere a workgroup shares a row."""
    if (rt.info["type"] == "cpu" and R <= 4096 and rows >= 16) or (R <= 128 and rows >= 4096):
        return 64, True, groups_for((rows + 63) // 64)
    return _row_wg(R), False, groups_for(rows)


def softmax_rows(mode: int, x: Tensor, g: Tensor | None = None, scale: float = 1.0, causal: bool = False) -> Tensor:
    """Softmax family over the last dim of contiguous ``x`` (see softmax.comp for modes).

    ``scale`` multiplies the inputs (forward modes) or the result (backward modes);
    ``causal`` masks column k of query row q (the second-to-last dim) where k > q."""
    rt = x._st.rt
    R = x.shape[-1]
    rows = x.numel() // R if R else 0
    out = empty(x.shape, x.dtype, rt)
    if out.numel() == 0:
        return out
    wg, per_thread, groups = _row_plan(rt, rows, R)
    pid = rt.pipeline("softmax", x.dtype.tag, (mode, wg, per_thread))
    bx, ox = bind(x)
    bg, og = bind(g) if g is not None else (bx, 0)
    name = ("softmax", "log_softmax", "softmax_bwd", "log_softmax_bwd")[mode]
    rt.dispatch(pid, [bx, bg, bind(out, True)[0]], _P_SOFTMAX.pack(R, rows, ox, og, scale, x.shape[-2] if causal else 0), groups, name,
                5 * x.numel(), 3 * x.numel() * x.dtype.itemsize)
    return out


def layer_norm_fwd(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float):
    """y, mean, rstd of LayerNorm over the last dim of contiguous ``x``."""
    rt = x._st.rt
    C = x.shape[-1]
    rows = x.numel() // C if C else 0
    y = empty(x.shape, x.dtype, rt)
    mean = empty((rows,), dt.float32, rt)
    rstd = empty((rows,), dt.float32, rt)
    if rows == 0:
        return y, mean, rstd
    wg, per_thread, groups = _row_plan(rt, rows, C)
    pid = rt.pipeline("layernorm", x.dtype.tag, (0, w is not None, wg, b is not None, per_thread))
    bx, ox = bind(x)
    bw, ow = bind(w) if w is not None else (bx, 0)
    bb, ob = bind(b) if b is not None else (bx, 0)
    rt.dispatch(pid, [bx, bw, bb, bind(y, True)[0], bind(mean, True)[0], bind(rstd, True)[0], bx],
                _P_LN.pack(C, rows, ox, 0, eps, ow, ob), groups, "layer_norm", 8 * x.numel(), 3 * x.numel() * x.dtype.itemsize)
    return y, mean, rstd


def layer_norm_bwd_input(x: Tensor, w: Tensor | None, g: Tensor, mean: Tensor, rstd: Tensor,
                         acc: Tensor | None = None) -> Tensor:
    """dL/dx of LayerNorm (contiguous x and g).  With ``acc`` (a contiguous tensor of x's
    shape and dtype: a pending gradient of x) the kernel returns dx + acc, the add done in
    its store (helios.fusion "layer_norm_bwd+acc"), bit for bit the separate add."""
    rt = x._st.rt
    C = x.shape[-1]
    if acc is not None and (acc.shape != x.shape or acc.dtype is not x.dtype or not acc.is_contiguous()):
        raise ShapeError(f"layer_norm_bwd_input: acc must be a contiguous {x.dtype.name} tensor of shape {x.shape}, "
                         f"got {acc.dtype.name} {acc.shape} with strides {acc._strides}")
    dx = empty(x.shape, x.dtype, rt)
    if dx.numel() == 0:  # no rows (or no columns): nothing to compute, nothing to bind
        return dx
    rows = x.numel() // C
    wg, per_thread, groups = _row_plan(rt, rows, C)
    pid = rt.pipeline("layernorm", x.dtype.tag, (1, w is not None, wg, acc is not None, per_thread))
    bx, ox = bind(x)
    bg, og = bind(g)
    bw, ow = bind(w) if w is not None else (bx, 0)
    bp, op = bind(acc) if acc is not None else (bx, 0)  # binding 2 (the bias slot) holds acc
    name = "layer_norm_bwd"
    if acc is not None:
        from helios import fusion

        name = fusion.dispatch_name("layer_norm_bwd+acc", rt)
    rt.dispatch(pid, [bx, bw, bp, bind(dx, True)[0], bind(mean)[0], bind(rstd)[0], bg],
                _P_LN.pack(C, rows, ox, og, 0.0, ow, op), groups, name, 10 * x.numel(),
                (4 + (acc is not None)) * x.numel() * x.dtype.itemsize)
    return dx


def layer_norm_bwd_params(x: Tensor, g: Tensor, mean: Tensor, rstd: Tensor, need_w: bool, need_b: bool,
                          dw_out: Tensor | None = None, db_out: Tensor | None = None):
    """(dw, db) of LayerNorm (contiguous x and g; None where not needed): per-column sums
    over the rows of g * xhat and of g, in one pass.

    ``dw_out`` / ``db_out`` (optional, contiguous [C] tensors of x's dtype) receive them
    instead of new memory when every needed one is given and they share a storage (one
    output binding: the slots of one flat gradient buffer); otherwise they are ignored and
    the results come in new memory."""
    rt = x._st.rt
    C = x.shape[-1]
    rows = x.numel() // C if C else 0
    dests = [d for d, need in ((dw_out, need_w), (db_out, need_b)) if need]
    direct = bool(dests) and rows > 0 and C > 0 and all(
        d is not None and d._st is dests[0]._st and d.shape == (C,) and d.dtype is x.dtype and d.is_contiguous()
        for d in dests)
    if direct:
        dw, db = (dw_out if need_w else None), (db_out if need_b else None)
        lo = min(d._off for d in dests)
        span = Tensor(dests[0]._st, (max(d._off for d in dests) + C - lo,), (1,), lo, x.dtype)
        bo, base = bind(span, True)
        offs = [d._off - lo + base if d is not None else 0 for d in (dw, db)]
    else:
        out = empty((2, C), x.dtype, rt)
        dw = Tensor(out._st, (C,), (1,), out._off, x.dtype) if need_w else None
        db = Tensor(out._st, (C,), (1,), out._off + C, x.dtype) if need_b else None
        if rows == 0 or C == 0:
            fill(out, 0)
            return dw, db
        bo, offs = bind(out, True)[0], [0, C]
    pid = rt.pipeline("layernorm", x.dtype.tag, (2, need_w, 64, need_b, False))
    bx, ox = bind(x)
    bg, og = bind(g)
    rt.dispatch(pid, [bx, bx, bx, bo, bind(mean)[0], bind(rstd)[0], bg],
                _P_LN.pack(C, rows, ox, og, 0.0, offs[0], offs[1]), groups_for((C + 63) // 64), "layer_norm_bwd_params",
                5 * x.numel(), 2 * x.numel() * x.dtype.itemsize)
    if direct:
        dests[0]._st.version += 1
    return dw, db


def cross_entropy_fwd(x: Tensor, t: Tensor):
    """Per-row loss and logsumexp for contiguous logits x[N, V] and int64 targets t[N]."""
    rt = x._st.rt
    N, V = x.shape
    loss = empty((N,), dt.float32, rt)
    lse = empty((N,), dt.float32, rt)
    if N == 0:
        return loss, lse
    if V == 0:  # no classes: logsumexp of nothing is -inf (PyTorch gives nan losses)
        return fill(loss, float("nan")), fill(lse, float("-inf"))
    wg, per_thread, groups = _row_plan(rt, N, V)
    pid = rt.pipeline("cross_entropy", x.dtype.tag, (0, wg, per_thread))
    bx, ox = bind(x)
    bt, ot = bind(t)
    rt.dispatch(pid, [bx, bt, bind(lse, True)[0], bind(loss, True)[0], bx, bx], _P_ROWS.pack(V, N, ox, ot),
                groups, "cross_entropy", 4 * x.numel(), x.numel() * x.dtype.itemsize)
    return loss, lse


def cross_entropy_bwd(x: Tensor, t: Tensor, lse: Tensor, gl: Tensor) -> Tensor:
    """d loss / d logits given the per-row upstream gradient ``gl`` (float32 [N]: contiguous,
    or one value expanded to N rows with stride 0, read once per row by the kernel)."""
    rt = x._st.rt
    N, V = x.shape
    dx = empty(x.shape, x.dtype, rt)
    if dx.numel() == 0:
        return dx
    one = N > 1 and gl._strides[0] == 0
    bg, og = bind(Tensor(gl._st, (1,), (1,), gl._off, gl.dtype) if one else gl)
    if og != 0 or not (one or gl.is_contiguous()):  # the kernel reads gl from its binding's start
        gl, one = copy(gl), False
        bg, og = bind(gl)
    wg, per_thread, groups = _row_plan(rt, N, V)
    pid = rt.pipeline("cross_entropy", x.dtype.tag, (1, wg, per_thread) + ((True,) if one else ()))
    bx, ox = bind(x)
    bt, ot = bind(t)
    rt.dispatch(pid, [bx, bt, bind(lse)[0], bind(lse)[0], bg, bind(dx, True)[0]], _P_ROWS.pack(V, N, ox, ot),
                groups, "cross_entropy_bwd", 4 * x.numel(), 2 * x.numel() * x.dtype.itemsize)
    return dx


def embedding_fwd(w: Tensor, idx: Tensor) -> Tensor:
    """out[..., :] = w[idx[...], :] for contiguous w [V, C] and contiguous int64 idx."""
    rt = w._st.rt
    V, C = w.shape
    rows = idx.numel()
    out = empty(idx.shape + (C,), w.dtype, rt)
    if out.numel() == 0:
        return out
    pid = rt.pipeline("embedding", w.dtype.tag, (0,))
    bw, ow = bind(w)
    bi, oi = bind(idx)
    gy = (rows + 3) // 4
    gz = (gy + 65534) // 65535
    gy = min(gy, 65535)
    rt.dispatch(pid, [bw, bi, bi, bind(out, True)[0]], _P_EMB.pack(C, rows, V, ow, oi), ((C + 63) // 64, gy, gz),
                "embedding", 0, 2 * out.numel() * w.dtype.itemsize)
    return out


def embedding_bwd(g: Tensor, pos: Tensor, rowptr: Tensor, V: int, out: Tensor | None = None) -> Tensor:
    """dW[V, C] from the upstream g[rows, C] and the CSR grouping (pos int64, rowptr int32),
    written into ``out`` (a contiguous [V, C] tensor of g's dtype) when given."""
    rt = g._st.rt
    C = g.shape[-1]
    if out is None:
        out = empty((V, C), g.dtype, rt)
    elif out.shape != (V, C) or out.dtype is not g.dtype or not out.is_contiguous():
        raise ShapeError(f"embedding_bwd: out must be a contiguous {g.dtype.name} tensor of shape {(V, C)}, "
                         f"got {out.dtype.name} {out.shape}")
    if out.numel() == 0:
        return out
    if g.numel() == 0:  # no position used the table: a zero gradient (nothing to bind)
        return fill(out, 0)
    pid = rt.pipeline("embedding", g.dtype.tag, (1,))
    bg, og = bind(g)
    bo, oo = bind(out, True)
    gy = (V + 3) // 4
    gz = (gy + 65534) // 65535
    gy = min(gy, 65535)
    rt.dispatch(pid, [bg, bind(pos)[0], bind(rowptr)[0], bo], _P_EMB.pack(C, V, V, og, oo),
                ((C + 63) // 64, gy, gz), "embedding_bwd", g.numel(), 2 * g.numel() * g.dtype.itemsize)
    out._st.version += 1
    return out


# -- creation on the device ------------------------------------------------------------------
def rng(shape: tuple, dtype: dt.DType, mode: int, seed: int, offset: int, p0: float, p1: float, rt=None) -> Tensor:
    """Philox random tensor: mode 0 uniform [p0, p1), 1 normal(p0, p1), 2 keep-mask (bool) with drop prob p0."""
    rt = rt or get_runtime()
    # (seed, offset) are push constants: a replay would draw the same numbers again
    graph.refuse(rt, "random numbers (dropout, hl.rand, ...)", "would repeat the same values at every replay; draw "
                 "them outside the captured step or run it without capture")
    out = empty(shape, dtype, rt)
    n = out.numel()
    if n == 0:
        return out
    variant = dtype.tag if dtype.kind == "float" else "u8"
    pid = rt.pipeline("rng", variant, (mode,))
    step = (_elems_per_dispatch(out) // 4) * 4
    # The counter is (i, window, offset): each window of a tensor larger than one binding
    # range gets its own stream, and a (seed, offset) pair fixes the whole tensor.
    for w, s in enumerate(range(0, n, step)):
        m = min(step, n - s)
        bo, oo = bind(_flat_window(out, s), True, span=m)
        rt.dispatch(pid, [bo], _P_RNG.pack(m, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, offset & 0xFFFFFFFF,
                                            (offset >> 32) & 0xFFFFFFFF, p0, p1, w, oo),
                    grid((m + 3) // 4), "rng", 0, m * dtype.itemsize)
    return out


def arange(n: int, start, step, dtype: dt.DType, rt=None) -> Tensor:
    rt = rt or get_runtime()
    out = empty((n,), dtype, rt)
    if n == 0:
        return out
    pid = rt.pipeline("iota", dtype.tag)
    isint = dtype.kind == "int"
    rt.dispatch(pid, [bind(out, True)[0]],
                _P_IOTA.pack(n, float(start), float(step), 0, int(start) if isint else 0, int(step) if isint else 0),
                grid(n), "arange", 0, n * dtype.itemsize)
    return out


# -- sorting, scans, gathers and scatters ----------------------------------------------------------
_P_SORT = struct.Struct("<6I")
_P_SCAN = struct.Struct("<4I")
_P_GATHER = struct.Struct("<6I6i6i6i")
_P_SCATTER = struct.Struct("<7I")
_SORT_BLOCK = 512  # elements a workgroup sorts in shared memory (sort.comp)


def sort_rows(x: Tensor, descending: bool = False):
    """Stable sort of each row of the contiguous 2-D ``x`` [rows, n] (see sort.comp).

    Returns (values [rows, n] in x's dtype, positions [rows, n] int32), both views of the
    padded working buffers (row stride P, the next power of two >= n)."""
    rt = x._st.rt
    rows, n = x.shape
    P = 1
    while P < n:
        P <<= 1
    total = rows * P
    keys = empty((rows, P), x.dtype, rt)
    pos = empty((rows, P), dt.int32, rt)
    if rows * n == 0:
        return keys[:, :n] if n else keys, pos[:, :n] if n else pos
    bk, bp, (bx, ox) = bind(keys, True)[0], bind(pos, True)[0], bind(x)
    blocks = groups_for((total + _SORT_BLOCK - 1) // _SORT_BLOCK)
    tag = x.dtype.tag
    nbytes = total * (x.dtype.itemsize + 4)
    rt.dispatch(rt.pipeline("sort", tag, (0, descending)), [bk, bp, bx], _P_SORT.pack(total, P, n, 0, 0, ox), blocks,
                "sort", 0, nbytes)
    k = 2 * _SORT_BLOCK
    while k <= P:
        j = k // 2
        while j >= _SORT_BLOCK:
            rt.dispatch(rt.pipeline("sort", tag, (1, descending)), [bk, bp, bx], _P_SORT.pack(total, P, n, k, j, ox),
                        groups_for((total // 2 + 255) // 256), "sort", 0, nbytes)
            j //= 2
        rt.dispatch(rt.pipeline("sort", tag, (2, descending)), [bk, bp, bx], _P_SORT.pack(total, P, n, k, 0, ox), blocks,
                    "sort", 0, nbytes)
        k *= 2
    keys._st.version += 1
    pos._st.version += 1
    view = (rows, n), (P, 1)
    return Tensor(keys._st, *view, 0, x.dtype), Tensor(pos._st, *view, 0, dt.int32)


_SCAN_OUT = {"float32": dt.float32, "float16": dt.float16, "bfloat16": dt.bfloat16}


def scan(op: str, x: Tensor, dim: int, reverse: bool = False) -> Tensor:
    """Inclusive cumsum ("sum") or cumprod ("prod") of ``x`` along ``dim`` (see scan.comp).
    Float inputs keep their dtype; integer and bool inputs give int64."""
    rt = x._st.rt
    if not x.is_contiguous():
        x = copy(x)
    out = empty(x.shape, _SCAN_OUT.get(x.dtype.name, dt.int64), rt)
    if out.numel() == 0:
        return out
    n = x.shape[dim]
    inner = numel(x.shape[dim + 1:])
    rows = out.numel() // n
    per_thread = rows >= 64 or n <= 64
    wg = 64 if per_thread else 256
    groups = groups_for((rows + wg - 1) // wg) if per_thread else groups_for(rows)
    bx, ox = bind(x)
    pid = rt.pipeline("scan", x.dtype.tag, ({"sum": 0, "prod": 1}[op], reverse, wg, per_thread))
    rt.dispatch(pid, [bx, bind(out, True)[0]], _P_SCAN.pack(n, rows, inner, ox), groups, "cum" + op, out.numel(),
                out.numel() * (x.dtype.itemsize + out.dtype.itemsize))
    return out


def gather(x: Tensor, dim: int, index: Tensor, positions: bool = False) -> Tensor:
    """torch.gather on the device: out[i] = x[..., index[i], ...] along ``dim`` (int64
    ``index`` of x's ndim, any strides; negative indices count from the end).  With
    ``positions`` the result is instead each element's int64 position in ``x`` (strides
    and offset included): the destinations of a scatter."""
    rt = index._st.rt
    out = empty(index.shape, dt.int64 if positions else x.dtype, rt)
    n = out.numel()
    if n == 0:
        return out
    nd = index.ndim
    if nd > 6:
        raise ShapeError(f"gather: at most 6 dims are supported, got {nd}")
    shape, sx, si = index.shape or (1,), x._strides or (0,), index._strides or (0,)
    bi, oi = bind(index)
    if positions:
        bx, ox = bi, x._off
        pid = rt.pipeline("gather", "i64", (1,))
    else:
        bx, ox = bind(x)
        pid = rt.pipeline("gather", x.dtype.tag, (0,))
    rt.dispatch(pid, [bx, bi, bind(out, True)[0]],
                _P_GATHER.pack(n, max(nd, 1), dim, ox, oi, x.shape[dim] if x.ndim else 1, *_pad(shape), *_pad(sx), *_pad(si)),
                grid(n), "gather", 0, n * (out.dtype.itemsize + 8))
    return out


def scatter_rows(out: Tensor, keys: Tensor, order: Tensor, src: Tensor, mode: str) -> None:
    """out[keys[s], :] (+)= src[order[s], :] in place (see scatter.comp): ``out`` [nrows, C]
    and ``src`` [M, C] contiguous, ``keys`` int64 [M] sorted stably, ``order`` int32 [M]."""
    rt = out._st.rt
    M = keys.numel()
    C = out.shape[1]
    if M == 0 or C == 0 or out.shape[0] == 0:
        return
    gy = (M + 3) // 4
    gz = (gy + 65534) // 65535
    gy = min(gy, 65535)
    (bo, oo), (bk, ok), (br, orr), (bs, os_) = bind(out, True), bind(keys), bind(order), bind(src)
    pid = rt.pipeline("scatter", out.dtype.tag, ({"add": 0, "replace": 1}[mode],))
    rt.dispatch(pid, [bk, br, bs, bo], _P_SCATTER.pack(C, M, out.shape[0], os_, oo, ok, orr), ((C + 63) // 64, gy, gz),
                "scatter_" + mode, M * C, 2 * M * C * out.dtype.itemsize)
    out._st.version += 1


# -- flash attention -------------------------------------------------------------------------
# flash_attn kernel (see kernels_spirv/glsl/flash_attn.comp).  Its passes (the MODE
# specialization constant): forward, backward preprocess D = rowsum(dO * O), dQ, dK and dV.
_P_FLASH = struct.Struct("<4If14I")
FLASH_HEAD_DIMS = (32, 64, 128)  # the variants compiled (flash_attn.variants)
_FA_FWD, _FA_PRE, _FA_DQ, _FA_DKV = 0, 1, 2, 3
_FA_SG_ROWS = 8   # rows a subgroup owns in the CPU kernel (NR in the GLSL)
_FA_GPU_WG = 64   # rows a workgroup owns in the GPU kernel
# Which kernel runs: None = the CPU kernel on CPU drivers with 8-lane subgroups (as matmul
# picks its kernel), else the shared-memory one; "gpu" / "cpu" force one (tests run the GPU
# kernel on lavapipe this way).
_FA_KERNEL: str | None = None
_FA_CPU_WY: int | None = None  # subgroups per workgroup of the CPU kernel; None = automatic


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
    return _cpu_mm_kernel(rt) and fa_subgroup_kernel_runs_on(rt)


def flash_attn_supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the flash kernel takes these [B, H, T, D] operands: one float dtype, a compiled
    head dim shared by q, k and v, the same B and H, non-empty, and B * H within one dispatch."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q._st.rt.is_host:
        return False
    B, H, Tq, D = q.shape
    return (q.dtype is k.dtype is v.dtype and q.dtype.kind == "float" and D in FLASH_HEAD_DIMS
            and k.shape[:2] == v.shape[:2] == (B, H) and k.shape[3] == v.shape[3] == D and k.shape[2] == v.shape[2]
            and Tq > 0 and k.shape[2] > 0 and 0 < B * H <= 65535)


def _fa_operand(t: Tensor) -> Tensor:
    """``t`` itself when the kernel can read it in place (unit stride along the head dim, the
    other strides and the offset multiples of 4 for vector loads), else a contiguous copy."""
    if t._strides[-1] == 1 and t._off % 4 == 0 and all(s % 4 == 0 for s in t._strides[:3]):
        return t
    return copy(t)


def _fa_pairs(Tq: int, Tk: int, causal: bool) -> int:
    """(query, key) pairs an attention computes: causal rows i see min(i + 1, Tk) keys."""
    if not causal:
        return Tq * Tk
    full = min(Tq, Tk)
    return full * (full + 1) // 2 + max(0, Tq - Tk) * Tk


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
        self.dev = from_numpy(m.astype(np.int32), dt.int32, rt or get_runtime())


class _FlashLaunch:
    """The bindings, push constants and grid of one flash_attn call's passes."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                 block_mask: FlashBlockMask | None = None):
        self.rt = rt = q._st.rt
        self.q, self.k, self.v = _fa_operand(q), _fa_operand(k), _fa_operand(v)
        self.B, self.H, self.Tq, self.D = q.shape
        self.Tk = k.shape[2]
        self.scale, self.causal = float(scale), bool(causal)
        (self.bq, oq), (self.bk, ok), (self.bv, ov) = bind(self.q), bind(self.k), bind(self.v)
        self.offs = [oq, ok, ov]
        self.cpu = _fa_cpu(rt)
        self.variant = f"{q.dtype.tag}_{'sg_' if self.cpu else ''}d{self.D}"
        strides = [s for t in (self.q, self.k, self.v) for s in t._strides[:3]]
        self.strides = strides
        # 8-wide loads need every row start 8-aligned (see WIDE in the GLSL)
        self.wide = int(self.cpu and all(x % 8 == 0 for x in strides + self.offs))
        self.bm = block_mask
        if block_mask is not None:
            if (block_mask.Tq, block_mask.Tk, block_mask.causal) != (self.Tq, self.Tk, self.causal):
                raise ShapeError(f"block_mask: built for Tq = {block_mask.Tq}, Tk = {block_mask.Tk}, causal = "
                                 f"{block_mask.causal}; the call has {self.Tq}, {self.Tk}, {self.causal}")
            self.bmb = bind(block_mask.dev)[0]  # a fresh upload: the kernel indexes it from 0

    def pairs(self) -> int:
        """(query, key) pairs one head computes: the mask's blocks only."""
        return self.bm.pairs if self.bm is not None else _fa_pairs(self.Tq, self.Tk, self.causal)

    def key_rows(self) -> int:
        return self.bm.key_rows if self.bm is not None else self.Tk

    def _wy(self, rows: int) -> int:
        if _FA_CPU_WY is not None:
            return _FA_CPU_WY
        # 4 subgroups a workgroup, fewer when a head has fewer row blocks (short sequences)
        return max(1, min(4, -(-rows // _FA_SG_ROWS)))

    def dispatch(self, mode: int, rows: int, bufs: dict, off_o: int, off_do: int, name: str, flops: int, nbytes: int,
                 per_head: bool = True, dlse: bool = False) -> None:
        """Record one pass over ``rows`` rows (per head, or in all with ``per_head=False``)."""
        rt = self.rt
        BH = self.B * self.H
        if self.cpu:
            wy = self._wy(rows) if per_head else 4
            spec = (wy, mode, self.wide)
            per_group = _FA_SG_ROWS * wy
        else:
            spec = (_FA_GPU_WG, mode, 0)
            per_group = _FA_GPU_WG
        groups = (1, -(-rows // per_group), BH) if per_head else groups_for(-(-rows // per_group))
        pid = rt.pipeline("flash_attn", self.variant, spec)
        flags = int(self.causal) | (2 if dlse else 0)
        if self.bm is not None and mode != _FA_PRE:
            # the mask goes through a binding this pass leaves unused (see flash_attn.comp)
            bufs = {**bufs, {_FA_FWD: 6, _FA_DQ: 8, _FA_DKV: 7}[mode]: self.bmb}
            flags |= self.bm.block_size << 8
        # unused bindings repeat Q (read-only, never touched by that pass)
        slots = [self.bq, self.bk, self.bv] + [bufs.get(i, self.bq) for i in range(3, 10)]
        push = _P_FLASH.pack(rows if not per_head else self.Tq, self.Tk, self.H, flags, self.scale,
                             *self.offs, off_o, off_do, *self.strides)
        rt.dispatch(pid, slots, push, groups, name, flops, nbytes)


def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, *,
                   block_mask: FlashBlockMask | None = None):
    """(O, L) of softmax(q k^T * scale) v for [B, H, T, D] operands (see flash_attn_supported):
    O contiguous in q's dtype, L the float32 log-sum-exp of each query row's scaled scores.
    ``causal``: query i sees keys j <= i.  Nothing of size T x T is allocated.
    ``block_mask`` (a FlashBlockMask built for these Tq, Tk and ``causal``, shared by every
    batch and head): only its blocks are computed, the others skipped whole."""
    fl = _FlashLaunch(q, k, v, scale, causal, block_mask)
    rt, B, H, Tq, D = fl.rt, fl.B, fl.H, fl.Tq, fl.D
    o = empty((B, H, Tq, D), q.dtype, rt)
    lse = empty((B, H, Tq), dt.float32, rt)
    pairs = B * H * fl.pairs()
    isz = q.dtype.itemsize
    fl.dispatch(_FA_FWD, Tq, {3: bind(o, True)[0], 5: bind(lse, True)[0]}, 0, 0, "flash_attn",
                4 * pairs * D, B * H * (2 * Tq + 2 * fl.key_rows()) * D * isz + lse.numel() * 4)
    return o, lse


def flash_attn_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, g: Tensor, scale: float, causal: bool,
                   need_q: bool = True, need_kv: bool = True, *, block_mask: FlashBlockMask | None = None,
                   dlse: Tensor | None = None):
    """(dQ, dK, dV) of flash attention given its forward's O and L and the upstream gradient
    ``g`` (contiguous [B, H, Tq, D]); FlashAttention-2's backward: P is recomputed from the
    saved L, dQ is one pass over key tiles and dK, dV one pass over query tiles, each output
    row written by one subgroup (no atomics, deterministic).  Passes not needed are skipped
    (their results are None).  ``block_mask``: the forward's.  ``dlse`` (float32 [B, H, Tq]):
    the gradient reaching L itself, for callers that use L (dL/ds_ij = P_ij adds dlse * P to
    dS: the kernel's D = rowsum(dO * O) becomes D - dlse)."""
    fl = _FlashLaunch(q, k, v, scale, causal, block_mask)
    rt, B, H, Tq, Tk, D = fl.rt, fl.B, fl.H, fl.Tq, fl.Tk, fl.D
    if not g.is_contiguous() or g._off % 4:
        g = copy(g)
    (bo, oo), (bg, og) = bind(o), bind(g)
    bl = bind(lse)[0]
    isz = q.dtype.itemsize
    rows = B * H * Tq
    dsum = empty((B, H, Tq), dt.float32, rt)
    pre = {3: bo, 4: bg, 6: bind(dsum, True)[0]}
    if dlse is not None:
        if dlse.shape != (B, H, Tq) or dlse.dtype is not dt.float32:
            raise ShapeError(f"flash_attn_bwd: dlse must be float32 {(B, H, Tq)}, got {dlse.dtype.name} {dlse.shape}")
        if not dlse.is_contiguous():
            dlse = copy(dlse)
        bd, od = bind(dlse)
        if od:  # the pass indexes dL from the start of its binding
            dlse = copy(dlse)
            bd, od = bind(dlse)
        pre[5] = bd
    fl.dispatch(_FA_PRE, rows, pre, oo, og, "flash_attn_bwd_pre", 2 * rows * D + (rows if dlse is not None else 0),
                2 * rows * D * isz + rows * (8 if dlse is not None else 4), per_head=False, dlse=dlse is not None)
    pairs = B * H * fl.pairs()
    dq = dk = dv = None
    stats = {4: bg, 5: bl, 6: bind(dsum)[0]}
    if need_q:
        dq = empty((B, H, Tq, D), q.dtype, rt)
        fl.dispatch(_FA_DQ, Tq, {**stats, 7: bind(dq, True)[0]}, oo, og, "flash_attn_bwd_dq", 6 * pairs * D,
                    B * H * (3 * Tq + 2 * fl.key_rows()) * D * isz)
    if need_kv:
        dk = empty((B, H, Tk, D), q.dtype, rt)
        dv = empty((B, H, Tk, D), q.dtype, rt)
        fl.dispatch(_FA_DKV, Tk, {**stats, 8: bind(dk, True)[0], 9: bind(dv, True)[0]}, oo, og, "flash_attn_bwd_dkv",
                    8 * pairs * D, B * H * (2 * Tq + 2 * Tk + 2 * fl.key_rows()) * D * isz)
    return dq, dk, dv
