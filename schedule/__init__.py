"""helios.schedule: parallelism schedules built on helios.comm and helios.autograd.

Data parallel (``DistributedDataParallel``) with gradient compression hooks
(``helios.schedule.compression``), ZeRO (``ZeroAdamW``, ``ZeroDataParallel``) and sharded
checkpoints (``helios.schedule.checkpoint``), ring attention over a sequence split between ranks
(``ring_attention``, ``ring_shard``, ``ring_unshard``); see schedule/README.md.
"""

from helios.schedule import compression
from helios.schedule.ddp import DistributedDataParallel
from helios.schedule.ring_attention import ring_attention, ring_positions, ring_shard, ring_unshard
from helios.schedule.zero import ZeroAdamW, ZeroDataParallel

__all__ = ["DistributedDataParallel", "compression", "ZeroAdamW", "ZeroDataParallel", "ring_attention", "ring_positions",
           "ring_shard", "ring_unshard"]
