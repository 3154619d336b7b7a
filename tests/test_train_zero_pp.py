"""helios-train --zero 1|2 --pp: each pipeline stage's parameters sharded by ZeRO over the stage's
data-parallel ranks train exactly what one rank trains (the clip's norm summed over every stage
and every shard once, the tied embedding once), the checkpoints hold whole tensors that resume
under another --zero and on one rank.  --zero 3 --pp too (1F1B: ZeRO-3 gathers each block of
the stage around its forward and its backward, every micro-batch's backward reduce-scatters
into the shards, the tied table's halves are summed shard by shard), and with --pp-virtual
(each chunk's backward gathers and reduce-scatters that chunk's units only)."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402
from test_train_dist import _one_line_error, _train_args, final_params, launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

MAX_NORM = 0.05  # far below the tiny GPT's gradient norm: the clip bites on every step
STEPS = 5
# 4 transformer layers, 4 micro-batches of 1 sequence on each of the 2 replicas
ARGS = ("--config", "tiny", "--steps", str(STEPS), "--microbatches", "4", "--grad-clip", str(MAX_NORM))
GRID = ("--pp", "2", "--dp", "2")


def _same_run(a, b) -> None:
    np.testing.assert_allclose(losses(b), losses(a), rtol=1e-5)
    fa, fb = final_params(a), final_params(b)
    assert sorted(fa) == sorted(fb)  # the whole model's tensors, under one device's names
    for k in fa:
        np.testing.assert_allclose(fb[k], fa[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _clipped_on_every_step(out, steps: int = STEPS, max_norm: float = MAX_NORM) -> None:
    """AdamW's second moments after the run, summed over every element of every tensor (the tied
    table once), are (1 - b2) sum_k b2^(n-k) |g_k|^2; with every step's gradient clipped to norm
    max_norm that is exactly (1 - b2^n) max_norm^2.  A norm that missed a stage, a shard or a
    ZeRO range, or counted the tied table or a replicated parameter twice, clips to another norm."""
    f = final_params(out)
    total = sum(float(v.astype(np.float64).sum()) for k, v in f.items() if k.startswith("optim.exp_avg_sq."))
    np.testing.assert_allclose(total, (1 - 0.95 ** steps) * max_norm ** 2, rtol=1e-5)


@pytest.fixture(scope="module")
def one_rank(one_rank_run):
    """One rank accumulating the same 4 micro-batches over the whole batch: the run to reproduce."""
    out = one_rank_run(*ARGS)
    _clipped_on_every_step(out)
    return out


# ZeRO-2 over a plain pipeline is the next test's first run (its steps before and after the resume).
@pytest.mark.parametrize("stage,extra,banner", [
    (1, [], "pipeline parallel 2 (4 micro-batches) x data parallel 2, ZeRO-1"),
    (1, ["--pp-virtual", "2"], "x data parallel 2, ZeRO-1"),
    (3, [], "pipeline parallel 2 (4 micro-batches) x data parallel 2, ZeRO-3"),
    (3, ["--pp-virtual", "2"], "2 virtual stages (interleaved, 4 micro-batches) x data parallel 2, ZeRO-3"),
])
def test_zero_over_each_stages_data_parallel_ranks_trains_what_one_rank_trains(tmp_path, one_rank, stage, extra,
                                                                              banner):
    r = launch(4, tmp_path, *ARGS, *GRID, "--zero", str(stage), *extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert banner in r.stdout
    _same_run(one_rank, tmp_path)
    _clipped_on_every_step(tmp_path)


def test_a_zero2_pipeline_checkpoint_resumes_under_zero1_and_on_one_rank_and_back(tmp_path, one_rank):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = launch(4, a, *ARGS, *GRID, "--zero", "2", "--stop-after", "3")
    assert first.returncode == 0 and "stopped at step 3" in first.stdout, first.stderr[-3000:]
    assert "pipeline parallel 2 (4 micro-batches) x data parallel 2, ZeRO-2" in first.stdout
    shutil.copytree(a, b)
    for out, world, flags in ((a, 4, [*GRID, "--zero", "1"]), (b, 1, [])):
        r = launch(world, out, *ARGS, "--resume", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "at step 3 (saved by 4 ranks, pp 2, ZeRO-2)" in r.stdout
        _same_run(one_rank, out)
        _clipped_on_every_step(out)
    # and a one-rank checkpoint resumes under --pp --zero
    assert launch(1, c, *ARGS, "--stop-after", "3").returncode == 0
    r = launch(4, c, *ARGS, "--resume", *GRID, "--zero", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 3 (saved by 1 rank, ZeRO-0)" in r.stdout
    _same_run(one_rank, c)


def test_a_zero3_pipeline_checkpoint_resumes_on_one_rank(tmp_path, one_rank):
    """Each stage writes its ZeRO-3 shards under the whole model's names (the tied table once)."""
    first = launch(4, tmp_path, *ARGS, *GRID, "--zero", "3", "--stop-after", "3")
    assert first.returncode == 0 and "stopped at step 3" in first.stdout, first.stderr[-3000:]
    r = launch(1, tmp_path, *ARGS, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 3 (saved by 4 ranks, pp 2, ZeRO-3)" in r.stdout
    _same_run(one_rank, tmp_path)
    _clipped_on_every_step(tmp_path)


@pytest.mark.slow
def test_zero_over_a_tensor_and_pipeline_parallel_grid_trains_what_the_grid_trains_without_it(tmp_path):
    """tp 2 x pp 2 x dp 2 on 8 ranks: ZeRO-2 over each (stage, tensor-parallel shard)'s two replicas
    equals the tp 2 x pp 2 grid on 4 ranks taking the whole batch (tensor parallelism alone differs
    from one rank by its own float noise); the clip's norm also sums the tensor-parallel shards once."""
    plain, zero = tmp_path / "plain", tmp_path / "zero"
    for out, world, dp in ((plain, 4, ()), (zero, 8, ("--dp", "2", "--zero", "2"))):
        r = launch(world, out, *ARGS, "--tp", "2", "--pp", "2", *dp)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "x tensor parallel 2 x data parallel 2, ZeRO-2" in r.stdout
    _same_run(plain, zero)
    _clipped_on_every_step(zero)


@pytest.mark.parametrize("world,args,needle", [
    (2, ["--pp", "2", "--zero", "3"], "--zero 3 with --pp 2 shards each stage over its data-parallel ranks"),
    (2, ["--pp", "2", "--zero", "2"], "--zero 2 with --pp 2 shards each stage over its data-parallel ranks"),
])
def test_zero_a_pipeline_cannot_use_is_one_line_on_every_rank(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
    assert all(r.code == 2 for r in res)
