"""helios.nn.utils: ``clip_grad_norm_`` under PyTorch's path (``torch.nn.utils``).

``nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` as nanoGPT, minGPT and llm.c call it.
The L2 case is :func:`helios.optim.clip_grad_norm_` (one reduction per flat AdamW gradient
buffer, the clip coefficient kept on the device); this module adds PyTorch's signature around
it: a single tensor as ``parameters``, the infinity norm, and ``error_if_nonfinite``.
"""

from __future__ import annotations

import math

import helios.functional as F
from helios import dtypes as dt
from helios import optim as _optim
from helios.autograd.tape import no_grad
from helios.tensor import Tensor

__all__ = ["clip_grad_norm_"]


def _grads(parameters) -> list:
    if isinstance(parameters, Tensor):  # PyTorch takes one tensor as well as an iterable of them
        parameters = [parameters]
    params = []
    for p in parameters:
        if not isinstance(p, Tensor):
            raise TypeError(f"clip_grad_norm_: parameters must be helios Tensors, got {type(p).__name__}")
        if p.grad is not None:
            params.append(p)
    return params


def _total_norm(params: list, norm_type: float) -> Tensor:
    """The norm of the per-gradient norms (PyTorch's definition of the total norm), float32."""
    per = [F.to(F.norm(F.to(p.grad, dt.float32), p=norm_type), dt.float32) for p in params]
    return F.norm(F.stack(per), p=norm_type)


@no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> Tensor:
    """Scale the gradients of ``parameters`` (an iterable of tensors, or one tensor) in place so
    that their total norm is at most ``max_norm``; returns the total norm before clipping, a
    float32 scalar tensor (0 when no parameter has a gradient).

    As in PyTorch, each gradient is multiplied by min(1, max_norm / (total_norm + 1e-6)).
    ``norm_type``: 2.0 (the L2 norm of all gradients together) or ``inf`` (the largest absolute
    value; the string "inf" too).  ``error_if_nonfinite``: raise a RuntimeError, gradients left
    untouched, when the total norm is nan or inf (this reads the norm on the host); otherwise a
    non-finite norm scales the gradients by a non-finite coefficient, as PyTorch does.
    ``foreach`` (None, True or False) chooses between two PyTorch implementations with equal
    results; Helios has one, which already reduces each flat gradient buffer in one dispatch."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"clip_grad_norm_: foreach must be None, True or False, got {foreach!r}")
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type!r}") from None
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
    max_norm = float(max_norm)
    params = _grads(parameters)
    if not params:
        return _optim.clip_grad_norm_(params, max_norm)  # its zero norm, nothing to scale
    if error_if_nonfinite or norm_type == math.inf:
        total = _total_norm(params, norm_type)
        if error_if_nonfinite and not math.isfinite(total.item()):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                               "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
    if norm_type == 2.0:
        return _optim.clip_grad_norm_(params, max_norm)
    # The infinity norm: PyTorch's coefficient, applied on the device (no host read of the norm).
    coef = F.clamp(F.rdiv(total + 1e-6, max_norm), max=1.0)
    for p in params:
        F.mul_(p.grad, F.to(coef, p.grad.dtype))
    return total
