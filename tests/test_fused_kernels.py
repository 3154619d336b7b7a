"""Fused kernels of the training step (helios.fused_kernels): each fused pattern against its unfused
twin bit for bit (forward values and every gradient), GPT AdamW steps with fusion on and off
(fp32 and bf16 autocast) bit for bit, and the dispatches the fusion removes."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

import helios as hl
import helios.functional as F
from helios import _kernels as K
from helios._kernels.core import column_chunks
from helios import dtypes as dt
from helios import elementwise_jit, fused_kernels
from helios.errors import ShapeError
from helios.functional import nn_ops
from helios.nn import GPT, GPTConfig, Parameter
from helios.optim import AdamW, clip_grad_norm_
from helios.runtime import get_runtime

sys.path.insert(0, os.path.dirname(__file__))
from switches import count_dispatches, switched  # noqa: E402

pytestmark = pytest.mark.vulkan


@contextlib.contextmanager
def fused(enabled: bool):
    """The fused kernels on or off (helios.fused_kernels.ENABLED) inside the block; the run-time
    elementwise chain fusion (helios.elementwise_jit, tested in test_elementwise_jit.py) off, so the
    counts here are the fused patterns' alone."""
    with switched(fused_kernels, "ENABLED", enabled), switched(elementwise_jit, "ENABLED", False):
        yield


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_bits_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(_bits(x), _bits(y))


def _dtypes():
    out = ["float32"]
    if get_runtime().features.get("storage16", False):
        out += ["bfloat16", "float16"]
    return out


# (input shape, out features): a GPT activation, a ragged one (no vec4 stores, clamped tiles)
# and a tall 2-D one (the 32-row register blocks).
SHAPES = [((2, 16, 32), 32), ((3, 5, 24), 40), ((80, 64), 96)]


def _pattern_run(fn, enabled: bool, dtype: str, shape, n_out: int, with_bias: bool = True):
    rng = np.random.default_rng(1)
    k = shape[-1]
    arrs = [rng.standard_normal(shape), rng.standard_normal((n_out, k)) * 0.2, rng.standard_normal(n_out),
            rng.standard_normal(shape[:-1] + (n_out,))]
    ts = [hl.tensor(a.astype(np.float32)).to(getattr(hl, dtype)).requires_grad_() for a in arrs]
    x, w, b, r = ts
    with fused(enabled), count_dispatches() as names:
        y = fn(x, w, b if with_bias else None, r)
    # a loss that gives every element its own gradient
    (y.float() * y.float()).sum().backward()
    grads = [t.grad for t in ts]
    return [y.float().numpy()] + [g.float().numpy() for g in grads if g is not None], names


