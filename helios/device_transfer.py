"""Moving tensors between devices: Vulkan and CUDA devices and "cpu" (host memory, numpy buffers).

A move reads the tensor's bytes (bfloat16 as its bit pattern, so nothing is rounded) and
writes them into a new allocation on the other device.  ``copy_across`` is ``copy_`` where
the source and destination are not on the same device, or where either is on cpu;
``ToDevice`` is the differentiable move behind ``Tensor.to(device)`` (its gradient moves
back to where the input was).
"""

from __future__ import annotations

import numpy as np

from helios import dtypes as dt
from helios.autograd.tape import Function
from helios.graph import refuse_upload
from helios.runtime import get_runtime
from helios.tensor import Tensor


def host_view(t: Tensor) -> np.ndarray:
    """A numpy view (storage dtype: bfloat16 as uint16 bits) of a cpu tensor's elements, strides kept."""
    isz = t.dtype.itemsize
    buf = t._st.handle[t._off * isz:].view(t.dtype.np_storage)
    return np.lib.stride_tricks.as_strided(buf, t.shape, tuple(s * isz for s in t._strides), writeable=True)


def raw(t: Tensor) -> np.ndarray:
    """A C-contiguous host copy of ``t``'s elements in its storage dtype (bfloat16 as uint16 bits)."""
    if t._st.rt.is_host:
        return np.array(host_view(t), order="C", copy=True)
    src = t if t.is_contiguous() else t.contiguous()
    out = np.empty(t.shape, dtype=t.dtype.np_storage)
    if out.size:
        src._st.rt.read(src._st.handle, src._off * t.dtype.itemsize, out.reshape(-1).view(np.uint8))
    return out


def from_raw(bits: np.ndarray, dtype: dt.DType, rt) -> Tensor:
    """A new contiguous tensor on ``rt`` holding ``bits`` (storage dtype of ``dtype``)."""
    from helios import _kernels as K

    bits = np.array(bits, dtype=dtype.np_storage, order="C", copy=True)
    out = K.empty(bits.shape, dtype, rt)
    if bits.size:
        rt.write(out._st.handle, 0, bits.reshape(-1).view(np.uint8))
    out._host = (out._st.version, bits)
    return out


def convert(bits: np.ndarray, src: dt.DType, dst: dt.DType) -> np.ndarray:
    """Storage bits of ``src`` converted to storage bits of ``dst`` (as the copy kernel converts)."""
    if src is dst:
        return bits
    vals = dt.bf16_bits_to_float32(bits) if src is dt.bfloat16 else bits
    with np.errstate(invalid="ignore", over="ignore"):
        if dst is dt.bfloat16:
            return dt.float32_to_bf16_bits(vals.astype(np.float32))
        if dst is dt.bool_:
            return vals != 0
        return vals.astype(dst.np_storage)


def move(x: Tensor, rt) -> Tensor:
    """``x``'s data as a new tensor on ``rt`` (``x`` itself when it is there already)."""
    if x._st.rt is rt:
        return x
    refuse_upload(f"moving a tensor to {rt.name}", rt)
    return from_raw(raw(x), x.dtype, rt)


def copy_across(dst: Tensor, src: Tensor) -> None:
    """dst[...] = src (broadcast, dtype converted) where either is on cpu or they are on two devices."""
    from helios import _kernels as K

    rt = dst._st.rt
    refuse_upload("copying host data into a tensor", rt)
    vals = np.broadcast_to(convert(raw(src), src.dtype, dst.dtype), dst.shape)
    if rt.is_host:
        host_view(dst)[...] = vals
    elif dst.is_contiguous():
        rt.write(dst._st.handle, dst._off * dst.dtype.itemsize, np.ascontiguousarray(vals).reshape(-1).view(np.uint8))
    else:
        K.copy_into(dst, from_raw(vals, dst.dtype, rt))
    dst._st.version += 1


class ToDevice(Function):
    """The differentiable move: forward to ``rt``, the gradient back to where the input was."""

    @staticmethod
    def forward(ctx, x, rt):
        ctx.src = x._st.rt
        return move(x, rt)

    @staticmethod
    def backward(ctx, g):
        return move(g, ctx.src), None


def to_device(x: Tensor, spec) -> Tensor:
    """``x`` on the device ``spec`` names (the same tensor when it is there already)."""
    rt = get_runtime(spec)
    if x._st.rt is rt:
        return x
    return ToDevice.apply(x, rt)


def parse_to_args(args: tuple, kwargs: dict, op: str = "to"):
    """(device or None, dtype or None, copy) from PyTorch's ``to(...)`` forms: ``to(device)``,
    ``to(dtype)``, ``to(device, dtype)``, ``to(other_tensor)``, keywords ``device=``,
    ``dtype=``, ``non_blocking=``, ``copy=``.  A string that is neither a dtype nor a device is one
    DeviceError naming it, the devices that exist and the dtypes."""
    from helios.runtime import parse_device, device_names

    device = kwargs.pop("device", None)
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("non_blocking", None)  # every Helios op is already asynchronous
    copy = bool(kwargs.pop("copy", False))
    kwargs.pop("memory_format", None)
    if kwargs:
        raise TypeError(f"{op}() got unexpected keyword arguments {sorted(kwargs)}")
    flags = []
    for a in args:
        if isinstance(a, Tensor):
            dtype, device = a.dtype, a.device
        elif isinstance(a, bool):
            flags.append(a)
        elif a is None:
            continue
        elif isinstance(a, dt.DType) or (type(a) is str and _names_a_dtype(a)):
            dtype = a  # as_dtype below refuses the ones Helios lacks ("float64") as a DTypeError
        elif isinstance(a, (str, int)) or type(a).__name__ == "device":
            try:
                parse_device(a)
            except Exception:
                raise _not_device_or_dtype(op, a, device_names()) from None
            device = a
        else:
            dtype = a  # numpy dtypes and the like: as_dtype names what it cannot read
    if len(flags) > 2:
        raise TypeError(f"{op}: too many bool arguments {flags}: expected non_blocking and copy")
    if len(flags) > 1:
        copy = flags[1]
    return device, (None if dtype is None else dt.as_dtype(dtype)), copy


def _names_a_dtype(name: str) -> bool:
    if dt.is_dtype_name(name):
        return True
    try:
        np.dtype(name)
    except TypeError:
        return False
    return True


def _not_device_or_dtype(op: str, a, devices: str):
    from helios.errors import DeviceError

    return DeviceError(f"{op}({a!r}): not a device or a dtype; devices here: {devices}; "
                       f"dtypes: {', '.join(d.name for d in dt.ALL)}")
