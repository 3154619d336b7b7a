"""helios.comm."""
