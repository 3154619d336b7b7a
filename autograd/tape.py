"""The autograd tape.

Every differentiable op is a :class:`Function`.  When any input requires grad (and
grad mode is on), ``Function.apply`` records a :class:`Node` on the output: the
function, its context (saved tensors, constants) and its inputs.  ``backward()``
orders the nodes reachable from the root topologically and runs each node's
``backward`` in reverse order.  Backward formulas are written in Helios ops, so they
run on the device like the forward pass.

Saved tensors remember the version counter of their storage; an in-place op on a
tensor that a node saved makes backward fail with a clear error instead of silently
using the modified values.

Gradients written in place: a leaf whose optimizer packed its gradient into a slot of a
flat buffer (``_grad_slot``) and that has no gradient yet in this pass has a *free slot*.
Before a node's backward runs, ``ctx.grad_out(i)`` names input i's free slot (else None);
a backward that writes input i's gradient there returns the slot itself, and
``_accumulate_leaf`` then records nothing (no copy into the slot).  Later contributions
(a tied weight's second use) and gradients of another dtype take the copying path, unless
the later use's backward takes the slot through ``ctx.grad_pending(i)`` (below) and adds
its gradient there itself (the embedding's, for GPT's tied table).  The
same goes for a non-leaf input whose producer gathers its outputs' gradients in one
buffer (a Function with ``grad_dest``: split_heads' q, k and v): the consumer writes the
first gradient there, and the producer's backward finds it in place.

Pending gradients taken over: a non-leaf used twice (the residual stream feeds a residual
add and a LayerNorm) gets its gradient as the sum of two contributions, which the tape adds
when the second arrives.  ``ctx.grad_pending(i)`` hands a backward the contribution input i
has gathered so far; a backward that takes it returns its own gradient plus that tensor (the
LayerNorm's input-gradient kernel adds it in its store: helios.fused_kernels's
"layer_norm_bwd+acc"), and the tape keeps the result as the input's pending gradient
instead of recording the add.  The sum is the one the tape would compute (the same two
operands; float addition commutes), so the bits are the same.

In-place ops under autograd (``y[mask] = v``, ``y.add_(z)`` on a non-leaf): the op is
recorded out of place, its result written into y's memory, and y moved to the new node
(helios.functional.inplace).  A node records its inputs as tensors, so y's earlier
producer is kept in ``y._history`` with the sequence number of the move: every node
recorded before it still reaches the producer it saw (:func:`edge`), as PyTorch's edges
do.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading

from helios import op_trace
from helios.profile.profiler import current_collector

_state = threading.local()

# Whether backward offers leaves' free gradient slots to the ops (see the module docstring);
# False gives the copying path everywhere (tests compare the two bit for bit).
GRADS_IN_PLACE = True


def is_grad_enabled() -> bool:
    """Whether ops record onto the tape."""
    return getattr(_state, "enabled", True)


class _GradMode:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        self.prev = is_grad_enabled()
        _state.enabled = self.enabled

    def __exit__(self, *exc):
        _state.enabled = self.prev
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*a, **k):
            with _GradMode(self.enabled):
                return fn(*a, **k)

        return wrapper


def no_grad() -> _GradMode:
    """Context manager (and decorator) that stops recording: ops make no nodes."""
    return _GradMode(False)


def enable_grad() -> _GradMode:
    """Context manager (and decorator) that turns recording back on."""
    return _GradMode(True)


class Context:
    """What a Function's forward keeps for its backward."""

    __slots__ = ("saved", "versions", "needs_input_grad", "dests", "__dict__")

    def __init__(self):
        self.saved = ()
        self.versions = ()

    def grad_out(self, i: int):
        """Where backward may write the gradient of input ``i``: the free gradient slot of a
        leaf (a contiguous tensor of the input's shape and dtype, see the module docstring),
        or None.  A backward that writes there returns that tensor as input i's gradient."""
        dests = getattr(self, "dests", None)
        return dests[i] if dests is not None else None

    def grad_pending(self, i: int):
        """The gradient of input ``i`` gathered so far in this pass from its other uses (a
        contiguous tensor of the input's shape and dtype), or None.  A backward that asks
        for it takes it over: it must return input i's gradient *plus* this tensor (added as
        the last step, e.g. in its kernel's store), which the tape then keeps as the input's
        gradient instead of adding the two (see the module docstring).  For a packed leaf
        whose gradient is already in its slot (a tied table's), that is the slot: a backward
        may add into it in place and return it."""
        src = getattr(self, "pending_src", None)
        if src is None:
            return None
        pending, node, incoming = src
        inputs = node.inputs
        t = inputs[i] if i < len(inputs) else None
        if t is None or sum(1 for u in inputs if u is t) > 1:
            return None
        producer = edge(t, node)[0]
        if producer is None:
            g = _slot_holding_grad(t, self.saved, incoming) if GRADS_IN_PLACE else None
        else:
            g = pending.get(id(producer)) if producer.n_out == 1 else None
        if g is None or g.shape != t.shape or g.dtype is not t.dtype or not g.is_contiguous():
            return None
        self.taken = getattr(self, "taken", frozenset()) | {i}
        return g

    def save_for_backward(self, *tensors) -> None:
        self.saved = tensors
        self.versions = tuple(t._st.version if t is not None else 0 for t in tensors)

    @property
    def saved_tensors(self) -> tuple:
        if self.saved is None:
            raise RuntimeError(
                "trying to backward through the graph a second time (its saved tensors were freed); "
                "pass retain_graph=True to the first backward() if you need to")
        for t, v in zip(self.saved, self.versions):
            if t is not None and t._st.version != v:
                raise RuntimeError(
                    f"a tensor of shape {t.shape} saved for backward was modified by an in-place op "
                    f"(version {v} -> {t._st.version}); use the out-of-place op or clone() before modifying it")
        return self.saved


