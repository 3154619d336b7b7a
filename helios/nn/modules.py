"""The modules of helios.nn: ``Module``, PyTorch's layers, activations, losses and containers, and a GPT.

``Module`` registers parameters and sub-modules on attribute assignment (like
PyTorch).  The layers take PyTorch's constructor arguments (``device=`` and ``dtype=``
included) and name their parameters as PyTorch does, so state-dict keys match
``torch.nn``'s for the same module tree.  Weights start as GPT-2 initialises them
(normal(0, 0.02), ``std=`` and ``seed=`` keywords) rather than PyTorch's
Kaiming-uniform: load a state dict for PyTorch's exact values.

The GPT follows GPT-2: learned position embeddings, pre-LayerNorm blocks, tied
input/output embeddings, and GPT-2's initialisation (normal(0, 0.02), residual
projections scaled by 1/sqrt(2 * n_layer)).
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np

import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios import fused_kernels
from helios.device_transfer import parse_to_args
from helios.autograd.tape import is_grad_enabled, no_grad
from helios.creation import normal, ones, zeros
from helios.errors import CheckpointError
from helios.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that a Module registers as a learnable parameter."""

    def __init__(self, data: Tensor, requires_grad: bool = True):
        super().__init__(data.untyped_storage(), data.shape, data.stride(), data.storage_offset(), data.dtype)
        self.requires_grad = requires_grad


