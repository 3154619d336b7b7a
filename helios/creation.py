"""Tensor creation: from host data, constants, ranges and random streams."""

from __future__ import annotations

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios.errors import ShapeError
from helios.graph import refuse_upload
from helios.autograd.tape import no_grad as _no_grad
from helios.random import default_generator
from helios.runtime import get_runtime
from helios.tensor import Tensor


def _shape(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    shape = tuple(int(s) for s in args)
    if any(s < 0 for s in shape):
        raise ShapeError(f"negative dimension in shape {shape}")
    return shape


def _finish(t: Tensor, requires_grad: bool) -> Tensor:
    if requires_grad:
        t.requires_grad_(True)
    return t


def tensor(data, dtype=None, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """A new tensor holding a copy of ``data`` (numpy array, nested lists, number or Tensor)."""
    rt = get_runtime(device)
    refuse_upload("hl.tensor(...)", rt)
    if isinstance(data, Tensor):
        arr = data.numpy()
    else:
        arr = np.asarray(data)
    if dtype is None:
        if arr.dtype == np.float64:
            d = dt.float32
        elif arr.dtype.kind in "iu":
            d = dt.int64 if not isinstance(data, np.ndarray) else dt.from_numpy_dtype(arr.dtype)
        else:
            d = dt.from_numpy_dtype(arr.dtype)
    else:
        d = dt.as_dtype(dtype)
    return _finish(K.from_numpy(arr, d, rt), requires_grad)


def from_numpy(arr: np.ndarray) -> Tensor:
    """A tensor copy of a numpy array (dtype kept where Helios has it)."""
    return tensor(arr, dtype=dt.from_numpy_dtype(arr.dtype))


def empty(*shape, dtype=dt.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor with uninitialised contents."""
    return _finish(K.empty(_shape(shape), dt.as_dtype(dtype), get_runtime(device)), requires_grad)


def full(shape, fill_value, dtype=None, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor filled with ``fill_value``."""
    if dtype is None:
        dtype = dt.float32 if isinstance(fill_value, float) else dt.bool_ if isinstance(fill_value, bool) else dt.int64
    t = K.empty(_shape((shape,) if isinstance(shape, int) else (shape,)), dt.as_dtype(dtype), get_runtime(device))
    return _finish(K.fill(t, fill_value), requires_grad)


def zeros(*shape, dtype=dt.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of zeros."""
    return _finish(K.fill(K.empty(_shape(shape), dt.as_dtype(dtype), get_runtime(device)), 0), requires_grad)


def ones(*shape, dtype=dt.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of ones."""
    return _finish(K.fill(K.empty(_shape(shape), dt.as_dtype(dtype), get_runtime(device)), 1), requires_grad)


def arange(start, end=None, step=1, dtype=None, device: str | None = None) -> Tensor:
    """Values from ``start`` up to (not including) ``end`` by ``step``."""
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange: step must be non-zero")
    if dtype is None:
        dtype = dt.float32 if any(isinstance(v, float) for v in (start, end, step)) else dt.int64
    dtype = dt.as_dtype(dtype)
    n = max(0, int(np.ceil((end - start) / step)))
    if dtype.kind != "float":
        # PyTorch's integer ranges: the values step from the truncated start by the truncated
        # step; int64 also counts its length from the truncated bounds (other dtypes from the
        # exact ones).
        start, step = int(start), int(step)
        if step == 0:
            raise ValueError("arange: the step, truncated to an integer for an integer dtype, is 0")
        if dtype is dt.int64:
            n = max(0, int(np.ceil((int(end) - start) / step)))
    return K.arange(n, start, step, dtype, get_runtime(device))


def _random(shape, mode, p0, p1, dtype, seed, device, requires_grad) -> Tensor:
    d = dt.as_dtype(dtype)
    if d.kind != "float":
        raise ShapeError(f"random tensors are floating point; got dtype {d.name}")
    if seed is None:
        s, off = default_generator().next_offset()
    else:
        s, off = int(seed), 0
    t = K.rng(_shape(shape), d, mode, s, off, p0, p1, get_runtime(device))
    return _finish(t, requires_grad)


def randn(*shape, seed: int | None = None, dtype=dt.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Standard normal samples (Philox on the device; deterministic for a ``seed``)."""
    return _random(shape, 1, 0.0, 1.0, dtype, seed, device, requires_grad)


def rand(*shape, seed: int | None = None, dtype=dt.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Uniform samples in [0, 1) (Philox on the device; deterministic for a ``seed``)."""
    return _random(shape, 0, 0.0, 1.0, dtype, seed, device, requires_grad)


def normal(mean, std=1.0, shape=None, seed: int | None = None, dtype=None, device: str | None = None,
           requires_grad: bool = False, layout=None) -> Tensor:
    """Samples of N(mean, std^2).  ``mean`` and ``std`` are numbers (then ``shape`` is needed)
    or tensors, which broadcast to the result's shape, as in PyTorch's torch.normal."""
    if layout is not None and str(layout).rsplit(".", 1)[-1] != "strided":
        raise ShapeError(f"normal: layout {layout!r} is not supported: Helios tensors are strided (dense)")
    if not isinstance(mean, Tensor) and not isinstance(std, Tensor):
        if shape is None:
            raise ShapeError("normal: with a number mean and std, give the result's shape")
        return _random(shape, 1, float(mean), float(std), dt.float32 if dtype is None else dtype, seed, device, requires_grad)
    from helios import functional as F
    from helios._shape import broadcast_shapes

    ref = mean if isinstance(mean, Tensor) else std
    d = dt.as_dtype(dtype) if dtype is not None else ref.dtype
    out_shape = broadcast_shapes("normal", *(t.shape for t in (mean, std) if isinstance(t, Tensor)))
    if shape is not None and tuple(shape) != out_shape:
        raise ShapeError(f"normal: shape {tuple(shape)} does not match the tensors' broadcast shape {out_shape}")
    z = _random(out_shape, 1, 0.0, 1.0, d, seed, ref.device, False)
    with _no_grad():
        out = F.add(F.mul(z, std), mean)
    out = F.to(out, d) if out.dtype is not d else out
    return _finish(out.detach(), requires_grad)


def uniform(low: float, high: float, shape, seed: int | None = None, dtype=dt.float32, device: str | None = None) -> Tensor:
    """Samples of U[low, high)."""
    return _random(shape, 0, float(low), float(high), dtype, seed, device, False)


def randn_like(x: Tensor, seed: int | None = None, dtype=None, device: str | None = None, requires_grad: bool = False,
               layout=None, memory_format=None) -> Tensor:
    """Standard normal samples of x's shape (x's dtype and device unless given)."""
    _check_like("randn_like", layout, memory_format)
    return randn(*x.shape, seed=seed, dtype=x.dtype if dtype is None else dtype, device=device or x.device,
                 requires_grad=requires_grad)


def rand_like(x: Tensor, seed: int | None = None, dtype=None, device: str | None = None, requires_grad: bool = False,
              layout=None, memory_format=None) -> Tensor:
    """Uniform [0, 1) samples of x's shape (x's dtype and device unless given)."""
    _check_like("rand_like", layout, memory_format)
    return rand(*x.shape, seed=seed, dtype=x.dtype if dtype is None else dtype, device=device or x.device,
                requires_grad=requires_grad)


def _check_like(op: str, layout, memory_format) -> None:
    from helios.functional import check_layout, check_memory_format

    check_layout(op, layout)
    check_memory_format(op, memory_format)


def randint(low, high=None, size=None, *, generator=None, dtype=dt.int64, device: str | None = None,
            requires_grad: bool = False) -> Tensor:
    """Integers uniform in [low, high) (``randint(high, size)`` or ``randint(low, high, size)``),
    drawn on the device from the Philox stream of ``generator`` (default: helios.random's):
    two 24-bit uniforms make 48 random bits, reduced modulo the range (a bias below
    range / 2**48)."""
    if size is None:
        if high is None or not isinstance(high, (tuple, list)):
            raise TypeError("randint: expected randint(high, size) or randint(low, high, size)")
        low, high, size = 0, low, high
    elif high is None:
        low, high = 0, low
    low, high = int(low), int(high)
    if high <= low:
        raise ValueError(f"randint: the range [{low}, {high}) is empty")
    span = high - low
    if span > 2 ** 48:
        raise ValueError(f"randint: a range of {span} values exceeds the 2**48 this generator draws from")
    d = dt.as_dtype(dtype)
    rt = get_runtime(device)
    shape = _shape(size)
    gen = generator or default_generator()
    (s1, o1), (s2, o2) = gen.next_offset(), gen.next_offset()
    scale = K.from_numpy(np.array(2 ** 24, np.int64), dt.int64, rt)

    def bits24(seed, offset):  # floor(u * 2**24): the uniform's 24 bits, exactly
        u = K.rng(shape, dt.float32, 0, seed, offset, 0.0, 1.0, rt)
        return K.copy(K.unary("mul_s", u, float(2 ** 24)), dt.int64)

    x = K.binary("add", K.binary("mul", bits24(s1, o1), scale), bits24(s2, o2))
    m = K.from_numpy(np.array(span, np.int64), dt.int64, rt)
    r = K.binary("sub", x, K.binary("mul", K.binary("div_floor", x, m), m))
    if low:
        r = K.binary("add", r, K.from_numpy(np.array(low, np.int64), dt.int64, rt))
    if d is not dt.int64:
        r = K.copy(r, d)
    return _finish(r, requires_grad)
