"""ZeRO for data parallel with AdamW in float32: shard the optimizer state (stage 1), the
gradients too (stage 2) and the parameters too (stage 3) over the data-parallel ranks.

    from helios.schedule.ddp import DistributedDataParallel
    from helios.schedule.zero import ZeroAdamW, memory_report

    model = DistributedDataParallel(GPT(cfg), bucket_cap_mb=25)   # before the optimizer, as always
    gpt = model.module
    decay = [p for p in gpt.parameters() if p.ndim >= 2]
    other = [p for p in gpt.parameters() if p.ndim < 2]
    opt = ZeroAdamW(model, [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                    stage=2, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    for step, (x, y) in enumerate(batches):
        _, loss = model(x, y)
        loss.backward()                  # stage 2/3: each bucket is reduce-scattered as soon as it is complete
        norm = opt.clip_grad_norm_(1.0)  # the global norm: this rank's shard squared and summed, all-reduced
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()                       # this rank's shard only; stages 1-2 then all-gather the parameters
        opt.zero_grad()

``ZeroAdamW(model, params=None, stage=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
weight_decay=1e-2, staging_limit_mb=None)`` takes the ``DistributedDataParallel`` model (built
first, so every rank starts from rank 0's parameters) and, like ``helios.optim.AdamW``, a list of parameters or of parameter groups
(dicts with ``"params"`` and any hyper-parameter); ``None`` means every trainable parameter
in one group.  The groups must hold every trainable parameter of the model exactly once (DDP
reduces them all), all float32 and contiguous; build the optimizer before the first forward
pass.  ``param_groups`` is the usual list of dicts: set ``g["lr"]`` between steps.  The
update is the ``adamw`` kernel of ``helios.optim.AdamW``, element for element, so N ranks at
any stage give one rank's losses and parameters to float tolerance.  ``staging_limit_mb``
(stages 2-3, default twice the DDP bucket size) bounds the gradient staging buffers: the host
records backward far ahead of the device, so before staging one more segment beyond the limit
backward waits for the oldest reduction in flight.

Methods: ``step()``; ``zero_grad(set_to_none=True)`` (gradients are always dropped: a shard
is overwritten by the next reduction); ``clip_grad_norm_(max_norm) -> Tensor`` (the global L2
norm as a device scalar, gradients scaled by ``min(1, max_norm / (norm + 1e-6))`` as
``helios.optim.clip_grad_norm_`` does; call it instead of that function, which cannot see a
sharded gradient); ``full_parameters() -> {name: ndarray}`` (every rank must call it at stage
3: it gathers); ``shard_ranges()``, ``state_dict()`` and ``load_shard_state(sd)`` (below);
``memory_report()``; ``expected_memory()`` (the formula's bytes per category at the padded
Psi); ``moment_ranges()``, ``moment_shards()`` and ``load_moment_shards()`` (the moments by
parameter, as helios-train's checkpoint code reads and writes them).

``reduce_gradients()`` (stages 1-2) reduces gradients that backward passes accumulated inside
``no_sync()``, for a caller that runs backward itself and must touch the local sums first: a
pipeline stage (helios-train ``--pp --zero 1|2``) sums the tied embedding's two gradients
between its first and last stage, then reduces.  ``clip_grad_norm_(max_norm, tp_group=None,
pp_group=None, counted=None)``: with ``pp_group`` the squares are also summed over the pipeline's
stages, each counting only the parameters ``counted(name)`` accepts (the stage's ``owns``).

A caller that runs the model's units itself instead of calling the model (a pipeline stage,
helios-train ``--pp --zero 3``) runs each pass inside ``forward_scope()``: the bookkeeping the
model's forward does (DDP's buckets, stage 3's unit order and on-the-spot gathers);
``all_reduce_gradient(name, group)`` then sums a parameter's reduced gradient over ``group``
(a pipeline's tied table on its first and last stage, sharded alike).  An interleaved
pipeline stage (``--pp-virtual --zero 3``) runs each backward of one chunk inside
``chunk_scope(params)``: only that chunk's parameters get gradients, so DDP reduces only their
buckets (``DistributedDataParallel.reducing_only``) and only their units are prefetched.  A
gather in flight keeps its buffer's version (the values are the ones it held before): an op may
save a prefetched unit's parameter for backward while the gather runs.

``param_replicas={name: group}`` (any stage): parameters that are not replicated over every
rank of the model's group but over a subgroup of it, each subgroup's ranks holding the same
values: expert parallelism's experts, replicated over the expert-data-parallel group (the
data-parallel ranks / ep) while the dense parameters are replicated over all the
data-parallel ranks.  Each is sharded over its own group, as DeepSpeed-MoE shards expert
parameters' optimizer state over the expert-data-parallel group: its segments are separate
(padded to that group's size), updated on that group's chunk and all-gathered over it.  DDP
must leave them alone (``params_to_ignore``; ``ZeroDataParallel`` does it).  At stages 1-2
``reduce_gradients()`` reduces them, after backward passes run inside ``no_sync()``; at stage
3 a unit's parameters of each group form a segment of their own, gathered over that group
before the unit runs, and backward reduce-scatters a subgroup segment over its subgroup as
soon as its gradients are complete (not inside ``no_sync()``), as DDP's buckets do for the
rest.  Either way the gradients are summed over the subgroup and divided by the model group's
size, the mean loss's gradient when each subgroup rank's parameters received the gradients of
every token the model group's ranks sent them
(``helios.schedule.moe.average_expert_gradients``' arithmetic).  The clip's sum of
squares over the model group then counts every shard of every subgroup once.
``replica_group(name)`` says which group a parameter is sharded over.

``ZeroDataParallel(module, stage, params, lr=..., bucket_cap_mb=25, ...)`` is the DDP model and
its ``ZeroAdamW`` in one object (a ``DistributedDataParallel`` whose optimizer methods are the
ZeroAdamW's), for a trainer that holds one object as both.

A tensor-parallel model (``TensorParallelGPT``) takes any stage: wrap it in DDP over the grid's
data-parallel group (``group=grid.dp_group``), so each tensor-parallel rank's shards (and its
replicated parameters) are partitioned over the ranks that hold the same shards; stage 3
gathers them over that group only, and the tensor-parallel collectives run on the gathered
shards unchanged (helios-train ``--dp 2 --tp 2 --zero 3``).  Clip with
``clip_grad_norm_(max_norm, tp_group=grid.tp_group)``.  With expert parallelism too
(``--tp --ep``), ``param_replicas`` names the experts' expert-data-parallel group of this TP
rank; the clip counts a shard in full over the TP group only where its TP peers hold other
parts of the tensor (an expert bias split over the expert-parallel ranks alone counts once).

Layout
------
Each parameter group is cut into *segments*: stage 1, one segment per group; stage 2, runs
of parameters of at most the DDP bucket size, taken in reverse registration order as DDP
cuts its buckets; stage 3, the parameters of one *unit* (a top-level child module of the
model, the children of a ``ModuleList`` such as GPT's ``h`` being units themselves;
parameters outside every unit form a root unit) that belong to the group.  With
``param_replicas`` each of these is split further by the group its parameters are sharded
over, N then being that group's size.  A segment of L elements is padded to N*c elements, c
a multiple of the device's storage-offset alignment (4 floats on lavapipe), and rank r owns
its chunk [r*c, (r+1)*c).  Each rank keeps, per group, shard buffers with the chunks of
every segment one after the other: the two AdamW moments (stages 1-3), the reduced
gradients (stages 2-3) and the parameters (stage 3).
The update binds parameters, gradients and moments each at their own aligned offset, so
one ``adamw`` dispatch updates one chunk in place.

- Stage 1: parameters and gradients stay in full flat buffers (the segment layout,
  padding zero); DDP all-reduces the gradient buckets as usual.  ``step`` updates this
  rank's chunk and all-gathers each segment's parameters.
- Stage 2: a parameter's gradient slot is a view of its segment's staging buffer, which
  is allocated when the first gradient of the segment lands and freed as soon as the
  segment is reduce-scattered (the comm hook this optimizer installs in DDP) into the
  shard-sized gradient buffer: the full flat gradient buffer never exists, only the
  staging buffers of the segments between their first gradient and their reduction.
  After backward ``p.grad`` is ``None``; the reduced gradients are in the shard.  Inside
  ``no_sync()`` the staging buffers are kept (they hold the local sum) until the next
  synchronised backward reduces them.
- Stage 3: also the parameters live in shards; a unit's full parameters are all-gathered
  into a buffer of their own just before its forward (the next unit's gather is issued
  asynchronously at the same time), freed after its forward, gathered again when backward
  reaches the unit's output (prefetching the unit before it) and freed once the unit's
  gradients are complete.  The order is the forward order of the first step.  A parameter
  read outside its unit while it is not gathered (GPT's tied output embedding) is gathered
  on the spot during a forward or backward pass and kept until the end of backward;
  anywhere else that read raises (use ``full_parameters()``, on every rank).

Bytes per rank (Psi trainable float32 parameters, N ranks; the weights pool holds exactly
these buffers, the transient ones live in the activations pool)::

    stage   params    grads     moments   transient
    1       4 Psi     4 Psi     8 Psi/N   -
    2       4 Psi     4 Psi/N   8 Psi/N   staging of the segments being reduced
    3       4 Psi/N   4 Psi/N   8 Psi/N   gathered units: the one computing, the next (prefetched),
                                          and one read outside its unit (GPT's tied embedding);
                                          the staging of one unit's gradients

Psi is rounded up per segment to N*c; ``memory_report()`` gives the formula at Psi and at
the padded size, the bytes asked of the pool and the bytes the pool holds for them (its
size classes round up), measured from ``rt.pool_stats()``.

State dict (sharded)
--------------------
``state_dict()`` returns::

    {"stage": int, "world_size": N, "rank": r, "step": int,
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "params": [parameter names]}, ...],
     "tensors": {KEY: {"shape": global shape (tuple), "dtype": "float32",
                       "start": int, "stop": int, "data": float32 ndarray of shape (stop - start,)}}}

KEY is ``"param." + name``, ``"exp_avg." + name`` or ``"exp_avg_sq." + name`` for each
trainable parameter (names as ``model.module.named_parameters()`` gives them) and [start,
stop) is the range of the flattened (row-major) global tensor this rank owns; the ranges of
the N ranks partition each tensor (a rank's range may be empty).  ``shard_ranges()`` gives
``{KEY: (shape, start, stop)}`` for this rank without reading any data, so a loader of a
checkpoint written at another world size or stage reads just those ranges and calls
``load_shard_state({"step": int, "param_groups": [...] (optional), "tensors": {KEY: ndarray or
{"data": ndarray}}})`` on every rank (it is collective: stages 1-2 all-gather the loaded
parameters).
"""

