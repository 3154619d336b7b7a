"""Gradients written in place: a backward that produces a parameter's first gradient of the
pass writes it straight into the parameter's slot of the optimizer's flat gradient buffer
(autograd.tape's free slots, Context.grad_out) instead of into new memory that the tape then
copies there.  Every result must be bit-identical to the copying path (tape.GRADS_IN_PLACE =
False, run in the same test), and the copies must be gone."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

import helios as hl
import helios.autograd.tape as tape
import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios import elementwise_jit
from helios.nn import GPT, GPTConfig, Parameter
from helios.optim import AdamW, clip_grad_norm_
from helios.runtime import get_runtime
from helios.tensor import Tensor

sys.path.insert(0, os.path.dirname(__file__))
from switches import count_dispatches, switched  # noqa: E402

pytestmark = pytest.mark.vulkan


def in_place(enabled: bool):
    """Gradients written in place or copied (tape.GRADS_IN_PLACE) inside the block."""
    return switched(tape, "GRADS_IN_PLACE", enabled)


def _gpt_run(enabled: bool, steps: int = 3, dtype=None):
    """Losses, final parameters and the last step's gradients of a small GPT under AdamW with
    clipping, and the copies recorded by the last backward."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg, seed=0)
    params = list(model.parameters())
    opt = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    losses, grads, copies = [], None, None
    with in_place(enabled):
        for _ in range(steps):
            x, y = rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))
            with hl.autocast(dtype) if dtype else contextlib.nullcontext():
                _, loss = model(hl.tensor(x), hl.tensor(y))
            with count_dispatches() as names:
                loss.backward()
            copies = names["copy"]
            grads = [p.grad.numpy().copy() for p in params]
            clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [p.numpy().copy() for p in params], grads, copies, len(params)


def _assert_bits_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_gpt_adamw_steps_are_bit_identical_and_the_leaf_copies_are_gone():
    on = _gpt_run(True)
    off = _gpt_run(False)
    assert on[0] == off[0]  # losses, exactly
    _assert_bits_equal(on[2], off[2])  # the last step's gradients
    _assert_bits_equal(on[1], off[1])  # the parameters after 3 AdamW steps
    n_params, n_layer = on[4], 2
    # Off: one copy per parameter, and split_heads' three per layer. On: none: the LM head
    # writes the tied table's slot and the embedding's backward adds its gradient there
    # (fused_kernels "embedding_bwd+acc"); q, k and v's gradients go into split_heads' buffer.
    assert off[3] - on[3] == n_params + 3 * n_layer


def test_gpt_under_bf16_autocast_is_bit_identical():
    rt = get_runtime()
    if not rt.features.get("storage16", False):
        pytest.skip("no 16-bit storage on this device")
    on = _gpt_run(True, steps=2, dtype="bfloat16")
    off = _gpt_run(False, steps=2, dtype="bfloat16")
    assert on[0] == off[0]
    _assert_bits_equal(on[2], off[2])
    _assert_bits_equal(on[1], off[1])
    assert on[3] < off[3]  # the casts' gradients convert straight into the float32 slots


def _leaf(rng, shape):
    return Parameter(hl.tensor(rng.standard_normal(shape).astype(np.float32)))


def _grads_both_ways(build, params, passes: int = 1):
    """The parameters' gradients (after ``passes`` backward passes without zeroing) with the
    in-place path and without, each from the same starting point."""
    out, copies = [], []
    for enabled in (True, False):
        opt = AdamW(params, lr=0.0)  # packs the gradients into flat slots
        with in_place(enabled), count_dispatches() as names:
            for _ in range(passes):
                build().backward()
        copies.append(names["copy"])
        out.append([p.grad.numpy().copy() for p in params])
        for p in params:
            assert p.grad._st is p._grad_slot._st and p.grad._off == p._grad_slot._off
        opt.zero_grad()
    assert copies[0] < copies[1]  # the in-place path ran
    return out


