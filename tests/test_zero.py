"""ZeRO stages 1-3 (helios.schedule.zero.ZeroAdamW) on real Helios tensors: N ranks at any stage
train what one rank with plain DDP and AdamW trains, hold the bytes the ZeRO formulas say, clip
by the same global norm, and a sharded state dict saved at one world size and stage loads at
another.

The ranks are this file run as a script.  Each run trains a nano GPT for a few AdamW steps on a
fixed global batch (rank r takes its contiguous slice), clipping the gradient norm at a value
below the norms seen, so clipping scales every step.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

STEPS = 12
SAVE_AT = 6
GLOBAL_BATCH = 8
T = 16
CLIP = 0.5
BUCKET_MB = 0.01  # ~10 KiB: stage 2 cuts the nano GPT into many segments


def _batches(step: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    data = rng.integers(0, vocab, size=(GLOBAL_BATCH, T + 1))
    return data[:, :-1], data[:, 1:]


def _assemble(src: str, ranges: dict) -> dict:
    """This rank's ranges of every tensor, cut from the global tensors a saved run's shards hold."""
    with open(os.path.join(src, "shards.json")) as f:
        meta = json.load(f)
    glob = {}
    for r in range(meta["world_size"]):
        with np.load(os.path.join(src, f"shard-{r}.npz")) as z:
            for key, (shape, start, stop) in meta["ranges"][str(r)].items():
                g = glob.setdefault(key, np.full(int(np.prod(shape)), np.nan, np.float32))
                g[start:stop] = z[key]
    for key, g in glob.items():
        assert not np.isnan(g).any(), f"{key}: the saved ranks' ranges do not cover the tensor"
    return {"step": meta["step"], "param_groups": meta["param_groups"],
            "tensors": {k: glob[k][start:stop] for k, (_, start, stop) in ranges.items()}}


def _rank_main(out_dir: str, stage: int, save_to: str, load_from: str, accum: int, accum_mode: str) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW, clip_grad_norm_
    from helios.schedule.ddp import DistributedDataParallel
    from helios.schedule.zero import ZeroAdamW, memory_report

    dist.init_process_group(backend=os.environ.get("TEST_ZERO_BACKEND", "shm"))
    r, n = dist.get_rank(), dist.get_world_size()
    # No linear biases: see tests/test_ddp.py (a bias whose gradient is exactly zero turns float
    # noise into lr-sized AdamW updates).
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=3, n_head=2, n_embd=32, bias=False)
    model = DistributedDataParallel(GPT(cfg, seed=7 if r == 0 else 99), bucket_cap_mb=BUCKET_MB)
    gpt = model.module
    decay = [p for p in gpt.parameters() if p.ndim >= 2]
    other = [p for p in gpt.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    if stage:
        opt = ZeroAdamW(model, groups, stage=stage, lr=3e-3)
        mem_init = memory_report(opt)
    else:
        opt = AdamW(groups, lr=3e-3)
    first = 0
    if load_from:
        sd = _assemble(load_from, opt.shard_ranges())
        opt.load_shard_state(sd)
        first = sd["step"]
        assert opt.step_count == first
    per_rank = GLOBAL_BATCH // n
    micro = per_rank // accum
    losses, norms = [], []
    for step in range(first, STEPS):
        x, y = _batches(step, cfg.vocab_size)
        x, y = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
        total = 0.0
        for m in range(accum):
            # "no_sync": reduce once, after the last micro-batch; "sync": reduce after every one
            # (stages 2-3 then add each reduced shard to the last).
            local = accum_mode == "no_sync" and m < accum - 1
            with model.no_sync() if local else contextlib.nullcontext():
                _, loss = model(hl.tensor(x[m * micro:(m + 1) * micro], dtype=hl.int64),
                                hl.tensor(y[m * micro:(m + 1) * micro], dtype=hl.int64))
                loss = loss * (1.0 / accum)
                loss.backward()
            total += loss.item()
        norm = opt.clip_grad_norm_(CLIP) if stage else clip_grad_norm_(gpt.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        avg = np.array([total], np.float64)
        dist.all_reduce(avg, op="avg")
        losses.append(float(avg[0]))
        norms.append(float(norm.item()))
        if save_to and step + 1 == SAVE_AT:
            sd = opt.state_dict()
            np.savez(os.path.join(save_to, f"shard-{r}.npz"), **{k: v["data"] for k, v in sd["tensors"].items()})
            ranges = {k: (v["shape"], v["start"], v["stop"]) for k, v in sd["tensors"].items()}
            with open(os.path.join(save_to, f"ranges-{r}.json"), "w") as f:
                json.dump({"step": sd["step"], "param_groups": sd["param_groups"], "ranges": ranges}, f)
    params = opt.full_parameters() if stage else {name: p.numpy() for name, p in gpt.named_parameters()}
    res = {"losses": losses, "norms": norms}
    if stage:
        res["memory_init"] = mem_init
        res["memory"] = memory_report(opt)
        res["segments"] = sum(len(g.segs) for g in opt.groups)
        res["q"] = opt._q
        res["stats"] = opt.stats
        launched = [e for e in model.bucket_log if e.what == "launched"]
        res["launched_before_backward_end"] = sum(e.backward_nodes_done < e.backward_nodes_total for e in launched)
    with open(os.path.join(out_dir, f"result-r{r}.json"), "w") as f:
        json.dump(res, f)
    if r == 0:
        np.savez(os.path.join(out_dir, "params.npz"), **params)
    dist.destroy_process_group()


def _run(out, world: int, stage: int, save_to: str = "", load_from: str = "", accum: int = 1,
         accum_mode: str = "no_sync", backend: str = "shm") -> dict:
    """Launch ``world`` ranks of this file's training into ``out``; their :func:`_results`."""
    os.makedirs(out, exist_ok=True)
    if save_to:
        os.makedirs(save_to, exist_ok=True)
    check_ok(run_ranks([__file__, str(out), str(stage), save_to, load_from, str(accum), accum_mode], world,
                       timeout=240, env={"TEST_ZERO_BACKEND": backend}))
    if save_to:  # one index of every rank's ranges, as a checkpoint's metadata would hold
        meta = {"world_size": world, "ranges": {}}
        for r in range(world):
            with open(os.path.join(save_to, f"ranges-{r}.json")) as f:
                m = json.load(f)
            meta["ranges"][str(r)] = m["ranges"]
            meta["step"], meta["param_groups"] = m["step"], m["param_groups"]
        with open(os.path.join(save_to, "shards.json"), "w") as f:
            json.dump(meta, f)
    return _results(out, world)


