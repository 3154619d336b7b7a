"""helios.autograd: the tape (Function, Node, backward), grad modes and activation checkpointing."""

from helios.autograd.tape import Context, Function, Node, backward, enable_grad, is_grad_enabled, no_grad  # noqa: F401
from helios.autograd.checkpoint import checkpoint  # noqa: F401,E402
