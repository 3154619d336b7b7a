"""helios.nn.init: PyTorch's parameter initialisers (``torch.nn.init``).

Each function fills its tensor (a ``Parameter`` included) in place, with gradient recording
off, and returns that same tensor, as PyTorch's do: ``nn.init.normal_(m.weight, 0.0, 0.02)``,
``nn.init.zeros_(m.bias)``, ``nn.init.trunc_normal_(w, std=0.02, a=-0.06, b=0.06)``.

Random fills draw from Helios' own Philox stream (``generator``, by default the one
``helios.manual_seed`` seeds), so a seed makes them reproducible on any device; the values
differ from PyTorch's for the same seed (a different generator), the distributions do not.
A tensor in host memory ("cpu") is drawn on the default device and copied in.
"""

from __future__ import annotations

import math
import warnings

import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios.autograd.tape import no_grad
from helios.random import Generator, default_generator
from helios.tensor import Tensor

__all__ = [
    "calculate_gain", "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
]

_RNG_UNIFORM, _RNG_NORMAL = 0, 1  # the modes of the device's Philox kernel (helios._kernels.rng)


def _check_tensor(tensor, op: str, floating: bool = True) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{op}: tensor must be a helios Tensor, got {type(tensor).__name__}")
    if floating and tensor.dtype.kind != "float":
        raise TypeError(f"{op}: tensor must be floating point, got {tensor.dtype.name}")


def _draw(tensor: Tensor, mode: int, p0: float, p1: float, generator, op: str, dtype=None) -> Tensor:
    """A fresh random tensor of ``tensor``'s shape from the next offset of ``generator``'s stream."""
    if generator is not None and not isinstance(generator, Generator):
        raise TypeError(f"{op}: generator must be a helios.random.Generator, got {type(generator).__name__}")
    seed, offset = (generator or default_generator()).next_offset()
    # A host tensor runs no kernels: the draw happens on the default device, copy_ brings it over.
    rt = None if tensor.is_cpu else tensor.untyped_storage().rt
    return K.rng(tensor.shape, dtype or tensor.dtype, mode, seed, offset, float(p0), float(p1), rt)


def _fill_from(tensor: Tensor, values: Tensor) -> Tensor:
    with no_grad():  # an initialiser is not part of the graph, even on a parameter that requires grad
        F.copy_(tensor, values)
    return tensor


