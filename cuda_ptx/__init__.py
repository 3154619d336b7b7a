"""helios.cuda_ptx: a PTX code generator for NVIDIA tensor cores, its gate, and a driver-API runner.

* :func:`emit_gemm` -- PTX text for a GEMM configuration (see :func:`variants`).
* :func:`variants` -- the ladder: simt, mma_sync, wgmma_tma, wgmma_pipe, wgmma_ws, wgmma_fp8,
  wgmma_persistent.
* :func:`gemm` -- ``a @ b`` on numpy arrays through a generated kernel (needs a GPU).
* :func:`emulate_gemm` -- the same kernel run thread by thread on the CPU emulator
  (no GPU): exact numerics, and hangs/races/faults reported as :class:`EmulationError`.
"""

from .config import GemmConfig, variants
from .emit import build_kernel, emit_gemm
from .emu.state import EmulationError
from .emu.launch import emulate_gemm

__all__ = ["EmulationError", "GemmConfig", "build_kernel", "emit_gemm", "emulate_gemm", "gemm", "variants"]


def __getattr__(name: str):
    # The runner pulls in the driver binding; load it only when asked for.
    if name == "gemm":
        from .runner import gemm

        return gemm
    raise AttributeError(f"module 'helios.cuda_ptx' has no attribute {name!r}")
