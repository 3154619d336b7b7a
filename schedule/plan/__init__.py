"""helios.schedule.plan: plan a training run -- what fits, how long it takes, what it costs, and why.

The command is ``helios-plan`` (cli.py); the pieces are importable::

    from helios.schedule.plan import ModelShape, Parallel, Settings, get_device, search
    res = search(ModelShape(32, 4096, 32, 51200, 2048), Settings(global_batch=1024, tokens=1e11),
                 get_device("h100-sxm"), 64, "bf16")
    best = res.plans[0]          # .par, .mem (bytes by kind), .time (seconds by component), .bound

See schedule/plan/README.md for the model and its validation.
"""

from .claims import check
from .hardware import Device, get_device
from .layout import Parallel, Settings
from .memory import memory_per_rank
from .model import ModelShape, PlanError, shape_for_params
from .search import search
from .timing import step_time

__all__ = ["Device", "ModelShape", "Parallel", "PlanError", "Settings", "check", "get_device", "memory_per_rank",
           "search", "shape_for_params", "step_time"]
