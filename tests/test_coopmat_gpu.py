"""The cooperative-matrix matmul (kernels_spirv/glsl/matmul_coop.comp) against PyTorch: every layout
(nn, nt, tn, tt), ragged shapes, offset views, broadcast batches, bias, transposed and
head-interleaved outputs; the fused epilogues and the bias gradient bit for bit against the
unfused kernels; the shared-memory kernel (switched to with coopmat.set_enabled) close to it.

float16 and bfloat16 operands alike (the bfloat16 ones where the device lists a bf16 shape).

On a GPU that lists cooperative matrices the real kernel runs (./scripts/gpu_check.sh . coopmat).
On lavapipe, which lists none, the same tests run its f16_emu and bf16_emu variants through
helios.matmul: the device's facts are made to list a 16x16x16 f16*f16+f32 and a bf16*bf16+f32
shape and to say "discrete" (past the CPU-driver kernel), and matmul_coop's pipelines are built
from the _emu variants, where plain code does the three cooperative-matrix operations; everything
else in the kernel and its dispatch is what a GPU runs.  Other devices skip."""

import os
import sys

import numpy as np
import pytest
import torch

import helios as hl
from helios import _kernels as K
from helios._kernels import coopmat
from helios.comm.reduce_ops import bf16_to_f32, f32_to_bf16

sys.path.insert(0, os.path.dirname(__file__))
from switches import coopmat_device  # noqa: E402

pytestmark = pytest.mark.vulkan
R = np.random.default_rng(37)


DTYPES = ("float16", "bfloat16")


@pytest.fixture(scope="module")
def rt():
    with coopmat_device(lambda r: coopmat.choice_for(r, "float16", 256, 256, 256)) as r:
        yield r


def rn(*shape, dtype="float16"):
    """Uniform values in [-1, 1) that ``dtype`` holds exactly (float16 or float32 arrays)."""
    x = R.uniform(-1.0, 1.0, size=shape).astype(np.float32)
    return bf16_to_f32(f32_to_bf16(x)) if dtype == "bfloat16" else x.astype(np.float16)


def h16(x, dtype="float16"):
    return hl.tensor(x, dtype=dtype)


def has(rt, dtype):
    """Skip where ``rt``'s device lists no shape for ``dtype`` operands."""
    if not coopmat.choice_for(rt, dtype, 256, 256, 256).coopmat:
        pytest.skip(f"{rt.name}: no cooperative-matrix kernel for {dtype}: {coopmat.choice_for(rt, dtype, 256, 256, 256).reason}")


def f32(t):
    return np.asarray(t.numpy(), dtype=np.float32)


