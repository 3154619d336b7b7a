"""Op parity against PyTorch (CPU): forward values and gradients over odd sizes, size-1
and empty dims, broadcasting, non-contiguous views and every supported dtype."""

import numpy as np
import pytest

from parity import check

import helios as hl

pytestmark = pytest.mark.vulkan

R = np.random.default_rng(1234)


def rn(*shape, lo=-2.0, hi=2.0):
    return R.uniform(lo, hi, size=shape).astype(np.float32)


FLOATS = ["float32", "float16", "bfloat16"]
SHAPES = [(), (1,), (7,), (3, 5), (2, 1, 4), (0, 3), (33, 17)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["exp", "tanh", "sigmoid", "relu", "neg", "abs", "sin"])
def test_unary(op, shape, dtype):
    check(lambda L, x: getattr(L, op)(x), rn(*shape), dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["log", "sqrt", "rsqrt"])
def test_unary_positive(op, dtype):
    check(lambda L, x: getattr(L, op)(x), rn(4, 9, lo=0.5, hi=3.0), dtype=dtype)


@pytest.mark.parametrize("approx", ["none", "tanh"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu(approx, dtype):
    check(lambda L, x: L.nn.functional.gelu(x, approximate=approx) if L.__name__ == "torch" else x.gelu(approximate=approx),
          rn(5, 13, lo=-5, hi=5), dtype=dtype)


BCAST = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 5), (3, 1)), ((1,), (6, 2)), ((0, 4), (1, 4)), ((), (2, 3))]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sa,sb", BCAST)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum"])
def test_binary(op, sa, sb, dtype):
    b = rn(*sb)
    if op == "div":
        b = np.where(np.abs(b) < 0.3, 0.7, b).astype(np.float32)
    check(lambda L, x, y: getattr(L, op)(x, y), rn(*sa), b, dtype=dtype)


def test_operators_and_scalars():
    check(lambda L, x, y: (x + 2.5) * y - 1.0 / (x * x + 1.0) + 3.0 - y / 4.0 + 2 ** x.clamp(-1, 1), rn(4, 5), rn(4, 5))
    check(lambda L, x: x ** 3 + (x * x) ** 0.5, rn(3, 7, lo=0.2, hi=2))
    check(lambda L, x, y: x ** y, rn(3, 4, lo=0.5, hi=2), rn(3, 4))


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_arithmetic(dtype):
    a = R.integers(-50, 50, size=(4, 6)).astype(dtype)
    b = R.integers(-50, 50, size=(6,)).astype(dtype)
    check(lambda L, x, y: x + y * 3 - y, a, b, grad=False)
    check(lambda L, x, y: L.maximum(x, y), a, b, grad=False)
    check(lambda L, x: -x, a, grad=False)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_compare(op):
    a = R.integers(0, 3, size=(4, 5)).astype(np.float32)
    b = R.integers(0, 3, size=(5,)).astype(np.float32)
    check(lambda L, x, y: getattr(L, op)(x, y), a, b, grad=False)
    check(lambda L, x: getattr(L, op)(x, 1.0), a, grad=False)


def test_where_masked_fill_clamp():
    c = R.random((3, 4)) > 0.5
    check(lambda L, m, x, y: L.where(m, x, y), c, rn(3, 4), rn(4))
    check(lambda L, m, x: x.masked_fill(m, -7.0), c, rn(3, 4))
    check(lambda L, x: x.clamp(-0.5, 0.75), rn(5, 6))
    check(lambda L, x: L.where(x > 0, x, 0.0), rn(5, 6))


def T(x):
    return x.transpose(0, 1)


def S(x):
    return x[::2, 1:]


@pytest.mark.parametrize("dtype", FLOATS)
def test_non_contiguous_inputs(dtype):
    check(lambda L, x, y: x * y + x.exp(), rn(6, 5), rn(5, 6), views=[None, T], dtype=dtype)
    check(lambda L, x: (x * 2).sum(), rn(9, 7), views=[S], dtype=dtype)
    check(lambda L, x: x.permute(2, 0, 1).sigmoid(), rn(2, 3, 4), dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,dim,keep", [((7,), None, False), ((3, 5), 1, True), ((3, 5), 0, False), ((4, 3, 5), (0, 2), False),
                                            ((2, 3, 4), -1, True), ((2, 3, 4), (1,), False), ((1, 300), 1, False),
                                            ((0, 3), 0, False), ((5, 1), 1, True)])
