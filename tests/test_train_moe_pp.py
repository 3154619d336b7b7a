"""Mixture of experts with pipeline parallelism: every stage adds the load-balancing loss of its
own blocks to its backward, so a pipeline of MoE blocks trains what one device accumulating the
same micro-batches trains (also over data-parallel replicas, and with expert parallelism
splitting each stage's data-parallel ranks); the logged aux loss and dropped pairs are the sums
over the stages; the settings that still cannot work are one line naming the flag."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402
from test_train_dist import _one_line_error, _train_args, final_params, launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

B, T, M, ALPHA = 2, 16, 4, 0.1


def grads_against(stage, ref_grads: dict) -> tuple[list, dict]:
    """A pipeline stage's parameter gradients against one device's: the names that are equal bit
    for bit, and for the others the largest difference relative to the largest reference value."""
    exact, close = [], {}
    for name, p in stage.named_parameters():
        got, want = p.grad.numpy(), ref_grads[name]
        if np.array_equal(got, want):
            exact.append(name)
        else:
            close[name] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return exact, close


def _rank_main(out_dir: str) -> None:
    """Each rank: one device's gradients of ``loss + aux`` over M micro-batches, then this rank's
    1F1B stage and its interleaved (2 chunks) stage of the same MoE GPT on the same micro-batches."""
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.moe import aux_loss, dropped_pairs, use_experts
    from helios.schedule.pipeline import InterleavedPipelineStage, PipelineStage

    dist.init_process_group(backend="shm")
    grid = ParallelGrid(pp=dist.get_world_size())
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=4, n_head=2, n_embd=32)
    rng = np.random.default_rng(5)
    xs = [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(M)]
    ys = [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(M)]

    def moe_gpt():  # capacity 1.25: some (token, choice) pairs are dropped
        return use_experts(GPT(cfg, seed=4), 4, top_k=2, capacity_factor=1.25, aux_alpha=ALPHA)

    ref = moe_gpt()
    ref_aux, ref_dropped = 0.0, 0
    for x, y in zip(xs, ys):  # as helios-train's one-device step: (loss / M + aux / M).backward()
        loss = ref(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64))[1] * (1.0 / M)
        aux = aux_loss(ref) * (1.0 / M)
        (loss + aux).backward()
        ref_aux += aux.item()
        ref_dropped += int(dropped_pairs(ref).item())
    ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    res = {"ref_aux": ref_aux, "ref_dropped": ref_dropped}
    for kind, stage in (("1f1b", PipelineStage(moe_gpt(), grid)), ("interleaved", InterleavedPipelineStage(moe_gpt(), grid, 2))):
        stage.train_step(xs, ys)
        exact, close = grads_against(stage, ref_grads)
        aux, dropped = stage.moe_totals()
        res[kind] = {"exact": exact, "close": close, "aux": aux, "dropped": dropped}
    with open(os.path.join(out_dir, f"rank{grid.rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_every_stage_differentiates_its_blocks_aux_loss_as_one_device_does(tmp_path):
    check_ok(run_ranks([__file__, str(tmp_path)], 2, timeout=240))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for kind in ("1f1b", "interleaved"):
        routers = [n for r in ranks for n in r[kind]["exact"] if n.endswith("mlp.router.weight")]
        assert sorted(routers) == [f"h.{i}.mlp.router.weight" for i in range(4)]  # every block, on one stage
        for r in ranks:
            # Bit for bit (the aux loss's gradient is 1/M on every layer, as in one device's
            # backward of loss + aux), but the tied table: its two halves are summed in another order.
            assert set(r[kind]["close"]) <= {"wte.weight"}, r[kind]["close"]
            assert all(v < 1e-6 for v in r[kind]["close"].values()), r[kind]["close"]
            # The log's figures: the sums over both stages, as one device has them.
            assert r[kind]["dropped"] == r["ref_dropped"] > 0
            assert r[kind]["aux"] == pytest.approx(r["ref_aux"], rel=1e-6)
            assert r[kind]["aux"] > 0


MOE = ("--moe-experts", "4", "--moe-top-k", "2", "--moe-aux-alpha", str(ALPHA), "--steps", "4")


def _logged(stdout: str) -> tuple[str, str]:
    """The aux loss and dropped pairs of the last step's line rank 0 printed."""
    line = [s for s in stdout.splitlines() if " aux " in s and "(final)" not in s][-1]
    return line.split(" aux ")[1].split()[0], line.split(" dropped ")[1].split()[0]


