"""In-place ops (``copy_``, ``add_``, ``fill_``, ...) and the ``*_like`` constructors."""

from __future__ import annotations

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios._shape import broadcast_shapes
from helios.autograd.tape import is_grad_enabled
from helios.errors import InPlaceError, ShapeError
from helios.runtime import get_runtime
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


# -- in-place ops (only outside autograd) --------------------------------------------------------
def _check_inplace(x: Tensor, op: str) -> None:
    if is_grad_enabled() and (x.requires_grad):
        raise InPlaceError(f"{op}: in-place op on a tensor that requires grad is not supported "
                           "(it would corrupt the tape); use the out-of-place form, or wrap the update in helios.no_grad()")


def copy_(x: Tensor, src) -> Tensor:
    """Copy ``src`` (a tensor broadcastable to x, a numpy array or a number) into ``x`` in place."""
    _check_inplace(x, "copy_")
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
        _check_inplace(x, name)
        r = fn(x, other, *args, **kw)
        if r.shape != x.shape:
            raise ShapeError(f"{name}: result shape {r.shape} does not fit the in-place target {x.shape}")
        K.copy_into(x, r)
        x._st.version += 1
        return x

    f.__name__ = name
    f.__doc__ = f"In-place {name.rstrip('_')}."
    return f


add_ = _inplace_binary("add_", F.add)
sub_ = _inplace_binary("sub_", F.sub)
mul_ = _inplace_binary("mul_", F.mul)
div_ = _inplace_binary("div_", F.div)
masked_fill_ = _inplace_binary("masked_fill_", F.masked_fill)


def clamp_(x: Tensor, min=None, max=None) -> Tensor:
    _check_inplace(x, "clamp_")
    K.copy_into(x, F.clamp(x, min, max))
    x._st.version += 1
    return x


def zero_(x: Tensor) -> Tensor:
    return fill_(x, 0)


def fill_(x: Tensor, value) -> Tensor:
    """Set every element to ``value`` in place."""
    _check_inplace(x, "fill_")
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
