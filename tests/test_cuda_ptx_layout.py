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
