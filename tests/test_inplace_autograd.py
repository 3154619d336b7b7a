"""In-place ops under autograd (helios.functional.inplace): ``y[mask] = v``, ``y[:, idx] = v``,
``y.add_(z)``, ``y.masked_fill_(m, x)`` ... on a non-leaf are recorded, and the values and the
gradients of everything upstream equal PyTorch's on the same program."""

import numpy as np
import pytest
import torch

import helios as hl
from helios.errors import InPlaceError

pytestmark = pytest.mark.vulkan

RNG = np.random.default_rng(7)
A = RNG.standard_normal((4, 5)).astype(np.float32)
W = RNG.standard_normal((4, 5)).astype(np.float32)
M = A > 0.3


def _run(L, program):
    """program(L, a, v, w, m) -> a scalar loss; returns the loss and the gradients of a and v."""
    t = torch.tensor if L is torch else hl.tensor
    a = t(A, requires_grad=True)
    v = t(np.float32(1.5), requires_grad=True)
    loss = program(L, a, v, t(W), t(M))
    loss.backward()
    grads = [None if x.grad is None else x.grad.numpy() for x in (a, v)]
    return [loss.detach().numpy() if L is torch else loss.numpy()] + grads


def _mask_write(L, a, v, w, m):
    y = a * 2
    y[m] = v
    return (y * w).sum()


def _earlier_consumer_keeps_its_producer(L, a, v, w, m):
    y = a * 2
    z = y * 3  # recorded before the write: its gradient reaches a unmasked
    y[m] = 0.0
    return (z * w).sum() + (y * w).sum()


def _index_array_and_slice_writes(L, a, v, w, m):
    y = a * 2
    y[:, [1, 3]] = v * a[:, :2]
    y[1:3, 0] = v
    return (y * w).sum()


def _repeated_rows(L, a, v, w, m):
    y = a * 1
    y[[0, 0, 2]] = a[1:4] * v  # a repeated index: the last write wins, each row gets its gradient
    return (y * w).sum()


def _binary_ops(L, a, v, w, m):
    y = a * 2
    y.mul_(v)  # its backward needs y's old values: a copy stands in for them
    y.add_(a)
    y.masked_fill_(m, 2.0)
    y.div_(v)
    y.clamp_(-1.0, 1.2)
    y.sub_(a, alpha=0.5)
    return (y * w).sum()


def _value_only(L, a, v, w, m):
    y = L.zeros(4, 5)  # requires no grad until a value that does is written
    y[m] = v
    y[0] = a[1]
    return (y * w).sum()


def _fill_zero_copy(L, a, v, w, m):
    y = a + 0
    y.fill_(3.0)
    y[0, :] = a[0] * v
    z = a * 1
    z.zero_()
    z.copy_(a[2] * v)  # broadcast over the rows
    u = a * 3
    u.copy_(w)  # a source without grad: nothing reaches a through u
    return (y * w).sum() + (z * w).sum() + (u * a).sum()


def _scatter_and_index_add(L, a, v, w, m):
    idx = L.tensor(np.array([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]], np.int64))
    y = a * 1
    y.scatter_(1, idx[:, :3].repeat(2, 1), a[:, :3] * v)
    y.index_add_(0, L.tensor(np.array([3, 0], np.int64)), a[:2] * 2)
    return (y * w).sum()


def _causal_scores(L, a, v, w, m):
    # nanoGPT's pattern on the scores: att[mask] = -inf, then a softmax
    att = a[:, :4] @ a[:, :4].transpose(0, 1) * v
    att[L.tensor(np.triu(np.ones((4, 4), bool), 1))] = -float("inf")
    return (L.softmax(att, -1) * w[:, :4]).sum()


@pytest.mark.parametrize("program", [_mask_write, _earlier_consumer_keeps_its_producer, _index_array_and_slice_writes,
                                     _repeated_rows, _binary_ops, _value_only, _fill_zero_copy,
                                     _scatter_and_index_add, _causal_scores], ids=lambda f: f.__name__.strip("_"))
def test_values_and_gradients_equal_pytorch(program):
    want, got = _run(torch, program), _run(hl, program)
    for name, t, h in zip(("loss", "a.grad", "v.grad"), want, got):
        assert (t is None) == (h is None), f"{name}: PyTorch {t}, Helios {h}"
        if t is not None:
            np.testing.assert_allclose(h, t, rtol=1e-5, atol=1e-6, err_msg=name)


def test_two_writes_in_a_row_chain_their_histories():
    a = hl.tensor(A, requires_grad=True)
    y = a * 2
    y[hl.tensor(M)] = 0.0
    y[hl.tensor(~M)] = 1.0  # every element overwritten: nothing reaches a through y
    (y.sum() + a.sum()).backward()
    np.testing.assert_array_equal(a.grad.numpy(), np.ones_like(A))
    np.testing.assert_array_equal(y.numpy(), np.where(M, 0.0, 1.0).astype(np.float32))


def test_a_saved_value_changed_later_fails_at_backward_as_in_pytorch():
    a = hl.tensor(A, requires_grad=True)
    y = a * 2
    z = y * a  # saves y for a's gradient
    y[hl.tensor(M)] = 0.0
    with pytest.raises(RuntimeError, match="modified by an in-place op"):
        z.sum().backward()


def test_refusals_name_the_op_and_the_way_out():
    a = hl.tensor(A, requires_grad=True)
    with pytest.raises(InPlaceError, match=r"setitem: a leaf tensor that requires grad .* clone\(\)"):
        a[0] = 1.0
    y = a * 2
    row = y[0]  # a view: y and row share memory
    with pytest.raises(InPlaceError, match="add_: the tensor shares its memory with another tensor"):
        y.add_(1.0)
    with pytest.raises(InPlaceError, match="setitem: the tensor shares its memory"):
        row[1] = 0.0
    del row
    y.add_(1.0)  # the view is gone: recorded
    y.sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), np.full_like(A, 2.0))


def test_outside_autograd_nothing_is_recorded():
    a = hl.tensor(A, requires_grad=True)
    with hl.no_grad():
        a[hl.tensor(M)] = 0.0  # the optimizer-update pattern
    assert a.is_leaf and a.requires_grad
    y = hl.zeros(4, 5)
    y[hl.tensor(M)] = 1.0  # nothing requires grad
    assert not y.requires_grad and y.grad_fn is None
    n = hl.zeros(4, 5, dtype=hl.int64)
    n[hl.tensor(M)] = hl.tensor(np.float32(2.0), requires_grad=True)  # an integer tensor takes the value only
    assert not n.requires_grad and int(n.numpy().sum()) == 2 * int(M.sum())


def test_a_bfloat16_write_gives_the_value_its_own_dtype_of_gradient():
    a = hl.tensor(A, requires_grad=True)
    y = a.to(hl.bfloat16)
    v = hl.tensor(np.float32(0.5), requires_grad=True)
    y[hl.tensor(M)] = v
    y.float().sum().backward()
    assert v.grad.dtype is hl.float32 and float(v.grad.numpy()) == float(M.sum())
    np.testing.assert_array_equal(a.grad.numpy(), (~M).astype(np.float32))
