"""Parity of every PyTorch API that ``scripts/api_coverage.py`` lists and Helios has.

The tests are parametrised from the script's ``ENTRIES``: an entry Helios has must have a case
in ``CASES`` below (forward values, and gradients where the op is differentiable, against
PyTorch CPU, through ``tests/parity.py``), so adding an op to Helios adds its test; an entry
Helios lacks is skipped with its name.  The script itself must run and the docs table
(``docs/api_coverage.md``) must be the one it writes now.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import helios as hl
from helios.errors import DeviceError
from parity import assert_close, check

pytestmark = pytest.mark.vulkan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "api_coverage.py")
DOC = os.path.join(ROOT, "docs", "api_coverage.md")


def _load_script():
    spec = importlib.util.spec_from_file_location("api_coverage", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["api_coverage"] = mod
    spec.loader.exec_module(mod)
    return mod


cov = _load_script()
RNG = np.random.default_rng(20)


def A(*shape, lo=None) -> np.ndarray:
    """Random float32 values (standard normal; ``lo``: uniform in [lo, lo + 1))."""
    if lo is not None:
        return (RNG.random(shape) + lo).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def I(hi, *shape) -> np.ndarray:  # noqa: E743 - reads as "integers"
    return RNG.integers(0, hi, shape).astype(np.int64)


def mod_check(make, *arrays, **kw):
    """A module built in both libraries with PyTorch's initial weights copied into Helios':
    forward, input gradients and every parameter's gradient compared."""
    torch.manual_seed(0)
    tm = make(torch)
    hm = make(hl)
    hm.load_state_dict({k: hl.tensor(v.detach().numpy()) for k, v in tm.state_dict().items()})
    check(lambda L, *xs: (hm if L is hl else tm)(*xs), *arrays, **kw)
    hp, tp = dict(hm.named_parameters()), dict(tm.named_parameters())
    assert sorted(hp) == sorted(tp), f"parameter names {sorted(hp)} != PyTorch's {sorted(tp)}"
    for name, p in tp.items():
        if p.grad is not None:
            assert hp[name].grad is not None, f"{name}: no gradient"
            assert_close(hp[name].grad, p.grad, "float32", f"gradient of {name}", 4)


def same(h, t) -> None:
    """Helios result ``h`` equals PyTorch's ``t`` (tensors by value, anything else by ==)."""
    if isinstance(t, torch.Tensor):
        assert_close(h, t, str(t.dtype).replace("torch.", ""), "value")
    else:
        assert h == t, f"{h!r} != {t!r}"


def both(fn) -> None:
    """fn(lib) gives the same in Helios and PyTorch."""
    same(fn(hl), fn(torch))


def write(fn, *arrays) -> None:
    """An in-place write: fn(lib, tensor, ...) mutates a copy of the first input made inside the
    graph (a non-leaf); the results and the gradients of every float input must agree."""
    def run(L, *xs):
        y = xs[0] * 1
        fn(L, y, *xs[1:])
        return y
    check(run, *arrays)


def _stats_multinomial():
    p = np.array([0.1, 0.0, 0.6, 0.3], np.float32)
    hl.manual_seed(3)
    a = hl.multinomial(hl.tensor(np.tile(p, (4000, 1))), 1, replacement=True).numpy().reshape(-1)
    freq = np.bincount(a, minlength=4) / a.size
    assert freq[1] == 0 and np.abs(freq - p).max() < 0.03, f"frequencies {freq} for weights {p}"
    hl.manual_seed(3)
    b = hl.multinomial(hl.tensor(np.tile(p, (4000, 1))), 1, replacement=True).numpy().reshape(-1)
    assert (a == b).all(), "the same seed must give the same draws"
    w = hl.multinomial(hl.tensor(np.tile(p, (500, 1))), 3).numpy()
    assert all(sorted(r) == [0, 2, 3] for r in w.tolist()), "without replacement: 3 distinct non-zero categories"
    first = np.bincount(w[:, 0], minlength=4) / 500
    assert abs(first[2] - 0.6) < 0.08, f"first draw frequencies {first}"
    assert tuple(hl.multinomial(hl.tensor(p), 2).shape) == (2,)
    with pytest.raises(ValueError, match="without replacement"):
        hl.multinomial(hl.tensor(p), 5)


def _save_load(tmp):
    sd = {"w": hl.tensor(A(3, 4)), "n": [hl.tensor(I(5, 2)), 7]}
    path = os.path.join(tmp, "sd.pt")
    hl.save(sd, path)
    back = hl.load(path)
    np.testing.assert_array_equal(back["w"].numpy(), sd["w"].numpy())
    np.testing.assert_array_equal(back["n"][0].numpy(), sd["n"][0].numpy())
    assert back["n"][1] == 7


