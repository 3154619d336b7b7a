"""helios.nn.init, helios.nn.utils.clip_grad_norm_ and the loss modules, beyond the coverage
parity cases: in-place identity, reproducibility under hl.manual_seed, the truncated normal's
bounds and distribution against its closed form, clipping equal to PyTorch's (the L2 and the
infinity norm, AdamW's flat gradient buffers, non-finite norms), and the errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import helios as hl
from helios import nn
from helios.optim import AdamW
from helios.random import Generator
from parity import assert_close, check

pytestmark = pytest.mark.vulkan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(7)


def A(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _phi(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return (1 + math.erf(x / math.sqrt(2))) / 2


# -- the package paths ----------------------------------------------------------------------------
def test_init_and_utils_are_reachable_as_in_pytorch():
    code = ("import helios as hl; assert hl.nn.init.normal_ and hl.nn.utils.clip_grad_norm_; "
            "import helios.nn.init as I, helios.nn.utils as U; assert I is hl.nn.init and U is hl.nn.utils; "
            "from helios.nn.utils import clip_grad_norm_; from helios.nn.init import trunc_normal_, zeros_; "
            "from helios.nn import CrossEntropyLoss, MSELoss, L1Loss, NLLLoss")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("init", "utils", "CrossEntropyLoss", "MSELoss", "L1Loss", "NLLLoss"):
        assert name in nn.__all__, name


# -- init: in place, reproducible -----------------------------------------------------------------
RANDOM_INITS = {
    "uniform_": (-0.5, 1.5), "normal_": (0.1, 0.5), "trunc_normal_": (0.0, 1.0, -1.5, 1.0), "xavier_uniform_": (),
    "xavier_normal_": (), "kaiming_uniform_": (), "kaiming_normal_": (),
}


@pytest.mark.parametrize("name", sorted(RANDOM_INITS))
def test_random_init_is_in_place_and_seeded(name):
    fn, args = getattr(nn.init, name), RANDOM_INITS[name]
    p = nn.Parameter(hl.zeros(16, 24))
    hl.manual_seed(11)
    assert fn(p, *args) is p and p.requires_grad and p.grad is None
    first = p.numpy().copy()
    assert np.unique(first).size > 300, "the draw fills every element with its own value"
    hl.manual_seed(11)
    np.testing.assert_array_equal(fn(hl.zeros(16, 24), *args).numpy(), first)
    assert not np.array_equal(fn(hl.zeros(16, 24), *args).numpy(), first), "the next draw continues the stream"
    # an explicit generator: its own stream, reproducible, and the default stream does not move
    state = hl.random.get_rng_state()
    a = fn(hl.zeros(16, 24), *args, generator=Generator(5)).numpy()
    b = fn(hl.zeros(16, 24), *args, generator=Generator(5)).numpy()
    np.testing.assert_array_equal(a, b)
    assert hl.random.get_rng_state() == state


def test_init_writes_through_views_and_into_bfloat16_and_host_tensors():
    base = hl.zeros(6, 4)
    nn.init.uniform_(base.t(), 2.0, 3.0)  # a transposed (non-contiguous) view fills its base
    v = base.numpy()
    assert (v >= 2.0).all() and (v < 3.0).all()
    half = nn.init.normal_(hl.zeros(2000, dtype=hl.bfloat16), 3.0, 0.5)
    assert half.dtype is hl.bfloat16 and abs(half.numpy().astype(np.float64).mean() - 3.0) < 0.05
    host = hl.zeros(500).cpu()
    assert nn.init.trunc_normal_(host, a=-0.5, b=0.5) is host and host.is_cpu
    assert np.abs(host.numpy()).max() <= 0.5 and host.numpy().std() > 0.2


def test_constant_fills_work_on_any_dtype_and_in_place():
    for dtype in (hl.float32, hl.int64, hl.bfloat16):
        t = hl.ones(3, 2, dtype=dtype)
        assert nn.init.zeros_(t) is t and (t.numpy() == 0).all()
        assert nn.init.ones_(t) is t and (t.numpy() == 1).all()
        assert nn.init.constant_(t, 7) is t and (t.numpy() == 7).all()
    # an initialiser may run while gradients are being recorded: it records nothing
    p = nn.Parameter(hl.ones(3))
    y = (p * 2).sum()
    nn.init.constant_(p, 0.25)
    assert p.numpy().tolist() == [0.25] * 3 and y.requires_grad


def test_normal_and_uniform_have_the_requested_moments():
    hl.manual_seed(1)
    n = nn.init.normal_(hl.zeros(200_000), -1.5, 0.3).numpy().astype(np.float64)
    assert abs(n.mean() + 1.5) < 0.003 and abs(n.std() - 0.3) < 0.003
    u = nn.init.uniform_(hl.zeros(200_000), -2.0, 6.0).numpy().astype(np.float64)
    assert u.min() >= -2.0 and u.max() < 6.0 and abs(u.mean() - 2.0) < 0.03 and abs(u.std() - 8 / math.sqrt(12)) < 0.03


# -- trunc_normal_ -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mean,std,a,b", [(0.0, 1.0, -2.0, 2.0), (0.3, 1.2, -1.0, 2.5), (0.0, 1.0, 1.0, 1.5),
                                          (5.0, 2.0, 4.0, 100.0), (0.0, 0.02, -0.04, 0.04)])
def test_trunc_normal_matches_the_truncated_distribution(mean, std, a, b):
    """Every value inside [a, b]; mean, std and the whole CDF (Kolmogorov-Smirnov distance) those of
    N(mean, std^2) truncated to [a, b], in closed form."""
    hl.manual_seed(2)
    n = 200_000
    x = nn.init.trunc_normal_(hl.zeros(n), mean, std, a, b).numpy().astype(np.float64)
    assert a <= x.min() and x.max() <= b, f"values {x.min()}..{x.max()} outside [{a}, {b}]"
    al, be = (a - mean) / std, (b - mean) / std
    z = _cdf(be) - _cdf(al)
    m = mean + std * (_phi(al) - _phi(be)) / z
    var = std ** 2 * (1 + (al * _phi(al) - be * _phi(be)) / z - ((_phi(al) - _phi(be)) / z) ** 2)
    assert abs(x.mean() - m) < 0.01 * std, f"mean {x.mean()} vs {m}"
    assert abs(x.std() - math.sqrt(var)) < 0.01 * std, f"std {x.std()} vs {math.sqrt(var)}"
    xs = np.sort(x)
    want = (np.array([_cdf((v - mean) / std) for v in xs[::100]]) - _cdf(al)) / z
    ks = np.abs(want - np.arange(0, n, 100) / n).max()
    assert ks < 0.006, f"Kolmogorov-Smirnov distance {ks}"


def test_trunc_normal_warns_far_from_the_mean_and_refuses_bad_bounds():
    with pytest.warns(UserWarning, match="more than 2 std"):
        nn.init.trunc_normal_(hl.zeros(10), mean=10.0, std=1.0, a=-2.0, b=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.init.trunc_normal_(hl.zeros(10), std=0.02)  # PyTorch's usual call: bounds far outside, no warning
    with pytest.raises(ValueError, match="a must be below b"):
        nn.init.trunc_normal_(hl.zeros(3), a=1.0, b=1.0)
    with pytest.raises(ValueError, match="std must be > 0"):
        nn.init.trunc_normal_(hl.zeros(3), std=0.0)


# -- fan-based initialisers ---------------------------------------------------------------------------
def test_gains_and_fan_bounds_match_pytorch():
    for nl, param in (("linear", None), ("sigmoid", None), ("tanh", None), ("relu", None), ("leaky_relu", None),
                      ("leaky_relu", 0.2), ("leaky_relu", math.sqrt(5)), ("selu", None), ("conv2d", None)):
        assert nn.init.calculate_gain(nl, param) == pytest.approx(torch.nn.init.calculate_gain(nl, param)), nl
    shape = (64, 32, 3, 3)  # fans over the receptive field, as for a convolution weight
    fan_in, fan_out = 32 * 9, 64 * 9
    cases = [("xavier_uniform_", dict(gain=2.0), math.sqrt(3) * 2.0 * math.sqrt(2 / (fan_in + fan_out))),
             ("kaiming_uniform_", dict(a=math.sqrt(5)), math.sqrt(3) * math.sqrt(2 / 6) / math.sqrt(fan_in)),
             ("kaiming_uniform_", dict(mode="fan_out", nonlinearity="relu"), math.sqrt(6 / fan_out))]
    for name, kw, bound in cases:
        hl.manual_seed(0)
        v = getattr(nn.init, name)(hl.zeros(*shape), **kw).numpy().astype(np.float64)
        t = getattr(torch.nn.init, name)(torch.zeros(*shape), **kw).numpy().astype(np.float64)
        assert np.abs(v).max() <= bound and np.abs(v).max() > 0.99 * bound, f"{name} {kw}: bound {bound}"
        assert abs(v.std() - t.std()) < 0.02 * t.std(), f"{name} {kw}: std {v.std()} vs PyTorch's {t.std()}"
    for name, kw, std in (("xavier_normal_", dict(gain=0.5), 0.5 * math.sqrt(2 / (fan_in + fan_out))),
                          ("kaiming_normal_", dict(nonlinearity="relu"), math.sqrt(2 / fan_in))):
        v = getattr(nn.init, name)(hl.zeros(*shape), **kw).numpy().astype(np.float64)
        assert abs(v.std() - std) < 0.02 * std and abs(v.mean()) < 0.02 * std, f"{name}: std {v.std()} vs {std}"


def test_init_errors_are_one_clear_line():
    with pytest.raises(TypeError, match="normal_: tensor must be floating point, got int64"):
        nn.init.normal_(hl.zeros(3, dtype=hl.int64))
    with pytest.raises(TypeError, match="uniform_: tensor must be a helios Tensor"):
        nn.init.uniform_(np.zeros(3))
    with pytest.raises(TypeError, match="generator must be a helios.random.Generator"):
        nn.init.normal_(hl.zeros(3), generator=torch.Generator())
    with pytest.raises(ValueError, match="uniform_: a must not exceed b"):
        nn.init.uniform_(hl.zeros(3), 1.0, 0.0)
    with pytest.raises(ValueError, match="normal_: std must be >= 0"):
        nn.init.normal_(hl.zeros(3), std=-1.0)
    with pytest.raises(ValueError, match="at least 2 dims"):
        nn.init.xavier_uniform_(hl.zeros(5))
    with pytest.raises(ValueError, match="mode must be 'fan_in' or 'fan_out'"):
        nn.init.kaiming_uniform_(hl.zeros(3, 3), mode="fan_avg")
    with pytest.raises(ValueError, match="unsupported nonlinearity 'swish'"):
        nn.init.calculate_gain("swish")
    with pytest.warns(UserWarning, match="zero-element"):
        nn.init.kaiming_uniform_(hl.zeros(0, 3))


# -- clip_grad_norm_ ----------------------------------------------------------------------------------
def _pair(seed: int = 0):
    """The same small model in both libraries with equal weights, after one backward of the same loss."""
    torch.manual_seed(seed)
    tm = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    hm = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    hm.load_state_dict({k: hl.tensor(v.detach().numpy()) for k, v in tm.state_dict().items()})
    x = A(5, 6) * 4
    tm(torch.tensor(x)).pow(2).sum().backward()
    return hm, tm, x


def _backward(hm, x):
    (hm(hl.tensor(x)) * hm(hl.tensor(x))).sum().backward()


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), "inf"])
@pytest.mark.parametrize("flat", [False, True], ids=["plain", "adamw-flat"])
def test_clip_coefficient_equals_pytorchs(norm_type, flat):
    """The gradients after clipping (hence the coefficient) and the returned norm equal PyTorch's;
    ``flat``: the gradients live in AdamW's flat buffer, which the L2 norm reduces in one dispatch."""
    for max_norm in (0.05, 1e6):
        hm, tm, x = _pair()
        if flat:
            AdamW(hm.parameters(), lr=0.0)
        _backward(hm, x)
        before = {n: p.grad.numpy().copy() for n, p in hm.named_parameters()}
        hn = nn.utils.clip_grad_norm_(hm.parameters(), max_norm, norm_type)  # a generator, as model.parameters()
        tn = torch.nn.utils.clip_grad_norm_(tm.parameters(), max_norm, norm_type)
        assert_close(hn, tn, "float32", "total norm")
        assert tuple(hn.shape) == () and hn.dtype is hl.float32
        for (name, p), (_, q) in zip(hm.named_parameters(), tm.named_parameters()):
            assert_close(p.grad, q.grad, "float32", f"clipped gradient of {name}")
            if max_norm == 1e6:
                np.testing.assert_array_equal(p.grad.numpy(), before[name], err_msg="a norm below max_norm leaves it as is")


