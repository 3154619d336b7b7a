"""Pipeline parallelism: a GPT's blocks split into stages on consecutive ranks, trained with
the 1F1B schedule (Narayanan et al. 2021, PipeDream-Flush).

    stage = PipelineStage(GPT(cfg, seed=0), grid)         # every rank builds the same GPT, keeps its stage
    loss = stage.train_step(x_micro, y_micro)              # m micro-batches; gradients accumulated
    opt.step()                                              # AdamW over stage.parameters()

Stages are contiguous runs of layers balanced by parameter count, the embeddings on the
first stage and the final LayerNorm and the (tied) output layer on the last.  Activations
go forward and their gradients backward with ``isend``/``irecv`` between neighbours.

1F1B on stage s of p with m micro-batches: ``min(p - s - 1, m)`` forwards to fill the pipe,
then one forward and one backward alternately, then the remaining backwards; a stage holds
at most p - s micro-batches' activations (p on the first), and each stage idles for
(p - 1) of m + p - 1 slots (the bubble).  Each micro-batch's loss is scaled by 1/m, so the
gradients are those of one device accumulating the same m micro-batches.

The tied embedding lives on the first stage (input) and the last (output layer): each
keeps a copy, and after the step's backwards the two gradients are summed between them
(Megatron's embedding group).
"""

from __future__ import annotations

import time

import numpy as np

import helios.comm as dist
from helios import _kernels as K
from helios import dtypes as dt
from helios import functional as F
from helios.autograd.tape import no_grad
from helios.creation import arange, tensor
from helios.nn import GPT, Module, ModuleList


