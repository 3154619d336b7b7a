"""The SPIR-V -> PTX translator over every Helios kernel: it translates, ptxas accepts the PTX for
sm_90 without spills, specialization constants fold away the code they rule out, and what it cannot
translate is refused by name.  (Numerics: tests/test_cuda_device.py runs the kernels.)"""

import os
import shutil
import subprocess

import pytest

from helios.cuda_ptx import spirv_ptx, toolchain
from helios.cuda_ptx.spirv import SpirvError, read_module
from helios.cuda_ptx.spirv_ptx import translate
from helios.kernels_spirv import registry, specialize

needs_ptxas = pytest.mark.skipif(toolchain.find_tool("ptxas") is None,
                                 reason="ptxas not found (CUDA toolkit or `pip install nvidia-cuda-nvcc`)")


def _variants(kernel):
    """The variants the CUDA runtime runs: not the subgroup (_sg) and texel-view (_tx) ones written
    for CPU drivers."""
    return [v for v in registry.variants(kernel) if "_sg" not in v and "tx" not in v.split("_")]


# Every kernel but the cooperative-matrix ones (matmul_coop): they run on Vulkan GPUs listing
# cooperative matrices only, never through the translator (cuda:N has its own tensor-core GEMM).
KERNELS = sorted(k for k in registry.KERNELS if not registry.needs_coopmat(k))


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_variant_translates(kernel):
    for v in _variants(kernel):
        t = translate(registry.spirv(kernel, v), (), f"{kernel}_{v}")
        assert f".visible .entry {kernel}_{v}(" in t.ptx
        assert len(t.bindings) == len(set(t.bindings)) <= registry.KERNELS[kernel].num_buffers
        assert t.push_words * 4 >= registry.KERNELS[kernel].push_size > (t.push_words - 1) * 4


