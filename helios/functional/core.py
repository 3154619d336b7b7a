"""Helpers every op family shares: argument checks, type promotion (PyTorch's rules),
the dtype/device conversion ``to``, contiguous copies."""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from helios import _kernels as K
from helios import device_transfer
from helios import dtypes as dt
from helios.autograd.tape import Function
from helios.errors import ShapeError
from helios.runtime import get_runtime
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


Number = (int, float, bool)
MaxMin = namedtuple("MaxMin", ["values", "indices"])


# -- helpers -------------------------------------------------------------------------------------
def _check_tensor(x, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: expected a helios.Tensor, got {type(x).__name__}")
    return x


_scalar_cache: dict = {}


def scalar_tensor(value, dtype: dt.DType, rt) -> Tensor:
    """A cached 0-d device tensor holding ``value`` (for comparisons and where with scalars)."""
    key = (value, type(value), math.copysign(1.0, value) if isinstance(value, float) else 0, dtype, id(rt))
    t = _scalar_cache.get(key)
    if t is None:
        if len(_scalar_cache) > 512:
            _scalar_cache.clear()
        t = K.from_numpy(np.array(value, dtype=np.float32 if dtype is dt.bfloat16 else dtype.np_storage), dtype, rt)
        _scalar_cache[key] = t
    return t


def _as_tensor_like(x, like: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Number):
        return scalar_tensor(x, dt.scalar_result(like.dtype, x), like._st.rt)
    if isinstance(x, np.ndarray):
        return K.from_numpy(x, dt.from_numpy_dtype(x.dtype), like._st.rt)
    raise TypeError(f"expected a helios.Tensor or a number, got {type(x).__name__}")


def _promote_pair(a: Tensor, b: Tensor, op: str):
    if a._st.rt is not b._st.rt:
        raise ShapeError(f"{op}: tensors are on different devices ({a.device} and {b.device})")
    if a.dtype is b.dtype:
        return a, b
    # a 0-d tensor does not promote a float tensor's dtype (like a Python scalar)
    if b.ndim == 0 and a.ndim > 0 and (a.dtype.kind == "float" or b.dtype.kind != "float"):
        return a, to(b, a.dtype)
    if a.ndim == 0 and b.ndim > 0 and (b.dtype.kind == "float" or a.dtype.kind != "float"):
        return to(a, b.dtype), b
    t = dt.promote(a.dtype, b.dtype)
    return to(a, t), to(b, t)


_KIND_RANK = {"bool": 0, "int": 1, "float": 2}


def result_type(*operands) -> dt.DType:
    """The dtype PyTorch's type promotion gives ``operands`` (tensors, numbers, None): tensors
    with dims promote each other; 0-d tensors, then Python numbers, only count where they
    are of a higher kind (bool < int < float) than everything before them."""
    tensors = [o for o in operands if isinstance(o, Tensor)]
    dims = [t.dtype for t in tensors if t.ndim]
    zero_d = [t.dtype for t in tensors if not t.ndim]
    out = None
    for rank, group in enumerate((dims, zero_d) if dims else (zero_d,)):
        for d in group:
            if out is None:
                out = d
            elif rank == 0:
                out = dt.promote(out, d)
            elif _KIND_RANK[d.kind] > _KIND_RANK[out.kind]:
                out = d
    for o in operands:
        if isinstance(o, Number) and not isinstance(o, Tensor):
            kind = "bool" if isinstance(o, bool) else "int" if isinstance(o, int) else "float"
            if out is None:
                out = {"bool": dt.bool_, "int": dt.int64, "float": dt.float32}[kind]
            elif _KIND_RANK[kind] > _KIND_RANK[out.kind]:
                out = dt.int64 if kind == "int" else dt.float32
    if out is None:
        raise TypeError("result_type: expected at least one tensor or number")
    return out


def sum_to_shape(g: Tensor, shape: tuple) -> Tensor:
    """Sum a broadcast gradient back to ``shape`` (the inverse of broadcasting)."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1]
    out = F.sum(g, dim=dims, keepdim=True) if dims else g
    return F.reshape(out, shape)


# -- casting, copies -----------------------------------------------------------------------------
class _Cast(Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src = x.dtype
        return K.copy(x, dtype)

    @staticmethod
    def backward(ctx, g):
        dest = ctx.grad_out(0)  # a float32 master weight's slot under autocast: convert straight into it
        if dest is not None and dest.dtype is ctx.src and dest.shape == g.shape:
            K.copy_into(dest, g)
            return dest, None
        return K.copy(g, ctx.src), None


def check_memory_format(op: str, memory_format) -> None:
    """Accept PyTorch's memory_format arguments that Helios honours: None, "preserve_format"
    and "contiguous_format" (results are row-major); any other layout is a ShapeError."""
    if memory_format is None:
        return
    name = str(memory_format).rsplit(".", 1)[-1]
    if name not in ("preserve_format", "contiguous_format"):
        raise ShapeError(f"{op}: memory_format {name!r} is not supported: Helios results are row-major "
                         "(contiguous_format); permute the tensor for another layout")


def to(x: Tensor, *args, dtype=None, device=None, non_blocking: bool = False, copy: bool = False,
       memory_format=None) -> Tensor:
    """``x`` as ``dtype`` and/or on ``device``, with PyTorch's forms: ``to(dtype)``,
    ``to(device, dtype)``, ``to(other)`` (other's dtype and device), then ``non_blocking``
    and ``copy`` (True: always a new tensor; ``non_blocking`` changes nothing, every op is
    asynchronous).  The same tensor when nothing changes.
    Devices: "cpu" (host memory: see helios.runtime.HostRuntime) and "vulkan:N"; a move is
    differentiable (the gradient moves back) and is followed by the dtype cast, if any."""
    _check_tensor(x, "to")
    device, dtype, copy = device_transfer.parse_to_args(args, {"device": device, "dtype": dtype, "copy": copy})
    if device is not None and get_runtime(device) is not x._st.rt:
        x, copy = device_transfer.to_device(x, device), False  # a new tensor already
    d = x.dtype if dtype is None else dtype
    check_memory_format("to", memory_format)
    if d is x.dtype:
        return clone(x) if copy else x
    if d.kind != "float" and x.requires_grad:
        return K.copy(x, d)  # integer results carry no gradient
    return _Cast.apply(x, d)


class _Contiguous(Function):
    @staticmethod
    def forward(ctx, x):
        return K.copy(x)

    @staticmethod
    def backward(ctx, g):
        return g


def contiguous(x: Tensor) -> Tensor:
    """``x`` itself if contiguous, else a contiguous copy."""
    return x if x.is_contiguous() else _Contiguous.apply(x)


def clone(x: Tensor) -> Tensor:
    """A copy with its own storage (differentiable)."""
    return _Contiguous.apply(x)


def pin_memory(x: Tensor) -> Tensor:
    """PyTorch's page-locked host copy.  Host (cpu) tensors are returned as they are: Helios
    uploads them without an intermediate staging copy where device memory is host-visible,
    and through its own staging pool elsewhere; a device tensor cannot be pinned."""
    if not x.is_cpu:
        from helios.errors import DeviceError

        raise DeviceError(f"pin_memory: only host (cpu) tensors can be pinned, this one is on {x.device}")
    return x
