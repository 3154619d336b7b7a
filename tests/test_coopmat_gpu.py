"""The cooperative-matrix matmul (kernels_spirv/glsl/matmul_coop.comp) against PyTorch: every layout
(nn, nt, tn, tt), ragged shapes, offset views, broadcast batches, bias, transposed and
head-interleaved outputs; the fused epilogues and the bias gradient bit for bit against the
unfused kernels; the shared-memory kernel (switched to with coopmat.set_enabled) close to it.

On a GPU that lists cooperative matrices the real kernel runs (./scripts/gpu_check.sh . coopmat).
On lavapipe, which lists none, the same tests run its f16_emu variant through helios.matmul: the
device's facts are made to list one 16x16x16 f16*f16+f32 shape and to say "discrete" (past the
CPU-driver kernel), and matmul_coop's pipelines are built from f16_emu, where plain code does the
three cooperative-matrix operations; everything else in the kernel and its dispatch is what a GPU
runs.  Other devices skip."""

import numpy as np
import pytest
import torch

import helios as hl
from helios import _kernels as K
from helios._kernels import coopmat

pytestmark = pytest.mark.vulkan
R = np.random.default_rng(37)


EMULATED_SHAPE = dict(m=16, n=16, k=16, a="f16", b="f16", c="f32", result="f32", scope="subgroup", saturating=False)


@pytest.fixture(scope="module")
def rt():
    from helios.runtime import get_runtime

    r = get_runtime()
    with pytest.MonkeyPatch.context() as mp:
        if not coopmat.shapes_of(getattr(r, "info", None) or {}):
            if (getattr(r, "info", None) or {}).get("type") != "cpu" or not coopmat.kernel_built():
                pytest.skip(f"{r.name} lists no cooperative matrices")
            mp.setitem(r.info, "cooperative_matrix", [EMULATED_SHAPE])
            mp.setitem(r.info, "type", "discrete")
            real = r.pipeline
            mp.setattr(r, "pipeline", lambda kernel, variant, spec=(), subgroup_size=0: real(
                kernel, "f16_emu" if kernel == coopmat.KERNEL else variant, spec, subgroup_size))
        ch = coopmat.choice_for(r, "float16", 256, 256, 256)
        if not ch.coopmat:
            pytest.skip(f"{r.name}: the cooperative-matrix kernel is not chosen: {ch.reason}")
        yield r


def rn(*shape):
    return R.uniform(-1.0, 1.0, size=shape).astype(np.float16)


def h16(x):
    return hl.tensor(x, dtype="float16")


def f32(t):
    return np.asarray(t.numpy(), dtype=np.float32)


