"""Complex tensors for rotary position embeddings, as a pair of real tensors.

Helios has no complex dtype (no kernels, no entry in the dtype table).  torchtitan's llama
applies its rotary embedding with PyTorch's complex API::

    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)             # complex64
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[0:seqlen].view(1, seqlen, 1, head_dim // 2)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)

and that code runs unchanged on Helios: a :class:`ComplexTensor` holds its real and imaginary
parts as two float32 :class:`helios.Tensor` of one shape, and every operation below is built
from differentiable real ops, so gradients reach the real tensors it came from.

What a complex tensor supports (PyTorch's semantics; nothing else):

* made by ``helios.polar(abs, angle)`` and ``helios.view_as_complex(x)`` (``x``'s last dim of
  size 2 holds (real, imag)); ``helios.view_as_real(z)`` gives back a real tensor of shape
  ``z.shape + (2,)``;
* ``.real``, ``.imag``, ``.shape``, ``.ndim``, ``.dtype`` (``helios.complex64``), ``.device``;
* ``.view(*shape)``, ``.reshape(*shape)``, ``.unsqueeze(dim)``, indexing and slicing
  ``z[...]`` (on the complex dims);
* ``z * w``, ``z + w``, ``z - w``, ``-z`` with ``w`` a complex tensor (broadcasting), a real
  tensor or a number (Python complex numbers included); a number may also come first
  (``2 * z``, ``1 - z``), a real *tensor* only second (``z * x``: ``x * z`` is refused by
  ``helios.Tensor``);
* ``.abs()``, ``.angle()``, ``.conj()``;
* ``.to(device)`` (and ``.to(helios.complex64)``, which changes nothing), ``.numpy()`` (a
  numpy complex64 array).

Anything else (``z.sum()``, ``z @ w``, ``z / w``, comparisons, item assignment...) raises
:class:`ComplexUnsupportedError`; take ``view_as_real(z)`` or ``.real`` / ``.imag`` and work
on real tensors instead.

Differences from PyTorch, none of which the rotary code meets: the results of
``view_as_complex`` and ``view_as_real`` are not views sharing memory with their input (only
``.real`` / ``.imag`` of ``view_as_complex(x)`` are views of ``x``), so writing into one in
place does not show in the other; ``conj()`` is resolved at once (PyTorch's ``conj()`` sets a
lazy bit that ``view_as_real`` refuses until ``resolve_conj()``); ``angle()`` is computed on the
host (Helios has no atan2 kernel), so it waits for the device.
"""

from __future__ import annotations

import numbers

import numpy as np

from helios import device_transfer
from helios import dtypes as dt
from helios import functional as F
from helios.autograd.tape import Function
from helios.creation import tensor as _host_to_tensor
from helios.errors import DTypeError, HeliosError, ShapeError
from helios.tensor import Tensor

__all__ = ["ComplexTensor", "ComplexUnsupportedError", "complex64", "polar", "view_as_complex", "view_as_real"]

_SUPPORTED = ("polar, view_as_complex, view_as_real, .real, .imag, .shape, .ndim, .dtype, .device, .view, .reshape, "
              ".unsqueeze, indexing, + - * with a complex tensor, a real tensor or a number, .abs(), .angle(), .conj(), "
              ".to(device), .numpy()")


class ComplexUnsupportedError(HeliosError, TypeError, AttributeError):
    """An operation that Helios' complex tensors do not have.

    Also an AttributeError, so ``hasattr(z, name)`` and ``getattr(z, name, default)`` keep
    working on a complex tensor for the names it lacks."""

    def __init__(self, what: str):
        super().__init__(f"{what}: complex tensors in Helios support only the rotary-embedding operations listed in "
                         f"the helios.complex docstring ({_SUPPORTED}); use view_as_real(z) or z.real / z.imag and "
                         "real tensor ops for anything else")


class ComplexDType:
    """The dtype marker of a :class:`ComplexTensor` (PyTorch's ``complex64``: float32 parts).

    Not a :class:`helios.DType`: no kernel or factory accepts it, so ``helios.zeros(2,
    dtype=helios.complex64)`` fails as for any dtype Helios lacks."""

    name = "complex64"
    itemsize = 8
    is_complex = True
    is_floating_point = False

    def __repr__(self) -> str:
        return "helios.complex64"


