"""Autocast's casts in the product (K.matmul(..., compute=), the mixed storage of
kernels_spirv/glsl/matmul.glsl and matmul_coop.comp, and the autocast linears of
helios.functional built on it): every float32 slot rounded or widened exactly as the cast
kernels around a 16-bit product do, bit for bit, in one dispatch, on the CPU-driver kernel, the
GPU shared-memory kernel and the cooperative-matrix kernel (lavapipe: its emulation)."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

import helios as hl
import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios import elementwise_jit, fused_kernels
from helios._kernels import gemm
from helios.runtime import get_runtime

sys.path.insert(0, os.path.dirname(__file__))
from switches import autocast_block, count_dispatches, switched, use_matmul_kernel  # noqa: E402

pytestmark = pytest.mark.vulkan

R = np.random.default_rng(7)


def _need_16bit():
    if not get_runtime().features.get("storage16", False):
        pytest.skip("no 16-bit storage on this device")


@pytest.fixture(params=["cpu", "gpu", "coop"])
def kernel(request, monkeypatch):
    """The matmul kernel under test: the CPU-driver kernel where the device runs it, the GPU
    shared-memory kernel, forced on (it runs on lavapipe too; on a GPU instead of the
    cooperative-matrix kernel), or the cooperative-matrix kernel (switches.use_matmul_kernel)."""
    _need_16bit()
    use_matmul_kernel(request.param, monkeypatch, request, "bfloat16")
    return request.param


@pytest.fixture(params=["cpu", "gpu"])
def simt_kernel(request, monkeypatch):
    """``kernel`` without the cooperative-matrix kernel: for the autocast linears and matmuls, which
    it runs in test_a_gpt_block_on_the_cooperative_matrix_kernel_runs_its_casts_in_the_products
    (their own cases would build its emulation ten more pipelines on a fresh machine)."""
    _need_16bit()
    use_matmul_kernel(request.param, monkeypatch, request, "bfloat16")
    return request.param


def _t(shape, dtype, transposed=False):
    """A tensor of ``shape`` in ``dtype`` (a transposed view of a contiguous one when asked)."""
    arr = R.standard_normal(shape[::-1] if transposed else shape).astype(np.float32)
    t = hl.tensor(arr if not transposed else arr)
    t = t if dtype is dt.float32 else K.copy(t, dtype)
    return t.mT if transposed else t


def _low(t, low):
    return t if t is None or t.dtype is low else K.copy(t, low)


def _bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.float().numpy()).view(np.uint32)


# (M, N, K): tall (the 32-row blocks, vector loads), ragged (scalar loads, clamped tiles),
# wide (16 columns a lane) and a K tail
SHAPES = [(64, 96, 40), (7, 13, 5), (3, 512, 8), (80, 64, 33)]


@pytest.mark.parametrize("low", [dt.bfloat16, dt.float16], ids=["bf16", "fp16"])
def test_float32_slots_equal_casts_around_the_product(kernel, low):
    for M, N, Kd in SHAPES:
        if kernel == "coop" and min(M, N) < gemm.coopmat.MIN_DIM:
            continue  # the shared-memory kernel's ("gpu")
        for da, db, dout in ((dt.float32, dt.float32, low), (low, dt.float32, dt.float32),
                             (dt.float32, low, dt.float32), (dt.float32, dt.float32, dt.float32)):
            for b_t in (False, True):
                a = _t((M, Kd), da)
                b = _t((Kd, N), db, transposed=b_t)
                bias = _t((N,), dt.float32) if b_t else None
                out = None if dout is low else K.empty((M, N), dt.float32, a._st.rt)
                assert kernel != "coop" or gemm.coopmat.choice_for(get_runtime(), low.name, M, N, Kd).coopmat
                with count_dispatches() as names:
                    got = gemm.matmul(a, b, bias, out, compute=low)
                want = gemm.matmul(_low(a, low), _low(b, low), _low(bias, low))
                assert got.dtype is dout
                assert np.array_equal(_bits(got), _bits(want)), (M, N, Kd, da.name, db.name, dout.name, b_t)
                if low is dt.bfloat16 or kernel != "cpu":  # fp16 on the CPU kernel: the casts apart
                    assert dict(names) == {"cast+matmul": 1}


def test_transposed_out_and_batches(kernel):
    low = dt.bfloat16
    # a weight's gradient slot written transposed (CT), and a batch of products
    a, b = _t((40, 24), dt.float32), _t((24, 56), low)
    out = K.empty((56, 40), dt.float32, a._st.rt).mT
    gemm.matmul(a, b, out=out, compute=low)
    want = gemm.matmul(_low(a, low), b)
    assert np.array_equal(_bits(out), _bits(want))
    a3, b3 = _t((3, 20, 16), low), _t((3, 16, 12), dt.float32)
    got = gemm.matmul(a3, b3, compute=low)
    assert np.array_equal(_bits(got), _bits(gemm.matmul(a3, _low(b3, low))))


def test_fused_epilogues_with_float32_slots(kernel):
    low = dt.bfloat16
    x, w = _t((2, 9, 24), dt.float32), _t((24, 40), dt.float32)
    bias, res = _t((40,), dt.float32), _t((2, 9, 40), dt.float32)
    y, u = K.matmul_epilogue("linear+gelu", x, w, bias, None, compute=low)
    u_want = gemm.matmul(_low(x, low), _low(w, low), _low(bias, low))
    assert y.dtype is low and u.dtype is low
    assert np.array_equal(_bits(u), _bits(u_want))
    assert np.array_equal(_bits(y), _bits(K.unary("gelu_tanh", u_want)))
    out, x_low = K.empty(res.shape, dt.float32, x._st.rt), _low(x, low)
    with count_dispatches() as names:
        K.matmul_epilogue("linear+residual", x_low, w, bias, res, out=out, compute=low)
    want = K.binary("add", res, K.copy(u_want, dt.float32))
    assert np.array_equal(_bits(out), _bits(want)) and dict(names) == {"cast+linear+residual": 1}


def test_bad_slots_are_refused():
    _need_16bit()
    a, b = _t((4, 8), dt.float32), _t((8, 4), dt.float32)
    with pytest.raises(ValueError, match="compute must be bfloat16 or float16"):
        gemm.matmul(a, b, compute=dt.float32)
    with pytest.raises(ValueError, match="a must be float16 or float32"):
        gemm.matmul(K.copy(a, dt.bfloat16), b, compute=dt.float16)
    res = _t((4, 4), dt.float32)
    with pytest.raises(ValueError, match="a float32 e is linear\\+residual's, with a float32 out"):
        K.matmul_epilogue("linear+residual", a, b, None, res, compute=dt.bfloat16)


def _linear_run(enabled: bool, fn, x_dtype, with_bias: bool):
    rng = np.random.default_rng(3)
    arrs = [rng.standard_normal((2, 12, 32)), rng.standard_normal((48, 32)) * 0.2, rng.standard_normal(48),
            rng.standard_normal((2, 12, 48))]
    ts = [hl.tensor(a.astype(np.float32)).requires_grad_() for a in arrs]
    x, w, b, r = ts
    xin = x if x_dtype is dt.float32 else x.to(x_dtype)
    # (the run-time elementwise fusion off: the counts are this fusion's alone)
    with switched(fused_kernels, "ENABLED", enabled), switched(elementwise_jit, "ENABLED", False), \
            count_dispatches() as names:
        with hl.autocast("bfloat16"):
            y = fn(xin, w, b if with_bias else None, r)
        (y.float() * y.float()).sum().backward()
    outs = [y] + [t.grad for t in ts if t.grad is not None]
    return [o.dtype for o in outs], [_bits(o) for o in outs], names


AUTOCAST_LINEARS = {
    "linear": lambda x, w, b, r: F.linear(x, w, b),
    "linear+gelu": lambda x, w, b, r: F.linear_gelu(x, w, b),
    "linear+residual": lambda x, w, b, r: F.linear_residual(x, w, b, r),
}


@pytest.mark.parametrize("name", sorted(AUTOCAST_LINEARS))
def test_autocast_linears_equal_the_casts_and_products_bit_for_bit(simt_kernel, name):
    fn = AUTOCAST_LINEARS[name]
    for x_dtype in (dt.float32, dt.bfloat16):
        for with_bias in (True, False):
            dt_on, on, names_on = _linear_run(True, fn, x_dtype, with_bias)
            dt_off, off, names_off = _linear_run(False, fn, x_dtype, with_bias)
            assert dt_on == dt_off
            for u, v in zip(on, off):
                assert np.array_equal(u, v), (name, x_dtype.name, with_bias)
            # the casts the product does: forward x's (when float32), w's, the bias's and the
            # residual add's promotion of the product; backward x's and w's, and linear+residual's
            # float32 output gradient g, rounded by backward's products as they load it (the bias
            # gradient is a bf16 sum cast to float32 either way: the sum reads g cast to bf16)
            x32, res = int(x_dtype is dt.float32), int(name == "linear+residual")
            fused_casts = (x32 + 1 + with_bias + res) + (x32 + 1 + res * (not with_bias))
            assert names_off["copy"] - names_on["copy"] == fused_casts
            # forward, then backward's two products, each one "cast+" kernel
            if name == "linear":
                assert names_on["cast+matmul"] == 3 and names_on["matmul"] == 0
            else:
                assert names_on["cast+" + name] == 1 and names_on["cast+matmul"] == 2 and names_on["matmul"] == 0
            assert names_off["add"] - names_on["add"] == (name == "linear+residual")


def _mlp_steps(fused_mlp: bool) -> tuple:
    """Two AdamW steps of a GPT MLP with its float32 residual under bf16 autocast: F.mlp_residual
    (``fused_mlp``), else its two linears apart.  float32 parameters in helios-train's two groups,
    weights decayed and biases not, which the optimizer gives flat gradient slots in a buffer each
    from its first step (the second step's bias gradients then ride in the weight gradients'
    products, their slots in another buffer).  Returns every output's, gradient's and
    parameter's bits, and the second step's dispatches by name."""
    from helios.optim import AdamW

    rng = np.random.default_rng(8)
    shapes = {"w1": (64, 32), "b1": (64,), "w2": (32, 64), "b2": (32,)}
    p = {k: hl.nn.Parameter(hl.tensor((rng.standard_normal(s) * 0.2).astype(np.float32))) for k, s in shapes.items()}
    opt = AdamW([{"params": [p["w1"], p["w2"]], "weight_decay": 0.1}, {"params": [p["b1"], p["b2"]], "weight_decay": 0.0}],
                lr=1e-2)
    bits = []
    for _ in range(2):
        x, r = (hl.tensor(rng.standard_normal((2, 8, 32)).astype(np.float32), requires_grad=True) for _ in range(2))
        with switched(elementwise_jit, "ENABLED", False), count_dispatches() as names:
            with hl.autocast("bfloat16"):
                if fused_mlp:
                    y = F.mlp_residual(x, p["w1"], p["b1"], p["w2"], p["b2"], r)
                else:
                    y = F.linear_residual(F.linear_gelu(x, p["w1"], p["b1"]), p["w2"], p["b2"], r)
            (y * y).sum().backward()
        bits += [_bits(y), _bits(x.grad), _bits(r.grad)]
        opt.step()
        opt.zero_grad()
    return bits + [_bits(t) for t in p.values()], names


def test_the_autocast_mlp_multiplies_by_gelus_derivative_in_a_product(kernel):
    # Under autocast the GPT MLP's backward makes c_proj's input gradient and multiplies it by
    # gelu'(u) in one product, as the float32 MLP does: bit for bit its two linears apart (the
    # hidden gradient rounded to bf16, then gelu_tanh_bwd), one dispatch fewer; c_proj's float32
    # output gradient is rounded by the products as they load it, in both
    fused, names = _mlp_steps(True)
    apart, names_apart = _mlp_steps(False)
    for u, v in zip(fused, apart):
        assert np.array_equal(u, v)
    assert names["cast+matmul+gelu_tanh_bwd"] == 1 and names["gelu_tanh_bwd"] == 0
    assert names_apart["gelu_tanh_bwd"] == 1 and names["copy"] == names_apart["copy"] == 0
    assert sum(names.values()) == sum(names_apart.values()) - 1
    assert names["cast+matmul+bias_grad"] == 2  # each bias gradient in its weight gradient's product
    assert all(n in fused_kernels.PARTS for n in names if "+" in n)  # HELIOS_DEBUG's names of the parts


def _gpt_step_dispatches(dtype: str | None) -> int:
    """The kernels the second of two steps of a 2-layer GPT dispatches, under ``dtype`` autocast
    (None: float32), with helios-train's optimizer: AdamW with the weights decayed and the biases
    and norms in a second group (a flat gradient buffer each)."""
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), seed=0)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = AdamW(groups, lr=1e-3)
    x, y = (hl.tensor(np.random.default_rng(i).integers(0, 64, (4, 16))) for i in range(2))
    for _ in range(2):
        with switched(elementwise_jit, "ENABLED", False), count_dispatches() as names:
            with hl.autocast(dtype) if dtype else contextlib.nullcontext():
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return sum(names.values())


def test_a_bf16_gpt_step_dispatches_no_more_kernels_than_float32(kernel):
    # every autocast cast rides in a kernel that runs anyway (the products, the loss, the softmax),
    # and the bias gradients ride in the weight gradients' products wherever their slots are: a
    # bf16 step dispatches what a float32 one does (before, on the cooperative-matrix kernel:
    # 216 against 140 in the tiny config's helios-train step)
    assert _gpt_step_dispatches("bfloat16") == _gpt_step_dispatches(None)


def _matmul_run(enabled: bool, a_arr, b_arr, a_dtype, b_dtype, b_view):
    ts = [hl.tensor(x.astype(np.float32)).requires_grad_() for x in (a_arr, b_arr)]
    a = ts[0] if a_dtype is dt.float32 else ts[0].to(a_dtype)
    b = ts[1] if b_dtype is dt.float32 else ts[1].to(b_dtype)
    with switched(fused_kernels, "ENABLED", enabled), switched(elementwise_jit, "ENABLED", False), \
            count_dispatches() as names:
        with hl.autocast("bfloat16"):
            y = F.matmul(a, b_view(b))
        (y.float() * y.float()).sum().backward()
    return [_bits(t) for t in (y, ts[0].grad, ts[1].grad)], y.dtype, names


def test_autocast_matmul_with_a_float32_operand_equals_the_casts_bit_for_bit(simt_kernel):
    rng = np.random.default_rng(5)
    cases = [  # attention's fp32 softmax times v (heads), the tied output embedding (x @ W^T)
        (rng.standard_normal((2, 3, 16, 16)), rng.standard_normal((2, 3, 16, 8)), dt.float32, dt.bfloat16,
         lambda b: b),
        (rng.standard_normal((2, 16, 24)), rng.standard_normal((40, 24)), dt.float32, dt.float32, lambda b: b.mT),
    ]
    for a_arr, b_arr, da, db, view in cases:
        on, y_dtype, names_on = _matmul_run(True, a_arr, b_arr, da, db, view)
        off, _, names_off = _matmul_run(False, a_arr, b_arr, da, db, view)
        assert y_dtype is dt.bfloat16
        for u, v in zip(on, off):
            assert np.array_equal(u, v)
        assert names_on["cast+matmul"] == 3 and names_on["matmul"] == 0
        n32 = int(da is dt.float32) + int(db is dt.float32)
        assert names_off["copy"] - names_on["copy"] == 2 * n32  # each fp32 operand's cast, both ways


@pytest.mark.parametrize("low", [dt.bfloat16, dt.float16], ids=["bf16", "fp16"])
def test_weight_and_bias_gradients_in_one_product_with_float32_slots(kernel, low):
    rt = get_runtime()
    if kernel == "cpu" and low is dt.float16:
        # refused (nothing dispatched): the CPU kernel has no float16 texel variants
        x, g = _t((8, 4), dt.float32), _t((8, 5), low)
        flat = K.empty((4 * 5 + 5,), dt.float32, rt)
        with count_dispatches() as names:
            assert not K.matmul_bias_grad(x.mT, g, flat[:20].reshape(5, 4).mT, flat[20:], compute=low)
        assert not names
        return
    for rows, n_in, n_out in ((64, 24, 40), (37, 8, 13), (70, 16, 72)):
        x, g = _t((rows, n_in), dt.float32), _t((rows, n_out), low)
        flat = K.empty((n_in * n_out + n_out + 3,), dt.float32, rt)  # the slots of a flat gradient buffer
        w_slot = flat[: n_in * n_out].reshape(n_out, n_in)
        b_slot = flat[n_in * n_out + 3:]
        with count_dispatches() as names:
            assert K.matmul_bias_grad(x.mT, g, w_slot.mT, b_slot, compute=low)
        assert dict(names) == {"cast+matmul+bias_grad": 1}
        want_w = K.copy(gemm.matmul(K.copy(x, low).mT, g), dt.float32)
        want_b = K.copy(K.copy(K.reduce("sum", g, (0,))[0], low), dt.float32)  # the 16-bit sum, rounded, widened
        assert np.array_equal(_bits(w_slot.mT), _bits(want_w)) and np.array_equal(_bits(b_slot), _bits(want_b))


def _with_and_without_fusion(inp, low, op, backward, fused: tuple, plain: tuple):
    """Run ``op`` on a fresh leaf of 16-bit ``inp`` under autocast and ``backward(out)``, with the
    fused kernels on and off: the outputs and the input's gradients must be the same bits, the
    fused run dispatch the kernels ``fused`` once each, the plain one ``plain`` and two more cast
    kernels (the input's cast to float32 and its gradient's cast back).  Returns (out, grad)."""
    runs = {}
    for fuse in (True, False):
        x = inp.detach().requires_grad_()
        with switched(fused_kernels, "ENABLED", fuse), count_dispatches() as names:
            with hl.autocast(low.name):
                out = op(x)
            backward(out)
        runs[fuse] = (out, x.grad, names)
    (out, grad, names), (ref_out, ref_grad, ref_names) = runs[True], runs[False]
    assert out.dtype is dt.float32 and grad.dtype is low
    assert np.array_equal(_bits(out), _bits(ref_out)) and np.array_equal(_bits(grad), _bits(ref_grad))
    assert all(names[n] == 1 for n in fused) and all(ref_names[n] == 1 for n in plain)
    assert ref_names["copy"] - names["copy"] == 2
    return out, grad


@pytest.mark.parametrize("low", [dt.bfloat16, dt.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(37, 50), (3, 11, 5)], ids=["rows", "classes-on-dim-1"])
def test_autocast_cross_entropy_reads_16bit_logits_with_the_casts_bits(low, shape):
    # Under autocast the loss is float32: 16-bit logits are read by the kernel itself instead
    # of a float32 copy, and their gradient is rounded as it is stored instead of cast back.
    rng = np.random.default_rng(3)
    logits = K.copy(hl.tensor(rng.standard_normal(shape).astype(np.float32) * 3), low)
    index_shape = shape[:1] + shape[2:]
    targets = rng.integers(0, shape[1], index_shape)
    targets.reshape(-1)[::4] = -100  # ignored rows: no loss, no gradient, not counted
    loss, _ = _with_and_without_fusion(logits, low, lambda x: F.cross_entropy(x, hl.tensor(targets)),
                                       lambda loss: loss.backward(), ("cast+cross_entropy", "cross_entropy_bwd+cast"),
                                       ("cross_entropy", "cross_entropy_bwd"))
    # and what PyTorch's autocast gives (float32 loss of the widened logits)
    import torch

    want = torch.nn.functional.cross_entropy(torch.tensor(logits.float().numpy()), torch.tensor(targets))
    np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-6)


@pytest.mark.parametrize("low", [dt.bfloat16, dt.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal,shape", [(True, (2, 3, 37, 37)), (False, (5, 9, 64)), (True, (1, 2, 64, 64))],
                         ids=["causal-odd", "plain", "causal-texel-rows"])
def test_autocast_attention_softmax_reads_16bit_scores_with_the_casts_bits(low, causal, shape):
    # Under autocast attention's softmax is float32: the kernel reads 16-bit scores itself and
    # its backward rounds the gradient as it stores it, instead of two cast kernels.
    rng = np.random.default_rng(5)
    scores = K.copy(hl.tensor(rng.standard_normal(shape).astype(np.float32) * 4), low)
    up = hl.tensor(rng.standard_normal(shape).astype(np.float32))  # the upstream gradient (float32, as y)
    y, grad = _with_and_without_fusion(scores, low, lambda x: F.attention_softmax(x, 0.125, causal=causal),
                                       lambda y: (y * up).sum().backward(), ("cast+softmax", "softmax_bwd+cast"),
                                       ("softmax", "softmax_bwd"))
    import torch

    t = torch.tensor(scores.float().numpy(), requires_grad=True)
    s = t * 0.125
    if causal:
        s = s.masked_fill(torch.ones(shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(s, -1)
    np.testing.assert_allclose(y.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-7)
    (want * torch.tensor(up.numpy())).sum().backward()
    np.testing.assert_allclose(grad.float().numpy(), t.grad.to(getattr(torch, low.name)).float().numpy(),
                               rtol=2e-2, atol=1e-3)


def test_float16_operands_the_cpu_kernel_cannot_read_are_cast_once(monkeypatch):
    # lavapipe's kernel reads float32 A or B in bfloat16 products only: under float16 autocast a
    # linear's float32 input and weight are cast once, forward, and backward's products read those
    # copies instead of casting x and w again (K.casts_operands_first), bit for bit the same
    if not gemm._cpu_mm_kernel(get_runtime()):
        pytest.skip("the CPU-driver kernel's float16 products (lavapipe)")
    once, once_casts = autocast_block(hl.float16)
    monkeypatch.setattr(K, "casts_operands_first", lambda *a: False)
    again, again_casts = autocast_block(hl.float16)
    for u, v in zip(once, again):
        assert np.array_equal(u, v)
    # Backward's products cast x, w1, w2 (c_fc's and c_proj's) and emb, y (the tied embedding's)
    # again, and each such product then also cast its result into its float32 gradient, where
    # with 16-bit operands the kernel widens it as it stores: 5 + 5.  c_proj's float32 output
    # gradient, cast once for its two products and its bias sum, is cast by each of them: + 2;
    # and its weight gradient's product, float32 g in, casts its result too: + 1
    assert again_casts - once_casts == 13, (again_casts, once_casts)


def test_a_gpt_block_on_the_cooperative_matrix_kernel_runs_its_casts_in_the_products(monkeypatch, request):
    # autocast's float32 operands and gradient slots rounded and widened by matmul_coop itself: the
    # same bits as the cast kernels around it (what it ran before it took float32 slots), 13 casts fewer
    use_matmul_kernel("coop", monkeypatch, request, "bfloat16")
    fused, fused_casts = autocast_block(hl.bfloat16)
    monkeypatch.setattr(gemm, "_mixed_in_kernel", lambda *a: False)
    apart, apart_casts = autocast_block(hl.bfloat16)
    for u, v in zip(fused, apart):
        assert np.array_equal(u, v)
    assert (fused_casts, apart_casts) == (7, 20)


def test_casts_first_where_the_product_kernel_reads_16_bit_only(monkeypatch):
    rt = get_runtime()
    assert not K.casts_operands_first(rt, dt.bfloat16, False, False)  # nothing to cast
    # the shared-memory and cooperative-matrix kernels round float32 operands as they load them
    tile = object()  # any tile: Choice.coopmat asks only whether there is one
    monkeypatch.setattr(gemm, "_cpu_mm_kernel", lambda rt: False)
    for choice in (gemm.coopmat.Choice("matmul_coop", tile, "faked"), gemm.coopmat.Choice("matmul", None, "faked")):
        monkeypatch.setattr(gemm.coopmat, "choice_for", lambda *a, c=choice: c)
        assert not K.casts_operands_first(rt, dt.float16, True, False)
    # a matrix engine reads 16-bit operands only
    monkeypatch.setattr(rt, "has_gemm", lambda name: True)
    assert K.casts_operands_first(rt, dt.float16, True, False)
