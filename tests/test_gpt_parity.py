"""Whole-model parity: the same GPT in Helios and in PyTorch (CPU) gives the same loss,
the same gradients, and the same parameters after three AdamW steps (fp32)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import helios as hl
from helios.nn import GPT, GPTConfig
from helios.optim import AdamW, SGD, clip_grad_norm_

pytestmark = pytest.mark.vulkan


def torch_gpt_loss(params: dict, cfg: GPTConfig, x, y):
    """A direct PyTorch transcription of helios.nn.GPT's forward."""
    B, T = x.shape
    C, H = cfg.n_embd, cfg.n_head
    h = params["wte.weight"][x] + params["wpe.weight"][torch.arange(T)]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.n_layer):
        p = lambda n: params.get(f"h.{i}.{n}")  # noqa: E731
        a = TF.layer_norm(h, (C,), p("ln_1.weight"), p("ln_1.bias"))
        def lin(t, name):
            b = p(name + ".bias")
            return t @ p(name + ".weight").T + (b if b is not None else 0)

        qkv = lin(a, "attn.c_attn")
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        yy = (att @ v).transpose(1, 2).reshape(B, T, C)
        h = h + lin(yy, "attn.c_proj")
        m = TF.layer_norm(h, (C,), p("ln_2.weight"), p("ln_2.bias"))
        m = TF.gelu(lin(m, "mlp.c_fc"), approximate="tanh")
        h = h + lin(m, "mlp.c_proj")
    h = TF.layer_norm(h, (C,), params["ln_f.weight"], params.get("ln_f.bias"))
    logits = h @ params["wte.weight"].T
    return TF.cross_entropy(logits.reshape(B * T, -1), y.reshape(-1))


def rel_err(a, b):
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_loss_grads_and_adamw_match_pytorch(bias):
    # With biases, the key bias has an exactly-zero gradient in exact arithmetic (softmax
    # is shift invariant), so both libraries see rounding noise there, which Adam's
    # normalisation amplifies to O(lr) updates of random sign.  Parameters are therefore
    # compared after the AdamW steps only for the bias-free model; losses and gradients
    # are compared for both.
    cfg = GPTConfig(vocab_size=37, block_size=11, n_layer=2, n_head=3, n_embd=24, bias=bias)
    model = GPT(cfg, seed=3)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (3, 11))
    y = rng.integers(0, cfg.vocab_size, (3, 11))
    tparams = {n: torch.tensor(p.numpy(), requires_grad=True) for n, p in model.named_parameters()}
    opt = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    topt = torch.optim.AdamW(list(tparams.values()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(3):
        _, loss = model(x, y)
        loss.backward()
        tloss = torch_gpt_loss(tparams, cfg, torch.tensor(x), torch.tensor(y))
        tloss.backward()
        assert abs(loss.item() - tloss.item()) <= 1e-4 * abs(tloss.item()), (step, loss.item(), tloss.item())
        for n, p in model.named_parameters():
            assert rel_err(p.grad.numpy(), tparams[n].grad.numpy()) < 1e-4, f"grad of {n} at step {step}"
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
    if not bias:
        for n, p in model.named_parameters():
            assert rel_err(p.numpy(), tparams[n].detach().numpy()) < 1e-4, f"parameter {n} after 3 AdamW steps"


def test_clip_grad_norm_matches_pytorch():
    cfg = GPTConfig(vocab_size=19, block_size=5, n_layer=1, n_head=2, n_embd=8)
    model = GPT(cfg, seed=1)
    AdamW(model.parameters())  # packs the parameters: exercises the flat-gradient path
    x = np.arange(10).reshape(2, 5) % 19
    _, loss = model(x, x)
    loss.backward()
    grads = {n: torch.tensor(p.grad.numpy()) for n, p in model.named_parameters()}
    tparams = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
    for tp, g in zip(tparams, grads.values()):
        tp.grad = g.clone()
    tnorm = torch.nn.utils.clip_grad_norm_(tparams, 0.05)
    norm = clip_grad_norm_(model.parameters(), 0.05)
    assert abs(norm.item() - tnorm.item()) < 1e-5 * tnorm.item()
    for (n, p), tp in zip(model.named_parameters(), tparams):
        assert rel_err(p.grad.numpy(), tp.grad.numpy()) < 1e-5, n


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_pytorch(nesterov):
    w0 = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    w = hl.tensor(w0, requires_grad=True)
    tw = torch.tensor(w0, requires_grad=True)
    opt = SGD([w], lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    topt = torch.optim.SGD([tw], lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    for _ in range(3):
        ((w * w).sum() + w.sum()).backward()
        ((tw * tw).sum() + tw.sum()).backward()
        opt.step(), topt.step(), opt.zero_grad(), topt.zero_grad()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_strict_errors():
    cfg = GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=4)
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=2)
    b.load_state_dict({k: v.numpy() for k, v in a.state_dict().items()})
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
    sd = {k: v.numpy() for k, v in a.state_dict().items()}
    sd.pop("ln_f.bias")
    sd["extra.weight"] = np.zeros(3, np.float32)
    sd["wte.weight"] = np.zeros((5, 4), np.float32)
    with pytest.raises(hl.CheckpointError) as e:
        b.load_state_dict(sd)
    msg = str(e.value)
    assert "missing keys: ln_f.bias" in msg and "unexpected keys: extra.weight" in msg and "wte.weight" in msg
