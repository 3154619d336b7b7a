"""helios.nn: Module and the layers of a GPT (the code lives in helios/nn/modules.py)."""

from helios.nn.modules import (  # noqa: F401
    GELU, GPT, MLP, Block, CausalSelfAttention, Dropout, Embedding, GPTConfig, LayerNorm, Linear, Module, ModuleList,
    Parameter,
)
