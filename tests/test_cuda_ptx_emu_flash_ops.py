"""What the flash-attention kernel needs from the emulator, the emulated driver and driver.Context:
N-dimensional TMA tensor maps, wgmma with A from registers, and the warp scheduler's f32 and
warp-shuffle instructions -- each on small hand-built kernels checked against numpy."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helios.cuda_ptx import dtypes, driver, ops
from helios.cuda_ptx import layout as L
from helios.cuda_ptx.emu.driver import EmulatedDriver, decode_tensor_map, emulated_context
from helios.cuda_ptx.emu.state import EmulationError, TensorMap
from helios.cuda_ptx.ir import Builder
from helios.cuda_ptx.render import render
from helios.errors import DeviceError

pytest.importorskip("cuda.bindings")

TMA = "cp.async.bulk.tensor.{r}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
TMA_STORE = "cp.async.bulk.tensor.{r}d.global.shared::cta.bulk_group"


def _bf16_ints(rng, shape, lo=-8, hi=9) -> np.ndarray:
    """Integer-valued bf16 bits (exact in bf16, so products and sums are exact in f32)."""
    return dtypes.encode(rng.integers(lo, hi, shape).astype(np.float32), "bf16").view(np.uint16)


def _tmap_reg(b: Builder, p):
    """A tensor-map parameter's generic address in a register (what TMA takes)."""
    g = b.reg("u64")
    b.emit("mov.b64", g, p)
    b.emit("cvta.param.u64", g, g)
    return g


def _wait(b: Builder, bar, parity: int) -> None:
    """Spin until the mbarrier phase of ``parity`` has completed."""
    lbl, done = b.label("wait"), b.reg("pred")
    b.place(lbl)
    b.emit("mbarrier.try_wait.parity.shared::cta.b64", done, f"[{bar}]", parity)
    b.emit("bra", lbl, pred=done, negate=True)


def _init_barrier(b: Builder, is_t0, bar) -> None:
    """Thread 0 initialises one mbarrier for one arrival; the CTA waits until it exists."""
    with b.if_(is_t0):
        b.emit("mbarrier.init.shared::cta.b64", f"[{bar}]", 1)
        b.emit("fence.proxy.async.shared::cta")
    ops.bar_sync(b, 0)


