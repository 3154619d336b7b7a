"""Mixture of experts: a GPT MLP replaced by E expert MLPs and a router (GShard, Switch).

    moe = MoEMLP(n_embd=128, n_experts=8, top_k=2, capacity_factor=1.25, ep_group=ep_group)
    y = moe(x)                 # [B, T, C] -> [B, T, C]
    loss = loss + moe.aux_loss # the load-balancing loss of this forward

Routing, for the N tokens of this rank:

* the router (a bias-free linear layer) gives each token a probability over the E experts;
  the token goes to its ``top_k`` most probable ones.  With ``top_k == 1`` (Switch) the
  expert's output is scaled by its probability; with more (GShard's top-2) by the chosen
  probabilities renormalised to sum to 1.
* each expert takes at most ``capacity = ceil(capacity_factor * top_k * N / E)`` tokens.
  Places are given in priority order -- every token's first choice before any second
  choice, then by token position, as GShard does -- and a (token, choice) pair past its
  expert's capacity is dropped: it adds nothing, so a token all of whose choices were
  dropped passes through the block on the residual alone.  ``capacity_factor=None``
  drops nothing (capacity N).
* the load-balancing loss is ``aux_alpha * E * sum_i f_i * P_i`` (Switch Transformer, eq. 4):
  ``f_i`` the share of tokens whose first choice is expert i, ``P_i`` the mean router
  probability of expert i.  With a uniform router every P_i is 1/E, so it is aux_alpha
  exactly whatever f is.

Every step of the routing stays on the device (top-k, one-hot, a cumulative sum for the
places, index_add into the expert buffers and index_select out of them): nothing is read
back to the host, and every row read back was written once (only the spare row that
collects dropped pairs is written many times, and it is never read), so the result is
deterministic.

Expert parallelism: with ``ep_group`` of size W, this rank holds experts
``[r * E / W, (r + 1) * E / W)``.  The dispatch buffer is laid out expert by expert, so
one ``all_to_all`` sends each rank the places of its experts from every rank; the
experts run on everything they received; a second ``all_to_all`` sends the results
back.  Both exchanges are autograd functions whose backward is the same exchange of the
gradients.  ``ep_group=None`` keeps every expert on this rank.  The ranks of ``ep_group``
see different tokens (they are data-parallel ranks): each one's output equals one device
that holds all experts run on its tokens.  Expert ``e`` is made from seeds of its own on
whatever rank holds it, so every expert-parallel
layout starts from the same weights.

Tensor parallelism (``MoEMLP.split_hidden``, called by ``TensorParallelGPT``): each expert's
MLP is split over the TP group by hidden features as Megatron-LM splits the dense MLP, the
router and ``b_proj`` whole.  The TP ranks hold the same tokens and route them alike; the
experts read them through ``copy_to_tp`` (their input gradient's parts summed backward) and
the k x N picked rows are all-reduced before the gates weigh them (the gates' gradient then
reads whole outputs): one all-reduce each way per layer.  With sequence parallelism the layer
all-gathers its rank's positions, routes every token and reduce-scatters the weighted parts
(``MoEMLP._forward_sequence_parallel``).  With expert parallelism too, the
expert-parallel groups join ranks of one TP place (``expert_groups(ep, pp, tp)``) and each
expert tensor is sharded over the ep x tp ranks of a replica (``expert_tp_group``).

Pipeline parallelism (``helios.schedule.pipeline``): a stage adds the load-balancing losses
of its own blocks to each micro-batch's backward through :func:`with_aux` (the stage's
output carries them, as Megatron-LM's MoEAuxLossAutoScaler does), so every stage's
parameters get what one device accumulating the same micro-batches gives them.  Expert
parallelism then splits the data-parallel ranks of each stage (``expert_groups(ep, pp)``).
"""

from __future__ import annotations

import math

import numpy as np

import helios.comm as dist
from helios import dtypes as dt
from helios import flat
from helios import functional as F
from helios.autograd.tape import Function, no_grad
from helios.creation import arange, full, normal, tensor, zeros
from helios.nn import Linear, Module, Parameter
from helios.schedule.grid import group_rank, group_size, new_groups, rank_lists
from helios.schedule.tensor_parallel import (TPLayout, copy_to_tp, gather_sequence, reduce_from_tp,
                                             reduce_scatter_sequence, with_transpose)
