"""The fast paths of kernels on CPU drivers (4 elements an invocation, rows read through texel
views) give, bit for bit, what their reference paths give."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios.optim import adamw_constants, adamw_dispatch

pytestmark = pytest.mark.vulkan


def _adamw(vec_ok: bool, n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)] + [rng.random(n).astype(np.float32)]
    p, g, m, v = (hl.tensor(a) for a in arrs)
    rt = p._st.rt
    consts = adamw_constants({"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}, 3)
    bufs = [K.bind(p, True)[0], K.bind(g)[0], K.bind(m, True)[0], K.bind(v, True)[0]]
    if vec_ok:
        adamw_dispatch(rt, bufs, n, 0, consts)
    else:  # the same elements as two ranges of odd length: the one-element path
        adamw_dispatch(rt, bufs, n - 1, 0, consts)
        adamw_dispatch(rt, bufs, 1, n - 1, consts)
    return [t.numpy() for t in (p, m, v)]


def test_adamw_vec4_equals_the_scalar_path_bit_for_bit():
    for a, b in zip(_adamw(True, 1028), _adamw(False, 1028)):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("n", [1024, 1023])  # the vec4 path and the one-element path
def test_in_place_scale_by_a_device_scalar(n):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n).astype(np.float32)
    c = np.float32(0.37)
    t = hl.tensor(x)
    K.binary_("mul", t, hl.tensor(np.array([c], np.float32)))
    np.testing.assert_array_equal(t.numpy(), x * c)  # one rounding per element, as numpy's
    # an offset view of a larger buffer: only its elements change
    big = hl.tensor(np.arange(n + 8, dtype=np.float32))
    K.binary_("mul", big[4:4 + n], hl.tensor(np.array(2.0, np.float32)))
    want = np.arange(n + 8, dtype=np.float32)
    want[4:4 + n] *= 2
    np.testing.assert_array_equal(big.numpy(), want)


@pytest.mark.parametrize("mode,causal", [(0, True), (1, False), (2, False), (3, False)])
def test_row_kernel_texel_variant_equals_the_storage_buffer_variant(monkeypatch, mode, causal):
    """softmax_rows' f32_tx variant (rows read through texel views, picked on CPU devices) gives
    the f32 variant's values bit for bit, with a causal mask, rows of 37 (not whole texels) and 36."""
    from helios._kernels import rows

    rng = np.random.default_rng(2)
    for n in (37, 36):  # element by element; whole texels (then the causal rows' partial texels one by one)
        x = hl.tensor(rng.standard_normal((3, n, n), dtype=np.float32))
        g = hl.tensor(rng.standard_normal((3, n, n), dtype=np.float32))
        args = (x, g if mode >= 2 else None, 0.5, causal)
        fast = K.softmax_rows(mode, *args).numpy()
        assert rows._row_variant(x._st.rt, x.dtype, True) == ("f32_tx" if x._st.rt.info["type"] == "cpu" else "f32")
        with monkeypatch.context() as mp:
            mp.setattr(rows, "_row_variant", lambda rt, dtype, per_thread, out=None: dtype.tag)
            slow = K.softmax_rows(mode, *args).numpy()
        np.testing.assert_array_equal(fast.view(np.uint32), slow.view(np.uint32))


@pytest.mark.parametrize("name", ["linear+residual", "linear+gelu", "matmul+gelu_tanh_bwd"])
def test_matmul_epilogue_on_vec4s_equals_the_per_element_epilogue(monkeypatch, name):
    """The fp32 CPU matmul's epilogue on vec4s of columns (EVEC) gives the per-element one's
    output and stored pre-activation bit for bit, with rows and columns clamped at the edges."""
    from helios._kernels import gemm

    rng = np.random.default_rng(3)
    for m, k, n in ((70, 24, 40),):  # 70 rows: clamped rows; 40 columns: a lane's block half out
        a, w = (hl.tensor(rng.standard_normal(s, dtype=np.float32)) for s in ((m, k), (k, n)))
        bias = hl.tensor(rng.standard_normal(n, dtype=np.float32)) if name != "matmul+gelu_tanh_bwd" else None
        e = hl.tensor(rng.standard_normal((m, n), dtype=np.float32)) if name != "linear+gelu" else None
        outs = []
        for vec in (True, False):
            monkeypatch.setattr(gemm, "_MM_EPI_VEC", vec)
            y, u = K.matmul_epilogue(name, a, w, bias, e)
            outs.append([t.numpy().view(np.uint32) for t in (y, u) if t is not None])
        for x, y in zip(*outs):
            np.testing.assert_array_equal(x, y)


def test_layer_norm_texel_variant_equals_the_storage_buffer_variant(monkeypatch):
    """LayerNorm forward, backward in one dispatch (with the pending-gradient add), and the
    parameter gradients alone: the f32_tx variant (reads through texel views; rows of a
    multiple of 4 a texel at a time) gives the f32 variant's values bit for bit."""
    from helios._kernels import rows

    rng = np.random.default_rng(5)
    for C in (50, 48):  # element by element; whole texels
        x, g, acc = (hl.tensor(rng.standard_normal((37, C), dtype=np.float32)) for _ in range(3))
        w, b = (hl.tensor(rng.standard_normal(C, dtype=np.float32)) for _ in range(2))

        def run():
            y, mean, rstd = K.layer_norm_fwd(x, w, b, 1e-5)
            outs = [y, *K.layer_norm_bwd(x, w, g, mean, rstd, True, True, acc),
                    *K.layer_norm_bwd_params(x, g, mean, rstd, True, True)]
            return [t.numpy().view(np.uint32) for t in outs]

        fast = run()
        with monkeypatch.context() as mp:
            mp.setattr(rows, "_row_variant", lambda rt, dtype, per_thread, out=None: dtype.tag)
            slow = run()
        for a, b_ in zip(fast, slow):
            np.testing.assert_array_equal(a, b_)
