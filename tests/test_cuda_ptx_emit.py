"""helios.cuda_ptx IR, renderer, configs and the emit_gemm / variants API (no tools needed)."""

import re

import helios.cuda_ptx as cp
import pytest
from helios.cuda_ptx import ir, render

from helios.errors import DTypeError, ShapeError


def test_variants_are_the_ladder():
    assert list(cp.variants()) == ["simt", "mma_sync", "wgmma_tma", "wgmma_pipe", "wgmma_ws", "wgmma_fp8",
                                   "wgmma_persistent", "wgmma_cluster"]
    for name, cfg in cp.variants().items():
        assert cfg.name == name
        cfg.validate()


@pytest.mark.parametrize("name", list(cp.variants()))
def test_emit_gemm_headers_and_entry(name):
    cfg = cp.variants()[name]
    ptx = cp.emit_gemm(name)
    assert ptx == cp.emit_gemm(cfg)  # by name or by config, deterministic
    assert f".target {cfg.target}\n" in ptx
    assert re.search(r"\.version (\d+)\.(\d+)", ptx)
    assert f".visible .entry {cfg.kernel_name}(" in ptx
    if cfg.kind == "wgmma":
        assert ".target sm_90a" in ptx and float(re.search(r"\.version ([\d.]+)", ptx).group(1)) >= 8.0
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
        assert ".param .align 128 .b8 tmap_a[128]" in ptx
    if cfg.maxnreg:
        # setmaxnreg is only honoured when the entry carries both of these
        assert f".maxntid {cfg.threads}, 1, 1" in ptx and ".minnctapersm 1" in ptx
        assert f"setmaxnreg.dec.sync.aligned.u32 {cfg.maxnreg[0]}" in ptx
        assert f"setmaxnreg.inc.sync.aligned.u32 {cfg.maxnreg[1]}" in ptx
    if cfg.kind == "mma_sync":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx and "cp.async.cg.shared.global" in ptx


def test_persistent_needs_the_warp_specialised_layout():
    with pytest.raises(ValueError, match="persistent needs"):
        cp.variants()["wgmma_pipe"].with_(persistent=True).validate()
    with pytest.raises(ValueError, match="persistent needs"):
        cp.variants()["mma_sync"].with_(persistent=True).validate()
    ptx = cp.emit_gemm("wgmma_persistent")
    # the tile loop strides by the grid; slots are released by lane 0 of each consumer warp
    assert "%nctaid.x" in ptx and re.search(r"@%p\d+ mbarrier\.arrive\.shared::cta\.b64", ptx)
    assert re.search(r"mbarrier\.init[^\n]*, 8;", ptx)


def test_tma_store_is_wgmma_only_and_shared_memory_is_bounded():
    with pytest.raises(ValueError, match="tma_store applies"):
        cp.variants()["mma_sync"].with_(tma_store=True).validate()
    # 5 stages of 48 KiB exceed the 227 KiB a CTA can have
    with pytest.raises(ShapeError, match="shared memory"):
        cp.emit_gemm(cp.variants()["wgmma_ws"].with_(stages=5))
    ptx = cp.emit_gemm("wgmma_persistent")
    assert ".param .align 128 .b8 tmap_c[128]" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx and "fence.proxy.async.shared::cta" in ptx


def test_persistent_grid_is_one_cta_per_sm_up_to_the_tiles():
    from helios.cuda_ptx import operands

    cfg = cp.variants()["wgmma_persistent"]
    assert operands.grid(cfg, operands.padded(cfg, 8192, 8192, 64), 132) == (132, 1)
    assert operands.grid(cfg, operands.padded(cfg, 200, 300, 64), 132) == (4, 1)  # 2 x 2 tiles
    assert operands.grid(cp.variants()["wgmma_ws"], operands.padded(cfg, 8192, 4096, 64), 132) == (16, 64)
    with pytest.raises(ValueError, match="sm_count"):
        operands.grid(cfg, operands.padded(cfg, 128, 256, 64), 0)