class Module:
    """Base class of layers and models."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before assigning attributes")
        if isinstance(value, Tensor) and not isinstance(value, Parameter) and name in self._buffers:
            self._buffers[name] = value  # a new value for a buffer stays a buffer (as in PyTorch)
            object.__setattr__(self, name, value)
            return
        for d in (self._parameters, self._modules, self._buffers):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        # Only reached when normal lookup fails: children registered under names that are not
        # attributes (a ModuleDict's keys, a Sequential's "0", "1" ...).
        d = self.__dict__
        for table in ("_parameters", "_modules", "_buffers"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        for table in ("_parameters", "_modules", "_buffers"):
            self.__dict__[table].pop(name, None)
        self.__dict__.pop(name, None)

    def add_module(self, name: str, module: "Module | None") -> None:
        """Register ``module`` as the child ``name`` (PyTorch's add_module)."""
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"module name must be a non-empty string without '.', got {name!r}")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        if name in self.__dict__ and name not in self._modules:
            raise KeyError(f"add_module: attribute {name!r} already exists")
        for table in (self._parameters, self._buffers):
            table.pop(name, None)
        self.__dict__.pop(name, None)  # the child is reached through __getattr__
        self._modules[name] = module

    register_module = add_module

    def register_parameter(self, name: str, param: "Parameter | None") -> None:
        """Register ``param`` under ``name`` (None: the name exists with no parameter, as a bias=False layer)."""
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter({name!r}): expected a helios.nn.Parameter or None, got {type(param).__name__}")
        setattr(self, name, param)

    def register_buffer(self, name: str, value: Tensor, persistent: bool = True) -> None:
        """A tensor that is part of the module's state but not a parameter (not in state_dict)."""
        object.__setattr__(self, name, value)
        self._buffers[name] = value

    def named_children(self):
        for name, m in self._modules.items():
            if m is not None:
                yield name, m

    def children(self):
        for _, m in self.named_children():
            yield m

    def apply(self, fn) -> "Module":
        """Call ``fn`` on every sub-module (children first) and on this module."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({name}): " + repr(m).replace("\n", "\n  ") for name, m in self.named_children()]
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        head = [extra] if extra else []
        return f"{type(self).__name__}(\n  " + "\n  ".join(head + lines) + "\n)"

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, m in self.named_children():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "", remove_duplicate: bool = True):
        """(name, parameter) pairs, each parameter once (tied weights under their first name);
        ``remove_duplicate=False`` gives a parameter held under several names under each of them."""
        return self._named_tensors("_parameters", prefix, remove_duplicate)

    def _named_tensors(self, table: str, prefix: str, remove_duplicate: bool = True):
        seen = set()
        for mname, m in self.named_modules(prefix):
            for tname, t in getattr(m, table).items():
                if remove_duplicate and id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mname}.{tname}" if mname else tname), t

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = ""):
        """(name, tensor) pairs of every registered buffer, each once."""
        return self._named_tensors("_buffers", prefix)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def to(self, *args, **kwargs) -> "Module":
        """Move and/or cast every parameter and buffer in place, with the forms of ``Tensor.to``:
        ``to("cpu")``, ``to("vulkan:0")``, ``to(helios.bfloat16)``, ``to(device, dtype)``,
        ``to(tensor)``, ``to(device=..., dtype=...)``.  A dtype applies to floating-point tensors
        only.  The parameters stay the same objects (an optimizer made earlier keeps working);
        their gradients move with them."""
        device, dtype, _ = parse_to_args(args, dict(kwargs), "Module.to")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"Module.to: only floating-point dtypes can be given, got {dtype.name}")
        if device is None and dtype is None:
            return self

        def convert(t: Tensor) -> None:
            new = t.detach()
            if device is not None:
                new = F.to(new, device=device)
            if dtype is not None and new.dtype.is_floating_point:
                new = F.to(new, dtype)
            if new.untyped_storage() is not t.untyped_storage() or new.dtype is not t.dtype:
                t.data = new

        seen = set()
        with no_grad():
            for t in [p for p in self.parameters()] + [b for _, b in self.named_buffers()]:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                convert(t)
                if getattr(t, "grad", None) is not None:
                    convert(t.grad)
        return self

    def cpu(self) -> "Module":
        return self.to("cpu")

    def float(self) -> "Module":
        return self.to(dt.float32)

    def half(self) -> "Module":
        return self.to(dt.float16)

    def bfloat16(self) -> "Module":
        return self.to(dt.bfloat16)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the parameters' gradients (``set_to_none``, the default, as PyTorch's), or fill
        them with zeros in place (the tensors stay: an optimizer's flat gradient slots keep theirs)."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                with no_grad():
                    F.zero_(p.grad)

    def state_dict(self) -> "OrderedDict[str, Tensor]":
        """Name -> parameter tensor (detached; shares storage).  A parameter held under several
        names (tied weights, a shared module) is listed under each of them, as PyTorch lists it."""
        return OrderedDict((n, p.detach()) for n, p in self.named_parameters(remove_duplicate=False))

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy tensors (or numpy arrays) from ``state`` into the parameters.

        With ``strict`` every key must match; the error lists missing keys, unexpected
        keys and shape mismatches together, and nothing is copied unless all is well.  A
        parameter held under several names (tied weights) loads from any one of them: a state
        dict that lists it under each name (PyTorch's, this module's) and one that lists it
        under one name both load strictly; it is missing only when none of its names is there."""
        named = list(self.named_parameters(remove_duplicate=False))
        own = dict(named)
        aliases: dict[int, list[str]] = {}
        for n, p in named:
            aliases.setdefault(id(p), []).append(n)
        missing = [k for k, p in named if not any(a in state for a in aliases[id(p)])]
        unexpected = [k for k in state if k not in own]
        mismatched = [f"{k}: checkpoint {tuple(np.shape(state[k]) if not isinstance(state[k], Tensor) else state[k].shape)} "
                      f"vs model {own[k].shape}" for k in own if k in state and
                      tuple(state[k].shape if isinstance(state[k], Tensor) else np.shape(state[k])) != own[k].shape]
        if mismatched or (strict and (missing or unexpected)):
            parts = []
            if missing:
                parts.append(f"missing keys: {', '.join(missing)}")
            if unexpected:
                parts.append(f"unexpected keys: {', '.join(unexpected)}")
            if mismatched:
                parts.append(f"shape mismatches: {'; '.join(mismatched)}")
            raise CheckpointError(f"load_state_dict into {type(self).__name__} failed: " + " | ".join(parts))
        with no_grad():
            for names in aliases.values():
                given = next((a for a in names if a in state), None)
                if given is not None:  # one copy per tensor, from the first of its names given
                    F.copy_(own[given], state[given])


def _new_param(t: Tensor, device, dtype, requires_grad: bool = True) -> "Parameter":
    """A parameter from a freshly made float32 tensor, cast to ``dtype`` and put on ``device``."""
    if dtype is not None:
        t = F.to(t, dtype)
    if device is not None:
        t = F.to(t, device=device)
    return Parameter(t, requires_grad)


def _shape_tuple(shape) -> tuple:
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


