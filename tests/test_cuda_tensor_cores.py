"""bf16 / fp16 matmuls of cuda:N tensors on the tensor cores (helios.cuda_ptx.tensor_gemm: the GEMM
ladder's wgmma kernel reading and writing the tensors through TMA).

On the emulated driver (an sm_90 device whose kernels run on the CPU) by default; the ``gpu``
parameter runs the same checks on a real GPU.  The reference is float64 arithmetic on the
16-bit inputs, and the generic (SIMT) kernel the product ran on before, with
HELIOS_TENSOR_CORES=0."""

import os
import sys

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios import functional as F
from helios.cuda_ptx import driver
from helios.runtime import close_device, get_runtime, set_device

sys.path.insert(0, os.path.dirname(__file__))
from switches import autocast_block  # noqa: E402

pytestmark = pytest.mark.vulkan


@pytest.fixture(params=["emulator", pytest.param("0", marks=pytest.mark.gpu)], ids=["emulated", "gpu"])
def cuda(request, monkeypatch):
    """cuda:0 (emulated, or the real GPU) as the current device, with a counter of the products
    its tensor cores took (``calls``); the device that was current before is current again after."""
    monkeypatch.setenv("HELIOS_CUDA_DEVICE", request.param)
    before = get_runtime().name
    close_device("cuda:0")
    driver.context.cache_clear()
    set_device("cuda:0")
    rt = get_runtime()
    calls = []
    real = type(rt).gemm

    def counted(self, *args):
        took = real(self, *args)
        calls.append(took)
        return took

    monkeypatch.setattr(type(rt), "gemm", counted)  # on the class: a graph capture interposes on the instance
    yield calls
    set_device(before)
    close_device("cuda:0")
    driver.context.cache_clear()


def _t(x, dtype=hl.bfloat16):
    return hl.tensor(np.asarray(x, np.float32)).to(dtype)


def _exact(t) -> np.ndarray:
    """The tensor's values as float64 (16-bit values are exact in float32)."""
    return t.float().numpy().astype(np.float64)


def _close(got, want, dtype=hl.bfloat16):
    # fp32 accumulation, then one rounding to the 16-bit type: half an ulp of the largest value
    ulp = 2.0 ** -8 if dtype is hl.bfloat16 else 2.0 ** -11
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * ulp * np.abs(want).max())


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_products_of_any_layout_and_odd_extents(cuda, layout):
    rng = np.random.default_rng(0)
    M, K, N = 37, 136, 72  # M is no multiple of any tile: TMA's zero fill and clipped stores
    a = _t(rng.standard_normal((K, M) if layout[0] == "t" else (M, K)))
    b = _t(rng.standard_normal((N, K) if layout[1] == "t" else (K, N)))
    a = a.t() if layout[0] == "t" else a
    b = b.t() if layout[1] == "t" else b
    c = a @ b
    assert c.shape == (M, N) and c.dtype is hl.bfloat16
    _close(_exact(c), _exact(a) @ _exact(b))
    assert cuda == [True]


def test_linear_with_bias_on_3d_input_and_fp16(cuda):
    rng = np.random.default_rng(1)
    x = _t(rng.standard_normal((2, 24, 64)))
    w = _t(rng.standard_normal((64, 48)))
    bias = _t(rng.standard_normal(48))
    wt = w.t()
    rt = get_runtime()
    d0 = rt.stats()["dispatches"]
    y = hl.nn.functional.linear(x, wt, bias)
    assert rt.stats()["dispatches"] - d0 == 1  # the bias is added in the product's epilogue
    want = _exact(x) @ _exact(w) + _exact(bias)
    _close(_exact(y), want)
    x16, w16 = _t(rng.standard_normal((40, 32)), hl.float16), _t(rng.standard_normal((32, 16)), hl.float16)
    # a bf16 model's fused linear+gelu runs as the engine's product and a GELU on this device
    g = hl.nn.functional.linear_gelu(x, wt, bias)
    want_g = _exact(hl.nn.functional.gelu(y, approximate="tanh"))
    np.testing.assert_array_equal(_exact(g), want_g)
    b16 = _t(rng.standard_normal(16), hl.float16)
    y16 = hl.nn.functional.linear(x16, w16.t(), b16)  # fp16: a float32 C, bias included, rounded once
    assert y16.dtype is hl.float16
    _close(_exact(y16), _exact(x16) @ _exact(w16) + _exact(b16), hl.float16)
    assert cuda == [True, True, True]


