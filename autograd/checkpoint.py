"""Activation checkpointing: keep a block's inputs, recompute its activations in backward.

``checkpoint(fn, *args)`` runs ``fn`` without recording (so none of its intermediate
tensors stay alive), and in backward runs it again with recording on and
back-propagates through the recomputed graph.  Gradients are identical to running
``fn`` directly: kernels are deterministic and the random stream (dropout) is
rewound to where the forward pass drew from it.
"""

from __future__ import annotations

from helios.autograd.tape import Function, enable_grad, no_grad


class _Checkpoint(Function):
    @staticmethod
    def forward(ctx, fn, rng_state, *args):
        ctx.fn = fn
        ctx.rng_state = rng_state
        ctx.save_for_backward(*[a for a in args if _is_tensor(a)])
        ctx.args = args
        with no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, g):
        from helios import random as hrandom

        ctx.saved_tensors  # checks that no input was modified in place since forward
        inputs = [a.detach().requires_grad_(a.requires_grad) if _is_tensor(a) else a for a in ctx.args]
        after = hrandom.get_rng_state()
        hrandom.set_rng_state(ctx.rng_state)  # replay the same dropout masks
        try:
            with enable_grad():
                out = ctx.fn(*inputs)
        finally:
            hrandom.set_rng_state(after)
        if out.requires_grad:
            out.backward(g)
        return (None, None) + tuple(a.grad if _is_tensor(a) and a.requires_grad else None for a in inputs)


def _is_tensor(x) -> bool:
    from helios.tensor import Tensor

    return isinstance(x, Tensor)


def checkpoint(fn, *args):
    """``fn(*args)``, recomputed in backward instead of keeping its activations.

    ``fn`` must return one tensor and depend only on ``args`` and on module parameters."""
    from helios import random as hrandom

    return _Checkpoint.apply(fn, hrandom.get_rng_state(), *args)