def ref(a, b, bias=None):
    """PyTorch's product of the fp16 values in fp32 (on the GPU where there is one), as float32."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    r = torch.matmul(torch.tensor(a, dtype=torch.float32, device=dev), torch.tensor(b, dtype=torch.float32, device=dev))
    if bias is not None:
        r = r + torch.tensor(bias, dtype=torch.float32, device=dev)
    return r.cpu().numpy()


def close(got, want, k, dtype="float16"):
    # fp32 sums in another order, then one 16-bit rounding: half an ulp of |want| plus the order's share
    half_ulp = 1e-3 if dtype == "float16" else 4e-3
    np.testing.assert_allclose(got, want, rtol=half_ulp, atol=2 * half_ulp * max(1.0, np.sqrt(k) / 4))


def _view(x, kind, dtype="float16"):
    """(numpy operand, helios view) of stored array ``x`` seen as ``kind``: "n" as is, "t" transposed, "off" from its second column."""
    if kind == "n":
        return x, h16(x, dtype)
    if kind == "t":
        return x.T, h16(x, dtype).transpose(0, 1)
    return x[:, 1:], h16(x, dtype)[:, 1:]


# bfloat16 runs the same staging code with other elements: the vector-load shape and a ragged one
_CASES = [(dtype, *mnk) for dtype in DTYPES for mnk in [(192, 320, 256), (77, 91, 45), (136, 200, 72), (16, 1000, 24)]
          if dtype == "float16" or mnk[0] in (192, 77)]


@pytest.mark.parametrize("dtype,M,N,Kd", _CASES)
@pytest.mark.parametrize("la,lb", [("n", "n"), ("n", "t"), ("t", "n"), ("t", "t"), ("off", "off")])
def test_layouts_and_ragged_shapes_against_torch(rt, dtype, M, N, Kd, la, lb):
    has(rt, dtype)
    xa = rn(M, Kd, dtype=dtype) if la == "n" else rn(Kd, M, dtype=dtype) if la == "t" else rn(M, Kd + 1, dtype=dtype)
    xb = rn(Kd, N, dtype=dtype) if lb == "n" else rn(N, Kd, dtype=dtype) if lb == "t" else rn(Kd, N + 1, dtype=dtype)
    (na, ha), (nb, hb) = _view(xa, la, dtype), _view(xb, lb, dtype)
    assert coopmat.choice_for(rt, dtype, M, N, Kd).coopmat
    close(f32(ha @ hb), ref(na, nb), Kd, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batches_bias_and_outputs(rt, dtype):
    has(rt, dtype)
    a, b = rn(3, 1, 40, 64, dtype=dtype), rn(2, 64, 48, dtype=dtype)
    close(f32(h16(a, dtype) @ h16(b, dtype)), ref(a, b), 64, dtype)
    x, w, bias = rn(4, 33, 96, dtype=dtype), rn(96, 80, dtype=dtype), rn(80, dtype=dtype)
    close(f32(K.matmul(h16(x, dtype), h16(w, dtype), h16(bias, dtype))), ref(x, w, bias), 96, dtype)
    # C stored transposed (a weight gradient's slot), then heads interleaved in rows (CLD)
    a, b = rn(72, 40, dtype=dtype), rn(40, 56, dtype=dtype)
    slot = hl.tensor(np.zeros((56, 72), np.float32), dtype=dtype)
    K.matmul(h16(a, dtype), h16(b, dtype), out=slot.transpose(0, 1))
    close(f32(slot).T, ref(a, b), 40, dtype)
    q, k = rn(2, 3, 32, 16, dtype=dtype), rn(2, 3, 16, 24, dtype=dtype)
    buf = hl.tensor(np.zeros((2, 32, 3 * 24), np.float32), dtype=dtype)
    heads = buf.reshape(2, 32, 3, 24).permute(0, 2, 1, 3)
    K.matmul(h16(q, dtype), h16(k, dtype), out=heads)
    close(f32(buf).reshape(2, 32, 3, 24).transpose(0, 2, 1, 3), ref(q, k), 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_epilogues_equal_the_unfused_kernels(rt, dtype):
    has(rt, dtype)
    x, w, bias, e = (rn(*s, dtype=dtype) for s in ((70, 96), (96, 136), (136,), (70, 136)))
    hx, hw, hb, he = (h16(t, dtype) for t in (x, w, bias, e))
    plain = K.matmul(hx, hw, hb)
    out, _ = K.matmul_epilogue("linear+residual", hx, hw, hb, he)
    assert np.array_equal(out.numpy(), K.binary("add", plain, he).numpy())
    out, u = K.matmul_epilogue("linear+gelu", hx, hw, hb, None)
    assert np.array_equal(u.numpy(), plain.numpy())
    assert np.array_equal(out.numpy(), K.unary("gelu_tanh", plain).numpy())
    out, _ = K.matmul_epilogue("matmul+gelu_tanh_bwd", hx, hw, None, he)
    assert np.array_equal(out.numpy(), K.binary("gelu_tanh_bwd", he, K.matmul(hx, hw)).numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gradient_in_the_weight_gradient_dispatch(rt, dtype):
    has(rt, dtype)
    # weight gradient x^T g, bias gradient g summed over rows (autograd fuses them for float32 slots only)
    x, g = rn(200, 64, dtype=dtype), rn(200, 48, dtype=dtype)
    hx, hg = h16(x, dtype), h16(g, dtype)
    sums, _ = K.reduce("sum", hg, (0,))  # float32 sums of the 16-bit column, then one rounding to 16 bits
    # the bias slot after the weight's in one buffer, and in a buffer of its own (AdamW's no-decay group)
    store = hl.tensor(np.zeros(64 * 48 + 48, np.float32), dtype=dtype)
    for out, bsum in ((store[:64 * 48].reshape(64, 48), store[64 * 48:]),
                      (hl.tensor(np.zeros((64, 48), np.float32), dtype=dtype), hl.tensor(np.zeros(48, np.float32), dtype=dtype))):
        assert K.matmul_bias_grad(hx.transpose(0, 1), hg, out, bsum)
        assert np.array_equal(out.numpy(), K.matmul(hx.transpose(0, 1), hg).numpy())
        assert np.array_equal(f32(bsum), f32(K.copy(sums, hg.dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_shared_memory_kernel_agrees(rt, dtype):
    has(rt, dtype)
    a, b = rn(300, 200, dtype=dtype), rn(200, 260, dtype=dtype)
    fast = f32(h16(a, dtype) @ h16(b, dtype))
    was = coopmat.set_enabled(False)
    try:
        assert not coopmat.choice_for(rt, dtype, 300, 260, 200).coopmat
        plain = f32(h16(a, dtype) @ h16(b, dtype))
    finally:
        coopmat.set_enabled(was)
    close(fast, plain, 200, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("la,lb", [("n", "n"), ("n", "t"), ("t", "n")])
def test_padded_rows_with_ragged_dims_read_in_runs_and_equal_single_loads_bit_for_bit(rt, dtype, la, lb):
    # Rows 8-aligned apart (a padded stride) with M, N and K not multiples of 8: runs of 8 a
    # load, the run across each edge one element a load (GPT-2's 50,257-token head, padded).
    # The staged tiles, so the products, are those of contiguous copies (rows 45 apart: one
    # element a load everywhere).
    has(rt, dtype)
    M, N, Kd = 77, 91, 45

    def padded(rows, cols, transposed):
        wide = -(-(rows if transposed else cols) // 8) * 8  # rows padded to a multiple of 8
        store = rn(cols, wide, dtype=dtype) if transposed else rn(rows, wide, dtype=dtype)
        store[:, (rows if transposed else cols):] = np.nan  # read past an edge, a NaN would show
        t = h16(store, dtype)[:, :rows].transpose(0, 1) if transposed else h16(store, dtype)[:, :cols]
        return t, store[:, :rows].T if transposed else store[:, :cols]

    (ha, na), (hb, nb) = padded(M, Kd, la == "t"), padded(Kd, N, lb == "t")
    modes = coopmat.load_modes(M, N, Kd, (0, 0), ha._strides, hb._strides)
    assert modes == ({"n": 1, "t": 2}[la], {"n": 2, "t": 1}[lb]), modes
    assert coopmat.load_modes(M, N, Kd, (0, 0), (Kd, 1), (N, 1)) == (0, 0)  # the copies'
    got = f32(ha @ hb)
    want = f32(h16(np.ascontiguousarray(na), dtype) @ h16(np.ascontiguousarray(nb), dtype))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    close(got, ref(na.astype(np.float32), nb.astype(np.float32)), Kd, dtype)
    # a float32 A rounded as it is loaded (autocast's mixed storage), its edge run too
    a32_store = R.standard_normal((M, 48)).astype(np.float32)
    a32_store[:, Kd:] = np.nan
    a32 = hl.tensor(a32_store)[:, :Kd]
    mixed = f32(K.matmul(a32, hb, compute=hb.dtype))
    assert np.array_equal(mixed.view(np.uint32), f32(K.copy(a32, hb.dtype) @ hb).view(np.uint32))


def test_an_odd_vocabulary_head_reads_its_padded_logit_gradient_in_runs(rt, monkeypatch):
    # GPT-2's 50,257 tokens in small: 61.  On a GPU the logits' gradient rows are 64 apart, so
    # the head's two backward products read them in 16-byte runs, not one element at a time:
    # the same gradients, bit for bit, no copy more.
    from helios._kernels import rows
    from helios.nn import GPT, GPTConfig
    from switches import count_dispatches

    has(rt, "bfloat16")
    V = 61
    idx, tgt = (hl.tensor(R.integers(0, V, (2, 32))) for _ in range(2))
    modes = []
    load_modes = coopmat.load_modes
    monkeypatch.setattr(coopmat, "load_modes", lambda M, N, Kd, *a: modes.append((M, N, Kd, load_modes(M, N, Kd, *a))) or modes[-1][3])

    def step():
        model = GPT(GPTConfig(vocab_size=V, block_size=32, n_layer=1, n_head=2, n_embd=64), seed=0)
        modes.clear()
        with count_dispatches() as names:
            with hl.autocast("bfloat16"):
                _, loss = model(idx, tgt)
            loss.backward()
        head = [m for m in modes if V in m[:3]]
        return [p.grad.float().numpy() for p in model.parameters()], names, head

    grads, names, head = step()
    assert rows.padded_row(rt, V) == 64
    assert sorted(h[3] for h in head) == [(1, 1), (1, 2), (2, 2)], head  # forward, dX, dW: all in runs
    monkeypatch.setattr(rows, "padded_row", lambda rt, V: V)  # rows 61 apart: one element a load
    grads_plain, names_plain, head_plain = step()
    assert sorted(h[3] for h in head_plain) == [(0, 2), (0, 2), (1, 1)], head_plain
    for a, b in zip(grads, grads_plain):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert names == names_plain
