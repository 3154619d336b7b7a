"""Tensors made on the device: random numbers (counter-based) and ranges."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import graph
from helios.runtime import get_runtime
from helios.tensor import Tensor
from helios._kernels.core import _elems_per_dispatch, bind, empty, grid
import helios._kernels as kern  # the other kernel families (bound once the package has loaded)


_P_RNG = struct.Struct("<5I2f2I")
_P_IOTA = struct.Struct("<I2fIqq")


# -- creation on the device ------------------------------------------------------------------
def rng(shape: tuple, dtype: dt.DType, mode: int, seed: int, offset: int, p0: float, p1: float, rt=None) -> Tensor:
    """Philox random tensor: mode 0 uniform [p0, p1), 1 normal(p0, p1), 2 keep-mask (bool) with drop prob p0."""
    rt = rt or get_runtime()
    # (seed, offset) are push constants: a replay would draw the same numbers again
    graph.refuse(rt, "random numbers (dropout, hl.rand, ...)", "would repeat the same values at every replay; draw "
                 "them outside the captured step or run it without capture")
    out = empty(shape, dtype, rt)
    n = out.numel()
    if n == 0:
        return out
    variant = dtype.tag if dtype.kind == "float" else "u8"
    pid = rt.pipeline("rng", variant, (mode,))
    step = (_elems_per_dispatch(out) // 4) * 4
    # The counter is (i, window, offset): each window of a tensor larger than one binding
    # range gets its own stream, and a (seed, offset) pair fixes the whole tensor.
    for w, s in enumerate(range(0, n, step)):
        m = min(step, n - s)
        bo, oo = bind(kern._flat_window(out, s), True, span=m)
        rt.dispatch(pid, [bo], _P_RNG.pack(m, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, offset & 0xFFFFFFFF,
                                            (offset >> 32) & 0xFFFFFFFF, p0, p1, w, oo),
                    grid((m + 3) // 4), "rng", 0, m * dtype.itemsize)
    return out


def arange(n: int, start, step, dtype: dt.DType, rt=None) -> Tensor:
    rt = rt or get_runtime()
    out = empty((n,), dtype, rt)
    if n == 0:
        return out
    pid = rt.pipeline("iota", dtype.tag)
    isint = dtype.kind == "int"
    rt.dispatch(pid, [bind(out, True)[0]],
                _P_IOTA.pack(n, float(start), float(step), 0, int(start) if isint else 0, int(step) if isint else 0),
                grid(n), "arange", 0, n * dtype.itemsize)
    return out
