"""helios.cuda_ptx."""