def test_views_of_wider_matrices_and_a_transposed_out(cuda):
    rng = np.random.default_rng(2)
    wide = _t(rng.standard_normal((48, 200)))
    a = wide[:, 64:128]  # rows 200 elements apart, starting 128 bytes in
    b = _t(rng.standard_normal((64, 40)))
    _close(_exact(a @ b), _exact(a) @ _exact(b))
    out = hl.empty((40, 48), dtype=hl.bfloat16).t()  # a transposed destination: stored as b^T a^T
    K.matmul(a, b, out=out)  # the kernel layer's out= (a gradient's slot in a flat buffer is such a view)
    _close(_exact(out), _exact(a) @ _exact(b))
    assert cuda == [True, True]


def test_what_the_engine_cannot_take_runs_the_generic_kernel(cuda):
    rng = np.random.default_rng(3)
    f = hl.tensor(rng.standard_normal((16, 16)).astype(np.float32))
    np.testing.assert_allclose((f @ f).numpy(), f.numpy() @ f.numpy(), rtol=1e-5, atol=1e-5)  # fp32: never
    # an odd number of columns with a bias: the epilogue loads the bias in pairs
    x, w, bias = _t(rng.standard_normal((8, 16))), _t(rng.standard_normal((16, 15))), _t(rng.standard_normal(15))
    _close(_exact(hl.nn.functional.linear(x, w.t(), bias)), _exact(x) @ _exact(w) + _exact(bias))
    assert cuda == []


def test_rows_off_the_16_byte_grid_are_copied_into_padded_rows(cuda):
    rng = np.random.default_rng(3)
    a, b = _t(rng.standard_normal((16, 12))), _t(rng.standard_normal((12, 16)))  # A's rows are 24 bytes
    rt = get_runtime()
    d0 = rt.stats()["dispatches"]
    c = a @ b
    assert rt.stats()["dispatches"] - d0 == 2  # A copied into 32-byte rows, then the product
    _close(_exact(c), _exact(a) @ _exact(b))
    assert cuda == [True]


@pytest.mark.parametrize("dtype", [hl.bfloat16, hl.float16], ids=["bf16", "fp16"])
def test_a_batch_of_products_is_one_tensor_core_launch(cuda, dtype):
    rng = np.random.default_rng(6)
    a = _t(rng.standard_normal((3, 70, 50)), dtype)  # rows of 100 bytes: copied into padded rows first
    b = _t(rng.standard_normal((3, 50, 40)), dtype)
    c = hl.bmm(a, b)
    assert c.shape == (3, 70, 40) and c.dtype is dtype
    _close(_exact(c), _exact(a) @ _exact(b), dtype)
    assert cuda == [True]  # every product of the batch in one call of the engine


@pytest.mark.parametrize("layout", ["tn", "nt", "tt"])
def test_batched_transposed_operands_are_read_in_place(cuda, layout):
    rng = np.random.default_rng(7)
    B, M, K, N = 3, 72, 56, 40
    a = _t(rng.standard_normal((B, K, M) if layout[0] == "t" else (B, M, K)))
    b = _t(rng.standard_normal((B, N, K) if layout[1] == "t" else (B, K, N)))
    a = a.mT if layout[0] == "t" else a
    b = b.mT if layout[1] == "t" else b
    rt = get_runtime()
    d0 = rt.stats()["dispatches"]
    c = a @ b
    assert rt.stats()["dispatches"] - d0 == 1  # no copy: the kernel reads the transposes itself
    _close(_exact(c), _exact(a) @ _exact(b))
    assert cuda == [True]


