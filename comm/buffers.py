"""The one adapter between user objects and the flat byte buffers the collectives move.

A numpy array is used in place (through a contiguous flat view, or a contiguous copy
that is written back when the array is strided).  A Helios tensor is recognised by duck
typing: an object with ``.numpy()`` (returns a host copy) and ``.copy_(ndarray)`` (writes
a result back).  bfloat16 travels as uint16 bit patterns; it is named either by an explicit
``dtype="bfloat16"`` argument or by a ``.dtype`` attribute whose ``str`` is ``"bfloat16"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from helios.errors import DTypeError

# Storage dtype of each dtype name the collectives accept.
_STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
}

SUPPORTED_DTYPES = tuple(_STORAGE)


@dataclass
class Buffer:
    """A flat contiguous array holding an operand, its dtype name and how to write it back."""

    flat: np.ndarray  # 1-D, C-contiguous, storage dtype
    dtype: str
    _writeback: Callable[[np.ndarray], None] | None = None

    @property
    def nbytes(self) -> int:
        """Size of the operand in bytes."""
        return int(self.flat.nbytes)

    @property
    def count(self) -> int:
        """Number of elements."""
        return int(self.flat.size)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return int(self.flat.itemsize)

    def bytes_view(self) -> np.ndarray:
        """The operand as a flat uint8 array sharing memory with ``flat``."""
        return self.flat.view(np.uint8)

    def commit(self) -> None:
        """Write the result back into the user's object when it was not used in place."""
        if self._writeback is not None:
            self._writeback(self.flat)


_NAME_OF = {dt: name for name, dt in _STORAGE.items() if name != "bfloat16"}


def _dtype_name(obj: Any, arr: np.ndarray, dtype: str | None) -> str:
    if dtype is not None:
        name = str(dtype)
    elif obj is arr and arr.dtype in _NAME_OF:
        return _NAME_OF[arr.dtype]  # the hot path: a numpy array names its own dtype
    else:
        attr = getattr(obj, "dtype", None)
        name = str(attr) if attr is not None and str(attr) == "bfloat16" else arr.dtype.name
    name = name.replace("torch.", "").replace("helios.", "")
    if name not in _STORAGE:
        raise DTypeError(
            f"helios.comm: dtype {name!r} is not supported; expected one of {', '.join(SUPPORTED_DTYPES)}. "
            "Convert the operand first (bfloat16 travels as uint16 bit patterns with dtype='bfloat16')."
        )
    return name


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    from helios.comm.reduce_ops import f32_to_bf16

    return f32_to_bf16(np.ascontiguousarray(a, dtype=np.float32).reshape(-1))


def as_buffer(obj: Any, dtype: str | None = None, *, what: str = "tensor", writable: bool = True) -> Buffer:
    """Wrap a numpy array or a Helios tensor as a :class:`Buffer` (in place where possible).

    ``writable``: the operation writes into it, so a read-only array is refused here, before
    any peer is involved (failing inside the operation would poison the communicator).
    """
    if isinstance(obj, np.ndarray):
        if writable and not obj.flags.writeable:
            raise ValueError(f"helios.comm: {what} is a read-only array but this operation writes into it; "
                             "pass a writable array (e.g. a copy).")
        name = _dtype_name(obj, obj, dtype)
        storage = _STORAGE[name]
        if obj.dtype != storage:
            raise DTypeError(
                f"helios.comm: {what} has numpy dtype {obj.dtype} but dtype {name!r} is stored as {storage}; "
                "pass a matching array (bfloat16 as uint16 bit patterns)."
            )
        if obj.flags.c_contiguous:
            return Buffer(obj.reshape(-1), name)
        copy = np.ascontiguousarray(obj).reshape(-1)

        def write_strided(flat: np.ndarray, target: np.ndarray = obj) -> None:
            target[...] = flat.reshape(target.shape)

        return Buffer(copy, name, write_strided)
    if hasattr(obj, "numpy") and hasattr(obj, "copy_"):
        host = np.asarray(obj.numpy())
        name = _dtype_name(obj, host, dtype)
        storage = _STORAGE[name]
        shape = host.shape
        if name == "bfloat16" and host.dtype != np.uint16:
            # The tensor hands bfloat16 out widened (e.g. float32): narrow it to bit patterns
            # for the wire and widen the result back for copy_.
            flat = _to_bf16_bits(host)
            widened = host.dtype

            def write_bf16(f: np.ndarray, target: Any = obj) -> None:
                from helios.comm.reduce_ops import bf16_to_f32

                target.copy_(bf16_to_f32(f).astype(widened).reshape(shape))

            return Buffer(flat, name, write_bf16)
        flat = np.ascontiguousarray(host, dtype=storage).reshape(-1).copy()

        def write_tensor(f: np.ndarray, target: Any = obj) -> None:
            target.copy_(f.reshape(shape))

        return Buffer(flat, name, write_tensor)
    raise DTypeError(
        f"helios.comm: {what} must be a numpy array or a Helios tensor (an object with .numpy() and .copy_()), "
        f"got {type(obj).__name__}."
    )
