"""In-place ops (``copy_``, ``add_``, ``fill_``, ``x[mask] = v``, ...) and the ``*_like`` constructors.

Under autograd (grad mode on and the tensor or an operand requiring grad) an in-place op is
recorded as its out-of-place form: the result is computed with a node on the tape, written
into the tensor's memory, and the tensor moves to that node (``autograd.tape.edge`` keeps the
nodes recorded before on the producer they saw).  As in PyTorch, a leaf that requires grad
is refused, and a node that saved the old values fails at backward (version counter).  Unlike
PyTorch, a tensor whose memory another live tensor shares (a view, or the tensor it views) is
refused: the other tensor's autograd history could not follow the write.
"""

from __future__ import annotations

import sys

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios._shape import broadcast_shapes
from helios.autograd.tape import is_grad_enabled, next_sequence
from helios.errors import InPlaceError, ShapeError
from helios.runtime import get_runtime
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


# -- in-place ops and autograd ---------------------------------------------------------------------
def _check_inplace(x: Tensor, op: str, *operands) -> bool:
    """Whether the in-place op ``op`` on ``x`` must be recorded on the autograd tape (grad mode
    on, and x or a tensor among ``operands`` requiring grad); refuses what cannot be recorded.
    Call it before computing anything from x.  A recorded op ends with :func:`finish_inplace`."""
    if not is_grad_enabled():
        return False
    if not (x.requires_grad or any(isinstance(o, Tensor) and o.requires_grad for o in operands)):
        return False
    if x.requires_grad and x._node is None:
        raise InPlaceError(f"{op}: a leaf tensor that requires grad cannot be changed in place (its .grad would "
                           "describe values it no longer holds); change a clone(), or wrap the update in helios.no_grad()")
    if x.dtype.kind != "float":
        return False  # an integer or bool tensor takes the values; no gradient flows through it
    # CPython's reference count of the storage: x's own reference and this call's argument.
    # Any other is another tensor on the same memory, whose history would miss the write.
    if sys.getrefcount(x._st) > 2:
        raise InPlaceError(f"{op}: the tensor shares its memory with another tensor (a view of it, or the tensor it "
                           "views), whose gradient could not follow an in-place write; write into a clone(), or "
                           "wrap the update in helios.no_grad()")
    return True


def finish_inplace(x: Tensor, result: Tensor, recorded: bool) -> Tensor:
    """Write ``result`` (an op's out-of-place form, x's shape) into ``x``.  ``recorded`` (what
    :func:`_check_inplace` said): x moves to result's node, and a copy of the old values
    stands in for x among what that node saved."""
    if result.shape != x.shape:
        raise ShapeError(f"in-place: result shape {result.shape} does not fit the in-place target {x.shape}")
    if recorded and result._node is not None:
        ctx = result._node.ctx
        saved = getattr(ctx, "saved", None) or ()
        if any(s is not None and s._st is x._st for s in saved):
            ctx.save_for_backward(*(K.copy(s) if s is not None and s._st is x._st else s for s in saved))
    values = K.copy(result) if result._st is x._st else result
    K.copy_into(x, values)
    x._st.version += 1
    if recorded:
        if x._node is not None:  # the nodes recorded so far keep x's old producer
            x._history = (x._history or ()) + ((next_sequence(), x._node, x._out_index),)
        # (a result that requires no grad does not depend on x's old values: x is detached)
        x._node, x._out_index, x.requires_grad = result._node, result._out_index, result.requires_grad
    return x


