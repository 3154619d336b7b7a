"""Elementwise kernels 16 bytes at a time (helios._kernels.core.vec_width, copy.comp): bfloat16 ops
take 8 elements an invocation through uvec4 views of their buffers (float32 4 through vec4s), and
copies without conversion move 16 bytes an invocation; each gives, bit for bit, what one element
an invocation gives, on lavapipe and on the emulated cuda:0 (where the views are 16-byte loads)."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios import dtypes, elementwise_jit
from helios._kernels import core, elementwise
from helios.runtime import get_runtime
from switches import count_dispatches

pytestmark = pytest.mark.vulkan

N = 8 * 67  # a multiple of 8, several workgroups' worth of invocations on neither path


def _inputs(n: int = N, seed: int = 0) -> list:
    """bf16 operands with the values rounding and the ops treat specially: NaN, infinities, -0,
    bf16 subnormals, the largest finite bf16, and values that round to the next even."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(3):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        x[k:k + 8] = [np.nan, np.inf, -np.inf, -0.0, 1e-39, -9e-40, 3.3895e38, 1.00390625]
        out.append(hl.tensor(x).to(hl.bfloat16))
    return out


def _bits(t: hl.Tensor) -> bytes:
    return t.float().numpy().tobytes()


def _ops(a, b, c) -> list:
    """Unary and binary ops (each its own kernel), an in-place scale by a device scalar, and a
    fused chain (helios.elementwise_jit), all on bf16 tensors."""
    outs = [K.unary("gelu_tanh", a), K.unary("exp", b), K.unary("clamp", c, -1.5, 1.5),
            K.binary("mul", a, b), K.binary("add", b, c, 0.5), K.binary("div", a, c), K.binary("gelu_tanh_bwd", a, b)]
    s = hl.tensor(a.float().numpy().copy()).to(hl.bfloat16)
    K.binary_("mul", s, hl.tensor(np.array([0.37], np.float32)).to(hl.bfloat16))
    chain = ((a * b + 1.0).tanh() - c).exp()  # queued, then fused into one ew_fused kernel
    return outs + [s, chain]


@pytest.fixture
def built(monkeypatch) -> list:
    """The (kernel, variant, specialization constants) of every pipeline asked for in the test,
    the fused chains' as ("ew_fused", dtype tag, (elements an invocation,))."""
    rt, specs = get_runtime(), []
    real_pipeline, real_jit = rt.pipeline, elementwise_jit._pipeline

    def pipeline(kernel, variant, spec=(), *rest):
        specs.append((kernel, variant, tuple(spec)))
        return real_pipeline(kernel, variant, spec, *rest)

    def fused(r, sig, vec):
        specs.append(("ew_fused", sig[0], (vec,)))
        return real_jit(r, sig, vec)

    monkeypatch.setattr(rt, "pipeline", pipeline)
    monkeypatch.setattr(elementwise_jit, "_pipeline", fused)
    return specs


def test_bf16_ops_eight_at_a_time_equal_one_at_a_time(monkeypatch, built):
    a, b, c = _inputs()
    assert core.vec_width("bf16", N, 0, 8) == 8 and core.vec_width("bf16", N, 4) == 1 and core.vec_width("f16", N) == 1
    specs = built
    with count_dispatches() as names:
        wide = [_bits(t) for t in _ops(a, b, c)]
    assert names["ew_fused"] == 1
    # the 8-element paths were built: ew_unary / ew_binary's VEC 8 (spec constant 2), the chain's
    assert {(k, s[2]) for k, v, s in specs if k in ("ew_unary", "ew_binary") and v == "bf16" and len(s) > 2} == {
        ("ew_unary", 8), ("ew_binary", 8)}, specs
    assert ("ew_fused", "bf16", (8,)) in specs
    monkeypatch.setattr(elementwise, "vec_width", lambda *x: 1)
    monkeypatch.setattr(core, "vec_width", lambda *x: 1)
    narrow = [_bits(t) for t in _ops(a, b, c)]
    assert wide == narrow


def test_copies_move_sixteen_bytes_at_a_time():
    rng = np.random.default_rng(1)
    for dtype, width in ((hl.bfloat16, 8), (hl.float16, 8), (hl.float32, 4), (hl.int32, 4)):
        x = hl.tensor(rng.standard_normal((6, 40)).astype(np.float32) * 100).to(dtype)
        ref = x.numpy()
        for view, want in ((x[:, 8:32], ref[:, 8:32]), (x[1:5], ref[1:5]), (x.t()[8:16], ref.T[8:16])):
            assert np.array_equal(view.contiguous().numpy(), want), (dtype, view.shape)
        # into an aligned slice of a larger buffer, and from an offset that is not aligned (one at a time)
        big = hl.zeros((6, 48)).to(dtype)
        big[:, 8:40] = x[:, :32]
        assert np.array_equal(big.numpy()[:, 8:40], ref[:, :32]) and not big.numpy()[:, :8].any()
        assert np.array_equal(x[:, 3:3 + width].contiguous().numpy(), ref[:, 3:3 + width])


def test_casts_between_float32_and_bfloat16_eight_at_a_time(built):
    # autocast's casts: 8 elements an invocation where aligned, one at a time where not; both round
    # to nearest even and keep NaN, as the host's conversion does, and bf16 -> f32 is exact
    rng = np.random.default_rng(3)
    f = (rng.standard_normal((8, 48)) * 3).astype(np.float32)
    f[0, 8:12] = [np.nan, np.inf, 3.3961e38, -1.00390625]  # the last two round up to inf and to even
    want = dtypes.float32_to_bf16_bits(f).astype(np.uint32) << 16  # as float32 bits
    x = hl.tensor(f)
    for cols in (slice(8, 40), slice(1, 33)):  # aligned: 8 at a time; not: one at a time
        down = x[:, cols].to(hl.bfloat16)
        up = down.to(hl.float32).numpy()  # back through the cast the other way
        assert np.array_equal(up.view(np.uint32), want[:, cols]), cols
    assert ("copy", "f32_bf16", (8,)) in built and ("copy", "bf16_f32", (8,)) in built


def test_the_wide_paths_on_the_emulated_cuda_device(emulated_cuda):
    # the uvec4 views become 16-byte loads and stores in the translated PTX; the bits are the Vulkan device's
    a, b, c = _inputs(8 * 20, seed=2)
    want = [_bits(t) for t in _ops(a, b, c)]
    hl.set_device("cuda:0")
    ca, cb, cc = (t.to("cuda:0") for t in (a, b, c))
    got = [_bits(t) for t in _ops(ca, cb, cc)]
    assert got == want
    f = (np.random.default_rng(4).standard_normal((3, 64)) * 3).astype(np.float32)
    x = hl.tensor(f).to(hl.bfloat16)  # a cast 8 at a time, then a copy 16 bytes at a time, then back
    want = dtypes.float32_to_bf16_bits(f[:, 16:48]).astype(np.uint32) << 16
    assert np.array_equal(x[:, 16:48].contiguous().to(hl.float32).numpy().view(np.uint32), want)