from helios.tensor import Tensor


def _exchange(x: Tensor, group) -> Tensor:
    src = flat.copy(x)  # contiguous, and not a tensor autograd may hold
    out = zeros(*x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all(out, src, group=group)
    return out


def all_to_all(x: Tensor, group) -> Tensor:
    """Differentiable all-to-all over ``group``: ``x``'s dim 0 is split into one chunk per rank."""
    if group is not None and group_size(group) == 1:
        return x
    return with_transpose(x, group, _exchange, _exchange)  # the gradients take the way back


class MoEMLP(Module):
    """E expert MLPs (``n_embd -> hidden -> n_embd``, tanh GELU, as the GPT's MLP) behind a
    top-k router; see the module docstring for the routing, capacity and loss."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
                 aux_alpha: float = 0.01, hidden: int | None = None, ep_group=None, seed: int = 0,
                 proj_std: float = 0.02) -> None:
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"MoEMLP: n_experts must be >= 1, got {n_experts}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoEMLP: top_k must be between 1 and n_experts ({n_experts}), got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoEMLP: capacity_factor must be > 0 (or None: no capacity limit), got {capacity_factor}")
        ep = 1 if ep_group is None else group_size(ep_group)
        if n_experts % ep:
            raise ValueError(f"MoEMLP: the {n_experts} experts do not split evenly over {ep} expert-parallel ranks")
        self.n_embd, self.n_experts, self.top_k = n_embd, n_experts, top_k
        self.capacity_factor, self.aux_alpha, self.ep_group = capacity_factor, aux_alpha, ep_group
        self.hidden = hidden or 4 * n_embd
        self.ep, self.local_experts = ep, n_experts // ep
        first = (0 if ep_group is None else group_rank(ep_group)) * self.local_experts
        self.router = Linear(n_embd, n_experts, bias=False, seed=seed)
        mine = range(first, first + self.local_experts)
        # expert e's weights come from seed + 1 + e wherever it lives (see the module docstring)
        self.w_fc = Parameter(F.stack([normal(0.0, 0.02, (n_embd, self.hidden), seed=seed + 1 + 2 * e) for e in mine]))
        self.b_fc = Parameter(zeros(self.local_experts, 1, self.hidden))
        self.w_proj = Parameter(F.stack([normal(0.0, proj_std, (self.hidden, n_embd), seed=seed + 2 + 2 * e)
                                         for e in mine]))
        self.b_proj = Parameter(zeros(self.local_experts, 1, n_embd))
        if ep > 1:
            # Each expert tensor is this rank's rows of a whole [E, ...] tensor: the same layout
            # record tensor parallelism keeps, so checkpoints gather whole tensors (and load
            # on any layout) and the global gradient norm sums each shard once over the group.
            for w in self.expert_parameters():
                w.tp_layout = TPLayout((n_experts, *w.shape[1:]), self._rows_of, ep, group=ep_group,
                                       rank=group_rank(ep_group))
        self.tp_group, self.tp, self.sequence_parallel = None, 1, False  # split_hidden() sets them
        self.aux_loss: Tensor | None = None
        self.dropped: Tensor | None = None  # (token, choice) pairs past capacity in the last forward

    def _rows_of(self, q: int) -> slice:
        return slice(q * self.local_experts, (q + 1) * self.local_experts)

    def split_hidden(self, tp_group, expert_group=None, sequence_parallel: bool = False) -> None:
        """Split every expert's MLP over the tensor-parallel group ``tp_group`` as Megatron-LM
        splits the dense MLP (in place): this rank keeps hidden features
        ``[r * hidden / tp, (r + 1) * hidden / tp)`` of ``w_fc``/``b_fc`` (columns) and of
        ``w_proj`` (rows); ``b_proj`` and the router stay whole.  Every TP rank routes the
        same tokens (their activations are replicated), runs its part of each expert, and one
        all-reduce of the combined tokens' rows sums the parts (see :meth:`forward`).
        With expert parallelism too, ``expert_group`` is the ep x tp ranks that hold the
        pieces of one replica's experts (rank ``ep_rank * tp + tp_rank`` in it, as
        :func:`expert_groups` builds it): the expert tensors' layouts record it, so
        checkpoints gather whole tensors and the clip sums each piece once.
        ``sequence_parallel``: the layer takes and returns this rank's T/tp positions (see
        :meth:`_forward_sequence_parallel`)."""
        tp = group_size(tp_group)
        if tp == 1:
            return
        if self.hidden % tp:
            raise ValueError(f"MoEMLP: the expert MLP width {self.hidden} does not split over {tp} tensor-parallel ranks")
        if self.ep > 1 and (expert_group is None or group_size(expert_group) != self.ep * tp):
            raise ValueError(f"MoEMLP: with {self.ep} expert-parallel and {tp} tensor-parallel ranks, give the "
                             f"expert group of ep x tp = {self.ep * tp} ranks")
        hl, r, E, El, ep = self.hidden // tp, group_rank(tp_group), self.n_experts, self.local_experts, self.ep

        def cols(q: int) -> slice:
            return slice(q * hl, (q + 1) * hl)

        def rows(q: int) -> slice:
            return slice(q * El, (q + 1) * El)

        def shard(w: Parameter, index: tuple, full: tuple, select) -> Parameter:
            p = Parameter(tensor(np.ascontiguousarray(w.numpy()[index], np.float32)))
            if ep == 1:
                p.tp_layout = TPLayout(full, select, tp)  # over the tensor-parallel group, as dense shards
            else:  # rank q of the expert group holds expert rows q // tp and hidden part q % tp
                p.tp_layout = TPLayout(full, lambda q: (rows(q // tp), *select(q % tp)[1:]), ep * tp,
                                       group=expert_group, rank=group_rank(expert_group))
            return p

        C, H = self.n_embd, self.hidden
        self.w_fc = shard(self.w_fc, (slice(None), slice(None), cols(r)), (E, C, H),
                          lambda q: (slice(None), slice(None), cols(q)))
        self.b_fc = shard(self.b_fc, (slice(None), slice(None), cols(r)), (E, 1, H),
                          lambda q: (slice(None), slice(None), cols(q)))
        self.w_proj = shard(self.w_proj, (slice(None), cols(r), slice(None)), (E, H, C),
                            lambda q: (slice(None), cols(q), slice(None)))
        if ep > 1:  # b_proj: rows over the expert-parallel group only (whole on every TP rank)
            self.b_proj.tp_layout = TPLayout((E, 1, C), rows, ep, group=self.ep_group, rank=group_rank(self.ep_group))
        self.tp_group, self.tp, self.sequence_parallel = tp_group, tp, sequence_parallel

    def expert_parameters(self) -> list[Parameter]:
        """The parameters of this rank's experts (the router is shared, as the rest of the model)."""
        return [self.w_fc, self.b_fc, self.w_proj, self.b_proj]

    def capacity(self, n_tokens: int) -> int:
        """Places per expert for ``n_tokens`` tokens on this rank."""
        if self.capacity_factor is None:
            return n_tokens
        return max(1, math.ceil(self.capacity_factor * self.top_k * n_tokens / self.n_experts))

    def route(self, x: Tensor, cap: int):
        """Router decisions for tokens ``x`` [N, C] and ``cap`` places per expert: (slot, weight,
        probs, first_choice), where
        slot [k*N] is each (choice, token) pair's row in the expert-major dispatch buffer
        (``E * capacity`` for a dropped pair) and weight [k*N] its gate value (0 if dropped)."""
        E, k = self.n_experts, self.top_k
        probs = F.softmax(self.router(x), -1)
        gate, choice = probs.topk(k)  # [N, k]
        if k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        expert = choice.t().reshape(-1)  # choice-major: every first choice before any second
        onehot = F.one_hot(expert, E)
        place = (F.cumsum(onehot, 0) * onehot).sum(-1) - 1
        keep = place < cap
        slot = F.where(keep, expert * cap + place, tensor(E * cap))
        weight = gate.t().reshape(-1) * keep.to(dt.float32)
        self.dropped = (~keep).to(dt.int64).sum()
        return slot, weight, probs, choice[:, 0]

    def experts(self, xin: Tensor) -> Tensor:
        """This rank's experts on their places: [E_local, P, C] -> [E_local, P, C] (split over
        tensor-parallel ranks: this rank's part of the sum over hidden features; b_proj is
        added by TP rank 0 alone, so the parts sum to the whole output)."""
        h = F.bmm(xin, self.w_fc) + self.b_fc
        out = F.bmm(F.gelu(h, approximate="tanh"), self.w_proj)
        if self.tp == 1:
            return out + self.b_proj
        return out + _on_first_rank(self.b_proj, group_rank(self.tp_group) == 0)

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            return self._forward_sequence_parallel(x)
        shape = x.shape
        tokens = x.reshape(-1, self.n_embd)
        n, E, k, C = tokens.shape[0], self.n_experts, self.top_k, self.n_embd
        cap = self.capacity(n)
        slot, weight, probs, first = self.route(tokens, cap)
        token = arange(n).repeat(k)
        # Split over tensor-parallel ranks, each rank's experts give a part of the input's gradient
        # (their hidden features'): summed over the group backward.  The router reads ``tokens``
        # itself, whose gradient is already whole on every rank.
        into = tokens if self.tp == 1 else copy_to_tp(tokens, self.tp_group)
        buf = F.index_add(zeros(E * cap + 1, C), 0, slot, F.index_select(into, 0, token))
        xin = buf[: E * cap].reshape(E, cap, C)
        out = self._run_experts(xin)  # [E, cap, C], in this rank's expert order
        rows = F.cat([out.reshape(E * cap, C), zeros(1, C)], 0)  # the last row: dropped pairs read zeros
        picked = F.index_select(rows, 0, slot)  # [k*N, C]
        if self.tp > 1:
            # The one all-reduce forward: the parts summed before the gates weigh them, so the
            # gates' (router's) gradient reads whole expert outputs, the same on every TP rank.
            picked = reduce_from_tp(picked, self.tp_group)
        y = (picked * weight.unsqueeze(-1)).reshape(k, n, C).sum(0)
        f = F.one_hot(first, E).to(dt.float32).mean(0)  # counts: no gradient, as in Switch
        self.aux_loss = (f * probs.mean(0)).sum() * (self.aux_alpha * E)
        return y.reshape(*shape)

    def _forward_sequence_parallel(self, x: Tensor) -> Tensor:
        """Sequence parallelism (``split_hidden(..., sequence_parallel=True)``): ``x`` is this TP
        rank's [B, T/tp, C] positions.  They are all-gathered, so every rank routes every token
        of the sequence as one device does (the same capacity, drops and aux loss); each rank's
        hidden part of the experts gives a part of every token's output, weighted by the gates,
        and a reduce-scatter sums the parts and leaves each rank its own positions.  Backward,
        the all-gathered output gradient is whole on every rank (each expert part gets every
        token's), the gates' gradient parts are summed over the group (``copy_to_tp`` on them:
        [k*N] values), and the gather's reduce-scatter sums the experts' input-gradient parts;
        the router's share of that gradient, the same on every rank, enters the sum at 1/tp."""
        group, tp = self.tp_group, self.tp
        whole = gather_sequence(x, group)  # [B, T, C]
        b, t, C = whole.shape
        tokens = whole.reshape(-1, C)
        n, E, k = tokens.shape[0], self.n_experts, self.top_k
        cap = self.capacity(n)
        slot, weight, probs, first = self.route(_scale_grad(tokens, 1.0 / tp), cap)
        token = arange(n).repeat(k)
        buf = F.index_add(zeros(E * cap + 1, C), 0, slot, F.index_select(tokens, 0, token))
        out = self._run_experts(buf[: E * cap].reshape(E, cap, C))  # this rank's hidden part
        rows = F.cat([out.reshape(E * cap, C), zeros(1, C)], 0)
        gates = copy_to_tp(weight, group)
        part = (F.index_select(rows, 0, slot) * gates.unsqueeze(-1)).reshape(k, n, C).sum(0)
        f = F.one_hot(first, E).to(dt.float32).mean(0)
        self.aux_loss = (f * probs.mean(0)).sum() * (self.aux_alpha * E)
        return reduce_scatter_sequence(part.reshape(b, t, C), group)

    def _run_experts(self, xin: Tensor) -> Tensor:
        if self.ep == 1:
            return self.experts(xin)
        W, El, cap, C = self.ep, self.local_experts, xin.shape[1], self.n_embd
        got = all_to_all(xin.reshape(W, El, cap, C), self.ep_group)  # [source rank, my expert, place, C]
        mine = got.permute(1, 0, 2, 3).reshape(El, W * cap, C)
        done = self.experts(mine).reshape(El, W, cap, C).permute(1, 0, 2, 3)
        back = all_to_all(done.contiguous(), self.ep_group)  # [owner rank, its expert, place, C]
        return back.reshape(W * El, cap, C)


