"""helios.cuda_ptx IR, renderer, configs and the emit_gemm / variants API (no tools needed)."""

import re

import helios.cuda_ptx as cp
import pytest
from helios.cuda_ptx import ir, render

from helios.errors import DTypeError, ShapeError


def test_variants_are_the_ladder():
    assert list(cp.variants()) == ["simt", "mma_sync", "wgmma_tma", "wgmma_pipe", "wgmma_ws", "wgmma_fp8"]
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


def test_wgmma_n_major_b_is_not_generated():
    with pytest.raises(NotImplementedError, match="K-major"):
        cp.emit_gemm(cp.variants()["wgmma_tma"].with_(b_major="n"))
