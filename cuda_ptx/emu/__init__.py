"""The CPU emulator of the PTX this project generates, and the emulated CUDA driver it runs under.

Not product code: it exists so that every kernel, and the host code that launches it, is checked
without a GPU (cuda_ptx/README.md, "The CPU emulator" and "The emulated driver").

* :mod:`ptx_parse` -- PTX text to instructions;
* :mod:`executor` -- the two executors: :class:`executor.Cta` (warp by warp: async copies, tensor
  cores, mbarriers, clusters) and :class:`executor.Grid` (every thread of a compute kernel as one
  numpy vector);
* :mod:`ops` -- each instruction's semantics, for both;
* :mod:`state` -- memory, barriers, tensor maps, in-flight operations;
* :mod:`driver` -- :class:`driver.EmulatedDriver`, the calls of ``cuda.bindings.driver`` that
  ``helios.cuda_ptx.driver.Context`` makes; ``HELIOS_CUDA_DEVICE=emulator`` selects it;
* :mod:`launch` -- ``emulate_gemm`` / ``emulate_kernel``: a kernel run as the GPU runner would.
"""
