"""Autograd surface beyond op parity: activation checkpointing, dropout, grad modes."""

import numpy as np
import pytest

import helios as hl
from helios.autograd import checkpoint
from helios.nn import GPT, GPTConfig
from helios.runtime import get_runtime

pytestmark = pytest.mark.vulkan


def _grads(model):
    return {n: p.grad.numpy() for n, p in model.named_parameters()}


def test_checkpoint_gives_identical_gradients_and_keeps_fewer_activations():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
    x = np.random.default_rng(0).integers(0, 50, (4, 16))
    results = {}
    for use_ckpt in (False, True):
        hl.manual_seed(7)
        model = GPT(cfg, seed=1)
        pool = get_runtime()

        def run(peak):
            h = model.drop(model.wte(hl.tensor(x)) + model.wpe(hl.arange(16)))
            for blk in model.h:
                h = checkpoint(blk, h) if use_ckpt else blk(h)
                peak.append(pool.pool_stats()["activations"]["in_use_bytes"])
            logits = model.ln_f(h) @ model.wte.weight.mT
            loss = hl.cross_entropy(logits.reshape(-1, 50), hl.tensor(x).reshape(-1))
            return loss

        hl.synchronize()
        base = pool.pool_stats()["activations"]["in_use_bytes"]
        samples = [base]  # in-use bytes after each block's forward: what the tape keeps alive
        loss = run(samples)
        kept = max(samples) - base
        loss.backward()
        results[use_ckpt] = (loss.item(), _grads(model), kept)
    (l0, g0, kept0), (l1, g1, kept1) = results[False], results[True]
    assert l0 == l1
    for n in g0:
        np.testing.assert_array_equal(g0[n], g1[n], err_msg=n)
    assert kept1 < 0.5 * kept0, (kept0, kept1)


def test_dropout_scales_and_masks_deterministically():
    hl.manual_seed(3)
    x = hl.ones(1000, requires_grad=True)
    y = hl.dropout(x, p=0.25)
    v = y.numpy()
    assert set(np.unique(v).tolist()) <= {0.0, float(np.float32(1.0 / 0.75))}
    assert 0.18 < (v == 0).mean() < 0.32
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), v)
    hl.manual_seed(3)
    np.testing.assert_array_equal(hl.dropout(hl.ones(1000), p=0.25).numpy(), v)
    assert hl.dropout(x, p=0.25, training=False) is x


def test_grad_accumulates_and_retain_graph():
    w = hl.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = (w * w).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), [4.0, 8.0, 12.0])
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_a_leaf_gradient_replaced_by_a_sum_is_no_longer_counted_as_handed_out():
    # The tape clones a gradient whose storage another leaf already holds, so an in-place update
    # of one .grad never changes another.  A leaf's second contribution replaces its .grad by a
    # sum; the first storage, once freed, may lend its id to a new one, which must not read as
    # held (a GPT's tied table, then the position table's gradient: a needless copy).
    from helios.autograd import tape

    given: set = set()
    w = hl.tensor([1.0, 2.0], requires_grad=True)
    tape._accumulate_leaf(w, hl.tensor([3.0, 4.0]), given)
    first = w.grad.untyped_storage()
    tape._accumulate_leaf(w, hl.tensor([5.0, 6.0]), given)
    assert id(first) not in given and id(w.grad.untyped_storage()) in given
    np.testing.assert_array_equal(w.grad.numpy(), [8.0, 10.0])


def test_the_implicit_seed_is_made_once_and_again_after_a_write():
    # backward() of a scalar seeds itself with a cached 1.0 (no fill kernel a step), made again
    # when anything wrote the cached value (here a backward that scales its incoming gradient)
    import helios.functional as F
    from helios.autograd import Function

    seen = []

    class Keep(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            seen.append(g)
            return g * 3.0

    w = hl.tensor([1.0, 2.0], requires_grad=True)
    for i in range(3):
        Keep.apply(w.sum()).backward()
        np.testing.assert_array_equal(w.grad.numpy(), [3.0, 3.0])
        np.testing.assert_array_equal(seen[-1].numpy(), 1.0)
        w.grad = None
        if i == 0:
            F.mul_(seen[-1], 5.0)  # in place, into the cached seed
    first, refilled, cached = (g.untyped_storage() for g in seen)
    assert refilled is not first and cached is refilled
