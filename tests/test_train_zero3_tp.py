"""helios-train --dp 2 --tp 2 --zero 3: each tensor-parallel rank's shards partitioned by ZeRO-3
over its two data-parallel ranks (gathered block by block, the tensor-parallel collectives
unchanged) train exactly what one rank trains with the clip biting (its norm counts every
tensor-parallel shard and every replicated parameter once); the checkpoints hold whole tensors
that resume on one rank and under ZeRO-1, and the other way round; the weights pool holds half
the tensor-parallel shard's model states; what cannot work is one line."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402
from test_train_dist import _one_line_error, _train_args, final_params, launch  # noqa: E402
from test_train_tp import _same_run  # noqa: E402
from test_train_zero import _memory  # noqa: E402
from test_train_zero_pp import _clipped_on_every_step as clipped_on_every_step  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

MAX_NORM = 0.05  # far below the nano GPT's gradient norm: the clip bites on every step
STEPS = 6
ARGS = ("--steps", str(STEPS), "--grad-clip", str(MAX_NORM))
GRID = ("--dp", "2", "--tp", "2")


def _clipped_on_every_step(out) -> None:
    clipped_on_every_step(out, STEPS, MAX_NORM)


@pytest.fixture(scope="module")
def one_rank(one_rank_run):
    """One rank over the whole batch: the run to reproduce."""
    out = one_rank_run(*ARGS)
    _clipped_on_every_step(out)
    return out


def test_zero3_over_the_data_parallel_ranks_of_a_tp_model_trains_what_one_rank_trains(tmp_path, one_rank):
    r = launch(4, tmp_path, *ARGS, *GRID, "--zero", "3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "tensor parallel 2 x data parallel 2, ZeRO-3" in r.stdout
    _same_run(one_rank, tmp_path)
    _clipped_on_every_step(tmp_path)
    _half_the_shards_model_states(tmp_path)


def test_zero3_with_sequence_parallelism_trains_what_one_rank_trains(tmp_path, one_rank):
    """The position table and the LayerNorms are read through copy_to_tp on a sequence shard
    (the table outside its own unit, so ZeRO-3 gathers it on demand)."""
    r = launch(4, tmp_path, *ARGS, *GRID, "--zero", "3", "--sequence-parallel")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "tensor parallel 2 x data parallel 2, sequence parallel, ZeRO-3" in r.stdout
    _same_run(one_rank, tmp_path)
    _clipped_on_every_step(tmp_path)


def _half_the_shards_model_states(tmp_path) -> None:
    # Rank 0's weights pool: parameters, gradients and both moments of its tensor-parallel shard
    # (Psi elements, padded), each cut in two over the data-parallel pair: 16 Psi / 2 bytes by the
    # formula, rounded up by the pool's size classes; unsharded they would be 16 Psi.
    mem = _memory(tmp_path)
    psi = mem["psi"]
    whole = sum(v.size for k, v in final_params(tmp_path).items() if k.startswith("model."))
    assert 0.45 * whole < psi < 0.6 * whole  # a tensor-parallel shard: about half the model
    assert mem["expected"] == {"params": 2 * psi, "grads": 2 * psi, "moments": 4 * psi}
    assert mem["expected_total"] <= mem["weights_pool_in_use"] < 1.25 * mem["expected_total"]


def test_a_zero3_tp_checkpoint_resumes_on_one_rank_and_under_zero1_and_back(tmp_path, one_rank):
    """One rank -> dp 2 x tp 2 ZeRO-3 -> ZeRO-1 -> ZeRO-3 -> one rank, a few steps each."""
    out = tmp_path / "chain"
    legs = ((1, [], 2, None),  # (ranks, flags, steps of this leg (--stop-after), what the resume reports)
            (4, [*GRID, "--zero", "3"], 1, "at step 2 (saved by 1 rank, ZeRO-0)"),
            (4, [*GRID, "--zero", "1"], 1, "at step 3 (saved by 4 ranks, tp 2, ZeRO-3)"),
            (4, [*GRID, "--zero", "3"], 1, "at step 4 (saved by 4 ranks, tp 2, ZeRO-1)"),
            (1, [], None, "at step 5 (saved by 4 ranks, tp 2, ZeRO-3)"))
    at = 0
    for world, flags, n, saved in legs:
        extra = [*flags, *(["--stop-after", str(n)] if n else []), *(["--resume"] if saved else [])]
        r = launch(world, out, *ARGS, *extra)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        if saved:
            assert saved in r.stdout, r.stdout[-2000:]
        if n:
            at += n
            assert f"stopped at step {at}" in r.stdout, r.stdout[-2000:]
    _same_run(one_rank, out)


@pytest.mark.parametrize("world,args,needle", [
    (4, ["--pp", "2", "--tp", "2", "--zero", "3"], "--zero 3 with --pp 2 shards each stage over its data-parallel ranks"),
    (2, ["--tp", "2", "--zero", "3"], "--zero 3 with --tp 2 shards each tensor-parallel rank's parameters"),
])
def test_zero3_a_grid_cannot_use_is_one_line_on_every_rank(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
    assert all(r.code == 2 for r in res)