def balance(weights: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of ``weights`` in ``parts`` pieces that minimise the heaviest
    piece (exact, by dynamic programming; ties keep earlier pieces lighter)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"pipeline: {parts} stages for {n} layers; give at most one stage per layer")
    prefix = np.concatenate([[0], np.cumsum(weights)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [], n
    for k in range(parts, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


class PipelineStage(Module):
    """This rank's stage of ``gpt`` on ``grid`` (a ParallelGrid; stage = its pp rank).

    The stage keeps references to ``gpt``'s own layers (drop ``gpt`` afterwards: the
    layers of other stages are then freed)."""

    def __init__(self, gpt: GPT, grid) -> None:
        super().__init__()
        cfg = gpt.config
        self.config, self.grid, self.group = cfg, grid, grid.pp_group
        self.pp, self.stage = grid.pp, grid.pp_rank
        self.ranks = grid.peers("pp")
        # Layers as the pipeline sees them: [embeddings, block 0, ..., block L-1, final LayerNorm].
        emb = gpt.wte.weight.numel() + gpt.wpe.weight.numel()
        weights = [emb] + [sum(p.numel() for p in b.parameters()) for b in gpt.h] + [2 * gpt.ln_f.weight.numel()]
        self.bounds = balance(weights, self.pp)
        lo, hi = self.bounds[self.stage]
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self.block_ids = [i - 1 for i in range(lo, hi) if 1 <= i <= cfg.n_layer]
        self.h = ModuleList([gpt.h[i] for i in self.block_ids])
        if self.first or self.last:
            self.wte_weight = gpt.wte.weight  # the tied table: input on the first stage, output on the last
        if self.first:
            self.wpe_weight = gpt.wpe.weight
        if self.last:
            self.ln_f = gpt.ln_f
        # The tied table's two gradients are summed between the first and the last stage of
        # each pipeline; every rank creates every such group, in one order.
        self.embedding_group = None
        if self.pp > 1:
            for d in range(grid.dp):
                for t in range(grid.tp):
                    pair = [grid.rank_of(t, d, 0), grid.rank_of(t, d, self.pp - 1)]
                    g = dist.new_group(pair)
                    if grid.rank in pair:
                        self.embedding_group = g

    # ---- one micro-batch --------------------------------------------------------------
    def _forward(self, x_in, idx_or_none, targets, scale: float):
        """This stage's part of the model for one micro-batch: the input activation (or token
        ids on the first stage) -> the output activation, or the scaled loss on the last."""
        if self.first:
            b, t = idx_or_none.shape
            x = F.embedding(idx_or_none, self.wte_weight) + F.embedding(arange(t, dtype=dt.int64), self.wpe_weight)
        else:
            x = x_in
        for block in self.h:
            x = block(x)
        if not self.last:
            return x
        b, t, _ = x.shape
        logits = F.matmul(self.ln_f(x), self.wte_weight.mT)
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t)) * scale

    def train_step(self, inputs: list, targets: list) -> float | None:
        """Forward and backward of every micro-batch in 1F1B order; gradients accumulate in the
        stage's parameters.  Every stage gets the same lists (only the first reads ``inputs``,
        only the last ``targets``).  Returns the mean loss on the last stage, None elsewhere."""
        m = len(inputs)
        if m < 1:
            raise ValueError("pipeline: give at least one micro-batch")
        b, t = np.asarray(inputs[0]).shape
        shape = (b, t, self.config.n_embd)
        prev = self.ranks[self.stage - 1] if not self.first else None
        nxt = self.ranks[self.stage + 1] if not self.last else None
        warm = min(self.pp - self.stage - 1, m)
        held: list = []  # (input leaf, output) of micro-batches whose backward is still to come
        sends: list = []
        losses: list[float] = []
        done_fwd = done_bwd = 0
        waited = [0.0]  # seconds blocked waiting for a neighbour (the bubble, and any imbalance)
        t_start = time.perf_counter()

        def receive(buf, peer) -> None:
            self._sync()  # the device finishes this stage's work first: waiting starts after it
            t0 = time.perf_counter()
            dist.recv(buf, peer)
            waited[0] += time.perf_counter() - t0

        def forward_one() -> None:
            nonlocal done_fwd
            i = done_fwd
            x_in = None
            if not self.first:
                x_in = K.empty(shape, dt.float32)
                receive(x_in, prev)
                x_in.requires_grad = True
            idx = tensor(np.asarray(inputs[i], np.int64), dtype=dt.int64) if self.first else None
            tgt = tensor(np.asarray(targets[i], np.int64), dtype=dt.int64) if self.last else None
            out = self._forward(x_in, idx, tgt, 1.0 / m)
            if self.last:
                losses.append(out.item() * m)
            else:
                sends.append(dist.isend(out.detach(), nxt))
            held.append((x_in, out))
            done_fwd += 1

        def backward_one() -> None:
            nonlocal done_bwd
            x_in, out = held.pop(0)
            if self.last:
                out.backward()
            else:
                g = K.empty(shape, dt.float32)
                receive(g, nxt)
                out.backward(g)
            if not self.first:
                sends.append(dist.isend(x_in.grad, prev))
            done_bwd += 1

        for _ in range(warm):
            forward_one()
        for _ in range(m - warm):
            forward_one()
            backward_one()
        while done_bwd < m:
            backward_one()
        self._sync()
        t0 = time.perf_counter()
        for w in sends:
            w.wait()
        waited[0] += time.perf_counter() - t0
        total = time.perf_counter() - t_start
        # The share of this step the stage spent waiting on its neighbours; 1F1B's bubble
        # alone makes it (p - 1) / (m + p - 1) when every stage costs the same.
        self.last_idle_fraction = waited[0] / total if total > 0 else 0.0
        if self.embedding_group is not None and self.wte_weight.grad is not None:
            with no_grad():
                g = self.wte_weight.grad
                whole = g if g.is_contiguous() else K.copy(g)  # the output layer's gradient is a transposed view
                dist.all_reduce(whole, group=self.embedding_group)
                self.wte_weight.grad = whole
        return float(np.mean(losses)) if self.last else None

    def _sync(self) -> None:
        from helios.runtime import get_runtime

        get_runtime().synchronize()

    def owned_parameters(self) -> list:
        """The parameters whose gradient norm this stage counts (the tied table once: the first stage's)."""
        return [p for n, p in self.named_parameters() if not (n == "wte_weight" and self.last and not self.first)]


def clip_grad_norm_(stage: PipelineStage, max_norm: float) -> float:
    """Scale the stage's gradients so the whole model's norm is at most ``max_norm`` (a
    collective over the pipeline group); returns the norm."""
    sq = 0.0
    for p in stage.owned_parameters():
        if p.grad is not None:
            sq += float(F.sum(p.grad * p.grad).item())
    total = np.array([sq], np.float64)
    if stage.pp > 1:
        dist.all_reduce(total, group=stage.group)
    norm = float(np.sqrt(total[0]))
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        with no_grad():
            for p in stage.parameters():
                if p.grad is not None:
                    F.copy_(p.grad, p.grad * coef)
    return norm


__all__ = ["PipelineStage", "balance", "clip_grad_norm_"]
