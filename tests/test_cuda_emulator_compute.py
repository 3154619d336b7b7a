"""The PTX emulator on general compute kernels, in the form the SPIR-V -> PTX translator writes.

Hand-written PTX (``.u64`` buffer parameters ``b0, b1, ...``, ``.u32`` words ``pc0, ...``,
``.maxntid X, Y, Z``, dynamic ``smem``, per-thread ``lmem``) runs on the vectorised
executor (``emulator.Grid``) and each result is compared with numpy.  No GPU needed.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helios.cuda_ptx import dtypes
from helios.cuda_ptx.emu.driver import EmulatedDriver
from helios.cuda_ptx.emu.state import EmulationError, GlobalMemory
from helios.cuda_ptx.emu.launch import emulate_kernel

# the numpy references overflow on purpose (f16 infinities, out-of-range casts)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

REGS = (".reg .pred %p<16>; .reg .b16 %h<64>; .reg .b32 %r<64>; .reg .f32 %f<64>; "
        ".reg .b64 %rd<64>; .reg .f64 %fd<64>;")

# the global linear thread id of a 1-D launch into %r1, and b0 + 4 * id into %rd1 .. b(n-1) into %rd(n)
GID_1D = """
  mov.u32 %r60, %tid.x;
  mov.u32 %r61, %ctaid.x;
  mov.u32 %r62, %ntid.x;
  mad.lo.s32 %r1, %r61, %r62, %r60;
"""


def kernel(body: str, bufs: int = 1, words: int = 0, block=(64, 1, 1), shared: bool = False, local: int = 0,
           name: str = "k") -> str:
    """PTX text in the translator's form around ``body``."""
    params = [f".param .u64 b{i}" for i in range(bufs)] + [f".param .u32 pc{i}" for i in range(words)]
    lines = [".version 8.0", ".target sm_90", ".address_size 64"]
    if shared:
        lines.append(".extern .shared .align 16 .b8 smem[];")
    lines += [f".visible .entry {name}({', '.join(params)})", ".maxntid {}, {}, {}".format(*block), "{"]
    if local:
        lines.append(f"  .local .align 16 .b8 lmem[{local}];")
    lines += ["  " + REGS, body, "}", ""]
    return "\n".join(lines)


def run(ptx: str, arrays: list[np.ndarray], block=(64, 1, 1), grid=(1, 1, 1), words=(), shared: int = 0):
    """Launch ``ptx`` with ``arrays`` as b0, b1, ... and ``words`` as pc0, ...; the arrays afterwards."""
    mem = GlobalMemory()
    ptrs = [mem.alloc_array(np.ascontiguousarray(a)) for a in arrays]
    params = {f"b{i}": p for i, p in enumerate(ptrs)} | {f"pc{i}": int(w) for i, w in enumerate(words)}
    emulate_kernel(ptx, block, shared, params, mem, grid)
    return [mem.view(p, a.nbytes).copy().view(a.dtype).reshape(a.shape) for p, a in zip(ptrs, arrays)]


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def elementwise(n_in: int, out_t: str, in_t: str, op: str, n: int) -> str:
    """out[i] = op(in0[i], ...) for i < n (pc0), one thread each: ``op`` is PTX using %x0.. -> %y."""
    size = {"b16": 2, "u16": 2, "u8": 1, "s8": 1, "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8,
            "s64": 8, "f64": 8}
    reg = {2: "%h", 1: "%r", 4: "%r", 8: "%rd"}
    ldt = {"f32": "f32", "f64": "f64"}
    body = [GID_1D, "  ld.param.u32 %r2, [pc0];", "  setp.ge.u32 %p1, %r1, %r2;", "  @%p1 bra $L_end;"]
    for i in range(n_in + 1):
        body.append(f"  ld.param.u64 %rd{20 + i}, [b{i}];")
    def regname(t, k):
        if t == "f32":
            return f"%f{k}"
        if t == "f64":
            return f"%fd{k}"
        return f"{reg[size[t]]}{k}"
    for i in range(n_in):
        sz = size[in_t]
        body.append(f"  mul.wide.u32 %rd10, %r1, {sz};")
        body.append(f"  add.s64 %rd11, %rd{20 + i}, %rd10;")
        body.append(f"  ld.global.{ldt.get(in_t, in_t)} {regname(in_t, 50 + i)}, [%rd11];")
    text = op
    for i in range(n_in):
        text = text.replace(f"%x{i}", regname(in_t, 50 + i))
    body.append(text.replace("%y", regname(out_t, 30)))
    sz = size[out_t]
    body.append(f"  mul.wide.u32 %rd10, %r1, {sz};")
    body.append(f"  add.s64 %rd11, %rd{20 + n_in}, %rd10;")
    body.append(f"  st.global.{out_t} [%rd11], {regname(out_t, 30)};")
    body += ["$L_end:", "  ret;"]
    return kernel("\n".join(body), bufs=n_in + 1, words=1)