class _NoContext:
    """Stand-in context when nothing will be recorded: saving is free."""

    __slots__ = ()

    def save_for_backward(self, *tensors) -> None:
        pass

    def __setattr__(self, name, value):
        pass


NO_CONTEXT = _NoContext()


_SEQUENCE = itertools.count()  # the order nodes are recorded in (see edge)


def next_sequence() -> int:
    """A number after every node recorded so far and before every later one."""
    return next(_SEQUENCE)


class Node:
    """One recorded op: the function, its context, and the inputs it differentiates."""

    __slots__ = ("fn", "ctx", "inputs", "name", "n_out", "retained", "seq")

    def __init__(self, fn, ctx, inputs):
        self.seq = next(_SEQUENCE)
        self.fn = fn
        self.ctx = ctx
        self.inputs = inputs  # tuple of Tensor-or-None, aligned with backward's outputs
        self.name = fn.__name__
        self.n_out = 1  # > 1: forward returned a tuple and backward takes a tuple of grads (None if unused)
        self.retained = None  # [(weakref to an output that retains its grad, output index)], see retain_grad


def edge(t, node) -> tuple:
    """(producer node, output index) of ``t`` as ``node`` saw it when it was recorded: the
    tensor's current ones, unless an in-place op moved it to a new node since (its
    ``_history``, oldest first, says which producer each earlier stretch of nodes saw)."""
    history = t._history
    if history is not None:
        for before, producer, index in history:
            if node.seq < before:
                return producer, index
    return t._node, t._out_index


def retain_grad(t) -> None:
    """Make backward store the gradient of the non-leaf ``t`` in ``t.grad`` (a no-op on a leaf)."""
    import weakref

    if t._node is None:
        if not t.requires_grad:
            raise RuntimeError("retain_grad(): the tensor does not require grad")
        return
    if t.retains_grad:
        return
    if t._node.retained is None:
        t._node.retained = []
    t._node.retained.append((weakref.ref(t), t._out_index))


class _HookHandle:
    """What register_post_accumulate_grad_hook returns: ``remove()`` unregisters the hook."""

    def __init__(self, t, hook):
        self._t, self._hook = t, hook

    def remove(self) -> None:
        hooks = self._t._grad_hooks
        if hooks is not None and self._hook in hooks:
            hooks.remove(self._hook)


def add_post_accumulate_hook(t, hook) -> _HookHandle:
    """Register ``hook(t)``, called once per backward after the last gradient reaching the leaf ``t``."""
    if t._node is not None:
        raise RuntimeError("register_post_accumulate_grad_hook: only leaf tensors accumulate gradients; this one has a grad_fn")
    if not t.requires_grad:
        raise RuntimeError("register_post_accumulate_grad_hook: the tensor does not require grad")
    if t._grad_hooks is None:
        t._grad_hooks = []
    t._grad_hooks.append(hook)
    return _HookHandle(t, hook)


