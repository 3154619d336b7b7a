"""Numpy layout model of helios.cuda_ptx: swizzles, descriptors, fragment maps, tile simulations."""

import dataclasses

import numpy as np
import pytest
from helios.cuda_ptx import config, dtypes, gen_mma, gen_wgmma
from helios.cuda_ptx import layout as L

V = config.variants()


def _ints(rng, shape):
    # small integers: every product and sum is exact in fp16/fp32, so comparisons are exact
    return rng.integers(-4, 5, shape).astype(np.float64)


def test_swizzle_128b_is_a_permutation_of_each_1024_byte_atom():
    addr = np.arange(4096)
    sw = L.swizzle(addr, 3)
    assert sorted(sw.tolist()) == addr.tolist()
    assert (sw // 1024 == addr // 1024).all()  # stays inside its atom
    # row r of an atom has its 16-byte chunks XORed by r
    for r in range(8):
        chunks = sw[r * 128: (r + 1) * 128: 16] // 16 % 8
        assert chunks.tolist() == [c ^ r for c in range(8)]


def test_swizzle_widths():
    a = np.arange(1024)
    assert (L.swizzle(a, 0) == a).all()
    assert (L.swizzle(a, 1) != a).any() and (L.swizzle(a, 1) ^ a).max() == 16
    assert (L.swizzle(a, 2) ^ a).max() == 48


def test_descriptor_round_trip_and_reference_fields():
    d = L.encode_desc(0x1400, 16, 1024, 128)
    assert d & 0x3FFF == 0x1400 >> 4
    assert (d >> 16) & 0x3FFF == 1  # LBO encoded 1
    assert (d >> 32) & 0x3FFF == 64  # SBO 1024 B
    assert d >> 62 == 1  # 128B swizzle
    rng = np.random.default_rng(1)
    for _ in range(200):
        start, lbo, sbo = (int(x) * 16 for x in rng.integers(0, 1 << 14, 3))
        sw = int(rng.choice([0, 32, 64, 128]))
        assert L.decode_desc(L.encode_desc(start, lbo, sbo, sw)) == {
            "start": start, "lbo": lbo, "sbo": sbo, "base_offset": 0, "swizzle": sw}


def test_descriptor_rejects_unaligned():
    with pytest.raises(ValueError, match="multiple of 16"):
        L.encode_desc(8, 16, 1024, 128)


def test_tma_write_then_descriptor_read_recovers_tile():
    rng = np.random.default_rng(2)
    tile = rng.integers(-100, 100, (64, 64)).astype(np.float16)
    smem = L.tma_store_box(tile, 128)
    for kk in range(4):  # +32 B per k16 step, as the generator advances the start address
        d = L.encode_desc(kk * 32, 16, 1024, 128)
        got = L.wgmma_gather(smem, d, 64, 32, np.float16)
        assert (got == tile[:, 16 * kk: 16 * kk + 16]).all()


def _n_major_smem(B, base=0, box_cols=64):
    """B (K x N) as the N-major kernel's TMA copies leave it: 64-column boxes at +j*8192 from ``base``."""
    k, n = B.shape
    box_bytes = k * 128
    smem = np.zeros(base + (n // box_cols) * box_bytes, np.uint8)
    for j in range(n // box_cols):
        o = base + j * box_bytes
        smem[o: o + box_bytes] = L.tma_store_box(np.ascontiguousarray(B[:, j * box_cols: (j + 1) * box_cols]), 128)
    return smem


@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("base", [0, 3072])  # a B tile after a 3 KiB A region: absolute-address swizzle
def test_tma_boxes_then_mn_major_descriptor_read_recovers_b(n, base):
    rng = np.random.default_rng(9)
    B = rng.integers(-1000, 1000, (64, n)).astype(np.float16)  # K x N
    smem = _n_major_smem(B, base)
    for kk in range(4):  # +16 K-rows = 2048 B per k16 step
        d = L.encode_desc(base + kk * 2048, 8192, 1024, 128)
        got = L.wgmma_gather_mn(smem, d, n, 16, np.float16)
        assert got.shape == (n, 16)
        assert (got == B[16 * kk: 16 * kk + 16, :].T).all()


@pytest.mark.parametrize("lbo, sbo", [(4096, 1024), (1024, 8192), (8192, 512), (8192, 2048)])
def test_mn_major_read_with_a_wrong_lbo_or_sbo_differs(lbo, sbo):
    rng = np.random.default_rng(10)
    B = rng.integers(-1000, 1000, (64, 256)).astype(np.float16)
    smem = _n_major_smem(B)
    d = L.encode_desc(0, lbo, sbo, 128)
    assert not (L.wgmma_gather_mn(smem, d, 256, 16, np.float16) == B[:16].T).all()


def test_mn_major_model_is_not_the_k_major_model():
    # the same bytes read K-major name other elements: the two models are not interchangeable
    B = np.arange(64 * 64).reshape(64, 64).astype(np.float16)
    smem = _n_major_smem(B)
    d = L.encode_desc(0, 8192, 1024, 128)
    mn = L.wgmma_gather_mn(smem, d, 64, 16, np.float16)
    km = L.wgmma_gather(smem, L.encode_desc(0, 16, 1024, 128), 64, 32, np.float16)
    assert (mn == B[:16].T).all() and not (km == B[:16].T).all()


def test_wgmma_gather_mn_signature_and_swizzle_modes():
    # another module calls it by these names; only the 128-byte swizzle is modelled
    import inspect

    assert list(inspect.signature(L.wgmma_gather_mn).parameters) == ["smem", "desc", "mn", "k", "dtype"]
    smem = np.zeros(8192, np.uint8)
    out = L.wgmma_gather_mn(smem=smem, desc=L.encode_desc(0, 8192, 1024, 128), mn=64, k=16, dtype=np.float16)
    assert out.shape == (64, 16) and out.dtype == np.float16
    with pytest.raises(NotImplementedError, match="128-byte"):
        L.wgmma_gather_mn(smem, L.encode_desc(0, 8192, 1024, 64), 64, 16, np.float16)


def test_ldmatrix_model_plain_and_trans():
    m = np.arange(32 * 8).reshape(32, 8)
    regs = L.ldmatrix(list(m))
    assert regs[5, 0, 1] == m[5 // 4, 2 * (5 % 4) + 1]
    regs_t = L.ldmatrix(list(m), trans=True)
    assert regs_t[5, 0, 1] == m[2 * (5 % 4) + 1, 5 // 4]


def test_wgmma_d_map_is_a_bijection():
    for n in (64, 128, 256):
        r, c = L.wgmma_d_map(n)
        flat = (r * n + c).ravel()
        assert sorted(flat.tolist()) == list(range(64 * n))


@pytest.mark.parametrize("b_major", ["n", "k"])
@pytest.mark.parametrize("tile", [(128, 128, 32, 2, 2), (64, 64, 16, 2, 2), (64, 128, 32, 1, 4)])
def test_mma_sync_tile_simulation_reproduces_matmul(b_major, tile):
    bm, bn, bk, wm, wn = tile
    cfg = V["mma_sync"].with_(b_major=b_major, bm=bm, bn=bn, bk=bk, warps_m=wm, warps_n=wn)
    rng = np.random.default_rng(3)
    A, B = _ints(rng, (bm, bk)), _ints(rng, (bk, bn))
    assert np.array_equal(gen_mma.simulate_tile(cfg, A, B), A @ B)


def test_mma_sync_simulation_catches_a_wrong_lane_map(monkeypatch):
    cfg = V["mma_sync"]
    rng = np.random.default_rng(4)
    A, B = _ints(rng, (cfg.bm, cfg.bk)), _ints(rng, (cfg.bk, cfg.bn))
    # swap which half of the lanes addresses rows 8-15 vs cols 8-15
    monkeypatch.setattr(L, "LDM_A_ROW", L.BitMap(((0, 7, 1), (4, 1, 8))))
    monkeypatch.setattr(L, "LDM_A_COL", L.BitMap(((3, 1, 8),)))
    assert not np.array_equal(gen_mma.simulate_tile(cfg, A, B), A @ B)


@pytest.mark.parametrize("name", ["wgmma_tma", "wgmma_pipe", "wgmma_ws", "wgmma_fp8"])
def test_wgmma_tile_simulation_reproduces_matmul(name):
    cfg = V[name]
    rng = np.random.default_rng(5)
    A, B = _ints(rng, (cfg.bm, cfg.bk)), _ints(rng, (cfg.bk, cfg.bn))
    assert np.array_equal(gen_wgmma.simulate_tile(cfg, A, B), A @ B)


@pytest.mark.parametrize("in_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("a_major,b_major", [("k", "n"), ("m", "k"), ("m", "n")])
@pytest.mark.parametrize("name", ["wgmma_tma", "wgmma_pipe", "wgmma_ws", "wgmma_persistent"])
def test_wgmma_transposed_operand_tile_simulation_reproduces_matmul(name, a_major, b_major, in_dtype):
    # N-major B (imm-trans-b) and M-major A (imm-trans-a, A stored K x M in 64-column boxes)
    cfg = V[name].with_(a_major=a_major, b_major=b_major, in_dtype=in_dtype)
    rng = np.random.default_rng(11)
    A, B = _ints(rng, (cfg.bm, cfg.bk)), _ints(rng, (cfg.bk, cfg.bn))
    assert np.array_equal(gen_wgmma.simulate_tile(cfg, A, B), A @ B)


def test_wgmma_m_major_a_plan_constants():
    cfg = V["wgmma_persistent"].with_(a_major="m")
    plan = gen_wgmma.WgmmaPlan(cfg)
    d = L.decode_desc(plan.desc_a_const)
    assert (d["lbo"], d["sbo"], plan.a_step_bytes, plan.trans_a, plan.a_boxes) == (8192, 1024, 2048, 1, cfg.bm // 64)
    assert plan.stage_bytes == gen_wgmma.WgmmaPlan(cfg.with_(a_major="k")).stage_bytes


def test_m_major_a_is_refused_where_it_is_not_generated():
    with pytest.raises(ValueError, match="a_major='m'"):
        V["wgmma_fp8"].with_(a_major="m").validate()
    with pytest.raises(ValueError, match="a_major='m'"):
        V["mma_sync"].with_(a_major="m").validate()


@pytest.mark.parametrize("const, bad", [("LBO_MN", 4096), ("LBO_MN", 1024), ("SBO_MN", 512), ("SBO_MN", 2048)])
def test_wgmma_n_major_simulation_catches_a_wrong_lbo_or_sbo(monkeypatch, const, bad):
    cfg = V["wgmma_ws"].with_(b_major="n")  # bn = 256: four 64-column boxes, so LBO matters
    rng = np.random.default_rng(12)
    A, B = _ints(rng, (cfg.bm, cfg.bk)), _ints(rng, (cfg.bk, cfg.bn))
    monkeypatch.setattr(gen_wgmma, const, bad)
    try:
        C = gen_wgmma.simulate_tile(cfg, A, B)
    except IndexError:
        return  # the descriptor names bytes past the slot: wrong as well
    assert not np.array_equal(C, A @ B)


def test_wgmma_n_major_plan_constants():
    plan = gen_wgmma.WgmmaPlan(V["wgmma_ws"].with_(b_major="n"))
    d = L.decode_desc(plan.desc_b_const)
    assert (d["lbo"], d["sbo"], d["swizzle"], d["start"]) == (8192, 1024, 128, 0)
    assert plan.b_boxes == 4 and plan.b_box_cols == 64 and plan.b_box_bytes == 8192
    assert plan.b_step_bytes == 2048 and plan.trans_b == 1
    assert [plan.b_box_offset(j) - plan.a_bytes for j in range(4)] == [0, 8192, 16384, 24576]
    # same slot size as the K-major form: expect_tx counts every byte of A and of all boxes
    k_plan = gen_wgmma.WgmmaPlan(V["wgmma_ws"])
    assert plan.stage_bytes == k_plan.stage_bytes == 128 * 128 + 256 * 128
    assert k_plan.desc_b_const == k_plan.desc_const and k_plan.b_step_bytes == 32 and k_plan.trans_b == 0


def test_wgmma_simulation_catches_a_wrong_sbo(monkeypatch):
    cfg = V["wgmma_tma"]
    rng = np.random.default_rng(6)
    A, B = _ints(rng, (cfg.bm, cfg.bk)), _ints(rng, (cfg.bk, cfg.bn))
    monkeypatch.setattr(gen_wgmma, "SBO", 512)
    assert not np.array_equal(gen_wgmma.simulate_tile(cfg, A, B), A @ B)


def test_wgmma_plan_offsets_are_what_the_descriptor_needs():
    plan = gen_wgmma.WgmmaPlan(V["wgmma_ws"])
    assert plan.stage_bytes % 1024 == 0  # every tile starts 1024-aligned (swizzle atom)
    assert plan.a_offset(1, 0, 0) == 64 * 128  # consumer 1 starts at row 64
    d = L.decode_desc(plan.desc_const)
    assert (d["sbo"], d["swizzle"]) == (1024, 128)


def test_bf16_encoding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(7).standard_normal(50000).astype(np.float32) * 1000
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(dtypes.f32_to_bf16_bits(x), ref)
    assert np.array_equal(dtypes.bf16_bits_to_f32(ref), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_e4m3_encoding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.random.default_rng(8).standard_normal(50000).astype(np.float32) * 50,
                        np.float32([0.0, -0.0, 1e-9, 448, -448, 2.0**-9 * 1.5])])
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(dtypes.f32_to_e4m3_bits(x), ref)
    assert np.array_equal(dtypes.e4m3_bits_to_f32(ref), torch.from_numpy(ref).view(torch.float8_e4m3fn).float().numpy())
    assert dtypes.f32_to_e4m3_bits(np.float32([1000.0]))[0] == 0x7E  # saturates at 448


def test_config_is_frozen_dataclass():
    assert dataclasses.is_dataclass(V["simt"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        V["simt"].bm = 1