class _OnFirstRank(Function):
    """y = x on one rank of a group, 0 on the others; the gradient passes whole on every rank."""

    @staticmethod
    def forward(ctx, x, first):
        return flat.copy(x) if first else x * 0.0

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScaleGrad(Function):
    """y = x; the gradient scaled by a constant."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _scale_grad(x: Tensor, scale: float) -> Tensor:
    """``x`` unchanged, its gradient times ``scale`` (a gradient the same on every rank of a
    group that a reduce-scatter then sums over it enters that sum at 1/size)."""
    return _ScaleGrad.apply(x, scale)


def _on_first_rank(x: Tensor, first: bool) -> Tensor:
    """A replicated bias added to parts that are then summed over a group: counted once in the
    sum (``x`` on the first rank, zeros elsewhere), while every rank's gradient is the whole one
    (the gradient of the sum), so the replicas stay equal without a collective."""
    return _OnFirstRank.apply(x, first)


def aux_loss(model: Module) -> Tensor | None:
    """The sum of the load-balancing losses of every MoE layer's last forward in ``model``."""
    total = None
    for m in model.modules():
        if isinstance(m, MoEMLP) and m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
    return total


def dropped_pairs(model: Module) -> Tensor | None:
    """The (token, choice) pairs every MoE layer of ``model`` dropped past capacity in its last
    forward (a device int64 scalar; None without MoE layers)."""
    total = None
    for m in model.modules():
        if isinstance(m, MoEMLP) and m.dropped is not None:
            total = m.dropped if total is None else total + m.dropped
    return total


