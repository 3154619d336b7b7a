"""The no-GPU gate over every variant: ptxas accepts, 0 spill, no C75xx notes, expected SASS.

Skips (saying why) where ptxas or cuobjdump/nvdisasm is missing; the cubin cache
keeps reruns fast.
"""

import os

import helios.cuda_ptx as cp
import pytest
from helios.cuda_ptx import gate, render, toolchain

needs_ptxas = pytest.mark.skipif(toolchain.find_tool("ptxas") is None,
                                 reason="ptxas not found (CUDA toolkit or `pip install nvidia-cuda-nvcc`)")
needs_sass = pytest.mark.skipif(
    toolchain.find_tool("cuobjdump") is None and toolchain.find_tool("nvdisasm") is None,
    reason="no SASS disassembler (`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`)")

V = cp.variants()
G = gate.gate_configs()


def test_gate_covers_the_ladder_and_n_major_twins_of_16_bit_wgmma():
    twins = ("wgmma_tma", "wgmma_pipe", "wgmma_ws", "wgmma_persistent", "wgmma_cluster")
    assert list(G) == [*V, *(f"{n}_nmajor" for n in twins), "wgmma_persistent_amajor", "wgmma_persistent_amajor_nmajor",
                       "wgmma_persistent_bias", "wgmma_persistent_bias_fp16", "wgmma_persistent_round",
                       "wgmma_persistent_round_fp16", "wgmma_persistent_residual", "wgmma_persistent_batched",
                       "wgmma_persistent_batched2_nmajor"]
    assert G["wgmma_persistent_residual"].residual and G["wgmma_persistent_residual"].bias
    assert G["wgmma_persistent_round"].round_out and G["wgmma_persistent_round_fp16"].in_dtype == "fp16"
    assert G["wgmma_persistent_batched"].batched == 1 and G["wgmma_persistent_batched2_nmajor"].batched == 2
    assert G["wgmma_persistent_bias"].bias and G["wgmma_persistent_bias_fp16"].in_dtype == "fp16"
    assert G["wgmma_persistent_amajor"].a_major == "m" and G["wgmma_persistent_amajor_nmajor"].b_major == "n"
    for name in twins:
        twin = G[f"{name}_nmajor"]
        assert twin == V[name].with_(name=f"{name}_nmajor", b_major="n")
    assert all(G[n] == V[n] for n in V)  # the ladder itself is gated unchanged (K-major wgmma B)


@needs_ptxas
@needs_sass
@pytest.mark.parametrize("name", list(G))
def test_gate_passes_for_every_variant(name):
    rep = gate.run_gate(G[name])
    assert rep.ok, rep.failures
    assert rep.spill_bytes == 0
    assert not set(rep.notes) & set(gate.FORBIDDEN_NOTES)
    assert all(n > 0 for n in rep.found.values()), rep.found
    if G[name].b_major == "n" and G[name].kind == "wgmma" and G[name].a_major == "k":
        # every HGMMA reads B transposed, and B arrives as 1 + bn/64 TMA copies per tile
        hg = next(v for k, v in rep.found.items() if k.startswith("HGMMA.64x"))
        assert rep.found["HGMMA " + gate.TNSP_B] == hg
        k_major = G[name].with_(b_major="k")  # the same kernel reading B K-major: one TMA copy of B fewer
        assert rep.found["UTMALDG"] > gate.run_gate(k_major, emulate=False).found["UTMALDG"]
    if G[name].a_major == "m":  # every HGMMA reads A transposed
        hg = next(v for k, v in rep.found.items() if k.startswith("HGMMA.64x"))
        assert rep.found["HGMMA " + gate.TNSP_A] == hg