def test_a_broadcast_operand_is_read_once_for_every_product(cuda):
    rng = np.random.default_rng(8)
    a2 = _t(rng.standard_normal((70, 56)))
    b3 = _t(rng.standard_normal((3, 56, 40)))
    _close(_exact(a2 @ b3), _exact(a2) @ _exact(b3))  # A broadcast over the batch (its stride is 0)
    a3 = _t(rng.standard_normal((3, 56, 72))).mT  # not foldable into one product: A's batches are transposes
    w = _t(rng.standard_normal((56, 40)))
    _close(_exact(a3 @ w), _exact(a3) @ _exact(w))  # B broadcast
    assert cuda == [True, True]


def test_per_head_attention_products_on_views_of_one_projection(cuda):
    # attention's q @ k^T and att @ v on [B, H, T, D] views of a [B, T, 3C] projection (two batch
    # dims whose strides do not merge), the dense path of the GPT's CausalSelfAttention
    rng = np.random.default_rng(9)
    B, T, H, D = 2, 70, 2, 32
    qkv = _t(rng.standard_normal((B, T, 3 * H * D)))
    q, k, v = hl.nn.functional.split_heads(qkv, H)
    scores = q @ k.mT  # rows of T = 70 elements: written through a float32 buffer with padded rows
    assert scores.shape == (B, H, T, T)
    _close(_exact(scores), _exact(q) @ np.swapaxes(_exact(k), -1, -2))
    y = scores @ v  # stored with the heads interleaved in rows of C, as the projection after reads it
    _close(_exact(y), _exact(scores) @ _exact(v))
    e = hl.einsum("bhtd,bhsd->bhts", q, k)  # an einsum that lowers to one batched product
    _close(_exact(e), _exact(scores))
    assert cuda == [True, True, True]


def test_batched_kernel_broadcasts_each_batch_dimension_on_its_own():
    # the generator's batched kernel on the emulated driver, 2 batch dims, A broadcast along one and
    # B along the other; small integers, so the product is exact.  Two CTAs walk the six products'
    # tiles, three each, with three k-tiles a tile: the 4-slot ring wraps from product to product.
    from helios.cuda_ptx.emu.launch import emulate_gemm
    from helios.cuda_ptx.tensor_gemm import VARIANT
    from helios.cuda_ptx.emit import resolve

    rng = np.random.default_rng(10)
    a = rng.integers(-3, 4, (2, 1, 70, 136)).astype(np.float32)
    b = rng.integers(-3, 4, (1, 3, 136, 40)).astype(np.float32)
    for cfg in (resolve(VARIANT).with_(batched=2, b_major="n"), resolve(VARIANT).with_(batched=2, a_major="m")):
        c = emulate_gemm(a, b, cfg, sm_count=2)
        assert c.shape == (2, 3, 70, 40)
        np.testing.assert_array_equal(c, a @ b)


def test_autocast_linear_gradients_match_the_generic_kernel(cuda, monkeypatch):
    # Forward and both backward products of a bf16 autocast Linear go to the tensor cores; the
    # gradients equal the generic kernel's to the 16-bit rounding.
    rng = np.random.default_rng(4)
    xs, ws, bs, gs = (rng.standard_normal(s).astype(np.float32) for s in ((4, 16, 32), (24, 32), (24,), (4, 16, 24)))

    def grads():
        x, w, b = (hl.tensor(v, requires_grad=True) for v in (xs, ws, bs))
        with hl.autocast("bfloat16"):
            y = hl.nn.functional.linear(x, w, b)
        (y.float() * hl.tensor(gs)).sum().backward()
        return [t.numpy() for t in (y.float(), x.grad, w.grad, b.grad)]

    engine = grads()
    assert len(cuda) == 3 and all(cuda)
    monkeypatch.setenv("HELIOS_TENSOR_CORES", "0")
    rt = get_runtime()
    rt._tensor_cores = None  # decide again, now switched off
    assert not rt.has_gemm("bfloat16")
    generic = grads()
    assert len(cuda) == 3  # no further product went to the engine
    for e, g in zip(engine, generic):
        np.testing.assert_allclose(e, g, rtol=2e-2, atol=2e-2 * np.abs(g).max())