def _results(out, world: int) -> dict:
    """Rank 0's losses and norms, every rank's report (``ranks``) and the final ``params``."""
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"result-r{r}.json")) as f:
            ranks.append(json.load(f))
    res = dict(ranks[0])
    res["ranks"] = ranks
    res["params"] = dict(np.load(os.path.join(out, "params.npz")))
    return res


def _same(ref: dict, got: dict, first: int = 0, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(got["losses"], ref["losses"][first:], rtol=rtol)
    np.testing.assert_allclose(got["norms"], ref["norms"][first:], rtol=rtol)
    for k in ref["params"]:
        np.testing.assert_allclose(got["params"][k], ref["params"][k], rtol=rtol, atol=atol, err_msg=k)


def _class_size(n: int, align: int = 256) -> int:
    """The weights pool's size class of an n-byte allocation (as helios/native/memory.cpp rounds):
    quarter steps between powers of two, 256-byte aligned (small models stay below the dedicated size)."""
    if n <= align:
        return align
    lg = (n - 1).bit_length() - 1
    step = max(1 << (lg - 2 if lg >= 2 else 0), align)
    return (n + step - 1) // step * step


def _check_bytes(res: dict, world: int, stage: int, no_sync: bool = False) -> None:
    for rank_res in res["ranks"]:
        for when in ("memory_init", "memory"):
            m = rank_res[when]
            psi, padded, held = m["numel"], m["padded_numel"], m["held"]
            # Padding: under N chunks of the alignment quantum per segment.
            assert psi <= padded < psi + rank_res["segments"] * world * rank_res["q"]
            assert padded % world == 0
            expect = {"params": 4 * psi // world if stage == 3 else 4 * psi,
                      "grads": 4 * psi if stage == 1 else 4 * psi // world,
                      "moments": 8 * psi // world}
            for cat, formula in expect.items():
                h = held[cat]
                assert h["formula"] == formula, (cat, h)
                # Bytes asked of the pool are the formula at the padded size, exactly ...
                assert h["requested"] == h["formula_padded"], (cat, h)
                assert sum(h["buffers"]) == h["requested"]
                # ... and the pool holds them in its size classes: what the allocator's rounding says.
                assert h["pool"] == sum(_class_size(b) for b in h["buffers"]), (cat, h)
                assert formula <= h["pool"] <= 1.25 * formula + 256 * len(h["buffers"]) + 4 * (padded - psi) * 2
            # The weights pool holds these buffers and nothing else: no full-size gradient buffer hides there.
            assert m["weights_pool_in_use"] == held["total"]["pool"]
        staging, gathered = m["transient"]["grad_staging"], m["transient"]["gathered_params"]
        assert staging["now"] == 0 and gathered["now"] == 0  # nothing transient outlives the step
        if stage >= 2 and not no_sync:  # (inside no_sync() the staging buffers hold the local sums)
            # Staging buffers come and go with the buckets: the full gradient never exists at once.
            assert 0 < staging["peak"] < 4 * psi * 0.6, staging
        if stage == 3:
            largest = m["largest_unit_bytes"]
            assert 0 < gathered["peak"] <= 3 * _class_size(largest), (gathered, largest)
            assert gathered["peak"] < 4 * psi


@pytest.fixture(scope="module")
def reference(shared_dir):
    """Plain DDP and AdamW on 1, 2 and 4 ranks."""
    def make(out):
        for world in (1, 2, 4):
            _run(out / f"n{world}", world, 0)

    out = shared_dir("zero-reference", make)
    return {world: _results(out / f"n{world}", world) for world in (1, 2, 4)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_on_1_2_4_ranks_matches_one_rank(tmp_path, reference, stage):
    assert min(reference[1]["norms"]) > CLIP  # clipping is active on every step
    for world in (1, 2, 4) if stage == 3 else (2, 4):  # one rank: once, with the stage that changes most
        res = _run(tmp_path / f"n{world}", world, stage)
        # One rank on the whole batch: the same to float tolerance.  The absolute tolerance is
        # plain DDP's own: its N ranks differ from one rank by up to ~4e-6 in a few elements
        # (another summation order of the batch, which AdamW normalises into the update).
        _same(reference[1], res)
        # Plain DDP on as many ranks (the same summation order): ZeRO changes nothing but the
        # order of the norm's sum.
        _same(reference[world], res, rtol=1e-6, atol=1e-7)
        for rank_res in res["ranks"]:  # every rank clipped by the same global norm
            np.testing.assert_allclose(rank_res["norms"], res["norms"], rtol=1e-6)
        _check_bytes(res, world, stage)
        st = res["stats"]
        if stage >= 2:  # every segment reduce-scattered each step, the first while backward still runs
            assert st["reduce_scatters"] == res["segments"] * STEPS, st
            assert res["launched_before_backward_end"] > 0
        if stage == 3:  # each unit gathered for its forward and its backward, the next one ahead of use
            assert st["gathers"] >= 2 * 5 * STEPS and st["prefetches"] >= 4 * STEPS, st
            assert st["on_demand_gathers"] == STEPS  # the tied output embedding, read outside its unit


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_over_tcp_matches_plain_ddp(tmp_path, reference, stage):
    # The ring algorithms of tcp, not shm's direct path: the reduce-scatters and the all-gathers
    # (whose input is a view of their output) give what plain DDP gives on as many ranks.
    _same(reference[2], _run(tmp_path, 2, stage, backend="tcp"), rtol=1e-6, atol=1e-7)


def test_sharded_state_saved_at_2_ranks_zero2_loads_at_4_ranks_zero3_and_1_rank_zero1(tmp_path, reference):
    saved = str(tmp_path / "ckpt")
    first = _run(tmp_path / "save", 2, 2, save_to=saved)
    _same(reference[2], first, rtol=1e-6, atol=1e-7)
    for world, stage in ((4, 3), (1, 1)):
        res = _run(tmp_path / f"load-{world}-{stage}", world, stage, load_from=saved)
        _same(reference[1], res, first=SAVE_AT)


def test_gradient_accumulation_with_and_without_no_sync(tmp_path):
    ref = _run(tmp_path / "ref", 2, 0, accum=2)
    for stage, mode in ((2, "no_sync"), (3, "sync"), (2, "sync")):
        res = _run(tmp_path / f"z{stage}-{mode}", 2, stage, accum=2, accum_mode=mode)
        # Reducing each micro-batch's gradients and adding them rounds differently from adding
        # first (the reference reduces once): one rank's tolerance (see the test above).
        _same(ref, res, rtol=1e-6 if mode == "no_sync" else 1e-5, atol=1e-7 if mode == "no_sync" else 1e-5)
        _check_bytes(res, 2, stage, no_sync=mode == "no_sync")


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
