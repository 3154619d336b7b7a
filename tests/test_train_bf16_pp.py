"""helios-train --dtype bf16 with --pp and with --moe-experts: every stage's forward runs under
the same autocast as one device's, so a pipeline trains what one rank accumulating the same
micro-batches trains in bf16, the interleaved schedule too; mixture-of-experts blocks run in
bf16 on one rank, through a pipeline and with their experts split over two ranks.

Each bf16 run's first loss must equal one rank's bf16 first loss bit for bit and differ from
its fp32 one (5.47585 against 5.47581 on the nano model): that shows autocast ran in the
stages.  Later steps are compared with the tolerances the pipeline tests use (the tied table's
two gradients are summed in another order), except under expert parallelism, see there."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402
from test_train_dist import final_params, launch, losses  # noqa: E402
from test_train_moe_pp import grads_against  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

STEPS = ("--steps", "3")
MOE = ("--moe-experts", "4", "--moe-top-k", "2", "--moe-aux-alpha", "0.1")


def _same_model(ref, out, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    a, b = final_params(ref), final_params(out)
    assert sorted(a) == sorted(b)  # the whole model under one device's names, every expert whole
    for k in a:  # atol: AdamW turns float noise in a near-zero gradient into ~1e-6 steps
        x, y = b[k], a[k]
        if k.endswith("attn.c_attn.bias"):
            # Not the key bias (the middle third): its true gradient is exactly 0 (softmax does
            # not change when a query's scores all shift alike), so what it gets is rounding
            # noise, bfloat16-sized under autocast, and AdamW normalises noise into steps of the
            # learning rate's size whatever its scale (measured up to 2.7e-4 apart).
            third = x.size // 3
            x, y = np.delete(x, np.s_[third:2 * third]), np.delete(y, np.s_[third:2 * third])
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=k)


def _first_loss_is_bf16(out, bf16_ref, fp32_ref) -> None:
    got = losses(out)[0]
    assert got == losses(bf16_ref)[0]  # the same ops on the same micro-batches
    assert got != losses(fp32_ref)[0]  # ... and they ran in bfloat16


@pytest.fixture(scope="module")
def refs(shared_dir):
    """One rank in bf16 and in fp32, 4 micro-batches of 2 sequences (dense and MoE), and MoE in
    bf16 over 8 micro-batches of one sequence (what 2 ranks x 4 micro-batches each see)."""
    runs = {"bf16": ("--dtype", "bf16", "--microbatches", "4"), "fp32": ("--steps", "1", "--microbatches", "4"),
            "moe_bf16": (*MOE, "--dtype", "bf16", "--microbatches", "4"),
            "moe_fp32": (*MOE, "--steps", "1", "--microbatches", "4"),
            "moe_bf16_8": (*MOE, "--dtype", "bf16", "--microbatches", "8")}

    def make(base):
        for name, flags in runs.items():
            r = launch(1, base / name, *STEPS, *flags)
            assert r.returncode == 0, r.stderr[-3000:]
            (base / f"{name}.stdout").write_text(r.stdout)

    base = shared_dir("bf16_pp-refs", make)
    out = {}
    for name in runs:
        out[name], out[name + "_stdout"] = base / name, (base / f"{name}.stdout").read_text()
    return out


def _final_val(stdout: str) -> float:
    """The final validation loss of rank 0's summary line."""
    line = [s for s in stdout.splitlines() if '"final_val_loss"' in s][-1]
    return json.loads(line.split("] ", 1)[1])["final_val_loss"]


