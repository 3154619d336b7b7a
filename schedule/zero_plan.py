"""ZeroAdamW's sharding plan: which rank owns which elements.

Its one job is the layout, decided once at construction and allocating nothing: the
parameter groups cut into *segments* (stage 1: one per group; stage 2: DDP's buckets; stage
3: one per unit, the top-level child modules), each split further by the group its
parameters are sharded over (``param_replicas``), padded to N chunks of c elements (c a
multiple of the storage-offset alignment) and placed one after the other in the group's
shard buffers (``so``) and full buffers (``po``).  ``ranges()`` says which slice of each
parameter this rank owns.  ``ZeroAdamW`` (``helios.schedule.zero``) allocates the buffers
of this plan, its ``GradientReducer`` (zero_grads.py) and ``UnitParameters`` (zero_stage3.py)
run the collectives over it; the module docstring there describes the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import helios.comm as dist
from helios import dtypes as dt
from helios.nn import Module, ModuleList
from helios.tensor import Storage, Tensor

_F32 = dt.float32


def view_f32(st: Storage, off: int, n: int) -> Tensor:
    """Elements [off, off + n) of a float32 storage (a segment's full buffer, a group's), as a 1-D view."""
    return st.view(off, (n,), _F32)


@dataclass
class Segment:
    """Parameters of one group laid out contiguously, padded to N chunks of c elements."""

    gi: int
    params: list
    rel: list  # offset of each parameter inside the segment
    numel: int  # L: elements of the parameters
    c: int  # chunk per rank
    so: int = 0  # offset of this segment's chunk in the group's shard buffers
    po: int = 0  # offset of the segment in its full parameter storage
    go: int = 0  # offset of the segment in its full gradient storage (stage 1: the group's; else its own staging)
    unit: object = None  # stage 3: the Unit it belongs to
    pfull: Storage = None  # storage of the full parameters (the group's flat buffer, or lazy at stage 3)
    gfull: Storage = None  # storage of the full gradients (the group's flat buffer at stage 1, else lazy staging)
    # runtime
    launched: int = 0  # DDP buckets of this segment handed to the comm hook in this backward
    ready: int = 0  # stage 3, subgroup segments: parameters whose gradient is complete in this backward
    has_grad: bool = False  # the shard holds reduced gradients not yet consumed by zero_grad
    staged_bytes: int = 0
    # the ranks this segment is sharded over: the model's group, or a subgroup (param_replicas)
    pg: object = None
    world: int = 1
    rank: int = 0
    sub: bool = False  # sharded over a subgroup: its gradients summed there, then divided by the model group's size


@dataclass
class Group:
    """One parameter group's segments and the buffers that hold them (allocated by the optimizer)."""

    segs: list
    full_n: int = 0  # elements of the full flat buffers (sum of N*c)
    shard_n: int = 0  # elements of the shard buffers (sum of c)
    pflat: Tensor = None  # stages 1-2: full parameters
    gflat: Tensor = None  # stage 1: full gradients
    pshard: Tensor = None  # stage 3
    gshard: Tensor = None  # stages 2-3
    m: Tensor = None
    v: Tensor = None


@dataclass
class Unit:
    """Stage 3: a top-level child module whose parameters are gathered together."""

    index: int
    name: str
    module: Module | None
    segs: list = field(default_factory=list)
    n_params: int = 0
    state: str = "released"  # released | pending | gathered
    pending: list = field(default_factory=list)  # (work, storage, version before) of a gather in flight
    arrived: int = 0  # gradients complete in this backward
    bytes: int = 0  # pool bytes of its gathered parameters