def _module_tree():
    def make(L):
        class Tiny(L.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = L.nn.Parameter(L.ones(3))
                self.inner = L.nn.Linear(3, 2)

            def forward(self, x):
                return self.inner(x * self.w)
        return Tiny()
    mod_check(make, A(4, 3))
    assert [n for n, _ in make(hl).named_parameters()] == [n for n, _ in make(torch).named_parameters()]


def _randint():
    hl.manual_seed(1)
    a = hl.randint(3, 9, (20000,)).numpy()
    assert a.dtype == np.int64 and a.min() == 3 and a.max() == 8
    assert np.abs(np.bincount(a - 3, minlength=6) / a.size - 1 / 6).max() < 0.02
    hl.manual_seed(1)
    np.testing.assert_array_equal(hl.randint(3, 9, (20000,)).numpy(), a)
    big = hl.randint(2 ** 40, (50000,)).numpy()  # a range past float32's 24 bits: every bit varies
    assert big.min() >= 0 and big.max() < 2 ** 40 and big.max() > 2 ** 39 and len(np.unique(big & 1)) == 2
    assert hl.randint(10, (2, 3), dtype=hl.int32).dtype is hl.int32


def _dtype_alias(name: str, make) -> None:
    """torch.<name> names the same dtype in Helios, and a tensor made with it holds PyTorch's values."""
    both(lambda L: (str(getattr(L, name)).split(".")[-1], str(make(L, getattr(L, name)).dtype).split(".")[-1],
                    make(L, getattr(L, name)).float().tolist()))


def _pin_memory():
    x = hl.tensor(A(3))
    h = x.cpu()
    assert h.pin_memory() is h
    with pytest.raises(DeviceError):
        x.pin_memory()


def _index_write_tensor():
    write(lambda L, y, i, v: y.__setitem__(i, v), A(5, 3), np.array([4, 0, 2]), A(3, 3))
    write(lambda L, y, v: y.__setitem__((slice(None), [0, 2]), v), A(4, 3), A(4, 2))
    write(lambda L, y, m, v: y.__setitem__(m, v), A(4, 3), RNG.random((4, 3)) > 0.5, np.float32(2.5) * np.ones((), np.float32))
    y = hl.zeros(4)
    y[hl.tensor([1, 1, 3])] = hl.tensor([1.0, 2.0, 3.0])  # a repeated index: the last write wins
    np.testing.assert_array_equal(y.numpy(), [0, 2, 0, 3])


def _mask_write():
    write(lambda L, y: y.__setitem__(y < 0, -float("inf")), A(3, 5))
    m = RNG.random((3, 5)) > 0.5
    write(lambda L, y, m: y.__setitem__(m, L.arange(int(m.sum()), dtype=L.float32)), A(3, 5), m)
    # nanoGPT's top-k filter: logits[logits < v[:, [-1]]] = -inf
    def topk_filter(L, y):
        v, _ = L.topk(y, 2)
        y[y < v[:, [-1]]] = -float("inf")
    write(topk_filter, A(4, 7))


def _view_as_complex():
    """The pairs of the last dim read as complex numbers: parts, a broadcasting complex product,
    and a last dim that is not 2 refused in both libraries."""
    check(lambda L, x: (z := L.view_as_complex(x)).real * 2 - z.imag, A(3, 4, 2))
    check(lambda L, x, y: L.view_as_real(L.view_as_complex(x) * L.view_as_complex(y)), A(2, 3, 2), A(3, 2))
    for L, err in ((hl, hl.ShapeError), (torch, RuntimeError)):
        with pytest.raises(err, match="last dimension of size 2"):
            L.view_as_complex(L.zeros(3, 3))


def _view_as_real():
    """A complex tensor back as (real, imag) pairs, after slicing, unsqueeze and arithmetic."""
    check(lambda L, x: L.view_as_real(L.view_as_complex(x)[1:, ::2].unsqueeze(0)), A(3, 4, 2))
    check(lambda L, x, y: L.view_as_real(L.view_as_complex(x) * y + 1.5 - L.view_as_complex(x).conj()), A(3, 4, 2), A(4))
    both(lambda L: tuple(L.view_as_real(L.polar(L.ones(2, 3), L.zeros(2, 3))).shape))


def _init_fill(name):
    """A constant initialiser: in place (on a Parameter that requires grad too), the same tensor back."""
    write(lambda L, y: getattr(L.nn.init, name)(y), A(3, 4))
    write(lambda L, y: getattr(L.nn.init, name)(y.t()), A(3, 4))  # through a transposed view
    for L in (hl, torch):
        p = L.nn.Parameter(L.tensor(A(2, 3)))
        assert getattr(L.nn.init, name)(p) is p and p.requires_grad


def _init_stats(name, *args, bounds=None, **kw):
    """A random initialiser fills its Parameter in place and returns it; on 120000 draws the
    sample's mean, std and quantiles agree with PyTorch's (the generators differ, so the values
    do not), every value is inside ``bounds`` (lo, hi) if given, and hl.manual_seed repeats the draw."""
    torch.manual_seed(0)
    hl.manual_seed(0)
    h, t = hl.nn.Parameter(hl.zeros(300, 400)), torch.nn.Parameter(torch.zeros(300, 400))
    assert getattr(hl.nn.init, name)(h, *args, **kw) is h and h.requires_grad
    assert getattr(torch.nn.init, name)(t, *args, **kw) is t
    hv, tv = h.numpy().astype(np.float64), t.detach().numpy().astype(np.float64)
    tol = 0.02 * tv.std()
    for what, a, b in (("mean", hv.mean(), tv.mean()), ("std", hv.std(), tv.std()),
                       *((f"quantile {q}", np.quantile(hv, q), np.quantile(tv, q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9))):
        assert abs(a - b) < tol, f"{name}: {what} {a:.5f} vs PyTorch's {b:.5f}"
    if bounds is not None:
        assert bounds[0] <= hv.min() and hv.max() <= bounds[1], f"{name}: values {hv.min()}..{hv.max()} outside {bounds}"
    hl.manual_seed(0)
    np.testing.assert_array_equal(getattr(hl.nn.init, name)(hl.zeros(300, 400), *args, **kw).numpy(), h.numpy())


def _clip_grad_norm():
    """The total norm and the clipped gradients equal PyTorch's on the same gradients, for the L2
    and the infinity norm, when clipping (max_norm 0.3) and when not (1e4)."""
    def params(L, grads):
        ps = [L.nn.Parameter(L.tensor(np.zeros_like(g))) for g in grads]
        for p, g in zip(ps, grads):
            p.grad = L.tensor(g)
        return ps
    for norm_type in (2.0, float("inf")):
        for max_norm in (0.3, 1e4):
            grads = [A(4, 5) * 3, A(7), np.asarray(A(1)[0])]
            hp, tp = params(hl, grads), params(torch, grads)
            hn = hl.nn.utils.clip_grad_norm_(hp, max_norm, norm_type=norm_type)
            tn = torch.nn.utils.clip_grad_norm_(tp, max_norm, norm_type=norm_type)
            assert_close(hn, tn, "float32", f"total norm (norm_type={norm_type})")
            for i, (h, t) in enumerate(zip(hp, tp)):
                assert_close(h.grad, t.grad, "float32", f"clipped gradient {i} (norm_type={norm_type}, max_norm={max_norm})")


CASES = {
    # -- Tensor methods ------------------------------------------------------------------------
    "tensor:view": lambda: check(lambda L, x: x.view(4, 6) * 2, A(2, 3, 4)),
    "tensor:transpose": lambda: check(lambda L, x: x.transpose(0, 2) * x.transpose(-1, 0), A(2, 3, 2)),
    "tensor:contiguous": lambda: check(lambda L, x: x.transpose(0, 1).contiguous().view(-1), A(3, 4)),
    "tensor:size": lambda: both(lambda L: (tuple(L.zeros(2, 3, 4).size()), L.zeros(2, 3, 4).size(-1))),
    "tensor:shape": lambda: both(lambda L: tuple(L.zeros(2, 3).shape)),
    "tensor:dtype": lambda: both(lambda L: [str(t.dtype).split(".")[-1] for t in
                                            (L.zeros(2), L.zeros(2, dtype=L.int64), L.zeros(2).to(L.bfloat16))]),
    "tensor:device": lambda: (str(hl.zeros(2).device).split(":")[0] in ("vulkan", "cuda") or _fail("device")),
    "tensor:split": lambda: check(lambda L, x: L.cat([p * (i + 1) for i, p in enumerate(x.split(2, dim=1))], 1), A(3, 5)),
    "tensor:chunk": lambda: check(lambda L, x: L.cat([p * (i + 1) for i, p in enumerate(x.chunk(3, -1))], -1), A(2, 7)),
    "tensor:masked_fill": lambda: check(lambda L, x, m: x.masked_fill(m, -1.5), A(3, 4), RNG.random((3, 4)) > 0.5),
    "tensor:numel": lambda: both(lambda L: L.zeros(2, 3, 5).numel()),
    "tensor:dim": lambda: both(lambda L: L.zeros(2, 3, 5).dim()),
    "tensor:to": lambda: check(lambda L, x: x.to(L.float16).to(L.float32) * 3, A(4, 3)),
    "tensor:float": lambda: check(lambda L, x: x.float() * 2, A(4)),
    "tensor:long": lambda: check(lambda L, x: x.long(), A(6) * 5, grad=False),
    "tensor:int": lambda: check(lambda L, x: (x > 0).int().argmax(-1), A(3, 6), grad=False),
    "tensor:bool": lambda: check(lambda L, x: x.bool(), np.array([0.0, 1.0, -2.0, 0.0], np.float32), grad=False),
    "tensor:type_as": lambda: check(lambda L, x, i: i.type_as(x) * x, A(5), I(9, 5)),
    "tensor:item": lambda: both(lambda L: round(L.tensor([[2.5]]).item(), 6)),
    "tensor:tolist": lambda: both(lambda L: L.tensor([[1, 2], [3, 4]]).tolist()),
    "tensor:numpy": lambda: np.testing.assert_array_equal(hl.tensor(A(3, 2) * 0 + 1.5).numpy(), np.full((3, 2), 1.5, np.float32)),
    "tensor:cpu": lambda: both(lambda L: L.tensor([1.5, 2.5]).cpu().numpy().tolist()),
    "tensor:detach": lambda: check(lambda L, x: x.detach() * x, A(4)),
    "tensor:clone": lambda: check(lambda L, x: x.clone() * x, A(4)),
    "tensor:backward": lambda: check(lambda L, x: (x * x).sum() * 0.5, A(3, 2)),
    "tensor:unsqueeze": lambda: check(lambda L, x: x.unsqueeze(0) * x.unsqueeze(-1), A(4)),
    "tensor:squeeze": lambda: check(lambda L, x: x.squeeze(1) * 2, A(3, 1, 2)),
    "tensor:reshape": lambda: check(lambda L, x: x.transpose(0, 1).reshape(2, -1), A(3, 4)),
    "tensor:permute": lambda: check(lambda L, x: x.permute(2, 0, 1) * 2, A(2, 3, 4)),
    "tensor:flatten": lambda: check(lambda L, x: x.flatten(1) * 2, A(2, 3, 4)),
    "tensor:expand": lambda: check(lambda L, x: x.expand(3, 4, 2) * 1.5, A(4, 1)),
    "tensor:pow": lambda: check(lambda L, x: x.pow(2).mean(-1, keepdim=True), A(3, 5)),
    "tensor:mean": lambda: check(lambda L, x: x.mean(-1, keepdim=True) + x.mean(), A(3, 5)),
    "tensor:sum": lambda: check(lambda L, x: x.sum(0) * x.sum(), A(3, 5)),
    "tensor:cos": lambda: check(lambda L, x: x.cos(), A(6)),
    "tensor:sin": lambda: check(lambda L, x: x.sin(), A(6)),
    "tensor:softmax": lambda: check(lambda L, x: x.softmax(dim=-1), A(3, 7)),
    "tensor:argmax": lambda: check(lambda L, x: x.argmax(-1), A(3, 7), grad=False),
    "tensor:gather": lambda: check(lambda L, x, i: x.gather(-2, i), A(2, 5, 3), I(5, 2, 4, 3)),
    "tensor:scatter": lambda: check(lambda L, x, i, s: x.scatter(1, i, s), A(3, 6), np.argsort(RNG.random((3, 6)), 1)[:, :4],
                                    A(3, 4)),
    "tensor:eq": lambda: check(lambda L, x, y: x.eq(y), I(3, 6), I(3, 6), grad=False),
    "tensor:ne": lambda: check(lambda L, x, y: x.ne(y), I(3, 6), I(3, 6), grad=False),
    "tensor:t": lambda: check(lambda L, x: x.t() * 2, A(3, 4)),
    "tensor:copy_": lambda: write(lambda L, y, s: y.copy_(s), A(3, 4), A(3, 4)),
    "tensor:zero_": lambda: write(lambda L, y: y.zero_(), A(3, 4)),
    "tensor:masked_fill_": lambda: write(lambda L, y, m: y.masked_fill_(m, -float("inf")), A(3, 4), RNG.random((3, 4)) > 0.5),
    "tensor:requires_grad_": lambda: both(lambda L: L.zeros(2).requires_grad_().requires_grad),
    "tensor:topk": lambda: check(lambda L, x: x.topk(3, dim=1).values * 2, A(4, 9)),
    "tensor:sort": lambda: check(lambda L, x: x.sort(dim=0, descending=True).values * 2, A(7, 3)),
    "tensor:argsort": lambda: check(lambda L, x: x.argsort(-1), A(3, 11), grad=False),
    "tensor:cumsum": lambda: check(lambda L, x: x.cumsum(-1), A(3, 50)),
    "tensor:cumprod": lambda: check(lambda L, x: x.cumprod(0), A(6, 3)),
    "tensor:repeat": lambda: check(lambda L, x: x.repeat(2, 1, 3), A(2, 3)),
    "tensor:flip": lambda: check(lambda L, x: x.flip(0, -1) * 2, A(3, 2, 4)),
    "tensor:roll": lambda: check(lambda L, x: x.roll(-2, 1) * 2, A(3, 5)),
    "tensor:tile": lambda: check(lambda L, x: x.tile((2, 2)), A(3)),
    "tensor:norm": lambda: check(lambda L, x: x.norm(dim=-1), A(4, 6)),
    "tensor:index_add": lambda: check(lambda L, x, i, s: x.index_add(0, i, s, alpha=2.0), A(5, 3), np.array([4, 0, 4, 1]), A(4, 3)),
    "tensor:scatter_add": lambda: check(lambda L, x, i, s: x.scatter_add(0, i, s), A(4, 3), I(4, 6, 3), A(6, 3)),
    "tensor:index_select": lambda: check(lambda L, x, i: x.index_select(1, i), A(3, 5), np.array([4, 0, 0, 2])),
    "tensor:pin_memory": _pin_memory,
    "tensor:x[:, -1, :]": lambda: check(lambda L, x: x[:, -1, :] * 2, A(2, 3, 4)),
    "tensor:x[:, [-1]] (integer list)": lambda: check(lambda L, x: x[:, [-1], :] * 2, A(2, 3, 4)),
    "tensor:x[:, [0, 2]] (integer list)": lambda: check(lambda L, x: x[:, [0, 2]] * 2, A(3, 4)),
    "tensor:x[idx_tensor] (integer tensor)": lambda: check(lambda L, x, i: x[i] * 2, A(5, 3), np.array([4, -1, 0, 4])),
    "tensor:x[arange, idx] (integer tensors)": lambda: check(lambda L, x, i: x[L.arange(4), i], A(4, 6), I(6, 4)),
    "tensor:x[mask] (boolean mask)": lambda: check(lambda L, x: x[x > 0] * 2, A(4, 5)),
    "tensor:x[mask] = v (boolean mask write)": _mask_write,
    "tensor:x[idx] = v (integer index write)": _index_write_tensor,
    # -- torch.* -------------------------------------------------------------------------------
    "torch:tensor": lambda: both(lambda L: L.tensor([[1, 2], [3, 4]]) * 1),
    "torch:from_numpy": lambda: both(lambda L: L.from_numpy(np.arange(6, dtype=np.int64).reshape(2, 3)) * 2),
    "torch:zeros": lambda: both(lambda L: L.zeros(2, 3) + L.zeros((2, 3), dtype=L.int64)),
    "torch:ones": lambda: both(lambda L: L.ones(2, 3) * 3),
    "torch:empty": lambda: both(lambda L: (tuple(L.empty(2, 5).shape), str(L.empty(3, dtype=L.int64).dtype)[-5:])),
    "torch:full": lambda: both(lambda L: L.full((2, 2), -1.5)),
    "torch:zeros_like": lambda: both(lambda L: L.zeros_like(L.ones(2, 3))),
    "torch:ones_like": lambda: both(lambda L: L.ones_like(L.zeros(2, 3, dtype=L.int64))),
    "torch:full_like": lambda: both(lambda L: L.full_like(L.zeros(2, 3), 7.0)),
    "torch:arange": lambda: (both(lambda L: L.arange(2, 11, 3)), both(lambda L: L.arange(0, 1, 0.25))),
    "torch:randn": lambda: both(lambda L: (tuple(L.randn(3, 4).shape), bool(L.randn(1000).std() > 0.9))),
    "torch:randint": lambda: _randint(),
    "torch:finfo": lambda: both(lambda L: [(L.finfo(d).eps, L.finfo(d).max, L.finfo(d).min, L.finfo(d).tiny, L.finfo(d).bits)
                                           for d in (L.float32, L.float16, L.bfloat16)]),
    "torch:long": lambda: _dtype_alias("long", lambda L, d: L.arange(0, 5, dtype=d) + 3),
    "torch:float32": lambda: _dtype_alias("float32", lambda L, d: L.arange(0, 5, dtype=d) / 3),
    "torch:bfloat16": lambda: _dtype_alias("bfloat16", lambda L, d: L.ones(3, dtype=d) / 3),
    "torch:float16": lambda: _dtype_alias("float16", lambda L, d: L.ones(3, dtype=d) / 3),
    "torch:manual_seed": lambda: (hl.manual_seed(5), a := hl.randn(4).numpy(), hl.manual_seed(5),
                                  np.testing.assert_array_equal(a, hl.randn(4).numpy())),
    "torch:no_grad": lambda: both(lambda L: _no_grad_flag(L)),
    "torch:tril": lambda: check(lambda L, x: L.tril(x, -1), A(4, 5)),
    "torch:triu": lambda: check(lambda L, x: L.triu(x, 1), A(4, 5)),
    "torch:cat": lambda: check(lambda L, x, y: L.cat((x, y), dim=-1), A(2, 3), A(2, 4)),
    "torch:stack": lambda: check(lambda L, x, y: L.stack([x, y], 1), A(2, 3), A(2, 3)),
    "torch:where": lambda: check(lambda L, m, x, y: L.where(m, x, y), RNG.random((3, 4)) > 0.5, A(3, 4), A(4)),
    "torch:matmul": lambda: check(lambda L, x, y: L.matmul(x, y), A(2, 3, 4), A(4, 5)),
    "torch:addmm": lambda: check(lambda L, b, x, y: L.addmm(b, x, y, beta=0.5, alpha=2.0), A(5), A(3, 4), A(4, 5)),
    "torch:baddbmm": lambda: check(lambda L, b, x, y: L.baddbmm(b, x, y, beta=0.0, alpha=0.125), A(2, 3, 5), A(2, 3, 4),
                                   A(2, 4, 5)),
    "torch:bmm": lambda: check(lambda L, x, y: L.bmm(x, y), A(2, 3, 4), A(2, 4, 5)),
    "torch:einsum": lambda: (check(lambda L, x, y: L.einsum("bhqd,bhkd->bhqk", x, y), A(2, 2, 3, 4), A(2, 2, 5, 4)),
                             check(lambda L, x, y: L.einsum("...i,ij->...j", x, y), A(2, 3, 4), A(4, 2)),
                             check(lambda L, x: L.einsum("ii->i", x), A(3, 3)),
                             check(lambda L, x, y, z: L.einsum("i,j,k->ijk", x, y, z), A(2), A(3), A(2))),
    "torch:outer": lambda: check(lambda L, x, y: L.outer(x, y), A(3), A(4)),
    "torch:rsqrt": lambda: check(lambda L, x: L.rsqrt(x), A(5, lo=0.5)),
    "torch:tanh": lambda: check(lambda L, x: L.tanh(x), A(5)),
    "torch:pow": lambda: check(lambda L, x: L.pow(x, 3.0), A(5)),
    "torch:topk": lambda: (check(lambda L, x: L.topk(x, 2, largest=False).values, A(3, 6)),
                           check(lambda L, x: L.topk(x, 4)[1], A(2, 70), grad=False)),
    "torch:multinomial": _stats_multinomial,
    "torch:sort": lambda: (check(lambda L, x: L.sort(x, descending=True)[0] * 2, A(3, 600)),
                           check(lambda L, x: L.sort(x, stable=True, dim=0)[1], I(3, 40, 2), grad=False)),
    "torch:argsort": lambda: check(lambda L, x: L.argsort(x, dim=0, stable=True), I(4, 9, 3), grad=False),
    "torch:cumsum": lambda: (check(lambda L, x: L.cumsum(x, dim=0), A(300, 2)), check(lambda L, x: L.cumsum(x, 1), I(5, 2, 9),
                                                                                  grad=False)),
    "torch:cumprod": lambda: check(lambda L, x: L.cumprod(x, -1), np.array([[1.5, 0.0, 2.0, -1.0], [0.5, 2.0, 0.0, 0.0]], np.float32)),
    "torch:gather": lambda: check(lambda L, x, i: L.gather(x, 1, i), A(3, 5), I(5, 3, 7)),
    "torch:scatter": lambda: check(lambda L, x, i: L.scatter(x, 0, i, 0.5), A(5, 2), np.array([[4, 0], [1, 3]])),
    "torch:scatter_add": lambda: check(lambda L, x, i, s: L.scatter_add(x, 1, i, s), A(2, 4), I(4, 2, 9), A(2, 9)),
    "torch:index_add": lambda: check(lambda L, x, i, s: L.index_add(x, 1, i, s), A(2, 4), np.array([3, 3, 0]), A(2, 3)),
    "torch:index_select": lambda: check(lambda L, x, i: L.index_select(x, 0, i), A(4, 3), np.array([3, 0, 3])),
    "torch:flip": lambda: check(lambda L, x: L.flip(x, [1]), A(2, 5)),
    "torch:roll": lambda: check(lambda L, x: L.roll(x, (1, -1), (0, 1)), A(3, 4)),
    "torch:tile": lambda: check(lambda L, x: L.tile(x, (2, 1, 2)), A(2, 3)),
    "torch:norm": lambda: (check(lambda L, x: L.norm(x), A(3, 4)), check(lambda L, x: L.norm(x, p=1, dim=0), A(3, 4)),
                           check(lambda L, x: L.norm(x, p=float("inf"), dim=1, keepdim=True), A(3, 4)),
                           check(lambda L, x: L.norm(x, p=3, dim=(0, 1)), A(3, 4))),
    "torch:repeat_interleave": lambda: (check(lambda L, x: L.repeat_interleave(x, 2, dim=1), A(2, 3, 4)),
                                        check(lambda L, x: L.repeat_interleave(x, L.tensor([1, 0, 3]), dim=0), A(3, 2))),
    "torch:save": lambda: _save_load(_tmpdir()),
    "torch:load": lambda: _save_load(_tmpdir()),
    "torch:polar": lambda: (check(lambda L, a, t: L.view_as_real(L.polar(a, t)), A(3, 4, lo=0.5), A(3, 4) * 3),
                            check(lambda L, a, t: L.view_as_real(L.polar(a, t)), A(4, lo=0.5), A(2, 4))),  # broadcast
    "torch:view_as_complex": lambda: _view_as_complex(),
    "torch:view_as_real": lambda: _view_as_real(),
    # -- torch.nn --------------------------------------------------------------------------------
    "nn:Module": _module_tree,
    "nn:Parameter": lambda: both(lambda L: (L.nn.Parameter(L.ones(2)).requires_grad, isinstance(L.nn.Parameter(L.ones(2)),
                                                                                               L.Tensor))),
    "nn:Linear": lambda: mod_check(lambda L: L.nn.Linear(4, 3), A(2, 5, 4)),
    "nn:Embedding": lambda: mod_check(lambda L: L.nn.Embedding(7, 3), I(7, 2, 5)),
    "nn:LayerNorm": lambda: mod_check(lambda L: L.nn.LayerNorm(6), A(3, 6)),
    "nn:RMSNorm": lambda: mod_check(lambda L: L.nn.RMSNorm(6, eps=1e-6), A(3, 6)),
    "nn:Dropout": lambda: mod_check(lambda L: L.nn.Dropout(0.3).eval(), A(3, 6)),
    "nn:GELU": lambda: mod_check(lambda L: L.nn.GELU(approximate="tanh"), A(3, 6)),
    "nn:ReLU": lambda: mod_check(lambda L: L.nn.ReLU(), A(3, 6)),
    "nn:SiLU": lambda: mod_check(lambda L: L.nn.SiLU(), A(3, 6)),
    "nn:Tanh": lambda: mod_check(lambda L: L.nn.Tanh(), A(3, 6)),
    "nn:Identity": lambda: mod_check(lambda L: L.nn.Identity(), A(3, 6)),
    "nn:Sequential": lambda: mod_check(lambda L: L.nn.Sequential(L.nn.Linear(4, 8), L.nn.ReLU(), L.nn.Linear(8, 2)), A(3, 4)),
    "nn:ModuleList": lambda: mod_check(lambda L: _Stack(L, L.nn.ModuleList([L.nn.Linear(3, 3) for _ in range(2)])), A(2, 3)),
    "nn:ModuleDict": lambda: mod_check(lambda L: _Stack(L, L.nn.ModuleDict({"a": L.nn.Linear(3, 3), "b": L.nn.Tanh()})), A(2, 3)),
    "nn:CrossEntropyLoss": lambda: (
        mod_check(lambda L: L.nn.CrossEntropyLoss(ignore_index=-1), A(6, 5), np.array([1, -1, 4, 0, 2, 2])),
        mod_check(lambda L: L.nn.CrossEntropyLoss(label_smoothing=0.1, reduction="none"), A(2, 5, 3), I(5, 2, 3)),
        check(lambda L, x, t, w: L.nn.CrossEntropyLoss(weight=w.detach(), ignore_index=3, label_smoothing=0.2)(x, t),
              A(6, 4), np.array([0, 3, 2, 1, 3, 1]), A(4, lo=0.5)),
        check(lambda L, x, p: L.nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.3)(x, p.softmax(-1)), A(3, 4), A(3, 4))),
    "nn:MSELoss": lambda: (mod_check(lambda L: L.nn.MSELoss(), A(3, 4), A(3, 4)),
                           mod_check(lambda L: L.nn.MSELoss(reduction="sum"), A(2, 3, 4), A(2, 3, 4))),
    "nn:init.normal_": lambda: _init_stats("normal_", 0.5, 2.0),
    "nn:init.zeros_": lambda: _init_fill("zeros_"),
    "nn:init.ones_": lambda: _init_fill("ones_"),
    "nn:init.trunc_normal_": lambda: (_init_stats("trunc_normal_", std=0.02, bounds=(-2.0, 2.0)),
                                      _init_stats("trunc_normal_", 0.3, 1.2, -1.0, 2.5, bounds=(-1.0, 2.5))),
    "nn:utils.clip_grad_norm_": _clip_grad_norm,
    # -- torch.nn.functional ----------------------------------------------------------------------
    "F:layer_norm": lambda: check(lambda L, x, w, b: L.nn.functional.layer_norm(x, (5,), w, b, 1e-5), A(3, 5), A(5), A(5)),
    "F:softmax": lambda: check(lambda L, x: L.nn.functional.softmax(x, dim=-1, dtype=L.float32), A(2, 3, 6)),
    "F:log_softmax": lambda: check(lambda L, x: L.nn.functional.log_softmax(x, dim=1), A(2, 3, 6)),
    "F:cross_entropy": lambda: check(lambda L, x, t: L.nn.functional.cross_entropy(x.view(-1, x.size(-1)), t.view(-1),
                                                                                    ignore_index=-1),
                                     A(2, 3, 7), np.array([[1, -1, 6], [0, 2, 2]])),
    "F:scaled_dot_product_attention": lambda: (
        check(lambda L, q, k, v: L.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), A(2, 2, 5, 4), A(2, 2, 5, 4),
              A(2, 2, 5, 3)),
        check(lambda L, q, k, v, m: L.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3), A(2, 4, 4),
              A(2, 6, 4), A(2, 6, 4), RNG.random((4, 6)) > 0.3)),
    "F:dropout": lambda: check(lambda L, x: L.nn.functional.dropout(x, 0.5, training=False) * 2, A(3, 4)),
    "F:linear": lambda: check(lambda L, x, w, b: L.nn.functional.linear(x, w, b), A(2, 3, 4), A(5, 4), A(5)),
    "F:embedding": lambda: check(lambda L, i, w: L.nn.functional.embedding(i, w), I(6, 2, 3), A(6, 4)),
    "F:gelu": lambda: (check(lambda L, x: L.nn.functional.gelu(x, approximate="tanh"), A(3, 5)),
                       check(lambda L, x: L.nn.functional.gelu(x), A(3, 5))),
    "F:silu": lambda: check(lambda L, x: L.nn.functional.silu(x), A(3, 5)),
    "F:relu": lambda: check(lambda L, x: L.nn.functional.relu(x), A(3, 5)),
    "F:leaky_relu": lambda: check(lambda L, x: L.nn.functional.leaky_relu(x, 0.2), A(3, 5)),
    "F:rms_norm": lambda: check(lambda L, x, w: L.nn.functional.rms_norm(x, (6,), w, eps=1e-6), A(2, 3, 6), A(6)),
    "F:pad": lambda: (check(lambda L, x: L.nn.functional.pad(x, (1, 2, 0, 1), value=-1.0), A(2, 3, 4)),
                      check(lambda L, x: L.nn.functional.pad(x, (0, 1), value=-100), I(5, 2, 3), grad=False),
                      check(lambda L, x: L.nn.functional.pad(x, (2, 1), mode="reflect"), A(2, 3, 4))),
    "F:one_hot": lambda: (check(lambda L, t: L.nn.functional.one_hot(t, 5), I(5, 2, 3), grad=False),
                          check(lambda L, t: L.nn.functional.one_hot(t), I(4, 6), grad=False)),
    "F:mse_loss": lambda: check(lambda L, x, y: L.nn.functional.mse_loss(x, y), A(3, 4), A(3, 4)),
    "F:l1_loss": lambda: check(lambda L, x, y: L.nn.functional.l1_loss(x, y, reduction="sum"), A(3, 4), A(3, 4)),
    "F:nll_loss": lambda: check(lambda L, x, t, w: L.nn.functional.nll_loss(x.log_softmax(1), t, weight=w.detach(), ignore_index=2),
                                A(6, 4), np.array([0, 2, 3, 1, 3, 3]), A(4, lo=0.5)),
}