def copy_(x: Tensor, src) -> Tensor:
    """Copy ``src`` (a tensor broadcastable to x, a numpy array or a number) into ``x`` in place."""
    if _check_inplace(x, "copy_", src):  # recorded as a write of every element: x's old values get no gradient
        if isinstance(src, np.ndarray):
            src = K.from_numpy(np.asarray(src, dtype=x.dtype.np_storage), x.dtype, x._st.rt)
        if isinstance(src, Tensor) and src.shape != x.shape:
            broadcast_shapes("copy_", src.shape, x.shape)
        F.setitem(x, Ellipsis, src)
        return x
    if isinstance(src, np.ndarray):
        if src.shape != x.shape:
            broadcast_shapes("copy_", src.shape, x.shape)
        if x.is_contiguous() and src.shape == x.shape and x.dtype is not dt.bfloat16 and not x._st.nbytes > x._st.rt.max_range:
            host = np.ascontiguousarray(src, dtype=x.dtype.np_storage)
            x._st.rt.write(x._st.handle, x._off * x.dtype.itemsize, host.reshape(-1).view(np.uint8))
            x._st.version += 1
            return x
        src = K.from_numpy(src, dt.from_numpy_dtype(src.dtype) if src.dtype != np.float64 else x.dtype, x._st.rt)
    if isinstance(src, F.Number):
        src = F.scalar_tensor(src, x.dtype, x._st.rt)
    if src.shape != x.shape:
        broadcast_shapes("copy_", src.shape, x.shape)
    K.copy_into(x, src)
    x._st.version += 1
    return x


def _inplace_binary(name, fn):
    def f(x: Tensor, other, *args, **kw) -> Tensor:
        recorded = _check_inplace(x, name, other, *args, *kw.values())
        r = fn(x, other, *args, **kw)
        if r.shape != x.shape:
            raise ShapeError(f"{name}: result shape {r.shape} does not fit the in-place target {x.shape}")
        return finish_inplace(x, r, recorded)

    f.__name__ = name
    f.__doc__ = f"In-place {name.rstrip('_')}."
    return f


add_ = _inplace_binary("add_", F.add)
sub_ = _inplace_binary("sub_", F.sub)
mul_ = _inplace_binary("mul_", F.mul)
div_ = _inplace_binary("div_", F.div)
masked_fill_ = _inplace_binary("masked_fill_", F.masked_fill)


def clamp_(x: Tensor, min=None, max=None) -> Tensor:
    """In-place :func:`clamp`."""
    recorded = _check_inplace(x, "clamp_", min, max)
    return finish_inplace(x, F.clamp(x, min, max), recorded)


def zero_(x: Tensor) -> Tensor:
    return fill_(x, 0)


def fill_(x: Tensor, value) -> Tensor:
    """Set every element to ``value`` in place."""
    if _check_inplace(x, "fill_", value):  # recorded as a write of every element: x's old values get no gradient
        F.setitem(x, Ellipsis, value)
        return x
    if x.is_contiguous():
        K.fill(x, value)
    else:
        K.copy_into(x, F.scalar_tensor(value, x.dtype, x._st.rt))
    x._st.version += 1
    return x


def full_like(x: Tensor, value, dtype=None, *, device=None, requires_grad: bool = False, layout=None,
              memory_format=None) -> Tensor:
    """A new tensor of x's shape filled with ``value`` (x's dtype and device unless given)."""
    F._check_tensor(x, "full_like")
    check_layout("full_like", layout)
    F.check_memory_format("full_like", memory_format)
    rt = x._st.rt if device is None else get_runtime(str(device))
    out = K.fill(K.empty(x.shape, dt.as_dtype(dtype) if dtype is not None else x.dtype, rt), value)
    return out.requires_grad_(True) if requires_grad else out


def zeros_like(x: Tensor, dtype=None, **kw) -> Tensor:
    """A new tensor of zeros of x's shape (keywords as :func:`full_like`)."""
    return full_like(x, 0, dtype, **kw)


def ones_like(x: Tensor, dtype=None, **kw) -> Tensor:
    """A new tensor of ones of x's shape (keywords as :func:`full_like`)."""
    return full_like(x, 1, dtype, **kw)


def check_layout(op: str, layout) -> None:
    """Accept PyTorch's layout argument where it names the only layout Helios has (strided)."""
    if layout is not None and str(layout).rsplit(".", 1)[-1] != "strided":
        raise ShapeError(f"{op}: layout {layout!r} is not supported: Helios tensors are strided (dense)")
