"""The public operations the parallel schedules run on (helios.flat, helios.flash, Tensor's
storage methods, ParallelGrid's groups), and the rule that helios.schedule uses nothing else:
no launcher (helios._kernels); no Tensor internals is tests/test_architecture.py's rule."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402
from test_architecture import installed  # noqa: E402,F401  (the fixture: the package installed into a folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- schedule/ reaches for no internals -------------------------------------------------------------
def test_schedule_uses_no_launcher():
    """What pyproject.toml's import contract checks for imports, for a launcher reached another way
    (a Tensor's internals: tests/test_architecture.py, for every module outside the tensor core)."""
    bad = re.compile(r"helios\._kernels|import _kernels|\(Storage\)|\bK\.")
    found = []
    folder = os.path.join(ROOT, "schedule")
    for dirpath, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    for i, line in enumerate(f, 1):
                        if bad.search(line.split("#", 1)[0]):
                            found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_schedule_module_reaching_for_a_launcher_breaks_the_contract(installed, tmp_path):  # noqa: F811
    """pyproject.toml's "schedule uses no launcher" contract is not vacuous."""
    import shutil

    from test_architecture import _lint

    site = tmp_path / "site"
    shutil.copytree(installed, site)
    grid = site / "helios" / "schedule" / "grid.py"
    grid.write_text(grid.read_text() + "\n\ndef _launch():\n    from helios import _kernels\n    return _kernels\n")
    r = _lint(site, tmp_path)
    assert r.returncode != 0 and "schedule uses no launcher BROKEN" in r.stdout, r.stdout[-2000:]
    assert "helios.schedule.grid -> helios._kernels" in r.stdout, r.stdout[-2000:]


# ---- Tensor and Storage ------------------------------------------------------------------------------
def test_storage_views_offsets_and_identity():
    import helios as hl
    from helios.errors import ShapeError

    t = hl.tensor(np.arange(12, dtype=np.float32))
    st = t.untyped_storage()
    assert t.storage_offset() == 0 and st is t.untyped_storage() and st.nbytes == 48
    v = st.view(4, (2, 3), hl.float32)
    np.testing.assert_array_equal(v.numpy(), np.arange(4, 10, dtype=np.float32).reshape(2, 3))
    assert v.storage_offset() == 4 and v.untyped_storage() is st and v.stride() == (3, 1)
    col = st.view(1, (3,), hl.float32, strides=(4,))
    np.testing.assert_array_equal(col.numpy(), [1, 5, 9])
    assert t[3:].storage_offset() == 3 and t[3:].untyped_storage() is st
    assert not v.requires_grad and v.grad_fn is None
    with pytest.raises(ShapeError, match="outside the storage"):
        st.view(10, (3,), hl.float32)
    with pytest.raises(ShapeError, match="outside the storage"):
        st.view(-1, (2,), hl.float32)
    assert st.view(12, (0,), hl.float32).numel() == 0  # an empty view at the end is fine


def test_set_moves_a_parameter_into_a_flat_buffer_and_keeps_its_identity():
    import helios as hl
    from helios.nn import Parameter

    p = Parameter(hl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3)))
    buf = hl.zeros(10)
    hooks = []
    p.register_post_accumulate_grad_hook(hooks.append)
    import helios.flat as flat

    flat.copy_into(buf.untyped_storage().view(3, p.shape, p.dtype), p)
    q = p.set_(buf.untyped_storage(), 3)
    assert q is p and p.requires_grad and p.shape == (2, 3) and p.storage_offset() == 3
    assert p.untyped_storage() is buf.untyped_storage()
    np.testing.assert_array_equal(buf.numpy(), [0, 0, 0, 0, 1, 2, 3, 4, 5, 0])
    (p * 2.0).sum().backward()
    assert len(hooks) == 1 and hooks[0] is p
    np.testing.assert_array_equal(p.grad.numpy(), np.full((2, 3), 2, np.float32))
    other = hl.tensor(np.ones((2, 3), np.float32))
    p.set_(other)  # a tensor as the source: its storage, offset, shape and strides
    assert p.untyped_storage() is other.untyped_storage() and p.storage_offset() == 0