def _fail(what):
    raise AssertionError(what)


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="helios-api-")


def _no_grad_flag(L):
    x = L.ones(2, requires_grad=True)
    with L.no_grad():
        y = x * 2
    return (y.requires_grad, (x * 2).requires_grad)


def _Stack(L, container):  # noqa: N802 - a module factory
    class Stack(L.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = container

        def forward(self, x):
            parts = self.layers.values() if hasattr(self.layers, "values") else self.layers
            for m in parts:
                x = m(x)
            return x
    return Stack()


@pytest.mark.parametrize("entry", cov.ENTRIES, ids=lambda e: e.key)
def test_parity(entry):
    if not cov.has(entry):
        pytest.skip(f"Helios has no {entry.torch_name} yet")
    case = CASES.get(entry.key)
    assert case is not None, f"Helios has {entry.torch_name}, but CASES has no parity test for it: add one"
    case()


def test_every_case_names_an_entry():
    keys = {e.key for e in cov.ENTRIES}
    assert not set(CASES) - keys, f"cases for entries that are not in the list: {sorted(set(CASES) - keys)}"


def test_coverage_script_runs(tmp_path):
    out = tmp_path / "api.md"
    r = subprocess.run([sys.executable, SCRIPT, "--markdown", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    have, total = cov.coverage()["all"]
    assert f"{have}/{total}" in r.stdout.splitlines()[-2], r.stdout[-500:]
    assert total == len(cov.ENTRIES) and 0 < have <= total
    assert out.read_text() == cov.markdown()


def test_docs_table_is_current():
    """docs/api_coverage.md is what the script writes now (regenerate it after adding an op:
    .venv/bin/python scripts/api_coverage.py --markdown docs/api_coverage.md)."""
    with open(DOC) as f:
        assert f.read() == cov.markdown(), "docs/api_coverage.md is stale: rerun scripts/api_coverage.py --markdown docs/api_coverage.md"


def test_errors_are_one_clear_line():
    x = hl.tensor(A(3, 4))
    with pytest.raises(IndexError, match="out of bounds for dim 1 with size 4"):
        x.gather(1, hl.tensor([[0, 4], [1, 1], [2, 2]]))
    with pytest.raises(IndexError, match="out of range"):
        x.topk(5)
    with pytest.raises(IndexError, match="out of bounds"):
        x.index_add(0, hl.tensor([3]), hl.ones(1, 4))
    with pytest.raises(hl.ShapeError, match="einsum"):
        hl.einsum("ij,jk->ik", x, x)
    with pytest.raises(IndexError, match="out of bounds"):
        x[hl.tensor([0, 3])] = 1.0
    with pytest.raises(IndexError, match="-4"):
        hl.nn.functional.one_hot(hl.tensor([1, -4]), 3)
    for err in (IndexError, hl.ShapeError):
        assert "\n" not in str(err("x"))
    assert math.isfinite(hl.norm(hl.zeros(3)).item())