def test_cluster_grid_is_whole_clusters_over_blocks_of_two_tile_rows():
    from helios.cuda_ptx import operands

    cl = cp.variants()["wgmma_cluster"]
    assert operands.padded(cl, 300, 300, 64) == operands.Padded(512, 512, 64)  # M to 2 x bm: a pair of tiles
    p = operands.padded(cl, 8192, 8192, 64)  # 32 x 64 blocks of 2 x 1 tiles
    assert operands.grid(cl, p, 132) == (132, 1)  # 66 clusters of 2
    assert operands.grid(cl, p, 132, clusters=60) == (120, 1)  # as many as can be resident
    assert operands.grid(cl, operands.padded(cl, 256, 512, 64), 132) == (4, 1)  # 2 blocks
    plain = cl.with_(persistent=False)
    assert operands.grid(plain, p, 132) == (2048, 1)  # one cluster (2 CTAs) per block: 32 x 64 blocks
    with pytest.raises(ValueError, match="resident"):
        operands.grid(cl, p, 1, clusters=0)
    with pytest.raises(ShapeError, match="not a whole number of 2 x 128-row blocks"):
        operands.grid(cl, operands.Padded(384, 512, 64), 132)
    # B's box is split between the two CTAs (K-major: half the rows; N-major: half the 64-column boxes)
    assert operands.tma_boxes(cl, p)[1] == operands.TmaBox("b", 8192, 64, 128, 64)
    assert operands.tma_boxes(cl.with_(b_major="n"), p)[1] == operands.TmaBox("b", 64, 8192, 64, 64)


def test_extents_past_32_bit_offsets_are_refused():
    from helios.cuda_ptx import operands

    v = cp.variants()
    with pytest.raises(ShapeError, match=r"wgmma_ws: C would have 65536 x 65536 .* tma_store=True"):
        operands.padded(v["wgmma_ws"], 65536, 65536, 64)
    operands.padded(v["wgmma_persistent"], 65536, 65536, 64)  # TMA stores: coordinates, no offsets
    with pytest.raises(ShapeError, match=r"mma_sync: A would have"):
        operands.padded(v["mma_sync"], 1 << 17, 64, 1 << 15)
    with pytest.raises(ShapeError, match="below 2\\^31"):
        operands.padded(v["wgmma_persistent"], 1 << 31, 256, 64)


def test_cluster_config_is_checked():
    ws = cp.variants()["wgmma_ws"]
    with pytest.raises(ValueError, match="cluster must be 1 or 2"):
        ws.with_(cluster=4).validate()
    with pytest.raises(ValueError, match="warp-specialised"):
        cp.variants()["wgmma_pipe"].with_(cluster=2).validate()
    with pytest.raises(ShapeError, match="multiple of 128"):
        ws.with_(cluster=2, b_major="n", bn=192).validate()
    ws.with_(cluster=2, b_major="k", bn=192).validate()  # K-major halves any tile: 96 rows each


