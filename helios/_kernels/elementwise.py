"""Elementwise kernels (ew_unary, ew_binary, ew_where) with their op codes from the op table
(kernels_spirv/ew_ops.py), strided copies and casts, fills, uploads from numpy."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import elementwise_jit, fused_kernels
from helios._shape import broadcast_strides, collapse
from helios.errors import DTypeError, ShapeError
from helios.kernels_spirv import ew_ops
from helios import op_trace
from helios.tensor import Tensor
from helios._kernels.core import MAX_DIMS, _PAD6, _ZERO14, _elems_per_dispatch, _pad, bind, empty, grid, narrow_view, vec_width

_TRACE = op_trace.current()  # the op being recorded: a queued op records under its own operands and ids


# Elementwise op codes, from the op table (kernels_spirv/ew_ops.py: it generates the GLSL switch too).
UNARY = ew_ops.codes("unary")
BINARY = ew_ops.codes("binary")
COMPARE = ew_ops.codes("compare")
INT_UNARY = frozenset(name for name, op in ew_ops.by_name("unary").items() if op.int_glsl)  # the rest: floats only

_P_UNARY = struct.Struct("<4I2f2I6i6i")
_P_BINARY = struct.Struct("<5If2I6i6i6i")
_P_WHERE = struct.Struct("<6I6i6i6i6i")
_P_COPY = struct.Struct("<4I8i8i8i")


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
            # vec4 / vec8 path (see ew_unary.comp): 4 or 8 aligned elements an invocation
            vec = vec_width(x.dtype.tag, m, ox, oo) if out.dtype is x.dtype else 1
            args = (pid if vec == 1 else rt.pipeline("ew_unary", x.dtype.tag, (code, 1, vec)), [bx, bo],
                    _P_UNARY.pack(m, 1, ox, oo, p0, p1, *_ZERO14), grid(m // vec), op, m, 2 * m * x.dtype.itemsize)
            q = rt.ew_queue
            if (q is not None and m == n and fused_kernels.ENABLED and elementwise_jit.ENABLED and out.dtype is x.dtype
                    and elementwise_jit.fusible("unary", op, x.dtype.tag)):
                # held back to be fused with the elementwise ops around it (helios.elementwise_jit)
                q.add(elementwise_jit.EwOp("unary", op, x.dtype.tag, m, ((bx, ox),), (bo, oo), (p0, p1), args,
                                     _TRACE.operands, _TRACE.dispatch_ids))
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

    return [narrow_view(v, d, 0, h) for v in views], [narrow_view(v, d, h, shape[d] - h) for v in views]


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
            # vec4 / vec8 path (see ew_binary.comp): 4 or 8 aligned elements an invocation
            vec = 1 if compare else vec_width(a.dtype.tag, m, oa, ob, oo)
            args = (pid if vec == 1 else rt.pipeline("ew_binary", variant, (code, 1, vec)), [ba, bb, bo],
                    _P_BINARY.pack(m, 1, oa, ob, oo, alpha, 0, 0, *_PAD6, *_PAD6, *_PAD6),
                    grid(m // vec), op, m, nbytes)
            q = rt.ew_queue
            if (q is not None and m == n and fused_kernels.ENABLED and elementwise_jit.ENABLED
                    and elementwise_jit.fusible("binary", op, variant)):
                # held back to be fused with the elementwise ops around it (helios.elementwise_jit)
                q.add(elementwise_jit.EwOp("binary", op, variant, m, ((ba, oa), (bb, ob)), (bo, oo), (alpha,), args,
                                     _TRACE.operands, _TRACE.dispatch_ids))
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
    if (q is not None and fused_kernels.ENABLED and elementwise_jit.ENABLED and elementwise_jit.fusible("binary", op, variant)
            and not (_too_wide(ae) or _too_wide(be) or _too_wide(out))):
        # one operand with the output's shape, contiguous, the other a single element seen
        # everywhere (a 0-d tensor): fusible too, the single element loaded once per element
        bcast = (not any(sa), not any(sb))
        full = b if bcast[0] else a
        if bcast in ((False, True), (True, False)) and full.shape == shape and full.is_contiguous():
            args, ins, o = _binary_args(op, pid, ae, be, out, alpha)
            q.add(elementwise_jit.EwOp("binary", op, variant, n, ins, o, (alpha,), args, _TRACE.operands,
                                 _TRACE.dispatch_ids, bcast))
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
        rt = a._st.rt
        n = a.numel()
        if b.numel() == 1 and not (_too_wide(a) or _too_wide(b)):
            # one element of b for every element of a: no index arithmetic, 4 elements an
            # invocation when aligned (ew_binary's B_ONE), the same op per element
            ba, oa = bind(a, True)
            bb, ob = bind(b)
            vec = vec_width(a.dtype.tag, n, oa)
            pid = rt.pipeline("ew_binary", a.dtype.tag, (BINARY[op], 1, vec, 1))
            rt.dispatch(pid, [ba, bb, ba], _P_BINARY.pack(n, 1, oa, ob, oa, 1.0, 0, 0, *_PAD6, *_PAD6, *_PAD6),
                        grid(n // vec), op, n, n * (2 * a.dtype.itemsize))
        else:
            be = Tensor(b._st, a.shape, broadcast_strides(b.shape, b._strides, a.shape), b._off, b.dtype)
            _binary_into(op, rt.pipeline("ew_binary", a.dtype.tag, (BINARY[op], 0)), a, be, a, 1.0)
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


def write_grad_slot(slot: Tensor, g: Tensor, add: bool) -> None:
    """Put a gradient into a parameter's packed gradient slot (a view of an optimizer's flat
    buffer): ``slot[...] = g``, or with ``add`` ``slot += g`` (a later contribution, e.g. a tied
    table's) in the slot itself where one in-place kernel can.  autograd calls this through the
    writer it is given (helios.autograd.tape.set_grad_slot_writer): the tape launches nothing."""
    if not add:
        copy_into(slot, g)
    elif fused_kernels.ENABLED and g.shape == slot.shape and g.dtype is slot.dtype and slot.is_contiguous():
        binary_("add", slot, g)
    else:
        copy_into(slot, slot + g)


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
        from helios.device_transfer import copy_across

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
    # 16 bytes an invocation (see copy.comp): a copy without conversion of a 4- or 2-byte dtype, or
    # 8 elements between float32 and bfloat16; inner runs contiguous on both sides and everything
    # aligned to that many elements
    vec = 16 // src.dtype.itemsize if src.dtype is dst.dtype and src.dtype.itemsize in (2, 4) else 1
    if {src.dtype, dst.dtype} == {dt.float32, dt.bfloat16}:
        vec = 8
    if not (cs[-1] == 1 and cd[-1] == 1 and cshape[-1] % vec == 0 and os_ % vec == 0 and od % vec == 0
            and all(x % vec == 0 for x in cs[:-1] + cd[:-1])):
        vec = 1
    if vec > 1:
        pid = rt.pipeline("copy", f"{src.dtype.tag}_{dst.dtype.tag}", (vec,))
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