def test_a_float32_out_of_a_16_bit_product_is_rounded_in_the_tensor_core_kernel(cuda):
    # matmul(compute=) with 16-bit operands and a float32 out: one tensor-core launch with round_out,
    # bit for bit the bf16 product widened; a fused epilogue's product keeps its own kernel and the cast
    rng = np.random.default_rng(8)
    a, b, bias = _t(rng.standard_normal((24, 32))), _t(rng.standard_normal((32, 16))), _t(rng.standard_normal(16))
    out = K.empty((24, 16), hl.float32, get_runtime())
    K.matmul(a, b, bias, out=out, compute=hl.bfloat16)
    assert cuda == [True]
    np.testing.assert_array_equal(out.numpy(), K.matmul(a, b, bias).float().numpy())
    y, u = K.matmul_epilogue("linear+gelu", a, b, bias, None, out=out, compute=hl.bfloat16)
    want, want_u = K.matmul_epilogue("linear+gelu", a, b, bias, None)
    np.testing.assert_array_equal(out.numpy(), want.float().numpy())
    np.testing.assert_array_equal(u.float().numpy(), want_u.float().numpy())


def test_vulkan_has_no_matrix_engine():
    assert not get_runtime().has_gemm("bfloat16") or get_runtime().name.startswith("cuda")


def test_a_captured_step_replays_its_tensor_core_products(cuda, monkeypatch):
    # the replays launch the products prepared once (TensorCoreGemm.prepare: a parameter block of
    # their own), on the new inputs
    from helios.cuda_ptx.tensor_gemm import TensorCoreGemm

    prepared = []
    real_prepare = TensorCoreGemm.prepare
    monkeypatch.setattr(TensorCoreGemm, "prepare", lambda self, *a: prepared.append(a) or real_prepare(self, *a))
    rng = np.random.default_rng(5)
    a0, a1 = (rng.standard_normal((24, 32)).astype(np.float32) for _ in range(2))
    b = _t(rng.standard_normal((32, 16)))
    b3 = _t(rng.standard_normal((2, 32, 16)))
    x = _t(a0)
    with hl.graph.capture(inputs=(x,)) as g:
        y = (x @ b).float()
        y3 = (x @ b3).float()  # a batched product: recorded with its batch
    _close(y.numpy(), _exact(x) @ _exact(b))
    _close(y3.numpy(), _exact(x) @ _exact(b3))
    for a in (a1, a0):
        g.replay(_t(a))
        _close(y.numpy(), _exact(_t(a)) @ _exact(b))  # the replay ran the product again, on the new input
        _close(y3.numpy(), _exact(_t(a)) @ _exact(b3))
    assert cuda == [True, True]  # each taken by the tensor cores when captured
    assert len(prepared) == 2 and prepared[1][11], prepared  # prepared on the first replay only, the batch kept
    g.release()


def test_autocast_gradient_casts_ride_in_the_tensor_core_products(cuda, monkeypatch):
    # Under bf16 autocast on cuda:0 a float32 operand is cast once, forward, and its gradient comes out
    # of the backward product rounded and widened in the kernel's epilogue (round_out): bit for bit the
    # separate casts around each product (the routing before: casts as autograd ops), with fewer cast
    # kernels.  (fp16's round_out: tests/test_cuda_ptx_emulator.py's bias test; each emulated product
    # costs ~0.5 s, so the block runs in bf16, the dtype GPT training uses, only.)
    from helios.functional import products

    fused, fused_casts = autocast_block(hl.bfloat16)
    monkeypatch.setattr(products, "_autocast_in_product", lambda *a: None)
    monkeypatch.setattr(products, "_autocast_matmul_dtype", lambda *a: None)
    separate, separate_casts = autocast_block(hl.bfloat16)
    for f, s in zip(fused, separate):
        np.testing.assert_array_equal(f, s)
    # Six products store float32 rounded, each of them a bf16 product and a cast before: c_fc's input
    # and weight gradients, c_proj's result (the residual's promotion) and weight gradient, the output
    # embedding's input and weight gradients.
    assert separate_casts - fused_casts == 6, (separate_casts, fused_casts)
    assert all(cuda)


