"""LayerNorm's autocast casts in its kernels (helios.fused_kernels "layer_norm+cast",
"cast+layer_norm_bwd"): a float32 LayerNorm that stores its result in 16 bits, and backward
kernels that read a 16-bit gradient, give the bits of the float32 kernels and the casts."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios import dtypes as dt
from helios import fused_kernels
from helios.errors import DTypeError
from helios.nn import GPT, GPTConfig
from helios.runtime import get_runtime
from switches import count_dispatches, switched, use_matmul_kernel
from test_mixed_matmul import _bits, _need_16bit

LOWS = [dt.bfloat16, dt.float16]


# (rows, C, device type): on a CPU device an invocation a row, whole texels (C % 4 == 0) or
# element by element, with the two backward kernels in one dispatch; a few rows, a workgroup a
# row; on a GPU a workgroup a row with the parameter gradients' columns in runs (partials added
# by a second dispatch), and very many short rows an invocation a row again
CASES = [(37, 48, "cpu"), (37, 50, "cpu"), (5, 48, "cpu"), (300, 48, "discrete"), (4096, 20, "discrete")]


def _kernels(x, w, b, g, acc, low, rms: bool, cast: bool):
    """Every LayerNorm kernel on x: forward (y stored in ``low`` if ``cast``, else float32 then
    cast by a kernel), and each backward form reading g in ``low`` (``cast``) or widened to
    float32 by a kernel; the results."""
    if cast:
        y, mean, rstd = K.layer_norm_fwd(x, w, b, 1e-5, rms, out_dtype=low)
    else:
        y, mean, rstd = K.layer_norm_fwd(x, w, b, 1e-5, rms)
        y = K.copy(y, low)
    g = g if cast else K.copy(g, dt.float32)
    outs = [y, mean, rstd, K.layer_norm_bwd_input(x, w, g, mean, rstd, None, rms),
            K.layer_norm_bwd_input(x, w, g, mean, rstd, acc, rms),
            *K.layer_norm_bwd_params(x, g, mean, rstd, True, True),
            *K.layer_norm_bwd(x, w, g, mean, rstd, True, b is not None, acc, None, None, rms)]
    return [t for t in outs if t is not None]


@pytest.mark.parametrize("low", LOWS, ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows,C,device", CASES)
def test_layer_norm_kernels_with_16bit_y_and_g_equal_the_casts(monkeypatch, low, rows, C, device):
    _need_16bit()
    rt = get_runtime()
    if rt.info["type"] != "cpu" and device == "cpu":
        pytest.skip("the CPU-driver row plans need a CPU device")
    monkeypatch.setitem(rt.info, "type", device)  # the row plans and variants follow it
    rng = np.random.default_rng(rows + C)
    x, acc = (hl.tensor(rng.standard_normal((rows, C), dtype=np.float32) * 3) for _ in range(2))
    w, b = (hl.tensor(rng.standard_normal(C, dtype=np.float32)) for _ in range(2))
    g = K.copy(hl.tensor(rng.standard_normal((rows, C), dtype=np.float32)), low)
    for rms in (False, True):
        bias = None if rms else b
        with count_dispatches() as names:
            fused = _kernels(x, w, bias, g, acc, low, rms, True)
        apart = _kernels(x, w, bias, g, acc, low, rms, False)
        for u, v in zip(fused, apart):
            np.testing.assert_array_equal(_bits(u), _bits(v))
        norm = "rms_norm" if rms else "layer_norm"
        assert names[f"{norm}+cast"] == 1 and names["copy"] == 0
        # (but for the partials' sums of a GPU's column runs, which read no gradient)
        assert all(n.startswith("cast+") for n in names if "_bwd" in n and n != "layer_norm_bwd_params")
        assert all(n in fused_kernels.PARTS for n in names if "+" in n)


def test_layer_norm_refuses_a_gradient_of_another_dtype():
    _need_16bit()
    x = hl.ones((4, 8))
    _, mean, rstd = K.layer_norm_fwd(x, None, None, 1e-5)
    with pytest.raises(DTypeError, match="layer_norm_bwd_input: the gradient must be float32 or a 16-bit float, got int32"):
        K.layer_norm_bwd_input(x, None, hl.ones((4, 8), dtype=hl.int32), mean, rstd)
    xb = K.copy(x, dt.bfloat16)
    with pytest.raises(DTypeError, match="layer_norm_fwd: out_dtype must be bfloat16, got float16"):
        K.layer_norm_fwd(xb, None, None, 1e-5, out_dtype=dt.float16)


def _gpt_bf16_step(feeds: bool):
    """One forward and backward of a 2-layer GPT under bf16 autocast, the LayerNorms' outputs
    stored in bf16 (``feeds``) or float32: the loss, every gradient's bits and the dispatches."""
    from helios.nn import modules

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), seed=0)
    rng = np.random.default_rng(0)
    x, y = (hl.tensor(rng.integers(0, 64, (4, 16))) for _ in range(2))
    plain = lambda norm, t, product: norm(t)  # noqa: E731 - the LayerNorms as they were
    with switched(modules, "norm_for_product", modules.norm_for_product if feeds else plain):
        with count_dispatches() as names:
            with hl.autocast("bfloat16"):
                _, loss = model(x, y)
            loss.backward()
    return loss.item(), [_bits(p.grad) for p in model.parameters()], names


def test_a_bf16_gpt_stores_its_layer_norm_outputs_in_bf16_with_the_same_bits(monkeypatch, request):
    # on the cooperative-matrix kernel (a GPU's, or lavapipe's emulation: its row kernels then take
    # a GPU's plans, a workgroup a row); on the device's own kernels test_fused_kernels' bf16 GPT
    # checks it against the unfused ops
    _need_16bit()
    use_matmul_kernel("coop", monkeypatch, request, "bfloat16")
    loss, grads, names = _gpt_bf16_step(True)
    loss0, grads0, names0 = _gpt_bf16_step(False)
    assert loss == loss0
    for u, v in zip(grads, grads0):
        np.testing.assert_array_equal(u, v)
    n_layer = 2
    assert names["layer_norm+cast"] == 2 * n_layer + 1 and names0["layer_norm+cast"] == 0
    # each LayerNorm backward kernel reads the bf16 gradient (one a LayerNorm on a CPU device,
    # the input's and the parameters' apart on a GPU's plans)
    def backward_kernels(ns, prefix):
        return sum(v for n, v in ns.items() if n.startswith(prefix + "layer_norm_bwd"))

    assert backward_kernels(names, "cast+") == backward_kernels(names0, "") >= 2 * n_layer + 1
    assert backward_kernels(names, "") == backward_kernels(names0, "cast+") == 0
    assert sum(names.values()) == sum(names0.values())  # the casts were in the products already
