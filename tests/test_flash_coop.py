"""Flash attention on cooperative matrices (kernels_spirv/glsl/flash_coop.comp): the forward, dQ and
dK/dV passes against float64 attention (causal or not, Tq != Tk, rows and keys that do not fill a
tile, every head dim, strided views read 8 or 4 halves a load, block masks), bit-identical reruns,
the trace naming the kernel, scaled_dot_product_attention's backward through it, and the choice of
kernel and plan (coopmat.choose_flash) for devices described by their facts; float16 operands, and
bfloat16 ones where the device lists a bf16 shape.

On a GPU that lists a 16x16x16 f16*f16+f32 shape the real kernel runs (./scripts/gpu_check.sh . coopmat).
On lavapipe, which lists none, the device's facts are made to list it and its bf16 twin and to say
"discrete" (past the CPU kernels), and flash_coop's pipelines are built from its f16_emu and
bf16_emu variants, where plain code
does the cooperative-matrix operations; staging, softmax, masks, the lanes' sums and the stores are
the code a GPU runs.  Other devices skip."""

import os
import sys

import numpy as np
import pytest

import helios as hl
import helios.nn.functional as F
from helios import _kernels as K
from helios._kernels import coopmat
from helios.comm.reduce_ops import bf16_to_f32, f32_to_bf16
from helios.profile import profile

sys.path.insert(0, os.path.dirname(__file__))
from switches import coopmat_device  # noqa: E402
from test_attention import flash_bwd_both_ways, gpt_attention  # noqa: E402

R = np.random.default_rng(33)
SHAPE = dict(m=16, n=16, k=16, a="f16", b="f16", c="f32", result="f32", scope="subgroup", saturating=False)


def _nv(m=16, n=16, k=16):
    return [coopmat.CoopShape(m, n, k, "f16", "f16", "f32", "f32", "subgroup")]


# -- the choice (pure: no device) --------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_every_pass_gets_the_largest_plan_that_fits(head_dim):
    ch = coopmat.choose_flash(_nv(), "float16", head_dim, 32, 49152)
    assert ch.coopmat and ch.kernel == "flash_coop", ch.reason
    for mode in (0, 2, 3):
        plan = ch.plan(mode)
        assert coopmat.flash_shared_bytes(head_dim, mode, plan.nsg, plan.bt) <= 49152
        # no earlier (larger) plan fits
        earlier = coopmat._FLASH_PLANS[:coopmat._FLASH_PLANS.index((plan.nsg, plan.bt))]
        assert all(coopmat.flash_shared_bytes(head_dim, mode, n, bt) > 49152 for n, bt in earlier)
        assert 64 % plan.rows == 0 and 64 % plan.bt == 0  # block masks: tiles never straddle a block
        assert plan.spec(True) == (plan.nsg * 32, mode, plan.bt, plan.nsg, 1)
    # the forward holds one fixed operand, the backward passes two: more room for the forward
    assert ch.plan(0).rows * ch.plan(0).bt >= ch.plan(2).rows * ch.plan(2).bt


@pytest.mark.parametrize("shapes, dtype, head_dim, sg, shared, why", [
    ([], "float16", 64, 32, 49152, "lists no cooperative-matrix shapes"),
    (_nv(), "bfloat16", 64, 32, 49152, "no subgroup-scope 16x16x16 bf16*bf16+f32 shape"),
    (_nv(), "float32", 64, 32, 49152, "float32 operands"),
    (_nv(), "float32", 64, 32, 49152, "float32 operands"),
    (_nv(), "float16", 80, 32, 49152, "head dim 80"),
    (_nv(16, 8, 16), "float16", 64, 32, 49152, "no subgroup-scope 16x16x16"),
    (_nv(), "float16", 64, 48, 49152, "subgroups of 48 lanes"),
    (_nv(), "float16", 128, 32, 16384, "no plan of pass"),
])
def test_the_choice_says_why_not(shapes, dtype, head_dim, sg, shared, why):
    ch = coopmat.choose_flash(shapes, dtype, head_dim, sg, shared)
    assert not ch.coopmat and ch.kernel == "flash_attn" and why in ch.reason
    assert why in ch.line("vulkan:0", dtype, head_dim) and "flash_attn (shared-memory kernel)" in ch.line("x", dtype, 1)


