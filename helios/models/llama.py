"""A LLaMA-style causal language model, weight for weight transformers' ``LlamaForCausalLM``.

RMSNorm before attention and MLP, rotary position embeddings in transformers' layout (the
head dim's two halves rotated together: ``q * cos + rotate_half(q) * sin``; ``rope_theta``,
and the "linear" and "llama3" frequency scalings), grouped-query attention
(``num_key_value_heads`` dividing ``num_attention_heads``, any head dim: the flash kernel where
it takes the head dim, the dense path elsewhere), a SwiGLU MLP (``down(silu(gate(x)) *
up(x))``), no biases unless the config asks, and an output head tied to the embedding only
with ``tie_word_embeddings``.  Parameter names are transformers' (``model.layers.0.self_attn.
q_proj.weight`` ...), so a state dict moves between the two as it is.

Mistral configs load here where they match (a ``sliding_window`` longer than any sequence
run: a longer one is refused), and Qwen2's (biases on q, k and v, none on o).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

import helios.functional as F
from helios import dtypes as dt
from helios.creation import tensor
from helios.nn.modules import Embedding, Linear, Module, ModuleList, RMSNorm, project_residual
from helios.tensor import Tensor

from helios.models.generation import GenerationMixin, attention, lm_loss

__all__ = ["LlamaConfig", "LlamaForCausalLM"]

LLAMA_TYPES = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig:
    """Sizes and options of a LLaMA-style model, with transformers' names and defaults.

    ``model_type`` "mistral" or "qwen2" marks a config read from those families (kept when
    saved); "qwen2" puts biases on q, k and v.  ``rope_scaling``: None, or a dict with
    ``rope_type`` "linear" (``factor``) or "llama3" (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).  ``extra`` holds the other
    keys of a config.json read, written back by save_pretrained."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"LlamaConfig: hidden_size {self.hidden_size} is not a multiple of "
                                 f"num_attention_heads {self.num_attention_heads}; give head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim {self.head_dim} must be even (rotary embeddings pair its halves)")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"LlamaConfig: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.model_type not in LLAMA_TYPES:
            raise ValueError(f"LlamaConfig: model_type {self.model_type!r} is not one of {', '.join(LLAMA_TYPES)}")
        rt = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rt not in _ROPE_TYPES:
            raise ValueError(f"LlamaConfig: rope scaling {rt!r} is not supported ({', '.join(_ROPE_TYPES)})")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    # -- transformers' config.json ----------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """The config of a transformers config.json dict (llama, mistral or qwen2); a ValueError
        names a field whose value this model cannot follow."""
        d = dict(d)
        model_type = d.pop("model_type", "llama")
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("qwen2 config: use_sliding_window=true is not supported")
        rp = d.pop("rope_parameters", None) or {}
        scaling = d.pop("rope_scaling", None) or None
        theta = rp.get("rope_theta", d.pop("rope_theta", 10000.0))
        d.pop("rope_theta", None)
        rope_type = rp.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if rope_type != "default":
            scaling = {k: v for k, v in {**(scaling or {}), **rp}.items() if k not in ("rope_theta", "type")}
            scaling["rope_type"] = rope_type
        else:
            scaling = None
        if (rp.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError("config: partial_rotary_factor other than 1 is not supported")
        sliding = d.pop("sliding_window", None)
        if model_type == "qwen2":
            sliding = None  # qwen2 keeps the field with use_sliding_window false
        known = {f.name for f in fields(cls)} - {"extra", "model_type", "rope_theta", "rope_scaling", "sliding_window"}
        kw = {k: d.pop(k) for k in list(d) if k in known}
        return cls(model_type=model_type, rope_theta=float(theta), rope_scaling=scaling, sliding_window=sliding,
                   extra=d, **kw)

    def to_hf(self) -> dict:
        """A transformers config.json dict (both the rope_theta / rope_scaling keys of
        transformers 4 and the rope_parameters of transformers 5)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra",)}
        d.update(self.extra)
        d["model_type"] = self.model_type
        d["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}[self.model_type]]
        rp = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rp.update(self.rope_scaling)
        d["rope_parameters"] = rp
        if self.model_type == "qwen2":
            d.pop("attention_bias", None), d.pop("mlp_bias", None)
            d.setdefault("use_sliding_window", False)
        elif self.model_type == "llama":
            d.pop("sliding_window", None)
        return d


def inv_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies (float32 [head_dim / 2]) as transformers computes them."""
    D = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)))
           ).astype(np.float32)
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = (inv / np.float32(s["factor"])).astype(np.float32)
    elif kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = (2 * math.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > lo_wavelen, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rotary(x: Tensor, cos: Tensor, sin_signed: Tensor, feeds_attention: bool = False) -> Tensor:
    """x * cos + rotate_half(x) * sin for x [B, H, T, D] and rows [T, D]: rotate_half(x) * sin is
    roll(x, D/2) * (-sin1, sin1) (the same products, the sign moved onto the table: F.rotary).
    ``feeds_attention``: only the attention's products read the result (F.rotary's
    ``feeds_products``; not where a KV cache keeps k)."""
    return F.rotary(x, cos, sin_signed, feeds_products=feeds_attention)


def rotary_qkv(attn, x: Tensor, cos: Tensor, sin_signed: Tensor, feeds_attention: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, T, D], k and v [B, Hk, T, D] of x [B, T, C], q and k rotated: ``attn``'s
    ``q_proj``/``k_proj``/``v_proj`` cut into its ``n_head``/``n_kv_head`` heads of ``head_dim``
    (a ``LlamaAttention``, or a tensor-parallel one over this rank's heads); ``feeds_attention``:
    apply_rotary's."""
    B, T, _ = x.shape
    H, Hk, D = attn.n_head, attn.n_kv_head, attn.head_dim
    q = F.transpose(F.reshape(attn.q_proj(x), (B, T, H, D)), 1, 2)
    k = F.transpose(F.reshape(attn.k_proj(x), (B, T, Hk, D)), 1, 2)
    v = F.transpose(F.reshape(attn.v_proj(x), (B, T, Hk, D)), 1, 2)
    return apply_rotary(q, cos, sin_signed, feeds_attention), apply_rotary(k, cos, sin_signed, feeds_attention), v