class Linear(Module):
    """y = x @ W^T + b, W of shape [out_features, in_features] (PyTorch's ``nn.Linear``).

    The weight starts as normal(0, ``std``) (GPT-2's 0.02) and the bias as zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 std: float = 0.02, seed: int | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _new_param(normal(0.0, std, (out_features, in_features), seed=seed), device, dtype)
        self.bias = _new_param(zeros(out_features), device, dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of size ``embedding_dim`` (PyTorch's ``nn.Embedding``).

    The table starts as normal(0, ``std``) (GPT-2's 0.02; PyTorch's is 1.0).  ``padding_idx``:
    that row starts at zero and its gradient is zeroed after every backward, as in PyTorch.
    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not supported."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, max_norm=None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False, _weight=None,
                 _freeze: bool = False, device=None, dtype=None, *, std: float = 0.02, seed: int | None = None):
        super().__init__()
        for name, value, default in (("max_norm", max_norm, None), ("scale_grad_by_freq", scale_grad_by_freq, False),
                                     ("sparse", sparse, False)):
            if value != default:
                raise ValueError(f"Embedding({name}={value!r}) is not supported; leave {name} at {default!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} is outside [-{num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        if _weight is None:
            w = normal(0.0, std, (num_embeddings, embedding_dim), seed=seed)
            if padding_idx is not None:
                w[padding_idx] = 0.0
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"Embedding: _weight has shape {tuple(_weight.shape)}, expected "
                                 f"{(num_embeddings, embedding_dim)}")
            w = _weight.detach() if isinstance(_weight, Tensor) else K.from_numpy(np.asarray(_weight), dt.float32, None)
        self.weight = _new_param(w, device, dtype, requires_grad=not _freeze)
        if padding_idx is not None:
            self.weight.register_post_accumulate_grad_hook(self._zero_padding_grad)

    def _zero_padding_grad(self, p: Tensor) -> None:
        if p.grad is not None:
            with no_grad():
                p.grad[self.padding_idx] = 0.0

    @classmethod
    def from_pretrained(cls, embeddings, freeze: bool = True, padding_idx: int | None = None, **kwargs) -> "Embedding":
        """An Embedding whose table is ``embeddings`` (a copy), frozen unless ``freeze=False``."""
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx=padding_idx, _weight=F.clone(embeddings.detach()), _freeze=freeze, **kwargs)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class LayerNorm(Module):
    """LayerNorm over the last ``len(normalized_shape)`` dims (PyTorch's ``nn.LayerNorm``)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _shape_tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.weight = _new_param(ones(*self.normalized_shape), device, dtype) if elementwise_affine else None
        self.bias = _new_param(zeros(*self.normalized_shape), device, dtype) if elementwise_affine and bias else None

    def forward(self, x: Tensor, *, feeds_products: bool = False) -> Tensor:
        """LayerNorm of x; ``feeds_products``: F.layer_norm's (only autocast products read the
        result: under autocast it is stored in their dtype)."""
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, feeds_products=feeds_products)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"


_FINFO_EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2 over the last dims) + eps) * weight (PyTorch's ``nn.RMSNorm``);
    ``eps=None`` is the machine epsilon of the input's dtype, as in PyTorch."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _shape_tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.weight = _new_param(ones(*self.normalized_shape), device, dtype) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        n = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - n:]) != self.normalized_shape:
            raise ValueError(f"RMSNorm: input shape {x.shape} does not end with normalized_shape {self.normalized_shape}")
        eps = self.eps if self.eps is not None else _FINFO_EPS.get(x.dtype.name, _FINFO_EPS["float32"])
        dims = tuple(range(x.ndim - n, x.ndim))
        y = x * F.rsqrt(F.mean(x * x, dim=dims, keepdim=True) + eps)
        return y * self.weight if self.weight is not None else y

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    """Zero each element with probability ``p`` in training, scaling the rest by 1 / (1 - p)."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class GELU(Module):
    """GELU; ``approximate="tanh"`` is GPT-2's tanh form, ``"none"`` (PyTorch's default) the erf form."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(Module):
    """max(x, 0).  ``inplace`` is accepted and gives a new tensor (the tape records no in-place ops)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class SiLU(Module):
    """x * sigmoid(x) (swish).  ``inplace`` is accepted and gives a new tensor."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        silu = getattr(F, "silu", None)
        return silu(x) if silu is not None else x * F.sigmoid(x)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Softmax(Module):
    """softmax over ``dim`` (None: PyTorch's legacy choice, dim 0 for 0-, 1- and 3-d inputs, else 1)."""

    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        dim = self.dim if self.dim is not None else (0 if x.ndim in (0, 1, 3) else 1)
        return F.softmax(x, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Identity(Module):
    """Returns its input; takes (and ignores) any constructor arguments, as in PyTorch."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


# -- losses ----------------------------------------------------------------------------------------
_REDUCTIONS = ("mean", "sum", "none")


class _Loss(Module):
    """A loss module: PyTorch's ``reduction`` ("mean", "sum" or "none"), checked when built.
    ``size_average`` and ``reduce`` (deprecated in PyTorch) hold their places in the argument
    order but are refused, as ``helios.functional``'s losses refuse them."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__()
        name = type(self).__name__
        if size_average is not None or reduce is not None:
            raise TypeError(f"{name}: size_average and reduce are deprecated; use reduction='mean', 'sum' or 'none'")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction = reduction

    def _set_weight(self, weight) -> None:
        if weight is None:
            self.weight = None
            return
        if not isinstance(weight, Tensor):
            raise TypeError(f"{type(self).__name__}: weight must be a helios Tensor or None, got {type(weight).__name__}")
        self.register_buffer("weight", weight)  # a buffer so that Module.to moves it with the model

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}" if self.reduction != "mean" else ""


