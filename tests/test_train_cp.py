"""helios-train --cp (and --dp): context parallelism (each sequence split over ranks, ring attention)
trains what one rank trains, composes with data parallel, and settings that cannot work are
one line naming the flag."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402
from test_train_dist import _one_line_error, _train_args, final_params, launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

# The tiny model's head dim (128 / 4 = 32) is one the flash kernel, hence ring attention, takes.
TINY = ("--config", "tiny", "--attention", "flash", "--steps", "4", "--sample-tokens", "8")


@pytest.fixture(scope="module")
def one_rank(one_rank_run):
    out = one_rank_run(*TINY)
    return losses(out), final_params(out)


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (2, "stripe"), (4, "zigzag")])
def test_context_parallel_trains_what_one_rank_trains(tmp_path, one_rank, world, layout):
    out = tmp_path / f"cp2_{layout}_w{world}"
    r = launch(world, out, *TINY, "--dp", str(world // 2), "--cp", "2", "--cp-layout", layout, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"context parallel 2 ({layout}: 8 tokens of each sequence a rank)" in r.stdout
    assert "--- sample ---" in r.stdout  # rank 0 samples whole sequences alone
    ref_losses, ref_params = one_rank
    np.testing.assert_allclose(losses(out), ref_losses, rtol=1e-5)
    params = final_params(out)
    assert sorted(params) == sorted(ref_params)
    for k, v in ref_params.items():
        # The sums run in another order (ring blocks, gradients reduced over ranks): weights
        # whose gradient is float noise get O(lr) Adam steps of random sign, so a loose atol.
        np.testing.assert_allclose(params[k], v, rtol=1e-5, atol=1e-4, err_msg=k)


@pytest.mark.parametrize("world,args,needle", [
    (2, ["--cp", "2"], "--cp 2: ring attention needs a head dim of 32, 64, 128; this model's n_embd / n_head is 32 / 2"),
    (2, ["--config", "tiny", "--cp", "2", "--block-size", "18"], "--block-size 18 must be a multiple of 4 for --cp 2"),
    (2, ["--config", "tiny", "--cp", "2", "--attention", "dense"], "--cp 2 with --attention dense"),
    (2, ["--config", "tiny", "--cp", "2", "--tp", "2"], "--cp 2 with --tp 2: context parallelism composes with data"),
    (2, ["--config", "tiny", "--cp", "3"], "--cp 3 must divide the number of ranks (2)"),
    (2, ["--dp", "1"], "--dp 1 = 1 rank, but the job has 2"),
    (4, ["--config", "tiny", "--dp", "4", "--cp", "2"], "--dp 4 x --cp 2 = 8 ranks, but the job has 4"),
])
def test_settings_that_cannot_work_are_one_line(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