EXTRA = {
    "mma_sync_kmajor": V["mma_sync"].with_(b_major="k"),
    "mma_sync_fp16_bf16out": V["mma_sync"].with_(in_dtype="fp16", out_dtype="bf16"),
    "simt_kmajor_bf16out": V["simt"].with_(b_major="k", out_dtype="bf16"),
    "wgmma_ws_bf16out": V["wgmma_ws"].with_(out_dtype="bf16"),
    "wgmma_pipe_fp16": V["wgmma_pipe"].with_(in_dtype="fp16"),
    "wgmma_fp8_bf16out": V["wgmma_fp8"].with_(out_dtype="bf16"),
    "wgmma_ws_nmajor_fp16_bf16out": V["wgmma_ws"].with_(b_major="n", in_dtype="fp16", out_dtype="bf16"),
    "wgmma_tma_nmajor_bn256": V["wgmma_tma"].with_(b_major="n", bn=256),
    "wgmma_ws_serial": V["wgmma_ws"].with_(inflight=0),
    "wgmma_pipe_serial_nmajor": V["wgmma_pipe"].with_(inflight=0, b_major="n"),
    "wgmma_persistent_fp8": V["wgmma_fp8"].with_(persistent=True, tma_store=True),
    "wgmma_persistent_st_global": V["wgmma_persistent"].with_(tma_store=False),
    "wgmma_pipe_tma_store_bf16out": V["wgmma_pipe"].with_(tma_store=True, out_dtype="bf16"),
    "wgmma_persistent_serial_rowwise_bf16out": V["wgmma_persistent"].with_(inflight=0, group_m=0, out_dtype="bf16"),
    "wgmma_cluster_plain_st_global": V["wgmma_cluster"].with_(persistent=False, tma_store=False),
    "wgmma_cluster_fp8": V["wgmma_fp8"].with_(cluster=2, persistent=True, tma_store=True),
}


@needs_ptxas
@needs_sass
@pytest.mark.parametrize("name", list(EXTRA))
def test_gate_passes_for_other_dtypes_and_layouts(name):
    rep = gate.run_gate(EXTRA[name])
    assert rep.ok, rep.failures


@needs_ptxas
@needs_sass
def test_gate_catches_setmaxnreg_dropped_without_launch_bounds():
    cfg = V["wgmma_ws"]
    k = cp.build_kernel(cfg)
    k.maxntid, k.minnctapersm = None, None
    rep = gate.run_gate(cfg, render.render(k))
    assert not rep.ok
    assert "C7508" in rep.notes
    assert any("C7508" in f for f in rep.failures)


@needs_ptxas
@needs_sass
def test_gate_catches_missing_tensor_core_instructions():
    # the SIMT kernel under the mma_sync expectations: no HMMA/LDSM/LDGSTS
    rep = gate.run_gate(V["mma_sync"], cp.emit_gemm("simt"))
    assert not rep.ok
    assert any("HMMA" in f for f in rep.failures)


@needs_ptxas
@needs_sass
@pytest.mark.parametrize("name", ["wgmma_tma", "wgmma_ws"])
def test_gate_catches_b_read_in_the_wrong_layout(name):
    k_cfg, n_cfg = V[name], G[f"{name}_nmajor"]
    # N-major PTX judged as the K-major kernel: its HGMMAs carry .tnspB
    rep = gate.run_gate(k_cfg, cp.emit_gemm(n_cfg))
    assert not rep.ok and any("carry .tnspB" in f for f in rep.failures)
    # K-major PTX judged as the N-major kernel: no HGMMA reads B transposed
    rep = gate.run_gate(n_cfg, cp.emit_gemm(k_cfg))
    assert not rep.ok and any("lack .tnspB" in f for f in rep.failures)


@needs_ptxas
@needs_sass
def test_gate_catches_a_gpu_wide_fence_in_the_cluster_release():
    # .release.cluster on the per-warp slot release makes ptxas put MEMBAR.ALL.GPU before each
    ptx = cp.emit_gemm("wgmma_cluster").replace("mbarrier.arrive.shared::cluster.b64",
                                                  "mbarrier.arrive.release.cluster.shared::cluster.b64")
    rep = gate.run_gate(V["wgmma_cluster"], ptx, emulate=False)
    assert not rep.ok and any("MEMBAR.ALL.GPU" in f for f in rep.failures), rep.failures