class Function:
    """Base class of differentiable ops: subclass and define static forward/backward.

    ``forward(ctx, *args)`` computes the output from Tensor (and other) args without
    recording; ``backward(ctx, grad)`` returns one gradient (or None) per forward arg.
    """

    @staticmethod
    def forward(ctx, *args):  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - interface
        raise NotImplementedError

    @classmethod
    def apply(cls, *args):
        if _TRACE.notes_on:  # HELIOS_DEBUG: note the operands for the kernel lines
            _TRACE.operands = _operands_text(args)
        if current_collector() is not None and not _in_profiled_op[0]:
            return _apply_profiled(cls, args)  # records the op with the kernels it launches
        # The hot path of every op: a plain loop finds out whether anything records
        # before building the needs tuple (most calls record nothing).
        if getattr(_state, "enabled", True):
            Tensor = _Tensor or _tensor_class()
            for a in args:
                if isinstance(a, Tensor) and a.requires_grad:
                    needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
                    ctx = Context()
                    ctx.needs_input_grad = needs
                    out = cls.forward(ctx, *args)
                    node = Node(cls, ctx, tuple(a if n else None for a, n in zip(args, needs)))
                    if type(out) is tuple:  # several outputs share one node; each knows its slot
                        node.n_out = len(out)
                        for i, o in enumerate(out):
                            o.requires_grad = True
                            o._node = node
                            o._out_index = i
                    else:
                        out.requires_grad = True
                        out._node = node
                    return out
        return cls.forward(NO_CONTEXT, *args)


_Tensor = None
_TRACE = op_trace.current()  # the op being recorded, which HELIOS_DEBUG lines and the trace attribute kernels to


def _tensor_class():
    """helios.tensor.Tensor, imported on first use (helios.tensor imports this module's users)."""
    global _Tensor
    if _Tensor is None:
        from helios.tensor import Tensor

        _Tensor = Tensor
    return _Tensor


_in_profiled_op = [False]


@functools.lru_cache(maxsize=None)
def _op_name(class_name: str) -> str:
    """The profiler's name for a Function class: _CrossEntropy -> cross_entropy (cached: called per op)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name.lstrip("_")).lower()


def _operands_text(args) -> tuple:
    """("(2, 3)x(3, 4)", "float32") for an op's tensor arguments (HELIOS_DEBUG lines)."""
    shapes = [a.shape for a in args if hasattr(a, "_st")]
    first = next((a for a in args if hasattr(a, "_st")), None)
    return "x".join(str(s) for s in shapes), first.dtype.name if first is not None else ""


class _OpScope:
    """While open, the runtime files each dispatch's sequence number under this host op;
    on close the op is recorded with them (name, shape and dtype of ``ref``)."""

    def __init__(self, col, name: str):
        self.col, self.name, self.ids = col, name, []

    def __enter__(self):
        import time

        self.prev = op_trace.collect_dispatch_ids(self.ids)
        _in_profiled_op[0] = True
        self.t0 = time.monotonic_ns()
        return self

    def close(self, ref) -> None:
        import time

        _in_profiled_op[0] = False
        op_trace.collect_dispatch_ids(self.prev)
        if type(ref) is tuple:
            ref = next((x for x in ref if x is not None), None)
        self.col.record_op(self.name, ref.shape if ref is not None else (), ref.dtype.name if ref is not None else "",
                           self.t0, time.monotonic_ns(), self.ids)


def _apply_profiled(cls, args):
    """Function.apply while profiling: record the op, its shape and the kernels it launched."""
    scope = _OpScope(current_collector(), getattr(cls, "op_name", None) or _op_name(cls.__name__)).__enter__()
    out = None
    try:
        out = cls.apply(*args)
    finally:
        scope.close(out)
    return out


def _backward_profiled(node, g):
    """node.fn.backward, recorded as a host op ``<name>_backward`` while profiling."""
    col = current_collector()
    if col is None:
        return node.fn.backward(node.ctx, g)
    name = getattr(node.fn, "op_name", None) or _op_name(node.name)  # a fused op's own name ("linear+gelu")
    scope = _OpScope(col, name + "_backward").__enter__()
    try:
        return node.fn.backward(node.ctx, g)
    finally:
        scope.close(g)


