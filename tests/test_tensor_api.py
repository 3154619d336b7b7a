"""Tensor API hardening: large tensors past maxStorageBufferRange, deferred execution,
creation and random streams, dtype round trips, zero-copy views, item(), in-place ops,
and the autograd surface (no_grad, detach, retain_graph, accumulation, saved-tensor
versioning).  Every value is checked against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios.runtime import get_runtime

pytestmark = pytest.mark.vulkan


def _stats() -> dict:
    return get_runtime().stats()


# -- tensors larger than one binding window -----------------------------------------------------
# One test fills, reduces, reads back and uploads a tensor past the device's own window (lavapipe's
# 128 MiB maxStorageBufferRange); the others run the window-splitting paths at a 4 MiB window
# (``windowed``) on tensors of a few windows, as on any device, a sixteenth of the size.
BIG = 40_000_000  # float32: 160 MB, more than lavapipe's 128 MiB maxStorageBufferRange
WINDOW = 4 << 20
LONG = 2_500_000  # float32: 10 MB, 2.4 windows of 4 MiB


@pytest.fixture(scope="module")
def big_host() -> np.ndarray:
    """LONG float32 values with the extremes planted on both sides of the first window edge."""
    a = np.random.default_rng(7).standard_normal(LONG).astype(np.float32)
    a[123] = -50.0           # minimum: first window
    a[1_100_001] = 60.0      # maximum: second window (past 4 MiB / 4 B = 1,048,576 elements)
    a[-1] = 1000.0           # the very last element shifts the sum: a dropped tail would show
    return a


@pytest.fixture
def windowed(monkeypatch):
    """Bind at most WINDOW bytes at a time on any device (a GPU binds 4 GiB, lavapipe 128 MiB), so
    the window-splitting paths run on tensors of a few windows."""
    rt = get_runtime()
    monkeypatch.setattr(rt, "max_range", min(rt.max_range, WINDOW))
    return rt


def _window_elems() -> int:
    return K._elems_per_dispatch(hl.ones(1))


def _check_reductions(x: hl.Tensor, a: np.ndarray) -> None:
    ref_sum = a.astype(np.float64).sum()
    abs_sum = np.abs(a).astype(np.float64).sum()
    # float32 tree sums over millions of values: allow 1e-7 of the absolute mass (a lost or doubled
    # window, or a dropped tail element, is orders of magnitude larger).
    assert abs(x.sum().item() - ref_sum) <= 1e-7 * abs_sum + 1e-3
    assert abs(x.mean().item() - ref_sum / a.size) <= 1e-7 * abs_sum / a.size + 1e-9
    assert x.max().item() == a.max()
    assert x.min().item() == a.min()
    assert x.argmax().item() == int(a.argmax())
    assert x.argmin().item() == int(a.argmin())


def test_big_tensor_from_numpy_reduces_and_maps(big_host, windowed):
    rt = windowed
    x = hl.tensor(big_host)
    assert x._st.nbytes > rt.max_range, "the test tensor must exceed one binding window"
    _check_reductions(x, big_host)
    y = x * 2 + 1
    np.testing.assert_allclose(y.numpy(), big_host * 2 + 1, rtol=1e-7, atol=0)
    # a view that starts inside the second window
    tail = x[LONG - 1000:]
    np.testing.assert_array_equal(tail.numpy(), big_host[LONG - 1000:])
    assert abs(tail.sum().item() - big_host[LONG - 1000:].astype(np.float64).sum()) < 1e-2


def test_big_tensor_dim_reductions_and_strided_views(big_host, windowed):
    """Ops whose operands span more than one window are split into parts that fit."""
    x = hl.tensor(big_host)
    a = big_host
    rows = x.reshape(4, LONG // 4)
    np.testing.assert_allclose(rows.sum(dim=1).numpy(), a.reshape(4, -1).astype(np.float64).sum(1), rtol=1e-5, atol=1e-2)
    np.testing.assert_array_equal(rows.argmax(dim=1).numpy(), a.reshape(4, -1).argmax(1))
    np.testing.assert_allclose(x.reshape(2, LONG // 2).mean(dim=1, keepdim=True).numpy(),
                               a.reshape(2, -1).astype(np.float64).mean(1, keepdims=True), atol=1e-6)
    cols = x.reshape(LONG // 4, 4).sum(dim=0)
    np.testing.assert_allclose(cols.numpy(), a.reshape(-1, 4).astype(np.float64).sum(0), rtol=1e-5, atol=1e-2)
    ev = x[::2]  # a strided view wider than a window
    assert abs(ev.sum().item() - a[::2].astype(np.float64).sum()) < 1e-2
    np.testing.assert_array_equal((ev * 3).numpy(), a[::2] * 3)
    bias = hl.tensor(np.array([1.0, -2.0, 3.0, -4.0], np.float32))
    np.testing.assert_array_equal((x.reshape(LONG // 4, 4) + bias).numpy(), a.reshape(-1, 4) + bias.numpy())
    np.testing.assert_array_equal(x.numpy(), a, err_msg="the source must be untouched")


def test_a_tensor_past_the_devices_own_window():
    # No window set by the test: the device's own limit (lavapipe's 128 MiB) splits the work.
    x = hl.ones(BIG)
    assert x.sum().item() == pytest.approx(BIG, rel=1e-6)
    assert x.mean().item() == pytest.approx(1.0, rel=1e-6)
    assert x.max().item() == 1.0
    assert x.argmax().item() == 0  # the first of equal maxima
    y = (x * 2 + 1).numpy()
    assert y.shape == (BIG,) and y.min() == 3.0 and y.max() == 3.0
    y[BIG - 1] = 5.0  # the last element, past the first window
    up = hl.tensor(y)  # and back up: an upload past the window
    assert up.max().item() == 5.0 and up.argmax().item() == BIG - 1


def test_big_tensor_randn(windowed):
    x = hl.randn(LONG, seed=11)
    a = x.numpy()
    _check_reductions(x, a)
    # Counter-based and deterministic: the first window is the stream of a small tensor
    # with the same seed, and the second window is a different stream, not a repeat.
    np.testing.assert_array_equal(a[:1000], hl.randn(1000, seed=11).numpy())
    w = _window_elems()
    assert not np.array_equal(a[w:w + 1000], a[:1000])
    assert abs(a.mean()) < 1e-3 and abs(a.std() - 1.0) < 1e-3


# -- deferred execution ------------------------------------------------------------------------
def _vulkan_stream(rt):
    # submits and batches are the Vulkan command stream's; a CUDA stream launches at once
    if not rt.name.startswith("vulkan"):
        pytest.skip(f"{rt.name}: no batched command stream")


def test_deferred_chain_of_1000_ops_does_not_wait():
    rt = get_runtime()
    _vulkan_stream(rt)
    x = hl.tensor(np.arange(8, dtype=np.float32))
    hl.synchronize()
    rt.dev.reset_stats()  # the Vulkan addon's own counters
    y = x
    from helios import elementwise_jit
    from switches import switched

    with switched(elementwise_jit, "ENABLED", False):  # one dispatch per op here (chains fused: test_elementwise_jit.py)
        for _ in range(1000):
            y = y + 1.0
    s = _stats()
    per_submit = rt.dev.auto_submit_dispatches
    assert s["dispatches"] == 1000
    assert s["submits"] <= 1000 // per_submit + 1, s
    assert s["fence_waits"] <= s["submits"] and s["fence_waits"] < 10, s
    assert s["pending_dispatches"] > 0, "nothing may wait for the last batch before a readback"
    np.testing.assert_array_equal(y.numpy(), np.arange(8, dtype=np.float32) + 1000)
    after = _stats()
    assert after["pending_dispatches"] == 0
    # The readback is what submitted the last batch (and waited for it, unless the device had
    # already finished by the time the host looked: a loaded host may be that slow).
    assert after["submits"] == s["submits"] + 1, (s, after)


def test_synchronize_submits_everything():
    _vulkan_stream(get_runtime())
    hl.synchronize()
    y = hl.ones(16) * 3
    assert _stats()["pending_dispatches"] > 0
    hl.synchronize()
    assert _stats()["pending_dispatches"] == 0
    assert y.sum().item() == 48.0


# -- creation ------------------------------------------------------------------------------------
def test_constants():
    np.testing.assert_array_equal(hl.zeros(2, 3).numpy(), np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(hl.ones((4,), dtype=hl.int32).numpy(), np.ones(4, np.int32))
    f = hl.full((2, 2), 7.5)
    assert f.dtype is hl.float32
    np.testing.assert_array_equal(f.numpy(), np.full((2, 2), 7.5, np.float32))
    assert hl.full((3,), 4).dtype is hl.int64
    assert hl.full((3,), True).dtype is hl.bool
    np.testing.assert_array_equal(hl.full(3, -2, dtype=hl.int64).numpy(), [-2, -2, -2])
    assert hl.zeros(0, 5).shape == (0, 5) and hl.zeros(0, 5).numpy().shape == (0, 5)
    with pytest.raises(hl.ShapeError, match="negative dimension"):
        hl.zeros(2, -1)


def test_arange():
    a = hl.arange(10)
    assert a.dtype is hl.int64
    np.testing.assert_array_equal(a.numpy(), np.arange(10))
    np.testing.assert_array_equal(hl.arange(3, 20, 4).numpy(), np.arange(3, 20, 4))
    f = hl.arange(0.0, 1.0, 0.1)
    assert f.dtype is hl.float32 and f.shape == (10,)
    np.testing.assert_allclose(f.numpy(), np.arange(0.0, 1.0, 0.1), atol=1e-6)
    np.testing.assert_array_equal(hl.arange(5, 0, -2).numpy(), [5, 3, 1])
    assert hl.arange(4, 4).shape == (0,)
    with pytest.raises(ValueError, match="step"):
        hl.arange(0, 5, 0)


def test_random_is_deterministic_per_seed():
    a = hl.randn(64, 33, seed=123).numpy()
    b = hl.randn(64, 33, seed=123).numpy()
    c = hl.randn(64, 33, seed=124).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    u = hl.rand(10_000, seed=5).numpy()
    np.testing.assert_array_equal(u, hl.rand(10_000, seed=5).numpy())
    assert u.min() >= 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.02
    n = hl.normal(3.0, 0.5, (20_000,), seed=1).numpy()
    assert abs(n.mean() - 3.0) < 0.02 and abs(n.std() - 0.5) < 0.02
    v = hl.uniform(-2.0, -1.0, (5_000,), seed=1).numpy()
    assert v.min() >= -2.0 and v.max() < -1.0
    with pytest.raises(hl.ShapeError):
        hl.randn(3, dtype=hl.int32)


def test_manual_seed_stream():
    state = hl.get_rng_state()
    try:
        hl.manual_seed(2024)
        first = hl.randn(100).numpy()
        second = hl.randn(100).numpy()
        assert not np.array_equal(first, second), "each draw takes the next counter offset"
        mid = hl.get_rng_state()
        third = hl.rand(50).numpy()
        hl.manual_seed(2024)
        np.testing.assert_array_equal(hl.randn(100).numpy(), first)
        np.testing.assert_array_equal(hl.randn(100).numpy(), second)
        hl.set_rng_state(mid)
        np.testing.assert_array_equal(hl.rand(50).numpy(), third)
        hl.manual_seed(2025)
        assert not np.array_equal(hl.randn(100).numpy(), first)
    finally:
        hl.set_rng_state(state)


# -- dtypes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,np_dtype", [("float32", np.float32), ("float16", np.float16), ("int32", np.int32),
                                           ("int64", np.int64), ("bool", np.bool_)])
def test_dtype_round_trip(name, np_dtype):
    rng = np.random.default_rng(3)
    if np_dtype is np.bool_:
        a = rng.integers(0, 2, size=(5, 7)).astype(bool)
    elif np.issubdtype(np_dtype, np.integer):
        info = np.iinfo(np_dtype)
        a = rng.integers(info.min, info.max, size=(5, 7), dtype=np_dtype)
        a[0, 0], a[0, 1] = info.min, info.max
    else:
        a = rng.standard_normal((5, 7)).astype(np_dtype)
    t = hl.tensor(a)
    assert t.dtype.name == name
    out = t.numpy()
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out, a)
    # through a device op too (a copy kernel, not the upload's host copy)
    np.testing.assert_array_equal(t.T.contiguous().numpy(), a.T)


def test_bfloat16_round_trip():
    a = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, -0.0], np.float32)
    t = hl.tensor(a, dtype=hl.bfloat16)
    assert t.dtype is hl.bfloat16 and t.element_size() == 2
    out = t.numpy()
    assert out.dtype == np.float32  # bfloat16 comes back as float32
    # values exact in bfloat16 come back exactly; the others within bfloat16's 8 bits
    np.testing.assert_array_equal(out[[0, 1, 2, 5]], a[[0, 1, 2, 5]])
    np.testing.assert_allclose(out, a, rtol=2 ** -8)
    np.testing.assert_allclose(t.float().numpy(), out)
    np.testing.assert_allclose((t * 2).numpy(), out * 2, rtol=2 ** -8)


def test_casts():
    x = hl.tensor(np.array([-1.7, 0.2, 2.9], np.float32))
    np.testing.assert_array_equal(x.long().numpy(), [-1, 0, 2])  # truncation toward zero
    np.testing.assert_array_equal(x.int().numpy(), np.array([-1, 0, 2], np.int32))
    np.testing.assert_array_equal(x.bool().numpy(), [True, True, True])
    np.testing.assert_allclose(x.half().numpy(), np.array([-1.7, 0.2, 2.9], np.float16))
    assert x.to(hl.float32) is x


# -- views share storage -----------------------------------------------------------------------
def test_views_share_storage():
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    x = hl.tensor(a)
    cases = {
        "reshape": (x.reshape(6, 4), a.reshape(6, 4)),
        "reshape-1": (x.reshape(-1), a.reshape(-1)),
        "transpose": (x.transpose(0, 2), a.transpose(2, 1, 0)),
        "permute": (x.permute(1, 2, 0), a.transpose(1, 2, 0)),
        "T": (x.T, a.T),
        "slice-steps": (x[:, ::2, 1::2], a[:, ::2, 1::2]),
        "int-index": (x[1, :, 3], a[1, :, 3]),
        "none-ellipsis": (x[None, ..., 1], a[None, ..., 1]),
        "unsqueeze": (x.unsqueeze(1), a[:, None]),
        "squeeze": (x[:1].squeeze(0), a[0]),
        "expand": (x[:, :1, :].expand(2, 5, 4), np.broadcast_to(a[:, :1, :], (2, 5, 4))),
        "narrow": (x.narrow(2, 1, 2), a[:, :, 1:3]),
        "flatten": (x.flatten(1), a.reshape(2, 12)),
    }
    for name, (v, ref) in cases.items():
        assert v._st is x._st, f"{name} copied"
        assert v.shape == ref.shape, name
        np.testing.assert_array_equal(v.numpy(), ref, err_msg=name)
    # a view of a view keeps sharing, and reads the right elements
    w = x.transpose(0, 1)[::2].permute(2, 0, 1)[1:]
    assert w._st is x._st
    np.testing.assert_array_equal(w.numpy(), a.transpose(1, 0, 2)[::2].transpose(2, 0, 1)[1:])


def test_contiguous_copies_only_when_needed():
    x = hl.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert x.contiguous() is x
    assert x.reshape(4, 3).contiguous()._st is x._st
    t = x.T
    assert not t.is_contiguous()
    c = t.contiguous()
    assert c._st is not x._st and c.is_contiguous()
    np.testing.assert_array_equal(c.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4).T)
    # a row slice is contiguous: contiguous() returns it as is
    row = x[1:2]
    assert row.is_contiguous() and row.contiguous() is row
    # a column is strided: contiguous() copies it
    col = x[:, 1:2]
    assert not col.is_contiguous() and col.contiguous()._st is not x._st
    # reshape of a transposed tensor cannot be a view: it copies; view() refuses instead
    r = t.reshape(12)
    assert r._st is not x._st
    np.testing.assert_array_equal(r.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4).T.reshape(12))
    with pytest.raises(hl.ShapeError, match="view"):
        t.view(12)


def test_writes_through_a_view_reach_the_base():
    x = hl.zeros(4, 5)
    x[1:3, ::2] = 7.0
    x[0].fill_(1.0)
    col = x[:, 4]
    col.fill_(-1.0)
    ref = np.zeros((4, 5), np.float32)
    ref[1:3, ::2] = 7.0
    ref[0] = 1.0
    ref[:, 4] = -1.0
    np.testing.assert_array_equal(x.numpy(), ref)


# -- item ------------------------------------------------------------------------------------------
def test_item():
    assert hl.tensor(np.float32(2.5)).item() == 2.5
    v = hl.ones(1, 1).sum().item()
    assert isinstance(v, float) and v == 1.0
    i = hl.arange(5).sum().item()
    assert isinstance(i, int) and i == 10
    b = (hl.ones(1) > 0).item()
    assert b is True
    assert hl.tensor([[3]]).item() == 3
    assert float(hl.full((), 1.5)) == 1.5 and int(hl.full((1,), 4)) == 4
    with pytest.raises(ValueError, match=r"one-element.*\(2,\)"):
        hl.ones(2).item()


# -- in-place ops and autograd --------------------------------------------------------------------
def test_inplace_ops_values():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = hl.tensor(a)
    x.add_(1.0).mul_(2.0).sub_(hl.ones(3)).div_(4.0)
    ref = ((a + 1) * 2 - 1) / 4
    np.testing.assert_allclose(x.numpy(), ref, rtol=1e-6)
    x.clamp_(0.5, 2.0)
    np.testing.assert_allclose(x.numpy(), np.clip(ref, 0.5, 2.0), rtol=1e-6)
    x.copy_(np.full((2, 3), 9.0, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.full((2, 3), 9.0))
    x.zero_()
    np.testing.assert_array_equal(x.numpy(), np.zeros((2, 3)))
    with pytest.raises(hl.ShapeError):
        x.add_(hl.ones(2, 2, 3))  # the result would not fit the target


def test_inplace_on_leaf_requiring_grad_raises():
    w = hl.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad cannot be changed in place"):
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="no_grad"):
        w.fill_(0.0)
    with pytest.raises(RuntimeError):
        w[0] = 5.0
    h = w * 2  # a non-leaf: recorded (tests/test_inplace_autograd.py)
    h.mul_(2.0)
    h.sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 4.0, np.float32))
    with hl.no_grad():  # the optimizer-update pattern is allowed
        w.sub_(hl.full((3,), 0.5))
    np.testing.assert_array_equal(w.numpy(), np.full(3, 0.5, np.float32))
    assert w.requires_grad and w.is_leaf


def test_saved_tensor_modified_in_place_raises():
    w = hl.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
    c = hl.tensor(np.array([4.0, 5.0, 6.0], np.float32))
    loss = (w * c).sum()  # mul saves c for the gradient of w
    c.add_(1.0)           # c does not require grad, so the in-place op itself is allowed
    with pytest.raises(RuntimeError, match="modified by an in-place op"):
        loss.backward()
    # the same graph without the modification works
    c2 = hl.tensor(np.array([4.0, 5.0, 6.0], np.float32))
    (w * c2).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [4.0, 5.0, 6.0])


def test_no_grad():
    w = hl.ones(3, requires_grad=True)
    assert hl.is_grad_enabled()
    with hl.no_grad():
        assert not hl.is_grad_enabled()
        y = w * 2
        with hl.enable_grad():
            z = w * 3
    assert hl.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad and z.grad_fn is not None

    @hl.no_grad()
    def f(t):
        return t + 1

    assert not f(w).requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_detach():
    w = hl.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    h = w * 3
    d = h.detach()
    assert d._st is h._st and not d.requires_grad and d.grad_fn is None
    loss = (h * d).sum()  # d is a constant: dloss/dw = 3 * d = 9 w
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), [9.0, 18.0])


def test_retain_graph():
    w = hl.tensor(np.array([1.0, -2.0, 3.0], np.float32), requires_grad=True)
    loss = (w * w).sum()
    loss.backward(retain_graph=True)
    np.testing.assert_allclose(w.grad.numpy(), [2.0, -4.0, 6.0])
    loss.backward()  # second pass through the retained graph accumulates
    np.testing.assert_allclose(w.grad.numpy(), [4.0, -8.0, 12.0])
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()  # the second call freed the saved tensors


def test_grad_accumulates_over_two_backward_calls():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    w = hl.tensor(a, requires_grad=True)
    (w * 2.0).sum().backward()
    first = w.grad
    (w * w).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 2.0 + 2 * a)
    np.testing.assert_allclose(first.numpy(), np.full((2, 2), 2.0), err_msg="accumulation must not modify the old grad")
    # a gradient given explicitly for a non-scalar output
    w.grad = None
    y = w * 3.0
    y.backward(hl.tensor(np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)))
    np.testing.assert_allclose(w.grad.numpy(), [[3.0, 0.0], [0.0, 6.0]])
    with pytest.raises(RuntimeError, match="scalar outputs"):
        (w * 3.0).backward()


def test_retain_grad_of_intermediate():
    w = hl.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    h = w * 2
    h.retain_grad()
    (h * h).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [8.0, 16.0])


# -- the README's snippet --------------------------------------------------------------------------
def _gelu_np(x: np.ndarray) -> np.ndarray:
    erf = np.frompyfunc(math.erf, 1, 1)
    x64 = x.astype(np.float64)
    return 0.5 * x64 * (1.0 + erf(x64 / math.sqrt(2.0)).astype(np.float64))


def test_readme_snippet():
    a = hl.randn(512, 256, seed=0)
    b = hl.tensor(np.ones((256, 128), np.float32))
    c = (a @ b).gelu().softmax(dim=-1)
    out = c.numpy()
    an = a.numpy().astype(np.float64)
    h = _gelu_np(an @ np.ones((256, 128)))
    e = np.exp(h - h.max(axis=-1, keepdims=True))
    ref = e / e.sum(axis=-1, keepdims=True)
    assert out.shape == (512, 128) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(out.sum(axis=-1), 1.0, rtol=1e-5)