def _assemble_without_spills(kernel: str, variant: str, spec: tuple, tmp_path) -> None:
    """Translate one pipeline of ``kernel`` and have ptxas assemble it for sm_90: no error, no spill."""
    t = translate(registry.spirv(kernel, variant), spec, f"{kernel}_{variant}")
    src = tmp_path / f"{kernel}_{variant}.ptx"
    src.write_text(t.ptx)
    r = subprocess.run([toolchain.require_tool("ptxas"), "-v", "-arch=sm_90", str(src), "-o", os.devnull],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{kernel}.{variant} {spec}: {r.stderr}"
    info = toolchain.parse_ptxas_log(r.stderr)
    assert info.spill_stores == 0 and info.spill_loads == 0, f"{kernel}.{variant} {spec}: {r.stderr}"


@needs_ptxas
@pytest.mark.parametrize("kernel", KERNELS)
def test_ptxas_accepts_every_variant_without_spills(kernel, tmp_path):
    for v in _variants(kernel):
        _assemble_without_spills(kernel, v, (), tmp_path)


@needs_ptxas
def test_ptxas_accepts_the_column_runs(tmp_path):
    # the column reductions' runs (helios._kernels.core.column_chunks), which GPUs take: LayerNorm's
    # partials (MODE 2 with PARTIALS) and their sum (MODE 4), reduce's second pass with arg indices;
    # the backward's input and parameter gradients in one dispatch, a workgroup a row (MODE 3), with
    # a pending gradient and a 16-bit gradient read by a float32 LayerNorm (f32_bf16)
    for v in ("f32", "bf16", "f32_bf16"):
        _assemble_without_spills("layernorm", v, (2, False, 64, False, False, True, True, True), tmp_path)
        _assemble_without_spills("layernorm", v, (4, False, 64, False, False, True, True), tmp_path)
        _assemble_without_spills("layernorm", v, (3, True, 256, True, False, True, True, True), tmp_path)
    for v, op in (("f32", 3), ("i64", 4), ("f32", 0)):
        _assemble_without_spills("reduce", v, (op, 1, 256, op != 0), tmp_path)


def test_specialization_constants_fold_the_op_switch():
    # ew_unary picks its op by specialization constant 0: one op's code is emitted, not all of them
    code = registry.spirv("ew_unary", "f32")
    one = translate(code, (registry_op("exp"), 0), "u").ptx
    every = translate(code, (), "u").ptx  # op 0 by default: still a single case
    assert "ex2.approx.f32" in one and "ex2.approx.f32" not in every
    assert one.count("\n") < 400


def registry_op(name):
    from helios import _kernels as K
    return K.UNARY[name]


def test_workgroup_size_follows_its_specialization_constant():
    code = registry.spirv("softmax", "f32")
    assert translate(code, (0, 128), "s").block == (128, 1, 1)
    assert translate(code, (0, 64), "s").block == (64, 1, 1)
    assert ".maxntid 64, 1, 1" in translate(code, (0, 64), "s").ptx


SUBGROUP_GLSL = """#version 450
#extension GL_KHR_shader_subgroup_shuffle : require
layout(local_size_x = 8) in;
layout(std430, binding = 0) buffer B { float b[]; };
void main() { b[gl_LocalInvocationID.x] = subgroupShuffle(b[gl_LocalInvocationID.x], 0u); }
"""


def test_subgroup_variants_and_foreign_modules_are_refused_by_name(tmp_path):
    # the CPU-driver variants (subgroup register blocks) read their operands through texel views
    for kernel in ("matmul", "flash_attn"):
        sg = [v for v in registry.variants(kernel) if "_sg" in v]
        assert sg
        for variant in (sg[0], sg[-1]):  # an fp32 one and a 16-bit one
            with pytest.raises(SpirvError, match="texel-view kernels"):
                translate(registry.spirv(kernel, variant), (), "m")
    with pytest.raises(SpirvError, match="texel-view kernels"):
        translate(registry.spirv("softmax", "f32_tx"), (), "s")
    # a subgroup kernel without texel views is refused at its subgroup instruction
    glslc = shutil.which(os.environ.get("GLSLC", "glslc"))
    if glslc is not None:
        src, spv = tmp_path / "sg.comp", tmp_path / "sg.spv"
        src.write_text(SUBGROUP_GLSL)
        subprocess.run([glslc, "--target-env=vulkan1.1", str(src), "-o", str(spv)], check=True)
        with pytest.raises(SpirvError, match="subgroup"):
            translate(spv.read_bytes(), (), "sg")
    with pytest.raises(SpirvError, match="magic"):
        read_module(b"\0" * 40)
    with pytest.raises(SpirvError, match="not a SPIR-V module"):
        read_module(b"\0" * 6)


def test_a_cached_translation_is_the_translation_and_a_changed_translator_misses(tmp_path, monkeypatch):
    from helios.cuda_ptx import spirv_ptx

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = registry.spirv("softmax", "f32")
    fresh = translate(code, (0, 128), "s")
    assert spirv_ptx.translate_cached(code, (0, 128), "s") == fresh  # translated, then written
    (cached,) = (tmp_path / "helios" / "ptx").iterdir()
    assert spirv_ptx.translate_cached(code, (0, 128), "s") == fresh  # read back
    cached.write_text(cached.read_text().replace(".maxntid 128", ".maxntid 128 /* from the cache */"))
    assert "from the cache" in spirv_ptx.translate_cached(code, (0, 128), "s").ptx
    assert spirv_ptx.translate_cached(code, (0, 64), "s").block == (64, 1, 1)  # another key
    monkeypatch.setattr(spirv_ptx, "_translator_fingerprint", lambda: "an edited translator")
    spirv_ptx.translate_cached(code, (0, 128), "s")
    assert len(list((tmp_path / "helios" / "ptx").iterdir())) == 3  # not the old file


def test_the_wide_elementwise_paths_are_sixteen_byte_accesses(tmp_path):
    # bf16 ops 8 elements an invocation and copies 16 bytes an invocation (uvec4 views): one
    # ld.global.v4.u32 per operand and one st.global.v4.u32, where the one-element path has u16s
    for kernel, variant, spec, loads in (("ew_unary", "bf16", (0, 1, 8), 1), ("ew_binary", "bf16", (0, 1, 8), 2),
                                         ("copy", "bf16_bf16", (8,), 1), ("copy", "f32_f32", (4,), 1)):
        ptx = translate(registry.spirv(kernel, variant), spec, f"{kernel}_{variant}").ptx
        assert ptx.count("ld.global.v4.u32") == loads and ptx.count("st.global.v4.u32") == 1, (kernel, variant)
        if toolchain.find_tool("ptxas") is not None:
            _assemble_without_spills(kernel, variant, spec, tmp_path)


# The kernels that walk a shape and strides held in push constants (``p.shape[d]`` with d a register).
STRIDED = (("copy", "f32_bf16", (8,)), ("copy", "bf16_bf16", ()), ("ew_binary", "f32", ()), ("ew_unary", "bf16", ()),
           ("ew_where", "f32", ()), ("gather", "f32", ()))


@pytest.mark.parametrize("kernel, variant, spec", STRIDED)
def test_push_constants_indexed_by_a_register_stay_parameters(kernel, variant, spec, tmp_path):
    """A push-constant array indexed by a register is read by selects among its words, not through
    a per-thread copy of the parameters in .local memory (ptxas: no stack frame), which cost every
    thread of these memory-bound kernels ~100 bytes of local stores and loads."""
    ptx = translate(registry.spirv(kernel, variant), spec, f"{kernel}_{variant}").ptx
    assert ".local" not in ptx and "selp.b32" in ptx
    if toolchain.find_tool("ptxas") is not None:
        src = tmp_path / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([toolchain.require_tool("ptxas"), "-v", "-arch=sm_90", str(src), "-o", os.devnull],
                           capture_output=True, text=True)
        assert r.returncode == 0 and toolchain.parse_ptxas_log(r.stderr).stack_frame == 0, r.stderr


def test_strided_kernels_pick_each_dimension_s_shape_and_strides(emulated_cuda):
    """On the emulated cuda:0, the selects give every dimension its own extent and strides: an
    8-dim permuted copy with a cast, a 6-dim broadcast product, where() and gather over views."""
    import numpy as np

    import helios as hl
    from helios.runtime import set_device

    set_device("cuda:0")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 1, 2, 3, 2, 2, 3)).astype(np.float32)
    perm = (7, 0, 5, 3, 1, 6, 4, 2)
    t = hl.tensor(a).permute(*perm)
    np.testing.assert_array_equal(t.contiguous().numpy(), a.transpose(perm))
    np.testing.assert_array_equal(t.to(hl.bfloat16).float().numpy(), hl.tensor(a.transpose(perm)).to(hl.bfloat16).float().numpy())
    x = rng.standard_normal((3, 1, 4, 1, 5, 2)).astype(np.float32)
    y = rng.standard_normal((1, 2, 1, 3, 5, 1)).astype(np.float32)
    np.testing.assert_array_equal((hl.tensor(x) * hl.tensor(y)).numpy(), x * y)
    c = rng.standard_normal((4, 3, 5)) > 0
    xt = hl.tensor(x[:, 0, :, 0, :, 0]).transpose(0, 1)
    np.testing.assert_array_equal(hl.where(hl.tensor(c), xt, hl.tensor(-1.0)).numpy(),
                                  np.where(c, x[:, 0, :, 0, :, 0].transpose(1, 0, 2), np.float32(-1.0)))
    idx = rng.integers(0, 4, (3, 2, 5))
    np.testing.assert_array_equal(hl.gather(xt.transpose(0, 1), 1, hl.tensor(idx)).numpy(),
                                  np.take_along_axis(x[:, 0, :, 0, :, 0], idx, 1))


