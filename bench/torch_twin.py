"""The benchmarks' PyTorch twin: helios.nn.GPT written in PyTorch, in one place.

Every benchmark that times or trains the GPT against PyTorch builds its peer from here
(train_step.py, train_parity.py, data_parallel.py, compression.py, model_parallel.py), so a
change to the GPT or to the twin's interface is made once and every peer follows it.
torch is imported when a function here is called, not when this module is imported: the
scripts that import it run their Helios side without torch.

* :func:`gpt_config`: the GPTConfig of a helios-train config (``helios.train.CONFIGS``).
* :func:`helios_weights`: Helios' initial parameters of a GPT, as numpy arrays under Helios'
  names, in Helios' order (what a twin starts from to train what Helios trains).
* :func:`torch_loss_fn`: the GPT's loss as a function over a mapping of Helios' parameter
  names to PyTorch tensors (the functional twin: same names, same weights, same maths as
  ``GPT.forward``; attention written out, or through ``scaled_dot_product_attention``).
* :func:`loss_module`: that loss as a ``torch.nn.Module`` owning its parameters (a
  ``ParameterDict``), for ``DistributedDataParallel`` and its comm hooks.
* :func:`tp_gpt_module`: the same GPT as ``nn.Module`` layers (``nn.Embedding``,
  ``nn.Linear``, ``nn.LayerNorm``) with q, k and v as separate layers, the form
  ``torch.distributed.tensor.parallel`` can split (Helios' fused ``c_attn`` cannot be split
  column-wise into whole heads), initialised as Helios initialises a GPT.
"""

from __future__ import annotations

import math


def gpt_config(config: str, vocab_size: int = 256):
    """The ``helios.nn.GPTConfig`` of helios-train's ``--config`` with a ``vocab_size``-token vocabulary
    (256: the byte tokenizer's)."""
    from helios.nn import GPTConfig
    from helios.train import CONFIGS

    c = CONFIGS[config]
    return GPTConfig(vocab_size=vocab_size, block_size=c["block_size"], n_layer=c["n_layer"], n_head=c["n_head"],
                     n_embd=c["n_embd"])


def helios_weights(cfg, seed: int, manual_seed: bool = False) -> dict:
    """Helios' initial parameters of ``GPT(cfg, seed=seed)``: ``{name: numpy array}`` in Helios' order.

    ``manual_seed``: call ``hl.manual_seed(seed)`` first, as helios-train does before it builds
    its model (the weights a helios-train run with ``--seed seed`` starts from)."""
    import helios as hl
    from helios.nn import GPT

    if manual_seed:
        hl.manual_seed(seed)
    weights = {n: p.numpy() for n, p in GPT(cfg, seed=seed).named_parameters()}
    hl.synchronize()
    return weights


def torch_loss_fn(cfg, B, T, params, sdpa: bool = False):
    """The GPT's loss in PyTorch over ``params`` (a mapping of Helios' parameter names to tensors,
    on one device), for batches of ``B`` x ``T`` tokens: ``loss_fn(x, y)``.

    The attention is written out (scores, mask, softmax), or with ``sdpa`` goes through
    ``scaled_dot_product_attention`` (on a GPU its flash kernel, as Helios' flash attention).
    Parameters are looked up at each call, so the mapping may be a view of parameters an
    optimizer or a module owns.  A model without biases (``GPTConfig(bias=False)``) has no
    ``*.bias`` entries."""
    import torch
    import torch.nn.functional as TF

    C, H = cfg.n_embd, cfg.n_head
    dev = next(iter(params.values())).device
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))
    pos = torch.arange(T, device=dev)

    def lin(t, name):
        b = params.get(name + ".bias")
        t = t @ params[name + ".weight"].T
        return t if b is None else t + b

    def ln(t, name):
        return TF.layer_norm(t, (C,), params[name + ".weight"], params.get(name + ".bias"))

    def loss_fn(x, y):
        h = params["wte.weight"][x] + params["wpe.weight"][pos]
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            q, k, v = lin(ln(h, p + "ln_1"), p + "attn.c_attn").split(C, dim=2)
            q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            if sdpa:
                o = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))).masked_fill(~mask, float("-inf")).softmax(-1)
                o = att @ v
            h = h + lin(o.transpose(1, 2).reshape(B, T, C), p + "attn.c_proj")
            h = h + lin(TF.gelu(lin(ln(h, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh"), p + "mlp.c_proj")
        h = ln(h, "ln_f")
        return TF.cross_entropy((h @ params["wte.weight"].T).reshape(B * T, -1), y.reshape(-1))

    return loss_fn


def loss_module(cfg, B, T, tensors: dict, sdpa: bool = False):
    """The GPT's loss as an ``nn.Module``: ``module(x, y)`` is :func:`torch_loss_fn`'s loss.

    ``tensors``: ``{Helios name: tensor or numpy array}``, the initial values.  The module owns
    them as a ``ParameterDict`` (``module.p``) keyed by Helios' names with the dots as double
    underscores (a ``ParameterDict`` key cannot hold a dot); built from a plain dict, it orders
    them by key (``ParameterDict.update`` sorts a plain dict), which is the order
    ``module.parameters()``, DDP's gradient buckets and an optimizer see.  ``module.params`` maps
    Helios' names to the same ``Parameter`` objects: :func:`torch_loss_fn` over it (another batch
    size, say) computes with the module's current weights."""
    import torch

    class GPTLoss(torch.nn.Module):
        """The GPT's training loss over a batch (parameters under Helios' names)."""

        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(torch.as_tensor(t).detach().clone())
                                             for n, t in tensors.items()})
            self.params = {n: self.p[n.replace(".", "__")] for n in tensors}
            self.loss = torch_loss_fn(cfg, B, T, self.params, sdpa)

        def forward(self, x, y):
            return self.loss(x, y)

    return GPTLoss()


def tp_gpt_module(cfg):
    """The GPT as PyTorch layers with q, k and v apart (see the module docstring): ``model(x)`` gives
    the logits; ``model.lm_head.weight`` is not yet tied to ``model.wte.weight`` (tie them after
    ``parallelize_module``, which replaces both).  Initialised as Helios' GPT: N(0, 0.02) weights,
    zero biases (from torch's global generator: ``torch.manual_seed`` first for the same weights)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as TF

    C, H, T, V = cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            # q, k and v apart (Helios' c_attn is one [3C, C] matrix): a column split of each
            # gives every rank whole heads.
            self.q, self.k, self.v, self.c_proj = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)

        def forward(self, x):
            b, t, _ = x.shape
            a = self.ln_1(x)
            # this rank's heads: the local width over the head size
            q, k, v = (f(a).reshape(b, t, -1, C // H).transpose(1, 2) for f in (self.q, self.k, self.v))
            att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))).masked_fill(~self.mask, float("-inf"))
            x = x + self.c_proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))
            return x + self.mlp_proj(TF.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, V, bias=False)

        def forward(self, x):
            h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for blk in self.h:
                h = blk(h)
            return self.lm_head(self.ln_f(h))

    model = GPT()
    with torch.no_grad():  # Helios' GPT init: N(0, 0.02) weights (tied table included), zero biases
        for mod in model.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                mod.weight.normal_(0.0, 0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.zero_()
    return model
