"""A Linear layer's bias gradient computed in its weight gradient's matmul (helios.fused_kernels
"matmul+bias_grad"): bit for bit the separate column reduction, one dispatch fewer, and the
two unfused dispatches wherever the kernel cannot take the operands.  Both kernels that sum
through the bias binding are tested: the CPU-driver kernel where the device runs it, and the
GPU shared-memory kernel, forced on (it runs on lavapipe too)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import helios as hl
import helios.functional as F
from helios import _kernels as K
from helios import fused_kernels
from helios.nn import Parameter
from helios.optim import AdamW
from helios.runtime import get_runtime
from helios.tensor import Tensor

sys.path.insert(0, os.path.dirname(__file__))
from switches import count_dispatches, switched, use_matmul_kernel  # noqa: E402

pytestmark = pytest.mark.vulkan


@pytest.fixture(params=["cpu", "gpu"])
def kernel(request, monkeypatch):
    """The matmul kernel under test (switches.use_matmul_kernel)."""
    use_matmul_kernel(request.param, monkeypatch, request, "float32")
    return request.param


def _bits_equal(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))


def _grads(x, w, b, fusion_on: bool, kernel_refuses: bool = False, slots: bool = True):
    """(weight grad, bias grad, dispatch names) of one backward of (linear(x, w, b) ** 2).sum();
    ``slots``: the gradients have free slots in the optimizer's flat buffer."""
    opt = AdamW([w, b], lr=0.0) if slots else None  # packs the gradients into flat slots
    refuse = (lambda *a: False) if kernel_refuses else K.matmul_bias_grad
    with switched(fused_kernels, "ENABLED", fusion_on), switched(K, "matmul_bias_grad", refuse):
        y = (F.linear(x, w, b) ** 2).sum()
        with count_dispatches() as names:
            y.backward()
    gw, gb = w.grad.numpy().copy(), b.grad.numpy().copy()
    if opt is not None:
        opt.zero_grad()
    else:
        w.grad = b.grad = None
    return gw, gb, names


