"""helios.nn as a package: helios.nn.functional, the import paths, and PyTorch's modules
(Sequential, ModuleList, ModuleDict, activations, Linear, Embedding, LayerNorm, RMSNorm) compared
with torch.nn on the same weights: outputs, gradients, state-dict keys and repr."""

import os
import subprocess
import sys
import tomllib
from collections import OrderedDict

import numpy as np
import pytest
import torch

import helios as hl
import helios.functional as HF
from helios import nn
from helios.optim import SGD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the package ----------------------------------------------------------------------------------
def test_nn_functional_is_reachable_right_after_import_helios():
    code = ("import helios as hl; F = hl.nn.functional; assert F.relu is not None and F.gelu and F.cross_entropy; "
            "import helios.nn.functional as G; assert G is F; from helios.nn.functional import softmax, layer_norm; "
            "from helios.nn import GPT, GPTConfig, Module, Parameter, ModuleList, Sequential, ModuleDict, RMSNorm")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def test_nn_functional_follows_helios_functional(monkeypatch):
    # An op added to helios.functional later (while the process runs) is reachable at once.
    def brand_new_op(x):
        return x

    brand_new_op.__module__ = "helios.functional"  # as for a function defined there

    monkeypatch.setattr(HF, "brand_new_op", brand_new_op, raising=False)
    assert nn.functional.brand_new_op is brand_new_op
    assert "brand_new_op" in dir(nn.functional)
    for name in ("softmax", "log_softmax", "gelu", "linear", "layer_norm", "embedding", "cross_entropy", "tanh"):
        assert getattr(nn.functional, name) is getattr(HF, name), name
        assert name in dir(nn.functional)
    assert "np" not in dir(nn.functional) and "Tensor" not in dir(nn.functional)
    with pytest.raises(AttributeError, match="no_such_op"):
        nn.functional.no_such_op


def test_existing_import_paths_keep_working():
    from helios.nn import (GELU, GPT, MLP, Block, CausalSelfAttention, Dropout, Embedding, GPTConfig,  # noqa: F401
                           LayerNorm, Linear, Module, ModuleList, Parameter)
    import helios.nn.modules as modules

    assert nn.GPT is modules.GPT and nn.Module is modules.Module and hl.nn is nn


def test_every_package_is_in_the_wheel():
    """pyproject lists packages by hand: every folder with an __init__.py under a mapped package must be there."""
    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    listed, mapping = set(cfg["packages"]), cfg["package-dir"]
    assert "helios.nn" in listed
    for pkg, folder in mapping.items():
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "build")]
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                name = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
                assert name in listed, f"{name} ({dirpath}) is not in pyproject's packages: a wheel would lack it"


# -- modules against torch.nn ---------------------------------------------------------------------
def _copy_weights(h_module, t_module):
    """Load torch's weights into the Helios module (keys must match) and return the keys."""
    sd = {k: v.detach().numpy() for k, v in t_module.state_dict().items()}
    h_module.load_state_dict(sd)
    return list(sd)


def _grads_close(h_module, t_module, atol=1e-5):
    tg = {k: p.grad.numpy() for k, p in t_module.named_parameters()}
    hg = {k: p.grad.numpy() for k, p in h_module.named_parameters()}
    assert list(tg) == list(hg)
    for k in tg:
        np.testing.assert_allclose(hg[k], tg[k], atol=atol, rtol=1e-4, err_msg=k)


def _run_both(h_module, t_module, x_np, atol=1e-5):
    xt = torch.tensor(x_np, requires_grad=True)
    xh = hl.tensor(x_np, requires_grad=True)
    yt, yh = t_module(xt), h_module(xh)
    np.testing.assert_allclose(yh.numpy(), yt.detach().numpy(), atol=atol, rtol=1e-4)
    w = np.random.default_rng(1).standard_normal(yt.shape).astype(np.float32)
    (yt * torch.tensor(w)).sum().backward()
    (yh * hl.tensor(w)).sum().backward()
    np.testing.assert_allclose(xh.grad.numpy(), xt.grad.numpy(), atol=atol, rtol=1e-4)
    _grads_close(h_module, t_module, atol)


@pytest.mark.vulkan
def test_sequential_matches_torch():
    torch.manual_seed(0)
    t = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 6), torch.nn.GELU(),
                            torch.nn.Linear(6, 4, bias=False), torch.nn.Tanh(), torch.nn.Linear(4, 3), torch.nn.SiLU(),
                            torch.nn.Identity(), torch.nn.Sigmoid())
    h = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.GELU(), nn.Linear(6, 4, bias=False), nn.Tanh(),
                      nn.Linear(4, 3), nn.SiLU(), nn.Identity(), nn.Sigmoid())
    assert list(h.state_dict()) == list(t.state_dict()) == _copy_weights(h, t)
    _run_both(h, t, np.random.default_rng(0).standard_normal((3, 2, 5)).astype(np.float32))
    assert repr(h) == repr(t)


