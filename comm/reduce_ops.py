"""Reduction operators over flat arrays, with float32 accumulation for 16-bit floats.

bfloat16 and float16 are widened to float32, reduced, and rounded back to nearest-even
once, so same-exponent inputs give exact results whatever the order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from helios.errors import DTypeError

OPS = ("sum", "avg", "max", "min", "prod")

_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns, nearest-even; NaN stays a quiet NaN."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
    res = (r >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        res[nan] = 0x7FC0
    if out is not None:
        out[...] = res
        return out
    return res


def check_op(op: str, dtype: str) -> None:
    """Raise when ``op`` is unknown (names the accepted ones)."""
    if op not in OPS:
        raise ValueError(f"helios.comm: op {op!r} is not one of {', '.join(OPS)}.")
    if dtype not in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"):
        raise DTypeError(f"helios.comm: cannot reduce dtype {dtype!r}.")


def _widen(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_to_f32(a)
    if dtype == "float16":
        return a.astype(np.float32)
    return a


def _narrow(acc: np.ndarray, out: np.ndarray, dtype: str) -> None:
    if dtype == "bfloat16":
        f32_to_bf16(acc, out)
    elif dtype == "float16":
        np.copyto(out, acc, casting="unsafe")
    elif acc is not out:
        np.copyto(out, acc)


def reduce_many(out: np.ndarray, srcs: Sequence[np.ndarray], op: str, dtype: str) -> None:
    """``out = op(srcs[0], srcs[1], ...)``; ``out`` may alias one of the sources."""
    if not srcs:
        return
    f = _UFUNC[op]
    if dtype in ("bfloat16", "float16"):
        acc = _widen(srcs[0], dtype)
        acc = acc.copy() if dtype == "float16" and acc is srcs[0] else acc
        for s in srcs[1:]:
            f(acc, _widen(s, dtype), out=acc)
        _narrow(acc, out, dtype)
        return
    if len(srcs) == 1:
        if srcs[0] is not out:
            np.copyto(out, srcs[0])
        return
    f(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        f(out, s, out=out)


def reduce_into(acc: np.ndarray, src: np.ndarray, op: str, dtype: str) -> None:
    """``acc = op(acc, src)`` in place."""
    reduce_many(acc, (acc, src), op, dtype)


def finish_avg(buf: np.ndarray, world: int, op: str, dtype: str) -> None:
    """Divide a summed buffer by the group size when ``op`` is avg (floor division for integers)."""
    if op != "avg" or world == 1:
        return
    if dtype in ("bfloat16", "float16"):
        acc = _widen(buf, dtype) / np.float32(world)
        _narrow(acc.astype(np.float32), buf, dtype)
    elif buf.dtype.kind in "iu":
        np.floor_divide(buf, world, out=buf)
    else:
        np.divide(buf, world, out=buf)
