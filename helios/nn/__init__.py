"""helios.nn: modules (PyTorch's names and signatures), ``helios.nn.functional``,
``helios.nn.init`` and ``helios.nn.utils``.

``Module`` registers parameters and sub-modules on attribute assignment; the layers
(``Linear``, ``Embedding``, ``LayerNorm``, ``RMSNorm``, ``Dropout``), activations
(``ReLU``, ``GELU``, ``SiLU``, ``Tanh``, ``Sigmoid``, ``Identity``), losses
(``CrossEntropyLoss``, ``MSELoss``, ``L1Loss``, ``NLLLoss``) and containers (``Sequential``,
``ModuleList``, ``ModuleDict``) take PyTorch's constructor arguments and name their
parameters as PyTorch does, so a state dict's keys match ``torch.nn``'s for the same module
tree.  ``nn.init`` fills parameters in place (``normal_``, ``zeros_``, ``trunc_normal_`` ...)
and ``nn.utils.clip_grad_norm_`` clips gradients, as in PyTorch.  ``GPT`` / ``GPTConfig``
are the GPT-2 model helios-train trains.
"""

from helios.nn.modules import (  # noqa: F401
    GELU, GPT, MLP, Block, CausalSelfAttention, CrossEntropyLoss, Dropout, Embedding, GPTConfig, Identity, L1Loss,
    LayerNorm, Linear, Module, ModuleDict, ModuleList, MSELoss, NLLLoss, Parameter, ReLU, RMSNorm, Sequential, Sigmoid,
    SiLU, Softmax, Tanh,
)
from helios.nn import functional, init, utils  # noqa: F401,E402

__all__ = [
    "Module", "Parameter", "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "GELU", "ReLU", "SiLU", "Tanh",
    "Sigmoid", "Softmax", "Identity", "Sequential", "ModuleList", "ModuleDict", "CrossEntropyLoss", "MSELoss", "L1Loss",
    "NLLLoss", "GPT", "GPTConfig", "functional", "init", "utils",
]