from __future__ import annotations

import contextlib

import helios.comm as dist
import helios.functional as F
from helios import dtypes as dt
from helios import flat
from helios.autograd.tape import no_grad
from helios.nn import Module
from helios.optim import Optimizer, adamw_constants
from helios.schedule.ddp import DistributedDataParallel
from helios.schedule.zero_grads import GradientReducer
from helios.schedule.zero_plan import Group, Segment, Unit, ZeroPlan, view_f32
from helios.schedule.zero_stage3 import UnitParameters
from helios.schedule.zero_state import TransientBytes, ZeroStateIO, state_bytes_formula, memory_report  # noqa: F401  (re-exported)
from helios.tensor import Tensor

_F32 = dt.float32


# ---- the optimizer -------------------------------------------------------------------------------
class ZeroAdamW(Optimizer):
    """AdamW whose state (stage 1), gradients (stage 2) and parameters (stage 3) are sharded
    over the ranks of a ``DistributedDataParallel`` model; see the module docstring.

    It owns the buffers and the update; the layout is its ``plan`` (``ZeroPlan``, zero_plan.py),
    the gradients' reduction its ``reducer`` (``GradientReducer``, zero_grads.py), stage 3's
    gathers and releases its ``unit_params`` (``UnitParameters``, zero_stage3.py) and the state
    going in and out its ``ZeroStateIO`` (zero_state.py)."""

    def __init__(self, model: DistributedDataParallel, params=None, stage: int = 1, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 staging_limit_mb: float | None = None, param_replicas: dict | None = None):
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"ZeroAdamW shards over the ranks of a DistributedDataParallel model, got "
                            f"{type(model).__name__}: wrap the model first")
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroAdamW: stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain AdamW)")
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"ZeroAdamW: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        if params is None:
            params = [p for _, p in named]
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.ddp, self.stage, self.pg = model, stage, model.group
        self.world = dist.get_world_size(self.pg)
        self.rank = dist.get_rank(self.pg)
        self.plan = ZeroPlan(model, self.param_groups, named, stage, param_replicas or {})
        self._io = ZeroStateIO(self)
        self._replicas_reduced = False  # reduce_gradients() ran since zero_grad (param_replicas need it)
        if getattr(model, "_own_flat", None):
            raise RuntimeError("ZeroAdamW: the model already ran a forward pass with gradient buffers of its own; "
                               "build the optimizer right after wrapping the model")
        p0 = self.param_groups[0]["params"][0]
        self.rt = p0.untyped_storage().rt  # the device runtime (helios.backend's contract) the parameters live on
        self._q = max(1, flat.alignment(self.rt) // 4)
        self.plan.q = self._q
        self._bytes = {k: {"requested": 0, "pool": 0, "buffers": []} for k in ("params", "grads", "moments")}
        self.transient = TransientBytes(("grad_staging", "gathered_params"))
        # Counts since construction: unit gathers issued (stage 3), those issued ahead of use
        # (prefetches), those forced by a read of an ungathered parameter, reduce-scatters.
        self.stats = {"gathers": 0, "prefetches": 0, "on_demand_gathers": 0, "reduce_scatters": 0}
        self.groups: list[Group] = [self.plan.layout(gi, g["params"]) for gi, g in enumerate(self.param_groups)]
        self.units: list[Unit] = self.plan.units  # stage 3 (made with the layout)
        largest = max(s.c * s.world * 4 for g in self.groups for s in g.segs)
        staging_limit = (max(2 * model.bucket_cap_bytes, largest) if staging_limit_mb is None
                         else int(staging_limit_mb * (1 << 20)))
        self.reducer = GradientReducer(model, stage, self.groups, self.rt, staging_limit, self.transient, self.stats)
        self.unit_params = UnitParameters(model, stage, self.units, self.plan.unit_of, self.groups, self.rt,
                                          self.transient, self.stats)
        with no_grad():
            for g in self.groups:
                self._allocate(g)
        if stage >= 2:
            model.register_comm_hook(self.reducer.comm_hook)
        if stage == 3:
            self.reducer.watch_replica_gradients()
            self.unit_params.install(p for _, p in named)

    # ---- construction (the layout: ZeroPlan, zero_plan.py) ----------------------------------------
    def replica_group(self, name: str):
        """The process group parameter ``name`` is sharded over: the model's, or its subgroup
        from ``param_replicas``."""
        return self.plan.replica_group(name)

    def _persist(self, category: str, n: int) -> Tensor:
        """A zero-filled float32 buffer of n elements in the weights pool, counted under ``category``."""
        before = flat.pool_in_use(self.rt, "weights")
        t = flat.zeros((n,), _F32, self.rt, pool="weights")
        got = flat.pool_in_use(self.rt, "weights") - before
        b = self._bytes[category]
        b["requested"] += n * 4
        b["pool"] += got
        b["buffers"].append(n * 4)
        return t

    def _allocate(self, g: Group) -> None:
        """Group ``g``'s buffers for the plan's layout, the parameters moved into them."""
        st3 = self.stage == 3
        if self.stage <= 2:
            g.pflat = self._persist("params", g.full_n)
        if self.stage == 1:
            g.gflat = self._persist("grads", g.full_n)
        else:
            g.gshard = self._persist("grads", g.shard_n)
        if st3:
            g.pshard = self._persist("params", g.shard_n)
        g.m = self._persist("moments", g.shard_n)
        g.v = self._persist("moments", g.shard_n)
        for s in g.segs:
            if st3:
                s.pfull = self.unit_params.gather_buffer(s)
                r = s.rank
                for p, a in zip(s.params, s.rel):  # this rank's chunk of the current values
                    lo, hi = max(a, r * s.c), min(a + p.numel(), (r + 1) * s.c)
                    if lo < hi:
                        flat.copy_into(flat.elements(g.pshard, s.so + lo - r * s.c, hi - lo),
                                       flat.elements(p, lo - a, hi - lo))
            else:
                s.pfull = g.pflat.untyped_storage()
                for p, a in zip(s.params, s.rel):
                    flat.copy_into(s.pfull.view(s.po + a, p.shape, _F32), p)
            if self.stage == 1:
                s.gfull, s.go = g.gflat.untyped_storage(), s.po
            else:
                s.gfull = self.reducer.staging_buffer(s)
            for p, a in zip(s.params, s.rel):
                p.set_(s.pfull, s.po + a)  # the parameter now lives in the segment's full buffer
                p.grad_slot = s.gfull.view(s.go + a, p.shape, _F32)
                p.grad = None

    # ---- passes run by the caller (stage 3's gathers: UnitParameters, zero_stage3.py) --------------
    @contextlib.contextmanager
    def forward_scope(self):
        """The bookkeeping of the model's own forward (and of DDP's, which builds the gradient
        buckets), for a caller that runs the model's units itself instead of calling the model
        (a pipeline stage's ``train_step``, which runs its micro-batches' forwards and backwards
        in 1F1B order): stage 3 records the units' order from the first one and allows a
        parameter read outside its unit (the tied output layer) to be gathered on the spot;
        without gradients everything is released at the end."""
        with self.unit_params.forward_scope():
            yield self

    def chunk_scope(self, params):
        """Backward passes inside give gradients to ``params`` only: one chunk of an interleaved
        pipeline stage's layers (helios-train ``--pp-virtual --zero 3``), whose backward runs
        that chunk's units alone.  DDP reduces the buckets of those parameters only (the other
        chunks' segments wait for their own backward, instead of counting as unused), and stage
        3 prefetches only their units.  A unit must lie wholly inside ``params`` or outside;
        every rank of the group gives the same ones."""
        return self.unit_params.chunk_scope(params)

    # ---- gradients (GradientReducer, zero_grads.py) ------------------------------------------------
    def settle(self) -> None:
        """Finish every reduction still in flight (a step right after backward finds none) and,
        at stage 3, give back every gathered unit."""
        self.reducer.finish_all()
        if self.stage == 3:
            self.unit_params.release_all()

    def local_gradients(self) -> list:
        """The gradient buffers this rank's step reads, whole: each group's full flat buffer at
        stage 1 (every gradient, so ``p.grad`` stays consistent), this rank's shard at stages 2
        and 3; the reductions in flight finish first.  The clip scales these, and a loss scaler
        unscales them (its inf/nan test then needs the other ranks' findings: a shard is one
        rank's part)."""
        self.settle()
        return self.reducer.gradient_buffers()

    def reduce_gradients(self) -> None:
        """Reduce, now, the gradients that backward passes accumulated locally (inside the model's
        ``no_sync()``), as DDP's next synchronised backward would: stage 1 averages the flat
        gradient buffers over the ranks, stage 2 reduce-scatters each segment's staging buffer
        into this rank's shard.  For a caller that runs backward itself and must touch the local
        sums before they are reduced: a pipeline stage (its micro-batches in 1F1B order, then the
        tied embedding's two gradients summed between the first and the last stage).  Every rank
        of the group calls it, after the same backward passes."""
        self.reducer.reduce_gradients()
        self._replicas_reduced = True

    @no_grad()
    def all_reduce_gradient(self, name: str, group) -> None:
        """Sum this rank's reduced gradient of parameter ``name`` over ``group`` (in place): for a
        parameter held by two models sharded alike, whose gradients add up (a pipeline's tied
        table on its first and last stage, each stage's rank i owning the same range)."""
        self.settle()
        for n, p, s, a, start, stop in self._ranges():
            if n == name:
                if self.stage == 1:  # every rank holds the whole reduced gradient
                    start, stop = 0, p.numel()
                if stop > start:  # (the ranks of the group own the same range: empty on all of them, or on none)
                    v = self.reducer.grad_range(s, a, start, stop)
                    whole = flat.copy(v)
                    dist.all_reduce(whole, group=group)
                    flat.copy_into(v, whole)
                return
        raise KeyError(f"ZeroAdamW: no parameter {name!r}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients: the shards are overwritten by the next reduction, staging buffers freed."""
        self.settle()
        self._replicas_reduced = False
        for g in self.groups:
            for s in g.segs:
                s.has_grad = False
                s.launched = 0
                for p in s.params:
                    p.grad = None
                if self.stage >= 2:
                    self.reducer.drop_staging(s)

    # ---- the update ----------------------------------------------------------------------------
    def _adamw(self, consts: tuple, ops: list, off: int, n: int) -> None:
        """Record ``adamw`` over elements [off, off + n) of four (storage, aligned base) operands."""
        flat.adamw_(*(view_f32(st, base + off, n) for st, base in ops), consts)

    @no_grad()
    def step(self) -> None:
        """One AdamW update of this rank's shard (then stages 1-2 all-gather the parameters)."""
        if self.plan.replicas and self.stage < 3 and not self._replicas_reduced:
            # DDP's hooks reduce only the model group's parameters: the others would step on local sums.
            raise RuntimeError("ZeroAdamW.step: the parameters of param_replicas are reduced by reduce_gradients() "
                               "only; run backward inside no_sync(), then call reduce_gradients() before step()")
        self.settle()
        self.step_count += 1
        works = []
        for hp, g in zip(self.param_groups, self.groups):
            consts = adamw_constants(hp, self.step_count)
            if self.stage == 3:
                self._step_shard(consts, g)
            else:
                works += self._step_full(consts, g)
        for w in works:
            w.wait()
        for g in self.groups:
            for s in g.segs:
                flat.mark_written(s.pfull)  # graphs recorded before the update must not be differentiated after it

    def _step_shard(self, consts: tuple, g: Group) -> None:
        """Stage 3: update the parameter shard of group ``g`` where it has reduced gradients."""
        if all(s.has_grad for s in g.segs):
            self._adamw(consts, [(g.pshard.untyped_storage(), 0), (g.gshard.untyped_storage(), 0),
                                 (g.m.untyped_storage(), 0), (g.v.untyped_storage(), 0)], 0, g.shard_n)
            return
        for s in g.segs:
            if s.has_grad:
                self._adamw(consts, [(g.pshard.untyped_storage(), s.so), (g.gshard.untyped_storage(), s.so),
                                     (g.m.untyped_storage(), s.so), (g.v.untyped_storage(), s.so)], 0, s.c)

    def _step_full(self, consts: tuple, g: Group) -> list:
        """Stages 1-2: update this rank's chunk of each segment of group ``g`` in the full
        parameters, then start all-gathering the updated segments; their Works."""
        updated = []
        for s in g.segs:
            ops = [(s.pfull, s.po + s.rank * s.c), None, (g.m.untyped_storage(), s.so), (g.v.untyped_storage(), s.so)]
            if self.stage == 2:
                if not s.has_grad:
                    continue
                ops[1] = (g.gshard.untyped_storage(), s.so)
                self._adamw(consts, ops, 0, s.c)
            else:
                ops[1] = (s.gfull, s.go + s.rank * s.c)
                ranges = self._stage1_ranges(s)
                for off, n in ranges:
                    self._adamw(consts, ops, off, n)
                if not ranges:
                    continue
            updated.append(s)
        return [dist.all_gather(view_f32(s.pfull, s.po, s.world * s.c), view_f32(s.pfull, s.po + s.rank * s.c, s.c),
                                group=s.pg, async_op=True) for s in updated]

    def _stage1_ranges(self, s: Segment) -> list:
        """(offset in this rank's chunk, count) to update: the whole chunk when every parameter has a gradient."""
        r, c = s.rank, s.c
        have = [p.grad is not None for p in s.params]
        if all(have):
            return [(0, c)]
        out = []
        for p, a, h in zip(s.params, s.rel, have):
            if not h:
                continue
            if p.grad.untyped_storage() is not s.gfull:
                flat.copy_into(p.grad_slot, p.grad)
            lo, hi = max(a, r * c), min(a + p.numel(), (r + 1) * c)
            if lo < hi:
                out.append((lo - r * c, hi - lo))
        return out

    # ---- the clip ------------------------------------------------------------------------------
    @no_grad()
    def clip_grad_norm_(self, max_norm: float, tp_group=None, pp_group=None, counted=None) -> Tensor:
        """Scale the gradients so their global L2 norm is at most ``max_norm``; returns the norm (a device scalar).

        The sum of squares of this rank's shard is all-reduced over the ranks (every rank gets
        the same norm); no host round trip beyond that one scalar.  ``tp_group``: the model is
        tensor parallel over that group (parameters with a ``tp_layout``): a tensor-parallel
        shard's squares are summed over it too, while a replicated parameter (the same
        gradient on every tensor-parallel rank) counts once.  ``pp_group`` and ``counted``: the
        model is one pipeline stage (``PipelineStage``); the squares are summed over the stages
        too, each counting only the parameters whose name ``counted(name)`` accepts (the stage's
        ``owns``: a tied table held by two stages counts once)."""
        self.settle()
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        parts = []
        if tp == 1 and counted is None:
            for v in self.reducer.grad_shards():
                parts.append(F.sum(v * v))
        else:
            for name, p, s, a, start, stop in self._ranges():
                if stop > start and (counted is None or counted(name)):
                    v = self.reducer.grad_range(s, a, start, stop)
                    # summed over the tp ranks below: a replicated parameter's 1/tp shares add to one
                    sharded = self._split_over_tp(p, s)
                    parts.append(F.sum(v * v) if sharded or tp == 1 else F.sum(v * v) * (1.0 / tp))
        if not parts:
            parts = [flat.zeros((), _F32, self.rt)]
        total = parts[0]
        for x in parts[1:]:
            total = total + x
        total = F.reshape(total, (1,)) if total.ndim == 0 else total
        total = flat.copy(total)
        dist.all_reduce(total, op="sum", group=self.pg)
        if tp > 1:
            dist.all_reduce(total, op="sum", group=tp_group)
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(total, op="sum", group=pp_group)
        norm = F.sqrt(F.reshape(total, ()))
        coef = F.clamp(F.rdiv(norm + 1e-6, float(max_norm)), max=1.0)
        for t in self.local_gradients():
            flat.mul_(t, coef)
        return norm

    def _split_over_tp(self, p: Tensor, s: Segment) -> bool:
        """Whether ``p`` (in segment ``s``) is a tensor-parallel shard whose tensor-parallel peers
        hold other parts of it, not the same values.  Its layout counts ``tp`` parts in all; the
        model group's ranks hold world / (s's group size) of them (an expert tensor's parts over
        the expert-parallel ranks, each sharded over its own replicas), so the parts left lie
        across the tensor-parallel ranks.  An expert bias split over the expert-parallel ranks
        only is the same on every tensor-parallel rank and counts once."""
        layout = getattr(p, "tp_layout", None)
        return layout is not None and layout.tp > self.world // s.world

    # ---- parameters, checkpoints, bytes (ZeroStateIO, zero_state.py) --------------------------
    def full_parameters(self) -> dict:
        """``{name: ndarray}`` of every trainable parameter, full size (at stage 3 every rank must call
        it: it gathers one unit at a time)."""
        return self._io.full_parameters()

    def _ranges(self):
        """Yield (name, parameter, segment, offset of the parameter in the segment, start, stop) for this rank."""
        return self.plan.ranges(self.groups)

    def shard_ranges(self) -> dict:
        """``{KEY: (global shape, start, stop)}``: the flat range of each tensor this rank owns."""
        return self._io.shard_ranges()

    def state_dict(self) -> dict:
        """This rank's shard of the parameters and moments, with the global ranges (module docstring)."""
        return self._io.state_dict()

    def load_shard_state(self, sd: dict) -> None:
        """Load this rank's ranges (``shard_ranges()``) of every tensor; collective (module docstring)."""
        self._io.load_shard_state(sd)

    # The interface of helios-train's checkpoint code (schedule/train_state.py): the moments by parameter.
    def moment_ranges(self) -> dict:
        """``{id(parameter): (start, stop)}``: the flat range of each parameter whose moments this rank holds."""
        return self._io.moment_ranges()

    def moment_shards(self) -> list:
        """``[(parameter, "exp_avg" | "exp_avg_sq", start, stop, float32 ndarray)]`` for this rank's ranges."""
        return self._io.moment_shards()

    def load_moment_shards(self, moments: dict) -> None:
        """Load ``{id(parameter): [exp_avg, exp_avg_sq]}``, each the ``moment_ranges()`` range of the moment."""
        self._io.load_moment_shards(moments)

    def expected_memory(self) -> dict:
        """The ZeRO formula's bytes per category at the padded Psi this layout uses (what ``requested`` is)."""
        return self._io.expected_memory()

    def memory_report(self) -> dict:
        return memory_report(self)

    @property
    def numel(self) -> int:
        """Psi: trainable parameters."""
        return sum(p.numel() for g in self.param_groups for p in g["params"])

    @property
    def padded_numel(self) -> int:
        """Psi rounded up per segment to N chunks of the aligned chunk size."""
        return sum(g.full_n for g in self.groups)

    def largest_unit_bytes(self) -> int:
        """Stage 3: bytes of the largest unit's gathered parameters (padded)."""
        return max((sum(s.c * s.world * 4 for s in u.segs) for u in self.units), default=0)


class ZeroDataParallel(DistributedDataParallel):
    """A ``DistributedDataParallel`` model and its ``ZeroAdamW`` in one object (helios-train holds one
    thing as model and optimizer): ``ZeroDataParallel(module, stage, params, lr=..., betas=..., eps=...,
    weight_decay=..., bucket_cap_mb=25, group=None, find_unused_parameters=False, param_replicas=None)``.
    Calling it runs the model; ``step``, ``zero_grad``, ``clip_grad_norm_``, ``param_groups``,
    ``step_count`` and the checkpoint methods are the optimizer's (``optimizer``); ``state_dict()``
    stays the model's.  ``param_replicas`` (``{name: group}``, see ZeroAdamW) are left out of DDP
    (not broadcast, not averaged) and sharded over their own group."""

    def __init__(self, module: Module, stage: int, params=None, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, bucket_cap_mb: float = 25.0, group=None,
                 find_unused_parameters: bool = False, staging_limit_mb: float | None = None,
                 param_replicas: dict | None = None) -> None:
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, group=group,
                         find_unused_parameters=find_unused_parameters, params_to_ignore=list(param_replicas or ()))
        self.optimizer = ZeroAdamW(self, params, stage=stage, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay, staging_limit_mb=staging_limit_mb,
                                   param_replicas=param_replicas)

    def replica_group(self, name: str):
        """See ZeroAdamW.replica_group."""
        return self.optimizer.replica_group(name)

    def all_reduce_gradient(self, name: str, group) -> None:
        """See ZeroAdamW.all_reduce_gradient."""
        self.optimizer.all_reduce_gradient(name, group)

    def forward_scope(self):
        """See ZeroAdamW.forward_scope."""
        return self.optimizer.forward_scope()

    def chunk_scope(self, params):
        """See ZeroAdamW.chunk_scope."""
        return self.optimizer.chunk_scope(params)

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.optimizer.step_count = value

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, tp_group=None, pp_group=None, counted=None) -> Tensor:
        """See ZeroAdamW.clip_grad_norm_."""
        return self.optimizer.clip_grad_norm_(max_norm, tp_group, pp_group, counted)

    def local_gradients(self) -> list:
        """See ZeroAdamW.local_gradients."""
        return self.optimizer.local_gradients()

    def reduce_gradients(self) -> None:
        """See ZeroAdamW.reduce_gradients."""
        self.optimizer.reduce_gradients()

    def _hyper(self) -> list:
        return self.optimizer._hyper()

    def moment_ranges(self) -> dict:
        return self.optimizer.moment_ranges()

    def moment_shards(self) -> list:
        return self.optimizer.moment_shards()

    def load_moment_shards(self, moments: dict) -> None:
        self.optimizer.load_moment_shards(moments)

    def expected_memory(self) -> dict:
        return self.optimizer.expected_memory()

    def memory_report(self) -> dict:
        return memory_report(self.optimizer)


__all__ = ["ZeroAdamW", "ZeroDataParallel", "memory_report"]