def test_clip_takes_one_tensor_skips_missing_grads_and_handles_none():
    t = nn.Parameter(hl.zeros(4))
    t.grad = hl.tensor([3.0, 4.0, 0.0, 0.0])
    n = nn.utils.clip_grad_norm_(t, 1.0)
    assert n.item() == pytest.approx(5.0)
    np.testing.assert_allclose(t.grad.numpy(), [0.6, 0.8, 0, 0], rtol=1e-5)
    no_grad = nn.Parameter(hl.ones(3))
    t.grad = hl.tensor([0.0, -8.0, 1.0, 2.0])
    assert nn.utils.clip_grad_norm_([no_grad, t], 4.0, norm_type="inf").item() == 8.0
    np.testing.assert_allclose(t.grad.numpy(), [0, -4, 0.5, 1], rtol=1e-5)
    assert no_grad.grad is None
    assert nn.utils.clip_grad_norm_([no_grad], 1.0).item() == 0.0
    assert nn.utils.clip_grad_norm_([], 1.0, float("inf")).item() == 0.0
    for foreach in (None, True, False):  # a speed choice in PyTorch: the same result
        t.grad = hl.tensor([3.0, 4.0, 0.0, 0.0])
        assert nn.utils.clip_grad_norm_(t, 1.0, foreach=foreach).item() == pytest.approx(5.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_error_if_nonfinite(bad, norm_type):
    """error_if_nonfinite=True raises as PyTorch does and leaves the gradients untouched; without
    it the non-finite norm is returned and scales the gradients as PyTorch's does."""
    g = np.array([1.0, bad, -2.0], np.float32)

    def params(L):
        p = L.nn.Parameter(L.zeros(3))
        q = L.nn.Parameter(L.zeros(2))
        p.grad, q.grad = L.tensor(g), L.tensor(np.array([0.5, 0.25], np.float32))
        return [p, q]

    hp, tp = params(hl), params(torch)
    with pytest.raises(RuntimeError, match="non-finite") as e:
        nn.utils.clip_grad_norm_(hp, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(tp, 1.0, norm_type, error_if_nonfinite=True)
    assert "\n" not in str(e.value) and "error_if_nonfinite=False" in str(e.value)
    np.testing.assert_array_equal(hp[0].grad.numpy(), g)
    np.testing.assert_array_equal(hp[1].grad.numpy(), [0.5, 0.25])
    hn = nn.utils.clip_grad_norm_(hp, 1.0, norm_type)
    tn = torch.nn.utils.clip_grad_norm_(tp, 1.0, norm_type)
    assert_close(hn, tn, "float32", "non-finite total norm")
    for h, t in zip(hp, tp):
        assert_close(h.grad, t.grad, "float32", "gradient scaled by a non-finite norm")
    # finite gradients with the check on: clipped as usual
    hp, tp = params(hl), params(torch)
    hp[0].grad, tp[0].grad = hl.tensor([3.0, 4.0, 0.0]), torch.tensor([3.0, 4.0, 0.0])
    assert_close(nn.utils.clip_grad_norm_(hp, 1.0, norm_type, error_if_nonfinite=True),
                 torch.nn.utils.clip_grad_norm_(tp, 1.0, norm_type, error_if_nonfinite=True), "float32", "norm")
    assert_close(hp[0].grad, tp[0].grad, "float32", "clipped gradient")


def test_clip_refuses_other_norm_types_and_bad_arguments():
    p = nn.Parameter(hl.zeros(2))
    p.grad = hl.ones(2)
    for nt in (1.0, 3, -float("inf"), 0, "fro"):
        with pytest.raises(ValueError, match="clip_grad_norm_: norm_type must be 2.0 or inf"):
            nn.utils.clip_grad_norm_(p, 1.0, norm_type=nt)
    with pytest.raises(TypeError, match="foreach must be None, True or False"):
        nn.utils.clip_grad_norm_(p, 1.0, foreach="yes")
    with pytest.raises(TypeError, match="parameters must be helios Tensors"):
        nn.utils.clip_grad_norm_([np.ones(2)], 1.0)
    np.testing.assert_array_equal(p.grad.numpy(), [1.0, 1.0])


# -- losses ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_modules_match_pytorch(reduction):
    t3 = np.array([[1, -1, 0], [3, 3, 2]])
    for make, arrays in (
        (lambda L: L.nn.MSELoss(reduction=reduction), (A(3, 4), A(3, 4))),
        (lambda L: L.nn.L1Loss(reduction=reduction), (A(3, 4), A(3, 4))),
        (lambda L: L.nn.CrossEntropyLoss(reduction=reduction, ignore_index=-1), (A(2, 5, 3), t3)),
        (lambda L: L.nn.CrossEntropyLoss(reduction=reduction, ignore_index=-1, label_smoothing=0.25), (A(2, 5, 3), t3)),
        (lambda L: L.nn.CrossEntropyLoss(reduction=reduction, ignore_index=4, label_smoothing=0.25),
         (A(6, 5), np.array([1, 4, 0, 3, 4, 2]))),
        (lambda L: L.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=1.0), (A(5), np.array(2))),
    ):
        check(lambda L, *xs: make(L)(*xs), *arrays)
    w = np.array([0.5, 2.0, 1.0, 1.5], np.float32)
    check(lambda L, x, t, w: L.nn.NLLLoss(weight=w.detach(), ignore_index=0, reduction=reduction)(x.log_softmax(1), t),
          A(6, 4), np.array([0, 2, 3, 1, 3, 3]), w)
    check(lambda L, x, t, w: L.nn.CrossEntropyLoss(weight=w.detach(), reduction=reduction, label_smoothing=0.1)(x, t),
          A(6, 4), np.array([0, 2, 3, 1, 3, -100]), w)
    check(lambda L, x, p, w: L.nn.CrossEntropyLoss(weight=w.detach(), reduction=reduction, label_smoothing=0.4)(
        x, p.softmax(1)), A(3, 4, 2), A(3, 4, 2), w)


def test_loss_module_state_and_errors():
    w = hl.tensor([1.0, 2.0, 3.0])
    ce = nn.CrossEntropyLoss(weight=w, ignore_index=1, label_smoothing=0.1)
    assert ce.weight is w and dict(ce.named_buffers())["weight"] is w and not list(ce.parameters())
    assert (ce.reduction, ce.ignore_index, ce.label_smoothing) == ("mean", 1, 0.1)
    assert nn.CrossEntropyLoss().weight is None and nn.NLLLoss().weight is None and nn.MSELoss().reduction == "mean"
    # a plain list of targets, as F.cross_entropy takes it
    got = ce(hl.tensor(np.ones((2, 3), np.float32)), [0, 2])
    want = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]), ignore_index=1, label_smoothing=0.1)(
        torch.ones(2, 3), torch.tensor([0, 2]))
    assert_close(got, want, "float32", "list targets")
    with pytest.raises(ValueError, match="MSELoss: reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        nn.MSELoss(reduction="avg")
    with pytest.raises(TypeError, match="CrossEntropyLoss: size_average and reduce are deprecated"):
        nn.CrossEntropyLoss(None, True)
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\], got 1.5"):
        nn.CrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(TypeError, match="NLLLoss: weight must be a helios Tensor or None"):
        nn.NLLLoss(weight=[1.0, 2.0])
    with pytest.raises(IndexError, match="out of range for 3 classes"):
        nn.CrossEntropyLoss(label_smoothing=0.2)(hl.zeros(2, 3), hl.tensor([0, 3]))
