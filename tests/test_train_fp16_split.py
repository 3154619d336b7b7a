"""helios-train --dtype fp16 with a split model (--pp, --tp) or sharded gradients (--zero): the
loss scaler's inf/nan test is agreed over the ranks, so every rank skips the same steps and keeps the same scale, and a
pipeline seeds each micro-batch's backward with the loss scale as one device's
``scaler.scale(loss).backward()`` does.

A 2-stage pipeline's first fp16 loss equals one rank's (accumulating the same micro-batches)
bit for bit, and its model after 2 steps equals one rank's to the pipeline tests' tolerance;
the ranks' final loss scales are one rank's.  The agreement itself: two ranks of which only one
holds an inf gradient both skip the step and back off."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402
from test_train_bf16_pp import _same_model  # noqa: E402
from test_train_dist import launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

STEPS = ("--steps", "2", "--dtype", "fp16", "--microbatches", "4")


def _summaries(stdout: str) -> list[dict]:
    """Every rank's summary line (rank-prefixed JSON)."""
    return [json.loads(s.split("] ", 1)[1]) for s in stdout.splitlines() if '"final_val_loss"' in s]


MOE = ("--moe-experts", "4", "--moe-top-k", "2", "--moe-aux-alpha", "0.1")


# (--tp, --zero 3 and --ep 2 in fp16 were checked the same way when they landed; the suite keeps
# the three layouts whose scaling differs: a pipeline's seeded backward, ZeRO's shards, and the
# load-balancing losses' gradient through a pipeline.)
@pytest.mark.parametrize("ref_flags,flags", [
    (STEPS, (*STEPS, "--pp", "2")), (STEPS, (*STEPS, "--zero", "2")), ((*STEPS, *MOE), (*STEPS, *MOE, "--pp", "2")),
], ids=["pp2", "zero2", "moe-pp2"])
def test_fp16_split_model_trains_what_one_rank_trains(tmp_path, one_rank_run, ref_flags, flags):
    # (a pipeline's load-balancing losses get the loss scale as their gradient, as one device's
    # scaler.scale(loss + aux).backward() gives them)
    ref = one_rank_run(*ref_flags)
    out = tmp_path / "split"
    r = launch(2, out, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mixed precision: --dtype fp16" in r.stdout
    np.testing.assert_allclose(losses(out), losses(ref), rtol=1e-4)
    if "--pp" in flags:
        assert losses(out)[0] == losses(ref)[0]  # the same ops on the same micro-batches, scaled alike
        _same_model(ref, out, rtol=1e-3, atol=1e-4)  # the tied table's two halves add in another order
    # (tensor, data and expert parallelism sum partial products in another order: float16 rounding
    # of those, which AdamW turns into steps of the learning rate's size where a gradient is near
    # 0, moves a few embedding entries by up to 6e-4 in a few steps; the losses above compare them.)
    scales = {s["loss_scale"] for s in _summaries(r.stdout)}
    assert len(scales) == 1  # every rank kept the same scale


def test_ranks_agree_to_skip_a_step_only_one_of_them_saw_inf(tmp_path):
    res = run_ranks([__file__, "agree"], 2, timeout=120)
    check_ok(res)
    seen = [json.loads(r.out.strip().splitlines()[-1]) for r in res]
    assert [s["skipped"] for s in seen] == [True, True]  # rank 1's gradients were finite
    assert [s["scale"] for s in seen] == [2.0 ** 15, 2.0 ** 15]  # both backed off from 2^16
    assert [s["skipped_alone"] for s in seen] == [True, False]  # without the group, only rank 0 would


def _agree_main() -> None:
    """Each rank: one parameter, rank 0's gradient holding an inf; a scaler over the world and one
    without a group unscale and step it."""
    import helios as hl
    import helios.comm as dist
    from helios.optim import SGD

    dist.init_process_group(backend="shm")
    rank = dist.get_rank()
    result = {}
    for name, group in (("skipped", "world"), ("skipped_alone", None)):
        p = hl.tensor(np.ones(4, np.float32), requires_grad=True)
        g = np.full(4, 2.0, np.float32)
        if rank == 0:
            g[1] = np.inf
        p.grad = hl.tensor(g)
        opt = SGD([p], lr=0.1)
        scaler = hl.amp.GradScaler(process_group=group)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        result[name] = scaler.last_step_skipped
        if group is not None:
            result["scale"] = scaler.get_scale()
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__" and sys.argv[1:] == ["agree"]:
    _agree_main()
