"""Tensor-core flash attention (helios.cuda_ptx.gen_flash / tensor_flash): the gate, numerics on the
emulated sm_90 driver against float64 attention, determinism, and the cuda:N device's SDPA taking it.

The emulated driver runs the very PTX ptxas gets (TMA, mbarriers, wgmma with A in registers), so
a wrong parity, a missing wait or a wrong layout shows here without a GPU.  The ``gpu`` cases run
the same checks on a real Hopper GPU when one is present."""

import numpy as np
import pytest

import helios as hl
import helios.nn.functional as F
from helios import _kernels as K
from helios.cuda_ptx import driver, gate, gen_flash, toolchain
from helios.cuda_ptx import tensor_flash as tf
from helios.cuda_ptx.emu.driver import emulated_context

needs_ptxas = pytest.mark.skipif(toolchain.find_tool("ptxas") is None, reason="ptxas is not installed")
needs_sass = pytest.mark.skipif(toolchain.find_tool("cuobjdump") is None and toolchain.find_tool("nvdisasm") is None,
                                reason="neither cuobjdump nor nvdisasm is installed")


@needs_ptxas
@needs_sass
@pytest.mark.parametrize("name", list(gate.flash_gate_configs()))
def test_gate_compiles_every_flash_kernel_clean(name):
    """ptxas for sm_90a: no spills, no serialisation or injected-wait notes, HGMMA for both products,
    4-D TMA loads, setmaxnreg and the SFU's ex2 in the SASS (numerics are checked below)."""
    rep = gate.run_flash_gate(gate.flash_gate_configs()[name], emulate=False)
    assert rep.ok, rep.failures


def _inputs(B, H, Hk, Tq, Tk, D, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Tq, D))
    k, v = rng.standard_normal((B, Hk, Tk, D)), rng.standard_normal((B, Hk, Tk, D))
    return q, k, v, rng.standard_normal((B, H, Tq, D))


def _check(got, q, k, v, do, causal, dtype):
    r = [tf.rounded(x, dtype) for x in (q, k, v, do)]
    want = tf.reference(*r, causal=causal)
    # P and dS are rounded to the 16-bit type before the second products: a few units of its
    # precision relative to the largest value (fp16 has 3 more mantissa bits than bf16)
    rel = 8e-3 if dtype == "bfloat16" else 1.5e-3
    for key in ("o", "dq", "dk", "dv"):
        err = np.abs(got[key] - want[key]).max()
        assert err <= rel * np.abs(want[key]).max(), (key, err, np.abs(want[key]).max())
    np.testing.assert_allclose(got["lse"], want["lse"], rtol=0, atol=1e-5)
    # D = rowsum(dO * O), summed by the dQ pass from the kernel's O (float32 sums of 16-bit products)
    d_want = (r[3] * got["o"]).sum(-1)
    np.testing.assert_allclose(got["delta"], d_want, rtol=0, atol=1e-5 * max(1.0, np.abs(d_want).max()))


# (B, H, Hk, Tq, Tk, D, causal, dtype): tails everywhere (no length is a block multiple), grouped-
# query heads, Tq != Tk both ways, the K/V ring wrapping (3 key blocks through 2 slots), both head
# dims and dtypes.
CASES = [
    (1, 2, 1, 100, 100, 64, True, "bfloat16"),
    (2, 2, 2, 70, 150, 128, False, "float16"),
    (1, 2, 1, 130, 300, 128, True, "bfloat16"),
    (1, 1, 1, 300, 130, 64, False, "float16"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}Hk{c[2]}T{c[3]}S{c[4]}D{c[5]}{'c' if c[6] else ''}-{c[7]}"
                                             for c in CASES])
def test_forward_and_backward_match_float64_on_the_emulator(case):
    B, H, Hk, Tq, Tk, D, causal, dtype = case
    q, k, v, do = _inputs(B, H, Hk, Tq, Tk, D)
    got = tf.attention_numpy(emulated_context(sm_count=4), q, k, v, do, causal=causal, dtype=dtype)
    _check(got, q, k, v, do, causal, dtype)


