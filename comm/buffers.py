"""The one adapter between user objects and the flat byte buffers the collectives move.

A numpy array is used in place (through a contiguous flat view, or a contiguous copy
that is written back when the array is strided).  A Helios tensor is reached when the
operation runs, not when it is issued, so an asynchronous collective overlaps the device
work that is still producing the tensor: the communicator's thread waits (polling, never
holding the device) until the recorded work that writes the tensor has run, then maps its
device memory where it is host-visible (lavapipe, integrated GPUs: no copy at all) or
reads it into one host array and writes the result back (discrete GPUs: one copy each
way).  bfloat16 travels as uint16 bit patterns; it is named by an explicit
``dtype="bfloat16"``, by a ``.dtype`` whose ``str`` is ``"bfloat16"``, or by a Helios tensor's
own dtype.  Tensors must be contiguous, as in torch.distributed; other objects with
``.numpy()`` and ``.copy_(ndarray)`` go through a host copy.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from helios.errors import DTypeError
from helios.flat import mark_written

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
    if _is_helios_tensor(obj):
        return DeviceBuffer(obj, dtype, what, writable)
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


def _is_helios_tensor(obj: Any) -> bool:
    from helios.tensor import Tensor

    return isinstance(obj, Tensor)


_ready = threading.local()


def take_device_ready_ns() -> int:
    """When this thread last found a Helios tensor's data produced by the device (0: none since
    the last call).  The communicator reports an operation's transfer as starting there."""
    ns = getattr(_ready, "ns", 0)
    _ready.ns = 0
    return ns


# Polling intervals while the device finishes the work that produces a tensor: short at
# first (a gradient is usually a few dispatches from done), longer when it is not.
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 1e-3


class DeviceBuffer(Buffer):
    """A Helios tensor's device bytes, reached on the thread that runs the operation.

    ``flat`` waits until the recorded work writing the tensor (for an output: touching
    it) has run, then maps the memory (no copy) or reads it into a host array (one copy);
    ``commit`` makes the host's writes visible to the device (or writes the host array
    back) and bumps the tensor's version so saved-for-backward checks see the change.
    """

    def __init__(self, t: Any, dtype: str | None, what: str, writable: bool) -> None:
        name = (str(dtype) if dtype is not None else t.dtype.name).replace("helios.", "").replace("torch.", "")
        if name not in _STORAGE:
            raise DTypeError(f"helios.comm: {what} has dtype {name!r}, which the collectives do not carry; expected one "
                             f"of {', '.join(SUPPORTED_DTYPES)}.")
        if _STORAGE[name].itemsize != t.dtype.itemsize:
            raise DTypeError(f"helios.comm: {what} is a Helios {t.dtype.name} tensor but dtype={name!r} was given.")
        if not t.is_contiguous():
            if writable:
                raise ValueError(f"helios.comm: {what} (shape {t.shape}) is not contiguous; collectives write into "
                                 "contiguous tensors only: pass t.contiguous() and copy the result back.")
            t = t.contiguous()  # an input only: a device copy, recorded now on the caller's thread
        # The work that makes the tensor is recorded here, on the caller's thread: ops held back
        # for fusion would otherwise wait for that thread's next command, and the operation's
        # thread (which polls the tensor) never records them.
        t.untyped_storage().rt.emit_pending()
        self.tensor = t
        self.dtype = name
        self.writable = writable
        self._count = t.numel()
        self._storage = _STORAGE[name]
        self._flat: np.ndarray | None = None
        self._staged = False
        self._writeback = None

    @property
    def nbytes(self) -> int:
        return self._count * self._storage.itemsize

    @property
    def count(self) -> int:
        return self._count

    @property
    def itemsize(self) -> int:
        return int(self._storage.itemsize)

    def _range(self) -> tuple[Any, int, int, int]:
        t = self.tensor
        st = t.untyped_storage()
        return st.rt, st.handle, t.storage_offset() * t.dtype.itemsize, self.nbytes

    @property
    def flat(self) -> np.ndarray:  # type: ignore[override]
        if self._flat is None:
            self._flat = self._resolve()
        return self._flat

    def _resolve(self) -> np.ndarray:
        dev, handle, off, n = self._range()
        if n == 0:
            return np.empty(0, self._storage)
        pause = _POLL_FIRST_S
        while not dev.ready(handle, off, n, self.writable):
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        _ready.ns = time.monotonic_ns()
        view = dev.map(handle, off, n, self.writable)
        if view is not None:
            return np.frombuffer(view, self._storage)
        host = np.empty(self._count, self._storage)
        dev.read(handle, off, host.view(np.uint8))
        self._staged = True
        return host

    def commit(self) -> None:
        if not self.writable or self._flat is None:
            return
        dev, handle, off, n = self._range()
        if self._staged:
            dev.write(handle, off, self._flat.view(np.uint8))
        else:
            dev.host_wrote(handle, off, n)
        mark_written(self.tensor)