def test_data_reads_detached_and_assigning_it_swaps_the_view_dtype_too():
    """``t.data`` (PyTorch's): the values without history; ``t.data = new`` makes ``t`` the view
    ``new`` is, dtype included (what Module.to(dtype) does to a parameter), keeping its identity."""
    import helios as hl
    from helios.nn import Parameter

    p = Parameter(hl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3)))
    d = p.data
    assert d is not p and not d.requires_grad and d.grad_fn is None
    assert d.untyped_storage() is p.untyped_storage()
    new = hl.tensor(np.full((3, 2), 0.5, np.float32)).to(hl.bfloat16)
    p.data = new
    assert p.dtype is hl.bfloat16 and p.shape == (3, 2) and p.requires_grad
    assert p.untyped_storage() is new.untyped_storage()
    np.testing.assert_array_equal(p.float().numpy(), np.full((3, 2), 0.5, np.float32))
    with pytest.raises(TypeError, match="Tensor.data: the new data must be a helios Tensor, got ndarray"):
        p.data = np.zeros(3)


def test_grad_slot_takes_the_gradient_in_place():
    import helios as hl
    from helios.errors import ShapeError
    from helios.nn import Parameter

    p = Parameter(hl.tensor(np.ones(4, np.float32)))
    assert p.grad_slot is None
    buf = hl.zeros(8)
    p.grad_slot = buf.untyped_storage().view(4, (4,), hl.float32)
    (p * 3.0).sum().backward()
    assert p.grad.untyped_storage() is buf.untyped_storage() and p.grad.storage_offset() == 4
    np.testing.assert_array_equal(buf.numpy(), [0, 0, 0, 0, 3, 3, 3, 3])
    with pytest.raises(ShapeError):
        p.grad_slot = buf.untyped_storage().view(0, (3,), hl.float32)
    assert hl.ones(2).grad_slot is None  # a plain tensor has none


# ---- helios.flat ---------------------------------------------------------------------------------------
def test_raw_ops_on_ranges_record_no_autograd_and_count_no_write():
    import helios as hl
    import helios.flat as flat
    from helios.errors import ShapeError

    buf = flat.zeros((16,), hl.float32, pool="weights")
    st = buf.untyped_storage()
    v0 = st.version
    r = flat.elements(buf, 4, 8)
    assert r.storage_offset() == 4 and r.untyped_storage() is st
    x = hl.tensor(np.arange(8, dtype=np.float32), requires_grad=True)
    flat.copy_into(r, x)
    flat.add_(r, 1.0)
    flat.mul_(r, hl.tensor(np.float32(2.0)))
    flat.add_(flat.elements(buf, 0, 4), hl.tensor(np.ones(4, np.float32)))
    want = np.zeros(16, np.float32)
    want[:4] = 1
    want[4:12] = (np.arange(8) + 1) * 2
    np.testing.assert_array_equal(buf.numpy(), want)
    assert buf.grad_fn is None and not buf.requires_grad and r.grad_fn is None
    assert st.version == v0 + 4  # each write counted, as the launchers count them
    flat.mark_written(r)
    flat.mark_written(st)
    assert st.version == v0 + 6
    c = flat.copy(x)  # a copy of a tensor that requires grad: no node, memory of its own
    assert c.grad_fn is None and not c.requires_grad and c.untyped_storage() is not x.untyped_storage()
    h = flat.copy(x, hl.float16) if hl.float16 else None
    if h is not None:
        assert h.dtype is hl.float16
    assert flat.fill_(flat.elements(buf, 0, 4), 7).numpy().tolist() == [7, 7, 7, 7]
    with pytest.raises(ShapeError, match="outside"):
        flat.elements(buf, 10, 8)
    with pytest.raises(ShapeError, match="contiguous"):
        flat.elements(hl.ones(4, 4).t(), 0, 4)
    assert flat.empty((2, 3), hl.float32).shape == (2, 3)


def test_read_gives_stored_elements_of_a_range():
    import helios as hl
    import helios.flat as flat

    a = np.arange(20, dtype=np.float32).reshape(4, 5)
    t = hl.tensor(a)
    np.testing.assert_array_equal(flat.read(t, 3, 11), a.reshape(-1)[3:11])
    np.testing.assert_array_equal(flat.read(t.t(), 2, 6), a.T.reshape(-1)[2:6])  # non-contiguous: C order
    assert flat.read(t, 5, 5).size == 0
    up = flat.from_numpy(a, hl.float32)
    np.testing.assert_array_equal(up.numpy(), a)


