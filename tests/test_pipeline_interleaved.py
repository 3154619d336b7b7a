"""The interleaved pipeline schedule (Megatron-LM's virtual stages, ``--pp-virtual``): the
schedule on its own (every operation once, dependencies kept, the bubble exactly
(p - 1) / (v m + p - 1) on a unit-time clock), then on real ranks (a 2 x 2 interleaved
pipeline trains what one device accumulating the same micro-batches trains), then helios-train."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

B, T, M, STEPS = 2, 16, 4, 3
CASES = [(2, 1, 4), (4, 1, 8), (2, 2, 2), (2, 2, 4), (2, 2, 8), (3, 2, 6), (2, 3, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)]


@pytest.mark.parametrize("p,v,m", CASES)
def test_every_operation_runs_once_after_what_it_needs(p, v, m):
    from helios.schedule.pipeline import pipeline_schedule, simulate_schedule

    every = sorted((kind, i, c) for kind in "FB" for i in range(m) for c in range(v))
    for r in range(p):
        ops = pipeline_schedule(p, v, m, r)
        assert sorted(ops) == every  # each (micro-batch, chunk) forward and backward exactly once
        pos = {op: n for n, op in enumerate(ops)}
        for i in range(m):
            for c in range(v):
                assert pos[("F", i, c)] < pos[("B", i, c)]
        for c in range(v):  # a chunk takes its micro-batches in order, forwards and backwards
            assert [i for kind, i, cc in ops if kind == "F" and cc == c] == list(range(m))
            assert [i for kind, i, cc in ops if kind == "B" and cc == c] == list(range(m))
    # Across ranks: on the simulated clock, each operation starts after what it waits for ends.
    ends = {}
    for end, r, kind, i, c in simulate_schedule(p, v, m)["order"]:
        ends[(kind, i, c * p + r)] = end
    last = p * v - 1
    for (kind, i, k), end in ends.items():
        start = end - 1
        if kind == "F" and k > 0:
            assert ends[("F", i, k - 1)] <= start
        if kind == "B":
            assert ends[("F", i, k)] <= start
            if k < last:
                assert ends[("B", i, k + 1)] <= start


@pytest.mark.parametrize("p,v,m", CASES)
def test_the_simulated_bubble_is_the_formula(p, v, m):
    from helios.schedule.pipeline import bubble_fraction, simulate_schedule

    sim = simulate_schedule(p, v, m)
    assert sim["makespan"] == 2 * (v * m + p - 1)  # unit-time chunk forwards and backwards
    want = (p - 1) / (v * m + p - 1)
    assert bubble_fraction(p, v, m) == want
    for idle in sim["idle_fraction"]:
        assert idle == pytest.approx(want, abs=1e-12)
    if v > 1:  # the interleaving is what shrinks it: 1F1B on the same (p, m) idles more
        assert max(sim["idle_fraction"]) < min(simulate_schedule(p, 1, m)["idle_fraction"])


def test_the_orders_are_1f1b_and_megatrons_interleaving():
    from helios.schedule.pipeline import pipeline_schedule

    F = lambda i, c=0: ("F", i, c)  # noqa: E731
    Bk = lambda i, c=0: ("B", i, c)  # noqa: E731
    # 1F1B, stage 1 of 4, 6 micro-batches: 2 forwards fill the pipe, then alternate.
    assert pipeline_schedule(4, 1, 6, 1) == [F(0), F(1), F(2), Bk(0), F(3), Bk(1), F(4), Bk(2), F(5), Bk(3),
                                             Bk(4), Bk(5)]
    # Interleaved, 2 ranks x 2 chunks, 4 micro-batches (groups of 2): rank 0 fills the pipe with
    # 2 (p - r - 1) + (v - 1) p = 4 forwards; backwards start from the last chunk.
    assert pipeline_schedule(2, 2, 4, 0) == [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), Bk(0, 1), F(3, 0),
                                             Bk(1, 1), F(2, 1), Bk(0, 0), F(3, 1), Bk(1, 0), Bk(2, 1), Bk(3, 1),
                                             Bk(2, 0), Bk(3, 0)]
    assert pipeline_schedule(2, 2, 4, 1)[:4] == [F(0, 0), F(1, 0), F(0, 1), Bk(0, 1)]


def test_bad_schedules_are_refused_by_name():
    from helios.schedule.pipeline import pipeline_schedule

    with pytest.raises(ValueError, match="3 micro-batches is not a multiple of 2"):
        pipeline_schedule(2, 2, 3, 0)
    with pytest.raises(ValueError, match="virtual must be at least 1"):
        pipeline_schedule(2, 0, 4, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        pipeline_schedule(2, 2, 4, 2)
    from types import SimpleNamespace

    from helios.schedule.pipeline import InterleavedPipelineStage

    gpt = SimpleNamespace(config=SimpleNamespace(n_layer=4))
    with pytest.raises(ValueError, match="virtual 2 interleaves the stages of a pipeline; the grid has pp 1"):
        InterleavedPipelineStage(gpt, SimpleNamespace(pp=1), 2)
    with pytest.raises(ValueError, match="2 ranks x 4 chunks is 8 virtual stages, more than the model's 4"):
        InterleavedPipelineStage(gpt, SimpleNamespace(pp=2), 4)


def test_the_flag_is_checked_against_the_layout(capsys):
    from helios.schedule.pipeline import describe_stages
    from helios.train_settings import check_bounds, check_layout

    # world, tp, pp, microbatches, zero, batch, n_layer, n_head, n_embd
    lay = check_layout(2, 1, 2, 4, 0, 8, 4, 2, 32, virtual=2)
    assert lay.virtual == 2
    assert lay.describe() == "pipeline parallel 2 x 2 virtual stages (interleaved, 4 micro-batches) x data parallel 1"
    assert check_layout(2, 1, 2, 4, 0, 8, 4, 2, 32).describe() == (
        "pipeline parallel 2 (4 micro-batches) x data parallel 1")  # --pp-virtual 1: as before
    assert describe_stages([(0, 2), (2, 3), (3, 4), (4, 6)], 4, 2) == (
        "0 (rank 0 chunk 0): embeddings, block 0 | 1 (rank 1 chunk 0): block 1 | 2 (rank 0 chunk 1): block 2 | "
        "3 (rank 1 chunk 1): block 3, final LayerNorm and output layer")
    refused = [
        (dict(world=4, tp=1, pp=4, microbatches=6, batch=24), "--microbatches 6 must be a multiple of --pp 4"),
        (dict(world=2, tp=1, pp=2, microbatches=4, batch=8, n_layer=2), "--pp 2 x --pp-virtual 2 = 4 virtual stages, "
                                                                       "more than the model's 2 transformer layers"),
        (dict(world=2, tp=1, pp=1, microbatches=4, batch=8), "--pp-virtual 2 interleaves the stages of a pipeline"),
    ]
    for kw, needle in refused:
        a = dict(zero=0, n_layer=8, n_head=2, n_embd=32, virtual=2) | kw
        with pytest.raises(SystemExit) as e:
            check_layout(a["world"], a["tp"], a["pp"], a["microbatches"], a["zero"], a["batch"], a["n_layer"],
                         a["n_head"], a["n_embd"], virtual=a["virtual"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        check_bounds({"pp_virtual": 0})
    assert "--pp-virtual must be at least 1" in capsys.readouterr().err


def _rank_main(out_dir: str, v: int) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.pipeline import InterleavedPipelineStage

    dist.init_process_group(backend="shm")
    pp = dist.get_world_size()
    grid = ParallelGrid(pp=pp)
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=4, n_head=2, n_embd=32)
    rng = np.random.default_rng(5)
    batches = [([rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(M)],
                [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(M)]) for _ in range(STEPS)]

    ref = GPT(cfg, seed=3)  # one device accumulating the same micro-batches, in order
    ref_opt = AdamW(ref.parameters(), lr=1e-2)
    ref_losses, ref_grads = [], None
    for xs, ys in batches:
        total = None
        for x, y in zip(xs, ys):
            loss = ref(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64))[1] * (1.0 / M)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        ref_losses.append(total.item())
        if ref_grads is None:
            ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()

    stage = InterleavedPipelineStage(GPT(cfg, seed=3), grid, v)
    opt = AdamW(stage.parameters(), lr=1e-2)
    res = {"rank": stage.stage, "chunks": stage.chunk_blocks, "losses": [], "idle": [], "grads_exact": [],
           "grads_close": {}}
    for step, (xs, ys) in enumerate(batches):
        res["losses"].append(stage.train_step(xs, ys))
        res["idle"].append(stage.last_idle_fraction)
        if step == 0:
            for name, p in stage.named_parameters():  # the whole model's names
                got, want = p.grad.numpy(), ref_grads[name]
                if np.array_equal(got, want):
                    res["grads_exact"].append(name)
                else:
                    res["grads_close"][name] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        opt.step()
        opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    # |got - want| beyond rtol 1e-5 of want: within atol 1e-5 where the weights agree (as
    # test_train_dist: AdamW amplifies the float noise of the key bias, whose gradient is ~0).
    res["params"] = {n: float(np.max(np.abs(p.numpy() - ref_params[n].numpy()) - 1e-5 * np.abs(ref_params[n].numpy())))
                     for n, p in stage.named_parameters()}
    xs, ys = batches[0]
    evaluated, logits = stage.evaluate(xs, ys), stage.infer(xs[0])  # forward only, through every chunk
    if stage.last:
        res["ref_losses"] = ref_losses
        with hl.no_grad():
            want = None
            for x, y in zip(xs, ys):
                part = ref(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64))[1] * (1.0 / M)
                want = part if want is None else want + part
            res["eval"], res["ref_eval"] = evaluated, want.item()
            got, want_logits = stage.full_logits(logits), ref(hl.tensor(xs[0], dtype=hl.int64))[0].numpy()
            res["logits_close"] = bool(np.allclose(got, want_logits, rtol=1e-5, atol=1e-5))
    else:
        res["forward_only_elsewhere"] = [evaluated, logits]
    with open(os.path.join(out_dir, f"v{v}-rank{stage.stage}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("v", [2, 1])
def test_two_ranks_two_chunks_train_what_one_device_trains(tmp_path, v):
    from helios.schedule.pipeline import bubble_fraction

    check_ok(run_ranks([__file__, str(tmp_path), str(v)], 2, timeout=240))
    ranks = [json.loads((tmp_path / f"v{v}-rank{r}.json").read_text()) for r in range(2)]
    if v == 2:  # 4 blocks over 2 ranks x 2 chunks, round-robin: virtual stage c * 2 + r holds block c * 2 + r
        assert [r["chunks"] for r in ranks] == [[[0], [2]], [[1], [3]]]
    else:  # one chunk per rank: the class runs 1F1B's order
        assert [r["chunks"] for r in ranks] == [[[0, 1]], [[2, 3]]]
    last = ranks[-1]
    # Step 1 starts from the same weights: the same scaled losses summed in the same order.
    assert last["losses"][0] == last["ref_losses"][0]
    # Later steps follow the tied table, whose two gradient halves are summed in another order.
    np.testing.assert_allclose(last["losses"], last["ref_losses"], rtol=1e-5)
    assert ranks[0]["losses"] == [None] * STEPS
    for r in ranks:
        assert set(r["grads_close"]) <= {"wte.weight"}, r["grads_close"]  # every other gradient bit for bit
        assert all(v < 1e-6 for v in r["grads_close"].values()), r["grads_close"]
        assert r["grads_exact"]
        assert all(v <= 1e-5 for v in r["params"].values()), r["params"]  # after 3 AdamW steps (rtol, atol 1e-5)
    # After the steps the weights agree to float noise (the tied table), so forward-only does too.
    assert last["eval"] == pytest.approx(last["ref_eval"], rel=1e-5) and last["logits_close"]
    assert ranks[0]["forward_only_elsewhere"] == [None, None]
    want = bubble_fraction(2, v, M)
    for r in ranks:
        # On 2 oversubscribed cores the measured wait is noise around the bubble: reported, the
        # formula is checked exactly on the schedule's simulated clock above.
        print(f"v {v} rank {r['rank']}: measured idle fraction per step {[round(x, 3) for x in r['idle']]}, "
              f"formula (p-1)/(vm+p-1) = {want:.3f}")
        assert all(0.0 <= x < 1.0 for x in r["idle"])


def _train(world, out, *flags):
    """helios-run --nproc-per-node world -m helios.train --config tiny, 3 steps, little else."""
    import subprocess

    from test_train_dist import BIN, ROOT, _env

    cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", str(world), "-m", "helios.train", "--config",
           "tiny", "--steps", "3", "--no-progress", "--eval-every", "0", "--sample-tokens", "4", "--eval-batches",
           "1", "--ckpt-every", "0", "--out", str(out), *flags]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_helios_train_runs_the_interleaved_schedule(tmp_path):
    from test_train_dist import final_params, losses

    train = _train
    r = train(2, tmp_path / "pp", "--pp", "2", "--pp-virtual", "2", "--microbatches", "4")
    assert "pipeline parallel 2 x 2 virtual stages (interleaved, 4 micro-batches) x data parallel 1" in r.stdout
    assert ("pipeline stages: 0 (rank 0 chunk 0): embeddings, block 0 | 1 (rank 1 chunk 0): block 1 | "
            "2 (rank 0 chunk 1): block 2 | 3 (rank 1 chunk 1): block 3, final LayerNorm and output layer") in r.stdout
    one = train(1, tmp_path / "one", "--microbatches", "4")  # one rank accumulating the same micro-batches
    assert one.returncode == 0
    got, want = losses(tmp_path / "pp"), losses(tmp_path / "one")
    assert len(got) == 3 and got[0] == want[0]  # the same sum of the same scaled losses, in order
    np.testing.assert_allclose(got, want, rtol=1e-5)
    from helios.schedule import checkpoint as C

    _, d = C.latest_complete(str(tmp_path / "pp"))
    assert C.metadata(d)["meta"]["grid"]["pp_virtual"] == 2  # saved with the layout, like --pp
    # A checkpoint of the interleaved run resumed on one rank: the same run.  (Interleaving with
    # data parallel: test_train_zero_pp's --pp-virtual case, 2 replicas against one rank.)
    split = tmp_path / "split"
    train(2, split, "--pp", "2", "--pp-virtual", "2", "--microbatches", "4", "--stop-after", "2")
    again = train(1, split, "--resume")
    assert "(saved by 2 ranks, pp 2, pp virtual 2, ZeRO-0)" in again.stdout
    ref = final_params(tmp_path / "one")
    for run in ("pp", "split"):
        np.testing.assert_allclose(losses(tmp_path / run), want, rtol=1e-5, err_msg=run)
        got = final_params(tmp_path / run)
        assert sorted(got) == sorted(ref)  # the whole model's tensors, under one device's names
        for k in ref:  # atol: the key bias's float noise, which AdamW amplifies (as test_train_dist)
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5, err_msg=f"{run}: {k}")


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_tensor_parallel_stages_interleave_like_1f1b(tmp_path):
    # tp 2 x pp 2 on 4 ranks: the interleaved run is the 1F1B run but for float noise (tensor
    # parallelism's own partial sums differ from one rank's by more: ~4e-5 in the tiny MLPs).
    from test_train_dist import final_params, losses

    runs = {}
    for name, flags in (("1f1b", ()), ("interleaved", ("--pp-virtual", "2"))):
        r = _train(4, tmp_path / name, "--tp", "2", "--pp", "2", "--microbatches", "4", *flags)
        runs[name] = (losses(tmp_path / name), final_params(tmp_path / name))
    assert "pipeline parallel 2 x 2 virtual stages (interleaved, 4 micro-batches) x tensor parallel 2" in r.stdout
    np.testing.assert_allclose(runs["interleaved"][0], runs["1f1b"][0], rtol=1e-6)
    for k, v in runs["1f1b"][1].items():
        np.testing.assert_allclose(runs["interleaved"][1][k], v, rtol=1e-5, atol=1e-6, err_msg=k)


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