def test_unbuilt_kernel_keeps_the_shared_memory_kernel():
    ch = coopmat.choose_flash(_nv(), "float16", 64, 32, 49152, kernel_built=False)
    assert not ch.coopmat and "not built" in ch.reason


# -- the kernel (the emulated variant on lavapipe, the real one on a GPU listing shapes) --------


@pytest.fixture(scope="module")
def rt():
    with coopmat_device(lambda r: coopmat.flash_choice_for(r, "float16", 64)) as r:
        yield r


pytestmark = pytest.mark.vulkan


def _exact(x, dtype):
    """``x`` as values ``dtype`` holds exactly (float16, or float32 ones rounded to bfloat16)."""
    return bf16_to_f32(f32_to_bf16(x.astype(np.float32))) if dtype == "bfloat16" else x.astype(np.float16)


def _operands(B, H, Tq, Tk, D, dtype="float16"):
    return tuple(_exact(R.standard_normal((B, H, T, D)), dtype) for T in (Tq, Tk, Tk, Tq))


def _reference(q, k, v, g, scale, causal, allowed=None):
    """O, L, dQ, dK, dV of softmax(q k^T scale) v in float64; ``allowed`` [Tq, Tk] (True = attends)."""
    q, k, v, g = (x.astype(np.float64) for x in (q, k, v, g))
    s = q @ k.swapaxes(-1, -2) * scale
    Tq, Tk = s.shape[-2:]
    keep = np.ones((Tq, Tk), dtype=bool) if allowed is None else allowed
    if causal:
        keep = keep & (np.arange(Tk)[None, :] <= np.arange(Tq)[:, None])
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    p /= l_
    dp = g @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return p @ v, (m + np.log(l_))[..., 0], ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ g


def _close(got, want, what, dtype="float16"):
    # 16-bit operands and results, P and dS rounded to 16 bits before their products, fp32 sums:
    # bf16 keeps 8 bits of mantissa to fp16's 11.  Element by element, then as a whole (the
    # roundings average out there, a systematic error does not: measured 3e-4 fp16, 2.5e-3 bf16)
    rtol, atol, whole = (1e-2, 2e-3, 1.5e-3) if dtype == "float16" else (4e-2, 1.6e-2, 8e-3)
    got = np.asarray(got, dtype=np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * max(1.0, float(np.abs(want).max())), err_msg=what)
    assert np.linalg.norm(got - want) <= whole * np.linalg.norm(want), what


def _run(q, k, v, g, scale, causal, block_mask=None):
    o, lse = K.flash_attn_fwd(q, k, v, scale, causal, block_mask=block_mask)
    dq, dk, dv = K.flash_attn_bwd(q, k, v, o, lse, g, scale, causal, block_mask=block_mask)
    return [t.numpy() for t in (o, lse, dq, dk, dv)]


def _h(x, dtype="float16"):
    return hl.tensor(x, dtype=dtype)


def _has(rt, dtype):
    """Skip where ``rt``'s device has no flash_coop for ``dtype`` operands."""
    ch = coopmat.flash_choice_for(rt, dtype, 64)
    if not ch.coopmat:
        pytest.skip(f"{rt.name}: flash_coop does not take {dtype}: {ch.reason}")


