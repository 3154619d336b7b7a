"""helios.nn: Module and the layers of a GPT.

``Module`` registers parameters and sub-modules on attribute assignment (like
PyTorch).  The GPT follows GPT-2: learned position embeddings, pre-LayerNorm blocks,
tied input/output embeddings, and GPT-2's initialisation (normal(0, 0.02), residual
projections scaled by 1/sqrt(2 * n_layer)).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np

import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios.creation import normal, ones, zeros
from helios.errors import CheckpointError
from helios.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that a Module registers as a learnable parameter."""

    def __init__(self, data: Tensor, requires_grad: bool = True):
        super().__init__(data._st, data.shape, data._strides, data._off, data.dtype)
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
        for d in (self._parameters, self._modules, self._buffers):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def register_buffer(self, name: str, value: Tensor) -> None:
        """A tensor that is part of the module's state but not a parameter (not in state_dict)."""
        object.__setattr__(self, name, value)
        self._buffers[name] = value

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = ""):
        """(name, parameter) pairs, each parameter once (tied weights under their first name)."""
        return self._named_tensors("_parameters", prefix)

    def _named_tensors(self, table: str, prefix: str):
        seen = set()
        for mname, m in self.named_modules(prefix):
            for tname, t in getattr(m, table).items():
                if id(t) not in seen:
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

    def to(self, device=None) -> "Module":
        """The same module: parameters live on the device they were made on; naming another
        device is a DeviceError (``F.to`` checks it), a dtype or None is a no-op."""
        if isinstance(device, str):
            for p in self.parameters():
                F.to(p, device)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            p.grad = None

    def state_dict(self) -> "OrderedDict[str, Tensor]":
        """Name -> parameter tensor (detached; shares storage)."""
        return OrderedDict((n, p.detach()) for n, p in self.named_parameters())

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy tensors (or numpy arrays) from ``state`` into the parameters.

        With ``strict`` every key must match; the error lists missing keys, unexpected
        keys and shape mismatches together, and nothing is copied unless all is well."""
        own = dict(self.named_parameters())
        missing = [k for k in own if k not in state]
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
        from helios.autograd.tape import no_grad

        with no_grad():
            for k, p in own.items():
                if k in state:
                    F.copy_(p, state[k])


class Linear(Module):
    """y = x @ W^T + b, W of shape [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02, seed: int | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(normal(0.0, std, (out_features, in_features), seed=seed))
        self.bias = Parameter(zeros(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of size ``embedding_dim``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 0.02, seed: int | None = None):
        super().__init__()
        self.weight = Parameter(normal(0.0, std, (num_embeddings, embedding_dim), seed=seed))

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight)


class LayerNorm(Module):
    """LayerNorm over the last dim with optional bias."""

    def __init__(self, dim: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(ones(dim))
        self.bias = Parameter(zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Dropout(Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)


class GELU(Module):
    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)


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

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(Module):
    """Multi-head self-attention with a causal mask."""

    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, seed=seed)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer), seed=seed + 1)
        self.attn_dropout = Dropout(cfg.dropout)
        self.resid_dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = F.split_heads(self.c_attn(x), H)  # [B, H, T, D] views
        # scale, causal mask (query i sees keys 0..i) and softmax in one kernel
        att = self.attn_dropout(F.attention_softmax(F.matmul(q, k.mT), 1.0 / math.sqrt(D), causal=True))
        y = F.matmul(att, v)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(Module):
    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias, seed=seed)
        self.gelu = GELU("tanh")
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer), seed=seed + 1)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(Module):
    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, seed)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg, seed + 2)

    def forward(self, x: Tensor) -> Tensor:
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

    def forward(self, idx, targets=None):
        if not isinstance(idx, Tensor):
            idx = K.from_numpy(np.asarray(idx, np.int64), dt.int64, self.wte.weight._st.rt)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = _positions(T, self.wte.weight._st.rt)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = F.matmul(x, self.wte.weight.mT)  # tied output embedding
        loss = None
        if targets is not None:
            if not isinstance(targets, Tensor):
                targets = K.from_numpy(np.asarray(targets, np.int64), dt.int64, idx._st.rt)
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * N (non-embedding-position params) + 12 * L * T * C."""
        c = self.config
        n = self.num_parameters() - self.wpe.weight.numel()
        return 6 * n + 12 * c.n_layer * c.block_size * c.n_embd


_pos_cache: dict = {}


def _positions(T: int, rt) -> Tensor:
    key = (T, id(rt))
    t = _pos_cache.get(key)
    if t is None:
        t = _pos_cache[key] = K.from_numpy(np.arange(T, dtype=np.int64), dt.int64, rt)
    return t


class ModuleList(Module):
    """A list of modules, registered as children named 0, 1, ..."""

    def __init__(self, modules):
        super().__init__()
        self._list = []
        for i, m in enumerate(modules):
            setattr(self, str(i), m)
            self._list.append(m)

    def __iter__(self):
        return iter(self._list)

    def __len__(self):
        return len(self._list)

    def __getitem__(self, i):
        return self._list[i]
