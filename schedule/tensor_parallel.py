"""Tensor parallelism (Megatron-LM): each layer's weight split over the ranks of a TP group.

    grid = ParallelGrid(tp=2)
    model = TensorParallelGPT(GPT(cfg, seed=0), grid.tp_group)   # keeps this rank's shards
    logits_shard, loss = model(idx, targets)                     # loss: the whole model's

Two conjugate operations carry every exchange (Shoeybi et al. 2019, "f" and "g"):

* ``copy_to_tp(x)``: identity forward, all-reduce of the gradient backward -- at the input
  of a column-parallel layer, whose ranks each use the whole (replicated) input;
* ``reduce_from_tp(x)``: all-reduce forward, identity backward -- at the output of a
  row-parallel layer, whose ranks each hold a partial sum.

A transformer block is column-then-row twice: attention split by heads (``c_attn`` keeps
the q, k and v rows of this rank's heads, ``c_proj`` the matching input columns) and the
MLP (``c_fc`` rows, ``c_proj`` columns), so it makes exactly 2 all-reduces forward and 2
backward.  The tied embedding is split by vocabulary rows (``VocabParallelEmbedding``: a
rank looks up the tokens it holds, zeros for the rest, all-reduce), and the output layer
uses the same shard: each rank computes its vocabulary slice of the logits, and the cross
entropy is computed across the slices with three small all-reduces (the row maximum, the
sum of exponentials, the target logit) without ever gathering the logits.  LayerNorms and
the position table are replicated; their gradients come out equal on every TP rank.

Sequence parallelism (Korthikanti et al. 2022; ``TensorParallelGPT(..., sequence_parallel=True)``):
between the tensor-parallel regions -- the LayerNorms and the residual stream -- each rank
holds only its T/tp positions instead of a replica of all T.  The all-reduce after a
row-parallel layer becomes a reduce-scatter along the sequence, and the column-parallel
layer's input is all-gathered along the sequence (backward: the other way round), so the
bytes moved are the same while those activations shrink tp-fold.  The parameters used on a
sequence shard (LayerNorms, the position table, row-parallel biases) see only their
rank's positions, so their gradients are summed over the group (``copy_to_tp`` on the
parameter: identity forward, all-reduce backward).

Built from a whole ``helios.nn.GPT`` (every rank makes the same one, then keeps its
shards), so a TP model starts from exactly the weights one device would train.
"""

from __future__ import annotations

import math

import numpy as np

import helios.comm as dist
from helios import dtypes as dt
from helios import flat
from helios import functional as F
from helios.autograd.tape import Function, no_grad
from helios.creation import arange, tensor
from helios.nn import GPT, Embedding, LayerNorm, Module, ModuleList, Parameter
from helios.schedule.grid import group_rank, group_size
from helios.tensor import Tensor