def calculate_gain(nonlinearity: str, param=None) -> float:
    """The recommended gain for ``nonlinearity`` (PyTorch's table): 1 for linear, conv and sigmoid,
    5/3 for tanh, sqrt(2) for relu, sqrt(2 / (1 + slope^2)) for leaky_relu (``param``: the
    negative slope, default 0.01) and 3/4 for selu."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                        "conv_transpose3d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, (int, float)) and not isinstance(param, bool):
            slope = float(param)
        else:
            raise ValueError(f"calculate_gain: param must be a number (the negative slope), got {param!r}")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    """Fill ``tensor`` with samples of U[a, b) in place; returns ``tensor``."""
    _check_tensor(tensor, "uniform_")
    if not a <= b:
        raise ValueError(f"uniform_: a must not exceed b, got a={a}, b={b}")
    return _fill_from(tensor, _draw(tensor, _RNG_UNIFORM, a, b, generator, "uniform_"))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    """Fill ``tensor`` with samples of N(mean, std^2) in place; returns ``tensor``."""
    _check_tensor(tensor, "normal_")
    if not std >= 0:
        raise ValueError(f"normal_: std must be >= 0, got {std}")
    return _fill_from(tensor, _draw(tensor, _RNG_NORMAL, mean, std, generator, "normal_"))


# Giles' single-precision approximation of erfinv ("Approximating the erfinv function", GPU
# Computing Gems, 2011): relative error below 3e-7 on (-1, 1), from log, sqrt and two
# polynomials, all ops Helios has on the device.  Coefficients from the highest power down.
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                   -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                0.00943887047, 1.00167406, 2.83297682)


def _horner(coefs, w: Tensor) -> Tensor:
    p = w * coefs[0] + coefs[1]
    for c in coefs[2:]:
        p = p * w + c
    return p


def _erfinv(x: Tensor) -> Tensor:
    """erfinv of a float32 tensor with values in [-1, 1] (+-1 give +-inf)."""
    w = F.neg(F.log((1.0 - x) * (1.0 + x)))
    central = _horner(_ERFINV_CENTRAL, w - 2.5)
    tail = _horner(_ERFINV_TAIL, F.sqrt(w) - 3.0)
    return F.where(w < 5.0, central, tail) * x


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None) -> Tensor:
    """Fill ``tensor`` in place with samples of N(mean, std^2) truncated to [a, b]; returns ``tensor``.

    ``a`` and ``b`` are absolute bounds, not multiples of ``std`` (as in PyTorch).  Drawn by
    PyTorch's method: a uniform draw between the normal CDF at a and at b, mapped through the
    inverse CDF, so every draw lands in [a, b] with no rejection loop; a mean more than 2 std
    outside [a, b] warns, as PyTorch does, because float32 then resolves the CDF too coarsely."""
    _check_tensor(tensor, "trunc_normal_")
    mean, std, a, b = float(mean), float(std), float(a), float(b)
    if not std > 0:
        raise ValueError(f"trunc_normal_: std must be > 0, got {std}")
    if not a < b:
        raise ValueError(f"trunc_normal_: a must be below b, got a={a}, b={b}")
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn("mean is more than 2 std from [a, b] in nn.init.trunc_normal_. "
                      "The distribution of values may be incorrect.", stacklevel=2)
    lo, hi = _norm_cdf((a - mean) / std), _norm_cdf((b - mean) / std)
    with no_grad():
        # erf(z / sqrt(2)) = 2 * cdf(z) - 1: draw erf's argument uniformly, invert it, and clamp
        # to [a, b] because the inverse reaches +-inf at +-1 and rounds near the bounds.
        u = _draw(tensor, _RNG_UNIFORM, 2 * lo - 1, 2 * hi - 1, generator, "trunc_normal_", dt.float32)
        z = F.clamp(_erfinv(u) * (std * math.sqrt(2.0)) + mean, min=a, max=b)
    return _fill_from(tensor, z)


def constant_(tensor: Tensor, val: float) -> Tensor:
    """Fill ``tensor`` with ``val`` in place; returns ``tensor``."""
    _check_tensor(tensor, "constant_", floating=False)
    with no_grad():
        F.fill_(tensor, val)
    return tensor


def ones_(tensor: Tensor) -> Tensor:
    """Fill ``tensor`` with ones in place; returns ``tensor``."""
    _check_tensor(tensor, "ones_", floating=False)
    return constant_(tensor, 1)


def zeros_(tensor: Tensor) -> Tensor:
    """Fill ``tensor`` with zeros in place; returns ``tensor``."""
    _check_tensor(tensor, "zeros_", floating=False)
    return constant_(tensor, 0)


def _fans(tensor: Tensor, op: str) -> tuple[int, int]:
    """(fan_in, fan_out) as PyTorch counts them: dims 1 and 0 times the product of the rest."""
    if tensor.ndim < 2:
        raise ValueError(f"{op}: fan in and fan out need a tensor of at least 2 dims, got shape {tensor.shape}")
    receptive = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _empty_noop(tensor: Tensor) -> bool:
    if tensor.numel() == 0:
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=3)
        return True
    return False


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    """Glorot uniform: U[-bound, bound) with bound = gain * sqrt(6 / (fan_in + fan_out)); in place."""
    _check_tensor(tensor, "xavier_uniform_")
    fan_in, fan_out = _fans(tensor, "xavier_uniform_")
    if _empty_noop(tensor):
        return tensor
    bound = math.sqrt(3.0) * gain * math.sqrt(2.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    """Glorot normal: N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)); in place."""
    _check_tensor(tensor, "xavier_normal_")
    fan_in, fan_out = _fans(tensor, "xavier_normal_")
    if _empty_noop(tensor):
        return tensor
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


def _kaiming_std(tensor: Tensor, a, mode: str, nonlinearity: str, op: str) -> float:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"{op}: mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan_in, fan_out = _fans(tensor, op)
    return calculate_gain(nonlinearity, a) / math.sqrt(fan_in if mode == "fan_in" else fan_out)


def kaiming_uniform_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator=None) -> Tensor:
    """He uniform: U[-bound, bound) with bound = sqrt(3) * gain / sqrt(fan), the gain of
    ``nonlinearity`` (``a``: leaky_relu's negative slope), fan from ``mode``; in place.
    (PyTorch's ``nn.Linear`` starts as ``kaiming_uniform_(w, a=sqrt(5))``.)"""
    _check_tensor(tensor, "kaiming_uniform_")
    if _empty_noop(tensor):
        return tensor
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity, "kaiming_uniform_")
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                    generator=None) -> Tensor:
    """He normal: N(0, std^2) with std = gain / sqrt(fan) (see ``kaiming_uniform_``); in place."""
    _check_tensor(tensor, "kaiming_normal_")
    if _empty_noop(tensor):
        return tensor
    return normal_(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity, "kaiming_normal_"), generator)
