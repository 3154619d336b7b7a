"""lavapipe (Mesa's llvmpipe) ends every loop of a kernel invocation once the invocation has run
65,535 loop iterations in all, and the kernel goes on with what it has (helios._kernels.core.loop_run).
The launchers keep each invocation under that: column reductions in runs, the CPU matmul kernel's
K in runs, a row kernel's workgroup grown for long rows (or a ShapeError past what it can take),
cumsum's long columns a workgroup each.  Each test on real shapes here gave wrong numbers before,
with no error.

The shapes that pass the real limit run where the device has it (lavapipe, as in CI); the split
product's every form (dtypes, float32 slots, fused epilogues) runs with the limit lowered, against
the one-pass kernel."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import helios as hl
import helios.nn.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios._kernels import core, gemm
from helios.errors import ShapeError
from helios.runtime import get_runtime

sys.path.insert(0, os.path.dirname(__file__))
from switches import count_dispatches, switched  # noqa: E402

pytestmark = pytest.mark.vulkan

R = np.random.default_rng(11)


@pytest.fixture(scope="module")
def limited():
    """The runtime, where its driver has the loop limit (else the test skips)."""
    rt = get_runtime()
    if core.loop_run(rt) is None:
        pytest.skip(f"{rt.info['name']} ends no loop early")
    return rt


def _rel(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def test_column_reductions_over_more_rows_than_the_limit(limited):
    x = R.standard_normal((70000, 8)).astype(np.float32)  # one invocation a column walked 70,000 rows
    t = hl.tensor(x)
    assert _rel(t.sum(0).numpy(), x.astype(np.float64).sum(0)) < 1e-5  # was 16 % off
    assert np.array_equal(t.amax(0).numpy(), x.max(0))
    assert np.array_equal(t.argmax(0).numpy(), x.argmax(0))
    c = R.standard_normal((70000, 64)).astype(np.float32)  # cumsum: an invocation a column
    assert _rel(hl.tensor(c).cumsum(0).numpy(), np.cumsum(c.astype(np.float64), 0)) < 1e-5  # was all wrong


def test_a_product_whose_k_passes_the_limit(limited):
    a = R.standard_normal((8, 600000)).astype(np.float32)  # 75,000 steps of 8 in one loop
    b = R.standard_normal((600000, 8)).astype(np.float32)
    with count_dispatches() as names:
        got = (hl.tensor(a) @ hl.tensor(b)).numpy()
    assert names["matmul"] == 2
    assert _rel(got, a.astype(np.float64) @ b) < 1e-4  # was 31 % off


def test_a_long_row_takes_a_bigger_workgroup_and_a_longer_one_is_refused(limited):
    x = R.standard_normal((1, 1 << 23)).astype(np.float32)  # 3 passes of 32,768 steps at 256 invocations
    e = np.exp(x.astype(np.float64) - x.max())
    assert _rel(F.softmax(hl.tensor(x), -1).numpy(), e / e.sum()) < 1e-5  # was off by 12x
    with switched(core, "LOOP_RUN", 3000):  # rows past what 1024 invocations take: 4 and 2 walks of a share
        with pytest.raises(ShapeError, match=r"softmax: a row of 600000 elements is longer than the 505856 one workgroup"):
            F.softmax(hl.tensor(np.zeros((2, 600000), np.float32)), -1)
        with pytest.raises(ShapeError, match=r"cumsum: a row of 1100000 elements is longer than the 1011712 "):
            hl.tensor(np.zeros(1100000, np.float32)).cumsum(0)


# -- the split product, every form, with the limit lowered: K in runs of 8 * 4 ------------------


def _t(shape, dtype=dt.float32):
    x = hl.tensor(R.standard_normal(shape).astype(np.float32))
    return x if dtype is dt.float32 else K.copy(x, dtype)


def _split(fn):
    """fn() with the loop limit at 4 steps (K = 100 in 4 runs) and as one pass, and the split's dispatch names."""
    one = fn()
    with switched(core, "LOOP_RUN", 4), count_dispatches() as names:
        split = fn()
    return split, one, names


def _close(got, want, tol):
    g, w = (np.asarray(t.float().numpy(), np.float64) for t in (got, want))
    assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max())


@pytest.mark.parametrize("dtype, tol", [(dt.float32, 1e-5), (dt.bfloat16, 1e-2), (dt.float16, 2e-3)])
def test_the_split_product_is_the_product(limited, dtype, tol):
    if not get_runtime().features.get("storage16") and dtype is not dt.float32:
        pytest.skip("no 16-bit storage")
    a, b, bias = _t((3, 9, 100), dtype), _t((100, 24), dtype), _t((24,), dtype)
    split, one, names = _split(lambda: gemm.matmul(a, b, bias))
    assert names["matmul"] == 4 and split.dtype is dtype and split.shape == (3, 9, 24)
    _close(split, one, tol)
    bt = _t((24, 100), dtype).mT  # a transposed view
    split, one, _ = _split(lambda: gemm.matmul(a, bt))
    _close(split, one, tol)


def test_float32_slots_and_fused_epilogues_in_runs(limited):
    if not get_runtime().features.get("storage16"):
        pytest.skip("no 16-bit storage")
    x, w, bias = _t((2, 5, 100)), _t((100, 16)), _t((16,))
    # float32 operands and out of a bfloat16 product: rounded to it, the result widened
    split, one, _ = _split(lambda: gemm.matmul(x, w, bias, K.empty((2, 5, 16), dt.float32), compute=dt.bfloat16))
    assert split.dtype is dt.float32
    _close(split, one, 1e-2)
    res, e = _t((2, 5, 16)), _t((2, 5, 16))
    split, one, names = _split(lambda: K.matmul_epilogue("linear+residual", x, w, bias, res)[0])
    assert names["matmul"] == 4 and "linear+residual" not in names
    _close(split, one, 1e-5)
    split, one, _ = _split(lambda: K.matmul_epilogue("linear+gelu", x, w, bias, None))
    _close(split[0], one[0], 1e-5)  # gelu(u)
    _close(split[1], one[1], 1e-5)  # u, stored for the backward
    split, one, _ = _split(lambda: K.matmul_epilogue("matmul+gelu_tanh_bwd", x, w, None, e)[0])
    _close(split, one, 1e-5)


def test_the_bias_gradient_goes_apart_when_k_is_split(limited):
    a, g = _t((16, 100)), _t((100, 8))
    out, bsum = K.empty((16, 8), dt.float32), K.empty((8,), dt.float32)
    with switched(core, "LOOP_RUN", 4):
        assert not gemm.matmul_bias_grad(a, g, out, bsum)  # the caller runs the product and the reduction
    assert gemm.matmul_bias_grad(a, g, out, bsum)
