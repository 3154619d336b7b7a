"""ZeroAdamW's gradient reduction: the gradients of every rank brought into this rank's shard.

Its one job is the way from the gradients backward leaves to the reduced gradients the update
reads (``helios.schedule.zero``'s module docstring, "Stage 2" and "Stage 3"): at stages 2-3
each segment's gradients land in a staging buffer that exists from the segment's first
gradient until its reduce-scatter into this rank's shard completes (issued by the comm hook
it installs in DDP once the segment's buckets are complete, or, for a subgroup's segment at
stage 3, once its parameters' gradients are); at any stage ``reduce_gradients()`` reduces what
backward passes accumulated inside ``no_sync()``.  It also says where this rank's reduced
gradients are (``gradient_buffers``, ``grad_shards``, ``grad_range``) for the step and the clip.

``GradientReducer(ddp, stage, groups, rt, staging_limit, transient, stats)`` works on the
optimizer's groups (``helios.schedule.zero_plan``'s layout, their ``gflat``/``gshard``); it
gathers no parameter and updates nothing.
"""

from __future__ import annotations

import helios.comm as dist
from helios import dtypes as dt
from helios import flat
from helios.autograd import tape
from helios.autograd.tape import no_grad
from helios.flat import LazyStorage
from helios.schedule.zero_plan import Segment, view_f32
from helios.tensor import Tensor

_F32 = dt.float32


def _in_slot(p: Tensor) -> bool:
    """Whether ``p``'s gradient is its gradient slot's memory (else it landed elsewhere: a cast)."""
    g, slot = p.grad, p.grad_slot
    return g.untyped_storage() is slot.untyped_storage() and g.storage_offset() == slot.storage_offset()


class _DoneWork:
    """The Work of a DDP bucket that only completes part of a segment: nothing to wait for."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _SegmentWork:
    """The reduce-scatter of one segment's gradients: ``wait()`` also frees its staging buffer."""

    def __init__(self, reducer: "GradientReducer", seg: Segment, work, temp: Tensor | None) -> None:
        self.reducer, self.seg, self.work, self.temp = reducer, seg, work, temp
        self.done = False

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.reducer._finish_reduce(self)
        return True


