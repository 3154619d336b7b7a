"""Pipeline parallelism (1F1B) on real ranks: every stage's gradients equal those of one
device accumulating the same micro-batches, and so does the loss, bit for bit."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

B, T = 2, 16


def _rank_main(out_dir: str, m: int) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.pipeline import PipelineStage

    dist.init_process_group(backend="shm")
    pp = dist.get_world_size()
    grid = ParallelGrid(pp=pp)
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=4, n_head=2, n_embd=32)
    rng = np.random.default_rng(11)
    xs = [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(m)]
    ys = [rng.integers(0, cfg.vocab_size, (B, T)) for _ in range(m)]

    ref = GPT(cfg, seed=4)  # one device accumulating the same micro-batches
    ref_loss = None  # summed on the device in micro-batch order, as helios-train accumulates it
    for x, y in zip(xs, ys):
        loss = ref(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64))[1] * (1.0 / m)
        loss.backward()
        ref_loss = loss.detach() if ref_loss is None else ref_loss + loss.detach()
    stage = PipelineStage(GPT(cfg, seed=4), grid)
    loss = stage.train_step(xs, ys)
    ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    res = {"stage": stage.stage, "blocks": stage.block_ids, "exact": [], "close": {}}
    for name, p in stage.named_parameters():  # a stage's parameters keep the whole model's names
        want = ref_grads[name]
        got = p.grad.numpy()
        if np.array_equal(got, want):
            res["exact"].append(name)
        else:
            res["close"][name] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    evaluated, logits = stage.evaluate(xs, ys), stage.infer(xs[0])  # forward only: no gradients
    if stage.last:
        res["loss"], res["ref_loss"] = loss, ref_loss.item()
        with hl.no_grad():
            want = None
            for x, y in zip(xs, ys):
                part = ref(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64))[1] * (1.0 / m)
                want = part if want is None else want + part
            ref_logits = ref(hl.tensor(xs[0], dtype=hl.int64))[0].numpy()
        res["eval"], res["ref_eval"] = evaluated, want.item()
        res["logits_equal"] = bool(np.array_equal(stage.full_logits(logits), ref_logits))
    else:
        res["forward_only_elsewhere"] = [evaluated, logits]
    with open(os.path.join(out_dir, f"pp{pp}-m{m}-stage{stage.stage}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 8)])
def test_1f1b_gradients_equal_one_device_accumulating_the_micro_batches(tmp_path, pp, m):
    check_ok(run_ranks([__file__, str(tmp_path), str(m)], pp, timeout=240))
    stages = [json.loads((tmp_path / f"pp{pp}-m{m}-stage{s}.json").read_text()) for s in range(pp)]
    blocks = [b for s in stages for b in s["blocks"]]
    assert blocks == list(range(4))  # every block on exactly one stage, in order
    for s in stages:
        # Bit for bit, except the tied table, whose two halves are summed in another order.
        assert set(s["close"]) <= {"wte.weight"}, s["close"]
        assert all(v < 1e-6 for v in s["close"].values()), s["close"]
        assert s["exact"], s
    last = stages[-1]
    assert last["loss"] == last["ref_loss"]
    assert last["eval"] == last["ref_eval"] and last["logits_equal"]
    assert all(s["forward_only_elsewhere"] == [None, None] for s in stages[:-1])


def test_stages_are_balanced_by_parameter_count():
    from helios.schedule.pipeline import balance, describe_stages

    assert balance([10, 1, 1, 1, 1, 10], 2) == [(0, 3), (3, 6)]
    assert balance([4, 4, 4, 4], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert balance([1, 100, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="5 stages for 4 layers"):
        balance([1, 1, 1, 1], 5)
    assert describe_stages([(0, 3), (3, 6)], 4) == (
        "0: embeddings, blocks 0-1 | 1: blocks 2-3, final LayerNorm and output layer")
    assert describe_stages([(0, 1), (1, 2), (2, 3)], 1) == (
        "0: embeddings | 1: block 0 | 2: final LayerNorm and output layer")


def test_a_trace_renders_as_one_timeline_per_rank():
    from helios.schedule.pipeline import timeline

    def x(pid, cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": 1000, "ts": ts, "dur": dur}

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "helios rank 0 host"}},
              {"ph": "M", "name": "process_name", "pid": 101, "args": {"name": "helios rank 1 host"}},
              x(1, "step", "step 3", 0, 100), x(1, "phase", "forward", 0, 20), x(1, "phase", "backward", 20, 60),
              x(1, "phase", "comm", 30, 20), x(1, "phase", "optimizer", 90, 10),
              x(101, "step", "step 3", 5, 50), x(101, "phase", "forward", 5, 30), x(101, "phase", "comm", 5, 10),
              x(101, "step", "step 4", 200, 100), x(101, "phase", "forward", 200, 100)]  # a later step: not drawn
    assert timeline({"traceEvents": events}, width=10).splitlines() == [
        "  rank 0 |FFB..BBB o|",  # 80-90: no phase open
        "  rank 1 |.FF  |",
    ]
    with pytest.raises(ValueError, match="no profiled step"):
        timeline({"traceEvents": []})


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