def _layer_norm_into_linear(feeds: bool, seed: int = 4):
    """GPT's ln_1 -> c_attn under bf16 autocast from float32 leaves, forward and backward, the
    LayerNorm told its output feeds the product (``feeds``) or not: every result's bits, and
    the cast kernels run (copies between dtypes)."""
    from switches import counting_casts

    rng = np.random.default_rng(seed)
    shapes = {"x": (2, 8, 64), "lw": (64,), "lb": (64,), "w": (96, 64), "b": (96,)}
    t = {k: hl.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True) for k, s in shapes.items()}
    with counting_casts() as casts:
        with hl.autocast(hl.bfloat16):
            h = F.layer_norm(t["x"], (64,), t["lw"], t["lb"], feeds_products=feeds)
            y = F.linear(h, t["w"], t["b"])
        y.backward(K.copy(hl.tensor(rng.standard_normal((2, 8, 96)).astype(np.float32)), hl.bfloat16))
    return [_exact(y)] + [t[k].grad.numpy() for k in shapes], h.dtype, sum(casts)


def test_a_layer_norm_feeding_a_product_stores_bf16_for_the_tensor_cores(cuda):
    # The tensor cores read memory as it is, so a float32 LayerNorm output was cast to bf16 by a
    # kernel of its own before the product; stored in bf16 by the LayerNorm itself ("layer_norm+cast")
    # it needs none, and backward the product writes the bf16 gradient the LayerNorm kernels read.
    # The same bits either way; each run's three products on the tensor cores.
    fused, h_dtype, fused_casts = _layer_norm_into_linear(True)
    separate, h32_dtype, separate_casts = _layer_norm_into_linear(False)
    for f, s in zip(fused, separate):
        np.testing.assert_array_equal(f, s)
    assert (h_dtype, h32_dtype) == (hl.bfloat16, hl.float32)
    assert separate_casts - fused_casts == 1 and all(cuda) and len(cuda) == 6, (separate_casts, fused_casts, cuda)


def _projection_with_residual(shape_x, n: int, seed: int = 8):
    """residual + linear(x, w, b) under bf16 autocast from float32 leaves (a GPT projection and its
    float32 residual stream), forward and backward: every result's bits and the dispatches."""
    from switches import count_dispatches

    rng = np.random.default_rng(seed)
    k = shape_x[-1]
    t = {name: hl.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True)
         for name, s in (("x", shape_x), ("w", (n, k)), ("b", (n,)), ("r", shape_x[:-1] + (n,)))}
    with count_dispatches() as names:
        with hl.autocast(hl.bfloat16):
            y = F.linear_residual(t["x"], t["w"], t["b"], t["r"])
    y.backward(hl.tensor(rng.standard_normal(y.shape).astype(np.float32)))
    return [y.numpy()] + [t[k].grad.numpy() for k in t], names


@pytest.mark.parametrize("shape_x,n", [((2, 8, 32), 48), ((70, 64), 96)])
def test_a_projection_adds_its_float32_residual_in_the_tensor_core_epilogue(cuda, monkeypatch, shape_x, n):
    # round_out's rounded product plus the float32 residual in the wgmma kernel's epilogue (its
    # residual config): no add kernel after it, and the bits of the add in place it replaces (the
    # engine made to decline the residual: the product, then the add)
    from helios.cuda_ptx.tensor_gemm import TensorCoreGemm

    fused, names = _projection_with_residual(shape_x, n)
    real = TensorCoreGemm.accepts

    def no_residual(*args):  # accepts(..., round_out, residual): refuse any residual
        return (len(args) < 12 or args[11] is None) and real(*args)

    monkeypatch.setattr(TensorCoreGemm, "accepts", staticmethod(no_residual))
    apart, names_apart = _projection_with_residual(shape_x, n)
    for f, s in zip(fused, apart):
        np.testing.assert_array_equal(f, s)
    assert names["add"] == 0 and names_apart["add"] == 1, (names, names_apart)
    # three products a run on the tensor cores; the second run's first try, with the residual, refused
    assert cuda == [True] * 3 + [False] + [True] * 3, cuda