class MSELoss(_Loss):
    """Mean squared error between input and target (PyTorch's ``nn.MSELoss``; ``F.mse_loss``)."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(size_average, reduce, reduction)

    def forward(self, input: Tensor, target) -> Tensor:
        return F.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    """Mean absolute error between input and target (PyTorch's ``nn.L1Loss``; ``F.l1_loss``)."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(size_average, reduce, reduction)

    def forward(self, input: Tensor, target) -> Tensor:
        return F.l1_loss(input, target, reduction=self.reduction)


class NLLLoss(_Loss):
    """Negative log likelihood of log-probabilities at class indices (PyTorch's ``nn.NLLLoss``;
    ``F.nll_loss``): ``weight`` per class, targets equal to ``ignore_index`` count for nothing."""

    def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean"):
        super().__init__(size_average, reduce, reduction)
        self._set_weight(weight)
        self.ignore_index = ignore_index

    def forward(self, input: Tensor, target) -> Tensor:
        return F.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction)


class CrossEntropyLoss(_Loss):
    """Cross entropy of logits against class indices or class probabilities (PyTorch's
    ``nn.CrossEntropyLoss``; ``F.cross_entropy``): classes on dim 1 (dim 0 of a 1-D input),
    ``weight`` per class, index targets equal to ``ignore_index`` count for nothing.

    ``label_smoothing`` in [0, 1] mixes the target with the uniform distribution over the C
    classes as PyTorch does: (1 - s) * the loss at the target + s / C * the loss summed over
    every class (index targets), or probabilities (1 - s) * p + s / C (probability targets)."""

    def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(size_average, reduce, reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}")
        self._set_weight(weight)
        self.ignore_index = ignore_index
        self.label_smoothing = float(label_smoothing)

    def forward(self, input: Tensor, target) -> Tensor:
        if self.label_smoothing == 0.0:
            return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                                   reduction=self.reduction)
        return _smoothed_cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing)

    def extra_repr(self) -> str:
        parts = [super().extra_repr()] + (["ignore_index=" + str(self.ignore_index)] if self.ignore_index != -100 else [])
        parts += [f"label_smoothing={self.label_smoothing}"] if self.label_smoothing else []
        return ", ".join(p for p in parts if p)


def _smoothed_cross_entropy(input: Tensor, target, weight, ignore_index: int, reduction: str, s: float) -> Tensor:
    """PyTorch's label-smoothed cross entropy, composed from ``F.cross_entropy`` and ``log_softmax``."""
    if not isinstance(input, Tensor):
        raise TypeError(f"CrossEntropyLoss: input must be a helios Tensor, got {type(input).__name__}")
    if input.ndim == 0:
        raise ValueError("CrossEntropyLoss: input needs at least 1 dim (the classes), got a 0-d tensor")
    cdim = 0 if input.ndim == 1 else 1
    C = input.shape[cdim]
    if not isinstance(target, Tensor):
        arr = np.asarray(target)
        target = K.from_numpy(arr, input.dtype if arr.dtype.kind == "f" else dt.int64, input.untyped_storage().rt)
    if target.dtype.kind == "float":  # probabilities: smooth the target itself
        return F.cross_entropy(input, target * (1.0 - s) + s / C, weight=weight, reduction=reduction)
    # F.cross_entropy checks the shapes and the class range, and gives the loss at the target.
    nll = F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index, reduction=reduction)
    logp = F.log_softmax(input if input.dtype.kind == "float" else F.to(input, dt.float32), cdim)
    if weight is not None:
        logp = logp * F.reshape(F.to(weight, logp.dtype), tuple(C if d == cdim else 1 for d in range(input.ndim)))
    # The targets F.cross_entropy leaves out (ignore_index, and negative ones) are left out here too.
    valid = F.logical_and(F.ne(target, ignore_index), F.ge(target, 0))
    smooth = F.where(valid, F.neg(F.sum(logp, dim=cdim)), 0.0)
    if reduction == "none":
        return nll * (1.0 - s) + smooth * (s / C)
    total = F.sum(smooth)
    if reduction == "mean":  # over the kept targets' total weight, as the loss at the target is
        w = F.to(valid, total.dtype)
        if weight is not None:
            safe = F.reshape(F.where(valid, target, 0), (-1,))
            w = w * F.reshape(F.index_select(F.to(weight, total.dtype), 0, safe), target.shape)
        total = total / F.sum(w)
    return nll * (1.0 - s) + total * (s / C)


