"""helios.nn: modules (PyTorch's names and signatures) and ``helios.nn.functional``.

``Module`` registers parameters and sub-modules on attribute assignment; the layers
(``Linear``, ``Embedding``, ``LayerNorm``, ``RMSNorm``, ``Dropout``), activations
(``ReLU``, ``GELU``, ``SiLU``, ``Tanh``, ``Sigmoid``, ``Identity``) and containers
(``Sequential``, ``ModuleList``, ``ModuleDict``) take PyTorch's constructor arguments and
name their parameters as PyTorch does, so a state dict's keys match ``torch.nn``'s for the
same module tree.  ``GPT`` / ``GPTConfig`` are the GPT-2 model helios-train trains.
"""

from helios.nn.modules import (  # noqa: F401
    GELU, GPT, MLP, Block, CausalSelfAttention, Dropout, Embedding, GPTConfig, Identity, LayerNorm, Linear, Module,
    ModuleDict, ModuleList, Parameter, ReLU, RMSNorm, Sequential, Sigmoid, SiLU, Softmax, Tanh,
)
from helios.nn import functional  # noqa: F401,E402

__all__ = [
    "Module", "Parameter", "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "GELU", "ReLU", "SiLU", "Tanh",
    "Sigmoid", "Softmax", "Identity", "Sequential", "ModuleList", "ModuleDict", "GPT", "GPTConfig", "functional",
]
