"""Gradient compression hooks (helios.schedule.compression) on real ranks and Helios tensors.

The ranks are this file run as a script.  Each wraps a small module in
DistributedDataParallel with a hook; the module's loss is sum(W * C_r) over its
parameters, so rank r's gradient is exactly the constant C_r the test chose, and the
hook's result can be compared with the true average of the ranks' C_r:

* exactly compressible gradients (rank-2 matrices for PowerSGD, K-sparse for top-K,
  equal magnitudes with one sign pattern for 1-bit, 16-bit-representable for fp16/bf16)
  must give the uncompressed average;
* over 50 steps of random gradients, error feedback keeps the running sum of the applied
  updates close to the running sum of the true averages (the gap is the residual, which
  stays bounded while the sums grow);
* the hook's state saved through DDP's state dict and loaded into a fresh hook continues
  bit-exactly.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

SHAPES = {"w1": (48, 40), "w2": (24, 64), "bias": (40,)}
HOOKS = ("none", "bf16", "fp16", "onebit:warmup=0,block=256", "topk:0.05", "powersgd:rank=4,start=0")


def _build(spec: str, seed: int = 0):
    """A DDP-wrapped module whose loss is sum over parameters of (param * constant)."""
    import helios as hl
    from helios.nn import Module, Parameter
    from helios.schedule import DistributedDataParallel, compression

    class Probe(Module):
        def __init__(self):
            super().__init__()
            for name, shape in SHAPES.items():
                setattr(self, name, Parameter(hl.tensor(np.zeros(shape, np.float32))))

        def forward(self, consts: dict):
            total = None
            for name in SHAPES:
                term = (getattr(self, name) * consts[name]).sum()
                total = term if total is None else total + term
            return total

    return DistributedDataParallel(Probe(), comm_hook=compression.parse_spec(spec), bucket_cap_mb=25.0)


def _layout(model) -> dict:
    """name -> (offset in the single bucket, numel) of every parameter."""
    (bucket,) = model.buckets
    names = {id(p): n for n, p in model.module.named_parameters()}
    return {names[id(p)]: (p._grad_slot._off - bucket.lo, p.numel()) for p in bucket.params}


def _step(model, flat: np.ndarray, layout: dict) -> np.ndarray:
    """One backward whose gradient, as the bucket's flat vector, is ``flat``; returns the reduced one."""
    import helios as hl

    consts = {n: hl.tensor(flat[o:o + k].reshape(SHAPES[n])) for n, (o, k) in layout.items()}
    for p in model.module.parameters():
        p.grad = None
    model(consts).backward()
    out = np.empty_like(flat)
    for n, (o, k) in layout.items():
        out[o:o + k] = getattr(model.module, n).grad.numpy().reshape(-1)
    return out


def _ready(spec: str):
    """A wrapped probe whose buckets exist (one forward under no_sync, zero gradients)."""
    import helios as hl

    model = _build(spec)
    with model.no_sync():
        model({n: hl.tensor(np.zeros(s, np.float32)) for n, s in SHAPES.items()}).backward()
    return model, _layout(model)