PATTERNS = {
    "linear+residual": (lambda x, w, b, r: F.linear_residual(x, w, b, r),
                        lambda x, w, b, r: r + F.linear(x, w, b)),
    "linear+gelu": (lambda x, w, b, r: F.linear_gelu(x, w, b),
                    lambda x, w, b, r: F.gelu(F.linear(x, w, b), approximate="tanh")),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fused_pattern_equals_its_unfused_twin_bit_for_bit(name, dtype):
    if dtype not in _dtypes():
        pytest.skip("no 16-bit storage on this device")
    fn, twin = PATTERNS[name]
    for shape, n_out in SHAPES:
        for with_bias in (True, False):
            on, names_on = _pattern_run(fn, True, dtype, shape, n_out, with_bias)
            off, names_off = _pattern_run(fn, False, dtype, shape, n_out, with_bias)
            ref, _ = _pattern_run(twin, True, dtype, shape, n_out, with_bias)
            _assert_bits_equal(on, off)
            _assert_bits_equal(on, ref)
            assert names_on[name] == 1 and names_on["matmul"] == 0  # one kernel, by its name
            assert names_off[name] == 0 and names_off["matmul"] == 1


def _mlp_run(enabled: bool, dtype: str, shape, hidden: int, with_bias: bool, fn):
    rng = np.random.default_rng(4)
    c = shape[-1]
    arrs = [rng.standard_normal(shape), rng.standard_normal((hidden, c)) * 0.3, rng.standard_normal(hidden),
            rng.standard_normal((c, hidden)) * 0.3, rng.standard_normal(c), rng.standard_normal(shape)]
    ts = [hl.tensor(a.astype(np.float32)).to(getattr(hl, dtype)).requires_grad_() for a in arrs]
    x, w1, b1, w2, b2, r = ts
    if not with_bias:
        b1 = b2 = None
    with fused(enabled), count_dispatches() as names:
        y = fn(x, w1, b1, w2, b2, r)
        (y.float() * y.float()).sum().backward()
    return [y.float().numpy()] + [t.grad.float().numpy() for t in ts if t.grad is not None], names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_block_fused_equals_the_separate_ops_bit_for_bit(dtype):
    if dtype not in _dtypes():
        pytest.skip("no 16-bit storage on this device")

    def twin(x, w1, b1, w2, b2, r):
        return r + F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    for shape, hidden in (((2, 16, 32), 128), ((3, 5, 8), 24)):
        for with_bias in (True, False):
            on, names_on = _mlp_run(True, dtype, shape, hidden, with_bias, F.mlp_residual)
            off, names_off = _mlp_run(False, dtype, shape, hidden, with_bias, F.mlp_residual)
            ref, _ = _mlp_run(True, dtype, shape, hidden, with_bias, twin)
            _assert_bits_equal(on, off)
            _assert_bits_equal(on, ref)
            assert names_on["matmul+gelu_tanh_bwd"] == 1 and names_on["gelu_tanh_bwd"] == 0
            assert names_off["gelu_tanh_bwd"] == 1
            assert sum(names_off.values()) - sum(names_on.values()) == 3  # add, gelu_tanh, gelu_tanh_bwd


def test_fused_kernels_name_their_parts_at_debug_and_refuse_bad_arguments():
    class Rt:
        debug = 0

    rt = Rt()
    assert fused_kernels.dispatch_name("linear+gelu", rt) == "linear+gelu"
    rt.debug = 1
    assert fused_kernels.dispatch_name("linear+gelu", rt) == "linear+gelu[matmul > +bias > gelu_tanh]"
    assert fused_kernels.dispatch_name("linear+residual", rt) == "linear+residual[matmul > +bias > add]"
    x, w = hl.ones((4, 8)), hl.ones((8, 8))
    with pytest.raises(ValueError, match="matmul_epilogue: name must be one of"):
        K.matmul_epilogue("linear+relu", x, w, None, None)
    with pytest.raises(ShapeError, match="linear\\+residual: e must be a contiguous float32 tensor of shape"):
        K.matmul_epilogue("linear+residual", x, w, None, hl.ones((4, 4)))
    # a residual the kernel cannot read in place takes the unfused path, same values
    r = hl.ones((8, 4)).transpose(0, 1)
    with count_dispatches() as names:
        y = F.linear_residual(x, w, None, r)
    assert names["linear+residual"] == 0 and np.array_equal(y.numpy(), np.full((4, 8), 9.0, np.float32))


def test_fused_ops_carry_their_names_into_the_profile():
    from helios.profile.profiler import profile

    x, w, b, r = (hl.ones(s).requires_grad_() for s in ((2, 4, 8), (8, 8), (8,), (2, 4, 8)))
    with fused(True), profile() as prof:
        y = F.linear_gelu(F.linear_residual(x, w, b, r), w, b)
        y.sum().backward()
        get_runtime().synchronize()
    col = prof.collector
    ops = {op.name for op in col.ops}
    kernels = {e.name for e in col.events}
    assert {"linear+residual", "linear+gelu", "linear+gelu_backward"} <= ops
    assert {"linear+residual", "linear+gelu"} <= kernels  # the trace's kernels
    assert "gelu_tanh" not in kernels and "linear" not in ops  # no unfused forward parts


def _residual_ln_run(enabled: bool, dtype: str, shape, pending: bool = True, bias: bool = True):
    """x feeding a LayerNorm and (``pending``) a residual use (the block's stream), else the
    LayerNorm alone; the values and the gradients of x and of the LayerNorm's parameters, and
    the kernels backward ran."""
    rng = np.random.default_rng(2)
    c = shape[-1]
    arrs = [rng.standard_normal(shape), rng.standard_normal(c), rng.standard_normal(c), rng.standard_normal(shape)]
    x0, w, b, r = (hl.tensor(a.astype(np.float32)).to(getattr(hl, dtype)).requires_grad_() for a in arrs)
    with fused(enabled):
        x = x0 * 1.5  # a non-leaf, as the residual stream is
        ln = F.layer_norm(x, (c,), w, b if bias else None)
        y = x * r + ln if pending else ln * r
        with count_dispatches() as names:
            (y.float() * y.float()).sum().backward()
    return [y.float().numpy()] + [t.grad.float().numpy() for t in (x0, w, b, r) if t.grad is not None], names


# (shape, a pending gradient to add?, a bias?): on a CPU device one invocation a row and a
# column (several workgroups of each in the fourth and the last), and a workgroup a row (15 rows,
# or long rows); on a GPU a workgroup a row, the last case's columns in 4 runs (partials, then
# their sums: a second dispatch)
LN_BWD_CASES = [((2, 8, 32), True, True), ((2, 8, 32), False, True), ((2, 8, 32), True, False),
                ((70, 100), False, False), ((3, 5, 20), True, True), ((4, 600), True, True), ((300, 48), True, True)]


@pytest.mark.parametrize("device", ["cpu", "discrete"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_norm_backward_adds_the_pending_gradient_bit_for_bit(monkeypatch, dtype, device):
    if dtype not in _dtypes():
        pytest.skip("no 16-bit storage on this device")
    rt = get_runtime()
    if rt.info["type"] != "cpu" and device == "cpu":
        pytest.skip("the CPU-driver row plans need a CPU device")
    monkeypatch.setitem(rt.info, "type", device)  # the row plans and the column runs follow it
    for shape, pending, bias in LN_BWD_CASES:
        on, names_on = _residual_ln_run(True, dtype, shape, pending, bias)
        off, names_off = _residual_ln_run(False, dtype, shape, pending, bias)
        _assert_bits_equal(on, off)
        assert len(on) == 4 + bias
        # the input and parameter gradients in one dispatch, and where the columns are summed in
        # runs, the dispatch that adds the runs' partials
        runs = column_chunks(rt, int(np.prod(shape[:-1])), shape[-1])[0]
        fused_name = ("layer_norm_bwd+acc" if pending else "layer_norm_bwd") + "+params"
        assert names_on[fused_name] == 1 and names_on["layer_norm_bwd_params"] == (runs > 1)
        assert sum(n.startswith("layer_norm_bwd") for n in names_on.elements()) == 1 + (runs > 1)
        assert names_off["layer_norm_bwd"] == 1 and names_off["layer_norm_bwd_params"] == 1 + (runs > 1)
        assert names_off["add"] - names_on["add"] == pending
    if device == "discrete":
        assert runs == 4


def test_layer_norm_backward_in_one_dispatch_writes_the_parameter_slots():
    # dw and db into their slots of one flat buffer, as layer_norm_bwd_params does; a frozen weight
    # (used, no gradient); the names at HELIOS_DEBUG
    rng = np.random.default_rng(3)
    rows, c = 40, 24
    x, g = (hl.tensor(rng.standard_normal((rows, c)).astype(np.float32)) for _ in range(2))
    w = hl.tensor(rng.standard_normal(c).astype(np.float32))
    _, mean, rstd = K.layer_norm_fwd(x, w, None, 1e-5)
    outs = []
    for one in (True, False):
        flat = hl.zeros((2 * c + 8,))
        dw_out, db_out = flat[4:4 + c], flat[c + 8:]
        with count_dispatches() as names:
            if one:
                dx, dw, db = K.layer_norm_bwd(x, w, g, mean, rstd, True, True, None, dw_out, db_out)
                _, dw1, db1 = K.layer_norm_bwd(x, w, g, mean, rstd, False, True)
            else:
                dx = K.layer_norm_bwd_input(x, w, g, mean, rstd)
                dw, db = K.layer_norm_bwd_params(x, g, mean, rstd, True, True, dw_out, db_out)
                dw1, db1 = K.layer_norm_bwd_params(x, g, mean, rstd, False, True)
        assert dw is dw_out and db is db_out and dw1 is None
        outs.append([dx.numpy(), flat.numpy(), db1.numpy()])
        if one and K._row_plan(get_runtime(), rows, c)[1]:
            assert names["layer_norm_bwd+params"] == 2 and len(names) == 1
    _assert_bits_equal(outs[0], outs[1])
    assert np.array_equal(outs[0][1][c + 8:], outs[0][2]) and not outs[0][1][:4].any()

    class Rt:
        debug = 1

    assert fused_kernels.dispatch_name("layer_norm_bwd+acc+params", Rt()) == \
        "layer_norm_bwd+acc+params[layer_norm_bwd > add > layer_norm_bwd_params]"


def test_grad_pending_is_refused_where_it_cannot_be_taken():
    # a LayerNorm whose input has no other use gets nothing to add; a leaf input without a
    # packed gradient slot neither
    with fused(True):
        x0 = hl.ones((2, 4)).requires_grad_()
        with count_dispatches() as names:
            F.layer_norm(x0 * 2.0, (4,)).sum().backward()
            F.layer_norm(x0, (4,)).sum().backward()
    assert names["layer_norm_bwd+acc"] == 0 and names["layer_norm_bwd"] == 2
    with pytest.raises(ShapeError, match="layer_norm_bwd_input: acc must be a contiguous float32 tensor"):
        K.layer_norm_bwd_input(hl.ones((2, 4)), None, hl.ones((2, 4)), hl.ones((2,)), hl.ones((2,)), hl.ones((4, 2)))


@pytest.mark.parametrize("dtype", _dtypes())
def test_embedding_backward_adds_into_the_gradient_it_is_given_bit_for_bit(dtype):
    # rows used several times, once, and never (their sum is 0.0, added all the same)
    rt, V, C = get_runtime(), 7, 70
    rng = np.random.default_rng(0)
    idx = np.array([[3, 0, 3, 5], [5, 3, 1, 0]])
    order, rowptr = nn_ops._group_by_row(idx, V)
    pos, rp = K.from_numpy(order, dt.int64, rt), K.from_numpy(rowptr, dt.int32, rt)
    tdt = getattr(hl, dtype)
    g = hl.tensor(rng.standard_normal((idx.size, C)).astype(np.float32)).to(tdt)
    before = rng.standard_normal((V, C)).astype(np.float32)
    before[2, :3] = [-0.0, 0.0, 1e30]
    slot = hl.tensor(before).to(tdt)
    want = (slot + K.embedding_bwd(g, pos, rp, V)).float().numpy()
    with count_dispatches() as names:
        got = K.embedding_bwd(g, pos, rp, V, out=slot, add=True)
    assert got is slot and names["embedding_bwd+acc"] == 1 and sum(names.values()) == 1
    _assert_bits_equal([slot.float().numpy()], [want])
    with pytest.raises(ValueError, match="add=True needs the gradient to add to"):
        K.embedding_bwd(g, pos, rp, V, add=True)


@pytest.mark.parametrize("passes", [1, 2])
def test_a_tied_table_gets_the_embedding_gradient_added_in_its_slot(passes):
    # x = table[idx] -> LayerNorm -> x @ table^T: the head's backward writes the table's slot,
    # the embedding's adds its gradient there (a second pass: both add to what the first left)
    rng = np.random.default_rng(1)
    V, C = 11, 8
    start = rng.standard_normal((V, C)).astype(np.float32)
    idx = rng.integers(0, V - 2, (3, 5))  # the last two rows get only the head's gradient
    grads, counts = [], []
    for enabled in (True, False):
        table = Parameter(hl.tensor(start))
        AdamW([table], lr=0.0)
        with fused(enabled), count_dispatches() as names:
            for _ in range(passes):
                logits = F.linear(F.layer_norm(F.embedding(hl.tensor(idx), table), (C,)), table)
                (logits * logits).sum().backward()
        assert table.grad._st is table._grad_slot._st
        grads.append(table.grad.numpy().copy())
        counts.append(names)
    _assert_bits_equal(grads[:1], grads[1:])
    on, off = counts
    assert on["embedding_bwd+acc"] == passes and off["embedding_bwd+acc"] == 0
    assert off["add"] - on["add"] == passes
    # and it is the gradient: float64 by hand
    w, x = start.astype(np.float64), start.astype(np.float64)[idx]
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5)
    dlogits = 2 * (h @ w.T)
    dh = dlogits @ w
    dx = (dh - dh.mean(-1, keepdims=True) - h * (dh * h).mean(-1, keepdims=True)) / np.sqrt(var + 1e-5)
    want = np.einsum("btv,btc->vc", dlogits, h)
    np.add.at(want, idx.reshape(-1), dx.reshape(-1, C))
    np.testing.assert_allclose(grads[0], passes * want, rtol=1e-4, atol=1e-4)


def _embedding_add_run(enabled: bool, dtype: str, idx, pos, packed: bool):
    """F.embedding_add over two fresh tables (AdamW-packed gradient slots or not): the output,
    both tables' gradients (as float32) and the dispatches of forward and backward."""
    rng = np.random.default_rng(3)
    tables = [Parameter(hl.tensor(rng.standard_normal(shape).astype(np.float32)).to(getattr(hl, dtype)))
              for shape in ((9, 12), (7, 12))]
    if packed and dtype == "float32":  # (AdamW packs float32 parameters)
        AdamW(tables, lr=0.0)
    g = hl.tensor(rng.standard_normal(idx.shape + (12,)).astype(np.float32)).to(getattr(hl, dtype))
    with fused(enabled), count_dispatches() as names:
        out = F.embedding_add(hl.tensor(idx), tables[0], hl.tensor(pos), tables[1])
        (out.float() * g.float()).sum().backward()
    return [out.float().numpy()] + [t.grad.float().numpy() for t in tables], names


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("pos, packed", [([0, 1, 2, 3, 4], True), ([6, 2, 0, 5, 1], False), ([3, 1, 3, 0, 1], True)])
def test_embedding_add_equals_the_separate_ops_bit_for_bit(dtype, pos, packed):
    # token rows used more than once; positions in order, shuffled, or repeated (then the
    # position table's gradient is the batch sum and the embedding backward, as unfused)
    idx, pos = np.array([[4, 0, 4, 8, 2], [1, 4, 4, 0, 7], [3, 3, 8, 5, 0]]), np.array(pos)
    on, n_on = _embedding_add_run(True, dtype, idx, pos, packed)
    off, n_off = _embedding_add_run(False, dtype, idx, pos, packed)
    _assert_bits_equal(on, off)
    assert n_on["embedding+add"] == 1 and n_on["embedding"] == n_on["add"] == 0 and n_off["embedding"] == 2
    repeated = len(set(pos.tolist())) < len(pos)
    assert n_on["sum+embedding_bwd"] == (0 if repeated else 1) and n_on["embedding_bwd"] == (2 if repeated else 1)
    if dtype == "float32":  # and the values: the rows added, each row's gradient summed where it was used
        rng = np.random.default_rng(3)
        t0, t1, g = (rng.standard_normal(shape).astype(np.float32) for shape in ((9, 12), (7, 12), idx.shape + (12,)))
        d0, d1 = np.zeros_like(t0, np.float64), np.zeros_like(t1, np.float64)
        np.add.at(d0, idx.reshape(-1), g.reshape(-1, 12))
        np.add.at(d1, np.tile(pos, len(idx)), g.reshape(-1, 12))
        np.testing.assert_array_equal(on[0], t0[idx] + t1[pos])
        np.testing.assert_allclose(on[1], d0, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(on[2], d1, rtol=1e-5, atol=1e-6)


def test_embedding_add_takes_the_separate_ops_where_it_cannot_fuse_and_refuses_bad_indices():
    rt = get_runtime()
    rng = np.random.default_rng(4)
    w, w2 = (hl.tensor(rng.standard_normal(shape).astype(np.float32)) for shape in ((9, 4), (7, 4)))
    with fused(True), count_dispatches() as names:
        one_row = F.embedding_add(hl.tensor([1, 2]), w, hl.tensor([0, 1]), w2)  # idx 1-D: no batch of rows
    assert names["embedding"] == 2 and names["embedding+add"] == 0
    np.testing.assert_array_equal(one_row.numpy(), w.numpy()[[1, 2]] + w2.numpy()[[0, 1]])
    with fused(True), pytest.raises(IndexError, match="index 7 is out of range for a table of 7 rows"):
        F.embedding_add(hl.tensor([[1, 2]]), w, hl.tensor([0, 7]), w2)
    with pytest.raises(ShapeError, match="want one floating dtype"):
        K.embedding_add_fwd(w, K.from_numpy(np.zeros((1, 2), np.int64), dt.int64, rt), w2.to(hl.bfloat16),
                            K.from_numpy(np.zeros(2, np.int64), dt.int64, rt))


def test_a_layer_norm_of_a_packed_leaf_adds_the_gradient_its_slot_holds():
    # (p * 2).sum()'s gradient reaches p's slot first; LayerNorm's backward then takes the slot
    # (Context.grad_pending) and adds it in its store, into new memory the tape copies to the slot
    start = np.random.default_rng(2).standard_normal((6, 8)).astype(np.float32)
    grads, counts = [], []
    for enabled in (True, False):
        p = Parameter(hl.tensor(start))
        AdamW([p], lr=0.0)
        with fused(enabled), count_dispatches() as names:
            ((p * 2.0).sum() + (F.layer_norm(p, (8,)) ** 2).sum()).backward()
        assert p.grad._st is p._grad_slot._st
        grads.append(p.grad.numpy().copy())
        counts.append(names)
    _assert_bits_equal(grads[:1], grads[1:])
    assert counts[0]["layer_norm_bwd+acc"] == 1 and counts[1]["layer_norm_bwd+acc"] == 0
    x = start.astype(np.float64)
    r = 1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    y = (x - x.mean(-1, keepdims=True)) * r
    dy = 2 * y
    want = 2.0 + r * (dy - dy.mean(-1, keepdims=True) - y * (dy * y).mean(-1, keepdims=True))
    np.testing.assert_allclose(grads[0], want, rtol=1e-4, atol=1e-5)


def _gpt_run(enabled: bool, steps: int = 2, dtype=None, n_layer: int = 2):
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32)
    model = GPT(cfg, seed=0)
    params = list(model.parameters())
    opt = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    losses, names = [], None
    with fused(enabled):
        for _ in range(steps):
            x, y = rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))
            with count_dispatches() as names:
                with hl.autocast(dtype) if dtype else contextlib.nullcontext():
                    _, loss = model(hl.tensor(x), hl.tensor(y))
                loss.backward()
                clip_grad_norm_(params, 0.5)  # biting: the coefficient is below 1
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    return losses, [p.numpy().copy() for p in params], names


