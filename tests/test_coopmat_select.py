"""The cooperative-matrix kernel choice (helios/_kernels/coopmat.py) with device property lists
handed in at its seam: which kernel each kind of device gets and why, the tile it picks and
that the tile fits the kernel's rules; the HELIOS_DEBUG line; lavapipe keeps today's kernel."""

import io
import contextlib

import pytest

from helios._kernels import coopmat
from helios._kernels.coopmat import CoopShape, choose


def _shapes(*rows):
    return [CoopShape(m, n, k, a, b, c, r, scope) for m, n, k, a, b, c, r, scope in rows]


# As NVIDIA's Vulkan driver lists them (fp16 with both accumulators, three shapes; int8; bf16 absent).
NVIDIA = _shapes(*[(m, n, k, "f16", "f16", acc, acc, "subgroup") for m, n, k in ((16, 8, 8), (16, 8, 16), (16, 16, 16))
                   for acc in ("f16", "f32")], (16, 8, 32, "i8", "i8", "i32", "i32", "subgroup"))
# As RADV lists RDNA3's: 16x16x16 only.
AMD = _shapes((16, 16, 16, "f16", "f16", "f16", "f16", "subgroup"), (16, 16, 16, "f16", "f16", "f32", "f32", "subgroup"),
              (16, 16, 16, "i8", "i8", "i32", "i32", "subgroup"))
NO_FP32_SUMS = _shapes((16, 16, 16, "f16", "f16", "f16", "f16", "subgroup"), (16, 8, 16, "f16", "f16", "f16", "f16", "subgroup"))


def test_an_empty_list_keeps_the_shared_memory_kernel():
    ch = choose([], "float16", 4096, 4096, 4096, subgroup_size=8)
    assert ch.kernel == "matmul" and not ch.coopmat and "lists no cooperative-matrix" in ch.reason


def test_nvidia_like_list_takes_16x16x16_fp32_sums_and_the_large_tile():
    ch = choose(NVIDIA, "float16", 4096, 4096, 4096, subgroup_size=32, max_shared=49152)
    assert ch.kernel == "matmul_coop" and ch.coopmat
    t = ch.tile
    assert (t.shape.m, t.shape.n, t.shape.k, t.shape.c, t.shape.result) == (16, 16, 16, "f32", "f32")
    assert (t.bm, t.bn, t.bk, t.threads) == (128, 128, 32, 128)
    assert t.fits(49152) and t.shared_bytes() <= 49152
    assert "16x16x16 listed" in ch.reason
    # a product under 128 rows takes the small tile
    small = choose(NVIDIA, "float16", 64, 3072, 768, subgroup_size=32, max_shared=49152).tile
    assert (small.bm, small.bn) == (64, 64) and small.fits(49152)


def test_amd_like_list_with_wave64_subgroups():
    ch = choose(AMD, "float16", 1024, 1024, 1024, subgroup_size=64, max_shared=65536)
    assert ch.kernel == "matmul_coop"
    assert (ch.tile.shape.m, ch.tile.shape.n, ch.tile.shape.k) == (16, 16, 16) and ch.tile.threads == 256
    spec = ch.tile.spec(amode=1, bmode=2)
    assert len(spec) == 16 and spec[3] == 256 and spec[14:] == (1, 2)


def test_without_16x16x16_the_largest_listed_shape_that_fits():
    shapes = _shapes((8, 16, 16, "f16", "f16", "f32", "f32", "subgroup"), (8, 8, 16, "f16", "f16", "f32", "f32", "subgroup"),
                     (32, 32, 16, "f16", "f16", "f32", "f32", "workgroup"))  # workgroup scope: not this kernel's
    ch = choose(shapes, "float16", 512, 512, 512, subgroup_size=16, max_shared=65536)
    assert (ch.tile.shape.m, ch.tile.shape.n, ch.tile.shape.k) == (8, 16, 16)
    assert "largest listed shape" in ch.reason


def test_a_list_without_fp32_accumulation_keeps_the_shared_memory_kernel():
    ch = choose(NO_FP32_SUMS, "float16", 4096, 4096, 4096, subgroup_size=32)
    assert ch.kernel == "matmul" and "fp32 sums" in ch.reason and "16x16x16 f16*f16+f16" in ch.reason


def test_bf16_asked_but_not_offered():
    ch = choose(NVIDIA, "bfloat16", 4096, 4096, 4096, subgroup_size=32)
    assert ch.kernel == "matmul" and "no subgroup-scope bf16*bf16+f32 shape" in ch.reason


