"""``HELIOS_DEBUG``: per-kernel log lines (the runtime prints them; the format lives here).

Levels
------
* ``0`` or unset -- nothing.
* ``1`` -- one line per kernel when its device time is known (at synchronize)::

      helios: matmul            (64, 768)x(768, 3072)  f32      412.30 us    73.21 GFLOP/s    12.09 GB/s

  name, shape, dtype, device time, achieved GFLOP/s and GB/s ("n/a" when the
  kernel's FLOPs/bytes are unknown or its time is zero).
* ``2`` -- level 1 plus, on the same line, ``src=<GLSL or PTX source path>`` and
  ``spv=<SPIR-V / cubin path>`` of the kernel.

Lines go to stderr, so they never mix with a program's output. The runtime
asks :func:`debug_level` once per synchronize (an environment read), not per op.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


def debug_level() -> int:
    """The current ``HELIOS_DEBUG`` level (0 when unset or not a number)."""
    raw = os.environ.get("HELIOS_DEBUG", "").strip()
    try:
        return max(0, int(raw)) if raw else 0
    except ValueError:
        return 0


def _fmt_time(ns: int) -> str:
    if ns >= 1_000_000:
        return f"{ns / 1e6:9.3f} ms"
    return f"{ns / 1e3:9.2f} us"


def format_kernel_line(name: str, shape: str, device_ns: int, flops: int, bytes_moved: int, dtype: str = "",
                       level: int = 1, source: str | None = None, binary: str | None = None) -> str:
    """One ``HELIOS_DEBUG`` line for a kernel (see the module docstring for the layout)."""
    if device_ns > 0:
        gf = f"{flops / device_ns:9.2f} GFLOP/s" if flops > 0 else f"{'n/a':>9} GFLOP/s"
        gb = f"{bytes_moved / device_ns:9.2f} GB/s" if bytes_moved > 0 else f"{'n/a':>9} GB/s"
    else:
        gf, gb = f"{'n/a':>9} GFLOP/s", f"{'n/a':>9} GB/s"
    line = f"helios: {name:<16} {shape:<22} {dtype:<5} {_fmt_time(max(0, device_ns))}  {gf}  {gb}"
    if level >= 2:
        line += f"  src={source or '-'}  spv={binary or '-'}"
    return line


def log_kernel(name: str, shape: str, device_ns: int, flops: int, bytes_moved: int, dtype: str = "",
               source: str | None = None, binary: str | None = None, level: int | None = None,
               stream: TextIO | None = None) -> bool:
    """Print the kernel's line to stderr when ``HELIOS_DEBUG >= 1``; returns whether it printed."""
    lvl = debug_level() if level is None else level
    if lvl < 1:
        return False
    print(format_kernel_line(name, shape, device_ns, flops, bytes_moved, dtype, lvl, source, binary),
          file=stream if stream is not None else sys.stderr, flush=True)
    return True


_noted: set[str] = set()


def log_choice(text: str, stream: TextIO | None = None) -> bool:
    """Print ``helios: <text>`` to stderr once per distinct text when ``HELIOS_DEBUG >= 1`` (which
    kernel an op took and why, e.g. a fallback from the tensor-core path); returns whether it printed."""
    if debug_level() < 1 or text in _noted:
        return False
    _noted.add(text)
    print(f"helios: {text}", file=stream if stream is not None else sys.stderr, flush=True)
    return True
