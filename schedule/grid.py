"""The process grid of model-parallel training: which ranks share a tensor-parallel,
data-parallel or pipeline group.

    grid = ParallelGrid(tp=2, pp=2)          # dp = world / (tp x pp)
    grid.tp_rank, grid.dp_rank, grid.pp_rank # this rank's coordinates
    dist.all_reduce(x, group=grid.tp_group)

Ranks are laid out as Megatron-LM lays them out: tensor parallel innermost (TP peers are
the ranks closest together -- on one host, so their frequent all-reduces take the fastest
link), then data parallel, then pipeline stages outermost:

    rank = pp_rank x (dp x tp) + dp_rank x tp + tp_rank

Every rank builds every group, in one fixed order (helios.comm.new_group must be called by
all ranks alike), and keeps the three it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import helios.comm as dist


@dataclass(frozen=True)
class Coord:
    """A rank's place in the grid."""

    tp: int
    dp: int
    pp: int


class ParallelGrid:
    """Tensor x data x pipeline groups over the world (see the module docstring).

    ``dp`` defaults to world / (tp x pp); a product that does not match the world size is
    refused with a ValueError that names the numbers.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None) -> None:
        world = dist.get_world_size()
        for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"ParallelGrid: {name} must be a positive integer, got {v!r}")
        if world % (tp * pp):
            raise ValueError(f"ParallelGrid: tp x pp = {tp} x {pp} = {tp * pp} does not divide the world size {world}")
        if dp is None:
            dp = world // (tp * pp)
        if tp * pp * dp != world:
            raise ValueError(f"ParallelGrid: tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}, but the world has "
                             f"{world} ranks")
        self.tp, self.pp, self.dp, self.world = tp, pp, dp, world
        self.rank = dist.get_rank()
        c = self.coord_of(self.rank)
        self.tp_rank, self.dp_rank, self.pp_rank = c.tp, c.dp, c.pp
        # Every rank creates every group in the same order, and keeps its own.
        self.tp_group = self._build([[self.rank_of(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)], "tp")
        self.dp_group = self._build([[self.rank_of(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)], "dp")
        self.pp_group = self._build([[self.rank_of(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)], "pp")

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        """The global rank at grid coordinates (tp, dp, pp)."""
        return pp * self.dp * self.tp + dp * self.tp + tp

    def coord_of(self, rank: int) -> Coord:
        """The grid coordinates of a global rank."""
        return Coord(rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp))

    def peers(self, kind: str) -> list[int]:
        """The global ranks of this rank's ``"tp"``, ``"dp"`` or ``"pp"`` group, in group order."""
        c = self.coord_of(self.rank)
        if kind == "tp":
            return [self.rank_of(t, c.dp, c.pp) for t in range(self.tp)]
        if kind == "dp":
            return [self.rank_of(c.tp, d, c.pp) for d in range(self.dp)]
        if kind == "pp":
            return [self.rank_of(c.tp, c.dp, p) for p in range(self.pp)]
        raise ValueError(f"ParallelGrid.peers: kind must be 'tp', 'dp' or 'pp', got {kind!r}")

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
        return (f"ParallelGrid(tp={self.tp}, pp={self.pp}, dp={self.dp}; rank {self.rank} = "
                f"tp {self.tp_rank}, dp {self.dp_rank}, pp {self.pp_rank})")


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
