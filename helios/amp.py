"""Mixed precision: ``autocast`` and ``GradScaler``, with PyTorch's semantics.

    with hl.autocast("bfloat16"):
        logits, loss = model(x, y)        # matmuls in bfloat16, softmax / norms / loss in float32
    loss.backward()                       # parameters stay float32 and get float32 gradients

    scaler = hl.amp.GradScaler()          # float16: the loss is scaled so small gradients survive
    with hl.autocast("float16"):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                  # before clipping: the gradients' true values
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)                      # skipped when a gradient is inf or nan
    scaler.update()                       # the scale backs off after a skip, grows after 2000 good steps

Under ``autocast`` the ops of ``LOW_PRECISION_OPS`` cast their floating-point inputs to the
autocast dtype and the ops of ``FLOAT32_OPS`` cast 16-bit inputs to float32; every other op
runs in the dtype of its inputs (a float32 + bfloat16 sum is float32, as in PyTorch).  The
cast is an autograd op (``F.to``), so a float32 parameter used by a bfloat16 matmul receives
a float32 gradient: the parameters are the float32 master weights.  The op lists are
PyTorch's CUDA lists restricted to the ops Helios has (PyTorch's CPU autocast leaves softmax,
layer_norm and sums in the low dtype; Helios follows the CUDA lists, which keep them exact).
The matmul kernels accumulate in float32 whatever the storage dtype
(kernels_spirv/glsl/matmul.comp), and so do the reduction, softmax, layer-norm and
cross-entropy kernels.  Where the product's kernel can, a linear or matmul with a float32
operand does its casts itself, with the same bits (helios.fused_kernels "cast+matmul"); on a
matrix engine (cuda:N's tensor cores) the operands are cast once and the gradients' casts ride
in the products (helios.functional.products, helios._kernels.casts_operands_first).

The state is per thread and nests: an inner ``autocast(enabled=False)`` turns casting off
for a region, an inner ``autocast("float16")`` changes the dtype.  A backward pass never
casts (its ops run in the dtypes the forward chose), whether or not it is called inside the
context.  Activation checkpointing (``helios.autograd.checkpoint``) recomputes its segment
in backward, hence without autocast: in float32.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from helios import dtypes as dt
from helios.autograd import tape

__all__ = ["autocast", "GradScaler", "is_autocast_enabled", "get_autocast_dtype", "LOW_PRECISION_OPS", "FLOAT32_OPS"]

# The ops of helios.functional that take part (the hook at each one's entry calls low() or fp32()).
LOW_PRECISION_OPS = ("matmul", "mm", "bmm", "linear", "addmm", "baddbmm", "scaled_dot_product_attention")
FLOAT32_OPS = ("softmax", "log_softmax", "attention_softmax", "cross_entropy", "layer_norm", "rms_norm", "sum",
               "norm")

_NAMES = {"bfloat16": dt.bfloat16, "bf16": dt.bfloat16, "float16": dt.float16, "fp16": dt.float16,
          "half": dt.float16}


class _State(threading.local):
    dtype = None  # the autocast dtype on this thread while a context is open, else None


state = _State()


def _low_dtype(dtype) -> dt.DType:
    if isinstance(dtype, dt.DType):
        d = dtype
    else:
        d = _NAMES.get(str(dtype).rsplit(".", 1)[-1])  # "bfloat16", torch.bfloat16's str, "bf16"
    if d is None or d not in (dt.bfloat16, dt.float16):
        raise ValueError(f"autocast: dtype must be bfloat16 or float16, got {dtype!r}")
    return d


class autocast:
    """Run the ops listed in ``LOW_PRECISION_OPS`` in ``dtype`` (bfloat16 or float16) and
    those in ``FLOAT32_OPS`` in float32, within a ``with`` block or a decorated function.

    ``autocast(dtype="bfloat16", enabled=True)``: ``dtype`` is "bfloat16" / "bf16", "float16" /
    "fp16" / "half", ``helios.bfloat16`` / ``helios.float16`` or a torch dtype of those names.
    ``device_type`` and ``cache_enabled`` (PyTorch's keywords) are accepted and change nothing:
    the ops run where their tensors are, and casts are not cached."""

    def __init__(self, dtype="bfloat16", enabled: bool = True, *, device_type: str | None = None,
                 cache_enabled=None):
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be True or False, got {enabled!r}")
        self.device_type = device_type
        self.dtype = _low_dtype(dtype)
        self.enabled = enabled
        self._saved: list = []  # the outer states, one per open entry (the same object may nest)

    def __enter__(self):
        self._saved.append(state.dtype)
        state.dtype = self.dtype if self.enabled else None
        return self

    def __exit__(self, *exc) -> bool:
        state.dtype = self._saved.pop()
        return False

    def __call__(self, fn):
        """Use as a decorator: ``fn`` runs under this autocast setting at every call."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast(self.dtype, self.enabled):
                return fn(*args, **kwargs)

        return wrapper


def is_autocast_enabled() -> bool:
    """True inside an enabled ``autocast`` on this thread."""
    return state.dtype is not None


def get_autocast_dtype():
    """The dtype low-precision ops run in on this thread (None outside ``autocast``)."""
    return state.dtype


def active_dtype():
    """The dtype autocast casts low-precision ops to at this point: None outside ``autocast`` and
    inside a backward pass (which runs without it)."""
    d = state.dtype
    if d is None or tape.in_backward():
        return None
    return d



def low(*ts) -> tuple:
    """``ts`` with every floating-point tensor cast to the autocast dtype (the hook of the ops in
    LOW_PRECISION_OPS; None and non-float arguments pass unchanged)."""
    d = active_dtype()
    if d is None:
        return ts
    from helios.functional import to
    from helios.tensor import Tensor

    return tuple(to(t, d) if isinstance(t, Tensor) and t.dtype.kind == "float" and t.dtype is not d else t for t in ts)


def fp32(*ts) -> tuple:
    """``ts`` with every 16-bit floating-point tensor cast to float32 (the hook of the ops in
    FLOAT32_OPS)."""
    if active_dtype() is None:
        return ts
    from helios.functional import to
    from helios.tensor import Tensor

    return tuple(to(t, dt.float32) if isinstance(t, Tensor) and t.dtype.kind == "float" and t.dtype.itemsize == 2
                 else t for t in ts)


# ---- loss scaling ----------------------------------------------------------------------------
class GradScaler:
    """Dynamic loss scaling for float16 training (PyTorch's ``torch.amp.GradScaler``).

    float16 holds no value below 6e-8, so small gradients of an unscaled loss become 0.  The
    loss is multiplied by ``scale`` before backward; ``unscale_`` divides the gradients back
    and looks for inf/nan; ``step`` skips the optimizer step when it found any (the scale was
    too large); ``update`` then multiplies the scale by ``backoff_factor``, or by
    ``growth_factor`` after ``growth_interval`` steps in a row without inf/nan.

    ``skipped_steps`` counts the steps skipped so far, ``last_step_skipped`` says whether the
    latest ``step`` was one.  ``enabled=False`` makes every method a pass-through (bfloat16
    and float32 runs need no scaling).

    ``process_group`` (a helios.comm group, or "world"): the ranks that hold different parts of
    the gradients (tensor- or pipeline-parallel ranks; PyTorch's ShardedGradScaler takes one
    too).  ``unscale_`` then takes the maximum of their inf/nan findings (one number
    all-reduced), so they skip the same steps and keep the same scale."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, process_group=None):
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"GradScaler: init_scale must be a positive number, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"GradScaler: growth_factor must be above 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"GradScaler: growth_interval must be a positive integer, got {growth_interval}")
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._per_opt: dict[int, dict] = {}  # optimizer id -> {"unscaled": bool, "found_inf": bool, "stepped": bool}
        self._group = process_group
        self.skipped_steps = 0
        self.last_step_skipped = False

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: every method passes through)."""
        return self._enabled

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    def scale(self, outputs):
        """``outputs`` (a tensor, or a list/tuple of them) multiplied by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return outputs * self._scale

    def _state(self, optimizer) -> dict:
        return self._per_opt.setdefault(id(optimizer), {"unscaled": False, "found_inf": False, "stepped": False})

    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and note whether any is inf
        or nan.  Call it once per step, before clipping or reading the gradients."""
        if not self._enabled:
            return
        st = self._state(optimizer)
        if st["unscaled"]:
            raise RuntimeError("GradScaler.unscale_: already called on this optimizer since the last update()")
        if st["stepped"]:
            raise RuntimeError("GradScaler.unscale_: step() was already called on this optimizer; call update() first")
        found = _unscale_grads(optimizer, 1.0 / self._scale)
        if self._group is not None:
            from helios import comm

            flag = np.array([1.0 if found else 0.0], np.float32)
            comm.all_reduce(flag, op="max", group=None if self._group == "world" else self._group)
            found = bool(flag[0] > 0)
        st["found_inf"] = found
        st["unscaled"] = True

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` unless the gradients hold inf or nan (then the
        step is skipped and None returned); unscales first if ``unscale_`` was not called."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        st = self._state(optimizer)
        if st["stepped"]:
            raise RuntimeError("GradScaler.step: already called on this optimizer since the last update()")
        if not st["unscaled"]:
            self.unscale_(optimizer)
        st["stepped"] = True
        self.last_step_skipped = st["found_inf"]
        if st["found_inf"]:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Adjust the scale after the step: back off if any optimizer found inf/nan, grow after
        ``growth_interval`` good steps in a row; ``new_scale`` sets it outright instead."""
        if not self._enabled:
            return
        if new_scale is not None:
            if not (float(new_scale) > 0 and math.isfinite(float(new_scale))):
                raise ValueError(f"GradScaler.update: new_scale must be a positive number, got {new_scale}")
            self._scale = float(new_scale)
        elif self._per_opt:
            if any(st["found_inf"] for st in self._per_opt.values()):
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._per_opt = {}

    def state_dict(self) -> dict:
        """The scale and its schedule (PyTorch's keys), for a checkpoint; empty when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        if not self._enabled:
            return
        if not state:
            raise RuntimeError("GradScaler.load_state_dict: the state is empty (saved by a disabled scaler)")
        self._scale = float(state["scale"])
        self._growth_factor = float(state["growth_factor"])
        self._backoff_factor = float(state["backoff_factor"])
        self._growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


def _grad_views(optimizer) -> list:
    """The gradients to unscale: the optimizer's own ``local_gradients()`` where it has them (a
    ZeRO optimizer's flat buffers or shards); a fused optimizer's flat gradient buffer once when
    every parameter of the group has its gradient there (one dispatch), else each ``p.grad``."""
    from helios.optim import complete_flat_grad

    local = getattr(optimizer, "local_gradients", None)
    if local is not None:
        return list(local())

    views, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            flat = complete_flat_grad(g)
            if flat is not None:
                if id(g.untyped_storage()) not in seen:
                    seen.add(id(g.untyped_storage()))
                    views.append(flat)
            elif id(g) not in seen:
                seen.add(id(g))
                views.append(g)
    return views


def _unscale_grads(optimizer, inv_scale: float) -> bool:
    """Multiply every gradient by ``inv_scale`` in place; True if any gradient holds inf or nan.

    The test is sum(g * 0) over every gradient: 0 when all are finite, nan otherwise (inf * 0
    is nan), so one number comes back to the host per step."""
    from helios import _kernels as K
    from helios import functional as F
    from helios.autograd.tape import no_grad

    views = _grad_views(optimizer)
    if not views:
        return False
    probe = None
    with no_grad():
        for g in views:
            part = F.sum(F.to(g, dt.float32) * 0.0)
            probe = part if probe is None else probe + part
            s = F.scalar_tensor(inv_scale, g.dtype, g.untyped_storage().rt)
            if g.is_contiguous():
                K.binary_("mul", g, s)  # in place: the flat buffer is the optimizer's gradient
            else:
                F.copy_(g, g * s)
    return not math.isfinite(probe.item())