# (B, H, Hk, Tq, Tk, D, causal, dtype, block size): 64-blocks split the kernels' 128-key blocks (a
# dead half is masked inside a computed block) and need the 32-query dK/dV form at D = 128
SPARSE = [(1, 2, 1, 300, 300, 64, True, "bfloat16", 64), (1, 2, 2, 200, 260, 128, False, "float16", 128),
          (1, 1, 1, 200, 200, 128, True, "bfloat16", 64)]


@pytest.mark.parametrize("case", SPARSE, ids=[f"T{c[3]}S{c[4]}D{c[5]}{'c' if c[6] else ''}-bs{c[8]}" for c in SPARSE])
def test_a_block_mask_skips_blocks_and_matches_the_masked_float64_attention(case):
    B, H, Hk, Tq, Tk, D, causal, dtype, bs = case
    q, k, v, do = _inputs(B, H, Hk, Tq, Tk, D)
    nq, nk = -(-Tq // bs), -(-Tk // bs)
    mask = np.random.default_rng(1).random((nq, nk)) < 0.5
    mask[np.arange(nq), np.minimum(np.arange(nq), nk - 1)] = True  # every row keeps a block it sees
    got = tf.attention_numpy(emulated_context(sm_count=4), q, k, v, do, causal=causal, dtype=dtype, block_mask=mask,
                             block_size=bs)
    r = [tf.rounded(x, dtype) for x in (q, k, v, do)]
    want = tf.reference(*r, causal=causal, block_mask=mask, block_size=bs)
    rel = 8e-3 if dtype == "bfloat16" else 1.5e-3
    for key in ("o", "dq", "dk", "dv"):
        assert np.abs(got[key] - want[key]).max() <= rel * np.abs(want[key]).max(), key


def test_reruns_are_bit_identical_whatever_the_warp_order():
    """No atomics: dQ is summed in one warpgroup's registers and dK, dV likewise, so another warp
    schedule (another emulator seed) and TMA landing order give the same bits."""
    q, k, v, do = _inputs(1, 2, 1, 100, 100, 64, seed=3)
    runs = [tf.attention_numpy(emulated_context(sm_count=2, seed=s), q, k, v, do, causal=True) for s in (1, 2)]
    for key in ("o", "lse", "delta", "dq", "dk", "dv"):
        assert np.array_equal(runs[0][key], runs[1][key]), key


def test_a_config_over_the_register_or_shared_budget_is_refused():
    with pytest.raises(Exception, match="head_dim"):
        gen_flash.FlashConfig(head_dim=96).validate()
    with pytest.raises(Exception, match="shared memory"):
        gen_flash.generate(gen_flash.FlashConfig(head_dim=128, bn=256, stages=4))


def test_why_not_names_what_the_kernels_do_not_take():
    pb = tf.Problem(1, 4, 3, 64, 64, 64)
    assert "multiple" in tf.why_not("bfloat16", pb, [])
    assert "head dim 96" in tf.why_not("bfloat16", tf.Problem(1, 1, 1, 64, 64, 96), [])
    assert "16 bytes" in tf.why_not("bfloat16", tf.Problem(1, 1, 1, 64, 64, 64), [tf.Operand(0x1000, (0, 0, 68))])
    assert tf.why_not("float32", tf.Problem(1, 1, 1, 64, 64, 64), []).startswith("dtype")
    rows = tf.Operand(0x1000, (4096, 4096, 64))
    assert tf.d_inputs_why_not(rows, rows) is None
    assert tf.d_inputs_why_not(tf.Operand(0x1008, (4096, 4096, 64)), rows).startswith("O's base")
    assert tf.d_inputs_why_not(rows, tf.Operand(0x1000, (4096, 4096, 68))).startswith("dO's base")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(2, 8, 2, 1000, 1000, 128, True, "bfloat16"),
                                          (1, 4, 4, 2048, 2048, 64, False, "bfloat16")])
