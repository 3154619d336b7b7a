"""Context parallelism for the GPT: the sequence of every training example split over the
ranks of a group, attention computed by ring attention (helios.schedule.ring_attention).

    grid = ParallelGrid(cp=2)                                        # cp peers: neighbouring ranks
    cp = use_context_parallel(gpt, grid.cp_group, layout="zigzag")   # ring attention
    model = DistributedDataParallel(gpt, group=grid.dp_cp_group)     # gradients averaged over dp x cp
    x_shard = cp.shard(x)                                            # [B, T] token ids -> [B, T / W]
    _, loss = model(x_shard, cp.shard(y))                            # this rank's tokens' mean loss

Everything but attention is per token, so a rank runs the whole model on its T / W tokens:
the embeddings take the tokens' global positions (``ContextParallel.positions``), and the
loss is the mean over the rank's tokens.  The mean of the W ranks' losses is the whole
sequence's loss (every rank holds as many tokens), and the parameters' gradients summed over
the W ranks are its gradient: ring attention's backward returns to each rank the gradient
its keys and values get from every rank's queries.  Averaging the gradients over the data-
parallel ranks and the W context-parallel ranks together (one DistributedDataParallel over
both) therefore gives exactly the gradient of the global batch's loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

import helios.comm as dist
from helios.schedule.grid import new_groups, rank_lists
from helios.schedule.ring_attention import LAYOUTS, ring_attention, ring_positions, ring_shard


@dataclass
class ContextParallel:
    """Which ranks share a sequence and which of its tokens this rank holds."""

    group: object
    layout: str
    rank: int
    world: int
    _pos: dict = field(default_factory=dict, repr=False)

    def shard(self, x: np.ndarray) -> np.ndarray:
        """This rank's tokens of a [B, T] batch (ids or targets): [B, T / world]."""
        return ring_shard(np.asarray(x), self.layout, self.rank, self.world, dim=1)

    def positions(self, local_T: int, rt):
        """The global positions of this rank's ``local_T`` tokens, as a device int64 tensor."""
        from helios import dtypes as dt
        from helios import flat

        key = (local_T, id(rt))
        if key not in self._pos:
            pos = ring_positions(local_T * self.world, self.layout, self.rank, self.world)
            self._pos[key] = flat.from_numpy(pos.astype(np.int64), dt.int64, rt)
        return self._pos[key]

    def attention(self, q, k, v):
        """Causal attention of this rank's [B, H, T / W, D] shards over the whole sequence."""
        return ring_attention(q, k, v, group=self.group, layout=self.layout, is_causal=True)


def context_parallel_group(cp: int):
    """This rank's group of ``cp`` neighbouring ranks (ranks r // cp alike share sequences).
    Every rank builds every group, in one order (helios.comm.new_group is collective)."""
    # Superseded by ParallelGrid(cp=...).cp_group, which builds the same groups (grid.rank_lists)
    # with the rest of the grid; kept for callers that build this one alone.
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp < 1 or world % cp:
        raise ValueError(f"context_parallel_group: cp = {cp} does not divide the world size {world}")
    return new_groups(rank_lists("cp", dp=world // cp, cp=cp), "cp", rank)


def use_context_parallel(gpt, group=None, layout: str = "zigzag") -> ContextParallel:
    """Make ``gpt`` (a helios.nn.GPT) take this rank's shard of each sequence: its forward then
    expects [B, T / W] token ids (``cp.shard``) and every attention layer runs ring attention
    over ``group`` (None: the world).  Every rank of the group must do the same."""
    if layout not in LAYOUTS:
        raise ValueError(f"use_context_parallel: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    cp = ContextParallel(group, layout, dist.get_rank(group), dist.get_world_size(group))
    gpt.context_parallel = cp
    for block in gpt.h:
        block.attn.context_parallel = cp
    return cp


@contextlib.contextmanager
def context_parallel_off(gpt):
    """Run ``gpt`` on whole sequences for a while (sampling on one rank), then restore."""
    saved = gpt.context_parallel
    attns = [block.attn for block in gpt.h]
    gpt.context_parallel = None
    for a in attns:
        a.context_parallel = None
    try:
        yield gpt
    finally:
        gpt.context_parallel = saved
        for a in attns:
            a.context_parallel = saved
