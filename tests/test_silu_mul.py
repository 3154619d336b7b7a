"""SwiGLU's gating in fewer kernels and less memory (F.silu_mul): the bits of
``F.silu(gate) * up``, forward and backward, with only gate and up kept for backward."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
from helios import dtypes as dt
from helios import fused_kernels
from helios.runtime import get_runtime
from switches import count_dispatches
from test_mixed_matmul import _need_16bit

R = np.random.default_rng(11)


def _bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.float().numpy()).view(np.uint32)


def _in_use() -> int:
    return get_runtime().pool_stats()["activations"]["in_use_bytes"]


def _inputs_of(state, dtype):
    """gate and up as _gate draws them from generator state ``state``, rounded to ``dtype``."""
    rng = np.random.default_rng()
    rng.bit_generator.state = state
    return [hl.tensor(rng.standard_normal((37, 50)).astype(np.float32) * 3).to(dtype).float().numpy() for _ in range(2)]


def _gate(dtype, fused: bool, monkeypatch):
    """(y, gate's and up's gradients, dispatches forward, backward, activation bytes kept by the
    forward) of silu(gate) * up, fusion on (F.silu_mul) or off (the separate ops)."""
    monkeypatch.setattr(fused_kernels, "ENABLED", fused)
    g, u, dy = (hl.tensor(R.standard_normal((37, 50)).astype(np.float32) * 3).to(dtype) for _ in range(3))
    g, u = g.detach().requires_grad_(True), u.detach().requires_grad_(True)
    before = _in_use()
    with count_dispatches() as fwd:
        y = hl.functional.silu_mul(g, u)
        y.numpy()
    kept = _in_use() - before
    with count_dispatches() as bwd:
        y.backward(dy)
        g.grad.numpy(), u.grad.numpy()
    return (y, g.grad, u.grad), dict(fwd), dict(bwd), kept


@pytest.mark.parametrize("dtype", [dt.float32, dt.bfloat16, dt.float16], ids=["fp32", "bf16", "fp16"])
def test_silu_mul_equals_silu_times_up_bit_for_bit(dtype, monkeypatch):
    if dtype.itemsize == 2:
        _need_16bit()
    state = R.bit_generator.state
    got, fwd, bwd, kept = _gate(dtype, True, monkeypatch)
    R.bit_generator.state = state  # the same inputs
    want, fwd0, bwd0, kept0 = _gate(dtype, False, monkeypatch)
    for a, b in zip(got, want):
        assert np.array_equal(_bits(a), _bits(b)), dtype.name
    assert fwd == {"ew_fused": 1} and bwd == {"ew_fused": 2}, (fwd, bwd)
    assert sum(bwd0.values()) >= 4, bwd0
    # sigmoid(gate) and silu(gate) are not kept: two activations of the output's size fewer
    assert kept0 - kept >= 2 * 37 * 50 * dtype.itemsize, (kept0, kept)
    # and the values are SwiGLU's (float64 from the same inputs)
    g64, u64 = (np.asarray(R_inputs, np.float64) for R_inputs in _inputs_of(state, dtype))
    tol = 1e-5 if dtype is dt.float32 else 3e-2
    np.testing.assert_allclose(got[0].float().numpy(), g64 / (1 + np.exp(-g64)) * u64, rtol=tol, atol=tol)


def test_silu_mul_takes_the_separate_ops_for_other_operands(monkeypatch):
    g = hl.tensor(R.standard_normal((6, 8)).astype(np.float32))
    up_t = hl.tensor(R.standard_normal((8, 6)).astype(np.float32)).mT  # not contiguous
    y = hl.functional.silu_mul(g, up_t)
    assert np.array_equal(_bits(y), _bits(hl.functional.silu(g) * up_t))
    gn, un = g.numpy().astype(np.float64), up_t.numpy().astype(np.float64)
    np.testing.assert_allclose(y.numpy(), gn / (1 + np.exp(-gn)) * un, rtol=1e-5, atol=1e-6)
    # another dtype: promoted, as silu(gate) * up is
    _need_16bit()
    up16 = up_t.contiguous().to(dt.bfloat16)
    y = hl.functional.silu_mul(g, up16)
    assert y.dtype is dt.float32 and np.array_equal(_bits(y), _bits(hl.functional.silu(g) * up16))