@needs_ptxas
@needs_sass
def test_gate_cli_runs_named_configs(capsys):
    import json

    assert gate.main(["wgmma_tma_nmajor"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["name"] == "wgmma_tma_nmajor" and json.loads(lines[0])["ok"]
    with pytest.raises(SystemExit):
        gate.main(["nope"])


@needs_ptxas
def test_ptxas_rejects_wgmma_on_plain_sm90():
    with pytest.raises(toolchain.PtxasError, match="sm_90"):
        toolchain.compile_ptx(cp.emit_gemm("wgmma_tma").replace(".target sm_90a", ".target sm_90"), "sm_90")


@needs_ptxas
def test_cubin_cache_key_and_atomic_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ptx = cp.emit_gemm("simt")
    first = toolchain.compile_ptx(ptx, "sm_80")
    assert not first.cached and first.cubin.parent == tmp_path / "helios" / "cubin"
    again = toolchain.compile_ptx(ptx, "sm_80")
    assert again.cached and again.cubin == first.cubin and again.info.registers == first.info.registers
    other_arch = toolchain.compile_ptx(ptx, "sm_90")
    assert other_arch.cubin != first.cubin
    assert not [p for p in os.listdir(first.cubin.parent) if p.endswith(".tmp")]
    assert first.cubin.read_bytes()[:4] == b"\x7fELF"
    # the disassembly of a cached cubin is kept beside it and read back as it was written
    listing = toolchain.sass(first.cubin)
    (kept,) = [p for p in os.listdir(first.cubin.parent) if p.endswith(".sass")]
    assert kept.startswith(first.cubin.stem + ".") and "FFMA" in listing
    (first.cubin.parent / kept).write_text(listing + "/* read back */")
    assert toolchain.sass(first.cubin).endswith("/* read back */")
    # a cubin outside the cache (not named by its content) is disassembled afresh, nothing kept
    elsewhere = tmp_path / "k.cubin"
    elsewhere.write_bytes(first.cubin.read_bytes())
    assert toolchain.sass(elsewhere) == listing and not list(tmp_path.glob("*.sass"))


def test_parse_ptxas_log():
    log = ("ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored\n"
           "    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers\n")
    info = toolchain.parse_ptxas_log(log)
    assert (info.registers, info.spill_stores, info.spill_loads, info.stack_frame) == (168, 12, 4, 8)
    assert info.notes == ["C7508"]


def test_count_prefixed_handles_predicates():
    sass = ("        /*0100*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
            "        /*0110*/              @P0 UTMALDG.2D [UR8], [UR10] ;\n"
            "        /*0120*/                   NOP ;\n")
    assert gate.count_prefixed(sass, "HGMMA.64x256x") == 1
    assert gate.count_prefixed(sass, "UTMALDG") == 1
    assert gate.count_prefixed(sass, "QGMMA") == 0
    tn = ("        /*0200*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12].tnspB, R24 ;\n"
          "        /*0210*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR28], R24, gsb0 ;\n")
    assert gate.count_prefixed(tn, "HGMMA") == 2
    assert gate.count_prefixed(tn, "HGMMA", gate.TNSP_B) == 1
    assert gate.count_prefixed(sass, "HGMMA", gate.TNSP_B) == 0


def test_missing_tool_message(monkeypatch):
    toolchain.find_tool.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(toolchain, "_wheel_bins", list)
    try:
        with pytest.raises(toolchain.ToolMissing, match="nvidia-cuda-nvdisasm"):
            toolchain.require_tool("nvdisasm")
    finally:
        toolchain.find_tool.cache_clear()


@needs_ptxas
@needs_sass
def test_gate_runs_each_kernel_on_the_emulator_and_catches_what_ptxas_cannot():
    import re

    rep = gate.run_gate(V["wgmma_ws"])
    assert rep.emulated["shape"] == [128, 512, 384] and rep.emulated["seconds"] >= 0
    # A producer waiting on the wrong parity assembles fine and hangs on the GPU.
    ptx = re.sub(r"xor\.b32 (%r\d+), (%r\d+), 1;\n(\s*)mad", r"mov.u32 \1, \2;\n\3mad", cp.emit_gemm("wgmma_ws"), count=1)
    rep = gate.run_gate(V["wgmma_ws"], ptx)
    assert not rep.ok and any("deadlock" in f for f in rep.failures), rep.failures
    # Refilling a slot before every warp retired its wgmma on it: a race, so a wrong product.
    ptx = cp.emit_gemm("wgmma_pipe").replace("bar.sync 1, 128;", "", 1)
    rep = gate.run_gate(V["wgmma_pipe"], ptx)
    assert not rep.ok and any("differ from A @ B" in f for f in rep.failures), rep.failures
