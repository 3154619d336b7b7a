"""ZeroAdamW's stage-3 parameters: each unit's full parameters gathered just before they are
used and released just after.

Its one job is the lifetime of the gathered units (``helios.schedule.zero``'s module docstring,
"Stage 3"): a unit's parameters are all-gathered from the shards into a buffer of their own
before its forward (the next unit's gather issued asynchronously at the same time), freed
after its forward, gathered again when backward reaches the unit's output (prefetching the
unit before it) and freed once the unit's gradients are complete.  The order is the forward
order of the first step.  A parameter read outside its unit while it is not gathered (GPT's
tied output embedding) is gathered on the spot during a forward or backward pass.

``UnitParameters(ddp, stage, units, unit_of, groups, rt, transient, stats)`` works on the
plan's units (``helios.schedule.zero_plan``) and the groups' parameter shards; it reduces no
gradient and updates nothing.  At stages 1-2 it has no units and only keeps the forward
bookkeeping (``forward_scope``, ``chunk_scope``) that a pipeline stage runs its passes in.
"""

from __future__ import annotations

import contextlib
import threading

import helios.comm as dist
from helios import flat
from helios.autograd import tape
from helios.autograd.tape import Function
from helios.errors import HeliosError
from helios.flat import LazyStorage
from helios.nn import Module
from helios.schedule.zero_plan import Segment, Unit, view_f32
from helios.tensor import Tensor


class _PreBackward(Function):
    """Identity on a unit's output; its backward (run before any of the unit's own) gathers the unit."""

    @staticmethod
    def forward(ctx, x, owner, unit):
        ctx.owner, ctx.unit = owner, unit
        return x.detach()  # the same values (a new handle)

    @staticmethod
    def backward(ctx, g):
        ctx.owner._pre_backward(ctx.unit)
        return g, None, None