@dataclass
class GPTConfig:
    """Sizes of a GPT (GPT-2 naming)."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    attention: str = "auto"  # "dense", "flash" or "auto" (see CausalSelfAttention)

    def to_dict(self) -> dict:
        return asdict(self)


ATTENTION_KINDS = ("auto", "dense", "flash", "block_sparse:...", "dilated:...")
_SPARSE_KEYS = {"local": "window in tokens", "global": "leading tokens", "dilated": "block stride",
                "random": "random key blocks per query block", "block": "block size, a multiple of 64"}
# "auto" trains with the flash kernel from this context length on: below it the dense path's
# forward + backward is faster on lavapipe (bench/attention.py, 16 x 4 heads of 32, causal:
# flash 0.57x dense at T = 64, 0.82x at 128, 0.96x at 256, 1.04x at 512).  The forward alone
# (evaluation, sampling) is faster with flash at every length measured (1.19x-1.65x).
FLASH_MIN_TRAIN_T = 512


def parse_attention(spec: str):
    """(kind, pattern, block size) of an attention spec: ``auto``, ``dense``, ``flash``,
    ``dilated:segments=W1/W2,dilations=R1/R2`` (pattern: the two lists, see _parse_dilated) or
    ``block_sparse:KEY=N,...`` (pattern: a BlockPattern) with keys local (window in tokens), global
    (leading tokens every query sees and that see every key), dilated (key blocks a multiple
    of N blocks back), random (BigBird's random key blocks per query block) and block (the
    block size, 64 by default); the patterns given are combined (``|``).  A ValueError names
    what is wrong."""
    if spec in ("auto", "dense", "flash"):
        return spec, None, 0
    kind, _, rest = str(spec).partition(":")
    if kind == "dilated" and rest:
        return "dilated", _parse_dilated(spec, rest), 0
    if kind != "block_sparse" or not rest:
        raise ValueError(f"attention must be one of auto, dense, flash, block_sparse:KEY=N,... (keys "
                         f"{', '.join(_SPARSE_KEYS)}) or dilated:segments=W1/W2,dilations=R1/R2, got {spec!r}")
    from helios.attention import BlockPattern

    values = {}
    for item in rest.split(","):
        key, eq, val = item.partition("=")
        if key not in _SPARSE_KEYS or not eq or not val.isdigit() or int(val) <= 0:
            raise ValueError(f"attention {spec!r}: {item!r} is not KEY=N with N a positive integer and KEY one of "
                             + ", ".join(f"{k} ({what})" for k, what in _SPARSE_KEYS.items()))
        values[key] = int(val)
    block = values.pop("block", 64)
    makers = {"local": BlockPattern.local, "global": BlockPattern.global_, "dilated": BlockPattern.dilated,
              "random": BlockPattern.random}
    parts = [makers[k](n) for k, n in values.items()]
    if not parts:
        raise ValueError(f"attention {spec!r}: give at least one pattern (local, global, dilated or random)")
    pattern = parts[0]
    for p in parts[1:]:
        pattern = pattern | p
    if block % 64:
        raise ValueError(f"attention {spec!r}: block={block} must be a multiple of 64 (the flash kernels' tile)")
    pattern.block_mask(max(block, values.get("local", block)), block)  # a window under the block size fails here
    return "block_sparse", pattern, block


def _parse_dilated(spec: str, rest: str) -> tuple[list[int], list[int]]:
    """(segments, dilations) of ``dilated:segments=512/1024,dilations=1/2`` (LongNet's patterns,
    helios.attention.dilated_attention).  A pattern of dilation 1 is required: it keeps every
    token for every head, which a causal language model needs."""
    got = {}
    for item in rest.split(","):
        key, eq, val = item.partition("=")
        nums = val.split("/")
        if key not in ("segments", "dilations") or not eq or not all(n.isdigit() and int(n) > 0 for n in nums):
            raise ValueError(f"attention {spec!r}: {item!r} is not segments=W1/W2/... or dilations=R1/R2/... with "
                             "positive integers")
        got[key] = [int(n) for n in nums]
    segments, dilations = got.get("segments", []), got.get("dilations", [])
    if not segments or len(segments) != len(dilations):
        raise ValueError(f"attention {spec!r}: give segments and dilations, as many of each")
    if 1 not in dilations:
        raise ValueError(f"attention {spec!r}: give a pattern with dilation 1 (it keeps every token for every head)")
    return segments, dilations


class CausalSelfAttention(Module):
    """Multi-head self-attention with a causal mask.

    ``cfg.attention`` picks how the scores are computed: ``"dense"`` materialises the T x T
    scores (one fused scale + mask + softmax kernel and two matmuls), ``"flash"`` runs
    ``F.scaled_dot_product_attention``'s flash kernel (memory linear in T), ``"auto"`` takes
    flash where it is the faster of the two (see FLASH_MIN_TRAIN_T).  Both give the same
    result up to rounding; dropout on the attention weights needs the dense path.
    ``"block_sparse:local=256,global=64"`` (see :func:`parse_attention`) computes only the
    key blocks the pattern allows (helios.attention.block_sparse_attention): another model,
    which equals dense attention under the same element mask; ``"dilated:segments=W1/W2,
    dilations=R1/R2"`` is LongNet's dilated attention (helios.attention.dilated_attention).
    """

    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.attention, self.sparse_pattern, self.sparse_block = parse_attention(cfg.attention)
        self.context_parallel = None  # set by helios.schedule.context_parallel: ring attention over ranks
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, seed=seed)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer), seed=seed + 1)
        self.attn_dropout = Dropout(cfg.dropout)
        self.resid_dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """The attention's output projection of ``x``; with ``residual``, residual + that
        (the block's residual add, fused into the projection's matmul where it can be)."""
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = F.split_heads(self.c_attn(x), H)  # [B, H, T, D] views
        if self.context_parallel is not None:
            y = self.context_parallel.attention(q, k, v)
        elif self.attention == "block_sparse":
            from helios.attention import block_sparse_attention

            y = block_sparse_attention(q, k, v, pattern=self.sparse_pattern, block_size=self.sparse_block,
                                       is_causal=True)
        elif self.attention == "dilated":
            from helios.attention import dilated_attention

            segments, dilations = self.sparse_pattern
            y = dilated_attention(q, k, v, segments=segments, dilations=dilations, is_causal=True)
        elif self._flash(q):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # scale, causal mask (query i sees keys 0..i) and softmax in one kernel
            att = self.attn_dropout(F.attention_softmax(F.matmul(q, k.mT), 1.0 / math.sqrt(D), causal=True))
            y = F.matmul(att, v)
        y = y.transpose(1, 2).reshape(B, T, C)
        return project_residual(self.c_proj, y, residual, self.resid_dropout)

    def _flash(self, q: Tensor) -> bool:
        """Whether the attention of ``q`` ([B, H, T, D]) runs the flash kernel: always with "flash",
        with "auto" at inference, from FLASH_MIN_TRAIN_T tokens, or wherever the device has its own
        (tensor-core) flash kernels for q's dtype and head dim."""
        if self.attention == "dense" or (self.training and self.attn_dropout.p > 0):
            return False
        if self.attention == "flash" or not is_grad_enabled() or q.shape[2] >= FLASH_MIN_TRAIN_T:
            return True
        # q's storage holds its device's runtime: no device name to parse on every forward
        return q.untyped_storage().rt.has_flash(q.dtype.name, q.shape[3])


