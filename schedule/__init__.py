"""helios.schedule: parallelism schedules (data, tensor, pipeline, sequence, ZeRO, experts).

Not built yet; it builds on helios.comm and helios.autograd.
"""