def test_forward_and_backward_on_the_gpu(case):
    ok, why = driver.driver_status()
    if not ok:
        pytest.skip(why)
    ctx = driver.context()
    if tuple(ctx.cc) != (9, 0):
        pytest.skip(f"the wgmma kernels need sm_90, this GPU is sm_{ctx.cc[0]}{ctx.cc[1]}")
    B, H, Hk, Tq, Tk, D, causal, dtype = case
    q, k, v, do = _inputs(B, H, Hk, Tq, Tk, D)
    got = tf.attention_numpy(ctx, q, k, v, do, causal=causal, dtype=dtype)
    _check(got, q, k, v, do, causal, dtype)
    again = tf.attention_numpy(ctx, q, k, v, do, causal=causal, dtype=dtype)
    for key in ("o", "dq", "dk", "dv"):
        assert np.array_equal(got[key], again[key]), key


@pytest.fixture
def cuda0(emulated_cuda, monkeypatch):
    """The emulated cuda:0 (conftest's emulated_cuda) as the current device, with the flash passes
    its tensor cores took: (pass, taken) per call."""
    from helios.runtime import get_runtime, set_device

    driver.context.cache_clear()
    set_device("cuda:0")
    took = []
    real = type(get_runtime()).flash

    def counted(self, pass_, *args):
        took.append((pass_, real(self, pass_, *args)))
        return took[-1][1]

    monkeypatch.setattr(type(get_runtime()), "flash", counted)
    yield took
    driver.context.cache_clear()


@pytest.mark.vulkan
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_sdpa_on_cuda0_runs_the_tensor_core_kernels(cuda0, gqa):
    """F.scaled_dot_product_attention of bf16 cuda:0 tensors goes to the wgmma kernels forward and
    backward (K/V heads shared in place with enable_gqa), q, k, v being per-head views of one packed
    [B, T, 3, H, D] tensor as a GPT's attention makes them; values and gradients match float64."""
    B, H, T, D = 1, 2, 80, 64
    Hk = 1 if gqa else H
    rng = np.random.default_rng(5)
    packed = rng.standard_normal((B, T, H + 2 * Hk, D)).astype(np.float32)
    x = hl.tensor(packed).to(hl.bfloat16).requires_grad_(True)
    q, k, v = (x[:, :, a:b].transpose(1, 2) for a, b in ((0, H), (H, H + Hk), (H + Hk, H + 2 * Hk)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    do = rng.standard_normal((B, H, T, D)).astype(np.float32)
    (out.float() * hl.tensor(do)).sum().backward()
    assert [p for p, ok in cuda0 if ok] == ["fwd", "bwd"], cuda0
    r = tf.rounded(packed)
    qn, kn, vn = (r[:, :, a:b].transpose(0, 2, 1, 3) for a, b in ((0, H), (H, H + Hk), (H + Hk, H + 2 * Hk)))
    want = tf.reference(qn, kn, vn, do, causal=True)
    got_o = out.float().numpy()
    assert np.abs(got_o - want["o"]).max() <= 8e-3 * np.abs(want["o"]).max()
    g = x.grad.float().numpy()
    for name, (a, b) in (("dq", (0, H)), ("dk", (H, H + Hk)), ("dv", (H + Hk, H + 2 * Hk))):
        got = g[:, :, a:b].transpose(0, 2, 1, 3)
        assert np.abs(got - want[name]).max() <= 1e-2 * np.abs(want[name]).max(), name


@pytest.mark.vulkan
def test_float32_gqa_on_cuda0_runs_the_simt_kernel_on_the_shared_heads(cuda0):
    """float32 attention on cuda:0 has no tensor-core kernel: the SIMT flash kernel (its SPIR-V
    translated to PTX) reads each group's K/V head in place and sums the group's dK, dV itself, as
    on Vulkan: no copy or reduction, values and gradients as float64 attention's."""
    from test_attention import gqa_attention

    B, H, Hk, T, D = 1, 4, 2, 20, 32
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, Hk, T, D)).astype(np.float32) for _ in range(2))
    got, names = gqa_attention(q, k, v, do, True)
    assert names == {"flash_attn": 1, "flash_attn_bwd_dq": 1, "flash_attn_bwd_dkv": 1}, names
    assert not any(ok for _, ok in cuda0), cuda0  # the engine declined float32
    want = tf.reference(q, k, v, do, causal=True)
    for name, a in zip(("o", "dq", "dk", "dv"), got):
        assert np.abs(a - want[name]).max() <= 2e-6 * np.abs(want[name]).max(), name


