"""helios.autograd."""