@pytest.mark.vulkan
def test_sequential_list_operations_name_children_as_torch():
    def ops(lib):
        s = lib.nn.Sequential(lib.nn.Linear(2, 3), lib.nn.ReLU(), lib.nn.Linear(3, 4))
        s.append(lib.nn.Linear(4, 5))
        del s[1]  # renumbered
        s.insert(1, lib.nn.Tanh())
        s.extend([lib.nn.Linear(5, 2)])
        popped = s.pop(0)
        return s, popped

    (h, hp), (t, tp) = ops(hl), ops(torch)
    assert list(h.state_dict()) == list(t.state_dict())
    assert len(h) == len(t) == 4 and [type(m).__name__ for m in h] == [type(m).__name__ for m in t]
    assert type(hp).__name__ == type(tp).__name__ == "Linear"
    assert isinstance(h[-1], nn.Linear) and h[-1].out_features == 2
    sl = h[1:3]
    assert isinstance(sl, nn.Sequential) and list(sl.state_dict()) == list(t[1:3].state_dict())
    h[0] = nn.ReLU()
    assert isinstance(h[0], nn.ReLU) and getattr(h, "0") is h[0]
    with pytest.raises(IndexError):
        h[4]
    named = nn.Sequential(OrderedDict([("fc", nn.Linear(2, 2)), ("act", nn.ReLU())]))
    assert list(named.state_dict()) == ["fc.weight", "fc.bias"] and named.fc is named[0]


@pytest.mark.vulkan
def test_module_list_and_dict():
    ml = nn.ModuleList([nn.Linear(2, 2)])
    ml.append(nn.ReLU())
    ml += [nn.Linear(2, 3)]
    ml.insert(0, nn.Tanh())
    assert [type(m).__name__ for m in ml] == ["Tanh", "Linear", "ReLU", "Linear"] and len(ml) == 4
    assert list(ml.state_dict()) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert isinstance(ml[1:], nn.ModuleList) and ml[-1].out_features == 3
    del ml[0]
    assert list(ml.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]

    torch.manual_seed(0)
    t = torch.nn.ModuleDict({"enc": torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()),
                             "norm": torch.nn.LayerNorm(4), "head": torch.nn.Linear(4, 2)})
    h = nn.ModuleDict({"enc": nn.Sequential(nn.Linear(3, 4), nn.ReLU()), "norm": nn.LayerNorm(4),
                       "head": nn.Linear(4, 2)})
    assert list(h.state_dict()) == list(t.state_dict()) == _copy_weights(h, t)
    assert list(h) == list(t) == list(h.keys()) and "enc" in h and len(h) == 3
    assert isinstance(h["norm"], nn.LayerNorm) and h.enc is h["enc"]
    assert repr(h) == repr(t)
    x = np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32)
    yt = t["head"](t["norm"](t["enc"](torch.tensor(x))))
    yh = h["head"](h["norm"](h["enc"](hl.tensor(x))))
    np.testing.assert_allclose(yh.numpy(), yt.detach().numpy(), atol=1e-5)
    h.update({"extra": nn.Identity(), "keys": nn.ReLU()})  # a key named as a method leaves the method alone
    assert isinstance(h["keys"], nn.ReLU) and callable(h.keys) and list(h.keys())[-1] == "keys"
    del h["keys"]
    assert h.pop("extra").__class__ is nn.Identity and "extra" not in h
    h.clear()
    assert len(h) == 0 and list(h.state_dict()) == []
    with pytest.raises(KeyError):
        nn.ModuleDict({"a.b": nn.ReLU()})


@pytest.mark.vulkan
@pytest.mark.parametrize("shape,eps,affine", [(8, None, True), ((3, 8), 1e-6, True), (8, 1e-5, False)])
def test_rmsnorm_matches_torch(shape, eps, affine):
    torch.manual_seed(0)
    t = torch.nn.RMSNorm(shape, eps=eps, elementwise_affine=affine)
    h = nn.RMSNorm(shape, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            t.weight.copy_(torch.randn(t.weight.shape))
    assert list(h.state_dict()) == _copy_weights(h, t)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32) * 3
    _run_both(h, t, x, atol=1e-4)
    assert repr(h) == repr(t)