def merge_heads(y: Tensor) -> Tensor:
    """The attention's output [B, H, T, D] as [B, T, H * D], the output projection's input."""
    B, H, T, D = y.shape
    return F.reshape(F.transpose(y, 1, 2), (B, T, H * D))


class LlamaRMSNorm(RMSNorm):
    """transformers' LlamaRMSNorm: normalised in float32, cast back to the input's dtype, then
    times the weight (the order matters in 16-bit).  In float32 the cast is none and the
    product the same, so the weight goes into the kernel (F.rms_norm's) and its gradient too."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype is dt.float32 and self.weight.dtype is dt.float32:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        y = F.rms_norm(x, self.normalized_shape, None, self.eps)
        return y * self.weight


class LlamaAttention(Module):
    def __init__(self, cfg: LlamaConfig, seed: int):
        super().__init__()
        C, H, Hk, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = H, Hk, D
        std = cfg.initializer_range
        self.q_proj = Linear(C, H * D, bias=cfg.qkv_bias, std=std, seed=seed)
        self.k_proj = Linear(C, Hk * D, bias=cfg.qkv_bias, std=std, seed=seed + 1)
        self.v_proj = Linear(C, Hk * D, bias=cfg.qkv_bias, std=std, seed=seed + 2)
        self.o_proj = Linear(H * D, C, bias=cfg.o_bias, std=std, seed=seed + 3)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv=None, layer: int = 0, residual: Tensor | None = None) -> Tensor:
        """o_proj of the attention over x's heads; with ``residual``, residual + that (the add
        in o_proj's matmul where it can be: helios.nn.modules.project_residual)."""
        q, k, v = rotary_qkv(self, x, cos, sin, feeds_attention=kv is None)
        y = kv.attend(layer, q, k, v) if kv is not None else attention(q, k, v, causal=True)
        return project_residual(self.o_proj, merge_heads(y), residual)


class LlamaMLP(Module):
    def __init__(self, cfg: LlamaConfig, seed: int):
        super().__init__()
        C, inner, std = cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range
        self.gate_proj = Linear(C, inner, bias=cfg.mlp_bias, std=std, seed=seed)
        self.up_proj = Linear(C, inner, bias=cfg.mlp_bias, std=std, seed=seed + 1)
        self.down_proj = Linear(inner, C, bias=cfg.mlp_bias, std=std, seed=seed + 2)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """down_proj(silu(gate_proj(x)) * up_proj(x)); with ``residual``, residual + that (as
        LlamaAttention's)."""
        return project_residual(self.down_proj, F.silu_mul(self.gate_proj(x), self.up_proj(x)), residual)


class LlamaDecoderLayer(Module):
    def __init__(self, cfg: LlamaConfig, seed: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, seed)
        self.mlp = LlamaMLP(cfg, seed + 4)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv=None, layer: int = 0) -> Tensor:
        if type(self.self_attn) is LlamaAttention and type(self.mlp) is LlamaMLP:  # (not a module swapped in)
            # the residual adds ride in the projections' matmuls where they can (project_residual)
            x = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, residual=x)
            return self.mlp(self.post_attention_layernorm(x), residual=x)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(Module):
    """The decoder stack (transformers' ``LlamaModel``): embed_tokens, layers, norm."""

    def __init__(self, cfg: LlamaConfig, seed: int):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, std=cfg.initializer_range, seed=seed * 1000 + 1)
        self.layers = ModuleList([LlamaDecoderLayer(cfg, seed * 1000 + 10 + 10 * i)
                                  for i in range(cfg.num_hidden_layers)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, idx: Tensor, cos: Tensor, sin: Tensor, kv=None) -> Tensor:
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv, i)
        return self.norm(x)