def ref(a, b, bias=None):
    """PyTorch's product of the fp16 values in fp32 (on the GPU where there is one), as float32."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    r = torch.matmul(torch.tensor(a, dtype=torch.float32, device=dev), torch.tensor(b, dtype=torch.float32, device=dev))
    if bias is not None:
        r = r + torch.tensor(bias, dtype=torch.float32, device=dev)
    return r.cpu().numpy()


def close(got, want, k):
    # fp32 sums in another order, then one fp16 rounding: half an fp16 ulp of |want| plus the order's share
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3 * max(1.0, np.sqrt(k) / 4))


def _view(x, kind):
    """(numpy operand, helios view) of stored array ``x`` seen as ``kind``: "n" as is, "t" transposed, "off" from its second column."""
    if kind == "n":
        return x, h16(x)
    if kind == "t":
        return x.T, h16(x).transpose(0, 1)
    return x[:, 1:], h16(x)[:, 1:]


@pytest.mark.parametrize("M,N,Kd", [(192, 320, 256), (77, 91, 45), (136, 200, 72), (16, 1000, 24)])
@pytest.mark.parametrize("la,lb", [("n", "n"), ("n", "t"), ("t", "n"), ("t", "t"), ("off", "off")])
def test_layouts_and_ragged_shapes_against_torch(rt, M, N, Kd, la, lb):
    xa = rn(M, Kd) if la == "n" else rn(Kd, M) if la == "t" else rn(M, Kd + 1)
    xb = rn(Kd, N) if lb == "n" else rn(N, Kd) if lb == "t" else rn(Kd, N + 1)
    (na, ha), (nb, hb) = _view(xa, la), _view(xb, lb)
    assert coopmat.choice_for(rt, "float16", M, N, Kd).coopmat
    close(f32(ha @ hb), ref(na, nb), Kd)


def test_batches_bias_and_outputs(rt):
    a, b = rn(3, 1, 40, 64), rn(2, 64, 48)
    close(f32(h16(a) @ h16(b)), ref(a, b), 64)
    x, w, bias = rn(4, 33, 96), rn(96, 80), rn(80)
    close(f32(K.matmul(h16(x), h16(w), h16(bias))), ref(x, w, bias), 96)
    # C stored transposed (a weight gradient's slot), then heads interleaved in rows (CLD)
    a, b = rn(72, 40), rn(40, 56)
    slot = hl.tensor(np.zeros((56, 72), np.float16), dtype="float16")
    K.matmul(h16(a), h16(b), out=slot.transpose(0, 1))
    close(f32(slot).T, ref(a, b), 40)
    q, k = rn(2, 3, 32, 16), rn(2, 3, 16, 24)
    buf = hl.tensor(np.zeros((2, 32, 3 * 24), np.float16), dtype="float16")
    heads = buf.reshape(2, 32, 3, 24).permute(0, 2, 1, 3)
    K.matmul(h16(q), h16(k), out=heads)
    close(f32(buf).reshape(2, 32, 3, 24).transpose(0, 2, 1, 3), ref(q, k), 16)


def test_fused_epilogues_equal_the_unfused_kernels(rt):
    x, w, bias, e = rn(70, 96), rn(96, 136), rn(136), rn(70, 136)
    hx, hw, hb, he = h16(x), h16(w), h16(bias), h16(e)
    plain = K.matmul(hx, hw, hb)
    out, _ = K.matmul_epilogue("linear+residual", hx, hw, hb, he)
    assert np.array_equal(out.numpy(), K.binary("add", plain, he).numpy())
    out, u = K.matmul_epilogue("linear+gelu", hx, hw, hb, None)
    assert np.array_equal(u.numpy(), plain.numpy())
    assert np.array_equal(out.numpy(), K.unary("gelu_tanh", plain).numpy())
    out, _ = K.matmul_epilogue("matmul+gelu_tanh_bwd", hx, hw, None, he)
    assert np.array_equal(out.numpy(), K.binary("gelu_tanh_bwd", he, K.matmul(hx, hw)).numpy())


def test_bias_gradient_in_the_weight_gradient_dispatch(rt):
    # weight gradient x^T g, bias gradient g summed over rows (autograd fuses them for float32 slots only)
    x, g = rn(200, 64), rn(200, 48)
    hx, hg = h16(x), h16(g)
    store = hl.tensor(np.zeros(64 * 48 + 48, np.float16), dtype="float16")
    out, bsum = store[:64 * 48].reshape(64, 48), store[64 * 48:]
    assert K.matmul_bias_grad(hx.transpose(0, 1), hg, out, bsum)
    assert np.array_equal(out.numpy(), K.matmul(hx.transpose(0, 1), hg).numpy())
    sums, _ = K.reduce("sum", hg, (0,))  # float32 sums of the fp16 column, then one rounding to fp16
    assert np.array_equal(bsum.numpy(), K.copy(sums, hl.float16).numpy())


def test_the_shared_memory_kernel_agrees(rt):
    a, b = rn(300, 200), rn(200, 260)
    fast = f32(h16(a) @ h16(b))
    was = coopmat.set_enabled(False)
    try:
        assert not coopmat.choice_for(rt, "float16", 300, 260, 200).coopmat
        plain = f32(h16(a) @ h16(b))
    finally:
        coopmat.set_enabled(was)
    close(fast, plain, 200)
