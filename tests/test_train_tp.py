"""helios-train --tp: tensor parallel (and tensor x data parallel) trains exactly what one rank
trains, its checkpoints hold whole tensors that resume on any grid, and a grid that cannot
work is one line."""

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


def _same_run(a, b) -> None:
    np.testing.assert_allclose(losses(b), losses(a), rtol=1e-5)
    fa, fb = final_params(a), final_params(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:  # atol: see test_train_dist (the key bias's float noise, which AdamW amplifies)
        np.testing.assert_allclose(fb[k], fa[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_tp2_and_dp2_x_tp2_train_what_one_rank_trains(tmp_path, one_rank_run):
    one = one_rank_run("--steps", "10")
    for world, name in ((2, "tp2"), (4, "dp2tp2")):
        r = launch(world, tmp_path / name, "--steps", "10", "--tp", "2")
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"tensor parallel 2 x data parallel {world // 2}" in r.stdout
        _same_run(one, tmp_path / name)


def test_zero_over_the_data_parallel_ranks_of_a_tp_model_trains_what_one_rank_trains(tmp_path, one_rank_run):
    """--dp 2 --tp 2 --zero 1 (and 2): the moments (and gradients) sharded over the two ranks
    that hold each tensor-parallel shard; the clip's norm counts every shard once; the
    checkpoint holds whole tensors, so a ZeRO-2 run resumes under ZeRO-1."""
    one = one_rank_run("--steps", "10")
    grid = ("--dp", "2", "--tp", "2")
    z1 = tmp_path / "z1"
    r = launch(4, z1, "--steps", "10", *grid, "--zero", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensor parallel 2 x data parallel 2, ZeRO-1" in r.stdout
    _same_run(one, z1)
    z2 = tmp_path / "z2"
    r = launch(4, z2, "--steps", "10", "--stop-after", "5", *grid, "--zero", "2")
    assert r.returncode == 0 and "stopped at step 5" in r.stdout, r.stderr[-3000:]
    r = launch(4, z2, "--steps", "10", "--resume", *grid, "--zero", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    _same_run(one, z2)


@pytest.fixture(scope="module")
def stopped_tp_run(tmp_path_factory):
    """A --tp 2 run of 10 steps stopped after step 5 (each resuming test copies it)."""
    split = tmp_path_factory.mktemp("split")
    first = launch(2, split, "--steps", "10", "--stop-after", "5", "--tp", "2")
    assert first.returncode == 0 and "stopped at step 5" in first.stdout, first.stderr[-2000:]
    return split


@pytest.mark.parametrize("resume_world,resume_tp", [(1, 1), (4, 2)])
def test_a_tp_checkpoint_resumes_on_another_grid(tmp_path, resume_world, resume_tp, one_rank_run, stopped_tp_run):
    full = one_rank_run("--steps", "10")
    split = tmp_path / "split"
    shutil.copytree(stopped_tp_run, split, symlinks=True)
    second = launch(resume_world, split, "--steps", "10", "--resume", "--tp", str(resume_tp))
    assert second.returncode == 0, second.stderr[-3000:]
    _same_run(full, split)


@pytest.mark.parametrize("world,args,needle", [
    (2, ["--tp", "3"], "--tp 3 must divide the number of ranks (2)"),
    (4, ["--tp", "4"], "--tp 4 must divide the model's heads (n_head), 2"),
    (2, ["--tp", "2", "--zero", "3"], "--zero 3 with --tp 2"),
    (2, ["--tp", "2", "--zero", "1"], "--zero 1 with --tp 2 shards each tensor-parallel rank's optimizer states"),
])
def test_a_grid_that_cannot_work_is_one_line_on_every_rank(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
