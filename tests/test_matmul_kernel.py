"""The CPU matmul kernel's 32-row register block (``f*_sg32x8``, picked for outputs of 64
rows or more; see kernels_spirv/glsl/matmul.comp and _mm_cpu_tile in helios/_kernels/gemm.py):
every operand layout (nn, nt, tn, tt), 8-wide, 4-wide and scalar loads, ragged row and
column blocks, K tails, the bias epilogue and 16-bit storage, against numpy in float64.

Each case asserts the tile and load modes it runs, so a change in the pickers cannot move
a case off the path it is meant to cover."""

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K

pytestmark = pytest.mark.vulkan

R = np.random.default_rng(2026)


def _operand(rows, cols, transposed, dtype):
    """(helios view, the float64 values it holds): a row-major matrix or a transposed view."""
    x = R.uniform(-1.0, 1.0, size=(cols, rows) if transposed else (rows, cols)).astype(np.float32)
    t = hl.tensor(x, dtype=dtype)
    held = t.numpy().astype(np.float64)  # the values after rounding to the storage dtype
    return (t.mT, held.T) if transposed else (t, held)


def _modes(a, b, M, N):
    cfg = K._mm_cpu_config(M, N, a._off, b._off, 0, [0, 0], [0, 0], a._strides[-2], a._strides[-1],
                           b._strides[-2], b._strides[-1], K._mm_cpu_tile(M, N, a.dtype))
    return (cfg[1], cfg[4]), (cfg[2], cfg[5])


# (layout, M, K, N, expected (AMODE, AWIDE), (BMODE, BWIDE)); M >= 256 takes the 16x8 block (fp32).
# Ragged: M not a multiple of 16 leaves clamped rows, N not a multiple of 64 clamped lanes,
# K not a multiple of 8 a tail.
CASES = [
    ("nn", 288, 64, 128, (1, 1), (1, 1)),    # aligned, 8-wide loads of both
    ("nn", 262, 37, 72, (0, 0), (1, 1)),     # A rows of 37: scalar A loads, K tail of 5
    ("nn", 260, 20, 36, (1, 0), (1, 0)),     # 4-aligned rows: 4-wide loads
    ("tn", 264, 40, 64, (2, 1), (1, 1)),     # A^T @ B (the weight gradient X^T @ g)
    ("nt", 256, 48, 70, (1, 1), (2, 1)),     # A @ B^T (the input gradient g @ W^T)
    ("tt", 292, 24, 66, (2, 0), (2, 1)),    # M % 8 == 4: 4-wide transposed A
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}_{c[1]}x{c[2]}x{c[3]}" for c in CASES])
def test_sg_layouts(case):
    layout, M, Kd, N, amode, bmode = case
    a, xa = _operand(M, Kd, layout[0] == "t", "float32")
    b, xb = _operand(Kd, N, layout[1] == "t", "float32")
    assert K._mm_cpu_tile(M, N)[:2] == (16, 8)
    assert _modes(a, b, M, N) == (amode, bmode)
    got = (a @ b).numpy()
    np.testing.assert_allclose(got, xa @ xb, rtol=1e-5, atol=2e-5 * Kd ** 0.5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_sg32_16bit_storage(dtype, layout):
    # 16-bit operands are unpacked in registers and summed in fp32; C is rounded once
    M, Kd, N = 80, 40, 72
    a, xa = _operand(M, Kd, layout[0] == "t", dtype)
    b, xb = _operand(Kd, N, layout[1] == "t", dtype)
    assert K._mm_cpu_tile(M, N, a.dtype)[:2] == (32, 8)
    got = (a @ b).float().numpy()
    ulp = 2.0 ** -8 if dtype == "float16" else 2.0 ** -5  # a rounding step of the output near its max
    ref = xa @ xb
    np.testing.assert_allclose(got, ref, rtol=0, atol=ulp * np.abs(ref).max())


def test_sg32_bias_and_batch():
    # the bias epilogue on a Linear-shaped product ([B, T, C] @ [C, N] runs as one [B*T, C] @ [C, N])
    x = R.uniform(-1, 1, size=(3, 90, 48)).astype(np.float32)  # 270 rows: the 16x8 block
    w = R.uniform(-1, 1, size=(48, 72)).astype(np.float32)
    bias = R.uniform(-1, 1, size=(72,)).astype(np.float32)
    got = K.matmul(hl.tensor(x), hl.tensor(w), hl.tensor(bias)).numpy()
    ref = x.astype(np.float64) @ w + bias
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_tile_picker_rows():
    # fp32 (texel loads): 256 rows or more take the 16-row block, 64 rows a workgroup
    assert K._mm_cpu_tile(256, 64) == (16, 8, 4)
    assert K._mm_cpu_tile(255, 64) == (8, 8, 2)
    assert K._mm_cpu_tile(64, 600) == (8, 8, 2)
    assert K._mm_cpu_tile(4096, 4096) == (16, 8, 4)
    # 16-bit (storage-buffer loads): the 32-row block, 64 rows a workgroup, 128 from 512 rows
    assert K._mm_cpu_tile(64, 64, hl.bfloat16) == (32, 8, 2)
    assert K._mm_cpu_tile(256, 64, hl.float16) == (32, 8, 2)
    assert K._mm_cpu_tile(4096, 4096, hl.bfloat16) == (32, 8, 4)
    # fewer rows keep 8-row blocks
    assert K._mm_cpu_tile(63, 64) == (8, 8, 2)
    assert K._mm_cpu_tile(16, 1024) == (8, 16, 2)