def _topo_order(root) -> list:
    """Nodes reachable from ``root`` in topological order (inputs before users)."""
    order = []
    seen = set()
    stack = [(root._node, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for inp in node.inputs:
            if inp is None:
                continue
            producer = inp._node if inp._history is None else edge(inp, node)[0]
            if producer is not None and id(producer) not in seen:
                stack.append((producer, False))
    return order


def queue_callback(fn) -> None:
    """Run ``fn()`` once when the backward pass now running ends (PyTorch's engine callback).

    Called from a hook during backward; data parallel uses it to wait for the gradient
    all-reduces it started, so ``loss.backward()`` returns with synchronised gradients.
    """
    if not in_backward():
        raise RuntimeError("queue_callback(): no backward pass is running on this thread")
    _state.callbacks.append(fn)


def in_backward() -> bool:
    """True while a backward pass runs on this thread (its nodes' functions are being called)."""
    return getattr(_state, "in_backward", False)


def backward_progress() -> tuple[int, int]:
    """(nodes processed, nodes in the pass) of the backward pass running on this thread, or (0, 0)."""
    return getattr(_state, "progress", (0, 0)) if in_backward() else (0, 0)


def backward(root, grad=None, retain_graph: bool = False) -> None:
    """Accumulate d(root)/d(leaf) into ``leaf.grad`` for every leaf that requires grad."""
    # A nested pass (activation checkpointing recomputes and differentiates a segment
    # inside the outer backward) has its own callbacks and progress.
    outer = (getattr(_state, "in_backward", False), getattr(_state, "callbacks", []), getattr(_state, "progress", (0, 0)))
    _state.in_backward, _state.callbacks, _state.progress = True, [], (0, 0)
    try:
        _backward(root, grad, retain_graph)
        callbacks = _state.callbacks
        # Callbacks may queue more (a bucket finished last): run until none is left.
        while callbacks:
            callbacks.pop(0)()
    finally:
        _state.in_backward, _state.callbacks, _state.progress = outer


# backward()'s implicit gradient of a scalar root (1.0) per runtime and dtype, with the version
# of its storage when it was filled: made once and again only after something wrote it, so a
# training step's backward launches no kernel to seed itself.
_seeds: dict = {}


def _seed(root):
    """1.0 in the shape, dtype and runtime of the one-element ``root``: the cached seed (a view
    of it), filled again where anything has written it since."""
    import helios.functional as F

    st = root.untyped_storage()
    key = (id(st.rt), root.dtype)
    got = _seeds.get(key)
    if got is None or got[0].untyped_storage().rt is not st.rt or got[0].untyped_storage().version != got[1]:
        one = F.full_like(root, 1.0).reshape(())
        got = _seeds[key] = (one, one.untyped_storage().version)
    return got[0].reshape(root.shape)


def _backward(root, grad, retain_graph: bool) -> None:
    from helios.tensor import Tensor
    import helios.functional as F

    if not root.requires_grad:
        raise RuntimeError("backward(): the tensor does not require grad and has no grad_fn "
                           "(did you compute it under no_grad(), or from tensors without requires_grad=True?)")
    if grad is None:
        if root.numel() != 1:
            raise RuntimeError(f"backward(): grad can be implicitly created only for scalar outputs, got shape {root.shape}; "
                               "pass a gradient tensor of the same shape")
        grad = _seed(root)
    elif not isinstance(grad, Tensor):
        raise TypeError("backward(): gradient must be a helios.Tensor")
    elif grad.shape != root.shape:
        raise RuntimeError(f"backward(): gradient shape {grad.shape} does not match the tensor's shape {root.shape}")
    # Storages already handed to a leaf in this pass: a second leaf gets a copy, so an
    # in-place update of one .grad (clipping, scaling) never changes another.
    given: set = {id(grad._st)}
    with no_grad():
        if root._node is None:
            _accumulate_leaf(root, grad, given)
            _run_hooks(root)
            return
        order = _topo_order(root)
        hooked = _LeafCounts(order)
        # node id -> gradient of its output (a list of per-output gradients for multi-output nodes)
        pending: dict[int, object] = {}
        handed: set = set()  # (node id, output index) whose gradient destination was handed out
        _add_pending(pending, root._node, root._out_index, grad)
        total = len(order)
        for done, node in enumerate(reversed(order)):
            _state.progress = (done, total)
            g = pending.pop(id(node), None)
            if g is None:
                hooked.skipped(node)
                continue
            if node.n_out > 1:
                g = tuple(g)
            if node.retained is not None:
                _store_retained(node, g)
            ctx = node.ctx
            ctx.dests = _grad_dests(node, g, pending, handed) if GRADS_IN_PLACE else None
            ctx.pending_src, ctx.taken = (pending, node, g), frozenset()
            in_grads = _backward_profiled(node, g)
            taken = ctx.taken
            ctx.dests = ctx.pending_src = None
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            for i, (inp, ig) in enumerate(zip(node.inputs, in_grads)):
                if inp is None:
                    continue
                producer, index = (inp._node, inp._out_index) if inp._history is None else edge(inp, node)
                if i in taken and producer is None:  # it added the leaf's slot (Context.grad_pending)
                    _keep_in_slot(inp, ig)
                elif i in taken:  # the backward added the pending gradient (Context.grad_pending)
                    pending[id(producer)] = ig
                elif ig is not None:
                    if ig.shape != inp.shape:
                        ig = F.sum_to_shape(ig, inp.shape)
                    if producer is None:
                        _accumulate_leaf(inp, ig, given)
                    else:
                        _add_pending(pending, producer, index, ig)
                if inp._grad_hooks:
                    hooked.arrived(inp, ig is not None)
            if not retain_graph:
                node.ctx.saved = None
        _state.progress = (total, total)


class _LeafCounts:
    """Counts, for each hooked leaf, the gradients still to come in this backward pass.

    A leaf can receive several contributions (a tied embedding weight gets two); its
    post-accumulate hooks run when the last edge into it has been processed, whether that
    edge carried a gradient or not, and only if at least one did (as in PyTorch).
    """

    def __init__(self, order: list) -> None:
        self.left: dict[int, int] = {}
        self.got: dict[int, bool] = {}
        for node in order:
            for inp in node.inputs:
                if inp is not None and inp._node is None and inp._grad_hooks:
                    self.left[id(inp)] = self.left.get(id(inp), 0) + 1

    def arrived(self, leaf, carried: bool) -> None:
        key = id(leaf)
        if key not in self.left:
            return
        self.got[key] = self.got.get(key, False) or carried
        self.left[key] -= 1
        if self.left[key] == 0 and self.got[key]:
            _run_hooks(leaf)

    def skipped(self, node) -> None:
        """A node no gradient reached: its edges into leaves arrive empty."""
        for inp in node.inputs:
            if inp is not None and inp._node is None and inp._grad_hooks:
                self.arrived(inp, False)


def _run_hooks(leaf) -> None:
    for hook in list(leaf._grad_hooks or ()):
        hook(leaf)


def _store_retained(node, g) -> None:
    """Give each output of ``node`` that called retain_grad() its (now complete) gradient."""
    grads = g if node.n_out > 1 else (g,)
    for ref, i in node.retained:
        t = ref()
        if t is None or grads[i] is None:
            continue
        gi = grads[i].detach()
        t.grad = gi.clone() if t.grad is None else t.grad + gi


def _add_pending(pending: dict, node, i: int, g) -> None:
    """Add gradient ``g`` of output ``i`` of ``node`` to what that node will receive."""
    key = id(node)
    if node.n_out == 1:
        prev = pending.get(key)
        pending[key] = g if prev is None else prev + g
    else:
        slots = pending.setdefault(key, [None] * node.n_out)
        slots[i] = g if slots[i] is None else slots[i] + g


def _grad_dests(node, g, pending: dict, handed: set):
    """Per input of ``node``, where its backward may write that input's gradient (see
    Context.grad_out), or None when no input has a destination.  A leaf's is its free slot:
    no gradient yet, a contiguous slot of its shape and dtype.  A non-leaf's is offered by
    its producer (``Function.grad_dest(node, out_index, resolve)``, e.g. split_heads' one
    buffer for q, k and v) once per pass, while no gradient of that output is pending.  Either only for an
    input this node has once (two writes would collide) and a destination sharing no storage
    with what the backward reads (its saved tensors, the incoming gradient)."""
    dests = None
    inputs = node.inputs
    for i, t in enumerate(inputs):
        if t is None:
            continue
        producer, index = (t._node, t._out_index) if t._history is None else edge(t, node)
        if producer is None:
            if t.grad is not None:
                continue
            d = getattr(t, "_grad_slot", None)
            if d is None or d.dtype is not t.dtype or d.shape != t.shape or not d.is_contiguous():
                continue
        else:
            d = _pending_dest(t, producer, index, pending, handed)
            if d is None:
                continue
        if sum(1 for u in inputs if u is t) > 1:
            continue
        if _backward_reads(d, node.ctx.saved, g):
            continue
        if dests is None:
            dests = [None] * len(inputs)
        dests[i] = d
    return dests


def _pending_dest(t, node, index: int, pending: dict, handed: set):
    """The destination ``node`` (t's producer, output ``index``: see :func:`edge`) offers for t's gradient, while none
    of it has arrived yet (a later one is added to it as usual, into new memory).  Each is
    handed out once per pass: a gradient written there may still be on its way (through a
    transpose's node) when another consumer of ``t`` runs, which must not write it again."""
    if node is None:
        return None
    hook = getattr(node.fn, "grad_dest", None)
    if hook is None:
        return None
    key = (id(node), index)
    if key in handed:
        return None
    got = pending.get(id(node))
    if got is not None and (node.n_out == 1 or got[index] is not None):
        return None
    handed.add(key)
    d = hook(node, index, lambda u: _pending_dest(u, *edge(u, node), pending, handed) if u is not None else None)
    if d is not None and (d.shape != t.shape or d.dtype is not t.dtype):
        return None
    return d


def _is_slot(g, slot) -> bool:
    """Whether the gradient ``g`` is the slot itself (a backward wrote it in place)."""
    return g._st is slot._st and g._off == slot._off and g.shape == slot.shape and g._strides == slot._strides


# How a gradient reaches an optimizer's packed slot: slot_writer(slot, g, add) sets (add=False) or
# adds to it.  The layer that launches kernels registers it (helios._kernels, at import): the tape
# itself imports no launcher.
_slot_writer: list = [None]


def set_grad_slot_writer(fn) -> None:
    """Register ``fn(slot, g, add)``, which writes (``add=False``) or adds (``add=True``) the
    gradient ``g`` into a parameter's packed gradient slot."""
    _slot_writer[0] = fn


def _slot_holding_grad(t, saved, incoming):
    """The packed slot of leaf ``t`` when ``t``'s gradient is already there (an earlier use's,
    in this pass or accumulated from an earlier one), else None; nor where the slot's flat
    buffer is what the backward reads (its saved tensors, the incoming gradient)."""
    slot = getattr(t, "_grad_slot", None)
    if slot is None or t.grad is None or not _is_slot(t.grad, slot):
        return None
    return None if _backward_reads(slot, saved, incoming) else slot


def _backward_reads(dest, saved, incoming) -> bool:
    """Whether a backward writing ``dest`` would write memory it reads: the storage of one of its
    ``saved`` tensors or of the ``incoming`` gradient (a tensor or a tuple of them)."""
    reads = (saved or ()) + (incoming if type(incoming) is tuple else (incoming,))
    return any(r is not None and r._st is dest._st for r in reads)


def _keep_in_slot(t, g) -> None:
    """Leaf ``t``'s whole gradient ``g`` (its slot's gradient added by the backward that took
    it): in the slot, written there unless the backward added in place."""
    slot = t._grad_slot
    if not _is_slot(g, slot):
        _slot_writer[0](slot, g if g.dtype is slot.dtype else g.to(slot.dtype), False)
    t.grad = slot


def _accumulate_leaf(t, g, given: set) -> None:
    if g.dtype != t.dtype:
        g = g.to(t.dtype)
    slot = getattr(t, "_grad_slot", None)
    if slot is not None:
        if t.grad is None and _is_slot(g, slot):  # written in place by the backward: nothing to copy
            t.grad = slot
            return
        # The optimizer packed this parameter: its gradient lives in a flat buffer.
        if t.grad is None or t.grad._st is not slot._st:
            _slot_writer[0](slot, g if t.grad is None else t.grad + g, False)
        else:
            _slot_writer[0](slot, g, True)  # a later contribution (the tied table's), added in the slot itself
        t.grad = slot
        return
    if t.grad is None:
        if id(g._st) in given or g._st is t._st:
            g = g.clone()
        given.add(id(g._st))
        t.grad = g.detach()
    else:
        # the old gradient's storage is no longer handed out (once freed, a new storage may
        # get its id, which must not read as given)
        given.discard(id(t.grad._st))
        t.grad = t.grad + g
        given.add(id(t.grad._st))