class MLP(Module):
    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias, seed=seed)
        self.gelu = GELU("tanh")
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer), seed=seed + 1)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """c_proj(gelu(c_fc(x))); with ``residual``, residual + that.  Where the parts are the
        plain ones, c_fc and the GELU run as one "linear+gelu" kernel and c_proj and the
        residual add as one "linear+residual" kernel, and backward multiplies by GELU's
        derivative in the product that makes the hidden gradient (helios.fused_kernels)."""
        plain_gelu = type(self.gelu) is GELU and self.gelu.approximate == "tanh"
        if (fused_kernels.ENABLED and residual is not None and plain_gelu and _plain_linear(self.c_fc)
                and _plain_linear(self.c_proj) and _identity(self.dropout)):
            return F.mlp_residual(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias, residual)
        if fused_kernels.ENABLED and _plain_linear(self.c_fc) and plain_gelu:
            h = F.linear_gelu(x, self.c_fc.weight, self.c_fc.bias)
        else:
            h = self.gelu(self.c_fc(x))
        return project_residual(self.c_proj, h, residual, self.dropout)


def _plain(m, cls) -> bool:
    """Whether ``m`` is a ``cls`` as the class defines it (no subclass, no replaced forward)."""
    return type(m) is cls and "forward" not in vars(m)


