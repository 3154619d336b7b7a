"""helios.optim: SGD, AdamW (one fused kernel per parameter group), gradient clipping
and the cosine learning-rate schedule with linear warmup.

AdamW keeps each group's float32 parameters in one flat device buffer (the parameters
become views into it) and has autograd write their gradients into a matching flat
gradient buffer, so a step is a single dispatch per group and the global gradient norm
is one reduction.
"""

from __future__ import annotations

import math
import weakref


import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios import fused_kernels
from helios import graph
from helios.autograd.tape import no_grad
from helios.errors import CheckpointError
from helios.flat import mark_written
from helios.tensor import Tensor

# The AdamW kernel's launch (its push constants and dispatch) lives with the launchers; these are
# the optimizer's public names for it (ZeroAdamW shares them).
adamw_constants, adamw_push, adamw_dispatch = K.adamw_constants, K.adamw_push, K.adamw_dispatch


def _param_groups(params, defaults: dict) -> list[dict]:
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out = []
    for g in groups:
        g = {**defaults, **g, "params": list(g["params"])}
        for p in g["params"]:
            if not isinstance(p, Tensor) or not p.requires_grad:
                raise ValueError("optimizer parameters must be tensors with requires_grad=True")
        out.append(g)
    return out


class Optimizer:
    """Base: parameter groups, zero_grad, state_dict plumbing."""

    def __init__(self, params, defaults: dict):
        self.defaults = defaults
        self.param_groups = _param_groups(params, defaults)
        self.step_count = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    with no_grad():
                        F.zero_(p.grad)

    def _hyper(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]


_flat_by_grad_storage: "weakref.WeakValueDictionary[int, FlatGroup]" = weakref.WeakValueDictionary()


class FlatGroup:
    """One parameter group packed into flat float32 buffers (params, grads, moments)."""

    def __init__(self, params: list, n_moments: int):
        rt = params[0].untyped_storage().rt
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            if p.dtype is not dt.float32:
                raise ValueError(f"fused optimizers take float32 parameters, got {p.dtype.name}")
            self.offsets.append(n)
            n += p.numel()
        self.n = n
        self.p = K.empty((n,), dt.float32, rt, pool="weights")
        self.g = K.fill(K.empty((n,), dt.float32, rt, pool="weights"), 0)
        self.moments = [K.fill(K.empty((n,), dt.float32, rt, pool="weights"), 0) for _ in range(n_moments)]
        for p, off in zip(params, self.offsets):
            K.copy_into(self.p.untyped_storage().view(off, p.shape, dt.float32), p)
        for p, off in zip(params, self.offsets):
            # The parameter now lives in the flat buffer; its gradient lands in the flat gradient buffer.
            p.set_(self.p.untyped_storage(), off)
            p.grad_slot = self.g.untyped_storage().view(off, p.shape, dt.float32)
        _flat_by_grad_storage[id(self.g.untyped_storage())] = self

    def grads_complete(self) -> bool:
        st = self.g.untyped_storage()
        return all(p.grad is not None and p.grad.untyped_storage() is st for p in self.params)