# As a driver with VK_KHR_shader_bfloat16 lists its shapes (the addon lists bf16 ones only where it
# can enable the extension's cooperative-matrix feature).
BF16 = NVIDIA + _shapes((16, 16, 16, "bf16", "bf16", "f32", "f32", "subgroup"), (16, 8, 16, "bf16", "bf16", "f32", "f32", "subgroup"))


def test_bf16_offered_takes_its_own_shape_and_variant():
    ch = choose(BF16, "bfloat16", 4096, 4096, 4096, subgroup_size=32)
    assert ch.kernel == "matmul_coop" and "bfloat16 operands, fp32 sums, 16x16x16 listed" in ch.reason
    assert (ch.tile.shape.a, ch.tile.shape.m, ch.tile.shape.n, ch.tile.shape.k) == ("bf16", 16, 16, 16)
    assert choose(BF16, "float16", 4096, 4096, 4096, subgroup_size=32).tile.shape.a == "f16"
    assert not choose(BF16, "bfloat16", 4096, 4096, 4096, subgroup_size=32, kernel_built=False).coopmat
    # bf16 products with fp16 or bf16 sums only are not this kernel's
    ch = choose(NVIDIA + _shapes((16, 16, 16, "bf16", "bf16", "bf16", "bf16", "subgroup")), "bfloat16", 4096, 4096, 4096,
                subgroup_size=32)
    assert not ch.coopmat and "16x16x16 bf16*bf16+bf16" in ch.reason


@pytest.mark.parametrize("dtype,M,N,built,reason", [
    ("float32", 4096, 4096, True, "takes float16"),
    ("float16", 8, 4096, True, "mostly padding"),
    ("float16", 4096, 4096, False, "not built"),
])
def test_other_reasons_to_keep_the_shared_memory_kernel(dtype, M, N, built, reason):
    ch = choose(NVIDIA, dtype, M, N, 64, subgroup_size=32, kernel_built=built)
    assert ch.kernel == "matmul" and reason in ch.reason


def test_a_tile_that_does_not_fit_shared_memory_is_refused():
    ch = choose(AMD, "float16", 4096, 4096, 4096, subgroup_size=32, max_shared=16384)
    assert ch.kernel == "matmul" and "no tile fits" in ch.reason


def test_load_modes_follow_strides_and_alignment():
    # nn: A K-contiguous, B N-contiguous; nt: B^T K-contiguous; tn: A^T M-contiguous
    assert coopmat.load_modes(64, 64, 64, (0, 0), (64, 1), (64, 1)) == (1, 2)
    assert coopmat.load_modes(64, 64, 64, (0, 0), (64, 1), (1, 64)) == (1, 1)
    assert coopmat.load_modes(64, 64, 64, (0, 0), (1, 64), (64, 1)) == (2, 2)
    # rows an odd number of elements apart (K = 63 contiguous) or an odd offset: one element a load
    assert coopmat.load_modes(64, 64, 63, (0, 0), (63, 1), (64, 1)) == (0, 2)
    assert coopmat.load_modes(64, 64, 64, (3, 0), (64, 1), (64, 1)) == (0, 2)
    # a ragged K, M or N with aligned rows (a padded stride): runs, the edge one element a load
    assert coopmat.load_modes(64, 64, 63, (0, 0), (64, 1), (64, 1)) == (1, 2)
    assert coopmat.load_modes(61, 59, 64, (0, 0), (1, 64), (64, 1)) == (2, 2)
    assert coopmat.load_modes(64, 64, 64, (0, 0), (64, 1, 4100), (64, 1, 0)) == (0, 2)  # batch stride off the grid


class _FakeRuntime:
    """A runtime as choice_for sees one: its name, HELIOS_DEBUG level and device facts."""

    def __init__(self, shapes, debug=1):
        self.name, self.debug = "vulkan:7", debug
        rows = [dict(m=s.m, n=s.n, k=s.k, a=s.a, b=s.b, c=s.c, result=s.result, scope=s.scope) for s in shapes]
        self.info = {"cooperative_matrix": rows, "limits": {"subgroup_size": 32, "max_shared_memory": 49152}}


def test_the_choice_is_one_debug_line_once_per_kind():
    rt = _FakeRuntime(NVIDIA)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for _ in range(3):
            ch = coopmat.choice_for(rt, "bfloat16", 512, 512, 512)
    assert ch.kernel == "matmul"
    lines = err.getvalue().splitlines()
    assert lines == ["helios: matmul bfloat16 on vulkan:7: matmul (shared-memory kernel): no subgroup-scope "
                     "bf16*bf16+f32 shape (fp32 sums) among those listed: " + ", ".join(sorted({s.label() for s in NVIDIA}))]
    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet):
        coopmat.choice_for(_FakeRuntime([], debug=1), "float16", 512, 512, 512)
        coopmat.choice_for(_FakeRuntime(NVIDIA, debug=0), "float32", 512, 512, 512)
    assert quiet.getvalue() == ""  # no list, no choice to tell; debug off, nothing printed


