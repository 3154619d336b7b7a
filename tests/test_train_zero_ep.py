"""helios-train --zero 1|2|3 with --ep: the expert parameters are sharded over the ranks that
hold the same experts (data-parallel ranks / ep), the dense ones over every data-parallel rank,
as DeepSpeed-MoE shards them (stage 3 gathers and reduce-scatters each unit's experts over those
ranks, its other parameters over every rank); 4 ranks with --ep 2 train what --zero 0 trains,
hold the bytes that split gives, and checkpoints move from --zero 1 or 3 to --zero 0 and back
under --ep 2.  (With --tp too: tests/test_train_moe_tp.py.)

Without the gradient clip the runs are bit-identical to --zero 0 at every stage (every parameter
and moment: measured).  With it (the default, and it bites here: 3 steps without it end 4e-4 lower) the
global norm sums each shard's squares where --zero 0 sums each tensor's, another float32 order,
so the weights differ by float noise (measured 2e-7 at most): compared at rtol 1e-5."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_dist import final_params, launch, losses  # noqa: E402
from test_train_zero import _memory  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

MOE = ("--moe-experts", "4", "--moe-top-k", "2", "--moe-aux-alpha", "0.1", "--ep", "2", "--steps", "3")
NO_CLIP = ("--grad-clip", "0")


def _same_model(ref, out, exact: bool) -> None:
    a, b = final_params(ref), final_params(out)
    assert sorted(a) == sorted(b)  # the whole model under one device's names, every expert whole
    for k in a:
        if exact:
            assert np.array_equal(b[k], a[k]), k
        else:  # atol: AdamW turns float noise in a near-zero gradient into ~1e-6 steps
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def zero0(shared_dir):
    """4 ranks, --ep 2 --zero 0, without and with the clip: the runs ZeRO must reproduce."""
    def make(base):
        for name, extra in (("no_clip", NO_CLIP), ("clip", ())):
            r = launch(4, base / name, *MOE, "--zero", "0", *extra)
            assert r.returncode == 0, r.stderr[-3000:]

    return shared_dir("zero_ep-zero0", make)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_ep_trains_what_zero_0_trains(tmp_path, zero0, stage):
    out = tmp_path / "z"
    r = launch(4, out, *MOE, "--zero", str(stage), *NO_CLIP)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(zero0 / "no_clip")
    _same_model(zero0 / "no_clip", out, exact=True)
    # The moments: the dense parameters' over 4 ranks, each rank's experts' over the 2 ranks that
    # hold them (2 layers x 2 of the 4 experts x (2 x 32 x 128 + 128 + 32) = 33,408 floats a rank):
    # 8 bytes x (dense / 4 + experts / 2), where sharding everything over 4 would give 8 x psi / 4.
    mem = _memory(out)
    experts = 2 * 2 * (2 * 32 * 128 + 128 + 32)
    dense = mem["psi"] - experts
    assert mem["expected"]["moments"] == 8 * (dense // 4 + experts // 2), mem
    assert mem["expected"]["grads"] == (4 * mem["psi"] if stage == 1 else 4 * (dense // 4 + experts // 2)), mem
    if stage == 3:  # the parameters too, split alike (a unit's gathered ones live in the activations pool)
        assert mem["expected"]["params"] == 4 * (dense // 4 + experts // 2), mem
        # What the weights pool holds between uses: its size classes' rounding stays under the
        # other half of this rank's experts (4 x experts / 2 bytes), which holding them whole would add.
        assert mem["weights_pool_in_use"] < mem["expected_total"] + 2 * experts, mem
    assert mem["expected_total"] <= mem["weights_pool_in_use"]
    if stage == 2:  # with the clip (norm summed per shard): float noise, see the module docstring
        clipped = tmp_path / "clip"
        r = launch(4, clipped, *MOE, "--zero", "2")
        assert r.returncode == 0, r.stderr[-3000:]
        np.testing.assert_allclose(losses(clipped), losses(zero0 / "clip"), rtol=1e-5)
        _same_model(zero0 / "clip", clipped, exact=False)


@pytest.mark.slow  # two 4-rank pipeline runs: 28 s on 2 loaded cores
def test_zero_with_ep_and_pp_trains_what_zero_0_trains(tmp_path):
    """pp 2 x dp 2 x ep 2: each stage's ZeRO shards its experts over the stage's ranks holding
    the same experts (here each stage's 2 data-parallel ranks split the experts: one rank each)."""
    runs = {}
    for stage in ("0", "1"):
        out = runs[stage] = tmp_path / stage
        r = launch(4, out, *MOE, "--pp", "2", "--microbatches", "4", "--zero", stage, *NO_CLIP)
        assert r.returncode == 0, r.stderr[-3000:]
    assert losses(runs["1"]) == losses(runs["0"])
    _same_model(runs["0"], runs["1"], exact=True)


@pytest.mark.parametrize("stage", ["1", "3"])
def test_a_checkpoint_moves_from_zero_n_to_zero_0_and_back_under_ep(tmp_path, zero0, stage):
    """One step under --zero 1 (or 3), one under --zero 0, the last under --zero 1 (3) again: each
    resume reads the other stage's checkpoint (whole tensors under one device's names)."""
    out = tmp_path / "run"
    for i, (zero, resume) in enumerate(((stage, ()), ("0", ("--resume",)), (stage, ("--resume",)))):
        r = launch(4, out, *MOE, "--zero", zero, *NO_CLIP, *resume, *(("--stop-after", "1") if i < 2 else ()))
        assert r.returncode == 0, r.stderr[-3000:]
        if i:
            assert f"(saved by 4 ranks, ZeRO-{stage if i == 1 else '0'})" in r.stdout, r.stdout[-2000:]
    assert losses(out) == losses(zero0 / "no_clip")
    _same_model(zero0 / "no_clip", out, exact=True)
