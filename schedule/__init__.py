"""helios.schedule: parallelism schedules built on helios.comm and helios.autograd.

Data parallel (``DistributedDataParallel``) and ZeRO live here; see schedule/README.md.
"""

from helios.schedule.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