def test_choice_for_answers_per_size_and_dtype():
    rt = _FakeRuntime(NVIDIA, debug=0)
    big, small = coopmat.choice_for(rt, "float16", 4096, 4096, 4096), coopmat.choice_for(rt, "float16", 64, 4096, 64)
    if coopmat.kernel_built():
        assert (big.tile.bm, small.tile.bm) == (128, 64)
    assert coopmat.choice_for(rt, "float16", 8, 4096, 64).kernel == "matmul"
    assert coopmat.choice_for(rt, "float32", 4096, 4096, 4096).kernel == "matmul"
    assert coopmat.choice_for(_FakeRuntime([]), "float16", 4096, 4096, 4096).kernel == "matmul"


def test_set_enabled_switches_the_kernel_off_and_back():
    rt = _FakeRuntime(NVIDIA, debug=0)
    was = coopmat.set_enabled(False)
    try:
        ch = coopmat.choice_for(rt, "float16", 512, 512, 512)
        assert ch.kernel == "matmul" and "switched off" in ch.reason
    finally:
        coopmat.set_enabled(was)
    assert "switched off" not in coopmat.choice_for(rt, "float16", 512, 512, 512).reason


@pytest.mark.vulkan
def test_lavapipe_keeps_todays_kernels_and_their_bits():
    import numpy as np

    import helios as hl
    from helios import _kernels as K
    from helios.runtime import get_runtime

    rt = get_runtime()
    if rt.info.get("type") != "cpu":
        pytest.skip(f"{rt.name} is not a CPU driver: lavapipe's check")
    assert coopmat.shapes_of(rt.info) == [] and rt.info.get("cooperative_matrix", []) == []
    assert coopmat.choice_for(rt, "float16", 512, 512, 512).kernel == "matmul"
    rng = np.random.default_rng(5)
    a, b, bias = (rng.uniform(-1, 1, s).astype(np.float32) for s in ((40, 72), (48, 72), (48,)))
    for dtype in ("float32", "float16", "bfloat16"):
        ha, hb, hbias = (hl.tensor(x, dtype=dtype) for x in (a, b, bias))
        on = K.matmul(ha, hb.transpose(0, 1), hbias).numpy()
        was = coopmat.set_enabled(False)
        try:
            off = K.matmul(ha, hb.transpose(0, 1), hbias).numpy()
        finally:
            coopmat.set_enabled(was)
        assert on.tobytes() == off.tobytes(), dtype


@pytest.mark.vulkan
def test_lavapipe_runs_the_glsl_matmul_and_prints_no_choice_line():
    import os
    import subprocess
    import sys

    code = ("import numpy as np, helios as hl\n"
            "from helios.runtime import get_runtime\n"
            "rt = get_runtime()\n"
            "if rt.info.get('type') != 'cpu': raise SystemExit(3)\n"
            "a = hl.tensor(np.ones((32, 32), np.float32), dtype='float16')\n"
            "a @ a\n"
            "hl.synchronize()\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HELIOS_DEBUG="2"), capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 3:
        pytest.skip("not lavapipe")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("helios: matmul")]
    assert lines and all("matmul.comp" in x and "matmul_coop" not in x for x in lines), r.stderr[-2000:]
    assert "cooperative" not in r.stderr and "shared-memory kernel" not in r.stderr


def test_the_planned_subgroup_size_is_required_where_the_device_can_require_it():
    from types import SimpleNamespace

    def rt(lo, hi):
        return SimpleNamespace(info={"limits": {"subgroup_size": 32, "min_subgroup_size": lo, "max_subgroup_size": hi}})

    assert coopmat.required_subgroup(rt(16, 64), 32) == 32  # Intel-like: 8..32 or AMD-like 32..64 drivers pick per shader
    assert coopmat.required_subgroup(rt(32, 32), 32) == 32
    assert coopmat.required_subgroup(rt(16, 64), 128) == 0  # outside the range: the driver's (reported) size
    assert coopmat.required_subgroup(rt(0, 0), 32) == 0  # no subgroupSizeControl: the driver's size
    assert coopmat.required_subgroup(SimpleNamespace(info={}), 32) == 0
