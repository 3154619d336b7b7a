"""helios.nn.functional: the functional ops under PyTorch's path (``torch.nn.functional``).

Every public function of :mod:`helios.functional` is reachable here, looked up when it is
asked for, so ops added there later appear here too (``F.relu``, ``F.gelu``, ``F.softmax``,
``F.cross_entropy``, ``F.layer_norm``, ``F.linear``, ``F.embedding``, ``F.dropout`` ...):
``import helios.nn.functional as F`` as in PyTorch.  Helios's functional ops already carry
PyTorch's names; where ``torch.nn.functional``'s signature has an extra argument (the
``inplace=`` flag of ``relu`` and ``dropout``), the function here takes it.  Sparse attention
(``block_sparse_attention``, ``dilated_attention``, ``BlockPattern``) comes from
:mod:`helios.attention`.
"""

from __future__ import annotations

import types as _types

import helios.functional as _hf
from helios.attention import BlockPattern, block_sparse_attention, dilated_attention  # noqa: F401  (re-exports)


def relu(input, inplace: bool = False):
    """max(input, 0).  ``inplace`` is accepted for PyTorch code and changes nothing: the result
    is a new tensor (the tape records no in-place ops on tensors that need gradients)."""
    return _hf.relu(input)


def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """Zero each element with probability ``p`` and scale the rest by 1 / (1 - p) when ``training``.
    ``inplace`` is accepted for PyTorch code; the result is a new tensor."""
    return _hf.dropout(input, p, training)


_OWN = {"relu", "dropout", "BlockPattern", "block_sparse_attention", "dilated_attention"}


def _public(name: str, value) -> bool:
    if name.startswith("_") or isinstance(value, (_types.ModuleType, type)) or not callable(value):
        return False
    return (getattr(value, "__module__", None) or "").startswith("helios")


def __getattr__(name: str):
    # Looked up on each access: whatever helios.functional defines, now or later, is here.
    if not name.startswith("_"):
        value = getattr(_hf, name, None)
        if value is not None and not isinstance(value, _types.ModuleType):
            return value
    raise AttributeError(f"module 'helios.nn.functional' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_OWN | {n for n, v in vars(_hf).items() if _public(n, v)})
