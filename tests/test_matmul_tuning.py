"""Parity of every matmul load path (see kernels_spirv/glsl/matmul.comp and matmul() in
helios/_kernels/gemm.py): row-major and transposed operands read 8-wide, 4-wide or with scalar
loads, K tails, ragged M/N edges, offset views, broadcast batches, fp16/bf16 storage.

Which path a case takes is asserted through ``_mm_cpu_config`` (the CPU kernel's mode
picker), so a change in the picker cannot silently leave a path untested."""

import numpy as np
import pytest
from parity import check

import helios as hl
from helios import _kernels as K

pytestmark = pytest.mark.vulkan

R = np.random.default_rng(4321)
FLOATS = ["float32", "float16", "bfloat16"]


def rn(*shape):
    return R.uniform(-1.0, 1.0, size=shape).astype(np.float32)


def _scale(dtype, k):
    # fp32 sums of k products differ from torch's order by O(k) ulps
    return max(8.0, k / 8) if dtype == "float32" else 4.0


def _config(a, b):
    """The CPU kernel's (WY, AMODE, BMODE, CVEC, AWIDE, BWIDE) for helios views a, b (2-D)."""
    M, N = a.shape[-2], b.shape[-1]
    return K._mm_cpu_config(M, N, a._off, b._off, 0, [0, 0], [0, 0], a._strides[-2], a._strides[-1],
                            b._strides[-2], b._strides[-1], K._mm_cpu_tile(M, N, a.dtype))


# (name, A view, B view, M, K, N, expected (AMODE, AWIDE), (BMODE, BWIDE))
# Views build the operand from a stored array: "rm" row-major, "t" transposed view of the
# stored transpose, "pad" a column slice of a wider array (row stride 8-aligned, K ragged),
# "off1" a view starting one element in (misaligned offset).
CASES = [
    ("rm8_rm8", "rm", "rm", 16, 24, 32, (1, 1), (1, 1)),
    ("ragged_edges", "rm", "rm", 19, 40, 72, (1, 1), (1, 1)),
    ("ktail_pad", "pad", "rm", 9, 29, 16, (1, 1), (1, 1)),  # A row stride 40, K = 29: a K tail of 5
    ("rm4", "rm", "rm", 10, 20, 12, (1, 0), (1, 0)),
    ("odd_scalar", "rm", "rm", 7, 13, 5, (0, 0), (0, 0)),
    ("aT8_bT8", "t", "t", 24, 16, 17, (2, 1), (2, 1)),
    ("aT4_bT4", "t", "t", 12, 20, 9, (2, 0), (2, 0)),
    ("aT_ragged", "t", "rm", 13, 16, 8, (0, 0), (1, 1)),
    ("offset_views", "off1", "off1", 8, 16, 24, (0, 0), (0, 0)),
    ("gpt_like", "rm", "rm", 40, 64, 256, (1, 1), (1, 1)),
    # N >= 512 takes the 16-column block (8x16 variant) with ragged subgroup columns
    ("wide_tile", "rm", "rm", 20, 24, 520, (1, 1), (1, 1)),
    ("wide_tile_T", "t", "t", 16, 24, 516, (2, 1), (2, 1)),
]


def _make(kind, rows, cols):
    """(numpy array to upload, view fn) giving a rows x cols operand of the given layout."""
    if kind == "rm":
        return rn(rows, cols), None
    if kind == "t":
        return rn(cols, rows), lambda x: x.transpose(0, 1)
    if kind == "pad":
        w = (cols + 7) // 8 * 8 + 8
        return rn(rows, w), lambda x: x[:, :cols]
    if kind == "off1":
        return rn(rows, cols + 1), lambda x: x[:, 1:]
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matmul_paths(case, dtype):
    _, ka, kb, M, Kd, N, amode, bmode = case
    xa, va = _make(ka, M, Kd)
    xb, vb = _make(kb, Kd, N)
    ha, hb = hl.tensor(xa), hl.tensor(xb)
    ha, hb = (va(ha) if va else ha), (vb(hb) if vb else hb)
    cfg = _config(ha, hb)
    assert (cfg[1], cfg[4]) == amode and (cfg[2], cfg[5]) == bmode, f"picked {cfg}"
    # forward and both gradients (g @ B^T and A^T @ g exercise the transposed paths too)
    check(lambda L, a, b: a @ b, xa, xb, views=[va, vb], dtype=dtype, scale=_scale(dtype, Kd))