def apply(op: str, out_t: str, in_t: str, *xs: np.ndarray, out_dtype=None) -> np.ndarray:
    """Run ``op`` elementwise over the inputs in blocks of 64 threads (ragged last block)."""
    n = xs[0].size
    out = np.zeros(n, out_dtype or {"f32": np.float32, "f64": np.float64, "s32": np.int32, "u32": np.uint32,
                                    "s64": np.int64, "u64": np.uint64, "b16": np.uint16, "u16": np.uint16,
                                    "b32": np.uint32, "b64": np.uint64}[out_t])
    ptx = elementwise(len(xs), out_t, in_t, op, n)
    res = run(ptx, [*xs, out], grid=((n + 63) // 64, 1, 1), words=(n,))
    return res[-1]


# -- a 3-D grid of 3-D blocks, a grid-stride loop and a ragged tail -------------------------------

STRIDED = """
  mov.u32 %r1, %tid.x;  mov.u32 %r2, %tid.y;  mov.u32 %r3, %tid.z;
  mov.u32 %r4, %ntid.x; mov.u32 %r5, %ntid.y; mov.u32 %r6, %ntid.z;
  mad.lo.s32 %r7, %r3, %r5, %r2;
  mad.lo.s32 %r7, %r7, %r4, %r1;            // thread's linear id in its block
  mov.u32 %r8, %ctaid.x; mov.u32 %r9, %ctaid.y; mov.u32 %r10, %ctaid.z;
  mov.u32 %r11, %nctaid.x; mov.u32 %r12, %nctaid.y; mov.u32 %r13, %nctaid.z;
  mad.lo.s32 %r14, %r10, %r12, %r9;
  mad.lo.s32 %r14, %r14, %r11, %r8;         // block's linear id in the grid
  mul.lo.s32 %r15, %r4, %r5;
  mul.lo.s32 %r15, %r15, %r6;               // threads per block
  mad.lo.s32 %r16, %r14, %r15, %r7;         // i
  mul.lo.s32 %r17, %r11, %r12;
  mul.lo.s32 %r17, %r17, %r13;
  mul.lo.s32 %r17, %r17, %r15;              // stride: every thread of the grid
  ld.param.u32 %r18, [pc0];
  ld.param.u64 %rd1, [b0];
  ld.param.u64 %rd2, [b1];
$L_head:
  setp.ge.u32 %p1, %r16, %r18;
  @%p1 bra $L_end;
  mul.wide.u32 %rd3, %r16, 4;
  add.s64 %rd4, %rd1, %rd3;
  ld.global.f32 %f1, [%rd4];
  cvt.rn.f32.u32 %f2, %r16;
  fma.rn.f32 %f3, %f1, 0f40000000, %f2;     // 2 x + i
  add.s64 %rd5, %rd2, %rd3;
  st.global.f32 [%rd5], %f3;
  add.s32 %r16, %r16, %r17;
  bra.uni $L_head;
$L_end:
  ret;
"""


def test_strided_elementwise_over_a_3d_grid_of_3d_blocks_with_a_ragged_tail():
    block, grid = (8, 4, 2), (3, 2, 2)  # 768 threads for 1000 elements: some take two turns, the tail none
    n = 1000
    x = np.random.default_rng(0).standard_normal(n + 24).astype(np.float32)
    out = np.full(n + 24, -7.0, np.float32)  # past n stays untouched
    _, got = run(kernel(STRIDED, bufs=2, words=1, block=block), [x, out], block=block, grid=grid, words=(n,))
    want = out.copy()
    want[:n] = 2 * x[:n] + np.arange(n, dtype=np.float32)
    np.testing.assert_array_equal(got, want)


def test_a_launch_with_grid_z_above_one_runs_every_z_slice():
    # each CTA writes its (x, y, z) into its own slot
    body = """
  mov.u32 %r1, %ctaid.x; mov.u32 %r2, %ctaid.y; mov.u32 %r3, %ctaid.z;
  mov.u32 %r4, %nctaid.x; mov.u32 %r5, %nctaid.y;
  mad.lo.s32 %r6, %r3, %r5, %r2;
  mad.lo.s32 %r6, %r6, %r4, %r1;
  mov.u32 %r7, %tid.x;
  setp.ne.u32 %p1, %r7, 0;
  @%p1 bra $L_end;
  shl.b32 %r8, %r3, 16;
  shl.b32 %r9, %r2, 8;
  or.b32 %r8, %r8, %r9;
  or.b32 %r8, %r8, %r1;
  ld.param.u64 %rd1, [b0];
  mul.wide.u32 %rd2, %r6, 4;
  add.s64 %rd3, %rd1, %rd2;
  st.global.u32 [%rd3], %r8;
$L_end:
  ret;
"""
    grid = (2, 3, 4)
    (got,) = run(kernel(body, block=(32, 1, 1)), [np.zeros(24, np.uint32)], block=(32, 1, 1), grid=grid)
    z, y, x = np.meshgrid(range(4), range(3), range(2), indexing="ij")
    np.testing.assert_array_equal(got, ((z << 16) | (y << 8) | x).reshape(-1).astype(np.uint32))


# -- cvt against numpy on edge values --------------------------------------------------------------

EDGES = f32([np.nan, np.inf, -np.inf, -0.0, 0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 2.0**31,
             -2.0**31, 2.0**32, 3e9, -3e9, 1e-45, -1e-45, 123.75, -123.75, 255.5, 256.0, 65535.5, 1e20, -1e20,
             2.0**63, 2.0**64, -2.0**63])

ROUND = {"rzi": np.trunc, "rni": np.rint, "rmi": np.floor, "rpi": np.ceil}


def _saturate(r: np.ndarray, dtype) -> np.ndarray:
    """PTX float -> integer saturation in exact Python arithmetic: NaN -> 0, else clamped."""
    info = np.iinfo(dtype)
    out = [0 if np.isnan(v) else int(info.max) if v >= info.max else int(info.min) if v <= info.min else int(v)
           for v in r.astype(np.float64).tolist()]
    return np.array(out, dtype=object).astype(dtype)


@pytest.mark.parametrize("mode", sorted(ROUND))
@pytest.mark.parametrize("dst", ["s32", "u32", "s64", "u64"])
def test_cvt_float_to_integer_rounds_and_saturates_as_ptx_says(mode, dst):
    dtype = {"s32": np.int32, "u32": np.uint32, "s64": np.int64, "u64": np.uint64}[dst]
    got = apply(f"  cvt.{mode}.{dst}.f32 %y, %x0;", dst, "f32", EDGES)
    np.testing.assert_array_equal(got, _saturate(ROUND[mode](EDGES.astype(np.float64)), dtype))


def test_cvt_float_to_narrow_integers_saturates_to_their_range():
    got = apply("  cvt.rni.s8.f32 %h30, %x0;\n  cvt.u32.s8 %y, %h30;", "u32", "f32", EDGES)
    want = _saturate(np.rint(EDGES.astype(np.float64)), np.int8).astype(np.int32).view(np.uint32)
    np.testing.assert_array_equal(got, want)
    got = apply("  cvt.rzi.u16.f32 %h30, %x0;\n  cvt.u32.u16 %y, %h30;", "u32", "f32", EDGES)
    np.testing.assert_array_equal(got, _saturate(np.trunc(EDGES.astype(np.float64)), np.uint16).astype(np.uint32))


@pytest.mark.parametrize("mode", sorted(ROUND))
def test_cvt_float_to_integral_float_in_the_same_type(mode):
    got = apply(f"  cvt.{mode}.f32.f32 %y, %x0;", "f32", "f32", EDGES)
    np.testing.assert_array_equal(got, ROUND[mode](EDGES))
    d = EDGES.astype(np.float64) + 0.25
    got = apply(f"  cvt.{mode}.f64.f64 %y, %x0;", "f64", "f64", d)
    np.testing.assert_array_equal(got, ROUND[mode](d))


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 by integer arithmetic on the bits (NaN handled by the caller)."""
    b = x.view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


HALF_EDGES = f32([2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-25 * 1.0001, 5 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-24,
                  65504, 65519.99, 65520, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8,
                  -(1 + 2.0**-8), 1e-40, -1e-40, 2.0**-133, 3e38, -0.0, np.inf, -np.inf])


def test_cvt_f32_to_f16_and_bf16_round_to_nearest_even_through_subnormals():
    got16 = apply("  cvt.rn.f16.f32 %h30, %x0;\n  mov.b16 %y, %h30;", "b16", "f32", HALF_EDGES)
    np.testing.assert_array_equal(got16, HALF_EDGES.astype(np.float16).view(np.uint16))
    gotbf = apply("  cvt.rn.bf16.f32 %h30, %x0;\n  mov.b16 %y, %h30;", "b16", "f32", HALF_EDGES)
    np.testing.assert_array_equal(gotbf, _bf16_reference(HALF_EDGES))
    nan = apply("  cvt.rn.bf16.f32 %h30, %x0;\n  cvt.f32.bf16 %y, %h30;", "f32", "f32", f32([np.nan, 1.0]))
    assert np.isnan(nan[0]) and nan[1] == 1.0


def test_cvt_f64_to_bf16_and_f16_round_once():
    # 1 + 2^-8 + 2^-30 lies just above the bf16 halfway point 1 + 2^-8: one rounding gives
    # 1 + 2^-7; rounding to f32 first lands on the halfway point, which then rounds to 1
    d = np.array([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-8, 1 + 3 * 2.0**-8 - 2.0**-40, -(1 + 2.0**-8 + 2.0**-31),
                  1 + 2.0**-11 + 2.0**-40, 2.0**-133 * 1.5, 2.0**-135, np.inf], np.float64)
    got = apply("  cvt.rn.bf16.f64 %h30, %x0;\n  mov.b16 %y, %h30;", "b16", "f64", d)
    np.testing.assert_array_equal(dtypes.bf16_bits_to_f32(got).astype(np.float64),
                                  [1 + 2.0**-7, 1.0, 1 + 2.0**-7, -(1 + 2.0**-7), 1.0, 2.0**-132, 0.0, np.inf])
    got = apply("  cvt.rn.f16.f64 %h30, %x0;\n  mov.b16 %y, %h30;", "b16", "f64", d)
    np.testing.assert_array_equal(got.view(np.float16).astype(np.float64)[4], 1 + 2.0**-10)


def test_cvt_f16_and_bf16_to_f32_are_exact_subnormals_included():
    h = np.arange(0, 65536, 37, dtype=np.uint16)
    got = apply("  cvt.f32.f16 %y, %x0;", "f32", "b16", h)
    want = h.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    got = apply("  cvt.f32.bf16 %y, %x0;", "f32", "b16", h)
    want = dtypes.bf16_bits_to_f32(h)
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


def test_cvt_between_integers_and_floats():
    ints = np.array([0, 1, -1, 2**24 + 1, 2**24 + 3, 2**31 - 1, -2**31, 123456789, -7], np.int32)
    np.testing.assert_array_equal(apply("  cvt.rn.f32.s32 %y, %x0;", "f32", "s32", ints), ints.astype(np.float32))
    u = ints.view(np.uint32)
    np.testing.assert_array_equal(apply("  cvt.rn.f32.u32 %y, %x0;", "f32", "u32", u), u.astype(np.float32))
    np.testing.assert_array_equal(apply("  cvt.rn.f64.s32 %y, %x0;", "f64", "s32", ints), ints.astype(np.float64))
    np.testing.assert_array_equal(apply("  cvt.rn.f16.s32 %h30, %x0;\n  mov.b16 %y, %h30;", "b16", "s32", ints),
                                  ints.astype(np.float64).astype(np.float16).view(np.uint16))
    d = np.array([0.1, -1e300, 1e-300, 3.4028235e38 * 1.0000001, np.pi, -0.0], np.float64)
    np.testing.assert_array_equal(apply("  cvt.rn.f32.f64 %y, %x0;", "f32", "f64", d), d.astype(np.float32))
    np.testing.assert_array_equal(apply("  cvt.f64.f32 %y, %x0;", "f64", "f32", EDGES), EDGES.astype(np.float64))


def test_cvt_between_integers_truncates_and_extends():
    w = np.array([0, 1, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 0x12345678, 0x000000FF, 0x00000080], np.uint32)
    np.testing.assert_array_equal(apply("  cvt.s64.s32 %y, %x0;", "s64", "u32", w), w.view(np.int32).astype(np.int64))
    np.testing.assert_array_equal(apply("  cvt.u64.u32 %y, %x0;", "u64", "u32", w), w.astype(np.uint64))
    np.testing.assert_array_equal(apply("  cvt.s32.s8 %y, %x0;", "s32", "u32", w),
                                  (w & 0xFF).astype(np.uint8).view(np.int8).astype(np.int32))
    np.testing.assert_array_equal(apply("  cvt.u32.u16 %y, %x0;", "u32", "u32", w), w & 0xFFFF)
    q = np.array([0, 2**40 + 5, 2**64 - 1, 2**63, 0xFFFFFFFF00000001], np.uint64)
    np.testing.assert_array_equal(apply("  cvt.u32.u64 %y, %x0;", "u32", "u64", q), (q & 0xFFFFFFFF).astype(np.uint32))


# -- comparisons, selects, min/max ----------------------------------------------------------------------

PAIRS_A = f32([1, 2, np.nan, 1, np.nan, -0.0, np.inf, -np.inf, 3])
PAIRS_B = f32([2, 2, 1, np.nan, np.nan, 0.0, np.inf, 1, -3])


def _cmp_reference(cmp: str, a, b):
    nan = np.isnan(a) | np.isnan(b)
    base = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}
    if cmp in base:
        return base[cmp] & ~nan
    if cmp == "num":
        return ~nan
    if cmp == "nan":
        return nan
    return base[cmp[:2]] | nan  # the unordered forms


@pytest.mark.parametrize("cmp", ["eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu",
                                 "num", "nan"])
def test_setp_ordered_and_unordered_comparisons_with_nan(cmp):
    got = apply(f"  setp.{cmp}.f32 %p2, %x0, %x1;\n  selp.u32 %y, 1, 0, %p2;", "u32", "f32", PAIRS_A, PAIRS_B)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got, _cmp_reference(cmp, PAIRS_A, PAIRS_B).astype(np.uint32))


def test_setp_unsigned_and_signed_integer_comparisons():
    a = np.array([0, 1, 0xFFFFFFFF, 5, 0x80000000], np.uint32)
    b = np.array([1, 1, 1, 0xFFFFFFFF, 0x7FFFFFFF], np.uint32)
    for cmp, fn in {"lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}.items():
        got = apply(f"  setp.{cmp}.u32 %p2, %x0, %x1;\n  selp.u32 %y, 1, 0, %p2;", "u32", "u32", a, b)
        np.testing.assert_array_equal(got, fn(a, b).astype(np.uint32))
    got = apply("  setp.lt.s32 %p2, %x0, %x1;\n  selp.u32 %y, 1, 0, %p2;", "u32", "u32", a, b)
    np.testing.assert_array_equal(got, (a.view(np.int32) < b.view(np.int32)).astype(np.uint32))


def test_min_and_max_return_the_operand_that_is_not_nan():
    for op, fn in (("min", np.fmin), ("max", np.fmax)):
        got = apply(f"  {op}.f32 %y, %x0, %x1;", "f32", "f32", PAIRS_A, PAIRS_B)
        want = fn(PAIRS_A, PAIRS_B)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
        assert np.isnan(got).sum() == 1  # only NaN with NaN gives NaN


def test_predicate_logic_and_negated_guards():
    a = np.arange(16, dtype=np.uint32)
    op = """  setp.lt.u32 %p2, %x0, 8;
  and.b32 %r40, %x0, 1;
  setp.eq.u32 %p3, %r40, 1;
  xor.pred %p4, %p2, %p3;
  not.pred %p5, %p4;
  or.pred %p6, %p5, %p2;
  mov.u32 %y, 0;
  @!%p6 mov.u32 %y, 7;
  @%p4 add.u32 %y, %y, 100;"""
    lt, odd = a < 8, (a & 1) == 1
    x = lt ^ odd
    want = np.where(~(~x | lt), 7, 0) + np.where(x, 100, 0)
    np.testing.assert_array_equal(apply(op, "u32", "u32", a), want.astype(np.uint32))


# -- integer arithmetic --------------------------------------------------------------------------------

U32 = np.array([0, 1, 2, 3, 7, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF, 12345, 0x00F0F000], np.uint32)
V32 = np.array([1, 0, 3, 0xFFFFFFFF, 2, 2, 0xFFFFFFFF, 16, 0x10001, 0, 33], np.uint32)


def test_integer_multiply_high_wide_and_64_bit_products():
    a, b = U32.astype(object), V32.astype(object)
    sa = U32.view(np.int32).astype(object)
    sb = V32.view(np.int32).astype(object)
    np.testing.assert_array_equal(apply("  mul.hi.u32 %y, %x0, %x1;", "u32", "u32", U32, V32),
                                  np.array([(x * y) >> 32 for x, y in zip(a, b)], np.uint64).astype(np.uint32))
    np.testing.assert_array_equal(apply("  mul.hi.s32 %y, %x0, %x1;", "s32", "s32", U32.view(np.int32),
                                        V32.view(np.int32)),
                                  np.array([(x * y) >> 32 for x, y in zip(sa, sb)], np.int64).astype(np.int32))
    np.testing.assert_array_equal(apply("  mul.wide.s32 %y, %x0, %x1;", "s64", "s32", U32.view(np.int32),
                                        V32.view(np.int32)),
                                  np.array([x * y for x, y in zip(sa, sb)], np.int64))
    np.testing.assert_array_equal(apply("  mul.wide.u32 %y, %x0, %x1;", "u64", "u32", U32, V32),
                                  np.array([x * y for x, y in zip(a, b)], np.uint64))
    big = np.array([0, 1, 2**64 - 1, 2**63, 0xDEADBEEFCAFEF00D, 3, 2**32 + 7], np.uint64)
    other = np.array([5, 2**64 - 1, 2**64 - 1, 2, 0x123456789ABCDEF, 2**63 + 1, 2**32 - 1], np.uint64)
    ba, bb = big.astype(object), other.astype(object)
    np.testing.assert_array_equal(apply("  mul.hi.u64 %y, %x0, %x1;", "u64", "u64", big, other),
                                  np.array([(x * y) >> 64 for x, y in zip(ba, bb)], dtype=object).astype(np.uint64))
    sba = big.view(np.int64).astype(object)
    sbb = other.view(np.int64).astype(object)
    want = np.array([((x * y) >> 64) & (2**64 - 1) for x, y in zip(sba, sbb)], dtype=object).astype(np.uint64)
    np.testing.assert_array_equal(apply("  mul.hi.s64 %y, %x0, %x1;", "u64", "u64", big, other), want)
    np.testing.assert_array_equal(apply("  mul.lo.s64 %y, %x0, %x1;", "u64", "u64", big, other), big * other)
    np.testing.assert_array_equal(apply("  mad.lo.s32 %y, %x0, %x1, 5;", "u32", "u32", U32, V32), U32 * V32 + 5)


def test_division_by_zero_gives_all_ones_and_signed_division_truncates():
    np.testing.assert_array_equal(apply("  div.u32 %y, %x0, %x1;", "u32", "u32", U32, V32),
                                  np.where(V32 == 0, 0xFFFFFFFF, U32 // np.maximum(V32, 1)).astype(np.uint32))
    np.testing.assert_array_equal(apply("  rem.u32 %y, %x0, %x1;", "u32", "u32", U32, V32),
                                  np.where(V32 == 0, 0xFFFFFFFF, U32 % np.maximum(V32, 1)).astype(np.uint32))
    a = np.array([7, -7, 7, -7, 0, -2**31 + 1], np.int32)
    b = np.array([2, 2, -2, -2, 3, 7], np.int32)
    np.testing.assert_array_equal(apply("  div.s32 %y, %x0, %x1;", "s32", "s32", a, b), [3, -3, -3, 3, 0, -306783378])
    np.testing.assert_array_equal(apply("  rem.s32 %y, %x0, %x1;", "s32", "s32", a, b), [1, -1, 1, -1, 0, -1])


def _bits_ref(fn, xs, width=32):
    return np.array([fn(int(x), width) for x in xs], np.uint64)


def test_bit_manipulation_matches_a_reference():
    popc = _bits_ref(lambda x, w: bin(x).count("1"), U32).astype(np.uint32)
    np.testing.assert_array_equal(apply("  popc.b32 %y, %x0;", "u32", "u32", U32), popc)
    clz = _bits_ref(lambda x, w: w - x.bit_length(), U32).astype(np.uint32)
    np.testing.assert_array_equal(apply("  clz.b32 %y, %x0;", "u32", "u32", U32), clz)
    brev = _bits_ref(lambda x, w: int(f"{x:032b}"[::-1], 2), U32).astype(np.uint32)
    np.testing.assert_array_equal(apply("  brev.b32 %y, %x0;", "u32", "u32", U32), brev)
    q = np.array([0, 1, 2**64 - 1, 0x00F0000000000000], np.uint64)
    np.testing.assert_array_equal(apply("  clz.b64 %r30, %x0;\n  cvt.u64.u32 %y, %r30;", "u64", "u64", q),
                                  [64, 63, 0, 8])
    np.testing.assert_array_equal(apply("  popc.b64 %r30, %x0;\n  cvt.u64.u32 %y, %r30;", "u64", "u64", q),
                                  [0, 1, 64, 4])
    # bfe: a field at (pos, len) zero- (u) or sign-extended (s); len 0 gives 0, fields past bit 31 stop there
    pos = np.array([0, 4, 8, 28, 31, 0, 40, 4], np.uint32)
    ln = np.array([8, 8, 0, 8, 1, 32, 4, 28], np.uint32)
    a = np.full(pos.size, 0xF00DBEEF, np.uint32)

    def bfe(x, p, n, signed):
        if n == 0:
            return 0
        bits = [(x >> min(p + i, 31)) & 1 if p + i <= 31 else None for i in range(32)]
        sbit = (x >> min(p + n - 1, 31)) & 1 if signed else 0
        return sum(((bits[i] if i < n and bits[i] is not None else sbit) << i) for i in range(32))

    body = [GID_1D, "  ld.param.u64 %rd20, [b0];", "  ld.param.u64 %rd21, [b1];", "  ld.param.u64 %rd22, [b2];",
            "  ld.param.u64 %rd23, [b3];", "  ld.param.u64 %rd24, [b4];", "  mul.wide.u32 %rd10, %r1, 4;"]
    for i in range(3):
        body += [f"  add.s64 %rd11, %rd{20 + i}, %rd10;", f"  ld.global.u32 %r{10 + i}, [%rd11];"]
    body += ["  bfe.u32 %r20, %r10, %r11, %r12;", "  bfe.s32 %r21, %r10, %r11, %r12;",
             "  add.s64 %rd11, %rd23, %rd10;", "  st.global.u32 [%rd11], %r20;",
             "  add.s64 %rd11, %rd24, %rd10;", "  st.global.u32 [%rd11], %r21;", "  ret;"]
    outs = run(kernel("\n".join(body), bufs=5, block=(8, 1, 1)), [a, pos, ln, np.zeros(8, np.uint32),
                                                                  np.zeros(8, np.uint32)], block=(8, 1, 1))
    np.testing.assert_array_equal(outs[3], [bfe(int(x), int(p), int(n), False) for x, p, n in zip(a, pos, ln)])
    np.testing.assert_array_equal(outs[4], [bfe(int(x), int(p), int(n), True) for x, p, n in zip(a, pos, ln)])
    # bfi: the low len bits of f replace bits pos.. of b
    f = np.full(8, 0xABCD, np.uint32)
    body = body[:7]
    for i in range(3):
        body += [f"  add.s64 %rd11, %rd{20 + i}, %rd10;", f"  ld.global.u32 %r{10 + i}, [%rd11];"]
    body += ["  bfi.b32 %r20, %r10, 0xFFFFFFFF, %r11, %r12;", "  add.s64 %rd11, %rd23, %rd10;",
             "  st.global.u32 [%rd11], %r20;", "  ret;"]
    outs = run(kernel("\n".join(body), bufs=5, block=(8, 1, 1)), [f, pos, ln, np.zeros(8, np.uint32),
                                                                  np.zeros(8, np.uint32)], block=(8, 1, 1))

    def bfi(fv, p, n):
        d = 0xFFFFFFFF
        for i in range(n):
            if p + i > 31:
                break
            d = (d & ~(1 << (p + i))) | (((fv >> i) & 1) << (p + i))
        return d & 0xFFFFFFFF

    np.testing.assert_array_equal(outs[3], [bfi(int(x), int(p), int(n)) for x, p, n in zip(f, pos, ln)])


def test_shifts_saturate_past_the_width_and_shr_s_is_arithmetic():
    s = np.array([0, 1, 31, 32, 33, 200, 4, 16, 0, 3, 31], np.uint32)
    np.testing.assert_array_equal(apply("  shl.b32 %y, %x0, %x1;", "u32", "u32", U32, s),
                                  np.where(s >= 32, 0, (U32.astype(np.uint64) << np.minimum(s, 31)) & 0xFFFFFFFF))
    np.testing.assert_array_equal(apply("  shr.u32 %y, %x0, %x1;", "u32", "u32", U32, s),
                                  np.where(s >= 32, 0, U32 >> np.minimum(s, 31)).astype(np.uint32))
    np.testing.assert_array_equal(apply("  shr.s32 %y, %x0, %x1;", "s32", "s32", U32.view(np.int32),
                                        s.view(np.int32)),
                                  U32.view(np.int32) >> np.minimum(s, 31).astype(np.int32))
    np.testing.assert_array_equal(apply("  neg.s32 %y, %x0;", "s32", "s32", U32.view(np.int32)),
                                  (-U32.astype(np.int64)).astype(np.uint32).view(np.int32))


# -- floating point ------------------------------------------------------------------------------------

def test_f32_arithmetic_and_the_approximate_functions():
    rng = np.random.default_rng(5)
    a = rng.standard_normal(200).astype(np.float32) * 3
    b = rng.standard_normal(200).astype(np.float32) + 0.1
    c = rng.standard_normal(200).astype(np.float32)
    np.testing.assert_array_equal(apply("  add.rn.f32 %y, %x0, %x1;", "f32", "f32", a, b), a + b)
    np.testing.assert_array_equal(apply("  sub.rn.f32 %y, %x0, %x1;", "f32", "f32", a, b), a - b)
    np.testing.assert_array_equal(apply("  mul.rn.f32 %y, %x0, %x1;", "f32", "f32", a, b), a * b)
    np.testing.assert_array_equal(apply("  div.rn.f32 %y, %x0, %x1;", "f32", "f32", a, b), a / b)
    fma = (a.astype(np.float64) * b + c).astype(np.float32)
    np.testing.assert_array_equal(apply("  fma.rn.f32 %y, %x0, %x1, %x2;", "f32", "f32", a, b, c), fma)
    pos = np.abs(a) + 0.01
    np.testing.assert_array_equal(apply("  sqrt.rn.f32 %y, %x0;", "f32", "f32", pos), np.sqrt(pos))
    for op, fn in (("rsqrt.approx", lambda x: 1 / np.sqrt(x)), ("rcp.approx", lambda x: 1 / x),
                   ("ex2.approx", np.exp2), ("lg2.approx", np.log2), ("sin.approx", np.sin),
                   ("cos.approx", np.cos), ("tanh.approx", np.tanh), ("div.full", None)):
        if fn is None:
            got = apply(f"  {op}.f32 %y, %x0, %x1;", "f32", "f32", pos, b)
            np.testing.assert_allclose(got, pos / b, rtol=2e-6)
            continue
        x = pos if op.startswith(("rsqrt", "lg2")) else a
        got = apply(f"  {op}.ftz.f32 %y, %x0;", "f32", "f32", x)
        np.testing.assert_allclose(got, fn(x.astype(np.float64)), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(apply("  copysign.f32 %y, %x0, %x1;", "f32", "f32", a, b), np.copysign(b, a))
    np.testing.assert_array_equal(apply("  abs.f32 %y, %x0;", "f32", "f32", a), np.abs(a))
    np.testing.assert_array_equal(apply("  neg.f32 %y, %x0;", "f32", "f32", a), -a)
    d = a.astype(np.float64) / 3
    np.testing.assert_array_equal(apply("  mul.rn.f64 %y, %x0, 0d4008000000000000;", "f64", "f64", d), d * 3.0)


def test_ftz_flushes_subnormals_and_testp_classifies():
    x = f32([1e-40, -1e-40, 1.0, 0.0, np.nan, np.inf, -np.inf, 2.0**-126])
    got = apply("  mul.ftz.f32 %y, %x0, 0f3F800000;", "f32", "f32", x)
    assert got[0] == 0 and np.signbit(got[1]) and got[1] == 0 and got[2] == 1 and got[7] == 2.0**-126
    for kind, fn in (("nan", np.isnan), ("infinite", np.isinf), ("finite", np.isfinite)):
        got = apply(f"  testp.{kind}.f32 %p2, %x0;\n  selp.u32 %y, 1, 0, %p2;", "u32", "f32", x)
        np.testing.assert_array_equal(got, fn(x).astype(np.uint32))


def test_mov_bitcasts_packs_and_unpacks():
    w = np.array([0x3F800000, 0xC0490FDB, 0x00000001, 0xFFFF0000], np.uint32)
    got = apply("  mov.b32 %f40, %x0;\n  add.f32 %f40, %f40, 0f3F800000;\n  mov.b32 %y, %f40;", "u32", "u32", w)
    np.testing.assert_array_equal(got, (w.view(np.float32) + np.float32(1)).view(np.uint32))
    got = apply("  mov.b32 {%h1, %h2}, %x0;\n  mov.b32 %y, {%h2, %h1};", "u32", "u32", w)  # swap the halves
    np.testing.assert_array_equal(got, (w >> 16) | ((w & 0xFFFF) << 16))
    got = apply("  mov.b64 %rd30, {%x0, %x0};\n  xor.b64 %y, %rd30, 0;", "u64", "u32", w)
    np.testing.assert_array_equal(got, w.astype(np.uint64) | (w.astype(np.uint64) << 32))
    got = apply("  mov.u32 %y, 0f40490FDB;\n  mov.f32 %f41, 0f3F800000;\n  mov.b32 %r41, %f41;\n"
                "  add.u32 %y, %y, %r41;", "u32", "u32", w)
    np.testing.assert_array_equal(got, np.full(4, 0x40490FDB + 0x3F800000, np.uint32))
    q = np.array([0x0123456789ABCDEF], np.uint64)
    got = apply("  mov.b64 {%r41, %r42}, %x0;\n  mov.b64 %y, {%r42, %r41};", "u64", "u64", q)
    np.testing.assert_array_equal(got, [0x89ABCDEF01234567])


# -- memory: bytes and halves, 64-bit addresses, vectors, local arrays -----------------------------------

def test_u8_and_u16_loads_extend_and_stores_keep_the_low_bits():
    body = GID_1D + """
  ld.param.u64 %rd1, [b0];
  ld.param.u64 %rd2, [b1];
  cvt.u64.u32 %rd3, %r1;
  add.s64 %rd4, %rd1, %rd3;
  ld.global.u8 %r2, [%rd4];                 // zero-extends into 32 bits
  ld.global.s8 %r3, [%rd4];                 // sign-extends
  mul.wide.u32 %rd5, %r1, 16;
  add.s64 %rd6, %rd2, %rd5;
  st.global.v2.u32 [%rd6], {%r2, %r3};
  shl.b64 %rd7, %rd3, 1;
  add.s64 %rd8, %rd1, %rd7;
  ld.global.u16 %r4, [%rd8+-0];
  ld.global.s16 %r5, [%rd8];
  add.s32 %r6, %r5, 0x1234500;              // the store keeps only the low byte / half
  st.global.u8 [%rd6+8], %r6;
  st.global.u16 [%rd6+10], %r6;
  st.global.u16 [%rd6+12], %r4;
  ret;
"""
    raw = np.arange(256, dtype=np.uint8)[::-1].copy()
    out = np.zeros((64, 16), np.uint8)
    _, got = run(kernel(body, bufs=2), [raw, out])
    i = np.arange(64)
    rec = got.view(np.uint32)
    np.testing.assert_array_equal(rec[:, 0], raw[i].astype(np.uint32))
    np.testing.assert_array_equal(rec[:, 1], raw[i].view(np.int8).astype(np.int32).view(np.uint32))
    h = raw.view(np.uint16)[i]
    v6 = (h.view(np.int16).astype(np.int64) + 0x1234500) & 0xFFFFFFFF
    np.testing.assert_array_equal(got[:, 8], (v6 & 0xFF).astype(np.uint8))
    np.testing.assert_array_equal(got.view(np.uint16)[:, 5], (v6 & 0xFFFF).astype(np.uint16))
    np.testing.assert_array_equal(got.view(np.uint16)[:, 6], h)


def test_64_bit_address_arithmetic_and_vector_loads():
    body = GID_1D + """
  ld.param.u64 %rd1, [b0];
  ld.param.u64 %rd2, [b1];
  cvt.u64.u32 %rd3, %r1;
  shl.b64 %rd4, %rd3, 4;
  add.s64 %rd5, %rd1, %rd4;
  ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd5];
  add.f32 %f5, %f1, %f2;
  add.f32 %f5, %f5, %f3;
  add.f32 %f5, %f5, %f4;
  mul.wide.s32 %rd6, %r1, -8;               // walk the output backwards from its end
  ld.param.u32 %r2, [pc0];
  mul.wide.u32 %rd7, %r2, 8;
  add.s64 %rd8, %rd2, %rd7;
  add.s64 %rd9, %rd8, %rd6;
  cvt.f64.f32 %fd1, %f5;
  st.global.f64 [%rd9+-8], %fd1;
  ret;
"""
    x = np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32)
    out = np.zeros(64, np.float64)
    _, got = run(kernel(body, bufs=2, words=1), [x, out], words=(64,))
    s = ((x[:, 0] + x[:, 1]) + x[:, 2]) + x[:, 3]
    np.testing.assert_array_equal(got[::-1], s.astype(np.float64))


LOCAL = GID_1D + """
  mov.u64 %rd1, lmem;
  mov.u32 %r2, 0;
$L_fill:
  setp.ge.u32 %p1, %r2, 8;
  @%p1 bra $L_filled;
  mad.lo.s32 %r3, %r1, 10, %r2;             // lmem[i] = 10 gid + i
  mul.wide.u32 %rd2, %r2, 4;
  add.s64 %rd3, %rd1, %rd2;
  st.local.u32 [%rd3], %r3;
  add.s32 %r2, %r2, 1;
  bra $L_fill;
$L_filled:
  mov.u32 %r4, 0;
  mov.u32 %r2, 0;
$L_sum:
  setp.ge.u32 %p1, %r2, 8;
  @%p1 bra $L_done;
  sub.s32 %r5, 7, %r2;
  mul.wide.u32 %rd2, %r5, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.local.u32 %r6, [%rd3];
  add.s32 %r7, %r2, 1;
  mad.lo.s32 %r4, %r6, %r7, %r4;            // sum of (i + 1) * lmem[7 - i]
  add.s32 %r2, %r2, 1;
  bra $L_sum;
$L_done:
  ld.param.u64 %rd4, [b0];
  mul.wide.u32 %rd5, %r1, 4;
  add.s64 %rd6, %rd4, %rd5;
  st.global.u32 [%rd6], %r4;
  ret;
"""


def test_a_local_array_indexed_by_a_loop_counter_is_private_to_each_thread():
    (got,) = run(kernel(LOCAL, local=32), [np.zeros(128, np.uint32)], grid=(2, 1, 1))
    g = np.arange(128)[:, None]
    i = np.arange(8)
    np.testing.assert_array_equal(got, ((i + 1) * (10 * g + 7 - i)).sum(axis=1))


# -- barriers and shared memory ---------------------------------------------------------------------------

TREE = """
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ctaid.x;
  mad.lo.s32 %r3, %r2, 128, %r1;
  ld.param.u64 %rd1, [b0];
  mul.wide.u32 %rd2, %r3, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.global.f32 %f1, [%rd3];
  mov.u32 %r4, smem;
  shl.b32 %r5, %r1, 2;
  add.s32 %r6, %r4, %r5;                    // &smem[tid]
  st.shared.f32 [%r6], %f1;
  bar.sync 0;
  mov.u32 %r7, 64;
$L_tree:
  setp.eq.u32 %p1, %r7, 0;
  @%p1 bra $L_out;
  setp.ge.u32 %p2, %r1, %r7;
  @%p2 bra $L_skip;
  shl.b32 %r8, %r7, 2;
  add.s32 %r9, %r6, %r8;
  ld.shared.f32 %f2, [%r6];
  ld.shared.f32 %f3, [%r9];
  add.f32 %f2, %f2, %f3;
  st.shared.f32 [%r6], %f2;
$L_skip:
  bar.sync 0;
  shr.u32 %r7, %r7, 1;
  bra $L_tree;
$L_out:
  setp.ne.u32 %p3, %r1, 0;
  @%p3 bra $L_end;
  ld.shared.f32 %f4, [smem+0];
  ld.param.u64 %rd4, [b1];
  mul.wide.u32 %rd5, %r2, 4;
  add.s64 %rd6, %rd4, %rd5;
  st.global.f32 [%rd6], %f4;
$L_end:
  ret;
"""


def test_shared_memory_tree_reduction_with_a_barrier_in_the_loop():
    x = np.random.default_rng(2).integers(-50, 50, 3 * 128).astype(np.float32)
    ptx = kernel(TREE, bufs=2, block=(128, 1, 1), shared=True)
    _, got = run(ptx, [x, np.zeros(3, np.float32)], block=(128, 1, 1), grid=(3, 1, 1), shared=512)
    np.testing.assert_array_equal(got, x.reshape(3, 128).sum(axis=1))
    # without the barrier in the loop a thread reads its partner's old partial sum
    broken = ptx.replace("$L_skip:\n  bar.sync 0;", "$L_skip:")
    assert broken != ptx
    _, bad = run(broken, [x, np.zeros(3, np.float32)], block=(128, 1, 1), grid=(3, 1, 1), shared=512)
    assert not np.array_equal(bad, got)


DIVERGENT = """
  mov.u32 %r1, %tid.x;
  rem.u32 %r2, %r1, 7;
  add.s32 %r2, %r2, 1;                      // trip count 1..7, different per lane
  mov.u32 %r3, 0;
  mov.u32 %r4, 0;
$L_loop:
  add.s32 %r4, %r4, %r3;
  add.s32 %r4, %r4, %r1;
  add.s32 %r3, %r3, 1;
  setp.lt.u32 %p1, %r3, %r2;
  @%p1 bra $L_loop;
  mov.u32 %r5, smem;
  shl.b32 %r6, %r1, 2;
  add.s32 %r7, %r5, %r6;
  st.shared.u32 [%r7], %r4;
  bar.sync 0;
  add.s32 %r8, %r1, 1;
  rem.u32 %r8, %r8, 96;                     // the next thread's value, across warps
  shl.b32 %r9, %r8, 2;
  add.s32 %r10, %r5, %r9;
  ld.shared.u32 %r11, [%r10];
  ld.param.u64 %rd1, [b0];
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  st.global.u32 [%rd3], %r11;
  ret;
"""


def test_lanes_with_different_trip_counts_reconverge_before_a_barrier():
    (got,) = run(kernel(DIVERGENT, block=(96, 1, 1), shared=True), [np.zeros(96, np.uint32)], block=(96, 1, 1),
                 shared=384)
    t = np.arange(96)
    n = t % 7 + 1
    val = n * (n - 1) // 2 + n * t
    np.testing.assert_array_equal(got, val[(t + 1) % 96])


def test_a_thread_exiting_while_others_wait_at_a_barrier_is_a_deadlock():
    body = GID_1D + """
  setp.ge.u32 %p1, %r1, 40;
  @%p1 bra $L_exit;
  bar.sync 0;
  ret;
$L_exit:
  ret;
"""
    # threads 40.. reach their ret only after the others opened the barrier (lowest PC first)
    with pytest.raises(EmulationError, match=r"deadlock -- CTA \(0, 0, 0\): bar\.sync 0 \(40/64 arrived\)"):
        run(kernel(body), [np.zeros(1, np.uint32)])


# -- warp-level operations -------------------------------------------------------------------------------

BFLY = GID_1D + """
  ld.param.u64 %rd1, [b0];
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.global.u32 %r2, [%rd3];
  mov.u32 %r3, 16;
$L_bfly:
  shfl.sync.bfly.b32 %r4, %r2, %r3, 31, 0xffffffff;
  add.s32 %r2, %r2, %r4;
  shr.u32 %r3, %r3, 1;
  setp.ne.u32 %p1, %r3, 0;
  @%p1 bra $L_bfly;
  ld.global.u32 %r5, [%rd3];
  shfl.sync.idx.b32 %r6, %r5, 3, 31, 0xffffffff;
  shfl.sync.down.b32 %r7, %r5, 1, 31, 0xffffffff;
  shfl.sync.up.b32 %r8, %r5, 1, 0, 0xffffffff;
  ld.param.u64 %rd4, [b1];
  mul.wide.u32 %rd5, %r1, 16;
  add.s64 %rd6, %rd4, %rd5;
  st.global.v4.u32 [%rd6], {%r2, %r6, %r7, %r8};
  ret;
"""


def test_warp_butterfly_reduction_and_the_other_shuffles():
    x = np.random.default_rng(3).integers(0, 1000, 128).astype(np.uint32)
    _, got = run(kernel(BFLY, bufs=2, block=(64, 1, 1)), [x, np.zeros((128, 4), np.uint32)], grid=(2, 1, 1))
    w = x.reshape(4, 32)
    np.testing.assert_array_equal(got[:, 0], np.repeat(w.sum(axis=1), 32))
    np.testing.assert_array_equal(got[:, 1], np.repeat(w[:, 3], 32))
    down = np.concatenate([w[:, 1:], w[:, 31:]], axis=1).reshape(-1)  # lane 31 keeps its own
    np.testing.assert_array_equal(got[:, 2], down)
    up = np.concatenate([w[:, :1], w[:, :31]], axis=1).reshape(-1)  # lane 0 keeps its own
    np.testing.assert_array_equal(got[:, 3], up)


BALLOT = GID_1D + """
  ld.param.u64 %rd1, [b0];
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.global.s32 %r2, [%rd3];
  setp.gt.s32 %p1, %r2, 0;
  vote.sync.ballot.b32 %r3, %p1, 0xffffffff;
  vote.sync.any.pred %p2, %p1, 0xffffffff;
  vote.sync.all.pred %p3, %p1, 0xffffffff;
  selp.u32 %r4, 1, 0, %p2;
  selp.u32 %r5, 1, 0, %p3;
  mov.u32 %r6, 0;
  and.b32 %r7, %r1, 1;
  setp.eq.u32 %p4, %r7, 0;
  @!%p4 bra $L_odd;
  activemask.b32 %r6;                       // only the even lanes are here
$L_odd:
  ld.param.u64 %rd4, [b1];
  mul.wide.u32 %rd5, %r1, 16;
  add.s64 %rd6, %rd4, %rd5;
  st.global.v4.u32 [%rd6], {%r3, %r4, %r5, %r6};
  ret;
"""


def test_ballot_any_all_and_activemask():
    x = np.random.default_rng(4).integers(-3, 3, 96).astype(np.int32)
    x[64:] = 5  # the third warp: all positive
    _, got = run(kernel(BALLOT, bufs=2, block=(96, 1, 1)), [x, np.zeros((96, 4), np.uint32)], block=(96, 1, 1))
    pos = (x > 0).reshape(3, 32)
    ballot = (pos * (1 << np.arange(32, dtype=np.uint64))).sum(axis=1).astype(np.uint32)
    np.testing.assert_array_equal(got[:, 0], np.repeat(ballot, 32))
    np.testing.assert_array_equal(got[:, 1], np.repeat(pos.any(axis=1), 32))
    np.testing.assert_array_equal(got[:, 2], np.repeat(pos.all(axis=1), 32))
    np.testing.assert_array_equal(got[:, 3], np.where(np.arange(96) % 2 == 0, 0x55555555, 0))


# -- errors name the line -----------------------------------------------------------------------------------

def test_misaligned_and_out_of_range_accesses_name_the_ptx_line():
    body = GID_1D + """
  ld.param.u64 %rd1, [b0];
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.global.f32 %f1, [%rd3+2];
  ret;
"""
    with pytest.raises(EmulationError, match=r"PTX line \d+: ld\.global\.f32 %f1, \[%rd3\+2\];: misaligned"):
        run(kernel(body), [np.zeros(64, np.float32)])
    with pytest.raises(EmulationError, match=r"illegal global address"):
        run(kernel(body.replace("[%rd3+2]", "[%rd3+4]")), [np.zeros(64, np.float32)])
    shared = GID_1D + "  mov.u32 %r2, smem;\n  st.shared.u32 [%r2+64], %r1;\n  ret;\n"
    with pytest.raises(EmulationError, match=r"st\.shared\.u32 \[%r2\+64\], %r1;: out of range \.shared access"):
        run(kernel(shared, shared=True), [np.zeros(1, np.float32)], shared=64)


# -- through the emulated driver -----------------------------------------------------------------------------

def _params(*values) -> tuple:
    """The kernelParams array the driver reads: one pointer per parameter to its bytes."""
    cells = [ctypes.c_uint64(v) if isinstance(v, int) and v > 0xFFFFFFFF else ctypes.c_uint32(v) if isinstance(v, int)
             else v for v in values]
    ptrs = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
    return ptrs, cells


def test_a_kernel_through_the_driver_api_with_streams_and_the_runtime_calls():
    drv = EmulatedDriver(sm_count=2)
    ok = drv.CUresult.CUDA_SUCCESS
    ptx = kernel(STRIDED, bufs=2, words=1, block=(8, 4, 2)).encode() + b"\0"
    err, mod = drv.cuModuleLoadDataEx(ptx, 0, [], [])
    assert err == ok
    err, fn = drv.cuModuleGetFunction(mod, b"k")
    assert err == ok
    n = 900
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    err, free0, total = drv.cuMemGetInfo()
    assert err == ok and free0 == total and drv.cuDeviceTotalMem(0) == (ok, total)
    err, a = drv.cuMemAlloc(4 * n)
    err, b = drv.cuMemAlloc(4 * n)
    err, c = drv.cuMemAlloc(4 * n)
    assert drv.cuMemGetInfo()[1] == free0 - 12 * n
    err, stream = drv.cuStreamCreate(0)
    assert err == ok
    assert drv.cuMemcpyHtoDAsync(a, x.ctypes.data, 4 * n, stream) == (ok,)
    assert drv.cuMemsetD32Async(b, 0x7FC00000, n, 0) == (ok,)  # NaN where nothing is written
    ptrs, _keep = _params(ctypes.c_uint64(int(a)), ctypes.c_uint64(int(b)), ctypes.c_uint32(n))
    assert drv.cuLaunchKernel(fn, 3, 2, 2, 8, 4, 2, 0, stream, ctypes.addressof(ptrs), 0) == (ok,)
    assert drv.cuStreamSynchronize(stream) == (ok,)
    assert drv.cuMemcpyDtoDAsync(c, b, 4 * n, stream) == (ok,)
    out = np.zeros(n, np.float32)
    assert drv.cuMemcpyDtoHAsync(out.ctypes.data, c, 4 * n, stream) == (ok,)
    np.testing.assert_array_equal(out, 2 * x + np.arange(n, dtype=np.float32))
    assert drv.launches[-1]["grid"] == (3, 2, 2) and drv.launches[-1]["block"] == (8, 4, 2)
    # D32 and D8 sets, a device-to-device copy
    assert drv.cuMemsetD32(c, 0x01020304, 2) == (ok,)
    assert drv.cuMemsetD8(c, 9, 1) == (ok,)
    assert drv.cuMemcpyDtoD(a, c, 8) == (ok,)
    head = np.zeros(2, np.uint32)
    assert drv.cuMemcpyDtoH(head.ctypes.data, a, 8) == (ok,)
    assert head.tolist() == [0x01020309, 0x01020304]
    # what the driver refuses, with its result code
    bad = drv.CUresult
    assert drv.cuMemsetD32(int(c) + 2, 0, 1)[0] == bad.CUDA_ERROR_INVALID_VALUE
    assert drv.cuMemcpyDtoD(a, c, 4 * n + 4)[0] == bad.CUDA_ERROR_INVALID_VALUE
    assert drv.cuStreamSynchronize(drv._real.CUstream(999))[0] == bad.CUDA_ERROR_INVALID_HANDLE
    assert drv.cuLaunchKernel(fn, 1, 1, 1, 8, 4, 2, 0, drv._real.CUstream(999), ctypes.addressof(ptrs), 0)[0] == \
        bad.CUDA_ERROR_INVALID_HANDLE
    assert drv.cuLaunchKernel(fn, 1, 1, 1, 8, 4, 4, 0, 0, ctypes.addressof(ptrs), 0)[0] == \
        bad.CUDA_ERROR_INVALID_VALUE  # 128 threads > .maxntid 64
    assert drv.cuLaunchKernel(fn, 1, 1, 70000, 8, 4, 2, 0, 0, ctypes.addressof(ptrs), 0)[0] == \
        bad.CUDA_ERROR_INVALID_VALUE  # grid z past 65535
    assert drv.cuMemAlloc(total)[0] == bad.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(OverflowError):
        drv.cuMemsetD32(c, -1, 1)  # as the bindings refuse it, before any driver
    with pytest.raises(OverflowError):
        drv.cuMemsetD8(c, 256, 1)
    with pytest.raises(TypeError):
        drv.cuStreamSynchronize("stream")
    assert drv.cuStreamDestroy(stream) == (ok,)
    assert drv.cuStreamSynchronize(stream)[0] == bad.CUDA_ERROR_INVALID_HANDLE
    assert drv.cuModuleUnload(mod) == (ok,)
    assert drv.cuLaunchKernel(fn, 1, 1, 1, 8, 4, 2, 0, 0, ctypes.addressof(ptrs), 0)[0] == \
        bad.CUDA_ERROR_INVALID_HANDLE  # its module is gone
    assert drv.cuModuleUnload(mod)[0] == bad.CUDA_ERROR_INVALID_HANDLE
    for p in (a, b, c):
        assert drv.cuMemFree(p) == (ok,)
    assert drv.cuMemGetInfo()[1] == total


def test_the_new_driver_calls_take_what_the_real_bindings_take():
    """Each call's arguments go to the real ``cuda.bindings`` first: without a driver library
    they convert them, then fail to find it; a TypeError there would be an argument the
    bindings refuse on a GPU machine."""
    from cuda.bindings import driver as real
    from cuda.pathfinder import DynamicLibNotFoundError

    from helios.cuda_ptx import driver as hdriver

    if hdriver.driver_status()[0]:
        pytest.skip("a CUDA driver is present: the real calls would run")
    drv = EmulatedDriver()
    ok = drv.CUresult.CUDA_SUCCESS

    def both(name, *args):
        with pytest.raises(DynamicLibNotFoundError):
            getattr(real, name)(*args)
        return getattr(drv, name)(*args)

    err, p = both("cuMemAlloc", 64)
    err, q = both("cuMemAlloc", 64)
    err, s = both("cuStreamCreate", 0)
    host = np.arange(16, dtype=np.uint32)
    assert both("cuMemcpyHtoDAsync", p, host.ctypes.data, 64, s) == (ok,)
    assert both("cuMemcpyDtoDAsync", q, p, 64, s) == (ok,)
    assert both("cuMemcpyDtoD", q, p, 64) == (ok,)
    assert both("cuMemsetD32Async", p, 7, 16, 0) == (ok,)
    assert both("cuMemsetD32", p, 7, 16) == (ok,)
    back = np.zeros(16, np.uint32)
    assert both("cuMemcpyDtoHAsync", back.ctypes.data, q, 64, s) == (ok,)
    assert back.tolist() == host.tolist()
    assert both("cuStreamSynchronize", s) == (ok,)
    assert both("cuStreamDestroy", s) == (ok,)
    assert both("cuMemGetInfo")[0] == ok
    assert both("cuDeviceTotalMem", real.CUdevice(0))[0] == ok
    err, mod = drv.cuModuleLoadDataEx(kernel(GID_1D + "  ret;").encode() + b"\0", 0, [], [])
    assert both("cuModuleUnload", mod) == (ok,)


def test_the_parse_is_cached_per_text():
    from helios.cuda_ptx.emu.ptx_parse import parse

    text = kernel(TREE, bufs=2, block=(128, 1, 1), shared=True)
    assert parse(text) is parse(text)


def test_a_grid_larger_than_one_batch_runs_in_several(monkeypatch):
    from helios.cuda_ptx.emu import launch as emulate

    block, grid, n = (8, 4, 2), (3, 2, 2), 1000
    x = np.random.default_rng(9).standard_normal(n).astype(np.float32)
    ptx = kernel(STRIDED, bufs=2, words=1, block=block)
    whole = run(ptx, [x, np.zeros(n, np.float32)], block=block, grid=grid, words=(n,))[1]
    monkeypatch.setattr(emulate, "BATCH_THREADS", 128)  # two CTAs per batch: six batches
    batched = run(ptx, [x, np.zeros(n, np.float32)], block=block, grid=grid, words=(n,))[1]
    np.testing.assert_array_equal(batched, whole)
    np.testing.assert_array_equal(whole, 2 * x + np.arange(n, dtype=np.float32))


def test_an_endless_loop_is_reported_and_an_unknown_instruction_refused_at_load(monkeypatch):
    from helios.cuda_ptx.emu import executor as emulator

    monkeypatch.setattr(emulator.Grid, "MAX_STEPS", 2000)
    with pytest.raises(EmulationError, match="no end after 2000 instruction steps"):
        run(kernel("$L_spin:\n  bra.uni $L_spin;\n  ret;"), [np.zeros(1, np.uint32)])
    drv = EmulatedDriver()
    log = bytearray(512)
    opts = [drv._real.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, drv._real.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    err, _ = drv.cuModuleLoadDataEx(kernel("  prmt.b32 %r1, %r2, %r3, 0;\n  ret;").encode() + b"\0", 2, opts,
                                    [log, len(log)])
    assert err == drv.CUresult.CUDA_ERROR_INVALID_PTX
    assert b"prmt.b32 is not modelled" in bytes(log)


def test_a_cta_that_skips_to_its_end_does_not_hold_the_others_barriers():
    # CTA 2 has no work (the grid is rounded up): it branches past the barriers to its ret while
    # CTAs 0 and 1, run in the same vector, meet at theirs
    guarded = TREE.replace("  mov.u32 %r1, %tid.x;\n  mov.u32 %r2, %ctaid.x;\n",
                           "  mov.u32 %r1, %tid.x;\n  mov.u32 %r2, %ctaid.x;\n  ld.param.u32 %r40, [pc0];\n"
                           "  setp.ge.u32 %p9, %r2, %r40;\n  @%p9 bra $L_end;\n", 1)
    assert guarded != TREE
    x = np.random.default_rng(8).integers(-9, 9, 3 * 128).astype(np.float32)
    _, got = run(kernel(guarded, bufs=2, words=1, block=(128, 1, 1), shared=True), [x, np.full(3, -1, np.float32)],
                 block=(128, 1, 1), grid=(3, 1, 1), words=(2,), shared=512)
    np.testing.assert_array_equal(got, [*x.reshape(3, 128).sum(axis=1)[:2], -1])