class UnitParameters:
    """Gathers and releases stage 3's units around their forward and backward passes.

    ``units`` and ``unit_of`` are the plan's (empty below stage 3); ``groups`` the optimizer's
    groups (their ``pshard`` is read when a unit is gathered); ``transient`` counts the
    gathered bytes under ``"gathered_params"``; ``stats`` is the optimizer's counter dict
    (``gathers``, ``prefetches``, ``on_demand_gathers``)."""

    def __init__(self, ddp, stage: int, units: list, unit_of: dict, groups: list, rt, transient, stats: dict) -> None:
        self.ddp, self.stage, self.rt = ddp, stage, rt
        self.units, self.unit_of, self.groups = units, unit_of, groups
        self.transient, self.stats = transient, stats
        self._fwd_depth = 0
        self._fwd_order: list[Unit] = []
        self._recording: list[Unit] | None = None
        self._armed = False
        self._backward_units = None  # ids of the units backward covers now (None: all; see chunk_scope)

    # ---- set-up ------------------------------------------------------------------------------
    def gather_buffer(self, s: Segment) -> LazyStorage:
        """Segment ``s``'s full parameters: memory only while its unit is gathered."""
        return LazyStorage(self.rt, s.world * s.c * 4, "activations", self.gather_on_demand, s)

    def install(self, params) -> None:
        """Wrap the units' and the model's forwards, and watch ``params``' gradients (a unit is
        released once all of its gradients are complete)."""
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        for u in self.units:
            if u.module is not None:
                self._wrap(u.module, u)
        self._wrap(self.ddp.module, None)

    def _wrap(self, module: Module, unit: Unit | None) -> None:
        inner = module.forward
        owner = self

        def forward(*args, **kwargs):
            if unit is None:
                return owner._root_forward(inner, args, kwargs)
            owner._pre_forward(unit)
            out = inner(*args, **kwargs)
            out = owner._mark_outputs(unit, out)
            owner.release(unit)
            return out

        object.__setattr__(module, "forward", forward)

    # ---- forward ----------------------------------------------------------------------------
    def _root_forward(self, inner, args, kwargs):
        self._fwd_depth += 1
        if self._fwd_depth == 1:
            self._recording = []
        try:
            return inner(*args, **kwargs)
        finally:
            self._fwd_depth -= 1
            if self._fwd_depth == 0:
                self._end_forward()

    def _end_forward(self) -> None:
        """The outermost forward ended: keep the first step's unit order; without gradients
        (no backward follows) give everything back now."""
        if self._recording and not self._fwd_order:
            self._fwd_order = self._recording
        self._recording = None
        if not tape.is_grad_enabled():
            self.release_all()

    @contextlib.contextmanager
    def forward_scope(self):
        """See ``ZeroAdamW.forward_scope``."""
        depth = self._fwd_depth
        if depth == 0:
            self.ddp.prepare_buckets()  # as DDP's forward does (a caller that runs the units never calls it)
        self._fwd_depth = depth + 1
        if depth == 0:
            self._recording = []
        try:
            yield
        finally:
            self._fwd_depth = depth
            if depth == 0:
                self._end_forward()

    @contextlib.contextmanager
    def chunk_scope(self, params):
        """See ``ZeroAdamW.chunk_scope``."""
        ids = {id(p) for p in params}
        units = None
        if self.stage == 3:
            units = {id(self.unit_of[i]) for i in ids if i in self.unit_of}
            split = [u.name for u in self.units if id(u) in units
                     and any(id(p) not in ids for s in u.segs for p in s.params)]
            if split:
                raise ValueError(f"ZeroAdamW.chunk_scope: unit {split[0] or 'root'} has parameters inside and "
                                 "outside the ones given; its gradients would be reduced half complete")
        prev = self._backward_units
        self._backward_units = units
        try:
            with self.ddp.reducing_only(params):
                yield
        finally:
            self._backward_units = prev

    def _order(self) -> list:
        return self._fwd_order or [u for u in self.units if u.module is not None]

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        order = self._order()
        if u not in order:
            return None
        i = order.index(u) + step
        return order[i] if 0 <= i < len(order) else None

    def _pre_forward(self, u: Unit) -> None:
        if self._recording is not None and u not in self._recording:
            self._recording.append(u)
        self.gather(u, wait=True)
        nxt = self._neighbour(u, 1)
        if nxt is not None:
            self.gather(nxt, wait=False)

    def _mark_outputs(self, u: Unit, out):
        if not tape.is_grad_enabled():
            return out
        if isinstance(out, Tensor):
            return _PreBackward.apply(out, self, u) if out.requires_grad else out
        if isinstance(out, tuple):
            return tuple(self._mark_outputs(u, o) for o in out)
        return out

    # ---- backward ---------------------------------------------------------------------------
    def _pre_backward(self, u: Unit) -> None:
        self._arm()
        self.gather(u, wait=True)
        prev = self._neighbour(u, -1)
        if prev is not None and prev.arrived < prev.n_params and self._covers(prev):
            self.gather(prev, wait=False)

    def _covers(self, u: Unit) -> bool:
        """Whether the backward running covers unit ``u`` (see ``chunk_scope``): one of another
        chunk is not prefetched, since no gradient of this backward reaches it."""
        return self._backward_units is None or id(u) in self._backward_units

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            tape.queue_callback(self._end_backward)

    def _on_grad_ready(self, p: Tensor) -> None:
        self._arm()
        u = self.unit_of[id(p)]
        u.arrived += 1
        if u.arrived == u.n_params:
            self.release(u)

    def _end_backward(self) -> None:
        self._armed = False
        for u in self.units:
            u.arrived = 0
        self.release_all()

    # ---- gather and release -----------------------------------------------------------------
    def gather(self, u: Unit, wait: bool) -> None:
        """All-gather the unit's full parameters (asynchronously unless ``wait``)."""
        if u.state == "released":
            for s in u.segs:
                got = s.pfull.materialize()
                u.bytes += got
                self.transient.count("gathered_params", got)
                g = self.groups[s.gi]
                s.pfull.filling = True  # the gather's write keeps the version (see LazyStorage)
                w = dist.all_gather(view_f32(s.pfull, 0, s.c * s.world), flat.elements(g.pshard, s.so, s.c),
                                    group=s.pg, async_op=True)
                s.pfull.waiter = threading.get_ident()  # a read on this thread waits for the gather
                u.pending.append((w, s.pfull, s.pfull.version))
            u.state = "pending"
            self.stats["gathers"] += 1
            self.stats["prefetches"] += not wait
        if wait and u.state == "pending":
            for w, st, version in u.pending:
                w.wait()
                st.waiter, st.filling = None, False
                st.version = version  # same values as before: saved-for-backward checks must not trip
            u.pending = []
            u.state = "gathered"

    def release(self, u: Unit) -> None:
        """Free the unit's gathered parameters (a gather in flight finishes first)."""
        if u.state == "released":
            return
        self.gather(u, wait=True)  # a gather in flight finishes before its buffer is freed
        for s in u.segs:
            s.pfull.release()
        self.transient.count("gathered_params", -u.bytes)
        u.bytes = 0
        u.state = "released"

    def release_all(self) -> None:
        """Free every unit's gathered parameters."""
        for u in self.units:
            self.release(u)

    def gather_on_demand(self, st: LazyStorage) -> None:
        """A parameter of an ungathered unit was read (``LazyStorage``'s ``on_demand``): gather its
        unit on the spot during a forward or backward pass; anywhere else, say what to call."""
        u = st.owner.unit
        if u.state == "pending":  # read while its gather is in flight: wait for it
            self.gather(u, wait=True)
            return
        if self._fwd_depth == 0 and tape.backward_progress()[1] == 0:
            raise HeliosError(f"ZeroAdamW stage 3: the parameters of {u.name or 'the root module'} are sharded over "
                              "the ranks and were read outside a forward or backward pass; call "
                              "opt.full_parameters() on every rank to read them")
        self.stats["on_demand_gathers"] += 1
        self.gather(u, wait=True)


__all__ = ["UnitParameters"]