def _same_model(ref, out) -> None:
    a, b = final_params(ref), final_params(out)
    assert sorted(a) == sorted(b)  # the whole model under one device's names, every expert whole
    for k in a:  # atol: AdamW turns float noise in a near-zero gradient into ~1e-6 steps
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_pp2_trains_what_one_rank_accumulating_the_micro_batches_trains(tmp_path):
    one = launch(1, tmp_path / "one", *MOE, "--microbatches", "4")
    assert one.returncode == 0, one.stderr[-3000:]
    pp = launch(2, tmp_path / "pp", *MOE, "--pp", "2", "--microbatches", "4")
    assert pp.returncode == 0, pp.stderr[-3000:]
    assert "pipeline parallel 2 (4 micro-batches) x data parallel 1" in pp.stdout
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "pp")
    assert len(got) == 4
    # The first step's loss is the same sum of the same scaled micro-batch losses: bit for bit.
    # After it, rtol: the tied table's gradient is summed in another order (see test_pipeline).
    assert got[0] == ref[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    _same_model(tmp_path / "one", tmp_path / "pp")
    assert _logged(pp.stdout) == _logged(one.stdout)  # the sums over the stages: one rank's figures
    # Without its load-balancing loss the model trains measurably otherwise: the check above can fail.
    off = launch(1, tmp_path / "off", *MOE, "--microbatches", "4", "--moe-aux-alpha", "0")
    assert off.returncode == 0, off.stderr[-3000:]
    a, b = final_params(tmp_path / "one"), final_params(tmp_path / "off")
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a if "router" in k) > 1e-3


@pytest.mark.parametrize("ep", [1, 2])
def test_pp2_over_two_replicas_trains_what_one_rank_trains(tmp_path, ep):
    """pp 2 x dp 2 on 4 ranks (with --ep 2: each stage's two replicas split the experts) against
    one rank accumulating the same 8 one-sequence micro-batches (an expert's capacity follows the
    tokens of a micro-batch: the same on both)."""
    one = launch(1, tmp_path / "one", *MOE, "--microbatches", "8")
    assert one.returncode == 0, one.stderr[-3000:]
    out = tmp_path / "pp_dp"
    r = launch(4, out, *MOE, "--pp", "2", "--microbatches", "4", "--ep", str(ep), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline parallel 2 (4 micro-batches) x data parallel 2" in r.stdout
    np.testing.assert_allclose(losses(out), losses(tmp_path / "one"), rtol=1e-5)
    _same_model(tmp_path / "one", out)
    if ep == 2:  # stopped under pp 2 x ep 2, resumed on one rank holding every expert
        part = tmp_path / "part"
        a = launch(4, part, *MOE, "--pp", "2", "--microbatches", "4", "--ep", "2", "--stop-after", "2", timeout=400)
        assert a.returncode == 0 and "stopped at step 2" in a.stdout, a.stderr[-3000:]
        b = launch(1, part, "--steps", "4", "--resume", "--microbatches", "8")
        assert b.returncode == 0, b.stderr[-3000:]
        np.testing.assert_allclose(losses(part), losses(tmp_path / "one"), rtol=1e-5)


@pytest.mark.parametrize("world,args,needle", [
    (2, ["--moe-experts", "4", "--pp", "2", "--ep", "2"], "--ep 2 must divide the data-parallel ranks (1)"),
])
def test_moe_pipeline_settings_that_cannot_work_are_one_line(tmp_path, world, args, needle):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, *args)], world, timeout=120)
    _one_line_error(res, needle)
    assert all(r.code == 2 for r in res)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