@pytest.mark.parametrize("dtype", FLOATS)
def test_matmul_batch_broadcast(dtype):
    # two batch dims with a broadcast one, each operand with its own batch strides
    check(lambda L, a, b: a @ b, rn(3, 1, 9, 16), rn(2, 16, 24), dtype=dtype, scale=_scale(dtype, 16))
    # batch stride not a multiple of 4 (5*7 = 35): falls back to scalar A loads
    check(lambda L, a, b: a @ b, rn(2, 5, 7), rn(2, 7, 8), dtype=dtype, scale=_scale(dtype, 7))


def test_matmul_batched_transposed_attention():
    # q @ k^T and p @ v on [B, H, T, D] views of [B, T, H, D] storage (the attention shapes)
    check(lambda L, q, k: q.permute(0, 2, 1, 3) @ k.permute(0, 2, 3, 1), rn(2, 16, 2, 8), rn(2, 16, 2, 8), scale=8)
    check(lambda L, p, v: p @ v.permute(0, 2, 1, 3), rn(2, 2, 16, 16), rn(2, 16, 2, 8), scale=8)


def test_matmul_larger_than_one_workgroup():
    # several workgroups in x and y with ragged edges on both, K with a tail of 7
    a, b = rn(133, 71), rn(71, 150)
    got = (hl.tensor(a) @ hl.tensor(b)).numpy()
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)


def test_matmul_vector_operands():
    check(lambda L, a, b: a @ b, rn(33), rn(33, 16), scale=8)
    check(lambda L, a, b: a @ b, rn(16, 33), rn(33), scale=8)


def test_tile_picker():
    assert K._mm_cpu_tile(1024, 1024) == (16, 8, 4)
    assert K._mm_cpu_tile(1024, 1024, hl.bfloat16) == (32, 8, 4)
    assert K._mm_cpu_tile(64, 100, hl.float16) == (32, 8, 2)
    assert K._mm_cpu_tile(40, 600) == (8, 16, 2)
    assert K._mm_cpu_tile(40, 100) == (8, 8, 2)
    K.gemm._MM_CPU_TILE, K.gemm._MM_CPU_WY = (32, 8), 2  # a forced block and height win
    try:
        assert K._mm_cpu_tile(1024, 1024) == (32, 8, 2)
    finally:
        K.gemm._MM_CPU_TILE = K.gemm._MM_CPU_WY = None


def test_mode_picker():
    # row-major A and B, 8-aligned: K-contiguous A, N-contiguous B
    cfg = K._mm_cpu_config(64, 64, 0, 0, 0, [0, 0], [0, 0], 64, 1, 64, 1)
    assert cfg[1:] == (1, 1, 1, 1, 1)
    # an offset that is not a multiple of 4 forces scalar loads for that operand only
    cfg = K._mm_cpu_config(64, 64, 2, 0, 0, [0, 0], [0, 0], 64, 1, 64, 1)
    assert (cfg[1], cfg[2]) == (0, 1)
    # a batch stride that is a multiple of 4 but not of 8 gives 4-wide loads, of neither scalar loads
    cfg = K._mm_cpu_config(64, 64, 0, 0, 0, [4, 0], [0, 0], 64, 1, 64, 1)
    assert (cfg[1], cfg[4]) == (1, 0)
    cfg = K._mm_cpu_config(64, 64, 0, 0, 0, [6, 0], [0, 0], 64, 1, 64, 1)
    assert cfg[1] == 0
    # transposed views: M-contiguous A needs M % width == 0, K-contiguous B any N
    cfg = K._mm_cpu_config(64, 62, 0, 0, 0, [0, 0], [0, 0], 1, 64, 1, 64)
    assert cfg[1:] == (2, 2, 0, 1, 1)
    assert K._mm_cpu_config(66, 8, 0, 0, 0, [0, 0], [0, 0], 1, 64, 8, 1)[1] == 0
    # C written as vec4 only when N % 4 == 0
    assert K._mm_cpu_config(8, 6, 0, 0, 0, [0, 0], [0, 0], 8, 1, 6, 1)[3] == 0


@pytest.mark.parametrize("tile", [(8, 8), (8, 16), (16, 8), (32, 8)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_forced_tiles(tile, dtype):
    # every compiled register block (bench/matmul.py --tiles sweeps them), 4 subgroups a workgroup
    K.gemm._MM_CPU_TILE, K.gemm._MM_CPU_WY = tile, 4
    try:
        check(lambda L, a, b: a @ b, rn(37, 24), rn(24, 70), dtype=dtype, scale=_scale(dtype, 24))
        check(lambda L, a, b: a.mT @ b, rn(20, 32), rn(20, 16), dtype=dtype, scale=_scale(dtype, 20))
    finally:
        K.gemm._MM_CPU_TILE = K.gemm._MM_CPU_WY = None
