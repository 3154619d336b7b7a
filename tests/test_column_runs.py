"""Column reductions in runs (helios._kernels.core.column_chunks): on GPUs a reduction of few
outputs over long columns (a bias's or a LayerNorm's parameter gradient) is cut into runs of rows,
each run's partial stored and the partials reduced in order by a second pass.

lavapipe is a CPU device, where the columns take one pass; here the ``gpu_runs`` fixture makes the
kernels cut them as a GPU would, at test sizes.  On the emulated ``cuda:0`` the policy itself cuts
them (the last test)."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios._kernels import core, reductions, rows
from helios.runtime import get_runtime
from switches import count_dispatches

pytestmark = pytest.mark.vulkan


class _GPU:
    info = {"type": "discrete"}


class _CPU:
    info = {"type": "cpu"}


@pytest.fixture
def gpu_runs(monkeypatch):
    """Columns cut as on a GPU, at test sizes: runs of at least 8 rows while fewer than 512
    invocations are busy."""
    monkeypatch.setattr(core, "COLUMN_THREADS", 512)
    monkeypatch.setattr(core, "COLUMN_RUN", 8)
    real = core.column_chunks

    def as_on_a_gpu(rt, R, n):
        return real(_GPU, R, n)

    monkeypatch.setattr(reductions, "column_chunks", as_on_a_gpu)
    monkeypatch.setattr(rows, "column_chunks", as_on_a_gpu)


def test_the_policy_cuts_long_columns_on_gpus_only():
    assert core.column_chunks(_CPU, 8192, 768) == (1, 8192)
    runs, per_run = core.column_chunks(_GPU, 8192, 768)  # a GPT-2 LayerNorm's dw and db
    assert (runs, per_run) == (85, 97) and runs * 768 <= core.COLUMN_THREADS
    for R, n in ((8192, 768), (100, 5), (65, 1), (10 ** 7, 3), (1000, 3000)):
        runs, per_run = core.column_chunks(_GPU, R, n)
        assert (runs - 1) * per_run < R <= runs * per_run  # every run holds rows
        assert runs <= 1024 and (runs == 1 or per_run >= core.COLUMN_RUN)
    assert core.column_chunks(_GPU, 64, 768) == (1, 64)  # one run's worth of rows
    assert core.column_chunks(_GPU, 8192, core.COLUMN_THREADS) == (1, 8192)  # the outputs fill it


def test_sums_and_means_over_runs(gpu_runs):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 5)).astype(np.float32)
    with count_dispatches() as names:
        s = hl.tensor(x).sum(0)
    assert names["sum"] == 3  # 25 runs of 8 rows, their partials in 3 runs, then one pass
    np.testing.assert_allclose(s.numpy(), x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hl.tensor(x).mean(0).numpy(), x.astype(np.float64).mean(0), rtol=1e-5, atol=1e-6)
    y = rng.standard_normal((3, 50, 4)).astype(np.float32)  # outer 3, inner 4: the outputs' two axes
    np.testing.assert_allclose(hl.tensor(y).sum(1).numpy(), y.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(K.reduce("sumsq", hl.tensor(y), (1,))[0].numpy(), (y.astype(np.float64) ** 2).sum(1),
                               rtol=1e-5, atol=1e-5)
    i = rng.integers(-10 ** 12, 10 ** 12, (90, 3))
    assert np.array_equal(hl.tensor(i).sum(0).numpy(), i.sum(0))


def test_a_sum_over_runs_lands_in_the_given_slot(gpu_runs):
    # the Linear's bias gradient: reduce(..., out=) into a slot of a flat buffer
    g = np.random.default_rng(1).standard_normal((4, 30, 6)).astype(np.float32)
    flat = hl.zeros((16,))
    out, _ = K.reduce("sum", hl.tensor(g), (0, 1), 1.0, out=flat[3:9])
    got = flat.numpy()
    np.testing.assert_allclose(got[3:9], g.astype(np.float64).sum((0, 1)), rtol=1e-5, atol=1e-5)
    assert out.shape == (6,) and not got[:3].any() and not got[9:].any()


def test_arg_reductions_over_runs_keep_the_first_index():
    # ties and NaNs in different runs: the first occurrence wins, as in one pass (and in torch)
    x = np.zeros((100, 4), np.float32)
    x[20, 1] = x[90, 1] = 5.0  # a tie across runs
    x[50, 2] = x[70, 2] = np.nan  # NaN wins, the first one
    x[:, 3] = -np.arange(100)  # the max in the first run, the min in the last
    x[99, 0] = -1.0
    want = {"argmax": [0, 20, 50, 0], "argmin": [99, 0, 50, 99]}
    one = {op: getattr(hl.tensor(x), op)(0).numpy() for op in want}
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(core, "COLUMN_THREADS", 512)
        mp.setattr(core, "COLUMN_RUN", 8)
        mp.setattr(reductions, "column_chunks", lambda rt, R, n: core.column_chunks(_GPU, R, n))
        for op, idx in want.items():
            with count_dispatches() as names:
                got = getattr(hl.tensor(x), op)(0).numpy()
            assert names[op] >= 2, names
            assert got.tolist() == idx == one[op].tolist(), op
        b = hl.tensor(np.random.default_rng(2).standard_normal((77, 3)).astype(np.float32)).to(hl.bfloat16)
        ref = b.float().numpy()
        assert np.array_equal(b.max(0).values.float().numpy(), ref.max(0))
        assert np.array_equal(b.min(0).values.float().numpy(), ref.min(0))
    finally:
        mp.undo()


def _ln_inputs(n_rows: int, c: int, dtype):
    rng = np.random.default_rng(3)
    x, g = (hl.tensor(rng.standard_normal((n_rows, c)).astype(np.float32)).to(dtype) for _ in range(2))
    w = hl.tensor(rng.standard_normal(c).astype(np.float32)).to(dtype)
    _, mean, rstd = K.layer_norm_fwd(x, w, None, 1e-5)
    return x, g, w, mean, rstd


def _ln_param_ref(x, g, mean, rstd):
    x64, g64 = x.float().numpy().astype(np.float64), g.float().numpy().astype(np.float64)
    xhat = (x64 - mean.numpy()[:, None]) * rstd.numpy()[:, None]
    return (g64 * xhat).sum(0), g64.sum(0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_norm_parameter_gradients_over_runs(gpu_runs, dtype):
    dtype = getattr(hl, dtype)
    n_rows, c = 100, 70  # 7 runs of 15 rows, two workgroups of columns each
    x, g, w, mean, rstd = _ln_inputs(n_rows, c, dtype)
    ref_w, ref_b = _ln_param_ref(x, g, mean, rstd)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype is hl.float32 else dict(rtol=1e-2, atol=5e-2)
    with count_dispatches() as names:
        dw, db = K.layer_norm_bwd_params(x, g, mean, rstd, True, True)
    assert names["layer_norm_bwd_params"] == 2 and len(names) == 1
    np.testing.assert_allclose(dw.float().numpy(), ref_w, **tol)
    np.testing.assert_allclose(db.float().numpy(), ref_b, **tol)
    # one of the two; into the slots of one flat buffer (a flat gradient buffer's)
    dw1, db1 = K.layer_norm_bwd_params(x, g, mean, rstd, False, True)
    assert dw1 is None and np.array_equal(db1.float().numpy(), db.float().numpy())
    flat = hl.zeros((2 * c + 8,)).to(dtype)
    dw_out, db_out = flat[4:4 + c], flat[c + 8:]
    dw2, db2 = K.layer_norm_bwd_params(x, g, mean, rstd, True, True, dw_out, db_out)
    assert dw2 is dw_out and db2 is db_out
    got = flat.float().numpy()
    assert np.array_equal(got[4:4 + c], dw.float().numpy()) and np.array_equal(got[c + 8:], db.float().numpy())
    assert not got[:4].any() and not got[4 + c:c + 8].any()


def test_layer_norm_backward_takes_two_kernels_when_columns_go_in_runs(gpu_runs):
    # short rows, one invocation a row: the fused dispatch (no runs) gives way to the input
    # gradient's kernel and the parameter gradients' two passes, the same dx bit for bit
    x, g, w, mean, rstd = _ln_inputs(100, 24, hl.float32)
    with count_dispatches() as names:
        dx, dw, db = K.layer_norm_bwd(x, w, g, mean, rstd, True, True)
    assert names == {"layer_norm_bwd": 1, "layer_norm_bwd_params": 2}
    assert np.array_equal(dx.numpy(), K.layer_norm_bwd_input(x, w, g, mean, rstd).numpy())
    ref_w, ref_b = _ln_param_ref(x, g, mean, rstd)
    np.testing.assert_allclose(dw.numpy(), ref_w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(db.numpy(), ref_b, rtol=1e-5, atol=1e-4)


def test_runs_on_the_emulated_cuda_device(emulated_cuda):
    # cuda:0 cuts columns by the policy itself: 200 rows over 3 or 24 columns go in 3 runs
    hl.set_device("cuda:0")
    rng = np.random.default_rng(4)
    assert core.column_chunks(get_runtime(), 200, 24) == (3, 67)
    x = rng.standard_normal((200, 3)).astype(np.float32)
    with count_dispatches() as names:
        s = hl.tensor(x).sum(0)
        a = hl.tensor(x).argmax(0)
    assert names == {"sum": 2, "argmax": 2}
    np.testing.assert_allclose(s.numpy(), x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    assert np.array_equal(a.numpy(), x.argmax(0))
    xt, g, w, mean, rstd = _ln_inputs(200, 24, hl.float32)
    with count_dispatches() as names:
        dw, db = K.layer_norm_bwd_params(xt, g, mean, rstd, True, True)
    assert names["layer_norm_bwd_params"] == 2
    ref_w, ref_b = _ln_param_ref(xt, g, mean, rstd)
    np.testing.assert_allclose(dw.numpy(), ref_w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(db.numpy(), ref_b, rtol=1e-5, atol=1e-4)


def test_runs_replay_in_a_captured_step(gpu_runs):
    # the partials live in temporaries of the captured step: a replay on new inputs recomputes them
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((100, 70)).astype(np.float32) for _ in range(2)]
    w = hl.tensor(rng.standard_normal(70).astype(np.float32))
    x = hl.tensor(xs[0])

    def grads(x):
        _, mean, rstd = K.layer_norm_fwd(x, w, None, 1e-5)
        dw, db = K.layer_norm_bwd_params(x, x * 0.5, mean, rstd, True, True)
        return dw, db, x.sum(0)

    with hl.graph.capture(inputs=(x,)) as g:
        outs = grads(x)
    g.replay(xs[1])
    want = grads(hl.tensor(xs[1]))
    for got, ref in zip(outs, want):
        assert got.numpy().tobytes() == ref.numpy().tobytes()
    g.release()