def test_gpt_adamw_steps_with_fusion_on_and_off_are_bit_identical():
    on = _gpt_run(True)
    off = _gpt_run(False)
    assert on[0] == off[0]  # losses, exactly
    _assert_bits_equal(on[1], off[1])  # every parameter after 2 steps
    n_layer = 2
    # per layer: the two residual adds ride in the projections, the GELU in c_fc, and
    # backward's two residual-stream gradient adds in ln_1's and ln_2's input gradients
    assert on[2]["linear+residual"] == 2 * n_layer and on[2]["linear+gelu"] == n_layer
    # and each LayerNorm's input and parameter gradients in one dispatch (CPU devices: one
    # invocation a row)
    one = K._row_plan(get_runtime(), 4 * 16, 32)[1]
    assert on[2]["layer_norm_bwd+acc+params" if one else "layer_norm_bwd+acc"] == 2 * n_layer
    assert on[2]["layer_norm_bwd_params"] == (0 if one else 2 * n_layer + 1)
    # (and the tied table's second gradient, the embedding's, added in its store: embedding_bwd+acc;
    # the token and position rows added in their gather: embedding+add)
    assert off[2]["add"] - on[2]["add"] == 4 * n_layer + 2
    assert on[2]["embedding_bwd+acc"] == 1 and off[2]["embedding_bwd+acc"] == 0
    # one gather of both tables forward; backward the position table's batch sum in its embedding backward
    assert on[2]["embedding+add"] == 1 and on[2]["embedding"] == 0 and off[2]["embedding"] == 2
    assert on[2]["sum+embedding_bwd"] == 1 and on[2]["embedding_bwd"] == 0 and off[2]["embedding_bwd"] == 2
    assert off[2]["gelu_tanh"] - on[2]["gelu_tanh"] == n_layer
    # the clip: no g * g temporary, and sqrt, add_s, rdiv_s, clamp in the reduction's last pass
    # (the flat buffer is long enough for two passes: squares into partials, then the chain)
    assert on[2]["sum_squares"] == 1 and on[2]["sum+clip_coef"] == 1
    for op in ("sqrt", "add_s", "rdiv_s", "clamp"):
        assert on[2][op] == 0 and off[2][op] == 1
    assert off[2]["mul"] - on[2]["mul"] == 1
    assert on[2]["matmul+gelu_tanh_bwd"] == n_layer and on[2]["gelu_tanh_bwd"] == 0
    # the tied table's second gradient added in its slot: no temporary copied there
    assert off[2]["copy"] - on[2]["copy"] == 1
    # every Linear's bias gradient in its weight gradient's matmul (CPU devices)
    bias_grads = on[2]["matmul+bias_grad"]
    assert bias_grads in (0, 4 * n_layer) and off[2]["matmul+bias_grad"] == 0
    assert sum(off[2].values()) - sum(on[2].values()) == 6 * n_layer + 5 + 5 + bias_grads + one * (2 * n_layer + 1)