@pytest.mark.vulkan
def test_the_dq_pass_computes_d_unless_o_is_unaligned(cuda0):
    """The tensor cores' dQ pass computes D = rowsum(dO * O) from O's and dO's rows (no preprocess
    dispatch, O handed to the engine); an O whose rows are not 16-byte aligned has the SIMT preprocess
    pass compute D instead.  Both give float64 attention's gradients."""
    from switches import count_dispatches

    B, H, T, D = 1, 2, 80, 64
    rng = np.random.default_rng(11)
    q, k, v, do = (tf.rounded(rng.standard_normal((B, H, T, D))) for _ in range(4))
    hq, hk, hv, hdo = (hl.tensor(x.astype(np.float32)).to(hl.bfloat16) for x in (q, k, v, do))
    o, lse = K.flash_attn_fwd(hq, hk, hv, D ** -0.5, True)
    odd = hl.zeros((B * H * T * D + 4,), dtype=hl.bfloat16)[4:].reshape(B, H, T, D)  # rows 8 bytes off
    K.copy_into(odd, o)
    want = tf.reference(q, k, v, do, causal=True)
    for o_in, pre in ((o, False), (odd, True)):
        cuda0.clear()
        with count_dispatches() as names:
            grads = K.flash_attn_bwd(hq, hk, hv, o_in, lse, hdo, D ** -0.5, True)
        assert cuda0 == [("bwd", True)], cuda0
        assert ("flash_attn_bwd_pre" in names) == pre, names
        for name, got in zip(("dq", "dk", "dv"), grads):
            err = np.abs(got.float().numpy() - want[name]).max()
            assert err <= 1e-2 * np.abs(want[name]).max(), (name, pre, err)


@pytest.mark.vulkan
def test_a_captured_attention_replays_on_new_inputs(cuda0):
    """A graph capture records the tensor-core flash pass as a FLASH command; a replay with new q
    gives what a fresh call gives (the command reads the refilled input in place)."""
    B, H, T, D = 1, 1, 70, 64
    rng = np.random.default_rng(7)
    q0, q1, kv = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3))
    q = hl.tensor(q0).to(hl.bfloat16)
    k = hl.tensor(kv).to(hl.bfloat16)
    with hl.graph.capture(inputs=(q,)) as g:
        out = F.scaled_dot_product_attention(q, k, k, is_causal=True)
    assert ("fwd", True) in cuda0
    g.replay(hl.tensor(q1).to(hl.bfloat16))
    fresh = F.scaled_dot_product_attention(hl.tensor(q1).to(hl.bfloat16), k, k, is_causal=True)
    assert np.array_equal(out.float().numpy(), fresh.float().numpy())