def test_pp2_in_bf16_trains_what_one_rank_accumulating_the_micro_batches_trains(tmp_path, refs):
    out = tmp_path / "pp"
    r = launch(2, out, *STEPS, "--dtype", "bf16", "--pp", "2", "--microbatches", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mixed precision: --dtype bf16, matmuls in bfloat16" in r.stdout
    _first_loss_is_bf16(out, refs["bf16"], refs["fp32"])
    np.testing.assert_allclose(losses(out), losses(refs["bf16"]), rtol=1e-5)
    _same_model(refs["bf16"], out)
    # The final validation loss ran through the stages under autocast as well.
    assert _final_val(r.stdout) == _final_val(refs["bf16_stdout"])


def test_moe_pp2_in_bf16_trains_what_one_rank_trains(tmp_path, refs):
    out = tmp_path / "moe_pp"
    r = launch(2, out, *STEPS, *MOE, "--dtype", "bf16", "--pp", "2", "--microbatches", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    _first_loss_is_bf16(out, refs["moe_bf16"], refs["moe_fp32"])
    np.testing.assert_allclose(losses(out), losses(refs["moe_bf16"]), rtol=1e-5)
    # atol 5e-5: the tied table's gradient is summed between the stages in another order (as
    # in fp32), its last float32 bit can move a bfloat16 rounding of the table the next step's
    # output layer reads (2^-8 relative), and AdamW's normalised step carries that into a few
    # weights by a small part of the learning rate (3e-3): measured 1.6e-5 at most.
    _same_model(refs["moe_bf16"], out, atol=5e-5)


def test_moe_ep2_in_bf16_trains_what_one_rank_trains(tmp_path, refs):
    """--ep 2 on 2 ranks against one rank accumulating the same 8 one-sequence micro-batches.
    The first loss is bit-equal (the forward computes every token alike).  After it, 2e-4: an
    expert's weight gradient is a bfloat16 matmul's output, rounded to bfloat16 once per
    matmul; expert-parallel, one matmul sums the rows both ranks sent, where one rank rounds
    each micro-batch's sum and adds them in float32, so the expert gradients differ in their
    last bfloat16 bit (measured: losses 7.9e-5 apart over 3 steps; in fp32 4.6e-8; bf16 and
    fp32 one-rank runs 3e-4 apart).  The weights are not compared element by element: AdamW
    turns those last-bit differences of near-zero gradients into steps of the learning rate's
    size (after 3 steps they are as far from one rank's bf16 weights as one rank's fp32 ones
    are); the checkpoint holds the same whole tensors."""
    out = tmp_path / "moe_ep"
    r = launch(2, out, *STEPS, *MOE, "--dtype", "bf16", "--ep", "2", "--microbatches", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    got, ref = losses(out), losses(refs["moe_bf16_8"])
    assert got[0] == ref[0]
    np.testing.assert_allclose(got, ref, rtol=2e-4)
    a, b = final_params(refs["moe_bf16_8"]), final_params(out)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}


B, T, M = 2, 16, 4


def _rank_main(out_dir: str) -> None:
    """Each rank: one device's bf16 gradients over M micro-batches, then this rank's 1F1B stage
    and its interleaved (2 chunks) stage of the same GPT on the same micro-batches, in bf16."""
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.pipeline import InterleavedPipelineStage, PipelineStage

    dist.init_process_group(backend="shm")
    grid = ParallelGrid(pp=dist.get_world_size())
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=4, n_head=2, n_embd=32)
    rng = np.random.default_rng(5)
    xs = [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(M)]
    ys = [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(M)]

    def bf16():
        return hl.autocast("bfloat16")

    ref = GPT(cfg, seed=4)
    total = None
    for x, y in zip(xs, ys):  # as helios-train's one-device step
        with bf16():
            loss = ref(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64))[1]
        loss = loss * (1.0 / M)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()  # summed on the device, in order
    ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    res = {"ref_loss": total.item()}
    for kind, stage in (("1f1b", PipelineStage(GPT(cfg, seed=4), grid)),
                        ("interleaved", InterleavedPipelineStage(GPT(cfg, seed=4), grid, 2))):
        loss = stage.train_step(xs, ys, autocast=bf16)
        for name, p in stage.named_parameters():
            assert p.grad.dtype is hl.float32, (name, p.grad.dtype)
        exact, close = grads_against(stage, ref_grads)
        res[kind] = {"exact": exact, "close": close, "loss": loss}
    with open(os.path.join(out_dir, f"rank{grid.rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_1f1b_and_interleaved_stages_get_one_devices_bf16_gradients(tmp_path):
    check_ok(run_ranks([__file__, str(tmp_path)], 2, timeout=240))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for kind in ("1f1b", "interleaved"):
        assert ranks[1][kind]["loss"] == ranks[1]["ref_loss"]  # the last rank's: the same scaled sum
        for r in ranks:
            # Bit for bit but the tied table, whose two halves are summed in another order.
            assert set(r[kind]["close"]) <= {"wte.weight"}, r[kind]["close"]
            assert all(v < 1e-6 for v in r[kind]["close"].values()), r[kind]["close"]
            assert len(r[kind]["exact"]) > 10


if __name__ == "__main__":
    _rank_main(sys.argv[1])
