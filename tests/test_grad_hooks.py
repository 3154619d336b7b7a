"""retain_grad() on non-leaf tensors and post-accumulate-grad hooks on leaves (the signal
data parallel uses to start a bucket's all-reduce while backward is still running)."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl

pytestmark = pytest.mark.vulkan


def test_retain_grad_stores_the_gradient_of_an_intermediate():
    w = hl.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    h = w * 2
    h.retain_grad()
    assert h.retains_grad and not (w * 3).retains_grad
    (h * h).sum().backward()
    np.testing.assert_allclose(h.grad.numpy(), [4.0, 8.0])  # d(h^2)/dh = 2h
    np.testing.assert_allclose(w.grad.numpy(), [8.0, 16.0])


def test_retain_grad_on_one_output_of_a_multi_output_op_and_on_the_root():
    w = hl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
    a, b = w.split(1, dim=0)
    b.retain_grad()
    loss = (a * 2).sum() + (b * 5).sum()
    loss.retain_grad()
    loss.backward()
    np.testing.assert_allclose(b.grad.numpy(), np.full((1, 3), 5.0))
    assert a.grad is None
    assert loss.grad.item() == 1.0


def test_post_accumulate_hook_runs_once_after_the_last_contribution():
    # A tied weight gets two gradients (embedding and output projection): the hook must see both.
    w = hl.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
    x = hl.tensor(np.array([[1.0, 2.0]], np.float32))
    first = (w * 3.0).sum()          # contributes 3 everywhere
    second = (x @ w.T).sum()         # contributes x's row to every row
    (first + second).backward()
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], [[4.0, 5.0]] * 3)
    np.testing.assert_allclose(w.grad.numpy(), seen[0])


def test_post_accumulate_hooks_fire_once_per_used_leaf_and_never_for_unused_ones():
    a = hl.tensor(np.ones(2, np.float32), requires_grad=True)
    b = hl.tensor(np.ones(2, np.float32), requires_grad=True)
    unused = hl.tensor(np.ones(2, np.float32), requires_grad=True)
    order = []
    for name, t in (("a", a), ("b", b), ("unused", unused)):
        t.register_post_accumulate_grad_hook(lambda t, name=name: order.append(name))
    (unused * 0.5).sum()  # on another graph: this backward never reaches it
    h = (a * 2).sum()
    (h * (b * 3).sum()).backward()
    assert sorted(order) == ["a", "b"]


def test_hook_on_a_branch_that_gets_no_gradient_still_fires_for_the_used_edge():
    w = hl.tensor(np.ones(2, np.float32), requires_grad=True)
    calls = []
    w.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    idx = hl.tensor(np.array([1, 0]), dtype=hl.int64)
    (w * 2).sum().backward()
    assert calls == [1]
    handle = w.register_post_accumulate_grad_hook(lambda t: calls.append(2))
    handle.remove()
    (w[idx] * 1).sum().backward()
    assert calls == [1, 1]


def test_hooks_are_refused_on_non_leaves():
    w = hl.tensor(np.ones(2, np.float32), requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        (w * 2).register_post_accumulate_grad_hook(lambda t: None)