complex64 = ComplexDType()


def _real_parts(other):
    """(real, imag) of an operand of a complex op: imag is None for a real tensor or number;
    None altogether for anything else (the operator then returns NotImplemented)."""
    if isinstance(other, ComplexTensor):
        return other._re, other._im
    if isinstance(other, Tensor):
        return other, None
    if isinstance(other, numbers.Complex) and not isinstance(other, numbers.Real):
        return float(other.real), float(other.imag)  # a Python complex number: two float scalars
    if isinstance(other, (int, float)):
        return other, None
    if isinstance(other, numbers.Real):
        return float(other), None  # numpy scalars: helios.Tensor's operators take Python numbers
    return None


class ComplexTensor:
    """A complex64 tensor held as two float32 tensors of one shape (see the module docstring
    for the operations it has).  Made by :func:`polar` and :func:`view_as_complex`; the
    constructor takes the two parts directly."""

    _helios_defers_binary_ops = True  # a real Tensor's +, - and * hand over to this class's reflected ones

    __slots__ = ("_re", "_im")
    __hash__ = object.__hash__  # the elementwise-comparison stubs below would otherwise drop it

    def __init__(self, real: Tensor, imag: Tensor):
        if not isinstance(real, Tensor) or not isinstance(imag, Tensor):
            raise TypeError(f"ComplexTensor: expected two helios.Tensor, got {type(real).__name__} and "
                            f"{type(imag).__name__}")
        if real.dtype is not dt.float32 or imag.dtype is not dt.float32:
            raise DTypeError(f"ComplexTensor: complex64 has float32 parts, got {real.dtype} and {imag.dtype}")
        if real.shape != imag.shape:
            raise ShapeError(f"ComplexTensor: real part of shape {real.shape} and imaginary part of shape "
                             f"{imag.shape} differ")
        if real.device != imag.device:
            raise ShapeError(f"ComplexTensor: real part on {real.device} and imaginary part on {imag.device}")
        self._re = real
        self._im = imag

    # -- metadata ---------------------------------------------------------------------------
    @property
    def real(self) -> Tensor:
        """The real part (a float32 tensor; a view of the input of ``view_as_complex``)."""
        return self._re

    @property
    def imag(self) -> Tensor:
        """The imaginary part (a float32 tensor; a view of the input of ``view_as_complex``)."""
        return self._im

    @property
    def shape(self) -> tuple:
        """The shape in complex elements."""
        return self._re.shape

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return self._re.ndim

    @property
    def dtype(self) -> ComplexDType:
        """Always ``helios.complex64``."""
        return complex64

    @property
    def device(self):
        """Where both parts live."""
        return self._re.device

    def __repr__(self) -> str:
        try:
            body = np.array2string(self.numpy(), precision=4, separator=", ", threshold=64)
        except Exception as e:  # noqa: BLE001 - never let repr raise
            body = f"<unreadable: {e}>"
        return f"tensor({body}, dtype=complex64, device='{self.device}')"

    # -- shape ops: the same op on both parts ---------------------------------------------------
    def view(self, *shape) -> ComplexTensor:
        """The same elements with a new shape, without copying (a ShapeError when the strides do
        not allow it, as for a real tensor)."""
        return ComplexTensor(self._re.view(*shape), self._im.view(*shape))

    def reshape(self, *shape) -> ComplexTensor:
        """The same elements with a new shape (a copy where a view is not possible)."""
        return ComplexTensor(self._re.reshape(*shape), self._im.reshape(*shape))

    def unsqueeze(self, dim: int) -> ComplexTensor:
        """A size-1 dim inserted at ``dim``."""
        return ComplexTensor(self._re.unsqueeze(dim), self._im.unsqueeze(dim))

    def __getitem__(self, idx) -> ComplexTensor:
        """Indexing and slicing over the complex dims (anything a real tensor accepts)."""
        return ComplexTensor(self._re[idx], self._im[idx])

    # -- arithmetic ---------------------------------------------------------------------------
    def __mul__(self, other):
        parts = _real_parts(other)
        if parts is None:
            return NotImplemented
        c, d = parts
        a, b = self._re, self._im
        if d is None:
            return ComplexTensor(a * c, b * c)
        # (a + bi)(c + di) = (ac - bd) + (ad + bc)i
        return ComplexTensor(a * c - b * d, a * d + b * c)

    __rmul__ = __mul__  # complex multiplication commutes

    def __add__(self, other):
        parts = _real_parts(other)
        if parts is None:
            return NotImplemented
        c, d = parts
        re = self._re + c
        # a real operand may broadcast the result to a larger shape; the imaginary part must follow
        im = self._im + d if d is not None else self._im.expand(*re.shape)
        return ComplexTensor(re, im)

    __radd__ = __add__

    def __neg__(self) -> ComplexTensor:
        return ComplexTensor(-self._re, -self._im)

    def __sub__(self, other):
        parts = _real_parts(other)
        if parts is None:
            return NotImplemented
        c, d = parts
        re = self._re - c
        im = self._im - d if d is not None else self._im.expand(*re.shape)
        return ComplexTensor(re, im)

    def __rsub__(self, other):
        parts = _real_parts(other)
        if parts is None:
            return NotImplemented
        c, d = parts
        re = c - self._re
        im = d - self._im if d is not None else (-self._im).expand(*re.shape)
        return ComplexTensor(re, im)

    def abs(self) -> Tensor:
        """|z| = sqrt(re² + im²) as a float32 tensor (exact to rounding for |z| between about
        1e-19 and 1e19, where re² + im² neither underflows nor overflows float32)."""
        r2 = self._re * self._re + self._im * self._im
        nonzero = r2 > 0
        # sqrt's gradient at 0 is infinite and 0 * inf is nan: take the root of 1 where |z| is 0
        # and select 0 there instead, so the gradient at 0 is 0, as PyTorch's sgn(0) gives
        return F.where(nonzero, F.sqrt(F.where(nonzero, r2, 1.0)), 0.0)

    def angle(self) -> Tensor:
        """The argument atan2(im, re) in (-pi, pi] as a float32 tensor (0 at 0, as in PyTorch)."""
        return _Angle.apply(self._re, self._im)

    def conj(self) -> ComplexTensor:
        """The complex conjugate re - im·i (resolved, not PyTorch's lazy conjugate bit)."""
        return ComplexTensor(self._re, -self._im)

    # -- moves ----------------------------------------------------------------------------------
    def to(self, *args, **kwargs) -> ComplexTensor:
        """Both parts on another device: ``to(device)``, ``to(device=...)``, ``to(other_complex)``;
        ``to(helios.complex64)`` changes nothing.  A real dtype is refused: take ``.real``,
        ``.imag`` or ``view_as_real`` to get real values."""
        rest = []
        for a in args:
            if isinstance(a, ComplexTensor):
                rest.append(a.device)
            elif a is not complex64:
                rest.append(a)
        if kwargs.get("dtype") is complex64:
            kwargs.pop("dtype")
        device, dtype, copy = device_transfer.parse_to_args(tuple(rest), dict(kwargs))
        if dtype is not None:
            raise DTypeError(f"to: a complex64 tensor cannot be cast to {dtype}; take .real, .imag or view_as_real(z)")
        re, im = self._re.to(device, copy=copy), self._im.to(device, copy=copy)
        # the same tensor when nothing moves, as PyTorch's to() gives
        return self if re is self._re and im is self._im else ComplexTensor(re, im)

    def numpy(self) -> np.ndarray:
        """A host copy as a numpy complex64 array."""
        out = np.empty(self.shape, dtype=np.complex64)
        out.real = self._re.numpy()
        out.imag = self._im.numpy()
        return out

    # -- everything else ------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # only reached for names the class lacks (Tensor methods such as sum or matmul, and the
        # private fields helios.functional reads from a real tensor): one error saying what works
        what = f"ComplexTensor.{name}" if not name.startswith("_") else "this operation"
        raise ComplexUnsupportedError(what)


