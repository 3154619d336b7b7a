"""ZeRO stages 1, 2 and 3 in helios-train: N ranks and any stage train what one rank trains,
hold the bytes the ZeRO formulas say, and checkpoints move between stages and world sizes."""

from __future__ import annotations

import json
import os
import sqlite3
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_dist import final_params, launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

SMALL_BUCKETS = ("--bucket-cap-mb", "0.02")  # several buckets even for the nano model


@pytest.fixture(scope="module")
def one_rank(one_rank_run):
    out = one_rank_run()
    return losses(out), final_params(out)


def _memory(out) -> dict:
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return json.loads(con.execute("SELECT config_json FROM runs").fetchone()[0])["memory"]
    finally:
        con.close()


# Every stage on 2 and 4 ranks; one rank (nothing to shard over) once, with the stage that
# changes the most (ZeRO-3 gathers each parameter before its use).
@pytest.mark.parametrize("stage,world", [(1, 2), (1, 4), (2, 2), (2, 4), (3, 1), (3, 2), (3, 4)])
def test_zero_stage_on_n_ranks_trains_what_one_rank_trains(tmp_path, one_rank, world, stage):
    r = launch(world, tmp_path, "--zero", str(stage), *SMALL_BUCKETS)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    base_losses, base_params = one_rank
    np.testing.assert_allclose(losses(tmp_path), base_losses, rtol=1e-5)
    got = final_params(tmp_path)
    for k, v in base_params.items():
        # atol: see test_checkpoint_of_two_ranks_resumes_on_any_world_size (the key bias).
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)

    # Bytes per rank: the model states follow the formula exactly (over the padded Ψ: ZeRO-1
    # holds 4Ψ + 4Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N, against 16Ψ without ZeRO), and the
    # weights pool, where they live, holds them within its size-class rounding (< 25 % + 256 B each).
    mem = _memory(tmp_path)
    e, psi = mem["expected"], mem["psi"]  # psi: parameters, padded to whole chunks per segment
    assert e["params"] == (4 * psi // world if stage == 3 else 4 * psi)
    assert e["grads"] == (4 * psi if stage == 1 else 4 * psi // world)
    assert e["moments"] == 8 * psi // world
    total = mem["expected_total"]
    assert total == e["params"] + e["grads"] + e["moments"]
    assert total <= mem["weights_pool_in_use"] <= 1.25 * total + 256 * 200


# Each stage's checkpoint resumes on another world size under another stage (and one of them
# on one rank without ZeRO).
@pytest.mark.parametrize("saved_stage,resumes", [(1, ((4, 2),)), (2, ((1, 0), (4, 3))), (3, ((4, 1), (2, 2)))])
def test_checkpoint_of_each_stage_resumes_on_other_world_sizes_and_stages(tmp_path, one_rank, saved_stage, resumes):
    out = tmp_path / "run"
    first = launch(2, out, "--zero", str(saved_stage), "--stop-after", "10", *SMALL_BUCKETS)
    assert first.returncode == 0 and "stopped at step 10" in first.stdout, first.stderr[-2000:]
    for world, stage in resumes:
        again = tmp_path / f"resume-{world}-{stage}"
        os.makedirs(again / "ckpt")
        os.symlink(out / "ckpt" / "step-00000010", again / "ckpt" / "step-00000010")
        r = launch(world, again, "--zero", str(stage), "--resume", *SMALL_BUCKETS)
        assert r.returncode == 0 and f"saved by 2 ranks, ZeRO-{saved_stage}" in r.stdout, r.stderr[-3000:]
        np.testing.assert_allclose(losses(again), one_rank[0][10:], rtol=1e-5)