class _WithAux(Function):
    """y = x; y's backward also gives ``aux`` the gradient ``aux_grad`` (see :func:`with_aux`)."""

    @staticmethod
    def forward(ctx, x, aux, aux_grad):
        ctx.aux_shape, ctx.aux_grad = aux.shape, aux_grad
        return x.detach()  # a new tensor on the same storage: x keeps its own place in the tape

    @staticmethod
    def backward(ctx, g):
        return g, full(ctx.aux_shape, ctx.aux_grad), None


def with_aux(x: Tensor, aux: Tensor | None, aux_grad: float = 1.0) -> Tensor:
    """``x`` unchanged, whose backward also differentiates the scalar ``aux`` (with gradient 1,
    as ``(root + aux).backward()`` gives it; ``aux_grad`` under a float16 loss scale, as
    ``(scale * (root + aux)).backward()`` gives it).  A pipeline stage hands the next stage (or
    the loss's backward) such an output, so ``out.backward(g)`` runs its blocks' load-balancing
    losses too: one backward, the gradients one device gets from ``loss + aux``."""
    if aux is None:
        return x
    return _WithAux.apply(x, aux, float(aux_grad))


def use_experts(model: Module, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
                aux_alpha: float = 0.01, ep_group=None) -> Module:
    """Replace the MLP of every block of a ``helios.nn.GPT`` by an :class:`MoEMLP` (in place;
    returns the model).  Layer i's experts are seeded from ``1000 * (i + 1)``, the same on
    every rank, so any expert-parallel layout starts from the same model.  The GPT's loss
    does not include the load-balancing loss: add :func:`aux_loss` of the model to it."""
    cfg = model.config
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2's scaled init of residual projections
    for i, block in enumerate(model.h):
        block.mlp = MoEMLP(cfg.n_embd, n_experts, top_k=top_k, capacity_factor=capacity_factor,
                           aux_alpha=aux_alpha, ep_group=ep_group, seed=1000 * (i + 1), proj_std=proj_std)
    return model


