"""helios-train --pp: pipeline parallel (alone, with tensor parallel, also sequence parallel, with
data parallel) trains what one rank trains, its checkpoints hold the whole model under one
device's names and resume on another layout, and a layout that cannot work is one line on
every rank."""

from __future__ import annotations

import os
import sqlite3
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402
from test_train_dist import _one_line_error, _train_args, final_params, launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

STEPS = ("--steps", "10", "--eval-every", "5")


def _val_losses(out) -> list[float]:
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return [r[0] for r in con.execute(
            "SELECT val_loss FROM step_timing WHERE rank = 0 AND val_loss IS NOT NULL ORDER BY step")]
    finally:
        con.close()


def _sample(stdout: str) -> str:
    """The final text sample rank 0 printed (helios-run prefixes its lines with the rank)."""
    text = stdout.replace("[rank 0] ", "")
    return text.split("--- sample ---\n", 1)[1].split("\n---", 1)[0]


def _same_run(a, b) -> None:
    np.testing.assert_allclose(losses(b), losses(a), rtol=1e-5)
    fa, fb = final_params(a), final_params(b)
    assert sorted(fa) == sorted(fb)  # the whole model's tensors, under one device's names
    for k in fa:  # atol: see test_train_dist (the key bias's float noise, which AdamW amplifies)
        np.testing.assert_allclose(fb[k], fa[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """One rank training the whole batch at once: the run every layout must reproduce."""
    out = tmp_path_factory.mktemp("one")
    r = launch(1, out, *STEPS)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


@pytest.mark.parametrize("world,flags,banner", [
    (2, ["--pp", "2", "--microbatches", "4"], "pipeline parallel 2 (4 micro-batches) x data parallel 1"),
    (4, ["--pp", "2", "--tp", "2", "--microbatches", "4"],
     "pipeline parallel 2 (4 micro-batches) x tensor parallel 2 x data parallel 1"),
    (4, ["--pp", "2"], "pipeline parallel 2 (2 micro-batches) x data parallel 2"),
    # Sequence parallel: the stages pass each TP rank's 8 of the 16 positions (and their gradients).
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--microbatches", "2"],
     "pipeline parallel 2 (2 micro-batches) x tensor parallel 2 x data parallel 1, sequence parallel"),
])
def test_pipeline_layouts_train_what_one_rank_trains(tmp_path, one_rank, world, flags, banner):
    ref, ref_stdout = one_rank
    r = launch(world, tmp_path, *STEPS, *flags)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert banner in r.stdout
    assert "pipeline stages: 0: embeddings, block 0 | 1: block 1, final LayerNorm and output layer" in r.stdout
    _same_run(ref, tmp_path)
    np.testing.assert_allclose(_val_losses(tmp_path), _val_losses(ref), rtol=1e-5)
    assert len(_val_losses(tmp_path)) == 2  # at step 5 and at the end
    assert _sample(r.stdout) == _sample(ref_stdout)  # sampled through the stages, the last one drawing
    con = sqlite3.connect(tmp_path / "run.db")
    assert con.execute("SELECT COUNT(DISTINCT rank) FROM step_timing").fetchone()[0] == world
    con.close()


def test_the_loss_is_one_device_accumulating_the_micro_batches_bit_for_bit(tmp_path):
    # The first step starts from the same weights: the pipeline's loss is the same sum of the
    # same scaled micro-batch losses, in the same order.
    one = launch(1, tmp_path / "one", "--steps", "2", "--microbatches", "4")
    pp = launch(2, tmp_path / "pp", "--steps", "2", "--pp", "2", "--microbatches", "4")
    assert one.returncode == 0 and pp.returncode == 0, pp.stderr[-3000:]
    assert losses(tmp_path / "pp")[0] == losses(tmp_path / "one")[0]


@pytest.mark.parametrize("first,second", [
    ((2, ["--pp", "2"]), (1, [])),
    ((1, []), (2, ["--pp", "2", "--microbatches", "4"])),
])
def test_a_checkpoint_resumes_across_pipeline_layouts(tmp_path, one_rank, first, second):
    ref, _ = one_rank
    split = tmp_path / "split"
    a = launch(first[0], split, *STEPS, "--stop-after", "5", *first[1])
    assert a.returncode == 0 and "stopped at step 5" in a.stdout, a.stderr[-2000:]
    b = launch(second[0], split, *STEPS, "--resume", *second[1])
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resumed from" in b.stdout
    if first[1]:
        assert "(saved by 2 ranks, pp 2, ZeRO-0)" in b.stdout
    _same_run(ref, split)


@pytest.mark.parametrize("world,args,needle", [
    (2, ["--pp", "3"], "--pp 3 must divide the number of ranks (2)"),
    (4, ["--tp", "2", "--pp", "4"], "--pp 4 must divide the ranks left by --tp 2 (4 / 2 = 2)"),
    (4, ["--pp", "4"], "--pp 4 is more pipeline stages than the model has transformer layers (2)"),
    (2, ["--pp", "2", "--microbatches", "3"],
     "--microbatches 3 must divide the batch of each data-parallel replica, 8 sequences"),
    (4, ["--pp", "2", "--batch-size", "6"],
     "--microbatches 2 (the default: --pp 2) must divide the batch of each data-parallel replica, 3 sequences"),
    (2, ["--pp", "2", "--zero", "1"], "--zero 1 with --pp 2"),
    (2, ["--pp", "2", "--grad-compression", "fp16"], "--grad-compression fp16 compresses"),
])
def test_a_pipeline_layout_that_cannot_work_is_one_line_on_every_rank(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
    assert all(r.code == 2 for r in res)