def _all_reduce(t: Tensor, group, op: str = "sum") -> Tensor:
    """A contiguous copy of ``t`` reduced over ``group`` (the copy: autograd may hold ``t``)."""
    out = flat.copy(t)
    if group_size(group) > 1:
        dist.all_reduce(out, op=op, group=group)
    return out


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.detach()  # the same values (a new handle)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: Tensor, group) -> Tensor:
    """Identity forward; the gradient is summed over ``group`` backward (Megatron's "f")."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group) -> Tensor:
    """Sum over ``group`` forward; the gradient passes unchanged backward (Megatron's "g")."""
    return _ReduceFromTP.apply(x, group)


def _gather_sequence(x: Tensor, group) -> Tensor:
    """[B, T/tp, C] shards of every rank -> the whole [B, T, C], in rank order along T."""
    tp = group_size(group)
    b, ts, c = x.shape
    every = flat.empty((tp, b, ts, c), x.dtype)
    dist.all_gather(every, flat.copy(x), group=group)
    return flat.copy(every.permute(1, 0, 2, 3)).reshape(b, tp * ts, c)


def _reduce_scatter_sequence(x: Tensor, group) -> Tensor:
    """[B, T, C] partial sums on every rank -> this rank's T/tp positions of their sum."""
    tp = group_size(group)
    b, t, c = x.shape
    chunks = flat.copy(x.reshape(b, tp, t // tp, c).permute(1, 0, 2, 3))  # [tp, B, T/tp, C]: chunk q goes to rank q
    out = flat.empty((b, t // tp, c), x.dtype)
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _Transposed(Function):
    """A collective forward and its transpose backward (``forward_fn(x, group)`` and
    ``backward_fn(g, group)``): all-gather and reduce-scatter, all-to-all and itself."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_fn(g, ctx.group), None, None, None


def with_transpose(x: Tensor, group, forward_fn, backward_fn) -> Tensor:
    """``forward_fn(x, group)``, differentiable: its gradient is ``backward_fn(g, group)``."""
    return _Transposed.apply(x, group, forward_fn, backward_fn)


class _SequenceParallelLinear(Function):
    """y = gather_sequence(x) @ W^T + b that keeps only this rank's sequence shard of x for the
    backward and all-gathers it again there (Korthikanti et al.): saving the gathered input
    would keep the whole sequence on every rank and undo the memory sequence parallelism saves."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        whole = _gather_sequence(x, ctx.group)  # again: the cost of not keeping it
        g2 = g.reshape(-1, g.shape[-1])
        dw = F.matmul(g2.mT, whole.reshape(-1, whole.shape[-1]))
        db = F.sum(g2, 0) if ctx.has_bias else None
        dx = _reduce_scatter_sequence(F.matmul(g, weight), ctx.group)
        return dx, dw, db, None


def gather_sequence(x: Tensor, group) -> Tensor:
    """All-gather of sequence shards [B, T/tp, C] into [B, T, C] forward, reduce-scatter of the
    gradient backward (sequence parallelism's entry into a column-parallel layer)."""
    return with_transpose(x, group, _gather_sequence, _reduce_scatter_sequence)


def reduce_scatter_sequence(x: Tensor, group) -> Tensor:
    """Reduce-scatter of partial sums [B, T, C] into this rank's [B, T/tp, C] forward, all-gather
    of the gradient backward (sequence parallelism's exit from a row-parallel layer)."""
    return with_transpose(x, group, _reduce_scatter_sequence, _gather_sequence)


def _param(a: np.ndarray) -> Parameter:
    return Parameter(tensor(np.ascontiguousarray(a, np.float32)))


class TPLayout:
    """Where a tensor-parallel shard sits in the whole tensor: ``select(q)`` indexes rank q's
    shard out of the whole array (rows, columns, or the q/k/v rows of some heads).

    ``group`` and ``rank``: the group whose ranks hold the shards and this rank's index in it,
    for a tensor sharded over another group than the model's tensor-parallel one (a mixture of
    experts' expert tensors under expert x tensor parallelism); None: the group and rank the
    caller passes (:func:`gather_full`, :func:`take_shard`, :func:`clip_grad_norm_`)."""

    def __init__(self, full_shape: tuple, select, tp: int, group=None, rank: int | None = None) -> None:
        self.full_shape, self.select, self.tp = tuple(full_shape), select, tp
        self.group, self.rank = group, rank

    def flat_index(self, q: int) -> np.ndarray:
        """Rank q's elements as indices into the whole tensor's flattened elements, in shard order."""
        return np.arange(int(np.prod(self.full_shape))).reshape(self.full_shape)[self.select(q)].reshape(-1)


def _sharded(full: np.ndarray, select, group) -> Parameter:
    """This rank's shard of ``full`` as a Parameter that remembers its layout (``tp_layout``)."""
    p = _param(full[select(group_rank(group))])
    p.tp_layout = TPLayout(full.shape, select, group_size(group))
    return p


def full_shape(p) -> tuple:
    """The shape of the whole tensor a (possibly tensor-parallel) parameter is part of."""
    layout = getattr(p, "tp_layout", None)
    return layout.full_shape if layout is not None else tuple(p.shape)


def gather_full(p, shard: np.ndarray, group) -> np.ndarray:
    """The whole tensor (flattened) from every TP rank's ``shard`` of parameter ``p`` (a
    collective over ``group``); ``shard`` itself for a replicated parameter."""
    layout = getattr(p, "tp_layout", None)
    if layout is None or layout.tp == 1:
        return shard.reshape(-1)
    if layout.group is not None:
        group = layout.group
    every = np.empty(layout.tp * shard.size, shard.dtype)
    dist.all_gather(every, np.ascontiguousarray(shard.reshape(-1)), group=group)
    out = np.empty(int(np.prod(layout.full_shape)), shard.dtype)
    for q in range(layout.tp):
        out[layout.flat_index(q)] = every[q * shard.size:(q + 1) * shard.size]
    return out


def take_shard(p, full: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s part of the whole (flattened) tensor ``full`` of parameter ``p``, flattened."""
    layout = getattr(p, "tp_layout", None)
    if layout is None:
        return full.reshape(-1)
    return full.reshape(-1)[layout.flat_index(rank if layout.rank is None else layout.rank)]


class ColumnParallelLinear(Module):
    """y_shard = x @ W_shard^T + b_shard: this rank's output features (rows of W); the input is
    the whole (replicated) activation."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, group, rows_of, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _sharded(weight, lambda q: rows_of(q), group)
        self.bias = _sharded(bias, lambda q: rows_of(q), group) if bias is not None else None

    @classmethod
    def from_linear(cls, linear, group, rows_of, sequence_parallel: bool = False) -> ColumnParallelLinear:
        """The shard of ``linear`` (a helios.nn.Linear) whose output features ``rows_of(rank)`` are this rank's."""
        b = linear.bias.numpy() if linear.bias is not None else None
        return cls(linear.weight.numpy(), b, group, rows_of, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            return _SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(Module):
    """y = sum over ranks of x_shard @ W_shard^T, then + b: this rank's input features
    (columns of W); the bias is added once, after the all-reduce."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, group, cols_of, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _sharded(weight, lambda q: (slice(None), cols_of(q)), group)
        self.bias = _param(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear, group, cols_of, sequence_parallel: bool = False) -> RowParallelLinear:
        """The shard of ``linear`` (a helios.nn.Linear) whose input features ``cols_of(rank)`` are this rank's."""
        b = linear.bias.numpy() if linear.bias is not None else None
        return cls(linear.weight.numpy(), b, group, cols_of, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        partial = F.linear(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.group)
            return y + copy_to_tp(self.bias, self.group) if self.bias is not None else y  # used on a shard
        y = reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(Module):
    """Rows [lo, hi) of an embedding table: a rank looks up the tokens it holds, zeros for the
    others, and the all-reduce assembles every token's vector (with sequence parallelism a
    reduce-scatter: each rank gets its positions' vectors)."""

    def __init__(self, table: np.ndarray, group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        rows = _split(table.shape[0], group_size(group), "the vocabulary size")
        self.lo, self.hi = group_rank(group) * rows, (group_rank(group) + 1) * rows
        self.weight = _sharded(table, lambda q: slice(q * rows, (q + 1) * rows), group)

    def forward(self, idx: Tensor) -> Tensor:
        if group_size(self.group) == 1:
            return F.embedding(idx, self.weight)
        mine = (idx >= self.lo) & (idx < self.hi)
        local = F.where(mine, idx - self.lo, 0)
        vectors = F.embedding(local, self.weight) * F.to(mine.unsqueeze(-1), dt.float32)
        if self.sequence_parallel:
            return reduce_scatter_sequence(vectors, self.group)  # this rank's positions only
        return reduce_from_tp(vectors, self.group)


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    @no_grad()
    def forward(ctx, logits, targets, lo, group):
        n, v = logits.shape
        top = _all_reduce(F.max(logits, 1)[0], group, op="max")  # a shift for exp(): no gradient flows
        shifted = logits - top.unsqueeze(1)
        e = F.exp(shifted)
        total = _all_reduce(F.sum(e, 1), group)
        onehot = F.to(arange(v, dtype=dt.int64).reshape(1, v) == (targets - lo).reshape(n, 1), dt.float32)
        target_logit = _all_reduce(F.sum(shifted * onehot, 1), group)  # zero on ranks without the target
        ctx.e, ctx.total, ctx.onehot, ctx.n = e, total, onehot, n
        return F.mean(F.log(total) - target_logit)

    @staticmethod
    @no_grad()
    def backward(ctx, g):
        softmax = ctx.e / ctx.total.unsqueeze(1)
        return (softmax - ctx.onehot) * (g * (1.0 / ctx.n)), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, lo: int, group) -> Tensor:
    """Mean cross entropy of rows of logits split by vocabulary over ``group``: ``logits`` holds
    this rank's columns [lo, lo + logits.shape[1]) of every row; the logits are never gathered."""
    return _VocabParallelCrossEntropy.apply(logits, targets, lo, group)


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"tensor parallel: {what} ({n}) must be divisible by the tensor-parallel size ({parts})")
    return n // parts


class ParallelAttention(Module):
    """Causal self-attention over this rank's heads (c_attn column-parallel, c_proj row-parallel)."""

    def __init__(self, attn, group, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = group_size(group)
        h, c = attn.n_head, attn.n_embd
        d = c // h
        self.n_head, self.head_dim = _split(h, tp, "the number of heads"), d
        hl = self.n_head

        def cols(q: int) -> np.ndarray:  # rank q's heads' features
            return (np.arange(q * hl, (q + 1) * hl)[:, None] * d + np.arange(d)).reshape(-1)

        self.c_attn = ColumnParallelLinear.from_linear(
            attn.c_attn, group, lambda q: np.concatenate([part * c + cols(q) for part in range(3)]),  # q, k, v rows
            sequence_parallel)
        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, group, cols, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.c_attn(x)  # the whole sequence, also when x is this rank's part of it
        b, t, _ = qkv.shape
        q, k, v = F.split_heads(qkv, self.n_head)
        att = F.attention_softmax(F.matmul(q, k.mT), 1.0 / math.sqrt(self.head_dim), causal=True)
        y = F.matmul(att, v).transpose(1, 2).reshape(b, t, self.n_head * self.head_dim)
        return self.c_proj(y)


class ParallelMLP(Module):
    """c_fc column-parallel (this rank's hidden features), GELU, c_proj row-parallel."""

    def __init__(self, mlp, group, sequence_parallel: bool = False) -> None:
        super().__init__()
        hidden = _split(mlp.c_fc.out_features, group_size(group), "the MLP width")

        def mine(q: int) -> np.ndarray:
            return np.arange(q * hidden, (q + 1) * hidden)

        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group, mine, sequence_parallel)
        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group, mine, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class SequenceParallelLayerNorm(LayerNorm):
    """A LayerNorm applied to this rank's sequence positions: its gradients are summed over
    the tensor-parallel group, so every rank holds the whole sequence's."""

    def __init__(self, *args, group=None, **kw) -> None:
        super().__init__(*args, **kw)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        b = copy_to_tp(self.bias, self.group) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, copy_to_tp(self.weight, self.group), b, self.eps)


def _copy_layer_norm(ln, group=None, sequence_parallel: bool = False) -> LayerNorm:
    if sequence_parallel:
        out = SequenceParallelLayerNorm(ln.weight.shape[0], bias=ln.bias is not None, eps=ln.eps, group=group)
    else:
        out = LayerNorm(ln.weight.shape[0], bias=ln.bias is not None, eps=ln.eps)
    out.weight = _param(ln.weight.numpy())
    if ln.bias is not None:
        out.bias = _param(ln.bias.numpy())
    return out


class ParallelBlock(Module):
    """A transformer block with tensor-parallel attention and MLP: 2 all-reduces forward, 2 backward
    (with sequence parallelism: 2 all-gathers and 2 reduce-scatters each way instead)."""

    def __init__(self, block, group, sequence_parallel: bool = False, expert_group=None) -> None:
        super().__init__()
        self.ln_1 = _copy_layer_norm(block.ln_1, group, sequence_parallel)
        self.attn = ParallelAttention(block.attn, group, sequence_parallel)
        self.ln_2 = _copy_layer_norm(block.ln_2, group, sequence_parallel)
        if hasattr(block.mlp, "split_hidden"):  # a mixture of experts (schedule.moe.MoEMLP)
            # each expert's MLP column-then-row, as ParallelMLP (sequence parallel: it gathers the tokens)
            block.mlp.split_hidden(group, expert_group, sequence_parallel)
            self.mlp = block.mlp
        else:
            self.mlp = ParallelMLP(block.mlp, group, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def embed_tokens(layers, idx: Tensor, sequence_parallel: bool) -> Tensor:
    """Token plus position embeddings of ``idx`` ([B, T] token ids) from ``layers.wte`` (a
    ``VocabParallelEmbedding``) and ``layers.wpe``: [B, T, C] on every rank, or with
    ``sequence_parallel`` this rank's [B, T/tp, C] shard (positions [r T/tp, (r + 1) T/tp))."""
    _, t = idx.shape
    if not sequence_parallel:
        return layers.wte(idx) + layers.wpe(arange(t, dtype=dt.int64))
    group = layers.wte.group
    tp, r = group_size(group), group_rank(group)
    lo = r * (t // tp)  # this rank's positions: [lo, lo + t/tp)
    # The position table sees only this rank's positions: its gradient is summed over the group.
    pos = F.embedding(arange(lo, lo + t // tp, dtype=dt.int64), copy_to_tp(layers.wpe.weight, group))
    return layers.wte(idx) + pos


def output_layer_input(x: Tensor, group, sequence_parallel: bool) -> Tensor:
    """The final LayerNorm's output ``x`` as every rank's vocabulary slice of the logits reads
    it: the whole sequence, all-gathered from the shards under ``sequence_parallel``.  Either
    way the backward sums the logits slices' gradients over ``group``."""
    if sequence_parallel:
        return gather_sequence(x, group)
    return copy_to_tp(x, group)


def _index_tensors(idx, targets):
    """Token ids and targets (arrays or lists) as int64 Tensors; Tensors and None pass through."""
    if not isinstance(idx, Tensor):
        idx = tensor(np.asarray(idx, np.int64), dtype=dt.int64)
    if targets is not None and not isinstance(targets, Tensor):
        targets = tensor(np.asarray(targets, np.int64), dtype=dt.int64)
    return idx, targets


class TensorParallelGPT(Module):
    """``gpt`` split over ``group`` (see the module docstring): ``model(idx, targets) ->
    (this rank's vocabulary slice of the logits, the whole model's mean loss)``.
    ``sequence_parallel``: the residual stream and LayerNorms hold T/tp positions per rank
    (T must then be a multiple of the group's size).  A mixture-of-experts GPT
    (``schedule.moe.use_experts``) has each expert's MLP split as the dense MLP is
    (``MoEMLP.split_hidden``); ``expert_group``: with expert parallelism too, the ep x tp
    ranks that hold the pieces of one replica's experts (``expert_groups(..., tp=)``)."""

    def __init__(self, gpt: GPT, group, sequence_parallel: bool = False, expert_group=None) -> None:
        super().__init__()
        cfg = gpt.config
        if cfg.dropout:
            raise ValueError("tensor parallel: dropout > 0 is not supported yet (it needs the same random mask "
                             "on every tensor-parallel rank); use dropout=0")
        self.config, self.group = cfg, group
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        self.wte = VocabParallelEmbedding(gpt.wte.weight.numpy(), group, self.sequence_parallel)
        self.vocab_lo = self.wte.lo
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.wpe.weight = _param(gpt.wpe.weight.numpy())
        self.h = ModuleList([ParallelBlock(b, group, self.sequence_parallel, expert_group) for b in gpt.h])
        self.ln_f = _copy_layer_norm(gpt.ln_f, group, self.sequence_parallel)

    def full_logits(self, logits: Tensor) -> np.ndarray:
        """The whole vocabulary's logits (host array) from every rank's slice (a collective)."""
        mine = np.ascontiguousarray(logits.numpy())
        tp = group_size(self.group)
        if tp == 1:
            return mine
        every = np.empty((tp,) + mine.shape, mine.dtype)
        dist.all_gather(every, mine, group=self.group)
        return np.concatenate(list(every), axis=-1)

    def forward(self, idx, targets=None):
        idx, targets = _index_tensors(idx, targets)
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        if self.sequence_parallel and t % group_size(self.group):
            if targets is not None:
                raise ValueError(f"sequence parallel: the sequence length {t} must be a multiple of the "
                                 f"tensor-parallel size {group_size(self.group)}")
            # Sampling grows the context one token at a time: pad it at the end (causal attention:
            # later positions change nothing before them) and drop the padding's logits.
            pad = -t % group_size(self.group)
            if t + pad > self.config.block_size:
                raise ValueError(f"sequence parallel: a context of {t} tokens pads to {t + pad}, more than "
                                 f"block_size {self.config.block_size}")
            padded = F.cat([idx, F.zeros_like(idx[:, :pad])], 1)
            logits, _ = self.forward(padded)
            return logits[:, :t], None
        x = embed_tokens(self, idx, self.sequence_parallel)
        for block in self.h:
            x = block(x)
        logits = F.matmul(output_layer_input(self.ln_f(x), self.group, self.sequence_parallel),
                          self.wte.weight.mT)  # tied: this rank's vocabulary rows
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t), self.vocab_lo,
                                                self.group)
        return logits, loss


def clip_grad_norm_(params, max_norm: float, group) -> Tensor:
    """Scale gradients so the whole model's L2 norm is at most ``max_norm``; returns the norm.

    A tensor-parallel shard's squares are summed over ``group`` (each rank holds a different
    part of the tensor), or over the group its layout names (expert tensors split over expert
    x tensor-parallel ranks); a replicated parameter's gradient is the same on every TP rank
    and counts once."""
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in params if getattr(p, "tp_layout", None) is not None and p.tp_layout.tp > 1]
    replicated = [p for p in params if not (getattr(p, "tp_layout", None) is not None and p.tp_layout.tp > 1)]
    # One sum per group, in the parameters' order (the same on every rank: one model).
    by_group: dict[int, tuple] = {id(group): (group, [])}
    for p in sharded:
        g = p.tp_layout.group if p.tp_layout.group is not None else group
        by_group.setdefault(id(g), (g, []))[1].append(p)

    def squares(ps):
        total = None
        for p in ps:
            s = F.sum(p.grad * p.grad)
            total = s if total is None else total + s
        return total

    with no_grad():
        total = squares(replicated)
        for g, ps in by_group.values():
            if ps:
                part = _all_reduce(squares(ps), g)
                total = part if total is None else total + part
        if total is None:
            return flat.zeros((), dt.float32)
        norm = F.sqrt(total)
        coef = F.clamp(F.rdiv(norm + 1e-6, float(max_norm)), max=1.0)
        for p in params:
            F.copy_(p.grad, p.grad * coef)
    return norm



# ---- LLaMA ----------------------------------------------------------------------------------------
class ParallelLlamaAttention(Module):
    """Grouped-query attention over this rank's heads: q_proj keeps the rows of this rank's H/tp
    query heads, k_proj and v_proj those of its Hk/tp key/value heads (column-parallel; with
    contiguous head ranges, query head h's key/value head h // (H/Hk) is on the same rank), o_proj
    the matching input columns (row-parallel).  The rotary tables are the whole model's."""

    def __init__(self, attn, group) -> None:
        super().__init__()
        tp = group_size(group)
        d = attn.head_dim
        self.n_head = _split(attn.n_head, tp, "the number of attention heads")
        self.n_kv_head = _split(attn.n_kv_head, tp, "the number of key/value heads")
        self.head_dim = d

        def heads(n: int):
            return lambda q: np.arange(q * n * d, (q + 1) * n * d)

        self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, group, heads(self.n_head))
        self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, group, heads(self.n_kv_head))
        self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, group, heads(self.n_kv_head))
        self.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, heads(self.n_head))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        from helios.models.generation import attention
        from helios.models.llama import merge_heads, rotary_qkv

        q, k, v = rotary_qkv(self, x, cos, sin, feeds_attention=True)
        return self.o_proj(merge_heads(attention(q, k, v, causal=True)))


class ParallelSwiGLU(Module):
    """down(silu(gate(x)) * up(x)) with gate and up column-parallel (this rank's intermediate
    features) and down row-parallel."""

    def __init__(self, mlp, group) -> None:
        super().__init__()
        inner = _split(mlp.gate_proj.out_features, group_size(group), "the MLP width (intermediate_size)")

        def mine(q: int) -> np.ndarray:
            return np.arange(q * inner, (q + 1) * inner)

        self.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, group, mine)
        self.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, group, mine)
        self.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group, mine)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _copy_rms_norm(norm):
    out = type(norm)(norm.weight.shape[0], eps=norm.eps)
    out.weight = _param(norm.weight.numpy())
    return out


