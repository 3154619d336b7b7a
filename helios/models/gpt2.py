"""GPT-2, weight for weight transformers' ``GPT2LMHeadModel``, on helios.nn's GPT.

The decoder is :class:`helios.nn.GPT` (the model helios-train trains) as ``transformer``: its
module tree is transformers' (``wte``, ``wpe``, ``h.N.ln_1``, ``attn.c_attn``, ``attn.c_proj``,
``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``), so the parameter names are transformers'
too.  ``lm_head.weight`` is the embedding table itself (tied, one parameter under both names)
unless the config says ``tie_word_embeddings: false``.  One difference is the layout:
transformers' GPT-2 keeps its projections in ``Conv1D`` modules whose weights are stored
[in, out]; here they are ``Linear`` weights [out, in].  ``hf_state_dict`` / ``load_hf_state_dict``
(and so ``save_pretrained`` / ``from_pretrained``) transpose them on the way out and in;
``state_dict`` / ``load_state_dict`` are Helios' own layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

import helios.functional as F
from helios import dtypes as dt
from helios.creation import tensor
from helios.nn.modules import (GELU, GPT, GPTConfig, LayerNorm, Linear, Module, ReLU, SiLU, embed_with_positions,
                                norm_for_product, position_ids)
from helios.tensor import Tensor

from helios.models.generation import GenerationMixin, lm_loss

__all__ = ["GPT2Config", "GPT2LMHeadModel", "CONV1D_WEIGHTS"]

#: the parameters transformers' GPT-2 stores transposed ([in, out], its Conv1D layout)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ACTIVATIONS = {"gelu_new": lambda: GELU("tanh"), "gelu_pytorch_tanh": lambda: GELU("tanh"),
                "gelu_fast": lambda: GELU("tanh"), "gelu": lambda: GELU("none"), "relu": ReLU, "silu": SiLU,
                "swish": SiLU}
# buffers some GPT-2 checkpoints carry (the causal mask), not weights
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass
class GPT2Config:
    """Sizes and options of a GPT-2, with transformers' names and defaults (GPT-2 small).

    ``attention`` is Helios' choice of attention kernel (helios.nn.CausalSelfAttention's
    "auto", "dense", "flash"; not written to config.json).  ``extra`` holds the other keys of a
    config.json read, written back by save_pretrained."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    attention: str = "auto"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(f"GPT2Config: activation_function {self.activation_function!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config: n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

    def gpt_config(self) -> GPTConfig:
        """The helios.nn.GPTConfig of the decoder (one dropout: resid_pdrop)."""
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.n_positions, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.resid_pdrop, bias=True,
                         attention=self.attention)

    @classmethod
    def from_hf(cls, d: dict) -> "GPT2Config":
        """The config of a transformers GPT-2 config.json dict; a ValueError names an option this
        model does not follow."""
        d = dict(d)
        d.pop("model_type", None)
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
            if d.get(key, ok) != ok:
                raise ValueError(f"gpt2 config: {key}={d[key]!r} is not supported (only {ok!r})")
        if "n_ctx" in d and "n_positions" not in d:
            d["n_positions"] = d["n_ctx"]
        known = {f.name for f in fields(cls)} - {"extra", "attention"}
        kw = {k: d.pop(k) for k in list(d) if k in known}
        return cls(extra=d, **kw)

    def to_hf(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "attention")}
        d.update(self.extra)
        d["model_type"] = "gpt2"
        d["architectures"] = ["GPT2LMHeadModel"]
        return d


