"""Ring attention (helios.schedule.ring_attention) on 2 and 4 real ranks against one device.

Every rank builds the same whole q, k, v and upstream gradient from one seed, runs the ring
on its shard and writes its O, log-sum-exp, dQ, dK, dV shards; the test process puts the
shards back together (ring_unshard) and compares them with the flash kernel on the whole
sequence (relative 1e-5), and, for the small cases, with float64 numpy.  One launch per
world size runs every layout, causal and not, at T = 248 (chunks of 31 for zigzag on 4
ranks) and one long case at T = 3824 = 16 * 239.  The ranks also report the bytes the
forward keeps for the backward (against the single device's) and the query-key pairs each
rank computed (equal on every rank under zigzag, not under contiguous).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

B, H, D = 1, 2, 32
SMALL_T = 248
LONG_T = 3824
LAYOUTS = ("contiguous", "zigzag", "stripe")
# The long case of each world size: the layouts whose causal masks are not the kernel's own.
LONG = {2: ("stripe", True), 4: ("zigzag", True)}
# The case whose q, k, v are strided views of one packed tensor, as the GPT's attention makes them.
VIEWS = ("stripe", True, SMALL_T)


def _cases(world: int) -> list[tuple[str, bool, int]]:
    small = [(layout, causal, SMALL_T) for layout in LAYOUTS for causal in (False, True)]
    return small + [(*LONG[world], LONG_T)]


def _case_name(layout: str, causal: bool, T: int) -> str:
    return f"{layout}-{'causal' if causal else 'full'}-{T}"


def _inputs(T: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + T)
    return [rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4)]  # q, k, v, upstream


# -- the ranks -------------------------------------------------------------------------------------
def _rank_main(out_dir: str) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.runtime import get_runtime
    from helios.schedule.ring_attention import ring_attention, ring_attention_stats, ring_shard

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    pool = get_runtime().dev
    report = {}
    for layout, causal, T in _cases(world):
        q, k, v, g = (hl.tensor(ring_shard(a, layout, rank, world), requires_grad=i < 3)
                      for i, a in enumerate(_inputs(T)))
        if (layout, causal, T) == VIEWS:
            # As the GPT hands them over: [B, H, T/W, D] views of one [B, T/W, 3 * H * D] tensor.
            packed = hl.tensor(np.concatenate([a.transpose(0, 2, 1, 3).reshape(B, -1, H * D)
                                               for a in (q.numpy(), k.numpy(), v.numpy())], -1), requires_grad=True)
            q, k, v = (packed[:, :, i * H * D:(i + 1) * H * D].reshape(B, -1, H, D).transpose(1, 2) for i in range(3))
            assert not q.is_contiguous()
        if T == LONG_T:
            # The communicator's thread keeps its last operation (a K/V block) until its next
            # one: after a first call, each call frees the previous call's block and keeps its
            # own, so the in-use growth over a call is what the forward keeps for backward.
            with hl.no_grad():
                ring_attention(q, k, v, layout=layout, is_causal=causal)
        hl.synchronize()
        before = pool.pool_stats()["activations"]["in_use_bytes"]
        o, lse = ring_attention(q, k, v, layout=layout, is_causal=causal, return_lse=True)
        hl.synchronize()
        kept = pool.pool_stats()["activations"]["in_use_bytes"] - before  # what the forward holds for backward
        o.backward(g)
        name = _case_name(layout, causal, T)
        if (layout, causal, T) == VIEWS:
            grads = packed.grad.numpy().reshape(B, -1, 3, H, D).transpose(2, 0, 3, 1, 4)  # [3, B, H, T/W, D]
        else:
            grads = [q.grad.numpy(), k.grad.numpy(), v.grad.numpy()]
        np.savez(os.path.join(out_dir, f"{name}-rank{rank}.npz"), o=o.numpy(), lse=lse.numpy(), dq=grads[0],
                 dk=grads[1], dv=grads[2])
        report[name] = {"kept_bytes": kept, **ring_attention_stats()}
        del o, lse  # freed now, not inside the next case's measurement
    if world == 4:
        # Two rings of 2 in one job, over groups: the ring's neighbours are global ranks.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group = pairs[rank // 2]
        sub = dist.get_rank(group)
        q, k, v, g = (hl.tensor(ring_shard(a, "zigzag", sub, 2), requires_grad=i < 3)
                      for i, a in enumerate(_inputs(SMALL_T)))
        o, lse = ring_attention(q, k, v, group=group, layout="zigzag", is_causal=True, return_lse=True)
        o.backward(g)
        np.savez(os.path.join(out_dir, f"pairs-rank{rank}.npz"), o=o.numpy(), lse=lse.numpy(), dq=q.grad.numpy(),
                 dk=k.grad.numpy(), dv=v.grad.numpy())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


# -- the test process ------------------------------------------------------------------------------
def _run(world: int, shared_dir) -> str:
    """One launch of ``world`` ranks running every case (shared by the tests of that size, on
    every worker)."""
    return str(shared_dir(f"ring_attention-{world}",
                          lambda out: check_ok(run_ranks([__file__, str(out)], world, timeout=300))))


def _single_device(T: int, causal: bool) -> dict:
    """The flash kernel on the whole sequence: O, L, dQ, dK, dV, and the bytes its forward keeps."""
    import helios as hl
    import helios.nn.functional as NF
    from helios import _kernels as K
    from helios.runtime import get_runtime

    qa, ka, va, ga = _inputs(T)
    q, k, v = (hl.tensor(a, requires_grad=True) for a in (qa, ka, va))
    g = hl.tensor(ga)
    pool = get_runtime().dev
    hl.synchronize()
    before = pool.pool_stats()["activations"]["in_use_bytes"]
    o = NF.scaled_dot_product_attention(q, k, v, is_causal=causal)
    hl.synchronize()
    kept = pool.pool_stats()["activations"]["in_use_bytes"] - before
    o.backward(g)
    _, lse = K.flash_attn_fwd(q.detach(), k.detach(), v.detach(), 1.0 / np.sqrt(D), causal)
    return {"o": o.numpy(), "lse": lse.numpy(), "dq": q.grad.numpy(), "dk": k.grad.numpy(), "dv": v.grad.numpy(),
            "kept_bytes": kept}


def _float64(T: int, causal: bool) -> dict:
    """Attention and its gradients in float64 numpy."""
    q, k, v, g = (a.astype(np.float64) for a in _inputs(T))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    top = s.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(s - top).sum(-1))
    p = np.exp(s - lse[..., None])
    o = p @ v
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (g * o).sum(-1, keepdims=True))
    return {"o": o, "lse": lse, "dq": ds @ k / np.sqrt(D), "dk": np.swapaxes(ds, -1, -2) @ q / np.sqrt(D),
            "dv": np.swapaxes(p, -1, -2) @ g}


def _gathered(out_dir: str, world: int, layout: str, causal: bool, T: int) -> dict:
    from helios.schedule.ring_attention import ring_unshard

    name = _case_name(layout, causal, T)
    shards = [np.load(os.path.join(out_dir, f"{name}-rank{r}.npz")) for r in range(world)]
    return {key: ring_unshard([s[key] for s in shards], layout, dim=2) for key in ("o", "lse", "dq", "dk", "dv")}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(float(np.abs(b).max()), 1e-12))


def _reports(out_dir: str, world: int) -> list[dict]:
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_equals_one_device(layout, causal, world, shared_dir):
    out = _run(world, shared_dir)
    got = _gathered(out, world, layout, causal, SMALL_T)
    want, exact = _single_device(SMALL_T, causal), _float64(SMALL_T, causal)
    worst = {key: _rel(got[key], want[key]) for key in ("o", "lse", "dq", "dk", "dv")}
    assert max(worst.values()) < 1e-5, worst
    # The single device itself is float32: both within float32 rounding of float64.
    worst64 = {key: _rel(got[key], exact[key]) for key in ("o", "lse", "dq", "dk", "dv")}
    assert max(worst64.values()) < 1e-5, worst64


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_long_sequence_equals_one_device_and_splits_the_memory(world, shared_dir):
    layout, causal = LONG[world]
    out = _run(world, shared_dir)
    got = _gathered(out, world, layout, causal, LONG_T)
    want = _single_device(LONG_T, causal)
    worst = {key: _rel(got[key], want[key]) for key in ("o", "lse", "dq", "dk", "dv")}
    assert max(worst.values()) < 1e-5, worst
    # The forward keeps O and L of T/W tokens: 1/W of the single device's bytes.
    name = _case_name(layout, causal, LONG_T)
    for r, rep in enumerate(_reports(out, world)):
        share = rep[name]["kept_bytes"] / want["kept_bytes"]
        assert abs(share * world - 1) < 0.05, (r, share)


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world, shared_dir):
    reps = _reports(_run(world, shared_dir), world)
    zig = [rep[_case_name("zigzag", True, SMALL_T)] for rep in reps]
    con = [rep[_case_name("contiguous", True, SMALL_T)] for rep in reps]
    n = SMALL_T // world
    # zigzag: one diagonal block and W - 1 half blocks on every rank.
    assert [z["pairs"] for z in zig] == [zig[0]["pairs"]] * world
    assert zig[0]["pairs"] == B * H * (n * (n + 1) // 2 + (world - 1) * n * n // 2)
    assert [z["blocks"] for z in zig] == [world] * world
    # contiguous: rank r computes r full blocks and the diagonal one.
    assert [c["pairs"] for c in con] == [B * H * (r * n * n + n * (n + 1) // 2) for r in range(world)]
    if LONG[world][0] == "zigzag":
        big = [rep[_case_name("zigzag", True, LONG_T)]["pairs"] for rep in reps]
        assert big == [big[0]] * world


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_two_rings_over_groups_in_one_job(shared_dir):
    from helios.schedule.ring_attention import ring_unshard

    out = _run(4, shared_dir)
    want = _single_device(SMALL_T, True)
    for ranks in ([0, 1], [2, 3]):
        shards = [np.load(os.path.join(out, f"pairs-rank{r}.npz")) for r in ranks]
        for key in ("o", "lse", "dq", "dk", "dv"):
            got = ring_unshard([s[key] for s in shards], "zigzag", dim=2)
            assert _rel(got, want[key]) < 1e-5, (ranks, key)


def test_shard_and_unshard_are_inverse_and_place_tokens_as_documented():
    from helios.schedule.ring_attention import ring_positions, ring_shard, ring_unshard

    T, W = 16, 4
    x = np.arange(T)[None, :]
    assert ring_shard(x, "contiguous", 1, W, dim=1).tolist() == [[4, 5, 6, 7]]
    assert ring_shard(x, "zigzag", 1, W, dim=1).tolist() == [[2, 3, 12, 13]]
    assert ring_shard(x, "stripe", 1, W, dim=1).tolist() == [[1, 5, 9, 13]]
    for layout in LAYOUTS:
        shards = [ring_shard(x, layout, r, W, dim=1) for r in range(W)]
        assert ring_unshard(shards, layout, dim=1).tolist() == x.tolist()
        every = np.concatenate([ring_positions(T, layout, r, W) for r in range(W)])
        assert sorted(every.tolist()) == list(range(T))


@pytest.mark.vulkan
def test_shard_and_unshard_of_helios_tensors_carry_gradients():
    import helios as hl
    from helios.schedule.ring_attention import ring_shard, ring_unshard

    a = np.random.default_rng(0).standard_normal((1, 2, 24, 4)).astype(np.float32)
    for layout in LAYOUTS:
        x = hl.tensor(a, requires_grad=True)
        shards = [ring_shard(x, layout, r, 3) for r in range(3)]
        assert np.array_equal(shards[1].numpy(), ring_shard(a, layout, 1, 3))
        back = ring_unshard(shards, layout)
        (back * hl.tensor(a)).sum().backward()
        assert np.array_equal(back.numpy(), a) and np.array_equal(x.grad.numpy(), a)


def test_lengths_that_do_not_split_are_refused_by_name():
    from helios.schedule.ring_attention import ring_shard

    x = np.zeros((1, 1, 3824, 32), np.float32)
    with pytest.raises(ValueError, match=r"T = 3824 does not split into 6 equal chunks"):
        ring_shard(x, "zigzag", 0, 3)
    with pytest.raises(ValueError, match=r"T = 3824 does not split into 3 equal chunks"):
        ring_shard(x, "stripe", 0, 3)
    with pytest.raises(ValueError, match=r"layout 'ring' is not one of"):
        ring_shard(x, "ring", 0, 2)
    with pytest.raises(ValueError, match=r"rank 2 is not in 0..1"):
        ring_shard(x, "contiguous", 2, 2)


@pytest.mark.vulkan
def test_bad_shards_are_refused_by_name():
    import helios as hl
    from helios.schedule.ring_attention import ring_attention

    q = hl.tensor(np.zeros((1, 2, 7, 32), np.float32))
    with pytest.raises(ValueError, match="odd 7 tokens"):
        ring_attention(q, q, q, layout="zigzag")
    with pytest.raises(ValueError, match="one shape"):
        ring_attention(q, q, hl.tensor(np.zeros((1, 2, 8, 32), np.float32)))
    with pytest.raises(ValueError, match="head dim"):
        ring_attention(*(hl.tensor(np.zeros((1, 2, 8, 24), np.float32)),) * 3)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
