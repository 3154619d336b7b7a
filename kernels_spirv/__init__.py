"""helios.kernels_spirv."""
