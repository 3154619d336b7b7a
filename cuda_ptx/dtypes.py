"""Host-side encodings of the kernel dtypes numpy lacks: bf16 and fp8 e4m3 (as raw bits).

All conversions round to nearest, ties to even, like the hardware's ``cvt.rn``.
"""

from __future__ import annotations

import numpy as np

from helios.errors import DTypeError


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def f32_pair_to_bf16x2(hi, lo) -> np.ndarray:
    """Two float32 values (arrays or scalars, broadcast) -> bf16 pairs packed in uint32, ``hi`` in the
    upper 16 bits, each rounded as :func:`f32_to_bf16_bits` rounds (PTX's ``cvt.rn.bf16x2.f32``), in
    one pass: the emulator runs it for every pair a 16-bit product's epilogue stores."""
    hi, lo = np.asarray(hi, np.float32), np.asarray(lo, np.float32)
    u_hi, u_lo = hi.view(np.uint32), lo.view(np.uint32)
    one, half, s16, top = np.uint32(1), np.uint32(0x7FFF), np.uint32(16), np.uint32(0xFFFF0000)
    word = ((u_hi + (half + ((u_hi >> s16) & one))) & top) | ((u_lo + (half + ((u_lo >> s16) & one))) >> s16)
    nan_hi, nan_lo = np.isnan(hi), np.isnan(lo)
    if nan_hi.any() or nan_lo.any():
        word = (np.where(nan_hi, np.uint32(0x7FC00000), word & top)
                | np.where(nan_lo, np.uint32(0x7FC0), word & np.uint32(0xFFFF)))
    return word


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes (0x7F/0xFF are NaN; no infinities)."""
    codes = np.arange(256, dtype=np.uint32)
    s = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> 3) & 0xF
    m = codes & 0x7
    val = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e.astype(np.int64) - 7))
    val = (s * val).astype(np.float32)
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val


E4M3_VALUES = _e4m3_table()
E4M3_MAX = 448.0


def f32_to_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes (uint8), round to nearest even, saturating at +-448."""
    x = np.asarray(x, dtype=np.float32)
    pos = E4M3_VALUES[:127]  # codes 0x00..0x7E, increasing
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(pos, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - pos[lo], pos[hi] - a
    # nearest; on a tie the even code (mantissa lsb 0)
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)
    code[np.isnan(x)] = 0x7F
    return code


def e4m3_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """e4m3fn codes -> float32 (exact)."""
    return E4M3_VALUES[np.asarray(b, dtype=np.uint8)]


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """Host array -> the raw element array a kernel of input ``dtype`` reads."""
    if dtype == "bf16":
        return f32_to_bf16_bits(x)
    if dtype == "fp16":
        return np.asarray(x, dtype=np.float16)
    if dtype == "e4m3":
        return f32_to_e4m3_bits(x)
    raise DTypeError(f"input dtype must be bf16, fp16 or e4m3, got {dtype!r}")


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw element array -> float32 values."""
    if dtype == "bf16":
        return bf16_bits_to_f32(raw)
    if dtype == "fp16":
        return np.asarray(raw, dtype=np.float16).astype(np.float32)
    if dtype == "e4m3":
        return e4m3_bits_to_f32(raw)
    if dtype == "f32":
        return np.asarray(raw, dtype=np.float32)
    raise DTypeError(f"dtype must be bf16, fp16, e4m3 or f32, got {dtype!r}")