def _exact_input(spec: str, rank: int, world: int, layout: dict, size: int) -> np.ndarray:
    """Rank ``rank``'s gradient that ``spec`` compresses without loss (same on every call)."""
    rng = np.random.default_rng(1000 + rank)
    shared = np.random.default_rng(7)
    if spec in ("bf16", "fp16"):
        return rng.integers(-64, 64, size).astype(np.float32) / 8  # few mantissa bits: exact in 16 bits
    if spec.startswith("topk"):
        k = int(np.ceil(0.05 * size))
        v = np.zeros(size, np.float32)
        v[rng.choice(size, k, replace=False)] = rng.integers(-50, 50, k).astype(np.float32)
        return v
    if spec.startswith("onebit"):  # one magnitude per 256-value block (the hook's scale), per rank
        signs = np.where(shared.random(size) < 0.5, -1.0, 1.0).astype(np.float32)
        mags = rng.uniform(0.5, 2.0, -(-size // 256)).astype(np.float32)
        return signs * np.repeat(mags, 256)[:size]
    # PowerSGD: every matrix is A @ B_r^T with A shared (rank 2 < 4), so the average has rank 2.
    v = rng.standard_normal(size).astype(np.float32)  # 1-D tensors: anything (not compressed)
    for name, (o, k) in layout.items():
        if len(SHAPES[name]) == 2:
            rows, cols = SHAPES[name]
            a = np.random.default_rng(sorted(SHAPES).index(name)).standard_normal((rows, 2)).astype(np.float32)
            v[o:o + k] = (a @ rng.standard_normal((cols, 2)).astype(np.float32).T).reshape(-1)
    return v


def _rank_main(out_dir: str, backend: str, what: str) -> None:
    import helios.comm as dist

    dist.init_process_group(backend=backend)
    r, n = dist.get_rank(), dist.get_world_size()
    result = {}
    for spec in HOOKS:
        model, layout = _ready(spec)
        size = sum(k for _, k in layout.values())
        sent0 = dist.comm_counters()["bytes_sent"]
        if what == "exact":
            got = [_step(model, _exact_input(spec, r, n, layout, size), layout)]
            import helios as hl

            with hl.profile.profile(device_timestamps=False) as prof:  # the second step, profiled
                got.append(_step(model, _exact_input(spec, r, n, layout, size), layout))
            col = prof.collector
            result.setdefault("_trace", {})[spec] = {
                "ops": sorted({o.name for o in col.ops if o.name.startswith("comm_hook.")}),
                "comm": sorted({c.name for c in col.comm_events()})}
            want = np.mean([_exact_input(spec, q, n, layout, size) for q in range(n)], axis=0)
            result[spec] = [float(np.max(np.abs(g - want)) / np.max(np.abs(want))) for g in got]
        elif what == "feedback":
            applied = np.zeros(size, np.float64)
            true = np.zeros(size, np.float64)
            gaps = []
            for t in range(50):
                grads = [np.random.default_rng([t, q]).standard_normal(size).astype(np.float32) + 0.5 for q in range(n)]
                applied += _step(model, grads[r], layout)
                true += np.mean(grads, axis=0)
                gaps.append(float(np.linalg.norm(applied - true) / np.linalg.norm(true)))
            result[spec] = gaps
        else:  # "resume": 3 steps, state dict, a fresh hook, 3 more == 6 steps in one go
            grads = [np.random.default_rng([t, r]).standard_normal(size).astype(np.float32) for t in range(6)]
            straight = [_step(model, g, layout) for g in grads]
            first, layout1 = _ready(spec)
            for g in grads[:3]:
                _step(first, g, layout1)
            saved = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in first.state_dict().items()
                     if k.startswith("comm_hook")}
            second, layout2 = _ready(spec)
            second.load_state_dict({**{k: v.detach() for k, v in second.state_dict().items()
                                       if not k.startswith("comm_hook")}, **saved})
            resumed = [_step(second, g, layout2) for g in grads[3:]]
            result[spec] = {"bit_exact": all(np.array_equal(a, b) for a, b in zip(straight[3:], resumed)),
                            "state_keys": sorted(k for k in saved if k != "comm_hook")}
        result.setdefault("_bytes", {})[spec] = dist.comm_counters()["bytes_sent"] - sent0
    if r == 0:
        with open(os.path.join(out_dir, f"{what}-{n}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _run(tmp_path, world: int, what: str, backend: str = "shm") -> dict:
    check_ok(run_ranks([__file__, str(tmp_path), backend, what], world, timeout=240))
    with open(tmp_path / f"{what}-{world}.json") as f:
        return json.load(f)


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("world,backend", [(2, "tcp"), (4, "shm")])
def test_exactly_compressible_gradients_give_the_uncompressed_average(tmp_path, world, backend):
    res = _run(tmp_path, world, "exact", backend)
    for spec in HOOKS:
        tol = 2e-5 if spec.startswith("powersgd") else 1e-6
        assert max(res[spec]) <= tol, (spec, res[spec])
    # A profile shows the compression (host ops) apart from the collectives it runs.
    assert res["_trace"]["powersgd:rank=4,start=0"] == {
        "ops": ["comm_hook.powersgd.compress", "comm_hook.powersgd.decompress"], "comm": ["all_reduce"]}
    assert res["_trace"]["onebit:warmup=0,block=256"]["comm"] == ["all_gather", "all_to_all"]
    assert res["_trace"]["topk:0.05"]["comm"] == ["all_gather"]
    assert res["_trace"]["none"] == {"ops": [], "comm": ["all_reduce"]}
    # Bytes this rank sent, as the comm layer counted them, against the plain all-reduce's.
    share = {spec: res["_bytes"][spec] / res["_bytes"]["none"] for spec in HOOKS}
    assert 0.45 < share["bf16"] < 0.55 and 0.45 < share["fp16"] < 0.55, share
    assert share["onebit:warmup=0,block=256"] < 0.06, share  # 1 bit of 32, plus a scale per 256 values
    assert share["topk:0.05"] < 0.25, share
    assert share["powersgd:rank=4,start=0"] < 0.4, share


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_keeps_the_running_sum_of_updates_on_the_true_one(tmp_path, world):
    res = _run(tmp_path, world, "feedback")
    for spec in HOOKS:
        gaps = res[spec]
        if spec in ("none", "bf16", "fp16"):  # no error feedback: only rounding, which averages out
            assert gaps[-1] < 0.01, (spec, gaps[-1])
            continue
        # The gap is the residuals (bounded) over a sum that grows with the steps: it falls as
        # about 1/t.  Without error feedback it would stay where one step's loss puts it.
        assert gaps[-1] < 0.25 and gaps[-1] < gaps[4] / 2.5, (spec, gaps[4], gaps[-1])


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_hook_state_round_trips_through_the_state_dict_bit_exactly(tmp_path):
    res = _run(tmp_path, 2, "resume")
    for spec in HOOKS[1:]:
        assert res[spec]["bit_exact"], spec
    assert res["powersgd:rank=4,start=0"]["state_keys"] == ["comm_hook.b0.error", "comm_hook.b0.q"]
    assert res["onebit:warmup=0,block=256"]["state_keys"] == ["comm_hook.b0.server_error", "comm_hook.b0.worker_error"]


def test_invalid_specs_are_refused_by_name():
    from helios.schedule.compression import PowerSGD, TopK, parse_spec

    for spec, words in (("topk:2", "in (0, 1)"), ("powersgd:rank=0", "rank must be >= 1"), ("zip", "unknown method"),
                        ("powersgd:rank=x", "must be numbers"), ("onebit:warm=3", "no option 'warm'"),
                        ("topk", "fraction"), ("bf16:3", "no options")):
        with pytest.raises(ValueError, match="--grad-compression") as e:
            parse_spec(spec)
        assert spec in str(e.value) and words in str(e.value), str(e.value)
    assert parse_spec("none") is None
    assert isinstance(parse_spec("topk:0.01"), TopK)
    p = parse_spec("powersgd:rank=4,start=100")
    assert isinstance(p, PowerSGD) and (p.rank, p.start_iter) == (4, 100)
    assert parse_spec(p.spec).spec == p.spec


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2], sys.argv[3])