def test_pool_accounting_alignment_and_flush():
    import helios as hl
    import helios.flat as flat

    dev = hl.ones(1).device
    before = flat.pool_in_use(dev, "weights")
    keep = flat.zeros((1 << 16,), hl.float32, dev, pool="weights")
    assert flat.pool_in_use(dev, "weights") >= before + (1 << 18)
    assert flat.alignment(dev) >= 4 and flat.alignment(dev) & (flat.alignment(dev) - 1) == 0
    flat.flush(dev)
    del keep


def test_adamw_on_views_equals_the_fused_optimizer():
    """ZeRO's update binds views of four buffers at their own offsets: the same numbers as AdamW."""
    import helios as hl
    import helios.flat as flat
    from helios.errors import ShapeError
    from helios.nn import Parameter
    from helios.optim import AdamW, adamw_constants

    rng = np.random.default_rng(0)
    n = 37
    w, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    p = Parameter(hl.tensor(w))
    opt = AdamW([p], lr=0.1, weight_decay=0.05)
    hyper = opt.param_groups[0]
    for _ in range(2):
        p.grad = hl.tensor(g)
        opt.step()
    q = max(1, flat.alignment() // 4)
    bufs = [flat.zeros((3 * q + n,), hl.float32) for _ in range(4)]
    offs = [q, 2 * q, 0, 3 * q]  # each in its own buffer at its own aligned offset
    views = [flat.elements(b, o, n) for b, o in zip(bufs, offs)]
    flat.copy_into(views[0], hl.tensor(w))
    flat.copy_into(views[1], hl.tensor(g))
    for step in (1, 2):
        flat.adamw_(*views, adamw_constants(hyper, step))
    np.testing.assert_array_equal(views[0].numpy(), p.numpy())
    np.testing.assert_array_equal(views[2].numpy(), opt.flat[0].moments[0].numpy())
    np.testing.assert_array_equal(views[3].numpy(), opt.flat[0].moments[1].numpy())
    if q > 1:
        with pytest.raises(ShapeError, match="modulo"):
            flat.adamw_(flat.elements(bufs[0], 1, 8), *(flat.elements(b, 0, 8) for b in bufs[1:]),
                        adamw_constants(hyper, 3))


def test_lazy_storage_comes_and_goes_under_its_views():
    import helios as hl
    import helios.flat as flat

    calls = []

    def on_demand(st):
        calls.append(st)
        st.materialize()

    dev = hl.ones(1).device
    st = flat.LazyStorage(dev, 64, "activations", on_demand, owner="me")
    assert not st.materialized and st.owner == "me"
    v = st.view(0, (16,), hl.float32)  # a view does not touch the memory
    assert not st.materialized and calls == []
    flat.fill_(v, 3)  # touching it materializes it on demand
    assert st.materialized and len(calls) == 1
    np.testing.assert_array_equal(v.numpy(), np.full(16, 3, np.float32))
    assert st.release() >= 0 and not st.materialized
    assert st.materialize() >= 64 and st.materialized
    flat.fill_(v, 1)
    np.testing.assert_array_equal(flat.elements(v, 4, 4).numpy(), np.ones(4, np.float32))
    st.version = 5
    st.filling = True
    st.version = 9  # a refill of the values it held does not count
    assert st.version == 5
    st.filling = False
    st.version = 6
    assert st.version == 6
    st.release()


# ---- helios.flash -------------------------------------------------------------------------------------
def test_flash_primitives_match_dense_attention():
    import helios as hl
    import helios.flash as flash

    rng = np.random.default_rng(1)
    B, H, T, D = 1, 2, 48, 32
    q, k, v, do = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4))
    tq, tk, tv, tdo = (hl.tensor(a) for a in (q, k, v, do))
    assert flash.supported(tq, tk, tv) and D in flash.HEAD_DIMS
    assert not flash.supported(tq, tk, hl.tensor(v[..., :16].copy()))
    scale = 1 / np.sqrt(D)
    o, lse = flash.forward(tq, tk, tv, scale, True)
    s = np.einsum("bhid,bhjd->bhij", q, k).astype(np.float64) * scale
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    l_ref = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    p = np.exp(s - l_ref[..., None])
    np.testing.assert_allclose(o.numpy(), p @ v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), l_ref, rtol=1e-5, atol=1e-5)
    dq, dk, dv = flash.backward(tq, tk, tv, o, lse, tdo, scale, True)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (do * (p @ v)).sum(-1, keepdims=True))
    np.testing.assert_allclose(dv.numpy(), np.swapaxes(p, -1, -2) @ do, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dq.numpy(), ds @ k * scale, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dk.numpy(), np.swapaxes(ds, -1, -2) @ q * scale, rtol=1e-4, atol=1e-4)
    assert flash.pairs(4, 4, True) == 10 and flash.pairs(4, 6, False) == 24 and flash.pairs(6, 4, True) == 18