@pytest.mark.slow  # one of the longest single-process tests: full runs only, not the inner loop
@pytest.mark.vulkan
def test_bf16_gpt_trains_on_cuda0_through_the_tensor_core_attention(cuda0):
    """A bf16-autocast GPT (head dim 64) on the emulated cuda:0 takes the wgmma flash kernels in both
    directions even below FLASH_MIN_TRAIN_T, and its losses are the Vulkan device's (the SIMT flash
    kernel on the same bf16 values) to bf16 noise."""
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW
    from helios.runtime import get_runtime, set_device

    def losses(device):
        set_device(device)
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=1, n_embd=64, dropout=0.0)
        hl.manual_seed(0)
        model = GPT(cfg, seed=0)
        opt = AdamW(model.parameters(), lr=3e-3)
        data = np.random.default_rng(1).integers(0, 64, (2, 4, 33))
        out = []
        for s in range(2):
            with hl.amp.autocast(dtype=hl.bfloat16):
                _, loss = model(hl.tensor(data[s, :, :-1]), hl.tensor(data[s, :, 1:]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    cuda = losses("cuda:0")
    assert [p for p, ok in cuda0 if ok] == ["fwd", "bwd"] * 2, cuda0
    np.testing.assert_allclose(cuda, losses("vulkan:0"), rtol=2e-3)
    set_device("cuda:0")
    assert get_runtime().name == "cuda:0"


@pytest.mark.vulkan
def test_block_sparse_attention_on_cuda0_runs_the_tensor_core_kernels(cuda0):
    """helios.attention.block_sparse_attention of bf16 cuda:0 tensors hands its block mask to the
    wgmma kernels (forward and backward) and equals masked float64 attention."""
    from helios.attention import block_sparse_attention

    B, H, T, D, bs = 1, 2, 192, 64, 64
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4))
    mask = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 1]], bool)
    qt, kt, vt = (hl.tensor(x).to(hl.bfloat16).requires_grad_(True) for x in (q, k, v))
    out = block_sparse_attention(qt, kt, vt, block_mask=mask, block_size=bs, is_causal=True)
    (out.float() * hl.tensor(do)).sum().backward()
    assert [p for p, ok in cuda0 if ok] == ["fwd", "bwd"], cuda0
    r = [tf.rounded(x) for x in (q, k, v)]
    want = tf.reference(*r, do, causal=True, block_mask=mask, block_size=bs)
    for name, got in (("o", out), ("dq", qt.grad), ("dk", kt.grad), ("dv", vt.grad)):
        g = got.float().numpy()
        assert np.abs(g - want[name]).max() <= 1e-2 * np.abs(want[name]).max(), name


@pytest.mark.vulkan
def test_the_gpu_attention_benchmark_smoke_runs_on_the_emulator():
    """bench/attention.py --device cuda:0 --smoke (CI's seconds-long run of the GPU benchmark): on the
    emulated device it takes the wgmma kernels and agrees with its PyTorch peer."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("torch")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HELIOS_CUDA_DEVICE="emulator")
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "attention.py"), "--device", "cuda:0", "--smoke"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
    assert line["numerics_ok"] and line["tensor_cores"], line
    assert "flash_wgmma_fwd" in line["helios_kernels_fwd"] and "flash_wgmma_bwd" in line["helios_kernels_bwd"]


@pytest.mark.vulkan
def test_a_gpt_attention_on_cuda0_makes_no_layout_copies(cuda0):
    """As tests/test_attention.py's on the Vulkan kernels, on the tensor cores: O stored token-major
    (merging the heads is a view), O's gradient read where the merge leaves it, and dQ, dK, dV
    written into split_heads' fused gradient, with the bits of the contiguous layouts."""
    from test_attention import gpt_attention

    rng = np.random.default_rng(7)
    B, T, H, D = 2, 45, 2, 64
    x = rng.standard_normal((B, T, 3 * H * D)).astype(np.float32)
    g = rng.standard_normal((B, T, H * D)).astype(np.float32)
    y, dx, names = gpt_attention(x, H, g, hl.bfloat16)
    assert [p for p, ok in cuda0] == ["fwd", "bwd"] and all(ok for _, ok in cuda0), cuda0
    assert not any("copy" in n for n in names), names
    assert "flash_attn_bwd_pre" not in names, names  # D comes from the tensor cores' dQ pass
    y0, dx0, names0 = gpt_attention(x, H, g, hl.bfloat16, through_copies=True)
    assert sum(n.startswith("copy") for n in names0.elements()) >= 5  # the test's copies do run there
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