def _stage_ranks(ep: int, pp: int, tp: int):
    """(world, rank, ranks per stage d, data-parallel ranks per stage), refused by name when
    the numbers do not divide."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp < 1 or tp < 1 or world % (pp * tp):
        raise ValueError(f"expert_groups: pp x tp = {pp} x {tp} does not divide the world size {world}")
    d = world // pp
    if ep < 1 or (d // tp) % ep:
        raise ValueError(f"expert_groups: ep = {ep} does not divide the {d // tp} data-parallel ranks of a stage "
                         f"(world {world} / pp {pp} / tp {tp})")
    return world, rank, d, d // tp


def expert_groups(ep: int, pp: int = 1, tp: int = 1):
    """(expert-parallel group, expert-data-parallel group) of this rank for ``ep`` experts-ways
    over the data-parallel ranks of each of ``pp`` pipeline stages (stage s holds ranks
    ``[s * D, (s + 1) * D)``, D = world / pp, as ParallelGrid lays them out; within a stage
    data-parallel rank i and tensor-parallel rank t is rank ``i * tp + t``).  Within a stage
    and a tensor-parallel rank, data-parallel ranks ``[j * ep, (j + 1) * ep)`` split the experts
    between them (neighbours, as Megatron-LM and DeepSpeed-MoE place them), and the ranks with
    the same place in those groups hold the same experts (their gradients are averaged over
    it).  Every rank builds every group, in one order (helios.comm.new_group is collective)."""
    # Superseded by ParallelGrid(tp=, pp=, ep=), which builds these groups (grid.ep_group,
    # grid.edp_group) with the rest of the grid, from the same layout (grid.rank_lists); kept
    # for callers that build them alone.
    world, rank, d, dp = _stage_ranks(ep, pp, tp)
    ep_group = new_groups(rank_lists("ep", tp=tp, dp=dp, pp=pp, ep=ep), "ep", rank)
    edp_group = new_groups(rank_lists("edp", tp=tp, dp=dp, pp=pp, ep=ep), "edp", rank)
    return ep_group, edp_group


def expert_tp_group(ep: int, tp: int, pp: int = 1):
    """The ep x tp ranks that hold the pieces of one replica's experts under expert and tensor
    parallelism (an expert-parallel group and its tensor-parallel peers), in rank order, so
    this rank is ``ep_rank * tp + tp_rank`` in it: the group a checkpoint gathers the expert
    tensors over and the clip sums their squares over.  Collective, as :func:`expert_groups`."""
    # Superseded by ParallelGrid(tp=, pp=, ep=).expert_tp_group (see expert_groups).
    world, rank, d, dp = _stage_ranks(ep, pp, tp)
    return new_groups(rank_lists("expert_tp", tp=tp, dp=dp, pp=pp, ep=ep), "ep", rank)


def expert_parameter_names(model: Module) -> list[str]:
    """Names of the parameters of every :class:`MoEMLP`'s experts in ``model`` (what data
    parallelism must leave to :func:`average_expert_gradients` under expert parallelism)."""
    mine = {id(p) for m in model.modules() if isinstance(m, MoEMLP) for p in m.expert_parameters()}
    return [n for n, p in model.named_parameters() if id(p) in mine]


def expert_gradient_copies(model: Module) -> list[tuple[Parameter, Tensor]]:
    """Copies of the experts' gradients in ``model`` (to put back with
    :func:`restore_expert_gradients` after an average over flat buffers that hold them too
    would mix different ranks' experts, as a pipeline stage's data-parallel average does)."""
    return [(p, flat.copy(p.grad)) for m in model.modules() if isinstance(m, MoEMLP) for p in m.expert_parameters()
            if p.grad is not None]


def restore_expert_gradients(copies: list[tuple[Parameter, Tensor]]) -> None:
    """Write the gradients :func:`expert_gradient_copies` kept back into their parameters."""
    with no_grad():
        for p, g in copies:
            F.copy_(p.grad, g)


def average_expert_gradients(model: Module, edp_group, data_parallel: int) -> None:
    """Turn the experts' accumulated gradients into the global batch's: an expert-parallel rank's
    experts received the gradient of every token routed to them (from every rank of its
    expert-parallel group), so the replicas' sum over ``edp_group`` is the sum over all
    ``data_parallel`` ranks' losses; dividing by ``data_parallel`` gives the mean loss's
    gradient, as data parallelism's average gives for the other parameters."""
    grads = [p.grad for m in model.modules() if isinstance(m, MoEMLP) for p in m.expert_parameters()
             if p.grad is not None]
    replicas = 1 if edp_group is None else group_size(edp_group)
    with no_grad():
        for g in grads:
            if replicas > 1:
                total = flat.copy(g)  # contiguous, for the collective
                dist.all_reduce(total, group=edp_group)
                g_new = total * (1.0 / data_parallel)
            else:
                g_new = g * (1.0 / data_parallel)
            F.copy_(g, g_new)
