"""The process grid of model-parallel training: every group a rank belongs to, built in one
place (Megatron-core's ``parallel_state``).

    grid = ParallelGrid(tp=2, pp=2)          # dp = world / (tp x cp x pp)
    grid.tp_rank, grid.dp_rank, grid.pp_rank # this rank's coordinates
    dist.all_reduce(x, group=grid.tp_group)

    grid = ParallelGrid(cp=2)                # context parallel: grid.cp_group, and grid.dp_cp_group to average over
    grid = ParallelGrid(tp=2, ep=2)          # experts: grid.ep_group, grid.edp_group, grid.expert_tp_group

Ranks are laid out as Megatron-LM lays them out: tensor parallel innermost (TP peers are
the ranks closest together -- on one host, so their frequent all-reduces take the fastest
link), then context parallel, then data parallel, then pipeline stages outermost:

    rank = pp_rank x (dp x cp x tp) + dp_rank x (cp x tp) + cp_rank x tp + tp_rank

(with cp = 1, as before context parallelism joined the grid: pp_rank x (dp x tp) + dp_rank x tp
+ tp_rank).  Expert parallelism splits the data-parallel ranks of each (pipeline stage, context
rank, tensor-parallel rank): data-parallel ranks ``[j x ep, (j + 1) x ep)`` hold one replica's
experts between them (the expert-parallel group, neighbours as Megatron-LM and DeepSpeed-MoE
place them) and the ranks at the same place of those groups hold the same experts (the
expert-data-parallel group, over which their gradients are reduced).

Groups the grid owns (each rank keeps its own; every rank builds every group in one fixed
order, since helios.comm.new_group must be called by all ranks alike):

=====================  ============================================================================
``tp_group``            tensor parallel: same (dp, cp, pp)
``cp_group``            context parallel: same (tp, dp, pp); cp > 1 only
``dp_group``            data parallel: same (tp, cp, pp)
``dp_cp_group``         data x context parallel, what gradients are averaged over (Megatron's
                        data-parallel group "with context parallel"); ``dp_group`` when cp = 1
``pp_group``            pipeline: same (tp, cp, dp)
``embedding_group``     the first and the last stage of this rank's pipeline, which hold the tied
                        embedding table and sum its two gradients; pp > 1 only
``ep_group``            expert parallel (ep > 1): ep neighbouring data-parallel ranks
``edp_group``           expert data parallel (ep > 1): the dp / ep ranks holding the same experts
``expert_tp_group``     ep x tp: the ranks holding the pieces of one replica's experts (ep > 1;
                        ``ep_group`` itself when tp = 1)
=====================  ============================================================================

``tp_group``, ``dp_group``, ``dp_cp_group`` and ``pp_group`` follow one rule: a dimension that
spans the world uses the world's communicator (``None``), one of size 1 none at all (a
stand-in whose ``size`` is 1: :func:`group_size` and :func:`group_rank` read it).  The others
are always communicators of their own (``helios.comm.new_group``, with the role as its trace
track), whatever their size, exactly as the functions that built them before the grid did
(``context_parallel_group``, ``expert_groups``, ``expert_tp_group``, ``PipelineStage``); those
functions still work and build the same groups from the same layout (:func:`rank_lists`).
A group the grid does not build (cp = 1, ep = 1, pp = 1) is ``None`` for ``cp_group``, the
``ep`` ones and ``embedding_group``.
"""

from __future__ import annotations

from dataclasses import dataclass

import helios.comm as dist

KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "embedding", "ep", "edp", "expert_tp")