def test_gpt_under_bf16_autocast_with_fusion_on_and_off_is_bit_identical():
    if "bfloat16" not in _dtypes():
        pytest.skip("no 16-bit storage on this device")
    on = _gpt_run(True, dtype="bfloat16")
    off = _gpt_run(False, dtype="bfloat16")
    assert on[0] == off[0]
    _assert_bits_equal(on[1], off[1])
    # Each Linear is one bf16 product that rounds its fp32 operands (the master weights, the
    # LayerNorm outputs) as it loads them: c_fc with its GELU, the projections with their fp32
    # residual add, backward's two products per Linear too; so are the products of the fp32
    # softmax with v and of ln_f's output with the tied table (tests/test_mixed_matmul.py).
    n_layer = 2
    if not get_runtime().has_gemm("bfloat16"):
        assert on[2]["cast+linear+gelu"] == n_layer and on[2]["cast+linear+residual"] == 2 * n_layer
        # c_attn forward, each Linear's two backward products, att @ v's three; the head's three;
        # on CPU devices each Linear's weight gradient also sums its bias gradient
        bias_grads = on[2]["cast+matmul+bias_grad"]
        assert bias_grads in (0, 4 * n_layer) and off[2]["cast+matmul+bias_grad"] == 0
        # (less the MLP's c_proj input gradient, whose product multiplies by gelu'(u) too)
        assert on[2]["cast+matmul"] + bias_grads == (1 + 2 * 4 + 3 - 1) * n_layer + 3 and off[2]["cast+matmul"] == 0
        assert off[2]["gelu_tanh"] - on[2]["gelu_tanh"] == n_layer
        assert on[2]["cast+matmul+gelu_tanh_bwd"] == n_layer and on[2]["gelu_tanh_bwd"] == 0
        # casts gone per layer: forward c_attn's and c_fc's x, W, b, the projections' W, b and
        # promoted product, att; backward the x and W gradients of c_attn and c_fc, the W gradients
        # of the projections, att's (20); the head's x and table both ways (4); and the tied
        # table's second gradient copy, as in fp32; with the bias gradients in the products, each
        # one's bf16 rounding and widening casts and its column sum too; the logits' float32 copy
        # for the loss and its gradient's cast back (2); each layer's attention scores to the
        # float32 softmax and their gradient back (2 a layer); where the bias gradients are in the
        # products, the projections' float32 output gradients, rounded by backward's products as
        # they load them (2 a layer; else their bias sums read them cast)
        projections_g = 2 * n_layer if bias_grads else 0
        assert off[2]["copy"] - on[2]["copy"] == 20 * n_layer + 4 + 1 + 2 * bias_grads + 2 + 2 * n_layer + projections_g
        assert on[2]["cast+cross_entropy"] == on[2]["cross_entropy_bwd+cast"] == 1
        assert on[2]["cast+softmax"] == on[2]["softmax_bwd+cast"] == n_layer
        # (+ the clip's two passes' sums, and the position table's batch sum: sum+embedding_bwd)
        assert off[2]["sum"] - on[2]["sum"] == bias_grads + 3
    # ln_1, ln_2 and ln_f store their outputs in bf16, what their products read (layer_norm+cast),
    # and their backward kernels read the products' bf16 gradients (tests/test_layer_norm_cast.py)
    assert on[2]["layer_norm+cast"] == 2 * n_layer + 1 and on[2]["layer_norm"] == 0
    assert sum(v for n, v in on[2].items() if n.startswith("cast+layer_norm_bwd")) >= 2 * n_layer + 1


