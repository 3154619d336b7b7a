"""Flash attention (kernels_spirv/glsl/flash_attn.comp) through F.scaled_dot_product_attention:
forward and the three gradients against PyTorch's scaled_dot_product_attention in float64,
the layouts it reads in place, its fallbacks to the dense path, and its memory."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import helios as hl
import helios.nn.functional as F
from helios import _kernels as K
from helios.runtime import get_runtime

sys.path.insert(0, os.path.dirname(__file__))
from switches import count_dispatches  # noqa: E402

pytestmark = pytest.mark.vulkan

RNG = np.random.default_rng(1234)


def _ref(q, k, v, g, **kw):
    """PyTorch's attention in float64 on the same values: (O, dQ, dK, dV)."""
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw)
    o.backward(torch.tensor(g, dtype=torch.float64))
    return [o.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]


def _helios(q, k, v, g, dtype=hl.float32, flash=True, **kw):
    """(O, dQ, dK, dV) from Helios as float64 arrays; checks which path ran."""
    hq, hk, hv = (hl.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    o = F.scaled_dot_product_attention(hq, hk, hv, **kw)
    assert o.dtype is dtype
    ran_flash = o._node is not None and any(n.name == "_FlashAttention" for n in _nodes(o))
    assert ran_flash == flash, "flash kernel" if flash else "dense path"
    o.backward(hl.tensor(g, dtype=dtype))
    return [t.float().numpy().astype(np.float64) for t in (o, hq.grad, hk.grad, hv.grad)]


def _nodes(t):
    """The autograd nodes behind ``t``."""
    seen, stack, out = set(), [t._node], []
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(i._node for i in n.inputs if i is not None)
    return out


def _close(got, want, tol, names=("O", "dQ", "dK", "dV")):
    """Each result within ``tol`` of the reference, relative to the reference's largest value
    (at least 1: the operands are O(1), and some gradients are exactly 0, e.g. dQ at T = 1)."""
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1.0)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def _operands(*shape, kv_len=None):
    q = RNG.standard_normal(shape).astype(np.float32)
    kv = shape[:-2] + (kv_len or shape[-2], shape[-1])
    k, v = (RNG.standard_normal(kv).astype(np.float32) for _ in range(2))
    return q, k, v, RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 7, 64, 129, 300])