def _linear_on_cuda0(x, w, b) -> list[bytes]:
    """A Linear's output and its three gradients on cuda:0 (a device opened for this call)."""
    import numpy as np

    import helios as hl
    import helios.nn.functional as F
    from helios.runtime import close_device, set_device

    close_device("cuda:0")
    set_device("cuda:0")
    xs, ws, bs = (hl.tensor(v, requires_grad=True) for v in (x, w, b))
    y = F.linear(xs, ws, bs)
    (y * y).sum().backward()
    return [np.ascontiguousarray(t.numpy()).tobytes() for t in (y, xs.grad, ws.grad, bs.grad)]


@pytest.mark.skipif(specialize.spirv_opt() is None, reason="spirv-opt is not installed")
def test_unrolled_loops_leave_no_per_thread_arrays_and_compute_the_same_bits(emulated_cuda, monkeypatch):
    """matmul's GPU kernel marks its register-tile loops [[unroll]]: the translation unrolls them,
    so its accumulators are registers instead of per-thread .local memory, and the emulated cuda:0
    gives the loop form's bits (several tiles, ragged edges, the bias gradient's column sums)."""
    import numpy as np

    code, spec = registry.spirv("matmul", "f32"), (64, 64, 16, 16, 16, 0)
    assert specialize.has_unroll_loops(code) and not specialize.has_unroll_loops(registry.spirv("ew_binary", "f32"))
    assert ".local" not in translate(code, spec, "mm").ptx
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 70, 130), (67, 130), (67,)))
    monkeypatch.setattr(spirv_ptx, "translate_cached", lambda s, sp=(), name="k", target="sm_90": translate(s, sp, name, target))
    unrolled = _linear_on_cuda0(x, w, b)
    monkeypatch.setattr(spirv_ptx, "unrolled", lambda *a: None)  # the loops as they are
    assert ".local" in translate(code, spec, "mm").ptx
    assert _linear_on_cuda0(x, w, b) == unrolled