@pytest.mark.vulkan
def test_layers_take_torch_signatures():
    torch.manual_seed(0)
    pairs = [
        (torch.nn.LayerNorm((4,), eps=1e-6, elementwise_affine=True, bias=False), nn.LayerNorm((4,), eps=1e-6, bias=False)),
        (torch.nn.LayerNorm(4, elementwise_affine=False), nn.LayerNorm(4, elementwise_affine=False)),
        (torch.nn.LayerNorm([2, 4]), nn.LayerNorm([2, 4])),
        (torch.nn.GELU(approximate="tanh"), nn.GELU(approximate="tanh")),
        (torch.nn.GELU(), nn.GELU()),
        (torch.nn.Softmax(dim=-1), nn.Softmax(dim=-1)),
        (torch.nn.Dropout(0.0), nn.Dropout(0.0)),
    ]
    x = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    for t, h in pairs:
        if list(t.state_dict()):
            with torch.no_grad():
                for p in t.parameters():
                    p.copy_(torch.randn(p.shape))
        assert list(h.state_dict()) == _copy_weights(h, t)
        _run_both(h, t, x, atol=1e-4)
        assert repr(h) == repr(t)
    assert nn.Dropout().p == torch.nn.Dropout().p == 0.5
    assert nn.GELU().approximate == "none"
    with pytest.raises(ValueError):
        nn.Dropout(1.5)
    assert repr(nn.Linear(3, 2, bias=False)) == repr(torch.nn.Linear(3, 2, bias=False))
    assert repr(nn.Identity(54, unused="x")) == "Identity()"
    lin = nn.Linear(3, 2, dtype=hl.bfloat16)
    assert lin.weight.dtype is hl.bfloat16 and lin.bias.dtype is hl.bfloat16


@pytest.mark.vulkan
def test_embedding_padding_idx_matches_torch():
    torch.manual_seed(0)
    t = torch.nn.Embedding(10, 4, padding_idx=-2)
    h = nn.Embedding(10, 4, padding_idx=-2)
    assert h.padding_idx == t.padding_idx == 8
    assert np.all(h.weight.numpy()[8] == 0)
    _copy_weights(h, t)
    idx = np.array([[1, 8, 3], [8, 8, 0]], np.int64)
    yt, yh = t(torch.tensor(idx)), h(hl.tensor(idx))
    np.testing.assert_allclose(yh.numpy(), yt.detach().numpy())
    w = np.random.default_rng(0).standard_normal(yt.shape).astype(np.float32)
    (yt * torch.tensor(w)).sum().backward()
    (yh * hl.tensor(w)).sum().backward()
    np.testing.assert_allclose(h.weight.grad.numpy(), t.weight.grad.numpy(), atol=1e-6)
    assert np.all(h.weight.grad.numpy()[8] == 0)
    assert repr(h) == repr(t)
    frozen = nn.Embedding.from_pretrained(hl.tensor(np.eye(3, dtype=np.float32)))
    assert not frozen.weight.requires_grad and frozen(hl.tensor([2])).numpy().tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match="max_norm"):
        nn.Embedding(4, 2, max_norm=1.0)


@pytest.mark.vulkan
def test_nn_functional_takes_torch_inplace_flags():
    x = hl.tensor([-1.0, 2.0])
    assert nn.functional.relu(x, inplace=True).numpy().tolist() == [0.0, 2.0]
    assert nn.functional.dropout(x, 0.5, training=False, inplace=False).numpy().tolist() == [-1.0, 2.0]


@pytest.mark.vulkan
def test_module_to_moves_and_casts_parameters_in_place():
    torch.manual_seed(0)
    t = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    h = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    _copy_weights(h, t)
    params = list(h.parameters())
    opt = SGD(h.parameters(), lr=0.1)
    topt = torch.optim.SGD(t.parameters(), lr=0.1)
    assert h.to("cpu") is h and all(p.device == "cpu" for p in h.parameters())
    assert [id(p) for p in h.parameters()] == [id(p) for p in params]  # same objects
    h.to(device="vulkan:0")
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(h(hl.tensor(x)).numpy(), t(torch.tensor(x)).detach().numpy(), atol=1e-5)
    for lib, model, o in ((hl, h, opt), (torch, t, topt)):  # the optimizer made before the moves still trains
        model(lib.tensor(x)).sum().backward()
        o.step()
    for (k, p), (_, q) in zip(h.named_parameters(), t.named_parameters()):
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), atol=1e-5, err_msg=k)
    h.zero_grad()
    h.to(hl.bfloat16)
    assert all(p.dtype is hl.bfloat16 for p in h.parameters())
    h.to("cpu", hl.float32)
    assert all(p.dtype is hl.float32 and p.device == "cpu" for p in h.parameters())
    with pytest.raises(TypeError, match="floating"):
        h.to(hl.int64)
    with pytest.raises(hl.DeviceError, match="cuda:0"):
        h.to("cuda:0")


def test_module_zero_grad_set_to_none_false_zeroes_in_place():
    lin = nn.Linear(3, 2)
    x = hl.tensor(np.ones((4, 3), np.float32))
    lin(x).sum().backward()
    grads = [p.grad for p in lin.parameters()]
    lin.zero_grad(set_to_none=False)
    for p, g in zip(lin.parameters(), grads):
        assert p.grad is g  # the same tensors, now zeros
        np.testing.assert_array_equal(g.numpy(), np.zeros(g.shape, np.float32))
    lin.zero_grad()
    assert all(p.grad is None for p in lin.parameters())
