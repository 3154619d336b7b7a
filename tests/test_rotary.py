"""RoPE in one kernel each way (helios.fused_kernels "rotary" / "rotary_bwd",
kernels_spirv/glsl/rotary.comp): the bits of the separate ops it replaces, forward and
backward, for every dtype pair it takes; LLaMA's training step with it."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios import dtypes as dt
from helios import fused_kernels
from helios.models.llama import LlamaConfig, LlamaForCausalLM
from helios.optim import AdamW
from switches import count_dispatches
from test_mixed_matmul import _need_16bit

R = np.random.default_rng(7)
PAIRS = [(dt.float32, dt.float32), (dt.bfloat16, dt.float32), (dt.float16, dt.float32),
         (dt.bfloat16, dt.bfloat16), (dt.float16, dt.float16)]


def _bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.float().numpy()).view(np.uint32)


def _tables(T: int, D: int, dtype, rng=R):
    """cos and sin [T, D] as rows 2 .. T+1 of longer tables (views at an offset), sin's first half
    negated (rotate_half's sign), as the LLaMA model keeps them."""
    ang = np.arange(T + 3, dtype=np.float32)[:, None] * rng.uniform(0.1, 1.0, D).astype(np.float32)
    sin = np.sin(ang)
    sin[:, : D // 2] *= -1
    cos_t, sin_t = (hl.tensor(a).to(dtype) for a in (np.cos(ang), sin))
    return cos_t[2:2 + T], sin_t[2:2 + T]


def _rotate(base, cos, sin, g, fused: bool, monkeypatch):
    """F.rotary of base [B, T, H, D] seen as [B, H, T, D] (a transposed view, as LLaMA's q and k),
    with fusion on or off: (output, base's gradient, dispatch counts forward, backward)."""
    monkeypatch.setattr(fused_kernels, "ENABLED", fused)
    base.grad = None
    x = base.transpose(1, 2)
    with count_dispatches() as fwd:
        out = hl.functional.rotary(x, cos, sin)
    with count_dispatches() as bwd:
        out.backward(g)
    return out, base.grad, fwd, bwd


@pytest.mark.parametrize("x_dtype,t_dtype", PAIRS, ids=[f"{a.name}-{b.name}" for a, b in PAIRS])
@pytest.mark.parametrize("D", [8, 6, 5])
def test_rotary_equals_the_separate_ops_bit_for_bit(x_dtype, t_dtype, D, monkeypatch):
    if x_dtype.itemsize == 2:
        _need_16bit()
    B, T, H = 2, 7, 3
    base = hl.tensor(R.standard_normal((B, T, H, D)).astype(np.float32)).to(x_dtype).detach().requires_grad_(True)
    cos, sin = _tables(T, D, t_dtype)
    g = hl.tensor(R.standard_normal((B, H, T, D)).astype(np.float32)).to(t_dtype)
    out, dx, fwd, bwd = _rotate(base, cos, sin, g, True, monkeypatch)
    want, want_dx, fwd0, bwd0 = _rotate(base, cos, sin, g, False, monkeypatch)
    assert out.dtype is t_dtype and out.shape == (B, H, T, D) and dx.dtype is x_dtype
    assert np.array_equal(_bits(out), _bits(want)), (x_dtype.name, t_dtype.name, D)
    assert np.array_equal(_bits(dx), _bits(want_dx)), (x_dtype.name, t_dtype.name, D)
    # one kernel each way, where the roll's copies, the products, the sum (and casts) were
    assert dict(fwd) == {"rotary": 1} and dict(bwd) == {"rotary_bwd": 1}, (fwd, bwd)
    assert sum(fwd0.values()) >= 5 and sum(bwd0.values()) >= 5, (fwd0, bwd0)
    # and the values are RoPE's (float64 from the same inputs)
    x64 = base.float().numpy().astype(np.float64).transpose(0, 2, 1, 3)
    c64, s64 = (t.float().numpy().astype(np.float64) for t in (cos, sin))
    ref = x64 * c64 + np.roll(x64, D // 2, -1) * s64
    tol = 1e-6 if t_dtype is dt.float32 else 2e-2
    np.testing.assert_allclose(out.float().numpy(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("low", [dt.bfloat16, dt.float16], ids=["bf16", "fp16"])
def test_rotary_feeding_autocast_products_stores_the_cast_result_bit_for_bit(low, monkeypatch):
    # under autocast, q and k feed only the attention, whose cast rounds them to the autocast
    # dtype: "rotary+cast" stores that rounding, and its backward reads the 16-bit gradient
    _need_16bit()
    B, T, H, D = 2, 6, 2, 8
    base = hl.tensor(R.standard_normal((B, T, H, D)).astype(np.float32)).to(low).detach().requires_grad_(True)
    cos, sin = _tables(T, D, dt.float32)
    g = hl.tensor(R.standard_normal((B, H, T, D)).astype(np.float32)).to(low)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(fused_kernels, "ENABLED", fused)
        base.grad = None
        with count_dispatches() as fwd:
            with hl.autocast(low.name):
                out = hl.functional.rotary(base.transpose(1, 2), cos, sin, feeds_products=True)
            if not fused:
                out = out.to(low)  # the attention's cast
        with count_dispatches() as bwd:
            out.backward(g)
        got[fused] = (out, base.grad, dict(fwd), dict(bwd))
    (out, dx, fwd, bwd), (want, want_dx, _, _) = got[True], got[False]
    assert out.dtype is low and np.array_equal(_bits(out), _bits(want))
    assert np.array_equal(_bits(dx), _bits(want_dx))
    assert fwd == {"rotary+cast": 1} and bwd == {"cast+rotary_bwd": 1}, (fwd, bwd)
    # without autocast, or without the promise, the result is the promoted float32 one
    monkeypatch.setattr(fused_kernels, "ENABLED", True)
    assert hl.functional.rotary(base.transpose(1, 2), cos, sin, feeds_products=True).dtype is dt.float32
    with hl.autocast(low.name):
        assert hl.functional.rotary(base.transpose(1, 2), cos, sin).dtype is dt.float32


def test_rotary_falls_back_to_the_separate_ops_and_refuses_bad_gradients(monkeypatch):
    cos, sin = _tables(4, 8, dt.float32)
    x3 = hl.tensor(R.standard_normal((3, 4, 8)).astype(np.float32))  # 3-D: the separate ops
    with count_dispatches() as names:
        y = hl.functional.rotary(x3, cos, sin)
    assert "rotary" not in names
    x64, c64, s64 = (t.numpy().astype(np.float64) for t in (x3, cos, sin))
    np.testing.assert_allclose(y.numpy(), x64 * c64 + np.roll(x64, 4, -1) * s64, rtol=1e-6, atol=1e-6)
    # tables that want a gradient take the separate ops too, and get it
    cos_p = cos.detach().requires_grad_(True)
    x4 = hl.tensor(R.standard_normal((1, 2, 4, 8)).astype(np.float32))
    hl.functional.rotary(x4, cos_p, sin).sum().backward()
    np.testing.assert_allclose(cos_p.grad.numpy(), x4.numpy().sum((0, 1)), rtol=1e-6)
    # tables on another device: the separate ops' one-line error, not the kernel reading them
    cos_host = hl.tensor(cos.numpy(), device="cpu")
    with pytest.raises(Exception, match=rf"different devices \({x4.device} and cpu\)"):
        hl.functional.rotary(x4, cos_host, cos_host)
    with pytest.raises(ValueError, match="rotary_bwd: a float32 gradient for an output of float32 tables and a int64 input"):
        K.rotary_bwd(K.copy(x4), cos, sin, dt.int64, x4.stride())


def _llama_step(fused: bool, autocast: str | None, monkeypatch):
    monkeypatch.setattr(fused_kernels, "ENABLED", fused)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    hl.manual_seed(0)
    model = LlamaForCausalLM(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-3)
    data = np.random.default_rng(3).integers(0, 64, (2, 17))
    x, y = hl.tensor(data[:, :-1]), hl.tensor(data[:, 1:])
    with count_dispatches() as names:
        if autocast:
            with hl.autocast(autocast):
                _, loss = model(x, y)
        else:
            _, loss = model(x, y)
        loss.backward()
    grads = [_bits(p.grad) for p in model.parameters()]
    opt.step()
    return loss.item(), grads, names


@pytest.mark.parametrize("autocast", [None, "bfloat16"], ids=["fp32", "bf16"])
def test_a_llama_step_rotates_q_and_k_in_one_kernel_each_way_with_the_same_bits(autocast, monkeypatch):
    if autocast:
        _need_16bit()
    loss, grads, names = _llama_step(True, autocast, monkeypatch)
    loss0, grads0, names0 = _llama_step(False, autocast, monkeypatch)
    assert loss == loss0
    for u, v in zip(grads, grads0):
        assert np.array_equal(u, v)
    # q and k of 2 layers; under autocast stored in bf16, what the attention reads
    fused = ("rotary+cast", "cast+rotary_bwd") if autocast else ("rotary", "rotary_bwd")
    assert names[fused[0]] == names[fused[1]] == 2 * 2, names
    assert not any("rotary" in n for n in names0)
    # each rotation was a roll's two copies, two products and a sum (and two casts under autocast),
    # its backward as many again; the gradient of q and k now reaches the projections uncopied
    assert sum(names0.values()) - sum(names.values()) >= 4 * (12 if autocast else 6), (names0, names)


@pytest.mark.vulkan
def test_rotary_on_the_emulated_cuda_device_gives_the_vulkan_bits(emulated_cuda, monkeypatch):
    # cuda:N runs the kernel's SPIR-V translated to PTX: the same bits as Vulkan, both directions
    from helios.runtime import get_runtime, set_device

    vulkan = get_runtime().name
    base = R.standard_normal((1, 5, 2, 8)).astype(np.float32)
    g = R.standard_normal((1, 2, 5, 8)).astype(np.float32)
    got = {}
    for device in (vulkan, "cuda:0"):
        set_device(device)
        for x_dtype in (dt.float32, dt.bfloat16):
            cos, sin = _tables(5, 8, dt.float32, np.random.default_rng(1))
            x = hl.tensor(base).to(x_dtype).detach().requires_grad_(True)
            with count_dispatches() as names:
                out = hl.functional.rotary(x.transpose(1, 2), cos, sin)
                out.backward(hl.tensor(g))
            assert dict(names) == {"rotary": 1, "rotary_bwd": 1}, names
            got[device, x_dtype] = (_bits(out), _bits(x.grad))
    for x_dtype in (dt.float32, dt.bfloat16):
        for a, b in zip(got[vulkan, x_dtype], got["cuda:0", x_dtype]):
            assert np.array_equal(a, b), x_dtype.name
