"""helios-train --sequence-parallel and --moe-experts: sequence parallelism trains what one
rank trains, a mixture-of-experts GPT trains, logs its load-balancing loss and resumes from
its folder alone, and settings that cannot work are one line naming the flag."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402
from test_train_dist import _one_line_error, _train_args, final_params, launch, losses  # noqa: E402
from test_train_tp import _same_run  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]


def test_sequence_parallel_trains_what_one_rank_trains(tmp_path, one_rank_run):
    one = one_rank_run("--steps", "10")
    r = launch(2, tmp_path / "sp", "--steps", "10", "--tp", "2", "--sequence-parallel")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensor parallel 2 x data parallel 1, sequence parallel" in r.stdout
    _same_run(one, tmp_path / "sp")


def test_a_mixture_of_experts_gpt_trains_logs_aux_and_resumes_from_its_folder(tmp_path):
    moe = ("--moe-experts", "4", "--moe-top-k", "2")
    full = tmp_path / "full"
    r = launch(1, full, "--steps", "10", *moe)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mixture of experts: 4 experts per block, top-2" in r.stdout
    aux = [float(line.split(" aux ")[1].split()[0]) for line in r.stdout.splitlines() if " aux " in line]
    assert aux and all(0.0 < a < 0.1 for a in aux), aux  # 2 layers x alpha 0.01 near balance: about 0.02
    ls = losses(full)
    assert len(ls) == 10 and ls[-1] < ls[0]
    params = final_params(full)
    assert "model.h.0.mlp.w_fc" in params and not any("c_fc" in k for k in params)
    part = tmp_path / "part"
    first = launch(1, part, "--steps", "10", "--stop-after", "5", *moe)
    assert first.returncode == 0 and "stopped at step 5" in first.stdout, first.stderr[-2000:]
    second = launch(1, part, "--steps", "10", "--resume")  # the experts come back from the checkpoint's settings
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(part) == ls  # bit for bit
    for k, v in final_params(part).items():
        np.testing.assert_array_equal(v, params[k], err_msg=k)


def test_a_mixture_of_experts_gpt_trains_data_parallel(tmp_path):
    r = launch(2, tmp_path / "dp2", "--steps", "3", "--moe-experts", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(losses(tmp_path / "dp2")) == 3


def test_expert_parallel_trains_what_every_rank_holding_every_expert_trains(tmp_path):
    """--ep 2 on 2 ranks (each holds 2 of 4 experts, tokens exchanged by all_to_all) and on 4
    ranks (2 replicas of each expert half) give the losses and the whole checkpointed model of
    plain data parallel on as many ranks, where every rank holds every expert; a run stopped
    under --ep 2 resumes with every expert on every rank."""
    moe = ("--moe-experts", "4", "--moe-top-k", "2", "--steps", "5")
    refs = {}
    for world in (2, 4):  # (a rank's capacity follows its tokens: compare at the same data-parallel size)
        dp = tmp_path / f"dp_w{world}"
        r = launch(world, dp, *moe, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        ref_losses, ref = refs[world] = losses(dp), final_params(dp)
        out = tmp_path / f"ep2_w{world}"
        r = launch(world, out, *moe, "--ep", "2", timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        np.testing.assert_allclose(losses(out), ref_losses, rtol=1e-5)
        got = final_params(out)
        assert sorted(got) == sorted(ref)
        for k, v in ref.items():  # the whole [E, ...] expert tensors, gathered from their ranks
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    # Stopped under --ep 2, resumed with every expert on every rank: the checkpoint held them whole.
    part = tmp_path / "part"
    r = launch(2, part, *moe, "--ep", "2", "--stop-after", "3")
    assert r.returncode == 0 and "stopped at step 3" in r.stdout, r.stderr[-3000:]
    r = launch(2, part, "--steps", "5", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(losses(part), refs[2][0], rtol=1e-5)


@pytest.mark.parametrize("world,args,needle", [
    (1, ["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 is more than --moe-experts 4"),
    (1, ["--moe-experts", "-1"], "--moe-experts must be 0 (a dense MLP) or more experts, got -1"),
    (2, ["--moe-experts", "3", "--ep", "2"], "--ep 2 must divide --moe-experts 3"),
    (2, ["--ep", "2"], "--ep 2 splits the experts of a mixture-of-experts model over ranks: give --moe-experts"),
    (1, ["--moe-experts", "4", "--ep", "2"], "--ep 2 must divide the data-parallel ranks (1)"),
    (1, ["--sequence-parallel"], "--sequence-parallel splits the sequence over tensor-parallel ranks"),
    (2, ["--sequence-parallel", "--tp", "2", "--block-size", "15"], "--block-size 15 must be a multiple of --tp 2"),
])
def test_settings_that_cannot_work_are_one_line(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