_OPERATORS = {"__matmul__": "z @ w", "__rmatmul__": "w @ z", "__truediv__": "z / w", "__rtruediv__": "w / z",
              "__floordiv__": "z // w", "__rfloordiv__": "w // z", "__mod__": "z % w", "__pow__": "z ** w",
              "__rpow__": "w ** z", "__eq__": "z == w", "__ne__": "z != w", "__lt__": "z < w", "__le__": "z <= w",
              "__gt__": "z > w", "__ge__": "z >= w", "__setitem__": "z[i] = v", "__bool__": "bool(z)",
              "__len__": "len(z)", "__iter__": "iterating over z", "__float__": "float(z)", "__int__": "int(z)",
              "__complex__": "complex(z)", "__array__": "numpy.asarray(z) (use z.numpy())"}


def _unsupported(name: str):
    def method(self, *args, **kwargs):
        raise ComplexUnsupportedError(_OPERATORS[name])

    method.__name__ = name
    method.__doc__ = "Not supported on a complex tensor (raises ComplexUnsupportedError)."
    return method


# Operators Python would otherwise answer with its own message (or, for == and bool, with a
# silently wrong identity result): each raises the one error instead.
for _name in _OPERATORS:
    setattr(ComplexTensor, _name, _unsupported(_name))