class AdamW(Optimizer):
    """AdamW with decoupled weight decay (Loshchilov & Hutter), PyTorch's defaults."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"AdamW: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.flat = [FlatGroup(g["params"], 2) for g in self.param_groups]

    @no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        self.step_count += 1
        t = self.step_count
        for g, fg in zip(self.param_groups, self.flat):
            consts = adamw_constants(g, t)
            rt = fg.p.untyped_storage().rt
            if fg.grads_complete():
                ranges = [(0, fg.n)]
            else:  # some parameters got no gradient: update only those that did (as PyTorch skips them)
                ranges = [(off, p.numel()) for p, off in zip(fg.params, fg.offsets) if p.grad is not None]
                for p, off in zip(fg.params, fg.offsets):
                    if p.grad is not None and p.grad.untyped_storage() is not fg.g.untyped_storage():
                        K.copy_into(p.grad_slot, p.grad)
            bufs = [K.bind(fg.p, True)[0], K.bind(fg.g)[0], K.bind(fg.moments[0], True)[0], K.bind(fg.moments[1], True)[0]]
            for off, n in ranges:
                if n:
                    adamw_dispatch(rt, bufs, n, off, consts)
                    # A replayed step: the step count and the group's learning rate as they are then.
                    graph.dynamic_push(lambda g=g, n=n, off=off: adamw_push(n, off, adamw_constants(g, self.step_count)))
            mark_written(fg.p)
        graph.before_replay(self._count_step)

    def _count_step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        """Step count, hyper-parameters and the moments of every parameter (numpy)."""
        state = {}
        for gi, fg in enumerate(self.flat):
            m, v = fg.moments[0].numpy(), fg.moments[1].numpy()
            for pi, (p, off) in enumerate(zip(fg.params, fg.offsets)):
                state[f"{gi}.{pi}.exp_avg"] = m[off: off + p.numel()].reshape(p.shape)
                state[f"{gi}.{pi}.exp_avg_sq"] = v[off: off + p.numel()].reshape(p.shape)
        return {"step": self.step_count, "groups": self._hyper(), "state": state}

    def load_state_dict(self, sd: dict) -> None:
        if len(sd["groups"]) != len(self.param_groups):
            raise CheckpointError(f"optimizer state has {len(sd['groups'])} parameter groups, this optimizer has {len(self.param_groups)}")
        for gi, fg in enumerate(self.flat):
            for pi, (p, off) in enumerate(zip(fg.params, fg.offsets)):
                for j, name in enumerate(("exp_avg", "exp_avg_sq")):
                    arr = sd["state"].get(f"{gi}.{pi}.{name}")
                    if arr is None or tuple(arr.shape) != p.shape:
                        raise CheckpointError(f"optimizer state for group {gi} parameter {pi} ({name}) is missing or "
                                              f"has the wrong shape (expected {p.shape})")
                    K.copy_into(fg.moments[j].untyped_storage().view(off, p.shape, dt.float32),
                                K.from_numpy(arr, dt.float32, fg.p.untyped_storage().rt))
        for g, h in zip(self.param_groups, sd["groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in h.items()})
        self.step_count = int(sd["step"])


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov momentum and weight decay (PyTorch's rules)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 dampening: float = 0.0):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum needs momentum > 0 and dampening = 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay,
                                  "dampening": dampening})
        self.buffers: dict[int, Tensor] = {}

    @no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        self.step_count += 1
        # A captured step bakes the rates into its kernels' constants: a replay checks they still hold.
        graph.before_replay(self._same_rates([(g["lr"], g["momentum"], g["weight_decay"]) for g in self.param_groups]))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if g["weight_decay"]:
                    d = d + p * g["weight_decay"]
                if g["momentum"]:
                    buf = self.buffers.get(id(p))
                    if buf is None:
                        buf = F.clone(d)
                    else:
                        buf = buf * g["momentum"] + d * (1 - g["dampening"])
                    self.buffers[id(p)] = buf
                    d = d + buf * g["momentum"] if g["nesterov"] else buf
                F.copy_(p, p - d * g["lr"])

    def _same_rates(self, captured: list):
        def check():
            now = [(g["lr"], g["momentum"], g["weight_decay"]) for g in self.param_groups]
            if now != captured:
                raise graph.GraphCaptureError(f"replay: SGD's (lr, momentum, weight_decay) changed since the capture "
                                              f"({captured} -> {now}); SGD records them as constants: capture the "
                                              "step again after a change, or use AdamW (its rates follow the groups)")
            self.step_count += 1
        return check

    def state_dict(self) -> dict:
        params = [p for g in self.param_groups for p in g["params"]]
        return {"step": self.step_count, "groups": self._hyper(),
                "state": {f"{i}.momentum_buffer": self.buffers[id(p)].numpy() for i, p in enumerate(params) if id(p) in self.buffers}}

    def load_state_dict(self, sd: dict) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        self.buffers = {}
        for i, p in enumerate(params):
            arr = sd["state"].get(f"{i}.momentum_buffer")
            if arr is not None:
                self.buffers[id(p)] = K.from_numpy(arr, p.dtype, p.untyped_storage().rt)
        for g, h in zip(self.param_groups, sd["groups"]):
            g.update(h)
        self.step_count = int(sd["step"])


def complete_flat_grad(grad: Tensor) -> Tensor | None:
    """The flat gradient buffer of the fused parameter group whose storage holds ``grad``, where every
    parameter of that group has its current gradient there (one view then covers them all); else None."""
    st = grad.untyped_storage()
    fg = _flat_by_grad_storage.get(id(st))
    return fg.g if fg is not None and fg.g.untyped_storage() is st and fg.grads_complete() else None


@no_grad()
def clip_grad_norm_(params, max_norm: float) -> Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; returns the norm (a device scalar).

    Computed without a host round trip: the clip coefficient stays on the device."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return K.fill(K.empty((), dt.float32), 0.0)
    # Group gradients by storage: flat groups reduce in one dispatch.
    seen, parts = set(), []
    flat_views = []
    for p in params:
        flat = complete_flat_grad(p.grad)
        if flat is None:
            flat_views.append(p.grad)
        elif id(flat.untyped_storage()) not in seen:  # the whole flat buffer holds current gradients: once
            seen.add(id(flat.untyped_storage()))
            flat_views.append(flat)
    # Fused (helios.fused_kernels): each contiguous view's sum of squares as one reduction, and the
    # scalar chain in the last reduction's final step; the same bits as the separate ops.
    fuse = fused_kernels.ENABLED and all(K.sum_squares_fits(g) for g in flat_views)
    if fuse and len(flat_views) == 1:
        norm, coef = K.clip_coef(flat_views[0], max_norm)
    else:
        for gview in flat_views:
            if fuse:
                parts.append(K.sum_squares(gview))
                continue
            g32 = gview if gview.dtype is dt.float32 else F.to(gview, dt.float32)
            parts.append(F.sum(g32 * g32))
        total = parts[0]
        for x in parts[1:]:
            total = total + x
        if fuse:
            norm, coef = K.clip_coef(total.reshape((1,)), max_norm, square=False)
        else:
            norm = F.sqrt(total)
            coef = F.clamp(F.rdiv(norm + 1e-6, float(max_norm)), max=1.0)
    for gview in flat_views:
        if gview.is_contiguous():
            K.binary_("mul", gview, F.to(coef, gview.dtype))  # in place: no temporary, no copy back
        else:
            F.copy_(gview, gview * F.to(coef, gview.dtype))
    return norm


def cosine_lr(step: int, max_lr: float, warmup: int, total: int, min_lr: float | None = None) -> float:
    """Linear warmup to ``max_lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` (default max_lr/10) at ``total``."""
    min_lr = max_lr / 10 if min_lr is None else min_lr
    if warmup and step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))
