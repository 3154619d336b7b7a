"""The CPU emulator of the generated PTX: every variant computes A @ B, and injected bugs are caught.

The bug tests edit the PTX text the way a generator bug would (a dropped wait, a
wrong parity, a missing barrier) and check that the emulator reports a hang, a
fault or a wrong product -- the failures a GPU would show only at run time.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import helios.cuda_ptx as cp
from helios.cuda_ptx import dtypes, ops
from helios.cuda_ptx.emu.state import EmulationError, GlobalMemory
from helios.cuda_ptx.emu.launch import emulate_gemm, emulate_kernel
from helios.cuda_ptx.ir import Builder
from helios.cuda_ptx.emu.ptx_parse import PtxParseError, parse
from helios.cuda_ptx.render import render

# Small problems that still run several k-tiles (so the rings wrap) for each rung.
SHAPES = {
    "simt": (64, 128, 48),
    "mma_sync": (128, 128, 160),
    "wgmma_tma": (64, 256, 192),
    "wgmma_pipe": (128, 128, 384),
    "wgmma_ws": (128, 256, 384),
    "wgmma_fp8": (128, 256, 640),
    "wgmma_persistent": (128, 512, 384),  # two tiles: one CTA walks both (sm_count=1)
    "wgmma_cluster": (256, 512, 384),  # two blocks of 2 x 1 tiles: one cluster of two CTAs walks both
}


def _ints(rng, shape, lo=-3, hi=4):
    return rng.integers(lo, hi, shape).astype(np.float32)


def _operands(variant, seed=0):
    m, n, k = SHAPES[variant]
    rng = np.random.default_rng(seed)
    return _ints(rng, (m, k)), _ints(rng, (k, n))


@pytest.mark.parametrize("variant", sorted(SHAPES))
def test_every_variant_computes_the_exact_product(variant):
    a, b = _operands(variant)
    c = emulate_gemm(a, b, variant)
    np.testing.assert_array_equal(c, a @ b)


@pytest.mark.parametrize("variant", ["simt", "mma_sync", "wgmma_tma"])
def test_grid_of_ctas_and_ragged_shapes(variant):
    """Several CTAs in both grid dimensions, and M/N/K off the tile multiples (padding)."""
    cfg = cp.variants()[variant]
    m, n, k = 2 * cfg.bm - 24, 2 * cfg.bn - 8, 3 * cfg.bk - 5
    rng = np.random.default_rng(1)
    a, b = _ints(rng, (m, k)), _ints(rng, (k, n))
    np.testing.assert_array_equal(emulate_gemm(a, b, variant), a @ b)


@pytest.mark.parametrize("variant", ["mma_sync", "wgmma_pipe"])
def test_grouped_tile_order_covers_every_tile_once(variant):
    """group_m=2 over 5 tile-rows: the last group is one row short; C starts NaN, so a hole shows."""
    cfg = cp.variants()[variant].with_(group_m=2)
    rng = np.random.default_rng(10)
    a, b = _ints(rng, (5 * cfg.bm - 3, 2 * cfg.bk)), _ints(rng, (2 * cfg.bk, 3 * cfg.bn - 5))
    np.testing.assert_array_equal(emulate_gemm(a, b, cfg), a @ b)
    # Without the clamp of the last group to the rows left, CTAs land on tiles past M.
    ptx = re.sub(r"min\.u32 (%r\d+), %r\d+, 2;", r"mov.u32 \1, 2;", cp.emit_gemm(cfg), count=1)
    with pytest.raises(EmulationError, match="illegal global address"):
        emulate_gemm(a, b, cfg, ptx=ptx)


@pytest.mark.parametrize("sm_count,group_m,b_major", [(1, 8, "k"), (3, 8, "n"), (3, 0, "k"), (4, 2, "k")])
def test_persistent_ctas_walk_every_tile_once(sm_count, group_m, b_major):
    """10 tiles (5 x 2, ragged M and N) over fewer CTAs than tiles, so CTAs take 2-4 tiles
    each with the ring running on across them; C starts NaN, so a skipped tile shows."""
    cfg = cp.variants()["wgmma_persistent"].with_(group_m=group_m, b_major=b_major)
    rng = np.random.default_rng(11)
    a, b = _ints(rng, (5 * cfg.bm - 3, 3 * cfg.bk)), _ints(rng, (3 * cfg.bk, 2 * cfg.bn - 5))
    np.testing.assert_array_equal(emulate_gemm(a, b, cfg, sm_count=sm_count), a @ b)


@pytest.mark.parametrize("persistent,sm_count,group_m,b_major", [
    (True, 2, 8, "k"), (True, 6, 8, "n"), (True, 4, 0, "k"), (False, 132, 2, "n"), (False, 132, 0, "k")])
def test_clusters_cover_every_tile_once(persistent, sm_count, group_m, b_major):
    """3 x 2 blocks of 2 x 1 tiles (ragged M and N), by one to three persistent clusters
    or one cluster per block; C starts NaN, so a tile no CTA of a cluster wrote shows."""
    cfg = cp.variants()["wgmma_cluster"].with_(persistent=persistent, group_m=group_m, b_major=b_major)
    rng = np.random.default_rng(13)
    a, b = _ints(rng, (6 * cfg.bm - 3, 2 * cfg.bk)), _ints(rng, (2 * cfg.bk, 2 * cfg.bn - 5))
    np.testing.assert_array_equal(emulate_gemm(a, b, cfg, sm_count=sm_count), a @ b)


def test_fp8_and_bf16_output_in_clusters():
    a, b = _operands("wgmma_cluster", seed=14)
    fp8 = cp.variants()["wgmma_fp8"].with_(cluster=2)
    np.testing.assert_array_equal(emulate_gemm(a, b, fp8), a @ b)
    c = emulate_gemm(a, b, "wgmma_cluster", out_dtype="bfloat16")
    np.testing.assert_array_equal(c, dtypes.decode(dtypes.encode(a @ b, "bf16"), "bf16"))


def test_real_valued_inputs_match_an_fp32_reference_on_rounded_operands():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((128, 192)).astype(np.float32)
    b = rng.standard_normal((192, 256)).astype(np.float32)
    ref = dtypes.decode(dtypes.encode(a, "bf16"), "bf16") @ dtypes.decode(dtypes.encode(b, "bf16"), "bf16")
    for variant in ("mma_sync", "wgmma_ws"):
        c = emulate_gemm(a, b, variant)
        np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", ["wgmma_tma", "wgmma_pipe", "wgmma_ws"])
@pytest.mark.parametrize("in_dtype", ["bf16", "fp16"])
def test_n_major_b_through_the_transpose_bit(variant, in_dtype):
    a, b = _operands(variant, seed=8)
    cfg = cp.variants()[variant].with_(b_major="n", in_dtype=in_dtype)
    np.testing.assert_array_equal(emulate_gemm(a, b, cfg), a @ b)


@pytest.mark.parametrize("variant,b_major", [("wgmma_tma", "k"), ("wgmma_ws", "n"), ("wgmma_persistent", "k"),
                                             ("wgmma_persistent", "n")])
def test_m_major_a_through_the_transpose_bit(variant, b_major):
    a, b = _operands(variant, seed=9)
    cfg = cp.variants()[variant].with_(a_major="m", b_major=b_major)
    np.testing.assert_array_equal(emulate_gemm(a, b, cfg), a @ b)


@pytest.mark.parametrize("in_dtype,out_dtype,round_out", [("bf16", "bf16", False), ("fp16", "f32", False),
                                                         ("fp16", "f32", True)])
def test_bias_is_added_in_the_epilogue_before_the_rounding(in_dtype, out_dtype, round_out):
    from helios.cuda_ptx.emu.driver import emulated_context
    from helios.cuda_ptx.runner import GemmLaunch

    cfg = cp.variants()["wgmma_persistent"].with_(bias=True, in_dtype=in_dtype, out_dtype=out_dtype,
                                                  round_out=round_out)
    rng = np.random.default_rng(10)
    m, n, k = 130, 300, 128  # N past one tile, not a multiple of it: the clipped columns add nothing
    a, b = rng.integers(-3, 4, (m, k)).astype(np.float32), rng.integers(-3, 4, (k, n)).astype(np.float32)
    bias = rng.integers(-50, 50, n).astype(np.float32) + 0.25
    if round_out:  # f32 C holds each sum rounded to fp16: sums on a quarter grid near 600, where fp16 steps by halves
        a, bias = a / 4, bias - 0.25 + 600
    launch = GemmLaunch(cfg, m, n, k, emulated_context(sm_count=2))
    launch.upload(a, b, bias)
    launch.run()
    want = a @ b + bias
    if out_dtype == "bf16" or round_out:
        want = dtypes.decode(dtypes.encode(want, in_dtype), in_dtype)
        assert not round_out or np.any(want != a @ b + bias)  # some sums were rounded
    np.testing.assert_array_equal(launch.result(), want)
    launch.close()


def test_bf16_output_and_fp16_input():
    a, b = _operands("wgmma_pipe", seed=3)
    c = emulate_gemm(a, b, "wgmma_pipe", out_dtype="bfloat16")
    np.testing.assert_array_equal(c, dtypes.decode(dtypes.encode(a @ b, "bf16"), "bf16"))
    c16 = emulate_gemm(a, b, "mma_sync", in_dtype="fp16")
    np.testing.assert_array_equal(c16, a @ b)


def test_schedules_differ_but_results_do_not():
    a, b = _operands("wgmma_ws", seed=4)
    for seed in (1, 7):
        np.testing.assert_array_equal(emulate_gemm(a, b, "wgmma_ws", seed=seed), a @ b)


# -- injected bugs ------------------------------------------------------------------------


def _edit(variant, pattern, repl, count=1):
    ptx = cp.emit_gemm(variant)
    new, n = re.subn(pattern, repl, ptx, count=count)
    assert n, f"pattern {pattern!r} not found in {variant}"
    return new


def _drop_wait(variant, which):
    """Remove the ``which``-th mbarrier spin loop (label, try_wait, branch) from the PTX."""
    ptx = cp.emit_gemm(variant)
    loops = list(re.finditer(r"\$wait_\d+:\n\s*mbarrier\.try_wait[^\n]*\n\s*@!%p\d+ bra \$wait_\d+;\n", ptx))
    m = loops[which]
    return ptx[: m.start()] + ptx[m.end():]


def _outcome(variant, ptx, seeds=(0, 1, 2, 3)):
    """'error: ...' for the first seed the emulator refuses, 'wrong' for a wrong product, else 'ok'."""
    a, b = _operands(variant, seed=5)
    for seed in seeds:
        try:
            c = emulate_gemm(a, b, variant, ptx=ptx, seed=seed)
        except EmulationError as e:
            return f"error: {e}"
        if not np.array_equal(c, a @ b):
            return "wrong"
    return "ok"


def test_wrong_mbarrier_parity_is_reported_as_a_deadlock():
    # The producer's first wait on a fresh "empty" barrier must use parity 1 (xor phase, 1).
    ptx = _edit("wgmma_ws", r"xor\.b32 (%r\d+), (%r\d+), 1;\n(\s*)mad", r"mov.u32 \1, \2;\n\3mad")
    out = _outcome("wgmma_ws", ptx, seeds=(0,))
    assert out.startswith("error") and "deadlock" in out and "mbarrier" in out, out


def test_missing_full_barrier_wait_is_caught():
    assert _outcome("wgmma_ws", _drop_wait("wgmma_ws", 1)) != "ok"
    assert _outcome("wgmma_pipe", _drop_wait("wgmma_pipe", 0)) != "ok"


def test_missing_slot_release_barrier_is_caught():
    # wgmma_pipe: thread 0 must not refill a slot before all four warps retired their wgmma on it.
    assert _outcome("wgmma_pipe", _edit("wgmma_pipe", r"bar\.sync 1, 128;", "")) == "wrong"


@pytest.mark.parametrize("variant", ["wgmma_pipe", "wgmma_ws"])
def test_releasing_a_slot_whose_wgmma_may_still_run_is_caught(variant):
    # inflight=1 keeps one k-tile of wgmma running and releases the previous tile's slot;
    # waiting only down to 2 groups hands back a slot the tensor cores still read.
    assert cp.variants()[variant].inflight == 1
    ptx = _edit(variant, r"wgmma\.wait_group\.sync\.aligned 1;", "wgmma.wait_group.sync.aligned 2;")
    assert _outcome(variant, ptx) == "wrong"


def test_serial_and_overlapped_wgmma_give_the_same_product():
    a, b = _operands("wgmma_ws", seed=9)
    for inflight in (0, 1):
        cfg = cp.variants()["wgmma_ws"].with_(inflight=inflight)
        np.testing.assert_array_equal(emulate_gemm(a, b, cfg), a @ b)


def test_persistent_kernel_bugs_are_caught():
    v = "wgmma_persistent"
    # The last k-tile's slot must be handed back after each tile (wait_group 0), or the
    # producer waits forever for it during the next tile.
    tail = r"(wgmma\.wait_group\.sync\.aligned 0;\n(?:[^\n]*\n){1,2}?)\s*@%p\d+ mbarrier\.arrive[^\n]*\n"
    out = _outcome(v, _edit(v, tail, r"\1"), seeds=(0,))
    assert out.startswith("error") and "deadlock" in out, out
    # scale-d must be 0 on each tile's first k-step, or a CTA's second tile adds onto its first.
    assert _outcome(v, _edit(v, r"setp\.ne\.u32 (%p\d+), (%r\d+), 0;(\n\s*wgmma\.fence)",
                             r"setp.eq.u32 \1, \2, \2;\3")) == "wrong"
    # Slots are released once per warp (count 8): every lane arriving completes the phase early.
    assert _outcome(v, re.sub(r"@%p\d+ (mbarrier\.arrive\.shared)", r"\1", cp.emit_gemm(v))) != "ok"


@pytest.mark.parametrize("variant,out_dtype,b_major", [("wgmma_tma", "float32", "n"), ("wgmma_pipe", "bfloat16", "k"),
                                                       ("wgmma_persistent", "bfloat16", "n")])
def test_tma_store_epilogue_writes_every_box(variant, out_dtype, b_major):
    cfg = cp.variants()[variant].with_(tma_store=True, b_major=b_major)
    a, b = _operands("wgmma_pipe", seed=12)
    want = a @ b if out_dtype == "float32" else dtypes.decode(dtypes.encode(a @ b, "bf16"), "bf16")
    np.testing.assert_array_equal(emulate_gemm(a, b, cfg, out_dtype=out_dtype), want)


def test_tma_store_bugs_are_caught():
    v = "wgmma_persistent"
    assert cp.variants()[v].tma_store
    ptx = cp.emit_gemm(v)
    # Every thread must fence its st.shared to the async proxy before the store reads them.
    first = ptx.index("fence.proxy.async.shared::cta;") + 1  # keep the one after mbarrier.init
    no_fence = ptx[:first] + ptx[first:].replace("fence.proxy.async.shared::cta;", "")
    out = _outcome(v, no_fence, seeds=(0,))
    assert out.startswith("error") and "fence.proxy.async" in out, out
    # A staging buffer may be refilled only after the store issued from it has read it.
    out = _outcome(v, ptx.replace("cp.async.bulk.wait_group.read 1;", "cp.async.bulk.wait_group.read 2;"))
    assert out.startswith("error") and "still reads" in out, out
    # The CTA must not end while its stores still read its shared memory.
    out = _outcome(v, _edit(v, r"cp\.async\.bulk\.wait_group 0;", ""), seeds=(0,))
    assert out.startswith("error") and "never waited for" in out, out
    # Thread 0 must not issue the store before the others have written the box.
    out = _outcome(v, re.sub(r"(fence\.proxy\.async\.shared::cta;)\n\s*bar\.sync %r\d+, 128;", r"\1", ptx))
    assert out != "ok", out


def test_cluster_kernel_bugs_are_caught():
    v = "wgmma_cluster"
    ptx = cp.emit_gemm(v)
    # Peers' barriers must be initialised before a producer multicasts into them.
    sync = "barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait.acquire;"
    out = _outcome(v, ptx.replace(sync, "bar.sync 0;", 1))
    assert out.startswith("error") and "before its mbarrier.init" in out, out
    # No CTA may leave while its peer can still arrive on its barriers.
    i = ptx.rindex("barrier.cluster.arrive")
    out = _outcome(v, ptx[:i] + ptx[ptx.index("\n", ptx.index("barrier.cluster.wait", i)) + 1:])
    assert out.startswith("error") and "exited" in out, out
    # A slot is free only when the consumers of *both* CTAs are done with it: releasing it
    # to this CTA's producer alone lets the peer's producer overwrite B under a wgmma.
    local = re.sub(r"mapa\.shared::cluster\.u32 (%r\d+), (%r\d+), 0;", r"mov.u32 \1, \2;", ptx)
    local = re.sub(r"mapa\.shared::cluster\.u32 (%r\d+), %r\d+, 1;\n\s*@%p\d+ mbarrier\.arrive[^\n]*\n", "", local)
    local = re.sub(r"(mbarrier\.init\.shared::cta\.b64 \[%r\d+\+\d+\]), 16;", r"\1, 8;", local)
    assert local.count("mapa") == 0 and local.count(", 8;") == 4
    assert _outcome(v, local) == "wrong"
    # B's share must reach every CTA (ctaMask 0b11); the peer waits forever for the rest.
    out = _outcome(v, _edit(v, r"mov\.b16 (%h\d+), 3;", r"mov.b16 \1, 1;"), seeds=(0,))
    assert out.startswith("error") and "deadlock" in out, out
    # The barriers are published to the peers by fence.mbarrier_init (the first
    # barrier.cluster is .relaxed and orders nothing by itself) ...
    out = _outcome(v, ptx.replace("fence.mbarrier_init.release.cluster;", ""), seeds=(0,))
    assert out.startswith("error") and "not published to the cluster" in out, out
    # ... though a .release barrier publishes them as well.
    valid = ptx.replace("fence.mbarrier_init.release.cluster;", "").replace(
        "barrier.cluster.arrive.relaxed;", "barrier.cluster.arrive.release;")
    assert _outcome(v, valid, seeds=(0,)) == "ok"
    # The final barrier must be a release: a remote arrive is asynchronous, and a .relaxed
    # arrive lets the peer leave before this CTA's last arrivals on its barriers land.
    out = _outcome(v, ptx.replace("barrier.cluster.arrive.release;", "barrier.cluster.arrive.relaxed;"), seeds=(0,))
    assert out.startswith("error") and "not ordered before the exit" in out, out
    # expect_tx must count the peer's share too, or the phase completes before it lands.
    bytes_ = cp.gen_wgmma.WgmmaPlan(cp.variants()[v]).stage_bytes
    out = _outcome(v, _edit(v, rf"(expect_tx\.shared::cta\.b64 _, \[%r\d+\]), {bytes_};", rf"\1, {bytes_ - 16384};"))
    assert out != "ok", out


def test_cluster_barrier_and_remote_arrive_on_a_small_kernel():
    """Rank 1 arrives on rank 0's mbarrier through mapa; rank 0 waits for it; every thread
    meets at barrier.cluster before the first remote use and before leaving."""
    def kernel(wait_without_arrive=False):
        b = Builder("t", "sm_90a", "8.0", 32)
        b.kernel.cluster = (2, 1, 1)
        out = b.param("out", "u64")
        tid = b.sreg("%tid.x")
        rank = b.sreg("%cluster_ctarank")
        bar = ops.smem_base(b)
        b.shared("bar", 8, align=8)
        t0 = b.setp("eq", "u32", tid, 0)
        with b.if_(t0):
            b.emit("mbarrier.init.shared::cta.b64", f"[{bar}]", 1)
        if not wait_without_arrive:
            b.emit("barrier.cluster.arrive.release.aligned")
        b.emit("barrier.cluster.wait.acquire.aligned")
        is1 = b.setp("eq", "u32", rank, 1)
        remote = b.reg("u32")
        b.emit("mapa.shared::cluster.u32", remote, bar, 0)
        arrive = b.reg("pred")
        b.emit("and.pred", arrive, is1, t0)
        b.emit("mbarrier.arrive.shared::cluster.b64", "_", f"[{remote}]", pred=arrive)
        with b.if_(b.setp("eq", "u32", rank, 0)):
            lbl, done = b.label("w"), b.reg("pred")
            b.place(lbl)
            b.emit("mbarrier.try_wait.parity.shared::cta.b64", done, f"[{bar}]", 0)
            b.emit("bra", lbl, pred=done, negate=True)
        cid = b.sreg("%clusterid.x")
        _store_u32(b, out, b.mad("u32", b.sreg("%ctaid.x"), 32, tid), b.mad("u32", cid, 10, rank))
        b.emit("barrier.cluster.arrive.release.aligned")
        b.emit("barrier.cluster.wait.acquire.aligned")
        return render(b.build())

    mem = GlobalMemory()
    out = mem.alloc(4 * 32 * 4)
    emulate_kernel(kernel(), 32, 8, {"out": out}, mem, grid=(4, 1))
    got = mem.view(out, 4 * 128).view(np.uint32).reshape(4, 32)
    np.testing.assert_array_equal(got[:, 0], [0, 1, 10, 11])  # cluster id * 10 + rank
    with pytest.raises(EmulationError, match="whole number of clusters"):
        emulate_kernel(kernel(), 32, 8, {"out": out}, mem, grid=(3, 1))
    with pytest.raises(EmulationError, match="barrier.cluster.wait without a barrier.cluster.arrive"):
        emulate_kernel(kernel(wait_without_arrive=True), 32, 8, {"out": out}, mem, grid=(2, 1))
    with pytest.raises(EmulationError, match="barrier.arrive is not modelled"):
        emulate_kernel(kernel().replace("barrier.cluster.wait.acquire.aligned;", "barrier.arrive 1, 64;", 1),
                       32, 8, {"out": out}, mem, grid=(2, 1))


def test_missing_expect_tx_is_caught():
    ptx = _edit("wgmma_pipe", r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, (\[%r\d+\]), \d+;",
                r"mbarrier.arrive.shared::cta.b64 _, \1;")
    assert _outcome("wgmma_pipe", ptx) != "ok"


def test_reading_accumulators_before_wgmma_wait_is_refused():
    out = _outcome("wgmma_ws", _edit("wgmma_ws", r"wgmma\.wait_group\.sync\.aligned 0;", ""), seeds=(0,))
    assert out.startswith("error") and "in flight" in out, out


def test_missing_wgmma_fence_is_refused():
    out = _outcome("wgmma_tma", _edit("wgmma_tma", r"wgmma\.fence\.sync\.aligned;", ""), seeds=(0,))
    assert out.startswith("error") and "wgmma.fence" in out, out


def test_register_budget_over_the_sm_never_gets_its_registers():
    # 40 * 128 + 2 * 248 * 128 > 65536: the consumers' setmaxnreg.inc waits for ever.
    ptx = _edit("wgmma_ws", r"setmaxnreg\.inc\.sync\.aligned\.u32 232", "setmaxnreg.inc.sync.aligned.u32 248")
    out = _outcome("wgmma_ws", ptx, seeds=(0,))
    assert out.startswith("error") and "deadlock" in out and "waiting for free registers" in out, out


def test_cp_async_waiting_for_too_little_is_caught():
    assert _outcome("mma_sync", _edit("mma_sync", r"cp\.async\.wait_group 1;", "cp.async.wait_group 2;")) == "wrong"


def test_missing_cta_barrier_in_simt_is_caught():
    assert _outcome("simt", _edit("simt", r"bar\.sync 0;", "", count=0)) == "wrong"


def test_wrong_ldmatrix_layout_is_caught():
    ptx = _edit("mma_sync", r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans", "ldmatrix.sync.aligned.m8n8.x4", count=0)
    assert _outcome("mma_sync", ptx) == "wrong"


def test_a_dropped_store_leaves_nan_in_c():
    ptx = _edit("wgmma_tma", r"\n\s*st\.global\.v2\.f32 \[%rd\d+\+0\], \{%f\d+, %f\d+\};", "")
    a, b = _operands("wgmma_tma", seed=6)
    c = emulate_gemm(a, b, "wgmma_tma", ptx=ptx)
    ctas = (64 // 64) * (256 // 128)
    assert np.isnan(c).sum() == ctas * 128 * 2  # one 2-wide store per thread per CTA


# -- the machine on small hand-built kernels --------------------------------------------------


def _kernel(threads, body, params=("out",)):
    """Build a tiny sm_80 kernel: ``body(b, ps, tid)`` emits instructions; returns PTX text."""
    b = Builder("t", "sm_80", "7.0", threads)
    ps = [b.param(p, "u64") for p in params]
    tid = b.sreg("%tid.x")
    body(b, ps, tid)
    return render(b.build())


def _store_u32(b, out_param, tid, value):
    base = ops.ld_param_ptr(b, out_param)
    b.emit("st.global.u32", f"[{ops.addr(b, base, tid, 4)}]", value)


def test_integer_semantics_match_ptx():
    def body(b, ps, tid):
        x = b.binop("shl", "b32", tid, 28)  # wraps past 32 bits
        y = b.binop("shr", "u32", x, 40)  # shift counts >= width give 0
        z = b.mad("u32", tid, 0xFFFFFFFF, 7)  # wraps: 7 - tid
        w = b.binop("rem", "u32", z, 5)
        s = b.binop("add", "u32", b.binop("add", "u32", x, y), w)
        _store_u32(b, ps[0], tid, s)

    mem = GlobalMemory()
    out = mem.alloc(4 * 64)
    emulate_kernel(_kernel(64, body), 64, 0, {"out": out}, mem)
    t = np.arange(64, dtype=np.uint64)
    want = ((t << 28) & 0xFFFFFFFF) + ((7 - t) & 0xFFFFFFFF) % 5
    np.testing.assert_array_equal(mem.view(out, 256).view(np.uint32), (want & 0xFFFFFFFF).astype(np.uint32))


# (op, type, shift): immediates inside and at the edge of the width, and past it
SHIFTS = [("shl", "b32", 0), ("shl", "b32", 5), ("shl", "b32", 31), ("shl", "b32", 40), ("shr", "u32", 7),
          ("shr", "u32", 31), ("shr", "s32", 1), ("shr", "s32", 31), ("shr", "s32", 33), ("shl", "b64", 63),
          ("shr", "u64", 40), ("shr", "s64", 63), ("shl", "b16", 9), ("shr", "u16", 11)]


def _shift_reference(v: np.ndarray, op: str, typ: str, k: int) -> np.ndarray:
    bits = int(typ[1:])
    x = [int(a) & ((1 << bits) - 1) for a in v.astype(np.uint64)]
    if typ[0] == "s":
        x = [a - (1 << bits) if a >> (bits - 1) else a for a in x]
    out = [(a << k) if op == "shl" else (a >> k) for a in x] if k < bits else \
        [0 if op == "shl" or a >= 0 else -1 for a in x]
    return np.array([a & ((1 << bits) - 1) & 0xFFFFFFFF for a in out], np.uint32)  # the low 32 bits, as stored


@pytest.mark.parametrize("scheduler", ["warp", "vector"])
def test_shifts_by_an_immediate_match_ptx_on_both_executors(scheduler):
    """The warp scheduler's and the vectorised executor's shifts give PTX's bits for every
    width and signedness: a left shift wraps, an arithmetic right shift fills with the sign,
    and a count of the width or more gives 0 (or all sign bits)."""
    def body(b, ps, tid):
        v32 = b.mad("u32", tid, 0x9E3779B9, 0x80000001)  # spread values, half of them negative as s32
        v64 = b.reg("u64")
        b.emit("mul.wide.u32", v64, v32, 0x9E3779B9)
        v64 = b.binop("xor", "b64", v64, b.binop("shl", "b64", v64, 32))  # the top half's bits too
        v16 = b.reg("b16")
        b.emit("cvt.u16.u32", v16, v32)
        base = ops.ld_param_ptr(b, ps[0])
        for j, (op, typ, k) in enumerate(SHIFTS):
            src = {"32": v32, "64": v64, "16": v16}[typ[1:]]
            r = b.reg("b16" if typ[1:] == "16" else typ)  # (16-bit registers are all .b16)
            b.emit(f"{op}.{typ}", r, src, k)
            low = b.reg("u32")
            if typ[1:] == "32":
                b.emit("mov.u32", low, r)
            else:  # the low 32 bits of a 64-bit result, or a 16-bit one zero-extended
                b.emit("cvt.u32.u64" if typ[1:] == "64" else "cvt.u32.u16", low, r)
            b.emit("st.global.u32", f"[{ops.addr(b, base, b.binop('add', 'u32', tid, 64 * j), 4)}]", low)

    prog = parse(_kernel(64, body))
    mem = GlobalMemory()
    out = mem.alloc(4 * 64 * len(SHIFTS))
    if scheduler == "warp":  # the scheduler that runs the tensor-core kernels, on a program the other one would take
        from helios.cuda_ptx.emu.executor import Cta
        Cta(prog, 64, 0, {"out": out}, mem, (0, 0, 0), (1, 1, 1)).run()
    else:
        emulate_kernel(prog, 64, 0, {"out": out}, mem)
    got = mem.view(out, 4 * 64 * len(SHIFTS)).view(np.uint32).reshape(len(SHIFTS), 64)
    t = np.arange(64, dtype=np.uint64)
    v32 = (t * 0x9E3779B9 + 0x80000001) & 0xFFFFFFFF
    w = (v32 * 0x9E3779B9) & 0xFFFFFFFFFFFFFFFF
    v64 = w ^ ((w << np.uint64(32)) & np.uint64(0xFFFFFFFFFFFFFFFF))
    for j, (op, typ, k) in enumerate(SHIFTS):
        src = {"32": v32, "64": v64, "16": v32 & 0xFFFF}[typ[1:]]
        np.testing.assert_array_equal(got[j], _shift_reference(src, op, typ, k), err_msg=f"{op}.{typ} {k}")


def test_reading_an_unwritten_register_is_refused():
    def body(b, ps, tid):
        r = b.reg("u32")
        p = b.setp("lt", "u32", tid, 16)
        b.emit("mov.u32", r, 1, pred=p)  # only lanes < 16 write it
        _store_u32(b, ps[0], tid, r)

    mem = GlobalMemory()
    with pytest.raises(EmulationError, match=r"read by thread 16 before anything wrote it"):
        emulate_kernel(_kernel(32, body), 32, 0, {"out": mem.alloc(128)}, mem)


def test_out_of_bounds_store_is_an_illegal_address():
    mem = GlobalMemory()
    with pytest.raises(EmulationError, match="illegal global address"):
        emulate_kernel(_kernel(64, lambda b, ps, tid: _store_u32(b, ps[0], tid, tid)), 64, 0,
                       {"out": mem.alloc(4 * 63)}, mem)


def test_divergent_aligned_instruction_is_refused():
    def body(b, ps, tid):
        smem = ops.smem_base(b)
        lane0 = b.setp("eq", "u32", tid, 0)
        regs = b.regs("b32", 4)
        with b.if_(lane0):
            b.emit("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "{" + ", ".join(map(str, regs)) + "}", f"[{smem}]")
        b.shared("tile", 512)

    mem = GlobalMemory()
    with pytest.raises(EmulationError, match=r"only lanes 0 of the warp reached"):
        emulate_kernel(_kernel(32, body), 32, 512, {"out": mem.alloc(4)}, mem)


def test_barrier_never_reached_by_all_threads_deadlocks():
    def body(b, ps, tid):
        low = b.setp("lt", "u32", tid, 32)
        with b.if_(low):
            ops.bar_sync(b, 0)  # warps 1.. never arrive

    mem = GlobalMemory()
    with pytest.raises(EmulationError, match=r"deadlock(.|\n)*bar\.sync 0 \(32/64 arrived\)"):
        emulate_kernel(_kernel(64, body), 64, 0, {"out": mem.alloc(4)}, mem)


def test_parser_rejects_what_it_does_not_know():
    with pytest.raises(PtxParseError, match="unknown label"):
        parse(".target sm_80\n.visible .entry k(\n)\n{\n\tbra $nowhere;\n}\n")
    with pytest.raises(PtxParseError, match="not declared"):
        parse(".target sm_80\n.visible .entry k(\n)\n{\n\tmov.u32 %r0, 1;\n}\n").reg_type("%r0")
    bad = _kernel(32, lambda b, ps, tid: b.emit("prmt.b32", b.reg("u32"), tid, tid, 0))
    mem = GlobalMemory()
    with pytest.raises(EmulationError, match="prmt.b32 is not modelled"):
        emulate_kernel(bad, 32, 0, {"out": mem.alloc(4)}, mem)