@pytest.mark.parametrize("out_features", [24, 8])  # wide weight (transposed store) and narrow
def test_linear_weight_and_bias_gradients(out_features):
    rng = np.random.default_rng(1)
    w, b = _leaf(rng, (out_features, 12)), _leaf(rng, (out_features,))
    x = hl.tensor(rng.standard_normal((3, 20, 12)).astype(np.float32))
    on, off = _grads_both_ways(lambda: (F.linear(x, w, b) ** 2).sum(), [w, b])
    _assert_bits_equal(on, off)
    # and the values are the gradients (not stale slot contents)
    xn = x.numpy().reshape(-1, 12)
    y = xn @ w.numpy().T + b.numpy()
    np.testing.assert_allclose(on[0], (2 * y).T @ xn, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(on[1], (2 * y).sum(0), rtol=1e-4, atol=1e-4)


def test_matmul_layer_norm_and_embedding_gradients_with_accumulation():
    rng = np.random.default_rng(2)
    table, w = _leaf(rng, (10, 8)), _leaf(rng, (8, 6))
    lw, lb = _leaf(rng, (8,)), _leaf(rng, (8,))
    idx = hl.tensor(rng.integers(0, 10, (2, 5)))

    def build():
        h = F.layer_norm(F.embedding(idx, table), 8, lw, lb)
        return (F.matmul(h, w).tanh() * 3).sum()

    # Two passes: the second accumulates onto the slots the first wrote in place.
    on, off = _grads_both_ways(build, [table, w, lw, lb], passes=2)
    _assert_bits_equal(on, off)
    one_on, one_off = _grads_both_ways(build, [table, w, lw, lb], passes=1)
    _assert_bits_equal(one_on, one_off)
    for a, b in zip(on, one_on):
        np.testing.assert_allclose(a, 2 * b, rtol=1e-6, atol=1e-6)


def test_a_leaf_used_twice_by_one_op_after_its_slot_was_written():
    rng = np.random.default_rng(3)
    w = _leaf(rng, (6, 6))
    # y = (w @ w) @ w^T: the linear's backward runs first and writes w's slot; then the
    # matmul has w as both inputs (no free slot: two writes would collide) and both of its
    # gradients are added to the slot.
    on, off = _grads_both_ways(lambda: (F.linear(F.matmul(w, w), w) ** 2).sum(), [w])
    _assert_bits_equal(on, off)
    wn = w.numpy().astype(np.float64)
    m = wn @ wn
    gy = 2 * (m @ wn.T)
    gm = gy @ wn
    expect = gy.T @ m + gm @ wn.T + wn.T @ gm
    np.testing.assert_allclose(on[0], expect, rtol=1e-4, atol=1e-3)


def test_post_accumulate_hooks_see_the_complete_gradient_in_the_slot():
    rng = np.random.default_rng(4)
    w = _leaf(rng, (5, 4))
    x = hl.tensor(rng.standard_normal((3, 4)).astype(np.float32))
    seen = {}
    w.register_post_accumulate_grad_hook(lambda t: seen.setdefault(tape.GRADS_IN_PLACE, t.grad.numpy().copy()))
    # two contributions (a tied use): the hook runs once, after both
    on, off = _grads_both_ways(lambda: (F.linear(x, w) ** 2).sum() + (w * 2.0).sum(), [w])
    _assert_bits_equal(on, off)
    _assert_bits_equal([seen[True]], [seen[False]])
    _assert_bits_equal([seen[True]], on)


def test_a_gradient_in_the_slot_is_not_handed_to_another_leaf():
    # A packed leaf's gradient is its slot; a leaf beside it without a slot gets its own
    # memory, so an in-place update of one .grad never changes the other.
    rng = np.random.default_rng(5)
    w, v = _leaf(rng, (4, 4)), _leaf(rng, (4, 4))
    AdamW([w], lr=0.0)
    x = hl.tensor(rng.standard_normal((2, 4)).astype(np.float32))
    (F.linear(x, w).sum() + F.linear(x, v).sum()).backward()
    assert w.grad._st is w._grad_slot._st
    assert v.grad._st is not w.grad._st
    before = w.grad.numpy().copy()
    F.mul_(v.grad, 0.0)
    np.testing.assert_array_equal(w.grad.numpy(), before)


def test_kernel_outputs_at_an_offset():
    rt = get_runtime()
    rng = np.random.default_rng(6)
    buf = K.fill(K.empty((400,), dt.float32, rt), 7.0)
    a = K.from_numpy(rng.standard_normal((9, 13)).astype(np.float32), dt.float32, rt)
    b = K.from_numpy(rng.standard_normal((13, 6)).astype(np.float32), dt.float32, rt)
    ref = K.matmul(a, b).numpy()
    # contiguous and transposed destinations at an odd offset
    d = Tensor(buf._st, (9, 6), (6, 1), 5, dt.float32)
    K.matmul(a, b, out=d)
    assert np.array_equal(d.numpy(), ref)
    dt_ = Tensor(buf._st, (9, 6), (1, 9), 101, dt.float32)  # [6, 9] contiguous, viewed transposed
    K.matmul(a, b, out=dt_)
    assert np.array_equal(dt_.numpy(), ref)
    # column sums into an offset slot
    s = Tensor(buf._st, (6,), (1,), 201, dt.float32)
    K.reduce("sum", K.matmul(a, b), (0,), 1.0, out=s)
    assert np.array_equal(s.numpy(), K.reduce("sum", K.matmul(a, b), (0,))[0].numpy())
    host = buf.numpy()
    assert (host[:5] == 7).all() and (host[59:101] == 7).all() and (host[155:201] == 7).all() and (host[207:] == 7).all()
    with pytest.raises(Exception, match="out"):
        K.matmul(a, b, out=Tensor(buf._st, (9, 6), (12, 2), 0, dt.float32))


def _split_heads_grads(enabled: bool, build, retain: bool = False):
    rng = np.random.default_rng(7)
    qkv = hl.tensor(rng.standard_normal((2, 8, 24)).astype(np.float32), requires_grad=True)
    with in_place(enabled), count_dispatches() as names:
        q, k, v = F.split_heads(qkv, 2)
        loss = build(q, k, v)
        loss.backward(retain_graph=retain)
        first = qkv.grad.numpy().copy()
        if retain:  # a second pass through the same graph accumulates
            loss.backward()
    return first, qkv.grad.numpy().copy(), names["copy"]


@pytest.mark.parametrize("case", ["attention", "k_used_twice", "k_direct_between", "v_unused"])
def test_split_heads_gradients_written_in_place(case):
    def attention(q, k, v):
        att = F.attention_softmax(F.matmul(q, k.mT), 0.25, causal=True)
        return (F.matmul(att, v) ** 2).sum()

    w = hl.tensor(np.random.default_rng(11).standard_normal((2, 2, 4, 4)).astype(np.float32))
    build = {
        "attention": attention,
        # k reaches backward twice: the second gradient is added in new memory and copied
        "k_used_twice": lambda q, k, v: attention(q, k, v) + (F.matmul(k, v.mT) * 0.5).sum(),
        # backward runs the k.mT consumer, then k @ w, then the transpose: k's buffer columns,
        # handed to the first, must not be written by the second while the first's gradient
        # is still on its way through the transpose
        "k_direct_between": lambda q, k, v: (F.matmul(F.matmul(k, w), k.mT) ** 2).sum(),
        "v_unused": lambda q, k, v: (F.matmul(q, k.mT) ** 2).sum(),
    }[case]
    on = _split_heads_grads(True, build, retain=True)
    off = _split_heads_grads(False, build, retain=True)
    _assert_bits_equal(list(on[:2]), list(off[:2]))
    np.testing.assert_allclose(on[1], 2 * on[0], rtol=1e-6)
    # k_direct_between: k's second gradient arrives first, so the sum is copied as before
    assert on[2] < off[2] if case != "k_direct_between" else on[2] == off[2]


def test_matmul_into_interleaved_heads():
    """The matmul kernel's strided store (CLD), plain and transposed, and untouched neighbours."""
    rt = get_runtime()
    rng = np.random.default_rng(8)
    a = K.from_numpy(rng.standard_normal((2, 3, 5, 4)).astype(np.float32), dt.float32, rt)
    b = K.from_numpy(rng.standard_normal((2, 3, 4, 6)).astype(np.float32), dt.float32, rt)
    ref = K.matmul(a, b).numpy()
    L = 2 * 3 * 6  # rows of a [2, 5, 36] buffer: two blocks of 3 heads of 6
    for transposed in (False, True):
        buf = K.fill(K.empty((2, 5, L), dt.float32, rt), 7.0)
        dest = Tensor(buf._st, (2, 3, 5, 6), (5 * L, 6, L, 1), 18, dt.float32)  # the second block
        if transposed:  # b^T a^T into the transposed view: the same products, stored along M
            K.matmul(K._swap_last(b), K._swap_last(a), out=K._swap_last(dest))
        else:
            K.matmul(a, b, out=dest)
        host = buf.numpy()
        assert np.array_equal(host[:, :, 18:].reshape(2, 5, 3, 6).transpose(0, 2, 1, 3), ref)
        assert (host[:, :, :18] == 7).all()


def test_attention_output_is_stored_with_heads_interleaved():
    """att @ v with split_heads' v lands in a [B, T, C] buffer: the same bits as the product
    computed alone, and transpose(1, 2).reshape(B, T, C) is a view (no copy recorded)."""
    rng = np.random.default_rng(9)
    B, T, H, D = 2, 16, 4, 8
    qkv = hl.tensor(rng.standard_normal((B, T, 3 * H * D)).astype(np.float32), requires_grad=True)
    att = hl.tensor(rng.standard_normal((B, H, T, T)).astype(np.float32), requires_grad=True)
    _, _, v = F.split_heads(qkv, H)
    with count_dispatches() as names:
        y = F.matmul(att, v)
        merged = y.transpose(1, 2).reshape(B, T, H * D)
    assert names["copy"] == 0 and merged._st is y._st
    assert np.array_equal(y.numpy(), K.matmul_any_layout(att, v).numpy())
    assert np.array_equal(merged.numpy(), K.copy(K.matmul_any_layout(att, v).permute(0, 2, 1, 3)).numpy().reshape(B, T, -1))


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_cross_entropy_backward_reads_the_mean_gradient_without_expanding_it(ignore_index, monkeypatch):
    rng = np.random.default_rng(10)
    xn = rng.standard_normal((12, 7)).astype(np.float32)
    t = rng.integers(0, 7, 12)
    t[3] = ignore_index  # an ignored row

    def grad():
        x = hl.tensor(xn, requires_grad=True)
        loss = F.cross_entropy(x, hl.tensor(t), ignore_index=ignore_index)  # the mean: the fused kernel
        with count_dispatches() as names:
            (loss * 3.0).sum().backward()
        return x.grad.numpy(), names["copy"]

    new, copies = grad()
    plain = K.cross_entropy_bwd
    # the copying path: the upstream gradient made contiguous first
    monkeypatch.setattr(K, "cross_entropy_bwd",
                        lambda x, t, lse, gl, cast=False, scale=1.0: plain(x, t, lse, K.copy(gl), cast, scale))
    old, old_copies = grad()
    assert np.array_equal(new, old)
    assert copies == old_copies - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_backward_scales_by_the_mean_in_its_kernel(dtype, monkeypatch):
    # the mean's 1/n multiplies the upstream gradient in the backward kernel: the bits of the
    # separate multiply (a mul_s dispatch) before it, one dispatch fewer
    if dtype != "float32" and not get_runtime().features.get("storage16", False):
        pytest.skip("no 16-bit storage on this device")
    rng = np.random.default_rng(11)
    xn = rng.standard_normal((13, 9)).astype(np.float32)
    t = rng.integers(0, 9, 13)

    def grad():
        x = hl.tensor(xn).to(getattr(hl, dtype)).requires_grad_()
        loss = F.cross_entropy(x, hl.tensor(t))
        # elementwise chains one kernel an op (the run-time fusion could join the multiplies)
        with switched(elementwise_jit, "ENABLED", False), count_dispatches() as names:
            (loss * 0.7).backward()
        return x.grad.float().numpy(), sum(names.values())

    grad()  # backward's seed made (tests/test_autograd.py): both counts without it
    new, n_new = grad()
    plain = K.cross_entropy_bwd
    monkeypatch.setattr(K, "cross_entropy_bwd",
                        lambda x, t, lse, gl, cast=False, scale=1.0: plain(x, t, lse, gl * scale, cast))
    old, n_old = grad()
    assert np.array_equal(new, old) and n_new == n_old - 1


def test_the_logit_gradient_rows_are_padded_on_gpus_only():
    # (tests/test_coopmat_gpu.py: what the padding buys the LM head's products there)
    from helios._kernels import rows

    class Gpu:
        info = {"type": "discrete"}

    assert rows.padded_row(Gpu, 50257) == 50264 and rows.padded_row(Gpu, 64) == 64
    rt = get_runtime()
    x = hl.tensor(np.random.default_rng(12).standard_normal((5, 61)).astype(np.float32), requires_grad=True)
    F.cross_entropy(x, hl.tensor(np.arange(5))).backward()
    assert x.grad._strides == ((61, 1) if rt.info.get("type") == "cpu" else (64, 1))