def _clip_run(enabled: bool, arrays, dtype: str, max_norm: float, flat: bool):
    """clip_grad_norm_ over parameters whose gradients are ``arrays`` (one flat buffer, as
    AdamW packs them, or separate gradients): the norm, the clipped gradients, the kernels."""
    if flat:  # float32 parameters whose gradients AdamW packs into one flat buffer
        params = [Parameter(hl.tensor(a)) for a in arrays]
        AdamW(params, lr=1e-3)
    else:
        params = [hl.tensor(a).to(getattr(hl, dtype)).requires_grad_() for a in arrays]
    loss = None
    for p, a in zip(params, arrays):
        term = (p * hl.tensor(a).to(getattr(hl, dtype))).float().sum()
        loss = term if loss is None else loss + term
    loss.backward()
    with fused(enabled), count_dispatches() as names:
        norm = clip_grad_norm_(params, max_norm)
        out = [norm.numpy()] + [p.grad.float().numpy() for p in params]
    return out, names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clip_grad_norm_fused_equals_the_separate_ops_bit_for_bit(dtype):
    if dtype not in _dtypes():
        pytest.skip("no 16-bit storage on this device")
    rng = np.random.default_rng(3)
    # short (one pass) and long (partials, then the chain in the second pass) buffers
    for sizes in ([(7, 5), (3,)], [(300, 100), (40000,)]):
        arrays = [rng.standard_normal(s).astype(np.float32) for s in sizes]
        for flat in ((True, False) if dtype == "float32" else (False,)):
            for max_norm in (0.5, 1e9):  # biting, and not
                on, names_on = _clip_run(True, arrays, dtype, max_norm, flat)
                off, names_off = _clip_run(False, arrays, dtype, max_norm, flat)
                _assert_bits_equal(on, off)
                for op in ("sqrt", "add_s", "rdiv_s", "clamp"):
                    assert names_on[op] == 0 and names_off[op] == 1
                # the squares in the reduction, the chain in its last pass (the GPT test below
                # counts the one-buffer case)
                assert names_on["mul"] == names_off["mul"] - len(arrays) and any("clip_coef" in n for n in names_on)


def test_sum_squares_refuses_what_it_cannot_reduce_in_order():
    with pytest.raises(ShapeError, match="sum_squares: x must be a contiguous float tensor"):
        K.sum_squares(hl.ones((4, 3)).transpose(0, 1))
    with pytest.raises(ShapeError, match="clip_coef: x must be a contiguous float tensor"):
        K.clip_coef(hl.tensor(np.arange(4)), 1.0)