# On lavapipe the emulated variants are right up to T = 300 at head dim 128 at least, and wrong
# from 500 on (flash_coop.comp, COOP_EMU: lavapipe's loop limit); every size here is far below.
# bfloat16 runs the same code with other elements: every head dim, causal or not, ragged tiles
@pytest.mark.parametrize("dtype, D, causal, Tq, Tk", [
    ("float16", 64, False, 40, 40), ("float16", 64, True, 100, 100), ("float16", 32, True, 70, 53),
    ("float16", 32, False, 17, 90), ("float16", 128, True, 50, 50), ("float16", 128, False, 24, 40),
    ("bfloat16", 64, True, 100, 100), ("bfloat16", 32, False, 17, 90), ("bfloat16", 128, True, 50, 50),
])
def test_passes_match_float64_attention(rt, dtype, D, causal, Tq, Tk):
    _has(rt, dtype)
    q, k, v, g = _operands(2, 2, Tq, Tk, D, dtype)
    scale = D ** -0.5
    with profile() as prof:
        got = _run(*(_h(x, dtype) for x in (q, k, v, g)), scale, causal)
        hl.synchronize()
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), got, _reference(q, k, v, g, scale, causal)):
        _close(a, b, f"{name} {dtype} D={D} causal={causal} Tq={Tq} Tk={Tk}", dtype)
    names = {e.name for e in prof.collector.events if e.name.startswith("flash")}
    assert names == {"flash_coop", "flash_coop_bwd_dq", "flash_coop_bwd_dkv"}  # D computed in the dQ pass


def test_reruns_are_bit_identical_and_close_to_the_shared_memory_kernel(rt):
    q, k, v, g = (_h(x) for x in _operands(1, 3, 90, 90, 64))
    first = _run(q, k, v, g, 0.125, True)
    again = _run(q, k, v, g, 0.125, True)
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()  # no atomics: every sum in a fixed order
    was = coopmat.set_enabled(False)
    try:
        with profile() as prof:
            simt = _run(q, k, v, g, 0.125, True)
            hl.synchronize()
    finally:
        coopmat.set_enabled(was)
    assert {e.name for e in prof.collector.events if e.name.startswith("flash")} == {
        "flash_attn", "flash_attn_bwd_dq", "flash_attn_bwd_dkv"}
    for a, b in zip(first, simt):
        _close(a, b.astype(np.float64), "coopmat vs shared-memory kernel")


@pytest.mark.parametrize("dtype, causal, masked", [("float16", True, False), ("bfloat16", False, True)])
def test_dq_pass_computes_d_as_the_preprocess_pass_does(rt, dtype, causal, masked):
    # The dQ pass's own D = rowsum(dO * O) (no preprocess dispatch) gives the bits of the
    # preprocess pass's (flash_attn.comp's, run here by a gradient of L of zeros); 90 query rows:
    # the last subgroup's rows are partial.
    _has(rt, dtype)
    q, k, v, g = _operands(1, 2, 90, 70, 64, dtype)
    bm = None
    if masked:
        bm = K.FlashBlockMask(np.array([[True, False], [True, True]]), 64, 90, 70, causal)
    (fused, fused_names), (pre, pre_names) = flash_bwd_both_ways(q, k, v, g, dtype, 0.125, causal, bm)
    for a, b in zip(fused, pre):
        np.testing.assert_array_equal(a, b)
    assert fused_names == {"flash_coop_bwd_dq", "flash_coop_bwd_dkv"}
    assert pre_names == fused_names | {"flash_attn_bwd_pre"}


@pytest.mark.parametrize("dtype, pad", [("float16", 0), ("float16", 4), ("bfloat16", 0), ("bfloat16", 4)])
def test_strided_views_are_read_in_place(rt, dtype, pad):
    """Heads of a packed QKV projection (rows 8-aligned: 16-byte loads) and rows padded by 4 halves
    (8-byte loads)."""
    _has(rt, dtype)
    B, T, H, D = 2, 45, 2, 64
    qkv = _exact(R.standard_normal((B, T, 3, H, D + pad)), dtype)
    hq = _h(qkv, dtype)
    views = [F.transpose(hq[:, :, i, :, :D], 1, 2) for i in range(3)]  # [B, H, T, D] with strides
    g = _exact(R.standard_normal((B, H, T, D)), dtype)
    got = _run(*views, _h(g, dtype), 0.125, True)
    want = _reference(*(qkv[:, :, i, :, :D].transpose(0, 2, 1, 3) for i in range(3)), g, 0.125, True)
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), got, want):
        _close(a, b, f"{name} {dtype} pad={pad}", dtype)


