"""helios.profile."""