def _plain_linear(m) -> bool:
    """Whether ``m`` is a Linear whose forward is F.linear (no subclass, no replaced forward)."""
    return _plain(m, Linear)


def _identity(dropout) -> bool:
    """Whether ``dropout`` passes its input through: None, or a Dropout with p == 0 or in eval mode."""
    return dropout is None or (type(dropout) is Dropout and (dropout.p == 0 or not dropout.training))


def norm_for_product(norm, x: Tensor, product) -> Tensor:
    """norm(x) where ``product`` alone reads the result: a plain LayerNorm before a plain Linear
    (or ``product`` None: the caller's own autocast product, GPT's tied head) stores it in the
    autocast dtype the product rounds it to (F.layer_norm's ``feeds_products``: the same values
    for the product, half the bytes).  Any other pair runs norm(x)."""
    if _plain(norm, LayerNorm) and (product is None or _plain_linear(product)):
        return norm(x, feeds_products=True)
    return norm(x)


def embed_with_positions(wte, wpe, idx, pos: Tensor) -> Tensor:
    """wte(idx) + wpe(pos) (``pos`` [T]: the positions of idx's last dim): one "embedding+add"
    kernel each way where both are plain Embeddings (helios.functional.embedding_add, bit for bit
    the separate ops), else the modules' forwards and the add.  GPT's input embedding."""
    if _plain(wte, Embedding) and _plain(wpe, Embedding):
        return F.embedding_add(idx, wte.weight, pos, wpe.weight)
    return wte(idx) + wpe(pos)


def project_residual(proj, y: Tensor, residual: Tensor | None, dropout=None) -> Tensor:
    """dropout(proj(y)) (no ``dropout``: proj(y)), plus ``residual`` when given: one
    "linear+residual" kernel when the projection is a plain Linear and the dropout the identity
    (helios.fused_kernels), bit for bit the separate ops, which run otherwise.  A block's output
    projection with its residual add (GPT's c_proj, LLaMA's o_proj and down_proj)."""
    if residual is not None and fused_kernels.ENABLED and _plain_linear(proj) and _identity(dropout):
        return F.linear_residual(y, proj.weight, proj.bias, residual)
    out = proj(y) if dropout is None else dropout(proj(y))
    return out if residual is None else residual + out


class Block(Module):
    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, seed)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg, seed + 2)

    def forward(self, x: Tensor) -> Tensor:
        if fused_kernels.ENABLED and type(self.attn) is CausalSelfAttention and type(self.mlp) is MLP:
            # the residual adds ride in the projections' matmuls (helios.fused_kernels)
            # and each LayerNorm's output is stored as its product reads it (under autocast)
            x = self.attn(norm_for_product(self.ln_1, x, self.attn.c_attn), residual=x)
            return self.mlp(norm_for_product(self.ln_2, x, self.mlp.c_fc), residual=x)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(Module):
    """A GPT-2 style language model: ``model(idx, targets) -> (logits, loss)``."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = cfg
        # Each layer gets its own seed, so the weights do not depend on creation order.
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, seed=seed * 1000 + 1)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, seed=seed * 1000 + 2)
        self.drop = Dropout(cfg.dropout)
        self.h = ModuleList([Block(cfg, seed * 1000 + 10 + 10 * i) for i in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        # With context parallelism (helios.schedule.context_parallel) ``idx`` is this rank's
        # shard of each sequence and the positions are its tokens' global ones.
        self.context_parallel = None

    def forward(self, idx, targets=None):
        if not isinstance(idx, Tensor):
            idx = K.from_numpy(np.asarray(idx, np.int64), dt.int64, self.wte.weight.untyped_storage().rt)
        B, T = idx.shape
        cp = self.context_parallel
        if T * (cp.world if cp is not None else 1) > self.config.block_size:
            raise ValueError(f"sequence length {T * (cp.world if cp else 1)} exceeds block_size {self.config.block_size}")
        rt = self.wte.weight.untyped_storage().rt
        pos = cp.positions(T, rt) if cp is not None else position_ids(T, rt)
        x = self.drop(embed_with_positions(self.wte, self.wpe, idx, pos))
        for block in self.h:
            x = block(x)
        x = norm_for_product(self.ln_f, x, None)
        # the tied output embedding: x @ wte^T as a Linear's product, whose weight gradient goes
        # straight into the table's gradient slot (the embedding's backward then adds its own)
        logits = F.linear(x, self.wte.weight)
        loss = None
        if targets is not None:
            if not isinstance(targets, Tensor):
                targets = K.from_numpy(np.asarray(targets, np.int64), dt.int64, idx.untyped_storage().rt)
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * N (non-embedding-position params) + 12 * L * T * C."""
        c = self.config
        n = self.num_parameters() - self.wpe.weight.numel()
        return 6 * n + 12 * c.n_layer * c.block_size * c.n_embd


