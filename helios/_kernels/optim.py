"""The optimizer kernels' launches: AdamW's push constants and dispatch (helios.optim and
schedule.zero's ZeroAdamW update parameters through these)."""

from __future__ import annotations

import math
import struct

from helios._kernels.core import grid

_P_ADAMW = struct.Struct("<4I8f")


def adamw_constants(group: dict, step: int) -> tuple:
    """The eight float push constants of the ``adamw`` kernel for ``group`` at ``step`` (1-based):
    lr, beta1, beta2, eps, weight decay, lr / (1 - beta1^t), sqrt(1 - beta2^t), 0."""
    b1, b2 = group["betas"]
    lr = group["lr"]
    return (lr, b1, b2, group["eps"], group["weight_decay"], lr / (1 - b1 ** step), math.sqrt(1 - b2 ** step), 0.0)


def adamw_push(n: int, off: int, consts: tuple) -> bytes:
    """The push-constant block of one ``adamw`` dispatch: elements [off, off + n) of each of its four
    bindings (parameters, gradients, first and second moments), which may each be bound at their own
    offset (a sharded optimizer binds shard-sized moments beside full-size parameters)."""
    return _P_ADAMW.pack(n, off, 0, 0, *consts)


def adamw_dispatch(rt, bufs: list, n: int, off: int, consts: tuple) -> None:
    """Record one ``adamw`` dispatch over elements [off, off + n) of its four bindings (see
    adamw_push), 4 elements an invocation when n and off allow it (bindings start 16-byte
    aligned): the same arithmetic per element, a quarter of the buffer accesses."""
    vec = 4 if n % 4 == 0 and off % 4 == 0 else 1
    pid = rt.pipeline("adamw", "default", (vec,))
    rt.dispatch(pid, bufs, adamw_push(n, off, consts), grid(n // vec), "adamw", 10 * n, 16 * n)