def _copy_smem_out(b: Builder, tid, threads: int, smem, out_g, nbytes: int) -> None:
    """Every thread copies words ``tid, tid + threads, ..`` of ``nbytes`` of shared memory to ``out``."""
    i, v = b.reg("u32"), b.reg("u32")
    with b.loop(i, tid, nbytes // 4, threads):
        b.emit("ld.shared.u32", v, f"[{b.mad('u32', i, 4, smem)}]")
        b.emit("st.global.u32", f"[{ops.addr(b, out_g, i, 4)}]", v)


# -- 1. N-dimensional TMA ---------------------------------------------------------------------

# Q of a packed [B, T, 3, H, D] bf16 buffer, viewed as heads: element (b, h, t, d) at
# b * T*3HD + t * 3HD + h * D + d.  Innermost first: dims (D, T, H, B), element strides
# (1, 3HD, D, T*3HD) -- dimension 2's stride is smaller than dimension 1's.
B_, H_, T_, D_ = 2, 3, 70, 64
ROW = 3 * H_ * D_
DIMS = (D_, T_, H_, B_)
STRIDES = (2 * ROW, 2 * D_, 2 * T_ * ROW)  # bytes, dims 1..3
BOX = (64, 64, 1, 1)
BOX_BYTES = 64 * 128


def _heads(flat: np.ndarray) -> np.ndarray:
    """The [B, H, T, D] view of Q in a packed [B, T, 3HD] buffer."""
    return flat.reshape(B_, T_, 3, H_, D_)[:, :, 0].transpose(0, 2, 1, 3)


def _tma_kernel(store: bool) -> tuple[str, int]:
    """One CTA per (head, batch) = (ctaid.x, ctaid.y): thread 0 loads the box at
    ``{0, t0, h, b}`` of ``src`` by TMA; then either every thread copies the shared box
    (still swizzled) to ``out + 8 KiB * (b * H + h)``, or thread 0 stores it back by TMA
    into ``dst`` at the same coordinates.  Returns (PTX, shared bytes)."""
    b = Builder("tma4d", "sm_90a", "8.0", 128)
    src = b.param("src", "tmap")
    dst = b.param("dst", "tmap") if store else None
    out = None if store else b.param("out", "u64")
    t0p = b.param("t0", "u32")
    b.shared("box", BOX_BYTES, align=1024)
    bar_t = b.shared("bar", 8, align=8)
    tid = b.sreg("%tid.x")
    h, bb = b.sreg("%ctaid.x"), b.sreg("%ctaid.y")
    t0 = ops.ld_param(b, t0p, "u32")
    smem = ops.smem_base(b)
    bar = b.binop("add", "u32", smem, bar_t.offset)
    is_t0 = b.setp("eq", "u32", tid, 0)
    tm_src = _tmap_reg(b, src)
    _init_barrier(b, is_t0, bar)
    with b.if_(is_t0):
        b.emit("mbarrier.arrive.expect_tx.shared::cta.b64", "_", f"[{bar}]", BOX_BYTES)
        b.emit(TMA.format(r=4), f"[{smem}]", f"[{tm_src}, {{0, {t0}, {h}, {bb}}}]", f"[{bar}]")
    _wait(b, bar, 0)
    if store:
        tm_dst = _tmap_reg(b, dst)
        with b.if_(is_t0):
            b.emit("fence.proxy.async.shared::cta")
            b.emit(TMA_STORE.format(r=4), f"[{tm_dst}, {{0, {t0}, {h}, {bb}}}]", f"[{smem}]")
            b.emit("cp.async.bulk.commit_group")
            b.emit("cp.async.bulk.wait_group", 0)
    else:
        out_g = ops.ld_param_ptr(b, out)
        blk = b.mad("u32", bb, H_, h)
        base = ops.addr(b, out_g, blk, BOX_BYTES)
        _copy_smem_out(b, tid, 128, smem, base, BOX_BYTES)
    k = b.build()
    return render(k), k.shared_bytes


def _load_tma_kernel(ctx, store: bool):
    ptx, smem = _tma_kernel(store)
    return ctx.load_kernel(ptx, "tma4d", smem, "sm_90a")


def _upload(ctx, arr: np.ndarray) -> int:
    ptr = ctx.alloc(arr.nbytes)
    ctx.upload(ptr, np.ascontiguousarray(arr))
    return ptr


@pytest.mark.parametrize("t0", [64, 0, -8])
def test_a_4d_box_of_strided_heads_lands_swizzled_with_the_outside_zeroed(t0):
    """Boxes (64, 64, 1, 1) at {0, t0, h, b} through a tensor map of the heads of a packed
    buffer land exactly as the 128B-swizzle model says; rows past T = 70 (t0 = 64) or
    before 0 (t0 = -8) are zero."""
    rng = np.random.default_rng(0)
    flat = _bf16_ints(rng, (B_, T_, ROW))
    ctx = emulated_context()
    src = _upload(ctx, flat)
    out = ctx.alloc(B_ * H_ * BOX_BYTES)
    tmap = ctx.tensor_map_nd(src, "bf16", DIMS, STRIDES, BOX)
    fn = _load_tma_kernel(ctx, store=False)
    ctx.launch(fn, (H_, B_, 1), (128, 1, 1), [tmap, ("u64", out), ("u32", t0 & 0xFFFFFFFF)])
    got = np.empty(B_ * H_ * BOX_BYTES, np.uint8)
    ctx.download(got, out)
    heads = _heads(flat)
    for bi in range(B_):
        for h in range(H_):
            box = np.zeros((64, 64), np.uint16)
            lo, hi = max(t0, 0), min(t0 + 64, T_)
            box[lo - t0: hi - t0] = heads[bi, h, lo:hi]
            want = L.tma_store_box(box, 128)
            blk = got[(bi * H_ + h) * BOX_BYTES:][:BOX_BYTES]
            np.testing.assert_array_equal(blk, want, err_msg=f"b={bi} h={h}")
            if t0 == 64:  # the six rows inside the tensor are not zero, the 58 past it are
                rows = blk[L.swizzle(np.arange(BOX_BYTES), 3)].view(np.uint16).reshape(64, 64)
                assert np.array_equal(rows[:6], heads[bi, h, 64:70]) and not rows[6:].any()


def test_a_4d_store_round_trip_clips_what_lies_outside_the_tensor():
    """Load each head's box by TMA, store it by TMA into a second packed buffer at the same
    coordinates: Q's rows arrive exactly, and nothing outside the tensor is written -- the
    box's rows past T would otherwise land on the next batch's rows or past the buffer,
    and K/V (the rest of each packed row) keep their sentinel bytes."""
    rng = np.random.default_rng(1)
    flat = _bf16_ints(rng, (B_, T_, ROW))
    ctx = emulated_context(seed=3)
    src = _upload(ctx, flat)
    sentinel = np.full((B_, T_, ROW), 0x7777, np.uint16)
    dst = _upload(ctx, sentinel)
    fn = _load_tma_kernel(ctx, store=True)
    maps = [ctx.tensor_map_nd(p, "bf16", DIMS, STRIDES, BOX) for p in (src, dst)]
    for t0 in (0, 64):
        ctx.launch(fn, (H_, B_, 1), (128, 1, 1), maps + [("u32", t0)])
    got = np.empty_like(sentinel)
    ctx.download(got, dst)
    want = sentinel.copy()
    _heads(want)[...] = _heads(flat)
    np.testing.assert_array_equal(got, want)


def _encode(cu, rank, dims, strides, box, esize_type="BFLOAT16", elem=None):
    """cuTensorMapEncodeTiled through its C entry point (as Context calls it): (CUresult, 128 bytes)."""
    err, pfn, _ = cu.cuGetProcAddress(b"cuTensorMapEncodeTiled", 12000, 0)
    assert err == cu.CUresult.CUDA_SUCCESS
    raw, out = driver.aligned_buffer(128, 128)
    arr = lambda t, v: (t * max(len(v), 1))(*v)  # noqa: E731
    code = driver.ENCODE_TILED(pfn)(
        out, int(getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{esize_type}")), rank, 0x7F00_0000_0000,
        arr(ctypes.c_uint64, dims), arr(ctypes.c_uint64, strides), arr(ctypes.c_uint32, box),
        arr(ctypes.c_uint32, elem or [1] * rank), int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
        int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B),
        int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B),
        int(cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return cu.CUresult(code), ctypes.string_at(out, 128)


@pytest.mark.parametrize("rank", [1, 3, 4, 5])
def test_every_rank_round_trips_through_the_encoded_bytes(rank):
    cu = EmulatedDriver()
    dims = (64, 70, 3, 2, 5)[:rank]
    strides = (1152, 128, 161280, 322560)[: rank - 1]
    box = (64, 32, 1, 2, 1)[:rank]
    err, raw = _encode(cu, rank, dims, strides, box)
    assert err == cu.CUresult.CUDA_SUCCESS
    tm = decode_tensor_map(raw)
    assert (tm.dims, tm.strides, tm.box, tm.rank) == (dims, strides, box, rank)
    assert tm == TensorMap.tiled(0x7F00_0000_0000, dims, strides, box, 2)
    assert tm.box_bytes == int(np.prod(box)) * 2
    if rank == 1:
        assert (tm.rows, tm.box_rows, tm.row_pitch) == (1, 1, 128)


def test_a_2d_map_is_the_same_in_both_spellings():
    """The 2-D constructor the GEMM runner's maps use and the general form are one map."""
    a = TensorMap(0x7F00_0000_0000, 256, 128, 64, 64, 2, pitch=512)
    assert a == TensorMap.tiled(0x7F00_0000_0000, (128, 256), (512,), (64, 64), 2)
    assert (a.dims, a.strides, a.box, a.row_pitch, a.box_bytes) == ((128, 256), (512,), (64, 64), 512, 8192)


@pytest.mark.parametrize("rank,dims,strides,box,elem,code,why", [
    (4, (64, 70, 3, 2), (1152, 120, 161280), (64, 64, 1, 1), None, "INVALID_VALUE", "multiple of 16"),
    (3, (64, 70, 3), (1152, 128), (64, 257, 1), None, "INVALID_VALUE", "1..256"),
    (3, (64, 70, 3), (1152, 128), (128, 64, 1), None, "INVALID_VALUE", "exceeds the 128-byte swizzle"),
    (3, (64, 0, 3), (1152, 128), (64, 64, 1), None, "INVALID_VALUE", "globalDim"),
    (3, (64, 70, 3), (64, 128), (64, 64, 1), None, "INVALID_VALUE", "shorter than a row"),
    (3, (64, 70, 3), (1152, 128), (64, 64, 1), [1, 1, 2], "NOT_SUPPORTED", "unit element strides"),
])
def test_the_emulated_driver_holds_nd_maps_to_the_rules(rank, dims, strides, box, elem, code, why):
    cu = EmulatedDriver()
    err, raw = _encode(cu, rank, dims, strides, box, elem=elem)
    assert err.name == f"CUDA_ERROR_{code}" and raw == bytes(128)
    assert why in cu.cuGetErrorString(err)[1].decode()


@pytest.mark.parametrize("kw,why", [
    ({"ptr": 0x7F00_0000_0008}, r"TMA base 0x7f0000000008 is not 16-byte aligned"),
    ({"strides": (1152, 120, 161280)}, r"TMA strides \(1152, 120, 161280\) \(bytes\) must be multiples of 16"),
    ({"box": (32, 64, 1, 1)}, r"TMA box \(32, 64, 1, 1\): the inner extent is 64 bytes"),
    ({"box": (64, 300, 1, 1)}, r"TMA box \(64, 300, 1, 1\): each extent must be 1..256"),
    ({"strides": (1152, 128)}, r"TMA strides \(1152, 128\): a rank-4 tensor takes 3"),
    ({"box": (64, 64)}, r"TMA box \(64, 64\): a rank-4 tensor takes 4 extents"),
    ({"dims": (64,) * 6, "strides": (128,) * 5, "box": (64,) * 6}, r"the rank must be 1..5"),
    ({"dtype": "f64"}, r"TMA dtype 'f64'"),
])
def test_the_context_refuses_nd_maps_naming_the_argument(kw, why):
    ctx = emulated_context()
    args = dict(ptr=0x7F00_0000_0000, dtype="bf16", dims=DIMS, strides=STRIDES, box=BOX)
    args.update(kw)
    with pytest.raises(DeviceError, match=why) as e:
        ctx.tensor_map_nd(args["ptr"], args["dtype"], args["dims"], args["strides"], args["box"])
    assert "\n" not in str(e.value)


def test_the_2d_wrapper_encodes_what_the_nd_call_does():
    ctx = emulated_context()
    ptr = ctx.alloc(256 * 512)
    assert ctx.tensor_map(ptr, "bf16", 256, 128, 64, 64, pitch=256) == ctx.tensor_map_nd(
        ptr, "bf16", (128, 256), (512,), (64, 64))
    assert decode_tensor_map(ctx.tensor_map(ptr, "fp16", 256, 64, 32, 64)) == TensorMap(ptr, 256, 64, 32, 64, 2)


def test_a_tma_whose_rank_differs_from_its_map_is_refused():
    rng = np.random.default_rng(2)
    flat = _bf16_ints(rng, (B_, T_, ROW))
    ctx = emulated_context()
    src = _upload(ctx, flat)
    out = ctx.alloc(B_ * H_ * BOX_BYTES)
    tmap = ctx.tensor_map_nd(src, "bf16", DIMS[:3], STRIDES[:2], BOX[:3])  # a rank-3 map for a .4d copy
    fn = _load_tma_kernel(ctx, store=False)
    with pytest.raises(EmulationError, match=r"\.4d\..* through a tensor map of rank 3"):
        ctx.launch(fn, (1, 1, 1), (128, 1, 1), [tmap, ("u64", out), ("u32", 0)])


# -- 2. wgmma with A from registers ---------------------------------------------------------

K_RS = 64  # four k16 steps, so the accumulation across register-form wgmmas is exercised too


def _rs_kernel(n: int, ptx_in: str, b_major: str, edit: str = "") -> tuple[str, int]:
    """128 threads: B (n x 64 K-major, or 64 x n N-major) lands by TMA in 128B-swizzled shared
    memory; each thread loads its A fragments of a 64 x 64 row-major A from global (four
    k16 steps of four .b32 registers, the mma.m16n8k16 A pattern per warp); D starts at 1
    and gains A @ B through four ``wgmma ... {a0..a3}, b-desc`` with scale-d = 1; each
    thread stores its accumulators to a row-major 64 x n f32 D.

    ``edit`` plants a bug: "write_a_in_flight" (an A register written between the
    mma_async and the wait), "write_a_after_fence" (one written after the fence),
    "unwritten_a" (one never loaded); "read_a_in_flight" is no bug (the tensor core only
    reads them too).  Returns (PTX, shared bytes)."""
    b = Builder("rs", "sm_90a", "8.0", 128)
    tmap = b.param("tmap_b", "tmap")
    pa, pd = b.param("a", "u64"), b.param("d", "u64")
    b_bytes = n * 128
    b.shared("b", b_bytes, align=1024)
    bar_t = b.shared("bar", 8, align=8)
    tid = b.sreg("%tid.x")
    smem = ops.smem_base(b)
    bar = b.binop("add", "u32", smem, bar_t.offset)
    is_t0 = b.setp("eq", "u32", tid, 0)
    tm = _tmap_reg(b, tmap)
    _init_barrier(b, is_t0, bar)
    with b.if_(is_t0):
        b.emit("mbarrier.arrive.expect_tx.shared::cta.b64", "_", f"[{bar}]", b_bytes)
        if b_major == "k":  # B stored n x 64: one box of n rows x 128 bytes
            b.emit(TMA.format(r=2), f"[{smem}]", f"[{tm}, {{0, 0}}]", f"[{bar}]")
        else:  # B stored 64 x n: boxes of 64 K-rows x 64 N-columns, 8 KiB apart
            for j in range(n // 64):
                b.emit(TMA.format(r=2), f"[{smem}+{j * 8192}]", f"[{tm}, {{{64 * j}, 0}}]", f"[{bar}]")
    # A fragments: lane = 32w + 4g + q holds rows 16w+g (+8), cols 2q, 2q+1 (+8) of each k16 step
    lane = b.binop("and", "b32", tid, 31)
    row0 = b.mad("u32", b.binop("shr", "u32", tid, 5), 16, b.binop("shr", "u32", lane, 2))
    col0 = b.binop("shl", "b32", b.binop("and", "b32", lane, 3), 1)
    a_g = ops.addr(b, ops.ld_param_ptr(b, pa), b.mad("u32", row0, K_RS, col0), 2)
    a_regs = [[b.reg("b32") for _ in range(4)] for _ in range(K_RS // 16)]
    for kk, regs in enumerate(a_regs):
        for j, r in enumerate(regs):
            if edit == "unwritten_a" and (kk, j) == (1, 2):
                continue
            off = 2 * (8 * (j % 2) * K_RS + 8 * (j // 2) + 16 * kk)
            b.emit("ld.global.b32", r, f"[{a_g}+{off}]")
    acc = [b.mov("f32", 1.0) for _ in range(n // 2)]
    one = b.setp("ne", "u32", tid, 1000)  # scale-d: true
    _wait(b, bar, 0)
    b.emit("wgmma.fence.sync.aligned")
    if edit == "write_a_after_fence":
        b.emit("mov.b32", a_regs[2][0], 0)
    if b_major == "k":
        desc, step, trans = L.encode_desc(0, 16, 1024, 128), 32, 0
    else:
        desc, step, trans = L.encode_desc(0, 8192, 1024, 128), 2048, 1
    db = b.reg("b64")
    dbk = b.reg("b64")
    t = b.binop("shr", "u32", b.binop("and", "b32", smem, 0x3FFFF), 4)
    b.emit("cvt.u64.u32", db, t)
    b.emit("or.b64", db, db, desc)
    vec = lambda regs: "{" + ", ".join(map(str, regs)) + "}"  # noqa: E731
    for kk, regs in enumerate(a_regs):
        b.emit("add.s64", dbk, db, kk * step >> 4)
        b.emit(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_in}.{ptx_in}", vec(acc), vec(regs), dbk, one,
               1, 1, trans)
    b.emit("wgmma.commit_group.sync.aligned")
    if edit == "write_a_in_flight":
        b.emit("mov.b32", a_regs[3][1], 0)
    if edit == "read_a_in_flight":
        b.emit("mov.b32", b.reg("b32"), a_regs[3][1])
    b.emit("wgmma.wait_group.sync.aligned", 0)
    # D: register 2p, 2p+1 of a thread hold row 16w + g + 8(p%2), cols 8(p//2) + 2q, +1
    d_g = ops.addr(b, ops.ld_param_ptr(b, pd), b.mad("u32", row0, n, col0), 4)
    for p in range(n // 4):
        off = 4 * (8 * (p % 2) * n + 8 * (p // 2))
        b.emit("st.global.v2.f32", f"[{d_g}+{off}]", vec(acc[2 * p: 2 * p + 2]))
    k = b.build()
    return render(k), k.shared_bytes


def _run_rs(n, dtype, b_major, edit="", seed=0):
    """(D the kernel computed, A, B as f32): A 64 x 64, B 64 x n, integer-valued."""
    rng = np.random.default_rng(seed)
    ptx_in, tdt = {"bf16": ("bf16", "bf16"), "fp16": ("f16", "fp16")}[dtype]
    a = rng.integers(-8, 9, (64, K_RS)).astype(np.float32)
    bm = rng.integers(-8, 9, (K_RS, n)).astype(np.float32)
    enc = lambda x: dtypes.encode(x, dtype).view(np.uint16)  # noqa: E731
    ctx = emulated_context(seed=seed)
    a_ptr, d_ptr = _upload(ctx, enc(a)), ctx.alloc(64 * n * 4)
    if b_major == "k":  # stored n x K, K contiguous
        b_ptr = _upload(ctx, enc(np.ascontiguousarray(bm.T)))
        tmap = ctx.tensor_map(b_ptr, tdt, n, K_RS, n, 64)
    else:  # stored K x n, n contiguous
        b_ptr = _upload(ctx, enc(bm))
        tmap = ctx.tensor_map(b_ptr, tdt, K_RS, n, 64, 64)
    ptx, smem = _rs_kernel(n, ptx_in, b_major, edit)
    fn = ctx.load_kernel(ptx, "rs", smem, "sm_90a")
    ctx.launch(fn, (1, 1, 1), (128, 1, 1), [tmap, ("u64", a_ptr), ("u64", d_ptr)])
    d = np.empty((64, n), np.float32)
    ctx.download(d, d_ptr)
    return d, a, bm


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_register_a_wgmma_computes_the_exact_product(n, dtype, b_major):
    d, a, bm = _run_rs(n, dtype, b_major)
    np.testing.assert_array_equal(d, a @ bm + 1)


def test_reading_a_registers_while_the_wgmma_runs_is_allowed():
    d, a, bm = _run_rs(64, "bf16", "n", "read_a_in_flight", seed=4)
    np.testing.assert_array_equal(d, a @ bm + 1)


@pytest.mark.parametrize("edit,why", [
    ("write_a_in_flight", r"written while an in-flight wgmma reads it as part of its A fragment"),
    ("write_a_after_fence", r"A-fragment register %r\d+ was written by an ordinary instruction after the last wgmma.fence"),
    ("unwritten_a", r"read by thread 0 before anything wrote it"),
])
def test_register_a_misuse_is_reported(edit, why):
    with pytest.raises(EmulationError, match=why):
        _run_rs(64, "bf16", "k", edit)


def test_the_register_a_map_is_mma_m16n8k16s_a_per_warp():
    """Each warp's 16 rows of wgmma's A fragment follow mma.sync's A pattern, and the 128
    threads x 4 registers x 2 halves cover the 64 x 16 tile exactly once."""
    rows, cols = L.wgmma_a_map()
    assert rows.shape == cols.shape == (128, 4, 2)
    hit = np.zeros((64, 16), int)
    np.add.at(hit, (rows, cols), 1)
    assert (hit == 1).all()
    tile = np.arange(64 * 16, dtype=np.float64).reshape(64, 16)
    for w in range(4):
        frag = tile[rows[32 * w: 32 * w + 32], cols[32 * w: 32 * w + 32]]  # (32, 4, 2)
        eye = np.zeros((32, 2, 2))  # B = I (16 x 8, then the next 8 columns) through the mma model
        t = np.arange(32)
        for half_n in range(2):
            for j in range(2):
                for h in range(2):
                    eye[:, j, h] = (2 * (t % 4) + 8 * j + h == t // 4 + 8 * half_n)
            got = L.mma_m16n8k16(frag, eye, np.zeros((32, 4)))
            want = tile[16 * w: 16 * w + 16, 8 * half_n: 8 * half_n + 8]
            g, q = t // 4, 2 * (t % 4)
            for j in range(4):
                np.testing.assert_array_equal(got[:, j], want[g + 8 * (j // 2), q + j % 2])


# -- 3. the warp scheduler's f32, select, convert, load/store and shuffle instructions -------------

def _plain_kernel(threads: int, body, n_in: int = 2) -> str:
    """An sm_90a kernel of plain instructions: ``body(b, tid, ins, out)`` gets the input
    pointers ``ins`` and the output pointer (all global u64 registers).  Such a kernel
    would run on the vectorised Grid; :func:`_run_both` runs it on both executors."""
    b = Builder("k", "sm_90a", "8.0", threads)
    ps = [b.param(f"in{i}", "u64") for i in range(n_in)]
    po = b.param("out", "u64")
    tid = b.sreg("%tid.x")
    body(b, tid, [ops.ld_param_ptr(b, p) for p in ps], ops.ld_param_ptr(b, po))
    return render(b.build())


def _run_both(ptx: str, threads: int, inputs: list[np.ndarray], out_bytes: int, shared: int = 0) -> np.ndarray:
    """Run ``ptx`` on the warp scheduler (emulator.Cta) and on the vectorised Grid over the
    same inputs; the two outputs must agree byte for byte (one definition of each
    instruction).  Returns the warp scheduler's output bytes."""
    from helios.cuda_ptx.emu.state import GlobalMemory
    from helios.cuda_ptx.emu.launch import emulate_kernel
    from helios.cuda_ptx.emu.executor import Cta
    from helios.cuda_ptx.emu.ptx_parse import parse

    outs = []
    for executor in ("cta", "grid"):
        mem = GlobalMemory()
        params = {f"in{i}": mem.alloc_array(x) for i, x in enumerate(inputs)}
        params["out"] = mem.alloc(out_bytes, fill=0xAB)
        if executor == "cta":
            Cta(parse(ptx), threads, shared, params, mem, (0, 0, 0), (1, 1, 1)).run()
        else:
            emulate_kernel(ptx, threads, shared, params, mem)
        outs.append(mem.view(params["out"], out_bytes).copy())
    np.testing.assert_array_equal(outs[0], outs[1], err_msg="the warp scheduler and the Grid disagree")
    return outs[0]


SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 3.25, 1e-40, -1e-40, np.inf, -np.inf, np.nan, 7.0, -2.0,
                    0.5, 100.0, -126.5, 2.0 ** -130, 1e30, -1e-30, 0.1, 8.0, 1.0, -0.0, np.nan, np.inf,
                    5.0, 0.25, -7.75, 1e-38, 2.0, 9.0, -3.0, 64.0], np.float32)
OTHER = np.roll(SPECIAL, 5)[::-1].copy()

F32_OPS = {  # PTX opcode -> what it must compute on f32 (ftz: subnormal inputs and results flushed to 0)
    "add.f32": lambda x, y: x + y,
    "add.rn.ftz.f32": lambda x, y: _ftz(_ftz(x) + _ftz(y)),
    "sub.rn.f32": lambda x, y: x - y,
    "mul.f32": lambda x, y: x * y,
    "mul.rn.ftz.f32": lambda x, y: _ftz(_ftz(x) * _ftz(y)),
    "max.f32": np.fmax,  # the number when one operand is NaN
    "min.f32": np.fmin,
    "div.rn.f32": lambda x, y: x / y,
    "div.approx.f32": lambda x, y: x / y,
    "neg.f32": lambda x, y: -x,
    "abs.f32": lambda x, y: np.abs(x),
    "rcp.rn.f32": lambda x, y: np.float32(1) / x,
    "rcp.approx.ftz.f32": lambda x, y: _ftz(np.float32(1) / _ftz(x)),
    "ex2.approx.f32": lambda x, y: np.exp2(x),
    "ex2.approx.ftz.f32": lambda x, y: _ftz(np.exp2(_ftz(x))),
    "lg2.approx.f32": lambda x, y: np.log2(x),
    "lg2.approx.ftz.f32": lambda x, y: np.log2(_ftz(x)),
}


def _ftz(x):
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def test_f32_arithmetic_on_the_warp_scheduler():
    names = list(F32_OPS)

    def body(b, tid, ins, out):
        x, y = b.reg("f32"), b.reg("f32")
        b.emit("ld.global.f32", x, f"[{ops.addr(b, ins[0], tid, 4)}]")
        b.emit("ld.global.f32", y, f"[{ops.addr(b, ins[1], tid, 4)}]")
        for k, op in enumerate(names):
            r = b.reg("f32")
            binary = op.split(".")[0] in ("add", "sub", "mul", "max", "min", "div")
            b.emit(op, r, *((x, y) if binary else (x,)))
            b.emit("st.global.f32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 32 * k), 4)}]", r)

    got = _run_both(_plain_kernel(32, body), 32, [SPECIAL, OTHER], 4 * 32 * len(names)).view(np.float32)
    with np.errstate(all="ignore"):
        for k, op in enumerate(names):
            want = np.asarray(F32_OPS[op](SPECIAL, OTHER), np.float32)
            np.testing.assert_array_equal(got[32 * k: 32 * k + 32].view(np.uint32), want.view(np.uint32), err_msg=op)
    ex2 = got[names.index("ex2.approx.f32") * 32:][:32]
    assert ex2[SPECIAL == -np.inf].tolist() == [0.0] and ex2[SPECIAL == np.inf].tolist() == [np.inf, np.inf]


def test_ordered_and_unordered_f32_compares_and_selects():
    cmps = ["lt", "le", "gt", "ge", "eq", "ne", "ltu", "neu", "equ", "num", "nan"]

    def body(b, tid, ins, out):
        x, y = b.reg("f32"), b.reg("f32")
        b.emit("ld.global.f32", x, f"[{ops.addr(b, ins[0], tid, 4)}]")
        b.emit("ld.global.f32", y, f"[{ops.addr(b, ins[1], tid, 4)}]")
        for k, cmp in enumerate(cmps):
            p = b.setp(cmp, "f32", x, y)
            r = b.reg("u32")
            b.emit("selp.u32", r, 1, 0, p)
            b.emit("st.global.u32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 32 * k), 4)}]", r)
        lt = b.setp("lt", "f32", x, 0.0)
        f, w = b.reg("f32"), b.reg("b32")
        b.emit("selp.f32", f, x, y, lt)
        b.emit("selp.b32", w, 7, 9, lt)
        b.emit("st.global.f32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 32 * len(cmps)), 4)}]", f)
        b.emit("st.global.b32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 32 * len(cmps) + 32), 4)}]", w)

    got = _run_both(_plain_kernel(32, body), 32, [SPECIAL, OTHER], 4 * 32 * (len(cmps) + 2))
    words = got.view(np.uint32).reshape(-1, 32)
    x, y = SPECIAL, OTHER
    nan = np.isnan(x) | np.isnan(y)
    want = {"lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y, "eq": x == y, "ne": (x != y) & ~nan,
            "ltu": (x < y) | nan, "neu": x != y, "equ": (x == y) | nan, "num": ~nan, "nan": nan}
    for k, cmp in enumerate(cmps):
        np.testing.assert_array_equal(words[k], want[cmp].astype(np.uint32), err_msg=cmp)
    assert words[cmps.index("ne")][np.isnan(x)].sum() == 0  # ordered: NaN compares unequal to nothing
    neg = x < 0
    np.testing.assert_array_equal(words[len(cmps)].view(np.float32), np.where(neg, x, y))
    np.testing.assert_array_equal(words[len(cmps) + 1], np.where(neg, 7, 9))


def test_conversions_on_the_warp_scheduler():
    vals = np.array([1.5, -2.25, 3e9, -3e9, np.nan, 0.7, -0.7, 65504.0, 1e6, 2.5, -2.5, 1.0 / 3.0] * 2 + [0.0] * 8,
                     np.float32)
    ints = np.array([0, 1, -1, 2**31 - 1, -(2**31), 123456789, 16777217, -7] * 4, np.int32)

    def body(b, tid, ins, out):
        x, y, f = b.reg("f32"), b.reg("f32"), b.reg("f32")
        b.emit("ld.global.f32", x, f"[{ops.addr(b, ins[0], tid, 4)}]")
        b.emit("ld.global.f32", y, f"[{ops.addr(b, ins[0], b.binop('xor', 'b32', tid, 1), 4)}]")
        i = b.reg("s32")
        b.emit("ld.global.s32", i, f"[{ops.addr(b, ins[1], tid, 4)}]")
        h = b.reg("b16")
        b.emit("ld.global.b16", h, f"[{ops.addr(b, ins[0], tid, 4)}+2]")  # x's upper half: x as bf16, truncated
        results = []
        r = b.reg("b32")
        b.emit("cvt.rn.f16x2.f32", r, x, y)  # hi: x, lo: y
        results.append(r)
        r2 = b.reg("b32")
        b.emit("cvt.rn.bf16x2.f32", r2, x, y)
        results.append(r2)
        b.emit("cvt.f32.bf16", f, h)
        results.append(f)
        for op, src in (("cvt.rn.f32.u32", i), ("cvt.rn.f32.s32", i)):
            g = b.reg("f32")
            b.emit(op, g, src)
            results.append(g)
        z = b.reg("s32")
        b.emit("cvt.rzi.s32.f32", z, x)
        results.append(z)
        for k, r in enumerate(results):
            b.emit("st.global.b32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 32 * k), 4)}]", r)

    got = _run_both(_plain_kernel(32, body), 32, [vals, ints], 4 * 32 * 6).view(np.uint32).reshape(6, 32)
    swapped = vals[np.arange(32) ^ 1]
    with np.errstate(all="ignore"):
        half = lambda v: v.astype(np.float16).view(np.uint16).astype(np.uint32)  # noqa: E731
        np.testing.assert_array_equal(got[0], (half(vals) << 16) | half(swapped))
        bf = lambda v: dtypes.f32_to_bf16_bits(v).astype(np.uint32)  # noqa: E731  (each value on its own)
        np.testing.assert_array_equal(got[1], (bf(vals) << 16) | bf(swapped))
        np.testing.assert_array_equal(got[2], vals.view(np.uint32) & 0xFFFF0000)
        np.testing.assert_array_equal(got[3].view(np.float32), ints.view(np.uint32).astype(np.float32))
        np.testing.assert_array_equal(got[4].view(np.float32), ints.astype(np.float32))
        want = np.where(np.isnan(vals), 0, np.clip(np.trunc(vals.astype(np.float64)), -2**31, 2**31 - 1))
        np.testing.assert_array_equal(got[5].view(np.int32), want.astype(np.int32))


def test_vector_and_shared_loads_and_stores_and_integer_min_max():
    """ld.global.v2.f32 / v4.b32, st/ld.shared.f32 across threads (a barrier between),
    st.global.v4.b32, and min/max on u32 and s32 with negative values."""
    data = np.arange(-64, 64, dtype=np.int32)

    def body(b, tid, ins, out):
        v = b.regs("b32", 4)
        b.emit("ld.global.v4.b32", "{" + ", ".join(map(str, v)) + "}", f"[{ops.addr(b, ins[0], tid, 16)}]")
        f = b.regs("f32", 2)
        b.emit("ld.global.v2.f32", "{" + ", ".join(map(str, f)) + "}", f"[{ops.addr(b, ins[0], tid, 8)}]")
        s = b.reg("f32")
        b.emit("add.f32", s, f[0], f[1])
        b.shared("s", 128)
        smem = ops.smem_base(b)
        b.emit("st.shared.f32", f"[{b.mad('u32', tid, 4, smem)}]", s)
        ops.bar_sync(b, 0)
        other = b.reg("f32")
        b.emit("ld.shared.f32", other, f"[{b.mad('u32', b.binop('xor', 'b32', tid, 31), 4, smem)}]")
        mins = [b.binop(op, t, v[0], v[1]) for op, t in (("min", "u32"), ("max", "u32"), ("min", "s32"), ("max", "s32"))]
        b.emit("st.global.v4.b32", f"[{ops.addr(b, out, tid, 16)}]", "{" + ", ".join(map(str, mins)) + "}")
        b.emit("st.global.f32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 128), 4)}]", other)
        b.emit("st.global.v4.b32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, 40), 16)}]",
               "{" + ", ".join(map(str, v[::-1])) + "}")

    got = _run_both(_plain_kernel(32, body, n_in=1), 32, [data], 4 * 288, shared=128).view(np.int32)
    quads = data.reshape(32, 4)
    a, c = quads[:, 0], quads[:, 1]
    ua, uc = a.view(np.uint32), c.view(np.uint32)
    want = np.stack([np.minimum(ua, uc).view(np.int32), np.maximum(ua, uc).view(np.int32),
                     np.minimum(a, c), np.maximum(a, c)], axis=1)
    np.testing.assert_array_equal(got[:128].reshape(32, 4), want)
    pairs = data.view(np.float32)[:64].reshape(32, 2)
    sums = pairs[:, 0] + pairs[:, 1]
    np.testing.assert_array_equal(got[128:160].view(np.float32), sums[np.arange(32) ^ 31])
    np.testing.assert_array_equal(got[160:288].reshape(32, 4), quads[:, ::-1])


def _shfl_kernel(threads: int, edit: str = "") -> str:
    """Each thread's value x[tid]: the max over its quad (bfly 1, 2), over its warp (bfly 16 ..
    1), and lane 5's value of its warp (idx) -- stored as three rows of ``out``.  ``edit``:
    "diverged" runs the quad reduction only in lanes 0-15 with a full membermask,
    "outside" names lanes 0-15 in membermask but runs it in every lane."""
    def body(b, tid, ins, out):
        x = b.reg("f32")
        b.emit("ld.global.f32", x, f"[{ops.addr(b, ins[0], tid, 4)}]")

        def reduce(v, masks, member=0xFFFFFFFF):
            for m in masks:
                t = b.reg("f32")
                b.emit("shfl.sync.bfly.b32", t, v, m, 0x1F, member)
                b.emit("max.f32", v, v, t)

        q = b.reg("f32")
        b.emit("mov.f32", q, x)
        if edit == "diverged":
            with b.if_(b.setp("lt", "u32", b.binop("and", "b32", tid, 31), 16)):
                reduce(q, (1, 2))
        else:
            reduce(q, (1, 2), 0xFFFF if edit == "outside" else 0xFFFFFFFF)
        w = b.reg("f32")
        b.emit("mov.f32", w, x)
        reduce(w, (16, 8, 4, 2, 1))
        five = b.reg("b32")
        b.emit("shfl.sync.idx.b32", five, x, 5, 0x1F, 0xFFFFFFFF)
        for k, r in enumerate((q, w, five)):
            b.emit("st.global.b32", f"[{ops.addr(b, out, b.binop('add', 'u32', tid, threads * k), 4)}]", r)

    return _plain_kernel(threads, body, n_in=1)


def test_shfl_reduces_a_quad_and_a_warp_and_broadcasts_a_lane():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(64).astype(np.float32)
    x[9] = np.nan  # max.f32 takes the number: the NaN does not spread
    got = _run_both(_shfl_kernel(64), 64, [x], 4 * 64 * 3).view(np.float32).reshape(3, 64)
    np.testing.assert_array_equal(got[0], np.repeat(np.fmax.reduce(x.reshape(16, 4), axis=1), 4))
    np.testing.assert_array_equal(got[1], np.repeat(np.fmax.reduce(x.reshape(2, 32), axis=1), 32))
    np.testing.assert_array_equal(got[2], np.repeat(x.reshape(2, 32)[:, 5], 32))


@pytest.mark.parametrize("edit,why", [
    ("diverged", r"lanes 16-31 named in membermask 0xffffffff are not executing it with the others"),
    ("outside", r"lanes 16-31 execute it outside membermask 0xffff"),
])
def test_shfl_lanes_must_match_the_membermask(edit, why):
    from helios.cuda_ptx.emu.state import GlobalMemory
    from helios.cuda_ptx.emu.executor import Cta
    from helios.cuda_ptx.emu.ptx_parse import parse

    mem = GlobalMemory()
    params = {"in0": mem.alloc_array(np.zeros(32, np.float32)), "out": mem.alloc(4 * 32 * 3)}
    with pytest.raises(EmulationError, match=why):
        Cta(parse(_shfl_kernel(32, edit)), 32, 0, params, mem, (0, 0, 0), (1, 1, 1)).run()