def rotary_tables(config, n: int, dtype, device) -> tuple[Tensor, Tensor]:
    """(cos, sin with its first half negated): the [n, head_dim] rotary tables of ``config``'s
    frequencies (transformers' values), in ``dtype`` on ``device`` (None: the defaults)."""
    inv = inv_frequencies(config)
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    sin[:, :sin.shape[1] // 2] *= -1
    return tensor(cos, dtype=dtype, device=device), tensor(sin, dtype=dtype, device=device)


def grow_rotary(module, n: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """``module``'s rotary tables (its rope_cos / rope_sin buffers, from its config), [>= n, head_dim]:
    remade with a power of two rows in ``like``'s dtype on its device when they are shorter than ``n``."""
    if module.rope_cos.shape[0] < n:
        module.rope_cos, module.rope_sin = rotary_tables(module.config, 1 << max(0, n - 1).bit_length(), like.dtype,
                                                         like.device)
    return module.rope_cos, module.rope_sin


class LlamaForCausalLM(Module, GenerationMixin):
    """A LLaMA-style language model: ``model(idx, targets=None) -> (logits, loss)`` (targets
    already shifted, as helios-train and nanoGPT give them), ``generate``, ``save_pretrained``.

    ``device`` / ``dtype``: where the weights live and their dtype (default: the current
    device, float32)."""

    def __init__(self, config: LlamaConfig, seed: int = 0, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, seed)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, std=config.initializer_range,
                              seed=seed * 1000 + 2)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the rotary tables are buffers (Module.to moves and casts them with the weights), made
        # here so that a captured step never uploads them; a longer sequence grows them
        cos, sin = rotary_tables(config, min(config.max_position_embeddings, 4096), None, None)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    # -- rotary tables ---------------------------------------------------------------------
    def rotary(self, n: int) -> tuple[Tensor, Tensor]:
        """(cos, sin with its first half negated): [>= n, head_dim] tables in the weights' dtype on
        their device, transformers' values; grown (to a power of two rows) for a longer sequence."""
        return grow_rotary(self, n, self.lm_head.weight)

    def _check_length(self, n: int) -> None:
        sw = self.config.sliding_window
        if sw is not None and n > sw:
            raise ValueError(f"{self.config.model_type}: a sequence of {n} tokens is longer than the sliding window "
                             f"({sw}); sliding-window attention is not supported, keep sequences within it")

    def forward(self, idx, targets=None):
        w = self.lm_head.weight
        if not isinstance(idx, Tensor):
            idx = tensor(np.asarray(idx, np.int64), dtype=dt.int64, device=w.device)
        B, T = idx.shape
        self._check_length(T)
        cos, sin = self.rotary(T)
        x = self.model(idx, cos[:T], sin[:T])
        logits = self.lm_head(x)
        return logits, None if targets is None else lm_loss(logits, targets, w.device)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * N (parameters but the embedding table) + 12 * L * T * H * D
        (attention scores and values at max_position_embeddings tokens)."""
        c = self.config
        n = self.num_parameters() - (0 if c.tie_word_embeddings else self.model.embed_tokens.weight.numel())
        return 6 * n + 12 * c.num_hidden_layers * c.max_position_embeddings * c.num_attention_heads * c.head_dim

    # -- generation ------------------------------------------------------------------------
    def _kv_layout(self):
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    def _max_positions(self):
        return self.config.sliding_window

    def _vocab_size(self) -> int:
        return self.config.vocab_size

    def _prepare_generation(self, length: int) -> None:
        self._check_length(length)
        self.rotary(length)

    def _decode(self, idx: Tensor, pos: Tensor, kv) -> Tensor:
        cos, sin = self.rotary(1)
        cos, sin = F.index_select(cos, 0, pos), F.index_select(sin, 0, pos)
        x = self.model(idx, cos, sin, kv)
        return self.lm_head(x[:, -1])

    # -- Hugging Face folders --------------------------------------------------------------
    def hf_state_dict(self) -> dict:
        """Name -> tensor as transformers stores them (the same names and layouts; a tied head
        is listed once, under the embedding's name, as transformers saves it)."""
        return {n: p.detach() for n, p in self.named_parameters()}

    def load_hf_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load tensors or arrays named and laid out as transformers stores them."""
        self.load_state_dict(state, strict=strict)

    def save_pretrained(self, path, max_shard_size: int | str | None = None) -> None:
        """Write config.json and model.safetensors (or shards and their index where the weights
        pass ``max_shard_size``) into the folder ``path``, loadable by transformers'
        ``from_pretrained`` and by :func:`helios.models.from_pretrained`."""
        from helios.models.hf import save_folder

        save_folder(self, path, max_shard_size)