# ---- ParallelGrid: every group in one place ----------------------------------------------------------
def test_rank_lists_partition_the_world_and_keep_the_old_layouts():
    from helios.schedule.grid import KINDS, rank_lists

    tp, cp, dp, pp, ep = 2, 2, 4, 2, 2
    world = tp * cp * dp * pp
    for kind in KINDS:
        lists = rank_lists(kind, tp=tp, dp=dp, pp=pp, cp=cp, ep=ep)
        every = sorted(r for ranks in lists for r in ranks)
        if kind == "embedding":  # the first and last stage of each pipeline
            assert every == sorted(r for r in range(world) if r // (tp * cp * dp) in (0, pp - 1)), kind
        else:
            assert every == list(range(world)), kind
    # TP innermost, then CP, DP, PP: rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    assert rank_lists("tp", tp=tp, dp=dp, pp=pp, cp=cp)[0] == [0, 1]
    assert rank_lists("cp", tp=tp, dp=dp, pp=pp, cp=cp)[0] == [0, 2]
    assert rank_lists("dp", tp=tp, dp=dp, pp=pp, cp=cp)[0] == [0, 4, 8, 12]
    assert rank_lists("pp", tp=tp, dp=dp, pp=pp, cp=cp)[0] == [0, 16]
    # without cp: the layouts the grid, expert_groups, expert_tp_group, context_parallel_group and
    # PipelineStage built before the grid owned them, group for group and in the same order
    tp, dp, pp, ep = 2, 4, 2, 2
    world, d = tp * dp * pp, tp * dp
    rank_of = lambda t, i, p: p * dp * tp + i * tp + t  # noqa: E731
    old = {
        "tp": [[rank_of(t, i, p) for t in range(tp)] for p in range(pp) for i in range(dp)],
        "dp": [[rank_of(t, i, p) for i in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank_of(t, i, p) for p in range(pp)] for i in range(dp) for t in range(tp)],
        "embedding": [[rank_of(t, i, 0), rank_of(t, i, pp - 1)] for i in range(dp) for t in range(tp)],
        "ep": [[base + (first + j) * tp + t for j in range(ep)]
               for base in range(0, world, d) for t in range(tp) for first in range(0, dp, ep)],
        "edp": [[base + i * tp + t for i in range(j, dp, ep)]
                for base in range(0, world, d) for t in range(tp) for j in range(ep)],
        "expert_tp": [[base + (first + j) * tp + t for j in range(ep) for t in range(tp)]
                      for base in range(0, world, d) for first in range(0, dp, ep)],
    }
    for kind, lists in old.items():
        assert rank_lists(kind, tp=tp, dp=dp, pp=pp, ep=ep) == lists, kind
    assert rank_lists("cp", dp=3, cp=2) == [[0, 1], [2, 3], [4, 5]]  # context_parallel_group(2) on 6 ranks
    with pytest.raises(ValueError, match="ep = 3 does not divide the 4 data-parallel ranks"):
        rank_lists("ep", dp=4, ep=3)


def _grid_main(out_dir: str) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.schedule.context_parallel import context_parallel_group
    from helios.schedule.grid import Coord, ParallelGrid, group_size
    from helios.schedule.moe import expert_groups, expert_tp_group

    dist.init_process_group(backend="shm")
    rank = dist.get_rank()
    out = {}

    def members(group):
        """The global ranks of ``group``, found by a collective over it (not read from the object)."""
        if group is not None and group_size(group) == 1:
            return [rank]
        n = dist.get_world_size(group)
        every = hl.zeros(n, dtype=hl.int32)
        dist.all_gather(every, hl.tensor([rank], dtype=hl.int32), group=group)
        return every.numpy().tolist()

    g = ParallelGrid(tp=2, pp=2)
    assert g.coord_of(rank) == Coord(rank % 2, 0, rank // 2) and g.rank_of(g.tp_rank, g.dp_rank, g.pp_rank) == rank
    out["tp_pp"] = {k: members(g.group(k)) for k in ("tp", "dp", "pp", "embedding")}
    out["tp_pp_peers"] = {k: g.peers(k) for k in ("tp", "dp", "pp", "embedding")}
    assert g.cp_group is None and g.ep_group is None and g.dp_cp_group is g.dp_group
    g = ParallelGrid(cp=2)
    out["cp"] = {k: members(g.group(k)) for k in ("cp", "dp", "dp_cp")}
    out["cp_old"] = members(context_parallel_group(2))
    out["cp_coord"] = [g.cp_rank, g.dp_rank]
    g = ParallelGrid(pp=2, cp=2)
    out["pp_cp"] = {k: members(g.group(k)) for k in ("cp", "pp", "embedding", "dp_cp")}
    g = ParallelGrid(tp=2, ep=2)
    out["tp_ep"] = {k: members(g.group(k)) for k in ("ep", "edp", "expert_tp")}
    out["tp_ep_peers"] = {k: g.peers(k) for k in ("ep", "edp", "expert_tp")}
    old_ep, old_edp = expert_groups(2, tp=2)
    out["tp_ep_old"] = {"ep": members(old_ep), "edp": members(old_edp), "expert_tp": members(expert_tp_group(2, 2))}
    g = ParallelGrid(ep=4)
    out["ep4"] = {k: members(g.group(k)) for k in ("ep", "edp", "expert_tp")}
    assert g.expert_tp_group is g.ep_group and g.ep_rank == rank
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_the_grid_builds_and_owns_every_group_on_four_ranks(tmp_path):
    check_ok(run_ranks([__file__, "grid", str(tmp_path)], 4, timeout=240))
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    for r, x in enumerate(res):
        t, p = r % 2, r // 2
        assert x["tp_pp"] == {"tp": [2 * p, 2 * p + 1], "dp": [r], "pp": [t, t + 2], "embedding": [t, t + 2]}
        assert x["tp_pp_peers"] == x["tp_pp"]
        # cp = 2 on 4 ranks: CP peers are neighbours (inside TP, outside DP); gradients average over all 4
        c, d = r % 2, r // 2
        assert x["cp"] == {"cp": [2 * d, 2 * d + 1], "dp": [c, c + 2], "dp_cp": [0, 1, 2, 3]}
        assert x["cp_old"] == x["cp"]["cp"] and x["cp_coord"] == [c, d]
        assert x["pp_cp"] == {"cp": [2 * d, 2 * d + 1], "pp": [c, c + 2], "embedding": [c, c + 2],
                              "dp_cp": [2 * d, 2 * d + 1]}
        # tp = 2, ep = 2 (dp = 2): the experts are split over the two data-parallel ranks of a TP place
        assert x["tp_ep"] == {"ep": [t, t + 2], "edp": [r], "expert_tp": [0, 1, 2, 3]}
        assert x["tp_ep_peers"] == x["tp_ep"] and x["tp_ep_old"] == x["tp_ep"]
        assert x["ep4"] == {"ep": [0, 1, 2, 3], "edp": [r], "expert_tp": [0, 1, 2, 3]}


def test_grid_refuses_sizes_that_do_not_fit_by_numbers():
    import helios.comm as dist
    from helios.comm.launcher import free_port
    from helios.schedule.grid import ParallelGrid

    dist.init_process_group(backend="tcp", rank=0, world_size=1, master_port=free_port())
    try:
        with pytest.raises(ValueError, match=r"tp x cp x pp = 1 x 2 x 1 = 2 does not divide the world size 1"):
            ParallelGrid(cp=2)
        with pytest.raises(ValueError, match="ep = 2 does not divide the 1 data-parallel ranks"):
            ParallelGrid(ep=2)
        with pytest.raises(ValueError, match="cp must be a positive integer"):
            ParallelGrid(cp=0)
        g = ParallelGrid()
        assert (g.cp, g.ep, g.cp_rank, g.ep_rank) == (1, 1, 0, 0) and g.peers("cp") == [0] and g.peers("ep") == []
        assert g.embedding_group is None and g.peers("embedding") == []
        with pytest.raises(ValueError, match="kind must be one of"):
            g.peers("xp")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "grid":
        _grid_main(sys.argv[2])