def test_block_mask_skips_blocks(rt):
    Tq = Tk = 150
    m = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=bool)
    allowed = np.repeat(np.repeat(m, 64, 0), 64, 1)[:Tq, :Tk]
    q, k, v, g = _operands(1, 2, Tq, Tk, 32)
    bm = K.FlashBlockMask(m, 64, Tq, Tk, False)
    got = _run(*(_h(x) for x in (q, k, v, g)), 0.2, False, block_mask=bm)
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), got, _reference(q, k, v, g, 0.2, False, allowed)):
        _close(a, b, f"{name} block mask")


@pytest.mark.parametrize("dtype, causal", [("float16", True), ("bfloat16", False)])
def test_grouped_query_heads_are_read_in_place(rt, dtype, causal):
    """K/V heads shared by 3 query heads each (grouped-query attention): every pass reads them in
    place and the dK / dV pass sums a group's gradients (3 x 40 query rows: G x T stays within the
    emulated loops' reach, see the top)."""
    _has(rt, dtype)
    q, g = (_exact(R.standard_normal((2, 6, 40, 64)), dtype) for _ in range(2))
    k, v = (_exact(R.standard_normal((2, 2, 45, 64)), dtype) for _ in range(2))
    with profile() as prof:
        got = _run(*(_h(x, dtype) for x in (q, k, v, g)), 0.125, causal)
        hl.synchronize()
    want = list(_reference(q, np.repeat(k, 3, 1), np.repeat(v, 3, 1), g, 0.125, causal))
    want[3:] = [w.reshape(2, 2, 3, 45, 64).sum(2) for w in want[3:]]
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), got, want):
        _close(a, b, f"{name} {dtype} causal={causal}", dtype)
    assert {e.name for e in prof.collector.events if e.name.startswith("flash")} == {
        "flash_coop", "flash_coop_bwd_dq", "flash_coop_bwd_dkv"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sdpa_backward_runs_on_it(rt, dtype):
    """scaled_dot_product_attention of 16-bit tensors with autograd: forward and backward through
    flash_coop, gradients as float64 attention's."""
    _has(rt, dtype)
    q, k, v, g = _operands(1, 2, 64, 64, 64, dtype)
    hq, hk, hv = (hl.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    with profile() as prof:
        o = F.scaled_dot_product_attention(hq, hk, hv, is_causal=True)
        o.backward(_h(g, dtype))
        hl.synchronize()
    assert {"flash_coop", "flash_coop_bwd_dq", "flash_coop_bwd_dkv"} <= {e.name for e in prof.collector.events}
    want = _reference(q, k, v, g, 0.125, True)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), (o, hq.grad, hk.grad, hv.grad), (want[0], *want[2:])):
        _close(a.numpy(), b, f"{name} {dtype}", dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_gpt_attention_makes_no_layout_copies(rt, dtype):
    """test_attention's GPT attention on flash_coop: O stored token-major, dO read and dQ, dK, dV
    written in the fused layouts, no copy kernel, the bits of the contiguous layouts."""
    _has(rt, dtype)
    B, T, H, D = 1, 40, 2, 64
    x = _exact(R.standard_normal((B, T, 3 * H * D)), dtype)
    g = _exact(R.standard_normal((B, T, H * D)), dtype)
    y, dx, names = gpt_attention(x, H, g, getattr(hl, dtype))
    assert {"flash_coop", "flash_coop_bwd_dq", "flash_coop_bwd_dkv"} <= set(names)
    assert not any("copy" in n for n in names), names
    y0, dx0, _ = gpt_attention(x, H, g, getattr(hl, dtype), through_copies=True)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