class GradientReducer:
    """Reduces the gradients of a ``ZeroAdamW``'s segments into this rank's shard.

    ``groups`` are the optimizer's (complete segments; their buffers may come later);
    ``staging_limit`` bounds the staging bytes in flight; ``transient`` counts them under
    ``"grad_staging"``; ``stats`` is the optimizer's counter dict (``reduce_scatters``)."""

    def __init__(self, ddp, stage: int, groups: list, rt, staging_limit: int, transient, stats: dict) -> None:
        self.ddp, self.stage, self.groups, self.rt = ddp, stage, groups, rt
        self.pg = ddp.group
        self.world = dist.get_world_size(self.pg)
        self.staging_limit = staging_limit
        self.transient, self.stats = transient, stats
        self._inflight: list[_SegmentWork] = []
        self._armed = False
        self._seg_of_storage: dict[int, Segment] = {}
        self._seg_of_param = {id(p): s for g in groups for s in g.segs for p in s.params}

    # ---- set-up ------------------------------------------------------------------------------
    def staging_buffer(self, s: Segment) -> LazyStorage:
        """Segment ``s``'s full gradients (stages 2-3): memory only from its first gradient to its reduction."""
        st = LazyStorage(self.rt, s.world * s.c * 4, "activations", self.stage_on_demand, s)
        self._seg_of_storage[id(st)] = s
        return st

    def watch_replica_gradients(self) -> None:
        """Stage 3: reduce each subgroup segment (``param_replicas``) as soon as its gradients are complete."""
        for g in self.groups:
            for s in g.segs:
                if s.sub:
                    for p in s.params:
                        p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def stage_on_demand(self, st: LazyStorage) -> None:
        """The first gradient of a segment lands: give it a staging buffer (its padding zeroed)."""
        s = st.owner
        # The host records backward far ahead of the device: bound the staging it allocates by
        # waiting for the oldest reduction in flight (the same order on every rank: no deadlock).
        while self._inflight and self.transient.now("grad_staging") + st.nbytes > self.staging_limit:
            self._inflight[0].wait()
        got = st.materialize()
        s.staged_bytes = got
        self.transient.count("grad_staging", got)
        if s.c * s.world > s.numel:
            flat.fill_(view_f32(st, s.numel, s.c * s.world - s.numel), 0)

    def drop_staging(self, s: Segment) -> None:
        """Free segment ``s``'s staging buffer (its gradients are reduced, or dropped)."""
        if isinstance(s.gfull, LazyStorage) and s.gfull.materialized:
            self.transient.count("grad_staging", -s.gfull.release())

    # ---- reduce-scatter as backward runs (stages 2-3) -----------------------------------------
    def _buckets_per_segment(self, ddp) -> dict:
        counts: dict[int, int] = {}
        for b in ddp.buckets:
            counts[b.storage_key] = counts.get(b.storage_key, 0) + 1
        return counts

    def comm_hook(self, ddp, bucket):
        """DDP hands over a complete bucket; once all buckets of a segment are in, reduce-scatter it."""
        s = self._seg_of_storage.get(bucket.storage_key)
        if s is None:
            raise RuntimeError("ZeroAdamW: DDP handed over a gradient bucket outside the optimizer's buffers")
        s.launched += 1
        if s.launched < self._buckets_per_segment(ddp)[bucket.storage_key]:
            return _DoneWork()
        s.launched = 0
        self._reap()
        return self._launch_reduce(s)

    def _launch_reduce(self, s: Segment) -> _SegmentWork:
        """Reduce-scatter segment ``s``'s staged gradients over its group into this rank's shard,
        asynchronously: averaged over the model's group, or summed over a subgroup (divided by
        the model group's size when it completes, ``_finish_reduce``)."""
        g = self.groups[s.gi]
        temp = None
        out = flat.elements(g.gshard, s.so, s.c)
        if s.has_grad:  # gradients are accumulating over backward passes: reduce beside, then add
            temp = flat.empty((s.c,), _F32, self.rt)
            out = temp
        if not s.gfull.materialized:  # no gradient at all reached it (cannot happen under DDP, which fills them)
            self.stage_on_demand(s.gfull)
        work = dist.reduce_scatter(out, view_f32(s.gfull, 0, s.c * s.world), op="sum" if s.sub else "avg",
                                   group=s.pg, async_op=True)
        self.stats["reduce_scatters"] += 1
        sw = _SegmentWork(self, s, work, temp)
        self._inflight.append(sw)
        return sw

    def _mean_over_model(self, t: Tensor) -> None:
        """A subgroup segment's reduced sum (in place) divided by the model group's size: every
        rank of the subgroup summed gradients of tokens from all of the model group's losses
        (expert parallelism), so this is the mean loss's gradient, as data parallel's average
        is for the other parameters (helios.schedule.moe.average_expert_gradients)."""
        flat.mul_(t, 1.0 / self.world)

    def _reap(self) -> None:
        """Finish the reductions that are already done (frees their staging buffers early)."""
        while self._inflight and self._inflight[0].is_completed():
            self._inflight[0].wait()

    def _finish_reduce(self, sw: _SegmentWork) -> None:
        sw.work.wait()
        s = sw.seg
        if s.sub:  # summed over the subgroup: now the mean over the model group's losses
            self._mean_over_model(sw.temp if sw.temp is not None else flat.elements(self.groups[s.gi].gshard, s.so, s.c))
        if sw.temp is not None:
            flat.add_(flat.elements(self.groups[s.gi].gshard, s.so, s.c), sw.temp)
        s.has_grad = True
        for p in s.params:  # the full-size gradient is gone: its reduced shard is what is left
            p.grad = None
        self.drop_staging(s)
        sw.done = True
        if sw in self._inflight:
            self._inflight.remove(sw)

    def finish_all(self) -> None:
        """Finish every reduction still in flight (a step right after backward finds none)."""
        for sw in list(self._inflight):
            sw.wait()

    def _on_grad_ready(self, p: Tensor) -> None:
        self._arm()
        self._replica_grad_ready(self._seg_of_param[id(p)], p)

    def _replica_grad_ready(self, s: Segment, p: Tensor) -> None:
        """Stage 3: ``p``'s gradient is complete, ``p`` in a subgroup segment (``param_replicas``).
        DDP leaves these parameters alone, so the segment is reduce-scattered over its subgroup
        here once all its gradients are complete, as DDP's buckets are for the others (and, like
        them, not inside ``no_sync()``: the staging keeps the local sum until a synchronised
        backward).  Every rank of the subgroup runs the same backward: the same order."""
        if not _in_slot(p):
            flat.copy_into(p.grad_slot, p.grad)  # a gradient outside its slot: put it in place
            p.grad = p.grad_slot
        s.ready += 1
        if s.ready == len(s.params) and self.ddp.synchronizing:
            flat.flush(self.rt)  # the gradients end a submission of their own, as DDP's buckets do
            self._reap()
            self._launch_reduce(s)

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            tape.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._armed = False
        for g in self.groups:
            for s in g.segs:
                s.ready = 0

    # ---- reduce after no_sync() (stages 1-2) --------------------------------------------------
    @no_grad()
    def reduce_gradients(self) -> None:
        """See ``ZeroAdamW.reduce_gradients``."""
        if self.stage == 3:
            raise ValueError("ZeroAdamW.reduce_gradients: stage 3 gathers and reduces each unit during backward; "
                             "it cannot run backward outside the model's hooks (use stage 1 or 2)")
        self.finish_all()
        works = []
        for g in self.groups:
            self._slot_gradients(g)
            if self.stage == 1:
                works += self._all_reduce_flat(g)
        if self.stage == 2:
            # The segments in one order on every rank (collectives must match), as the comm hook does.
            for g in self.groups:
                for s in g.segs:
                    flat.flush(self.rt)
                    self._launch_reduce(s)
        for w in works:
            w.wait()
        self.finish_all()

    def _slot_gradients(self, g) -> None:
        """Every gradient of group ``g`` in its slot, a missing one as zero."""
        for s in g.segs:
            if self.stage == 2 and not s.gfull.materialized:
                self.stage_on_demand(s.gfull)  # no gradient reached this segment: it counts as zero
                flat.fill_(view_f32(s.gfull, 0, s.numel), 0)
            for p in s.params:
                if p.grad is None:
                    # no gradient: zero, as DDP's find_unused_parameters counts it (the slot may
                    # hold a stale sum at stage 1, or uninitialised staging memory at stage 2)
                    flat.fill_(p.grad_slot, 0)
                elif not _in_slot(p):
                    flat.copy_into(p.grad_slot, p.grad)  # a gradient outside its slot: put it in place
                p.grad = p.grad_slot

    def _all_reduce_flat(self, g) -> list:
        """Stage 1: average group ``g``'s flat gradients (a subgroup's segments summed over their
        subgroup, now); the Works still in flight."""
        flat.flush(self.rt)
        if not any(s.sub for s in g.segs):
            return [dist.all_reduce(g.gflat, op="avg", group=self.pg, async_op=True)]
        works = []
        for s in g.segs:  # each segment over its own group (param_replicas)
            whole = view_f32(s.gfull, s.go, s.world * s.c)
            if s.sub:
                dist.all_reduce(whole, op="sum", group=s.pg)
                self._mean_over_model(whole)
            else:
                works.append(dist.all_reduce(whole, op="avg", group=self.pg, async_op=True))
        return works

    # ---- where the reduced gradients are ------------------------------------------------------
    def gradient_buffers(self) -> list:
        """The gradient buffers the step reads, whole (``ZeroAdamW.local_gradients``; finish
        the reductions in flight first)."""
        return [g.gflat for g in self.groups] if self.stage == 1 else [g.gshard for g in self.groups]

    def grad_shards(self) -> list:
        """This rank's gradients: views of the chunks it owns."""
        views = []
        for g in self.groups:
            if self.stage == 1:
                views += [view_f32(s.gfull, s.go + s.rank * s.c, s.c) for s in g.segs]
            else:
                views.append(g.gshard)
        return views

    def grad_range(self, s: Segment, a: int, start: int, stop: int) -> Tensor:
        """This rank's gradient elements [start, stop) of the parameter at ``a`` in segment ``s``."""
        if self.stage == 1:
            return view_f32(s.gfull, s.go + a + start, stop - start)
        g = self.groups[s.gi]
        return flat.elements(g.gshard, s.so + a + start - s.rank * s.c, stop - start)


__all__ = ["GradientReducer"]
