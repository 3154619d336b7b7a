"""helios.schedule.plan: plan a training run (see README.md)."""