_pos_cache: dict = {}


def position_ids(T: int, rt) -> Tensor:
    """The int64 positions 0 .. T-1 on runtime ``rt``: a constant made once per (T, runtime) and kept,
    so a captured step uploads nothing (the embedding's backward groups indices on the host)."""
    key = (T, id(rt))
    t = _pos_cache.get(key)
    if t is None:
        t = _pos_cache[key] = K.from_numpy(np.arange(T, dtype=np.int64), dt.int64, rt)
    return t


def _index(i, n: int, what: str) -> int:
    i = operator.index(i)
    if not -n <= i < n:
        raise IndexError(f"{what} index {i} is out of range for {n} modules")
    return i % n


class Sequential(Module):
    """Modules called one after another: ``Sequential(m0, m1, ...)`` (children "0", "1", ...) or
    ``Sequential(OrderedDict(name=module, ...))``.  Indexing (a slice gives a Sequential),
    ``len``, iteration, ``append``, ``extend``, ``insert``, ``pop`` and ``del`` as in PyTorch."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], Mapping):
            for name, m in args[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def _items(self) -> list:
        return list(self._modules.items())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return type(self)(OrderedDict(self._items()[i]))
        return self._items()[_index(i, len(self), "Sequential")][1]

    def __setitem__(self, i, module: Module) -> None:
        self.add_module(self._items()[_index(i, len(self), "Sequential")][0], module)

    def __delitem__(self, i) -> None:
        mods = list(self._modules.values())
        del mods[i if isinstance(i, slice) else _index(i, len(mods), "Sequential")]
        self._modules.clear()  # renumbered "0", "1", ... as PyTorch does
        for j, m in enumerate(mods):
            self.add_module(str(j), m)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module: Module) -> "Sequential":
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable) -> "Sequential":
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> "Sequential":
        n = len(self)
        if not -n <= index <= n:
            raise IndexError(f"Sequential.insert: index {index} is out of range for {n} modules")
        mods = list(self._modules.values())
        mods.insert(index % (n + 1) if index < 0 else index, module)
        self._modules.clear()
        for j, m in enumerate(mods):
            self.add_module(str(j), m)
        return self

    def pop(self, index: int = -1) -> Module:
        m = self[index]
        del self[index]
        return m

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of modules, registered as children named 0, 1, ... (PyTorch's ``nn.ModuleList``)."""

    def __init__(self, modules: Iterable | None = None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i):
        mods = list(self._modules.values())
        if isinstance(i, slice):
            return type(self)(mods[i])
        return mods[_index(i, len(mods), "ModuleList")]

    def __setitem__(self, i, module: Module) -> None:
        self.add_module(str(_index(i, len(self), "ModuleList")), module)

    def __delitem__(self, i) -> None:
        mods = list(self._modules.values())
        del mods[i if isinstance(i, slice) else _index(i, len(mods), "ModuleList")]
        self._modules.clear()
        self.extend(mods)

    def append(self, module: Module) -> "ModuleList":
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable) -> "ModuleList":
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        mods = list(self._modules.values())
        mods.insert(index, module)
        self._modules.clear()
        self.extend(mods)

    def __iadd__(self, modules: Iterable) -> "ModuleList":
        return self.extend(modules)


class ModuleDict(Module):
    """Modules by name (PyTorch's ``nn.ModuleDict``): ``md["name"]``, ``md.name``, ``in``, ``len``,
    iteration over the names, ``keys()``, ``values()``, ``items()``, ``update``, ``pop``, ``clear``."""

    def __init__(self, modules: Mapping | Iterable | None = None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key) -> bool:
        return key in self._modules

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def update(self, modules: Mapping | Iterable) -> None:
        pairs = modules.items() if isinstance(modules, Mapping) else modules
        for key, m in pairs:
            self[key] = m

    def pop(self, key: str) -> Module:
        m = self._modules[key]
        del self[key]
        return m

    def clear(self) -> None:
        for key in list(self._modules):
            del self[key]