class ZeroPlan:
    """Which rank owns which elements: the checked parameters, their segments, units and offsets.

    ``ZeroPlan(model, param_groups, named, stage, param_replicas)`` checks the groups (every
    trainable parameter once, float32, contiguous) and ``param_replicas``; ``layout(gi,
    params, q)`` then returns group ``gi``'s ``Group`` with its segments and offsets (no
    buffers yet)."""

    def __init__(self, model, param_groups: list, named: list, stage: int, param_replicas: dict) -> None:
        self.ddp, self.stage, self.param_groups = model, stage, param_groups
        self.pg = model.group
        self.world = dist.get_world_size(self.pg)
        self.rank = dist.get_rank(self.pg)
        self.name = {id(p): n for n, p in named}
        self.q = 1  # the chunk's alignment in elements (set by the optimizer from its device)
        self.units: list[Unit] = []
        self.unit_of: dict[int, Unit] = {}
        self._check_params(named)
        self.replicas = self._check_replicas(param_replicas, model)

    # ---- checks --------------------------------------------------------------------------------
    def _check_params(self, named: list) -> None:
        seen: dict[int, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in self.name:
                    raise ValueError("ZeroAdamW: a parameter in the groups is not a trainable parameter of the model")
                if id(p) in seen:
                    raise ValueError(f"ZeroAdamW: parameter {self.name[id(p)]} appears in more than one group")
                if p.dtype is not _F32:
                    raise ValueError(f"ZeroAdamW takes float32 parameters; {self.name[id(p)]} is {p.dtype.name}")
                if not p.is_contiguous():
                    raise ValueError(f"ZeroAdamW: parameter {self.name[id(p)]} is not contiguous")
                seen[id(p)] = 1
        missing = [n for n, p in named if id(p) not in seen]
        if missing:
            raise ValueError(f"ZeroAdamW: the groups leave out {len(missing)} trainable parameter(s) of the model "
                             f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}); DDP reduces every "
                             "trainable parameter, so the optimizer must own them all")

    def _check_replicas(self, replicas: dict, model) -> dict:
        """``{id(parameter): group}`` of the parameters sharded over a subgroup of the model's
        ranks (``param_replicas``: names to groups), checked."""
        if not replicas:
            return {}
        by_name = {n: p for p, n in ((p, self.name[id(p)]) for g in self.param_groups for p in g["params"])}
        unknown = sorted(set(replicas) - set(by_name))
        if unknown:
            raise ValueError(f"ZeroAdamW: param_replicas names no parameter of the optimizer: {', '.join(unknown[:5])}")
        ignored = {n for n, _ in model.module.named_parameters()} - {n for n, _ in model._named}
        kept = sorted(set(replicas) - ignored)
        if kept:
            raise ValueError(f"ZeroAdamW: {kept[0]} is in param_replicas but the DDP model averages it over every "
                             "rank; leave it to the optimizer (DistributedDataParallel(params_to_ignore=...))")
        return {id(by_name[n]): g for n, g in replicas.items()}

    # ---- layout --------------------------------------------------------------------------------
    def chunk(self, n: int, world: int | None = None) -> int:
        """c: the per-rank chunk of a segment of n elements, a multiple of q."""
        per = self.q * (self.world if world is None else world)
        return (n + per - 1) // per * self.q

    def replica_group(self, name: str):
        """The process group parameter ``name`` is sharded over: the model's, or its subgroup
        from ``param_replicas``."""
        for g in self.param_groups:
            for p in g["params"]:
                if self.name[id(p)] == name:
                    return self.replicas.get(id(p), self.pg)
        raise KeyError(f"ZeroAdamW: no parameter {name!r}")

    def layout(self, gi: int, params: list) -> Group:
        """Group ``gi``'s segments with their offsets in the shard and full buffers."""
        segs = self._segments_of(gi, params)
        g = Group(segs)
        for s in segs:
            s.so, s.po = g.shard_n, (0 if self.stage == 3 else g.full_n)
            g.shard_n += s.c
            g.full_n += s.world * s.c
        return g

    def _segments_of(self, gi: int, params: list) -> list[Segment]:
        if self.stage <= 2:
            runs = []
            for part in self._by_replica_group(params):
                runs += [part] if self.stage == 1 else self._buckets(part)
        else:
            if not self.units:
                self._find_units()
            unit_of = self.unit_of
            runs = []
            for u in self.units:
                # a unit's parameters of each group they are replicated over apart (param_replicas:
                # a block's experts are gathered over their subgroup, the rest over the model's)
                runs += self._by_replica_group([p for p in params if unit_of[id(p)] is u])
        segs = []
        for run in runs:
            rel, n = [], 0
            for p in run:
                rel.append(n)
                n += p.numel()
            pg = self.replicas.get(id(run[0]), self.pg)
            world = self.world if pg is self.pg else dist.get_world_size(pg)
            s = Segment(gi, run, rel, n, self.chunk(n, world))
            s.pg, s.world, s.sub = pg, world, pg is not self.pg
            s.rank = self.rank if pg is self.pg else dist.get_rank(pg)
            if self.stage == 3:
                s.unit = unit_of[id(run[0])]
                s.unit.segs.append(s)
            segs.append(s)
        return segs

    def _by_replica_group(self, params: list) -> list[list]:
        """``params`` split by the group they are sharded over (``param_replicas``), in order of
        first appearance: a segment is sharded over one group."""
        parts: dict[int, list] = {}
        for p in params:
            parts.setdefault(id(self.replicas.get(id(p), self.pg)), []).append(p)
        return list(parts.values())

    def _buckets(self, params: list) -> list[list]:
        """Stage 2's segments of ``params``: DDP's buckets (reverse registration order, at most
        the bucket size), so a segment is complete when its buckets are."""
        cap = self.ddp.bucket_cap_bytes
        runs, cur, size = [], [], 0
        for p in reversed(params):  # DDP's rule: reverse registration order, at most cap bytes
            nb = p.numel() * 4
            if cur and size + nb > cap:
                runs.append(cur[::-1])
                cur, size = [], 0
            cur.append(p)
            size += nb
        if cur:
            runs.append(cur[::-1])
        runs.reverse()
        return runs

    def _find_units(self) -> None:
        """Top-level children of the model (a ModuleList's children each), then a root unit."""
        root = self.ddp.module
        mods: list = []

        def visit(prefix: str, m: Module) -> None:
            for name, child in m._modules.items():
                full = f"{prefix}.{name}" if prefix else name
                # (a container whose children are called one by one: a pipeline stage's blocks)
                if isinstance(child, ModuleList) or getattr(child, "children_are_units", False):
                    visit(full, child)
                else:
                    mods.append((full, child))

        visit("", root)
        trainable = set(self.name)
        for name, m in mods:
            ps = [p for _, p in m.named_parameters() if id(p) in trainable and id(p) not in self.unit_of]
            if ps:
                u = Unit(len(self.units), name, m, n_params=len(ps))
                self.units.append(u)
                for p in ps:
                    self.unit_of[id(p)] = u
        rest = [p for _, p in root.named_parameters() if id(p) in trainable and id(p) not in self.unit_of]
        if rest:
            u = Unit(len(self.units), "", None, n_params=len(rest))
            self.units.append(u)
            for p in rest:
                self.unit_of[id(p)] = u

    # ---- ownership -----------------------------------------------------------------------------
    def ranges(self, groups: list):
        """Yield (name, parameter, segment, offset of the parameter in the segment, start, stop)
        for this rank: [start, stop) of the flattened parameter is the slice it owns."""
        for g in groups:
            for s in g.segs:
                r = s.rank
                for p, a in zip(s.params, s.rel):
                    lo, hi = max(a, r * s.c), min(a + p.numel(), (r + 1) * s.c)
                    if hi < lo:
                        hi = lo = min(max(a, r * s.c), a + p.numel())
                    yield self.name[id(p)], p, s, a, lo - a, hi - a


__all__ = ["Group", "Segment", "Unit", "ZeroPlan", "view_f32"]