class ParallelLlamaLayer(Module):
    """A LLaMA decoder layer with tensor-parallel attention and MLP (2 all-reduces forward, 2
    backward); its RMSNorms replicated."""

    def __init__(self, layer, group) -> None:
        super().__init__()
        self.self_attn = ParallelLlamaAttention(layer.self_attn, group)
        self.mlp = ParallelSwiGLU(layer.mlp, group)
        self.input_layernorm = _copy_rms_norm(layer.input_layernorm)
        self.post_attention_layernorm = _copy_rms_norm(layer.post_attention_layernorm)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _LlamaStack(Module):
    """``model`` of TensorParallelLlama: embed_tokens (vocabulary-parallel), layers, norm."""

    def __init__(self, llama_model, group) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(llama_model.embed_tokens.weight.numpy(), group)
        self.layers = ModuleList([ParallelLlamaLayer(layer, group) for layer in llama_model.layers])
        self.norm = _copy_rms_norm(llama_model.norm)


class TensorParallelLlama(Module):
    """A :class:`helios.models.LlamaForCausalLM` split over ``group`` as Megatron-LM splits a
    LLaMA (torchtitan's plan): ``model(idx, targets) -> (this rank's vocabulary slice of the
    logits, the whole model's mean loss)``.  q, k and v are column-parallel over the heads (the
    key/value heads too: ``num_key_value_heads`` must be a multiple of the group's size), o_proj
    row-parallel; gate and up column-parallel, down row-parallel; the embedding and the output
    head split by vocabulary rows (a tied head shares the embedding's shard), the loss the
    vocabulary-parallel cross entropy; RMSNorms and the rotary tables replicated.  Parameter names
    are the whole model's, so a checkpoint holds one device's tensors and resumes on any grid."""

    def __init__(self, llama, group) -> None:
        super().__init__()
        cfg = llama.config
        self.config, self.group = cfg, group
        self.model = _LlamaStack(llama.model, group)
        self.vocab_lo = self.model.embed_tokens.lo
        rows = _split(cfg.vocab_size, group_size(group), "the vocabulary size")
        if not cfg.tie_word_embeddings:  # (tied: the embedding's own shard, below)
            self.lm_head = ColumnParallelLinear.from_linear(llama.lm_head, group,
                                                            lambda q: slice(q * rows, (q + 1) * rows))
        self.register_buffer("rope_cos", llama.rope_cos)
        self.register_buffer("rope_sin", llama.rope_sin)

    def rotary(self, n: int) -> tuple[Tensor, Tensor]:
        """The whole model's rotary tables, [>= n, head_dim] (grown for a longer sequence)."""
        from helios.models.llama import grow_rotary

        return grow_rotary(self, n, self.model.norm.weight)

    full_logits = TensorParallelGPT.full_logits

    def forward(self, idx, targets=None):
        idx, targets = _index_tensors(idx, targets)
        b, t = idx.shape
        cos, sin = self.rotary(t)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos[:t], sin[:t])
        x = copy_to_tp(self.model.norm(x), self.group)
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        logits = F.matmul(x, head.weight.mT)  # this rank's vocabulary rows
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t), self.vocab_lo,
                                                self.group)
        return logits, loss
