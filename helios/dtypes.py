"""Helios dtypes: what a tensor stores, how numpy sees it, and which kernel variant handles it.

Storage dtypes are float32, float16, bfloat16, int32, int64 and bool.  Arithmetic on
16-bit floats is done in float32 inside the kernels (the storage is converted on load
and rounded to nearest-even on store), so devices without 16-bit arithmetic still work;
they do need 16-bit storage, which is checked when the first 16-bit tensor is made.
numpy has no bfloat16: its bits travel as uint16 and are converted on ``.numpy()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helios.errors import DTypeError


@dataclass(frozen=True)
class DType:
    """A tensor element type."""

    name: str
    itemsize: int
    np_storage: np.dtype  # numpy dtype of the raw bits (uint16 for bfloat16)
    kind: str  # "float", "int" or "bool"
    tag: str  # kernel variant tag: f32 f16 bf16 i32 i64 u8

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "float"

    def __repr__(self) -> str:
        return f"helios.{self.name}"


float32 = DType("float32", 4, np.dtype(np.float32), "float", "f32")
float16 = DType("float16", 2, np.dtype(np.float16), "float", "f16")
bfloat16 = DType("bfloat16", 2, np.dtype(np.uint16), "float", "bf16")
int32 = DType("int32", 4, np.dtype(np.int32), "int", "i32")
int64 = DType("int64", 8, np.dtype(np.int64), "int", "i64")
bool_ = DType("bool", 1, np.dtype(np.bool_), "bool", "u8")

ALL = (float32, float16, bfloat16, int32, int64, bool_)
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update({"float": float32, "half": float16, "long": int64, "int": int32, "bf16": bfloat16, "fp32": float32, "fp16": float16})
_FROM_NUMPY = {
    np.dtype(np.float32): float32,
    np.dtype(np.float16): float16,
    np.dtype(np.int32): int32,
    np.dtype(np.int64): int64,
    np.dtype(np.bool_): bool_,
    np.dtype(np.float64): float32,  # like torch.tensor on float64 data with a float32 default
    np.dtype(np.int8): int32,
    np.dtype(np.int16): int32,
    np.dtype(np.uint8): int32,
    np.dtype(np.uint16): int32,
}

# Promotion order for binary ops between two tensors (bool < ints < floats; float16 and
# bfloat16 meet in float32, as in PyTorch).
_RANK = {bool_: 0, int32: 1, int64: 2, bfloat16: 3, float16: 3, float32: 4}


def as_dtype(d) -> DType:
    """Turn a DType, a name ("float32", "bf16"...) or a numpy dtype into a DType."""
    if isinstance(d, DType):
        return d
    if isinstance(d, str):
        if d in _BY_NAME:
            return _BY_NAME[d]
        raise DTypeError(f"unknown dtype {d!r}: expected one of {', '.join(x.name for x in ALL)}")
    try:
        npd = np.dtype(d)
    except TypeError:
        raise DTypeError(f"cannot interpret {d!r} as a dtype: expected one of {', '.join(x.name for x in ALL)}") from None
    if npd in _FROM_NUMPY:
        return _FROM_NUMPY[npd]
    raise DTypeError(f"numpy dtype {npd} has no Helios equivalent: expected one of {', '.join(x.name for x in ALL)}")


def is_dtype_name(name: str) -> bool:
    """Whether ``name`` is a Helios dtype's name or one of its aliases (float, half, long, int, bf16, fp32, fp16)."""
    return name in _BY_NAME


def from_numpy_dtype(npd: np.dtype) -> DType:
    """The Helios dtype a numpy array of dtype ``npd`` becomes."""
    npd = np.dtype(npd)
    if npd in _FROM_NUMPY:
        return _FROM_NUMPY[npd]
    raise DTypeError(f"numpy dtype {npd} has no Helios equivalent: expected one of {', '.join(x.name for x in ALL)}")


def promote(a: DType, b: DType) -> DType:
    """Result dtype of a binary op between tensors of dtypes ``a`` and ``b``."""
    if a is b:
        return a
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if _RANK[a] >= _RANK[b] else b


def scalar_result(t: DType, scalar) -> DType:
    """Result dtype of ``tensor op python_scalar`` (a float scalar lifts ints and bools to float32)."""
    if isinstance(scalar, bool):
        return t
    if isinstance(scalar, float) and t.kind != "float":
        return float32
    if isinstance(scalar, int) and t.kind == "bool":
        return int64
    return t


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns, rounded to nearest even (NaN stays NaN)."""
    x = np.array(x, dtype=np.float32, order="C")
    u = x.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


class finfo:  # noqa: N801 - PyTorch's name
    """Machine limits of a floating-point dtype, as ``torch.finfo``: ``bits``, ``eps`` (the
    gap between 1 and the next value), ``max``, ``min`` (= -max), ``tiny`` (the smallest
    normal, also ``smallest_normal``) and ``resolution``.  ``finfo()`` is float32's."""

    _TABLE = {  # bits, eps, max, tiny, resolution
        "float32": (32, 2.0 ** -23, float(np.finfo(np.float32).max), 2.0 ** -126, 1e-6),
        "float16": (16, 2.0 ** -10, 65504.0, 2.0 ** -14, 1e-3),
        "bfloat16": (16, 2.0 ** -7, float.fromhex("0x1.fep127"), 2.0 ** -126, 0.01),
    }

    def __init__(self, dtype=None):
        d = float32 if dtype is None else as_dtype(dtype)
        if d.name not in self._TABLE:
            raise DTypeError(f"finfo: expected a floating-point dtype (float32, float16, bfloat16), got {d.name}")
        self.dtype = d.name
        self.bits, self.eps, self.max, self.tiny, self.resolution = self._TABLE[d.name]
        self.min = -self.max
        self.smallest_normal = self.tiny

    def __repr__(self) -> str:
        return (f"finfo(resolution={self.resolution}, min={self.min:.6g}, max={self.max:.6g}, eps={self.eps:.6g}, "
                f"smallest_normal={self.tiny:.6g}, tiny={self.tiny:.6g}, dtype={self.dtype})")