@dataclass(frozen=True)
class Coord:
    """A rank's place in the grid."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


def rank_lists(kind: str, tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> list[list[int]]:
    """Every group of one ``kind`` (see :data:`KINDS`) of a grid of these sizes, as lists of
    global ranks, in the order every rank creates them: the layout of the module docstring in
    one place.  ``embedding``: the [first, last] stage pair of each pipeline (pp > 1);
    ``ep``/``edp``/``expert_tp``: ep must divide dp."""
    def rank_of(t: int, d: int, p: int, c: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    if kind == "tp":
        return [[rank_of(t, d, p, c) for t in T] for p in P for d in D for c in C]
    if kind == "dp":
        return [[rank_of(t, d, p, c) for d in D] for p in P for t in T for c in C]
    if kind == "pp":
        return [[rank_of(t, d, p, c) for p in P] for d in D for t in T for c in C]
    if kind == "cp":
        return [[rank_of(t, d, p, c) for c in C] for p in P for d in D for t in T]
    if kind == "dp_cp":
        return [[rank_of(t, d, p, c) for d in D for c in C] for p in P for t in T]
    if kind == "embedding":
        return [[rank_of(t, d, 0, c), rank_of(t, d, pp - 1, c)] for d in D for t in T for c in C] if pp > 1 else []
    if kind in ("ep", "edp", "expert_tp"):
        if ep < 1 or dp % ep:
            raise ValueError(f"ParallelGrid: ep = {ep} does not divide the {dp} data-parallel ranks")
        if kind == "ep":
            return [[rank_of(t, first + j, p, c) for j in range(ep)]
                    for p in P for c in C for t in T for first in range(0, dp, ep)]
        if kind == "edp":
            return [[rank_of(t, i, p, c) for i in range(j, dp, ep)] for p in P for c in C for t in T for j in range(ep)]
        return [[rank_of(t, first + j, p, c) for j in range(ep) for t in T]
                for p in P for c in C for first in range(0, dp, ep)]
    raise ValueError(f"rank_lists: kind must be one of {', '.join(KINDS)}, got {kind!r}")


def new_groups(lists: list[list[int]], role: str, rank: int | None = None):
    """Create a communicator for each of ``lists`` (``helios.comm.new_group``, every rank in the
    same order) and return the one holding ``rank`` (this rank by default), or None."""
    rank = dist.get_rank() if rank is None else rank
    mine = None
    for ranks in lists:
        g = dist.new_group(ranks, role=role)
        if rank in ranks:
            mine = g
    return mine


class ParallelGrid:
    """Every process group of model-parallel training over the world (see the module docstring).

    ``ParallelGrid(tp=1, pp=1, dp=None, cp=1, ep=1)``: ``dp`` defaults to world / (tp x cp x
    pp); a product that does not match the world size, or an ``ep`` that does not divide ``dp``,
    is refused with a ValueError that names the numbers.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, ep: int = 1) -> None:
        world = dist.get_world_size()
        for name, v in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"ParallelGrid: {name} must be a positive integer, got {v!r}")
        if world % (tp * pp * cp):
            what = f"tp x pp = {tp} x {pp}" if cp == 1 else f"tp x cp x pp = {tp} x {cp} x {pp}"
            raise ValueError(f"ParallelGrid: {what} = {tp * pp * cp} does not divide the world size {world}")
        if dp is None:
            dp = world // (tp * pp * cp)
        if tp * pp * cp * dp != world:
            what = f"tp x pp x dp = {tp} x {pp} x {dp}" if cp == 1 else f"tp x cp x pp x dp = {tp} x {cp} x {pp} x {dp}"
            raise ValueError(f"ParallelGrid: {what} = {tp * pp * cp * dp}, but the world has {world} ranks")
        if dp % ep:
            raise ValueError(f"ParallelGrid: ep = {ep} does not divide the {dp} data-parallel ranks "
                             f"(world {world} / tp {tp} / cp {cp} / pp {pp})")
        self.tp, self.pp, self.dp, self.cp, self.ep, self.world = tp, pp, dp, cp, ep, world
        self.rank = dist.get_rank()
        c = self.coord_of(self.rank)
        self.tp_rank, self.dp_rank, self.pp_rank, self.cp_rank = c.tp, c.dp, c.pp, c.cp
        self.ep_rank = self.dp_rank % ep  # place in the expert-parallel group
        # Every rank creates every group in the same order, and keeps its own.  (The first three
        # in the order they had before the grid knew cp and ep: a grid of tp, dp, pp builds what it did.)
        self.tp_group = self._build(self._lists("tp"), "tp")
        self.dp_group = self._build(self._lists("dp"), "dp")
        self.pp_group = self._build(self._lists("pp"), "pp")
        self.cp_group = self.dp_cp_group = None
        if cp > 1:
            self.cp_group = new_groups(self._lists("cp"), "cp", self.rank)
            self.dp_cp_group = self._build(self._lists("dp_cp"), "dp")
        else:
            self.dp_cp_group = self.dp_group
        self.embedding_group = new_groups(self._lists("embedding"), "", self.rank) if pp > 1 else None
        self.ep_group = self.edp_group = self.expert_tp_group = None
        if ep > 1:
            self.ep_group = new_groups(self._lists("ep"), "ep", self.rank)
            self.edp_group = new_groups(self._lists("edp"), "edp", self.rank)
            self.expert_tp_group = new_groups(self._lists("expert_tp"), "ep", self.rank) if tp > 1 else self.ep_group

    def _lists(self, kind: str) -> list[list[int]]:
        return rank_lists(kind, tp=self.tp, dp=self.dp, pp=self.pp, cp=self.cp, ep=self.ep)

    def rank_of(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        """The global rank at grid coordinates (tp, dp, pp, cp)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coord_of(self, rank: int) -> Coord:
        """The grid coordinates of a global rank."""
        return Coord(rank % self.tp, (rank // (self.tp * self.cp)) % self.dp, rank // (self.tp * self.cp * self.dp),
                     (rank // self.tp) % self.cp)

    def peers(self, kind: str) -> list[int]:
        """The global ranks of this rank's group of ``kind`` (one of :data:`KINDS`: ``"tp"``,
        ``"cp"``, ``"dp"``, ``"dp_cp"``, ``"pp"``, ``"embedding"``, ``"ep"``, ``"edp"``,
        ``"expert_tp"``), in group order ([] for a group the grid does not build)."""
        if kind not in KINDS:
            raise ValueError(f"ParallelGrid.peers: kind must be one of {', '.join(repr(k) for k in KINDS)}, "
                             f"got {kind!r}")
        if kind in ("ep", "edp", "expert_tp") and self.ep == 1:
            return []
        for ranks in self._lists(kind):
            if self.rank in ranks:
                return ranks
        return []

    def group(self, kind: str):
        """This rank's group of ``kind`` (see :meth:`peers`): the attribute ``<kind>_group``."""
        if kind not in KINDS:
            raise ValueError(f"ParallelGrid.group: kind must be one of {', '.join(repr(k) for k in KINDS)}, "
                             f"got {kind!r}")
        return getattr(self, f"{kind}_group")

    def _build(self, groups: list[list[int]], role: str):
        if self.world > 1 and len(groups[0]) == self.world:
            return None  # the dimension spans every rank: the world's own communicator (group=None)
        mine = None
        for ranks in groups:
            # One member: no communicator is needed (collectives over one rank are copies).
            g = dist.new_group(ranks, role=role) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = g if g is not None else _Alone(ranks)
        return mine

    def __repr__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1)
        where = "".join(f", {k} {getattr(self, k + '_rank')}" for k in ("cp", "ep") if getattr(self, k) > 1)
        return (f"ParallelGrid(tp={self.tp}, pp={self.pp}, dp={self.dp}{extra}; rank {self.rank} = "
                f"tp {self.tp_rank}, dp {self.dp_rank}, pp {self.pp_rank}{where})")


class _Alone:
    """The group of a dimension of size 1: this rank alone (collectives over it do nothing)."""

    size = 1
    rank = 0

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks


def group_size(group) -> int:
    """Ranks in ``group`` (1 for a dimension of size one)."""
    return 1 if isinstance(group, _Alone) else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group``."""
    return 0 if isinstance(group, _Alone) else dist.get_rank(group)