def test_flash_matches_torch(T, D, causal):
    q, k, v, g = _operands(2, 2, T, D)
    kw = dict(is_causal=causal, scale=0.7 / np.sqrt(D))
    _close(_helios(q, k, v, g, **kw), _ref(q, k, v, g, **kw), 1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,D", [(7, 32), (129, 128), (70, 64)])
def test_shared_memory_kernel_matches_torch(monkeypatch, T, D, causal):
    # The GPU kernel (one invocation per row, tiles in shared memory) runs on any device:
    # forced here so a CPU-only machine checks it too.
    monkeypatch.setattr(K.flash, "_FA_KERNEL", "gpu")
    q, k, v, g = _operands(2, 2, T, D)
    kw = dict(is_causal=causal, scale=0.3)
    _close(_helios(q, k, v, g, **kw), _ref(q, k, v, g, **kw), 1e-5)


def test_subgroup_kernel_refused_on_wider_subgroups(monkeypatch):
    # The subgroup kernel owns one row per lane of an 8-lane subgroup: forced onto a device with
    # 32-lane subgroups (an NVIDIA GPU) it computed garbage; it is refused there instead.
    from helios.runtime import get_runtime
    rt = get_runtime()
    limits = dict(rt.info["limits"], subgroup_size=32)
    monkeypatch.setitem(rt.info, "limits", limits)
    monkeypatch.setattr(K.flash, "_FA_KERNEL", "cpu")
    q, k, v, _ = _operands(1, 1, 8, 32)
    with pytest.raises(RuntimeError, match="8-lane subgroups"):
        F.scaled_dot_product_attention(hl.tensor(q), hl.tensor(k), hl.tensor(v))
    monkeypatch.setattr(K.flash, "_FA_KERNEL", None)  # left to choose, it takes the shared-memory kernel
    assert not K._fa_cpu(rt)


@pytest.mark.parametrize("kernel", [None, "gpu"])
@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_flash_16bit_storage(monkeypatch, kernel, dtype, tol):
    # 16-bit operands are stored as 16 bits and computed in fp32: the error is the rounding of
    # the result to 16 bits (half an ulp: 4.9e-4 for float16, 3.9e-3 for bfloat16), with margin.
    monkeypatch.setattr(K.flash, "_FA_KERNEL", kernel)
    tdt = getattr(torch, dtype)
    q, k, v, g = (torch.tensor(x).to(tdt).double().numpy() for x in _operands(2, 2, 37, 64))
    _close(_helios(q, k, v, g, dtype=getattr(hl, dtype), is_causal=True), _ref(q, k, v, g, is_causal=True), tol)


def flash_bwd_both_ways(q, k, v, g, dtype, scale, causal, block_mask=None, pad=4):
    """The flash backward of numpy operands (exact in ``dtype``) twice: as training runs it, the
    dQ pass computing D = rowsum(dO * O) itself, and with a gradient of L of zeros, which makes it
    run the preprocess pass (D - 0 = D) first.  O is token-major (strided) and dO starts ``pad``
    elements into its buffer.  ((dQ, dK, dV) as float64 arrays, dispatch names) of each."""
    hq, hk, hv = (hl.tensor(x, dtype=dtype) for x in (q, k, v))
    go = hl.tensor(np.concatenate([np.zeros(pad), g.ravel()]), dtype=dtype)[pad:].reshape(*g.shape)
    o, lse = K.flash_attn_fwd(hq, hk, hv, scale, causal, block_mask=block_mask, token_major=True)
    runs = []
    for dlse in (None, hl.zeros(lse.shape)):
        with count_dispatches() as names:
            grads = K.flash_attn_bwd(hq, hk, hv, o, lse, go, scale, causal, block_mask=block_mask, dlse=dlse)
            hl.synchronize()
        runs.append(([t.float().numpy().astype(np.float64) for t in grads], set(names)))
    return runs


@pytest.mark.parametrize("kernel, dtype, causal, masked", [
    ("cpu", "float32", True, False), ("cpu", "bfloat16", False, True),
    ("gpu", "float32", False, True), ("gpu", "float16", True, False),
])
def test_flash_dq_pass_computes_d_as_the_preprocess_pass_does(monkeypatch, kernel, dtype, causal, masked):
    # One dispatch fewer a backward, and the same bits: the dQ pass sums dO * O over the head dim
    # in the preprocess pass's order.  150 query rows: the last row group is partial.
    if kernel == "cpu" and not K.fa_subgroup_kernel_runs_on(get_runtime()):
        pytest.skip("the subgroup kernel needs 8-lane subgroups")
    monkeypatch.setattr(K.flash, "_FA_KERNEL", kernel)
    tdt = getattr(torch, dtype)
    q, k, v, g = (torch.tensor(x).to(tdt).float().numpy() for x in _operands(2, 2, 150, 32, kv_len=130))
    bm = None
    if masked:
        allow = RNG.random((3, 3)) < 0.6
        allow[:, 0] = True
        bm = K.FlashBlockMask(allow, 64, 150, 130, causal)
    (fused, fused_names), (pre, pre_names) = flash_bwd_both_ways(q, k, v, g, dtype, 0.2, causal, bm)
    for a, b in zip(fused, pre):
        np.testing.assert_array_equal(a, b)
    assert "flash_attn_bwd_pre" in pre_names and "flash_attn_bwd_pre" not in fused_names
    assert len(fused_names) == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_gpu_preprocess_wide_and_scalar_loads_agree(monkeypatch, dtype):
    # The GPU kernel's preprocess pass (D = rowsum(dO * O)) reads 16 bytes a load where O's and
    # dO's rows start 8-aligned, and one value a load otherwise, summing in the same order: a
    # gradient handed in 4 elements into its buffer takes the scalar loads and must give the same
    # bits, and both the reference's values.
    # (The preprocess pass runs where the backward has a gradient of L; flash_bwd_both_ways' second run.)
    monkeypatch.setattr(K.flash, "_FA_KERNEL", "gpu")
    tdt = getattr(torch, dtype)
    q, k, v, g = (torch.tensor(x).to(tdt).double().numpy() for x in _operands(2, 2, 37, 64))
    wide, scalar = (flash_bwd_both_ways(q, k, v, g, dtype, 64 ** -0.5, True, pad=pad)[1][0] for pad in (0, 4))
    for a, b in zip(wide, scalar):
        np.testing.assert_array_equal(a, b)
    _close(wide, _ref(q, k, v, g, is_causal=True)[1:], 2e-5 if dtype == "float32" else 1.6e-2, names=("dQ", "dK", "dV"))


@pytest.mark.parametrize("dtype,D,pad,tol", [("bfloat16", 32, 0, 1.6e-2), ("float16", 64, 4, 2e-3)])
def test_flash_16bit_texel_reads(dtype, D, pad, tol):
    # The CPU kernel reads 16-bit Q, K, V and dO 8 values a texel: head dim 32 takes each lane's
    # 4 columns from one half of a texel or the other, and rows `pad` elements into a wider
    # array (a row stride and offset 4-aligned, not 8-aligned) take 4-value loads throughout.
    tdt, hdt = getattr(torch, dtype), getattr(hl, dtype)
    q, k, v, g = (torch.tensor(x).to(tdt).double().numpy() for x in _operands(1, 2, 45, D + pad))
    hq, hk, hv = (hl.tensor(x, dtype=hdt, requires_grad=True) for x in (q, k, v))
    o = F.scaled_dot_product_attention(hq[..., pad:], hk[..., pad:], hv[..., pad:], is_causal=True)
    assert any(n.name == "_FlashAttention" for n in _nodes(o))
    o.backward(hl.tensor(g[..., pad:], dtype=hdt))
    got = [t.float().numpy().astype(np.float64) for t in (o, hq.grad[..., pad:], hk.grad[..., pad:], hv.grad[..., pad:])]
    _close(got, _ref(q[..., pad:], k[..., pad:], v[..., pad:], g[..., pad:], is_causal=True), tol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq,Tk", [(5, 70), (70, 5), (64, 200)])
def test_flash_cross_attention_lengths(Tq, Tk, causal):
    # L != S: the causal mask is top-left aligned (query i sees keys j <= i), as PyTorch's.
    q, k, v, g = _operands(1, 3, Tq, 64, kv_len=Tk)
    _close(_helios(q, k, v, g, is_causal=causal), _ref(q, k, v, g, is_causal=causal), 1e-5)


def test_flash_reads_fused_qkv_heads_in_place():
    # q, k, v as split_heads' strided views of one [B, T, 3C] projection (the GPT's layout):
    # read in place, and the gradient reaches the fused tensor.
    B, T, H, D = 2, 45, 2, 64
    x = RNG.standard_normal((B, T, 3 * H * D)).astype(np.float32)
    g = RNG.standard_normal((B, H, T, D)).astype(np.float32)
    hx = hl.tensor(x, requires_grad=True)
    hq, hk, hv = F.split_heads(hx, H)
    assert not hq.is_contiguous()
    o = F.scaled_dot_product_attention(hq, hk, hv, is_causal=True)
    assert any(n.name == "_FlashAttention" for n in _nodes(o))
    o.backward(hl.tensor(g))
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tq, tk, tv = (t.reshape(B, T, H, D).transpose(1, 2) for t in tx.split(H * D, dim=2))
    to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    to.backward(torch.tensor(g, dtype=torch.float64))
    _close([o.numpy(), hx.grad.numpy()], [to.detach().numpy(), tx.grad.numpy()], 1e-5, ("O", "dX"))


def gpt_attention(x, H: int, g, dtype, through_copies: bool = False, attend=None):
    """The GPT's attention on a [B, T, 3C] projection ``x``: split_heads' views, causal flash
    (or ``attend(q, k, v)``), the heads merged into [B, T, C] for the output projection,
    backward from ``g``.  ``(y, dX, dispatches by name)``; ``through_copies``: with contiguous
    copies of q, k, v and O (the layouts the kernels read and wrote before they took any), for
    the same bits."""
    hx = hl.tensor(x, dtype=dtype, requires_grad=True)
    B, T, C3 = x.shape
    with count_dispatches() as names:
        q, k, v = F.split_heads(hx, H)
        if through_copies:
            q, k, v = (t.contiguous() for t in (q, k, v))
        o = attend(q, k, v) if attend else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = (o.contiguous() if through_copies else o).transpose(1, 2).reshape(B, T, C3 // 3)
        y.backward(hl.tensor(g, dtype=dtype))
        hl.synchronize()
    return y.float().numpy(), hx.grad.float().numpy(), names


@pytest.mark.parametrize("kernel,dtype", [(None, "float32"), (None, "bfloat16"), ("gpu", "float32"), ("gpu", "float16")])
def test_a_gpt_attention_makes_no_layout_copies(monkeypatch, kernel, dtype):
    # O is stored token-major, so merging the heads is a view; backward reads O's gradient where
    # the merge leaves it and writes dQ, dK, dV into the fused projection's gradient (split_heads'
    # buffer): no copy kernel either way, and the bits of the contiguous layouts.
    monkeypatch.setattr(K.flash, "_FA_KERNEL", kernel)
    B, T, H, D = 2, 45, 2, 64
    x = RNG.standard_normal((B, T, 3 * H * D)).astype(np.float32)
    g = RNG.standard_normal((B, T, H * D)).astype(np.float32)
    y, dx, names = gpt_attention(x, H, g, getattr(hl, dtype))
    assert {"flash_attn", "flash_attn_bwd_dq", "flash_attn_bwd_dkv"} <= set(names)
    assert not any("copy" in n for n in names), names
    y0, dx0, names0 = gpt_attention(x, H, g, getattr(hl, dtype), through_copies=True)
    assert sum(n.startswith("copy") for n in names0.elements()) >= 5  # the test's copies do run there
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)


def test_flash_broadcast_and_leading_dims():
    # K and V shared by every head (a broadcast batch dim, read with stride 0), 3-D inputs
    # without a batch dim, and 5-D inputs whose leading dims are merged.
    q, _, _, g = _operands(2, 4, 33, 32)
    k, v = (RNG.standard_normal((2, 1, 33, 32)).astype(np.float32) for _ in range(2))
    got = _helios(q, k, v, g, is_causal=True)
    want = _ref(q, np.broadcast_to(k, q.shape), np.broadcast_to(v, q.shape), g, is_causal=True)
    want[2], want[3] = want[2].sum(1, keepdims=True), want[3].sum(1, keepdims=True)
    _close(got, want, 1e-5)
    for shape in ((3, 19, 64), (2, 2, 2, 19, 64)):
        q, k, v, g = _operands(*shape)
        _close(_helios(q, k, v, g), _ref(q, k, v, g), 1e-5)


def gqa_attention(q, k, v, g, causal: bool):
    """scaled_dot_product_attention with ``enable_gqa`` on float32 arrays, forward and backward
    (upstream gradient ``g``): ([O, dQ, dK, dV] as float64 arrays, the kernels dispatched by name)."""
    hq, hk, hv = (hl.tensor(x, requires_grad=True) for x in (q, k, v))
    hg = hl.tensor(g)
    with count_dispatches() as names:
        o = F.scaled_dot_product_attention(hq, hk, hv, is_causal=causal, enable_gqa=True)
        o.backward(hg)
    return [t.numpy().astype(np.float64) for t in (o, hq.grad, hk.grad, hv.grad)], dict(names)


# (H, Hk, T, D, causal).  On lavapipe the shared-memory kernel (a GPU's) is right only while one
# invocation's loops stay under the CPU driver's 65,535 iterations (see _fa_cpu_loops): its
# dK / dV pass streams every query tile of the G heads, so G x T stays small at head dim 128.
GQA_CASES = [(4, 2, 40, 64, True), (6, 2, 70, 32, False), (8, 2, 19, 128, True), (4, 1, 33, 32, True)]


@pytest.mark.parametrize("kernel", [None, "gpu"], ids=["default", "shared-memory"])
@pytest.mark.parametrize("H, Hk, T, D, causal", GQA_CASES)
def test_flash_gqa_reads_the_shared_heads_in_place(monkeypatch, kernel, H, Hk, T, D, causal):
    """enable_gqa: query head h reads K/V head h // (H / Hk) where it lies, and the dK / dV pass sums
    each group's gradients in the kernel: PyTorch's values, three dispatches and no copy or
    reduction, and O and dQ the bits of K and V repeated by hand (the same arithmetic a query head)."""
    monkeypatch.setattr(K.flash, "_FA_KERNEL", kernel)
    q, _, _, g = _operands(2, H, T, D)
    k, v = (RNG.standard_normal((2, Hk, T, D)).astype(np.float32) for _ in range(2))
    got, names = gqa_attention(q, k, v, g, causal)
    assert names == {"flash_attn": 1, "flash_attn_bwd_dq": 1, "flash_attn_bwd_dkv": 1}, names
    _close(got, _ref(q, k, v, g, is_causal=causal, enable_gqa=True), 1e-5)
    G = H // Hk
    rep = _helios(q, np.repeat(k, G, 1), np.repeat(v, G, 1), g, is_causal=causal)
    np.testing.assert_array_equal(got[0], rep[0])
    np.testing.assert_array_equal(got[1], rep[1])
    for a, b in zip(got[2:], rep[2:]):  # the group's sums: one rounding each, in another order
        _close([a], [b.reshape(2, Hk, G, T, D).sum(2)], 1e-6, ("dK or dV",))


def test_flash_gqa_partial_gradients():
    # only q needs a gradient: the dK/dV pass is skipped and k, v get none
    q, _, _, g = _operands(1, 4, 40, 64)
    k, v = (RNG.standard_normal((1, 2, 40, 64)).astype(np.float32) for _ in range(2))
    hq = hl.tensor(q, requires_grad=True)
    with count_dispatches() as names:
        F.scaled_dot_product_attention(hq, hl.tensor(k), hl.tensor(v), enable_gqa=True).backward(hl.tensor(g))
    assert "flash_attn_bwd_dkv" not in names and names["flash_attn_bwd_dq"] == 1, names
    _close([hq.grad.numpy()], [_ref(q, k, v, g, enable_gqa=True)[1]], 1e-5, ("dQ",))


def test_flash_cpu_kernel_refuses_what_the_cpu_driver_would_cut_short():
    # lavapipe ends an invocation's loops after 65,535 iterations without an error (measured: a
    # dK / dV pass over 8 x 12,000 query rows at head dim 128 came out wrong); such a pass is refused
    if not K.flash._fa_cpu(get_runtime()):
        pytest.skip("the subgroup kernel does not run on this device")
    rng = np.random.default_rng(0)
    q, g = (hl.tensor(rng.standard_normal((1, 8, 12000, 128)).astype(np.float32)) for _ in range(2))
    k, v = (hl.tensor(rng.standard_normal((1, 1, 8, 128)).astype(np.float32)) for _ in range(2))
    o, lse = K.flash_attn_fwd(q, k, v, 0.1, False)  # 8 keys: the forward and dQ passes are short
    with pytest.raises(RuntimeError, match="12000 query rows x 8 query heads a K/V head .* 65,535"):
        K.flash_attn_bwd(q, k, v, o, lse, g, 0.1, False)
    assert K.flash._fa_cpu_loops(K.flash._FA_DKV, 128, 1, 12000, 8) < K.flash._FA_CPU_LOOP_CAP  # one head: runs


def test_flash_backward_is_deterministic():
    q, k, v, g = _operands(1, 2, 150, 64)
    first = _helios(q, k, v, g, is_causal=True)
    for a, b in zip(first, _helios(q, k, v, g, is_causal=True)):
        np.testing.assert_array_equal(a, b)


def test_dense_fallbacks():
    # masks, dropout, head dims without a kernel variant and mixed dtypes take the dense path
    q, k, v, g = _operands(2, 2, 9, 64)
    mask = RNG.random((9, 9)) > 0.3
    np.fill_diagonal(mask, True)
    got = _helios(q, k, v, g, flash=False, attn_mask=hl.tensor(mask))
    _close(got, _ref(q, k, v, g, attn_mask=torch.tensor(mask)), 1e-5)
    bias = RNG.standard_normal((9, 9)).astype(np.float32)
    _close(_helios(q, k, v, g, flash=False, attn_mask=hl.tensor(bias)),
           _ref(q, k, v, g, attn_mask=torch.tensor(bias, dtype=torch.float64)), 1e-5)
    q16, k16, v16, g16 = _operands(2, 2, 9, 16)
    _close(_helios(q16, k16, v16, g16, flash=False, is_causal=True), _ref(q16, k16, v16, g16, is_causal=True), 1e-5)
    o = F.scaled_dot_product_attention(hl.tensor(q, requires_grad=True), hl.tensor(k), hl.tensor(v), dropout_p=0.5)
    assert o.shape == q.shape and not any(n.name == "_FlashAttention" for n in _nodes(o))
    o = F.scaled_dot_product_attention(hl.tensor(q, dtype=hl.float16), hl.tensor(k), hl.tensor(v))
    assert o.dtype is hl.float16 and o._node is None


_MEMORY_SCRIPT = r"""
import json, numpy as np, helios as hl, helios.nn.functional as F, helios.functional as HF
from helios.runtime import get_runtime

pool = get_runtime()
rng = np.random.default_rng(0)
out = {}

def measure(name, T, fn):
    q, k, v, g = (hl.tensor(rng.standard_normal((1, 2, T, 64)).astype(np.float32), requires_grad=True) for _ in range(4))
    hl.synchronize()
    st = pool.pool_stats()["activations"]
    base = st["in_use_bytes"]
    out[name + "_prior_peak"] = st["peak_in_use_bytes"] - base  # must be below what is measured
    o = fn(q, k, v)
    o.backward(g.detach())
    q.grad.numpy()
    out[name] = pool.pool_stats()["activations"]["peak_in_use_bytes"] - base

flash = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
dense = lambda q, k, v: HF.matmul(HF.attention_softmax(HF.matmul(q, k.mT), 0.125, causal=True), v)
measure("flash_1024", 1024, flash)
measure("flash_2048", 2048, flash)
measure("dense_2048", 2048, dense)
print(json.dumps(out))
"""


def test_flash_memory_is_linear_in_T():
    # Peak device memory above the inputs over a causal forward + backward with 2 heads of
    # 64, in a fresh process (the pool's peak only grows): the dense path holds [2, T, T]
    # score and probability matrices (16 MiB per head at T = 2048), the flash kernel none.
    r = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    T = 2048
    score_bytes = T * T * 4  # one head's T x T float32 matrix
    assert m["dense_2048"] > 2 * score_bytes, m  # the measurement sees T x T buffers when they exist
    assert m["flash_2048"] < score_bytes / 2, m
    assert m["flash_1024"] < m["flash_2048"] < 2.5 * m["flash_1024"], m  # doubles with T, not x4
    for name in ("flash_1024", "flash_2048", "dense_2048"):
        assert m[name + "_prior_peak"] < m[name], m