def test_sum_mean(shape, dim, keep, dtype):
    check(lambda L, x: x.sum(dim=dim, keepdim=keep) if dim is not None else x.sum(), rn(*shape), dtype=dtype, scale=4)
    if 0 not in shape:
        check(lambda L, x: x.mean(dim=dim, keepdim=keep) if dim is not None else x.mean(), rn(*shape), dtype=dtype, scale=4)


def test_long_row_sum_uses_chunks():
    check(lambda L, x: x.sum(dim=1), rn(3, 50001), scale=20)
    check(lambda L, x: x.sum(), rn(100003), scale=50)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_max_min_argmax_var(dim):
    x = rn(6, 9)
    check(lambda L, t: t.max(dim=dim).values, x)
    check(lambda L, t: t.min(dim=dim, keepdim=True).values, x)
    check(lambda L, t: t.argmax(dim=dim), x, grad=False)
    check(lambda L, t: t.argmin(dim=dim), x, grad=False)
    check(lambda L, t: t.var(dim=dim), x, scale=4)
    check(lambda L, t: t.max(), x)
    h = hl.tensor(x).max(dim=dim)
    np.testing.assert_array_equal(h.indices.numpy(), x.argmax(axis=dim))


def test_argmax_ties_pick_first():
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    assert hl.tensor(x).argmax(dim=1).numpy().tolist() == [1, 0]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sa,sb", [((5, 7), (7, 3)), ((1, 1), (1, 1)), ((65, 33), (33, 70)), ((2, 4, 5), (5, 6)),
                                   ((3, 1, 4, 5), (2, 5, 3)), ((7,), (7, 2)), ((3, 7), (7,)), ((0, 4), (4, 3)),
                                   ((4, 0), (0, 3))])
def test_matmul(sa, sb, dtype):
    check(lambda L, a, b: a @ b, rn(*sa), rn(*sb), dtype=dtype, scale=8 if dtype == "float32" else 4)


def test_matmul_transposed_views():
    check(lambda L, a, b: a.transpose(-1, -2) @ b, rn(2, 9, 6), rn(9, 4), scale=8)
    check(lambda L, a, b: a @ b.mT, rn(5, 8), rn(3, 8), scale=8)
    # attention-shaped: [B, T, H, D] permuted to [B, H, T, D]
    check(lambda L, q, k: q.permute(0, 2, 1, 3) @ k.permute(0, 2, 3, 1), rn(2, 5, 3, 4), rn(2, 5, 3, 4), scale=8)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,dim", [((4, 10), -1), ((3, 5, 7), 1), ((2, 1000), -1), ((1, 1), 0), ((5,), 0)])
def test_softmax(shape, dim, dtype):
    check(lambda L, x: L.softmax(x, dim=dim), rn(*shape, lo=-5, hi=5), dtype=dtype)
    check(lambda L, x: L.log_softmax(x, dim=dim), rn(*shape, lo=-5, hi=5), dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 33), (1, 1000)])
def test_layer_norm(shape, dtype):
    C = shape[-1]
    check(lambda L, x, w, b: L.nn.functional.layer_norm(x, (C,), w, b) if L.__name__ == "torch" else L.layer_norm(x, (C,), w, b),
          rn(*shape), rn(C), rn(C), dtype=dtype, scale=4)


@pytest.mark.parametrize("dtype", FLOATS)
def test_embedding_and_cross_entropy(dtype):
    idx = R.integers(0, 11, size=(3, 7)).astype(np.int64)
    check(lambda L, i, w: (L.nn.functional.embedding(i, w) if L.__name__ == "torch" else L.embedding(i, w)) * 1.0,
          idx, rn(11, 5), dtype=dtype)
    tgt = R.integers(0, 13, size=(6,)).astype(np.int64)
    check(lambda L, x, t: L.nn.functional.cross_entropy(x, t) if L.__name__ == "torch" else L.cross_entropy(x, t),
          rn(6, 13, lo=-4, hi=4), tgt, dtype=dtype)


def test_cross_entropy_ignore_index():
    tgt = np.array([1, -100, 3, -100, 0], np.int64)
    check(lambda L, x, t: L.nn.functional.cross_entropy(x, t, ignore_index=-100) if L.__name__ == "torch" else L.cross_entropy(x, t),
          rn(5, 4), tgt)


