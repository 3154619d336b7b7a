"""Tensor parallelism on real ranks: the TP model's loss, and every gradient shard, equal the
single-device model's (each rank computes that reference itself, from the same weights), and
a transformer block makes exactly 2 all-reduces forward and 2 backward (counted by the comm
layer, not assumed)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

B, T = 2, 16


def _shard_of(name: str, full: np.ndarray, model, r: int, tp: int) -> np.ndarray:
    """The part of the single-device gradient ``full`` that TP parameter ``name`` holds."""
    cfg = model.config
    c, h = cfg.n_embd, cfg.n_head
    d, hl = c // h, h // tp
    cols = (np.arange(r * hl, (r + 1) * hl)[:, None] * d + np.arange(d)).reshape(-1)
    if name == "wte.weight":
        rows = cfg.vocab_size // tp
        return full[r * rows:(r + 1) * rows]
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        return full[np.concatenate([part * c + cols for part in range(3)])]
    if name.endswith("attn.c_proj.weight"):
        return full[:, cols]
    hidden = 4 * c // tp
    mine = np.arange(r * hidden, (r + 1) * hidden)
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
        return full[mine]
    if name.endswith("mlp.c_proj.weight"):
        return full[:, mine]
    return full  # replicated: LayerNorms, the position table, row-parallel biases


def _rank_main(out_dir: str, sequence_parallel: bool = False) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.tensor_parallel import ParallelBlock, TensorParallelGPT, gather_full, take_shard

    dist.init_process_group(backend="shm")
    tp = dist.get_world_size()
    grid = ParallelGrid(tp=tp)
    r = grid.tp_rank
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=4, n_embd=32)
    rng = np.random.default_rng(3)
    x = rng.integers(0, cfg.vocab_size, (B, T))
    y = rng.integers(0, cfg.vocab_size, (B, T))
    xt, yt = hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64)

    ref = GPT(cfg, seed=5)  # the single-device model, on every rank
    ref_logits, ref_loss = ref(xt, yt)
    ref_loss.backward()
    model = TensorParallelGPT(GPT(cfg, seed=5), grid.tp_group, sequence_parallel=sequence_parallel)
    logits, loss = model(xt, yt)
    loss.backward()

    worst = {}
    lo = model.vocab_lo
    width = cfg.vocab_size // tp
    worst["logits"] = float(np.max(np.abs(logits.numpy() - ref_logits.numpy()[..., lo:lo + width])))
    worst["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        want = _shard_of(name, ref_grads[name], model, r, tp)
        assert p.grad is not None and p.grad.shape == want.shape, (name, p.shape, want.shape)
        worst[name] = float(np.max(np.abs(p.grad.numpy() - want)) / (np.max(np.abs(want)) + 1e-12))

    # Whole tensors from the shards and back (what checkpoints of any grid are made of).
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        whole = gather_full(p, p.numpy(), grid.tp_group)
        assert np.array_equal(whole, ref_params[name].numpy().reshape(-1)), name
        assert np.array_equal(take_shard(p, whole, r), p.numpy().reshape(-1)), name

    # All-reduces of one block, forward and backward, as the comm layer counts them.
    # Collectives of one block, forward and backward, as the comm layer counts them.
    block = ParallelBlock(GPT(cfg, seed=5).h[0], grid.tp_group, sequence_parallel)
    t_in = T // tp if sequence_parallel else T  # a sequence-parallel block holds T/tp positions
    h = hl.tensor(rng.standard_normal((B, t_in, cfg.n_embd)).astype(np.float32), requires_grad=True)
    calls = lambda: dict(dist.comm_counters(grid.tp_group)["calls"])  # noqa: E731
    c0 = calls()
    out = block(h)
    c1 = calls()
    out.sum().backward()
    c2 = calls()

    def diff(a, b):
        return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}

    if r == 0:
        name = f"tp-{tp}{'-sp' if sequence_parallel else ''}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump({"worst": worst, "block_forward": diff(c0, c1), "block_backward": diff(c1, c2)}, f)
    dist.destroy_process_group()


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gpt_equals_the_single_device_model(tmp_path, tp):
    check_ok(run_ranks([__file__, str(tmp_path)], tp, timeout=240))
    with open(tmp_path / f"tp-{tp}.json") as f:
        res = json.load(f)
    bad = {k: v for k, v in res["worst"].items() if v > 1e-5}  # logits: absolute; loss and gradients: relative
    assert not bad, bad
    assert len(res["worst"]) > 10  # every parameter was compared
    assert (res["block_forward"], res["block_backward"]) == ({"all_reduce": 2}, {"all_reduce": 2})


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_gpt_equals_the_single_device_model(tmp_path, tp):
    check_ok(run_ranks([__file__, str(tmp_path), "sp"], tp, timeout=240))
    with open(tmp_path / f"tp-{tp}-sp.json") as f:
        res = json.load(f)
    bad = {k: v for k, v in res["worst"].items() if v > 1e-5}
    assert not bad, bad
    assert len(res["worst"]) > 10
    # The all-reduces become all-gathers into the column-parallel layers and reduce-scatters out
    # of the row-parallel ones; backward swaps them, gathers each column-parallel input again
    # (only its sequence shard was kept), and the 6 parameters used on a sequence shard (2
    # LayerNorms' weight and bias, 2 row-parallel biases) have their gradients summed.
    assert res["block_forward"] == {"all_gather": 2, "reduce_scatter": 2}
    assert res["block_backward"] == {"all_gather": 4, "reduce_scatter": 2, "all_reduce": 6}


def test_a_grid_that_does_not_fit_the_world_is_refused_by_numbers():
    import helios.comm as dist
    from helios.comm.launcher import free_port
    from helios.schedule.grid import ParallelGrid

    dist.init_process_group(backend="tcp", rank=0, world_size=1, master_port=free_port())
    try:
        with pytest.raises(ValueError, match=r"tp x pp = 2 x 1 = 2 does not divide the world size 1"):
            ParallelGrid(tp=2)
        with pytest.raises(ValueError, match="tp must be a positive integer"):
            ParallelGrid(tp=0)
        g = ParallelGrid()
        assert (g.tp, g.dp, g.pp, g.tp_rank) == (1, 1, 1, 0) and g.peers("tp") == [0]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sequence_parallel=sys.argv[2:] == ["sp"])