del _name


class _Angle(Function):
    """atan2(im, re): the forward on the host (no atan2 kernel exists), the backward on the device."""

    @staticmethod
    def forward(ctx, re, im):
        ctx.save_for_backward(re, im)
        a = np.arctan2(im.numpy(), re.numpy()).astype(np.float32)
        return _host_to_tensor(a, dtype=dt.float32, device=re.device)

    @staticmethod
    def backward(ctx, g):
        re, im = ctx.saved_tensors
        r2 = re * re + im * im
        zero = r2 == 0
        # d atan2(im, re) = (re·dim - im·dre) / |z|²; PyTorch gives 0 at z = 0 (where(self == 0, 0, ...))
        inv = F.where(zero, 0.0, 1.0 / F.where(zero, 1.0, r2))
        return -g * im * inv, g * re * inv


def polar(abs: Tensor, angle: Tensor) -> ComplexTensor:  # noqa: A002 - PyTorch's argument names
    """The complex tensor abs·(cos(angle) + i·sin(angle)) (``torch.polar``), broadcasting
    ``abs`` against ``angle``; both float32 tensors (the result is complex64)."""
    for what, t in (("abs", abs), ("angle", angle)):
        if not isinstance(t, Tensor):
            raise TypeError(f"polar: {what} must be a helios.Tensor, got {type(t).__name__}")
    if abs.dtype is not dt.float32 or angle.dtype is not dt.float32:
        raise DTypeError(f"polar: expected float32 tensors for abs and angle (a complex64 result), got "
                         f"{abs.dtype} and {angle.dtype}")
    return ComplexTensor(abs * F.cos(angle), abs * F.sin(angle))


def view_as_complex(x: Tensor) -> ComplexTensor:
    """``x`` of shape (..., 2), read as (real, imag) pairs: a complex64 tensor of shape (...)
    (``torch.view_as_complex``).  ``x`` must be float32 with a last dim of size 2 and stride 1,
    as PyTorch requires; ``.real`` and ``.imag`` of the result are views of ``x``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"view_as_complex: expected a helios.Tensor, got {type(x).__name__}")
    if x.dtype is not dt.float32:
        raise DTypeError(f"view_as_complex is only supported for float32 tensors in Helios (complex64), got a "
                         f"tensor of dtype {x.dtype}")
    if x.ndim == 0:
        raise ShapeError("view_as_complex: the input tensor must have one or more dimensions")
    if x.shape[-1] != 2:
        raise ShapeError(f"view_as_complex: the tensor must have a last dimension of size 2, got shape {x.shape}")
    if x.stride(-1) != 1:
        # Helios would not need it (the parts are two strided views), but PyTorch refuses such an
        # input, and code that runs here should run there
        raise ShapeError(f"view_as_complex: the tensor must have a last dimension with stride 1, got strides "
                         f"{x.stride()}; call .contiguous() first")
    return ComplexTensor(x[..., 0], x[..., 1])


def view_as_real(z: ComplexTensor) -> Tensor:
    """A float32 tensor of shape ``z.shape + (2,)`` holding (real, imag) pairs
    (``torch.view_as_real``); differentiable (a new tensor, not a view of ``z``)."""
    if not isinstance(z, ComplexTensor):
        raise TypeError(f"view_as_real is only supported for complex tensors, got {type(z).__name__}"
                        + (f" of dtype {z.dtype}" if isinstance(z, Tensor) else ""))
    return F.stack([z._re, z._im], dim=-1)