class GPT2LMHeadModel(Module, GenerationMixin):
    """GPT-2 with its output head: ``model(idx, targets=None) -> (logits, loss)`` (targets
    already shifted, as helios-train gives them), ``generate``, ``save_pretrained``.
    ``transformer`` is a :class:`helios.nn.GPT`.  ``device`` / ``dtype``: where the weights live
    and their dtype (default: the current device, float32)."""

    def __init__(self, config: GPT2Config, seed: int = 0, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.transformer = GPT(config.gpt_config(), seed)
        for m in self.transformer.modules():
            if isinstance(m, LayerNorm):
                m.eps = config.layer_norm_epsilon
        inner = config.n_inner or 4 * config.n_embd
        for i, block in enumerate(self.transformer.h):
            if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
                block.mlp.gelu = _ACTIVATIONS[config.activation_function]()
            if inner != 4 * config.n_embd:
                block.mlp.c_fc = Linear(config.n_embd, inner, seed=seed * 1000 + 500 + 2 * i)
                block.mlp.c_proj = Linear(inner, config.n_embd, seed=seed * 1000 + 501 + 2 * i)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False, seed=seed * 1000 + 3)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def forward(self, idx, targets=None):
        t = self.transformer
        if self.config.tie_word_embeddings:  # exactly helios.nn.GPT's forward (what helios-train trains)
            return t(idx, targets)
        w = self.lm_head.weight
        if not isinstance(idx, Tensor):
            idx = tensor(np.asarray(idx, np.int64), dtype=dt.int64, device=w.device)
        B, T = idx.shape
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions {self.config.n_positions}")
        # GPT's cached positions: a constant with its host copy (the embedding's backward groups
        # indices on the host), uploaded once, so a captured step uploads nothing
        x = t.drop(embed_with_positions(t.wte, t.wpe, idx, position_ids(T, w.untyped_storage().rt)))
        for block in t.h:
            x = block(x)
        logits = F.linear(norm_for_product(t.ln_f, x, None), w)  # as helios.nn.GPT's head
        return logits, None if targets is None else lm_loss(logits, targets, w.device)

    def flops_per_token(self) -> int:
        """Training FLOPs per token (helios.nn.GPT's count, plus an untied head's parameters)."""
        extra = 0 if self.config.tie_word_embeddings else 6 * self.lm_head.weight.numel()
        return self.transformer.flops_per_token() + extra

    # -- generation ------------------------------------------------------------------------
    def _kv_layout(self):
        c = self.config
        return c.n_layer, c.n_head, c.n_embd // c.n_head

    def _max_positions(self):
        return self.config.n_positions

    def _vocab_size(self) -> int:
        return self.config.vocab_size

    def _prepare_generation(self, length: int) -> None:
        pass

    def _decode(self, idx: Tensor, pos: Tensor, kv) -> Tensor:
        t = self.transformer
        x = embed_with_positions(t.wte, t.wpe, idx, pos)
        for i, block in enumerate(t.h):
            B, T, C = x.shape
            q, k, v = F.split_heads(block.attn.c_attn(norm_for_product(block.ln_1, x, block.attn.c_attn)), block.attn.n_head)
            y = F.reshape(F.transpose(kv.attend(i, q, k, v), 1, 2), (B, T, C))
            x = F.linear_residual(y, block.attn.c_proj.weight, block.attn.c_proj.bias, x)  # one kernel, as GPT's Block
            x = block.mlp(norm_for_product(block.ln_2, x, block.mlp.c_fc), residual=x)
        return F.linear(norm_for_product(t.ln_f, x[:, -1], None), self.lm_head.weight)

    # -- Hugging Face folders --------------------------------------------------------------
    def hf_state_dict(self) -> dict:
        """Name -> tensor as transformers stores them: the Conv1D weights transposed ([in, out]
        views), a tied head listed once (under ``transformer.wte.weight``, as transformers saves it)."""
        return {n: (F.transpose(p.detach(), 0, 1) if n.endswith(CONV1D_WEIGHTS) else p.detach())
                for n, p in self.named_parameters()}

    def load_hf_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load tensors or arrays named and laid out as transformers stores them (Conv1D weights
        [in, out]; keys with or without the ``transformer.`` prefix; the attention-mask buffers
        some checkpoints carry are skipped)."""
        prefixed = any(k.startswith("transformer.") for k in state)
        own = {}
        for k, v in state.items():
            if k.endswith(_IGNORED_SUFFIXES):
                continue
            name = k if prefixed or k.startswith("lm_head.") else "transformer." + k
            if name.endswith(CONV1D_WEIGHTS):
                v = F.transpose(v, 0, 1) if isinstance(v, Tensor) else np.ascontiguousarray(np.asarray(v).T)
            own[name] = v
        self.load_state_dict(own, strict=strict)

    def save_pretrained(self, path, max_shard_size: int | str | None = None) -> None:
        """Write config.json and model.safetensors (or shards and their index where the weights
        pass ``max_shard_size``) into the folder ``path``, loadable by transformers'
        ``from_pretrained`` and by :func:`helios.models.from_pretrained`."""
        from helios.models.hf import save_folder

        save_folder(self, path, max_shard_size)