def test_cluster_kernel_multicasts_b_and_releases_slots_to_every_cta():
    ptx = cp.emit_gemm("wgmma_cluster")
    assert ".reqnctapercluster 2, 1, 1" in ptx
    loads = [ln.strip() for ln in ptx.splitlines() if "cp.async.bulk.tensor.2d.shared::cluster" in ln]
    assert len(loads) == 2 and "multicast" not in loads[0]  # A: this CTA's own
    assert loads[1].startswith("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                               ".multicast::cluster") and loads[1].endswith(", %h0;")
    assert "mov.b16 %h0, 3;" in ptx  # ctaMask: both CTAs
    # every consumer warp's lane 0 releases a slot in both CTAs: 2 CTAs x 2 consumers x 4 warps
    assert ptx.count("mbarrier.init.shared::cta.b64") == 8 and ", 16;" in ptx
    assert ptx.count("mapa.shared::cluster.u32") == 4  # (in-loop + end-of-tile release) x 2 ranks
    # a cta-scope release: .release.cluster would put a GPU-wide MEMBAR before every arrive
    assert "mbarrier.arrive.shared::cluster.b64" in ptx and "arrive.release.cluster" not in ptx
    # after the init (published by fence.mbarrier_init), and before the exit (a release:
    # this thread's remote arrivals land before the peer may leave)
    assert ptx.count("barrier.cluster.arrive.relaxed;") == 1 and ptx.count("barrier.cluster.arrive.release;") == 1
    assert ptx.index("fence.mbarrier_init.release.cluster;") < ptx.index("barrier.cluster.arrive.relaxed;")
    assert "%clusterid.x" in ptx and "%nclusterid.x" in ptx and "%cluster_ctarank" in ptx


def test_fp8_uses_k32_e4m3():
    ptx = cp.emit_gemm("wgmma_fp8")
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in ptx


def test_every_register_used_is_declared():
    ptx = cp.emit_gemm("wgmma_ws")
    decl = {m.group(1): int(m.group(2)) for m in re.finditer(r"\.reg \.\w+ %(\w+?)<(\d+)>", ptx)}
    for m in re.finditer(r"%(p|h|r|rd|f|fd)(\d+)\b", ptx):
        assert int(m.group(2)) < decl[m.group(1)], m.group(0)


def test_builder_loop_and_if_render():
    b = ir.Builder("k", "sm_80", "7.0", 32)
    i = b.reg("u32")
    x = b.mov("u32", 0)
    p = b.setp("eq", "u32", x, 0)
    with b.loop(i, 0, 10, 2):
        b.emit("add.u32", x, x, i)
    with b.if_(p):
        b.comment("taken")
    b.emit("mov.f32", b.reg("f32"), 1.0)
    text = render.render(b.build())
    body = [ln.strip() for ln in text.splitlines()]
    start = body.index("$loop_1:")
    assert body[start - 1] == "mov.u32 %r0, 0;"
    assert body[start + 1: start + 5] == [
        "add.u32 %r1, %r1, %r0;", "add.u32 %r0, %r0, 2;", "setp.lt.u32 %p1, %r0, 10;", "@%p1 bra.uni $loop_1;"]
    assert body[start + 5: start + 8] == ["@!%p0 bra $skip_2;", "// taken", "$skip_2:"]
    assert "0f3F800000" in text  # floats are written as exact hex


def test_builder_rejects_unclosed_block():
    b = ir.Builder("k", "sm_80", "7.0", 32)
    cm = b.loop(b.reg("u32"), 0, 1, 1)
    cm.__enter__()
    with pytest.raises(RuntimeError, match="unclosed"):
        b.build()


def test_invalid_configs_say_why():
    v = cp.variants()
    with pytest.raises(DTypeError, match="K-major"):
        v["mma_sync"].with_(in_dtype="e4m3").validate()
    with pytest.raises(ShapeError, match="bk"):
        v["wgmma_tma"].with_(bk=32).validate()
    with pytest.raises(DTypeError):
        v["simt"].with_(out_dtype="f64").validate()
    with pytest.raises(KeyError, match="unknown GEMM variant"):
        cp.emit_gemm("nope")


TMA_RE = re.compile(r"cp\.async\.bulk\.tensor\.2d\S* \[%r(\d+)(?:\+(\d+))?\], \[%rd(\d+), \{%r(\d+), %r(\d+)\}\]")


def _defs(ptx: str) -> dict[str, str]:
    """Register -> the instruction that last wrote it (the kernels assign most registers once)."""
    out = {}
    for ln in ptx.splitlines():
        m = re.match(r"\s*(\S+) (%\w+), (.*);", ln)
        if m:
            out[m.group(2)] = f"{m.group(1)} {m.group(3)}"
    return out


@pytest.mark.parametrize("name", ["wgmma_tma", "wgmma_pipe", "wgmma_ws"])
@pytest.mark.parametrize("in_dtype", ["bf16", "fp16"])
def test_wgmma_n_major_b_reads_through_the_transpose_bit(name, in_dtype):
    from helios.cuda_ptx import gen_wgmma
    from helios.cuda_ptx import layout as L

    cfg = cp.variants()[name].with_(b_major="n", in_dtype=in_dtype)
    plan = gen_wgmma.WgmmaPlan(cfg)
    ptx = cp.emit_gemm(cfg)
    assert f"_bn_{cfg.bm}x{cfg.bn}" in cfg.kernel_name and f".entry {cfg.kernel_name}(" in ptx
    mmas = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert mmas and all(ln.rstrip().endswith(", 1, 1, 0, 1;") for ln in mmas)  # imm-trans-a 0, imm-trans-b 1
    # every expect_tx arms the slot's full byte count: A + bn/64 boxes of 8 KiB
    tx = re.findall(r"expect_tx\S* _, \[%r\d+\], (\d+);", ptx)
    assert tx and {int(t) for t in tx} == {cfg.bm * 128 + (cfg.bn // 64) * 8192}
    # per load site: one A copy {k0, m0}, then bn/64 B copies {n0 + 64 j, k0} at +a_bytes + 8192 j
    defs = _defs(ptx)
    copies = TMA_RE.findall(ptx)
    per_tile = 1 + cfg.bn // 64
    assert copies and len(copies) % per_tile == 0
    for t in range(0, len(copies), per_tile):
        a_dst, a_off, a_map, k0, m0 = copies[t]
        assert a_off == ""
        n0 = None
        for j, (dst, off, bmap, nj, kj) in enumerate(copies[t + 1: t + per_tile]):
            assert (dst, int(off), kj) == (a_dst, plan.a_bytes + 8192 * j, k0) and bmap != a_map
            if j == 0:
                n0 = nj
            else:
                assert defs[f"%r{nj}"] == f"add.u32 %r{n0}, {64 * j}"
    # B's descriptor: MN-major constants, +2048 B (128 encoded) per k16 step; A's stays K-major
    ors = re.findall(r"or\.b64 %rd\d+, %rd\d+, (\d+);", ptx)
    assert {int(x) for x in ors} == {plan.desc_const, L.encode_desc(0, 8192, 1024, 128)}
    steps = sorted({int(x) for x in re.findall(r"add\.s64 %rd\d+, %rd\d+, (\d+);", ptx)})
    assert {128 * kk for kk in range(4)} <= set(steps)


def test_wgmma_k_major_b_keeps_one_copy_and_no_transpose():
    ptx = cp.emit_gemm("wgmma_ws")
    assert all(ln.rstrip().endswith(", 1, 1, 0, 0;") for ln in ptx.splitlines() if "wgmma.mma_async" in ln)
    copies = TMA_RE.findall(ptx)
    # A {k0, m0} then B {k0, n0}: both K innermost
    for t in range(0, len(copies), 2):
        assert copies[t + 1][3] == copies[t][3] and copies[t + 1][1] == str(128 * 128)


def test_fp8_with_n_major_b_is_refused_with_the_reason():
    with pytest.raises(DTypeError, match="K-major only"):
        cp.emit_gemm(cp.variants()["wgmma_fp8"].with_(b_major="n"))


def test_user_picks_b_major_on_any_16_bit_wgmma_config():
    cfg = cp.variants()["wgmma_ws"].with_(b_major="n", out_dtype="bf16")
    cfg.validate()
    assert cfg.kernel_name != cp.variants()["wgmma_ws"].kernel_name
    assert [c.b_major for c in cp.variants().values() if c.kind == "wgmma"] == ["k"] * 6  # ladder unchanged


def test_tma_boxes_follow_b_major():
    from helios.cuda_ptx import operands

    v = cp.variants()
    p = operands.Padded(256, 512, 128)
    assert operands.tma_boxes(v["wgmma_ws"], p) == [
        operands.TmaBox("a", 256, 128, 128, 64), operands.TmaBox("b", 512, 128, 256, 64)]
    assert operands.tma_boxes(v["wgmma_ws"].with_(b_major="n"), p) == [
        operands.TmaBox("a", 256, 128, 128, 64), operands.TmaBox("b", 128, 512, 64, 64)]
    assert operands.tma_boxes(v["mma_sync"], p) == []


def test_encode_operands_stores_b_as_the_kernel_reads_it():
    import numpy as np
    from helios.cuda_ptx import dtypes, operands

    cfg = cp.variants()["wgmma_tma"]
    a, b = np.ones((3, 5), np.float32), np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    p = operands.padded(cfg, 3, 7, 5)
    _, rn = operands.encode_operands(cfg.with_(b_major="n"), a, b, p)
    _, rk = operands.encode_operands(cfg, a, b, p)
    assert rn.shape == (p.k, p.n) and rk.shape == (p.n, p.k)
    assert np.array_equal(rn[:5, :7], dtypes.encode(b, "bf16")) and np.array_equal(rk[:7, :5], rn[:5, :7].T)


def test_gemm_reads_16_bit_b_n_major_and_transposes_only_fp8():
    from helios.cuda_ptx import runner

    for name, cfg in cp.variants().items():
        got = runner.gemm_config(name, out_dtype="bfloat16")
        assert got.b_major == ("k" if cfg.in_dtype == "e4m3" else "n"), name
        assert got.out_dtype == "bf16" and got.in_dtype == cfg.in_dtype
    # a config given with K-major B is still run N-major by gemm() (its B is numpy's K x N)
    assert runner.gemm_config(cp.variants()["wgmma_pipe"], in_dtype="fp16").b_major == "n"