def test_views_reshape_slicing_expand():
    check(lambda L, x: x.reshape(3, 2, 4).transpose(0, 2)[1:, ::2] * 2, rn(6, 4))
    check(lambda L, x: x[..., None, 1].expand(2, 5, 3).sum(dim=1), rn(5, 4))
    check(lambda L, x: x.unsqueeze(0).squeeze(0).flatten() * 1.0, rn(2, 3, 2))
    check(lambda L, x: x.T.contiguous().view(-1) * 1.0, rn(3, 4))
    check(lambda L, x: x[2] + x[-1, 1:3].sum(), rn(4, 5))


def test_cat_stack_split_chunk_tril():
    check(lambda L, a, b: L.cat([a, b, a], dim=1), rn(2, 3), rn(2, 5))
    check(lambda L, a, b: L.stack([a, b], dim=1), rn(4, 3), rn(4, 3))
    check(lambda L, a: L.cat([p * (i + 1) for i, p in enumerate(L.split(a, 2, dim=0))], dim=0), rn(5, 3))
    check(lambda L, a: L.cat([p * (i + 1) for i, p in enumerate(L.chunk(a, 3, dim=1))], dim=1), rn(2, 7))
    check(lambda L, a: L.tril(a) + L.triu(a, diagonal=1) * 2, rn(5, 6))


@pytest.mark.parametrize("src,dst", [("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32"),
                                     ("float32", "int32"), ("int64", "float32"), ("int32", "int64"), ("float32", "bool"),
                                     ("bool", "float32"), ("bfloat16", "float16")])
def test_casts(src, dst):
    import torch

    from parity import TORCH_DTYPE
    x = (rn(4, 6) * 20).round(1) if src != "bool" else (R.random((4, 6)) > 0.5)
    h = hl.tensor(x, dtype=src).to(dst)
    t = torch.tensor(x).to(TORCH_DTYPE[src]).to(TORCH_DTYPE[dst])
    tv = t.float().numpy() if dst == "bfloat16" else t.numpy()
    np.testing.assert_array_equal(h.numpy(), tv)


def test_split_with_unused_pieces_and_reuse():
    check(lambda L, a: L.split(a, 2, dim=1)[1] * 3.0, rn(3, 6))
    check(lambda L, a: L.split(a, 2, dim=0)[0] * L.split(a, 2, dim=0)[2] + L.split(a, 2, dim=0)[0], rn(6, 4))


def test_index_select_and_cast_gradients():
    idx = np.array([2, 0, 2, 1], np.int64)
    check(lambda L, x, i: L.index_select(x, 1, i) * 2.0, rn(3, 4), idx)
    check(lambda L, x, i: x[i] * 1.5, rn(3, 5), idx)
    check(lambda L, x: (x.to(L.float16) * 2).to(L.float32), rn(4, 5))
    check(lambda L, x: (x.to(L.bfloat16) + 1).to(L.float32).sum(dim=0), rn(4, 5))


def test_linear_attention_softmax_split_heads():
    import torch

    def lin(L, x, w, b):
        return torch.nn.functional.linear(x, w, b) if L.__name__ == "torch" else L.functional.linear(x, w, b)

    check(lin, rn(3, 5, 7), rn(4, 7), rn(4))
    check(lin, rn(9, 7), rn(6, 7), rn(6))
    check(lambda L, x, w: (x @ w.mT) if L.__name__ == "torch" else L.functional.linear(x, w), rn(2, 3, 8), rn(5, 8))

    def att(L, s):
        if L.__name__ == "torch":
            T = s.shape[-1]
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            return (s * 0.3).masked_fill(~mask, float("-inf")).softmax(-1)
        return L.functional.attention_softmax(s, 0.3, causal=True)

    check(att, rn(2, 3, 7, 7, lo=-4, hi=4))
    check(lambda L, s: (s * 0.5).softmax(-1) if L.__name__ == "torch" else L.functional.attention_softmax(s, 0.5),
          rn(4, 6, 9))

    def heads(L, qkv):
        B, T, C3 = qkv.shape
        C = C3 // 3
        if L.__name__ == "torch":
            q, k, v = (t.reshape(B, T, 2, C // 2).transpose(1, 2) for t in qkv.split(C, dim=2))
        else:
            q, k, v = L.functional.split_heads(qkv, 2)
        return q * 1.0 + k * 2.0 - v * 0.5

    check(heads, rn(2, 5, 12))