# (rows, out, in): a K tail (rows % 8) or none, N = out with clamped columns (20, 18: lanes
# past N; 18: no vec4 loads of B either), a square weight, and a 32-row tile with two column
# blocks (out 72 > 64 columns a workgroup).
@pytest.mark.parametrize("rows,out,inp", [(60, 20, 12), (64, 24, 24), (37, 18, 12), (50, 72, 64)])
def test_bias_grad_in_the_weight_grad_matmul_is_bit_identical(kernel, rows, out, inp):
    rng = np.random.default_rng(rows)
    w = Parameter(hl.tensor(rng.standard_normal((out, inp)).astype(np.float32)))
    b = Parameter(hl.tensor(rng.standard_normal((out,)).astype(np.float32)))
    x = hl.tensor(rng.standard_normal((rows // 2, 2, inp)).astype(np.float32) if rows % 2 == 0 else
                  rng.standard_normal((rows, inp)).astype(np.float32))
    ref = _grads(x, w, b, fusion_on=False)
    on = _grads(x, w, b, fusion_on=True)
    refused = _grads(x, w, b, fusion_on=True, kernel_refuses=True)
    for got in (on, refused):
        assert _bits_equal(got[0], ref[0]) and _bits_equal(got[1], ref[1])
    y = x.numpy().reshape(rows, inp) @ w.numpy().T + b.numpy()
    np.testing.assert_allclose(on[1], (2 * y).sum(0), rtol=1e-4, atol=1e-3)
    assert ref[2]["matmul+bias_grad"] == 0 and refused[2]["matmul+bias_grad"] == 0
    # one dispatch for the weight and bias gradients instead of a matmul and a sum
    assert on[2]["matmul+bias_grad"] == 1
    assert refused[2]["matmul"] - on[2]["matmul"] == 1 and refused[2]["sum"] - on[2]["sum"] == 1
    assert sum(refused[2].values()) - sum(on[2].values()) == 1


def test_without_free_slots_the_bias_grad_is_a_reduction():
    rng = np.random.default_rng(0)
    w = Parameter(hl.tensor(rng.standard_normal((16, 8)).astype(np.float32)))
    b = Parameter(hl.tensor(rng.standard_normal((16,)).astype(np.float32)))
    x = hl.tensor(rng.standard_normal((20, 8)).astype(np.float32))
    on = _grads(x, w, b, fusion_on=True, slots=False)
    off = _grads(x, w, b, fusion_on=False, slots=False)
    assert on[2]["matmul+bias_grad"] == 0
    assert _bits_equal(on[0], off[0]) and _bits_equal(on[1], off[1])


def test_matmul_bias_grad_takes_only_what_it_can_store(kernel):
    rt = get_runtime()
    rng = np.random.default_rng(1)
    M, Kd, N = 12, 21, 20
    a = hl.tensor(rng.standard_normal((Kd, M)).astype(np.float32)).transpose(0, 1)  # x^T: M-contiguous
    b = hl.tensor(rng.standard_normal((Kd, N)).astype(np.float32))
    flat = hl.tensor(np.full(3 + N + M * N + 5, 7.0, np.float32))
    bsum = Tensor(flat._st, (N,), (1,), 3, flat.dtype)  # before the product's slot
    out = Tensor(flat._st, (M, N), (N, 1), 3 + N, flat.dtype)  # contiguous: no transposed store
    with count_dispatches() as names:
        assert K.matmul_bias_grad(a, b, out, bsum)
    assert dict(names) == {"matmul+bias_grad": 1}
    ref_c = K.matmul(a, b)
    ref_s, _ = K.reduce("sum", b, (0,), 1.0)
    got = flat.numpy()
    assert _bits_equal(got[3 + N:3 + N + M * N].reshape(M, N), ref_c.numpy())
    assert _bits_equal(got[3:3 + N], ref_s.numpy())
    assert np.all(got[:3] == 7.0) and np.all(got[3 + N + M * N:] == 7.0)  # nothing else written
    # a bsum in another tensor (a bias in its own flat buffer, as AdamW's no-decay group keeps
    # it): both kernels store the sums through the bias binding
    other = hl.zeros((N,))
    assert K.matmul_bias_grad(a, b, out, other)
    assert _bits_equal(other.numpy(), ref_s.numpy()) and _bits_equal(got[3 + N:3 + N + M * N].reshape(M, N), ref_c.numpy())
    # refused, with nothing dispatched: a bsum overlapping the product, of another dtype or
    # length, a B not contiguous along N, a batched or a one-column product
    overlapping = Tensor(flat._st, (N,), (1,), 3 + N + 5, flat.dtype)
    bt = hl.tensor(rng.standard_normal((N, Kd)).astype(np.float32)).transpose(0, 1)
    with count_dispatches() as names:
        assert not K.matmul_bias_grad(a, b, out, overlapping)
        assert not K.matmul_bias_grad(a, b, out, Tensor(flat._st, (N - 1,), (1,), 0, flat.dtype))
        assert not K.matmul_bias_grad(a, b, out, hl.zeros((N,), dtype="float16").to(rt.name)
                                      if rt.features.get("storage16") else other)
        assert not K.matmul_bias_grad(a, bt, out, bsum)
        assert not K.matmul_bias_grad(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), bsum)
        assert not K.matmul_bias_grad(a, b[:, :1], Tensor(flat._st, (M, 1), (1, 1), 3 + N, flat.dtype),
                                      Tensor(flat._st, (1,), (1,), 0, flat.dtype))
    assert sum(names.values()) == 0


def test_the_fused_dispatch_names_its_parts_at_debug():
    class Rt:
        debug = 1

    assert fused_kernels.dispatch_name("matmul+bias_grad", Rt()) == "matmul+bias_grad[matmul > sum]"
