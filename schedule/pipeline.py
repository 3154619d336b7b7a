"""Pipeline parallelism: a GPT's blocks split into stages on consecutive ranks, trained with
the 1F1B schedule (Narayanan et al. 2021, PipeDream-Flush).

    stage = PipelineStage(GPT(cfg, seed=0), grid)         # every rank builds the same GPT, keeps its stage
    loss = stage.train_step(x_micro, y_micro)              # m micro-batches; gradients accumulated
    opt.step()                                              # AdamW over stage.parameters()

Stages are contiguous runs of layers balanced by parameter count, the embeddings on the
first stage and the final LayerNorm and the (tied) output layer on the last.  Parameter count
misjudges the last layer: it weighs only the final LayerNorm's parameters but runs the output
layer's matmul against the whole tied table and the cross entropy.  ``layer_times`` measures
each layer's forward and backward on this device instead, and ``PipelineStage(gpt, grid,
weights=times)`` balances on those (helios-train's ``--pp-balance time``).  Activations
go forward and their gradients backward with ``isend``/``irecv`` between neighbours.  A
stage's parameters keep the whole model's names (``wte.weight``, ``h.5.attn.c_attn.weight``),
so a checkpoint written by the stages is one device's.

1F1B on stage s of p with m micro-batches: ``min(p - s - 1, m)`` forwards to fill the pipe,
then one forward and one backward alternately, then the remaining backwards; a stage holds
at most p - s micro-batches' activations (p on the first), and each stage idles for
(p - 1) of m + p - 1 slots (the bubble).  Each micro-batch's loss is scaled by 1/m and the
scaled losses are summed on the device in micro-batch order, so the loss and the gradients
are those of one device accumulating the same m micro-batches.

The interleaved schedule (Megatron-LM's virtual stages, helios-train's ``--pp-virtual v``):
``InterleavedPipelineStage(gpt, grid, v)`` holds v chunks, the layers cut into pp x v runs
that go round-robin over the ranks (chunk c of rank r is virtual stage c * pp + r), and runs
``pipeline_schedule``'s order; the bubble shrinks to (p - 1) of v * m + p - 1 chunk slots.
``simulate_schedule`` runs any (p, v, m) on a unit-time clock.

The tied embedding lives on the first stage (input) and the last (output layer): each
keeps a copy, and after the step's backwards the two gradients are summed between them
(Megatron's embedding group).

Mixture-of-experts blocks (``helios.schedule.moe.use_experts``): each stage adds the
load-balancing loss of its own blocks, scaled by 1/m as the micro-batch's loss, to that
micro-batch's backward (``moe.with_aux`` hangs it on the stage's output), so every stage's
gradients are one device's of ``loss + aux`` over the same micro-batches; ``moe_totals()``
sums the step's aux loss and dropped pairs over the stages for the log.

Mixed precision (helios-train ``--dtype bf16``): ``train_step(..., autocast=factory)`` and
``evaluate(..., autocast=factory)`` run every stage's forwards under ``factory()`` (e.g.
``lambda: hl.autocast("bfloat16")``), as one device's forward runs.  The activations passed
between stages are float32: autocast leaves the residual stream in float32 (float32
embeddings plus 16-bit projections promote), so the stages pass one device's stream
unrounded (bfloat16 would halve the bytes but round it, and the pipeline would no longer
train what one device trains).  Backward never casts: the parameters get float32 gradients.

ZeRO-3 (helios-train ``--pp --zero 3``): the stage's blocks are ZeRO-3 units
(``_Blocks.children_are_units``); the trainer sets ``stage.pass_scope`` to the optimizer's
``forward_scope`` (each pass of the stage runs inside it: the stage runs its units itself,
never the model's forward) and ``stage.sum_tied_locally = False`` (the tied table's halves are
reduced into ZeRO's shards during backward and summed there).  With the interleaved schedule
(``--pp-virtual``) each backward runs one chunk: the trainer also sets ``stage.chunk_scope`` to
the optimizer's ``chunk_scope``, which each backward of chunk c runs inside, given
``chunk_parameters(c)``, so it reduces that chunk's gradients only.

A tensor-parallel model (``TensorParallelGPT``) splits into stages the same way: each
tensor-parallel rank of a stage holds its shards, activations pass between the ranks of
equal tensor-parallel index, and the last stage's loss is the vocabulary-parallel cross
entropy (the logits are never gathered).  A sequence-parallel one (Megatron-LM's layout)
passes each tensor-parallel rank's [B, T/tp, C] shard of the residual stream and its
gradient: the first stage embeds only its rank's positions, the last gathers the sequence
after the final LayerNorm, as the model's own forward does.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

import helios.comm as dist
from helios import dtypes as dt
from helios import flat
from helios import functional as F
from helios.autograd.tape import is_grad_enabled, no_grad
from helios.creation import tensor
from helios.nn import GPT, Module
from helios.nn.modules import embed_with_positions, norm_for_product, position_ids
from helios.schedule.grid import group_size
from helios.schedule.moe import with_aux


def balance(weights: list[float], parts: int) -> list[tuple[int, int]]:
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


def describe_stages(bounds: list[tuple[int, int]], n_layer: int, pp: int | None = None,
                    times: list[float] | None = None) -> str:
    """What each stage holds, in one line: ``0: embeddings, blocks 0-1 | 1: blocks 2-3, final LayerNorm``.
    With more stages than ``pp`` ranks (virtual stages), each says its rank and chunk:
    ``2 (rank 0 chunk 1): block 1``.  With ``times`` (seconds per layer, ``layer_times``), each
    stage ends with the sum of its layers' measured times: ``0: embeddings, block 0 (4.1 ms)``."""
    if times is not None and len(times) != n_layer + 2:
        raise ValueError(f"describe_stages: {len(times)} times for {n_layer + 2} layers")
    parts = []
    for s, (lo, hi) in enumerate(bounds):
        what = ["embeddings"] if lo == 0 else []
        blocks = [i - 1 for i in range(lo, hi) if 1 <= i <= n_layer]
        if blocks:
            what.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
        if hi == n_layer + 2:
            what.append("final LayerNorm and output layer")
        label = f"{s} (rank {s % pp} chunk {s // pp})" if pp and len(bounds) > pp else str(s)
        cost = f" ({sum(times[lo:hi]) * 1e3:.1f} ms)" if times is not None else ""
        parts.append(f"{label}: {', '.join(what)}{cost}")
    return " | ".join(parts)


def _whole_numel(p) -> int:
    """Elements of the whole tensor a (possibly tensor-parallel) parameter is part of: stages are
    balanced on the whole model, so the split does not depend on --tp."""
    from helios.schedule.tensor_parallel import full_shape

    return int(np.prod(full_shape(p)))


def layer_weights(gpt) -> list[int]:
    """Parameter counts of the layers the pipeline splits: embeddings, each block, final LayerNorm."""
    emb = _whole_numel(gpt.wte.weight) + _whole_numel(gpt.wpe.weight)
    blocks = [sum(_whole_numel(p) for p in b.parameters()) for b in gpt.h]
    return [emb] + blocks + [sum(_whole_numel(p) for p in gpt.ln_f.parameters())]


def _embeddings(layers, idx):
    """Token plus position embeddings of ``idx`` ([b, t] int64), then their dropout where
    ``layers`` has one (a GPT, or the first stage of one).  A sequence-parallel model's are this
    tensor-parallel rank's t/tp positions, as its own forward embeds them."""
    if getattr(layers, "sequence_parallel", False):
        from helios.schedule.tensor_parallel import embed_tokens

        return embed_tokens(layers, idx, sequence_parallel=True)  # (no dropout under tensor parallelism)
    _, t = idx.shape
    # the cached positions (with their host copy: the embedding's backward groups them there)
    x = embed_with_positions(layers.wte, layers.wpe, idx, position_ids(t, layers.wte.weight.untyped_storage().rt))
    drop = getattr(layers, "drop", None)  # (none in a tensor-parallel model)
    return drop(x) if drop is not None else x


def _logits(layers, x, tp_group):
    """The final LayerNorm of ``x`` [b, t, C] and the tied output layer: the logits (this rank's
    vocabulary slice of them under tensor parallelism; a sequence-parallel model's ``x`` is this
    rank's [b, t/tp, C] shard, gathered after the LayerNorm, so the logits cover all t)."""
    if tp_group is None:  # the head's autocast product alone reads it, as in GPT.forward
        return F.linear(norm_for_product(layers.ln_f, x, None), layers.wte.weight)
    from helios.schedule.tensor_parallel import output_layer_input

    x = output_layer_input(layers.ln_f(x), tp_group, getattr(layers, "sequence_parallel", False))
    return F.linear(x, layers.wte.weight)


def _stream_shape(b: int, t: int, n_embd: int, tp_group, sequence_parallel: bool) -> tuple[int, int, int]:
    """The shape of the residual stream of ``b`` sequences of ``t`` tokens on one rank: a
    sequence-parallel model's ranks each hold t/tp positions (what its stages pass)."""
    if not sequence_parallel:
        return b, t, n_embd
    tp = group_size(tp_group)
    if t % tp:
        raise ValueError(f"pipeline: sequence parallel: the sequence length {t} must be a multiple of the "
                         f"tensor-parallel size {tp}")
    return b, t // tp, n_embd


def _cross_entropy(logits, targets, tp_group, vocab_lo: int):
    """The mean loss of [N, V] ``logits`` (the vocabulary-parallel one over ``tp_group``: the
    logits are never gathered)."""
    if tp_group is None:
        return F.cross_entropy(logits, targets)
    from helios.schedule.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets, vocab_lo, tp_group)


def layer_times(gpt, batch, reps: int = 5, warmup: int = 1) -> list[float]:
    """Seconds of one forward plus backward of each layer the pipeline splits, on this device,
    for one micro-batch ``batch`` ([b, t] token ids): the embeddings; each block; the final
    LayerNorm with the output layer and the cross entropy (the next tokens as targets).  Each
    layer runs ``warmup`` times unmeasured, then ``reps`` times; the median is returned, in the
    order of ``layer_weights`` (so ``balance(layer_times(...), p)`` splits by time).

    A layer's time runs from its input to its input's gradient, the device finished at both ends
    (a block's input is a random activation, its output's gradient random too).  The repetitions
    go round all the layers in turn, so a change in the machine's load touches every layer alike.
    ``gpt`` is a ``helios.nn.GPT`` or a ``TensorParallelGPT``.  The parameters' gradients are
    left None and the random generator as it was: training afterwards is what it would have
    been.  Under helios.comm every rank calls it together and all return rank 0's times
    (broadcast), so every rank balances the same split.  Rank 0 measures alone while the others
    wait, unless the layers hold collectives (tensor-parallel layers, experts spread over
    expert-parallel ranks): then every rank measures with it, as those collectives need.  (With every
    rank measuring at once on shared cores, a block's median came out 2-6x the other blocks' in
    several runs; rank 0 alone is disturbed less often, not never.)"""
    from helios.random import get_rng_state, set_rng_state
    from helios.runtime import get_runtime

    ids = np.asarray(batch, np.int64)
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"layer_times: batch must be [batch, tokens] token ids, got shape {ids.shape}")
    if reps < 1 or warmup < 0:
        raise ValueError(f"layer_times: reps must be at least 1 and warmup 0 or more, got {reps} and {warmup}")
    rt = get_runtime()
    tp_group = None if isinstance(gpt, GPT) else gpt.group
    b, t = ids.shape
    cfg = gpt.config
    rng = np.random.default_rng(0)
    shape = _stream_shape(b, t, cfg.n_embd, tp_group, getattr(gpt, "sequence_parallel", False))
    x_np = rng.standard_normal(shape).astype(np.float32)
    g_np = rng.standard_normal(shape).astype(np.float32) / np.sqrt(b * t * cfg.n_embd)
    idx = tensor(ids, dtype=dt.int64)
    tgt = tensor(np.roll(ids, -1, axis=1).reshape(b * t), dtype=dt.int64)
    upstream = tensor(g_np)

    def embeddings() -> None:
        _embeddings(gpt, idx).backward(upstream)

    def block(i: int):
        def run() -> None:
            x = tensor(x_np, requires_grad=True)
            gpt.h[i](x).backward(upstream)
        return run

    def head() -> None:
        x = tensor(x_np, requires_grad=True)
        logits = _logits(gpt, x, tp_group)
        _cross_entropy(logits.reshape(b * t, -1), tgt, tp_group, getattr(gpt, "vocab_lo", 0)).backward()

    layers = [embeddings] + [block(i) for i in range(cfg.n_layer)] + [head]
    shared = dist.is_initialized() and dist.get_world_size() > 1
    times = np.zeros(len(layers), np.float64)
    if not shared or dist.get_rank() == 0 or _layers_talk(gpt):
        state = get_rng_state()
        samples: list[list[float]] = [[] for _ in layers]
        try:
            for r in range(warmup + reps):
                for k, run in enumerate(layers):
                    rt.synchronize()
                    t0 = time.perf_counter()
                    run()
                    rt.synchronize()
                    if r >= warmup:
                        samples[k].append(time.perf_counter() - t0)
        finally:
            for p in gpt.parameters():
                p.grad = None
            set_rng_state(state)
        times[:] = [np.median(s) for s in samples]
    if shared:
        dist.broadcast(times, src=0)  # one rank's figures: every rank balances the same numbers
    return [float(v) for v in times]


def _layers_talk(gpt) -> bool:
    """Whether running ``gpt``'s layers takes collectives with other ranks: tensor-parallel
    layers, or experts spread over more than one expert-parallel rank."""
    if not isinstance(gpt, GPT):
        return True
    for m in gpt.modules():
        group = getattr(m, "ep_group", None)
        if group is not None and group_size(group) > 1:
            return True
    return False


class _Blocks(Module):
    """A stage's transformer blocks, registered under their index in the whole model, so the
    stage's parameter names are the single-device model's (``h.<i>.…``)."""

    # The stage calls each block itself: ZeRO-3 gathers block by block, as for GPT's ModuleList.
    children_are_units = True

    def __init__(self, blocks: dict[int, Module]) -> None:
        super().__init__()
        for i, b in blocks.items():
            self.add_module(str(i), b)

    def __iter__(self):
        return self.children()

    def __len__(self) -> int:
        return len(list(self.children()))


class PipelineStage(Module):
    """This rank's stage of ``gpt`` on ``grid`` (a ParallelGrid; stage = its pp rank).

    ``gpt`` is a ``helios.nn.GPT``, or a ``TensorParallelGPT`` over ``grid.tp_group``.  The
    stage keeps references to ``gpt``'s own layers (drop ``gpt`` afterwards: the layers of
    other stages are then freed)."""

    def __init__(self, gpt, grid, weights: list[float] | None = None) -> None:
        self._build(gpt, grid, 1, weights)

    def _build(self, gpt, grid, virtual: int, weights: list[float] | None = None) -> None:
        """This rank's layers of ``gpt`` split into ``pp x virtual`` stages (virtual stage
        ``c * pp + rank`` is this rank's chunk c), and the tied table's group.  ``weights``: one
        per layer (``layer_times``) to balance on instead of the parameter counts; every rank of
        the pipeline must give the same ones."""
        Module.__init__(self)
        self._loss_scale = 1.0  # train_step's: what each micro-batch's backward is seeded with
        cfg = gpt.config
        self.config, self.grid, self.group = cfg, grid, grid.pp_group
        self.pp, self.stage = grid.pp, grid.pp_rank
        self.ranks = grid.peers("pp")
        # The tensor-parallel group of a TensorParallelGPT (its vocabulary-parallel embedding and loss).
        self.tp_group = None if isinstance(gpt, GPT) else gpt.group
        self.vocab_lo = getattr(gpt, "vocab_lo", 0)
        # A sequence-parallel model's stages pass each tensor-parallel rank's [B, T/tp, C] shard of
        # the residual stream (Megatron-LM's layout): the first embeds only its positions, the last
        # gathers the sequence after the final LayerNorm.
        self.sequence_parallel = getattr(gpt, "sequence_parallel", False)
        # Layers as the pipeline sees them: [embeddings, block 0, ..., block L-1, final LayerNorm].
        self.virtual = virtual
        self._moe_step = None  # see _moe_aux
        self._cast = contextlib.nullcontext  # the autocast of the step or evaluation running (see _casting)
        # The context every pass of the stage runs in: a ZeRO-3 optimizer's forward_scope (the stage
        # runs its units itself, never the model's forward, which would set it up).
        self.pass_scope = contextlib.nullcontext
        # False: the optimizer sums the tied table's two gradients (ZeRO-3 reduces every micro-batch's
        # gradients into its shards during backward: they are summed there, shard by shard).
        self.sum_tied_locally = True
        # The context each backward of one chunk runs in, given the chunk's parameters (a ZeRO-3
        # optimizer's chunk_scope: the backward reduces those only, the other chunks' wait for theirs).
        self.chunk_scope = lambda params: contextlib.nullcontext()
        if weights is not None and len(weights) != cfg.n_layer + 2:
            raise ValueError(f"pipeline: {len(weights)} layer weights for the model's {cfg.n_layer + 2} layers "
                             "(embeddings, each block, final LayerNorm)")
        self.bounds = balance(layer_weights(gpt) if weights is None else list(weights), self.pp * virtual)
        # The embeddings are on virtual stage 0 (this rank's chunk 0 on the first rank) and the
        # output layer on the last (chunk v - 1 on the last rank).
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self.chunk_blocks = []  # the block ids of each of this rank's chunks
        for c in range(virtual):
            lo, hi = self.bounds[c * self.pp + self.stage]
            self.chunk_blocks.append([i - 1 for i in range(lo, hi) if 1 <= i <= cfg.n_layer])
        self.block_ids = [i for ids in self.chunk_blocks for i in ids]
        self.h = _Blocks({i: gpt.h[i] for i in self.block_ids})
        if self.first or self.last:
            self.wte = gpt.wte  # the tied table: input on the first stage, output on the last
        if self.first:
            self.wpe = gpt.wpe
            self.drop = getattr(gpt, "drop", None)  # the embeddings' dropout (none in a tensor-parallel model)
        if self.last:
            self.ln_f = gpt.ln_f
        # The tied table's two gradients are summed between the first and the last stage of
        # each pipeline: the grid's embedding group.
        self.embedding_group = grid.embedding_group if self.pp > 1 else None

    # ---- one micro-batch --------------------------------------------------------------
    def _forward(self, x_in, idx_or_none, targets, scale: float):
        """This stage's part of the model for one micro-batch: the input activation (or token
        ids on the first stage) -> the output activation; on the last stage the scaled loss,
        or the logits (this rank's vocabulary slice under tensor parallelism) without targets."""
        return self._through(self.h, self.first, self.last, x_in, idx_or_none, targets, scale)

    def _through(self, blocks, embed: bool, head: bool, x_in, idx_or_none, targets, scale: float):
        """``blocks`` for one micro-batch, after the embeddings when ``embed`` (from token ids)
        and followed by the final LayerNorm, the output layer and the scaled loss when ``head``.
        The model's own ops run under the step's autocast (``_cast``), as one device's forward
        does; the load-balancing loss and the 1/m scale after it, as one device adds them."""
        with self._cast():
            if embed:
                x = _embeddings(self, idx_or_none)
            else:
                x = x_in
            for block in blocks:
                x = block(x)
        aux = self._moe_aux(blocks, scale)
        if not head:
            if x.dtype is not dt.float32:
                # The stages pass float32 activations (the receive buffers are float32): under
                # autocast the residual stream stays float32 (float32 embeddings plus 16-bit
                # projections promote to float32), so this is one device's stream unrounded.
                raise RuntimeError(f"pipeline: a stage's output is {x.dtype.name}; the stages pass float32 "
                                   "activations")
            return with_aux(x, aux, self._loss_scale)
        with self._cast():
            logits = _logits(self, x, self.tp_group)
            if targets is None:
                return logits
            b, t = logits.shape[:2]  # (every position's: a sequence-parallel x held this rank's only)
            loss = self._loss(logits.reshape(b * t, -1), targets.reshape(b * t))
        return with_aux(loss * scale, aux, self._loss_scale)

    def _moe_aux(self, blocks, scale: float):
        """The load-balancing loss of the mixture-of-experts layers in ``blocks`` (their forward
        just ran), scaled as the micro-batch's loss, for the backward to differentiate (None
        without experts, or when not training); the step's totals are kept for the log."""
        if not is_grad_enabled():
            return None
        from helios.schedule.moe import aux_loss, dropped_pairs

        aux = aux_loss(blocks)
        if aux is None:
            return None
        aux = aux * scale
        # Accumulated on the device in micro-batch order, as one device sums them.
        drop = dropped_pairs(blocks)
        self._moe_step = (aux.detach(), drop) if self._moe_step is None else (
            self._moe_step[0] + aux.detach(), self._moe_step[1] + drop)
        return aux

    def moe_totals(self) -> tuple[float, int] | None:
        """The last training step's load-balancing loss (scaled per micro-batch, summed over the
        micro-batches) and its dropped (token, choice) pairs, each summed over every stage of
        this pipeline: what one device logs for the whole model.  A collective over the
        pipeline group; None for a model without experts."""
        mine = getattr(self, "_moe_step", None)
        if mine is None and not self._has_experts():
            return None
        both = np.array([0.0, 0.0] if mine is None else [mine[0].item(), mine[1].item()], np.float64)
        if self.pp > 1:
            dist.all_reduce(both, group=self.group)
        return float(both[0]), int(both[1])

    def _has_experts(self) -> bool:
        from helios.schedule.moe import MoEMLP

        return any(isinstance(m, MoEMLP) for m in self.modules())

    def _loss(self, logits, targets):
        return _cross_entropy(logits, targets, self.tp_group, self.vocab_lo)

    def _activation_shape(self, ids) -> tuple[int, int, int]:
        """The shape of the activation (and of its gradient) the stages pass for the micro-batch
        of token ids ``ids``: [b, t, C], or this rank's [b, t/tp, C] under sequence parallelism."""
        b, t = np.asarray(ids).shape
        return _stream_shape(b, t, self.config.n_embd, self.tp_group, self.sequence_parallel)

    def _neighbours(self) -> tuple[int | None, int | None]:
        """The global ranks of the previous and the next stage (None at the ends)."""
        prev = self.ranks[self.stage - 1] if not self.first else None
        nxt = self.ranks[self.stage + 1] if not self.last else None
        return prev, nxt

    @contextlib.contextmanager
    def _casting(self, autocast):
        """Run the stage's forwards under ``autocast`` (a factory of autocast contexts, one per
        forward, as helios-train's ``--dtype``; None: float32) while the block runs."""
        self._cast = autocast or contextlib.nullcontext
        try:
            yield
        finally:
            self._cast = contextlib.nullcontext

    def train_step(self, inputs: list, targets: list, phase=None, autocast=None, loss_scale: float = 1.0) -> float | None:
        """Forward and backward of every micro-batch in 1F1B order; gradients accumulate in the
        stage's parameters.  Every stage gets the same lists (only the first reads ``inputs``,
        only the last ``targets``).  Returns the mean loss on the last stage, None elsewhere.

        ``phase(name)``, when given, is a context manager that times the step's parts: each
        micro-batch's "forward" and "backward", and as "comm" the waits on a neighbour and the
        tied table's gradient exchange (a trainer's StepTimer.phase).  ``autocast``: a factory
        of the contexts each forward runs under (``lambda: hl.autocast("bfloat16")``), so the
        stages compute what one device's autocast forward computes; the activations passed
        between stages stay float32 (the residual stream autocast leaves in float32) and the
        parameters get float32 gradients (backward never casts).  ``loss_scale``: each micro-batch's
        loss is multiplied by it before its backward (a float16 run's ``GradScaler.get_scale()``),
        as one device's ``scaler.scale(loss).backward()`` does; the gradients passed between
        stages are then scaled too, and every stage unscales its own."""
        self._loss_scale = float(loss_scale)
        with self._casting(autocast), self.pass_scope():
            return self._train_step(inputs, targets, phase)

    def _seeded(self, out):
        """The last stage's micro-batch loss as its backward starts from: times the loss scale."""
        return out * self._loss_scale if self._loss_scale != 1.0 else out

    def _train_step(self, inputs: list, targets: list, phase=None) -> float | None:
        m = len(inputs)
        if m < 1:
            raise ValueError("pipeline: give at least one micro-batch")
        timed = phase or (lambda name: contextlib.nullcontext())
        self._moe_step = None  # (load-balancing loss, dropped pairs) of this step's micro-batches
        shape = self._activation_shape(inputs[0])
        prev, nxt = self._neighbours()
        warm = min(self.pp - self.stage - 1, m)
        held: list = []  # (input leaf, output) of micro-batches whose backward is still to come
        sends: list = []
        total = None  # the scaled losses summed in micro-batch order, on the device
        done_fwd = done_bwd = 0
        waited = [0.0]  # seconds blocked waiting for a neighbour (the bubble, and any imbalance)
        t_start = time.perf_counter()

        def receive(buf, peer) -> None:
            waited[0] += self._timed_recv(buf, peer, timed)

        def forward_one() -> None:
            nonlocal done_fwd, total
            i = done_fwd
            with timed("forward"):
                x_in = None
                if not self.first:
                    x_in = flat.empty(shape, dt.float32)
                    receive(x_in, prev)
                    x_in.requires_grad = True
                idx = tensor(np.asarray(inputs[i], np.int64), dtype=dt.int64) if self.first else None
                tgt = tensor(np.asarray(targets[i], np.int64), dtype=dt.int64) if self.last else None
                out = self._forward(x_in, idx, tgt, 1.0 / m)
                if self.last:
                    total = out.detach() if total is None else total + out.detach()
                else:
                    sends.append(dist.isend(out.detach(), nxt))
                self._sync()
            held.append((x_in, out))
            done_fwd += 1

        def backward_one() -> None:
            nonlocal done_bwd
            x_in, out = held.pop(0)
            with timed("backward"):
                if self.last:
                    self._seeded(out).backward()
                else:
                    g = flat.empty(shape, dt.float32)
                    receive(g, nxt)
                    out.backward(g)
                if not self.first:
                    sends.append(dist.isend(x_in.grad, prev))
                self._sync()
            done_bwd += 1

        for _ in range(warm):
            forward_one()
        for _ in range(m - warm):
            forward_one()
            backward_one()
        while done_bwd < m:
            backward_one()
        self._finish_step(sends, waited[0], t_start, timed)
        return total.item() if self.last else None

    def _timed_recv(self, buf, peer: int, timed) -> float:
        """Receive ``buf`` from ``peer``; the seconds spent waiting for it.  The device finishes
        this rank's recorded work first, so the wait counts only the neighbour's lateness."""
        self._sync()
        with timed("comm"):
            t0 = time.perf_counter()
            dist.recv(buf, peer)
            return time.perf_counter() - t0

    def _finish_step(self, sends: list, waited: float, t_start: float, timed) -> None:
        """End of a training step: wait for the sends still in flight, note the share of the step
        spent waiting on neighbours, and sum the tied table's gradients."""
        self._sync()
        with timed("comm"):
            t0 = time.perf_counter()
            for w in sends:
                w.wait()
            waited += time.perf_counter() - t0
            elapsed = time.perf_counter() - t_start
            # With every stage (chunk) costing the same, the bubble alone makes this
            # (p - 1) / (m + p - 1) for 1F1B and (p - 1) / (v m + p - 1) interleaved.
            self.last_idle_fraction = waited / elapsed if elapsed > 0 else 0.0
            # (the stage's own work in the step: what a window common to every stage is measured against)
            self.last_busy_seconds = elapsed - waited
            self._sum_tied_gradients()

    def _sum_tied_gradients(self) -> None:
        """The tied table's gradient: the input embedding's (first stage) plus the output
        layer's (last stage), on both."""
        if self.embedding_group is None or self.wte.weight.grad is None or not self.sum_tied_locally:
            return
        with no_grad():
            g = self.wte.weight.grad
            whole = g if g.is_contiguous() else flat.copy(g)  # the output layer's gradient is a transposed view
            dist.all_reduce(whole, group=self.embedding_group)
            self.wte.weight.grad = whole

    # ---- forward only: evaluation and sampling ------------------------------------------
    @no_grad()
    def _forward_only(self, inputs: list, targets: list | None) -> list:
        """Each micro-batch through the pipeline without gradients; the last stage's outputs
        (scaled losses, or logits without ``targets``), an empty list on the other stages."""
        m = len(inputs)
        prev, nxt = self._neighbours()
        outs, sends = [], []
        for i in range(m):
            x_in = None
            if not self.first:
                x_in = flat.empty(self._activation_shape(inputs[i]), dt.float32)
                dist.recv(x_in, prev)
            idx = tensor(np.asarray(inputs[i], np.int64), dtype=dt.int64) if self.first else None
            tgt = None
            if self.last and targets is not None:
                tgt = tensor(np.asarray(targets[i], np.int64), dtype=dt.int64)
            out = self._forward(x_in, idx, tgt, 1.0 / m)
            if self.last:
                outs.append(out)
            else:
                self._sync()
                sends.append((dist.isend(out, nxt), out))  # the tensor lives until its send is done
        for w, _ in sends:
            w.wait()
        return outs

    def evaluate(self, inputs: list, targets: list, autocast=None) -> float | None:
        """The mean loss over the micro-batches (no gradients) on the last stage, None elsewhere
        (every stage calls it with the same lists; ``autocast`` as in ``train_step``)."""
        with self._casting(autocast), no_grad(), self.pass_scope():  # (a scope left without gradients releases)
            outs = self._forward_only(inputs, targets)
        if not self.last:
            return None
        total = outs[0]
        for o in outs[1:]:
            total = total + o
        return total.item()

    def infer(self, idx) -> object | None:
        """The logits of one batch of token ids on the last stage (this rank's vocabulary slice
        under tensor parallelism), None elsewhere (every stage calls it with the same ids).
        Under sequence parallelism a context that does not split over the tensor-parallel ranks
        (sampling grows it one token at a time) is padded at the end, as the model's own forward
        pads it: causal attention leaves the positions before the padding unchanged, and the
        padding's logits are dropped."""
        ids = np.asarray(idx, np.int64)
        t = ids.shape[1]
        pad = -t % group_size(self.tp_group) if self.sequence_parallel else 0
        if pad:
            ids = np.concatenate([ids, np.zeros((ids.shape[0], pad), np.int64)], axis=1)
        with no_grad(), self.pass_scope():
            outs = self._forward_only([ids], None)
        if not self.last:
            return None
        return outs[0][:, :t] if pad else outs[0]

    def full_logits(self, logits) -> np.ndarray:
        """The whole vocabulary's logits (host array) on the last stage; gathered from the
        tensor-parallel ranks' slices (a collective over the tensor-parallel group)."""
        mine = np.ascontiguousarray(logits.numpy())
        if self.tp_group is None or group_size(self.tp_group) == 1:
            return mine
        tp = group_size(self.tp_group)
        every = np.empty((tp,) + mine.shape, mine.dtype)
        dist.all_gather(every, mine, group=self.tp_group)
        return np.concatenate(list(every), axis=-1)

    def from_last_stage(self, value: int) -> int:
        """``value`` as the last stage has it, on every stage of this pipeline (a sampled token)."""
        if self.pp == 1:
            return value
        buf = np.array([value], np.int64)
        dist.broadcast(buf, src=self.ranks[-1], group=self.group)
        return int(buf[0])

    def _sync(self) -> None:
        from helios.runtime import get_runtime

        get_runtime().synchronize()

    def owns(self, name: str) -> bool:
        """Whether this stage counts parameter ``name`` as its own (in the gradient norm and in
        checkpoints): every parameter it holds except the last stage's copy of the tied table."""
        return not (name == "wte.weight" and self.last and not self.first)

    def owned_parameters(self) -> list:
        """The parameters whose gradient norm this stage counts (the tied table once: the first stage's)."""
        return [p for n, p in self.named_parameters() if self.owns(n)]


# ---- the interleaved schedule (virtual stages) ------------------------------------------------
def pipeline_schedule(pp: int, virtual: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The ordered operations of pipeline rank ``rank`` of ``pp`` for one step of ``m``
    micro-batches: ``("F" | "B", micro-batch, chunk)``.  Chunk c of rank r is virtual stage
    ``c * pp + r``.

    ``virtual == 1`` is 1F1B (``PipelineStage.train_step``'s order): ``min(pp - rank - 1, m)``
    forwards, then a forward and a backward alternately, then the remaining backwards.
    ``virtual > 1`` is Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, 2.2): the
    ``m x virtual`` (micro-batch, chunk) forwards run in groups of ``pp`` micro-batches, chunk
    0 of the group's micro-batches, then chunk 1, ...; the backwards the same way from the last
    chunk down; ``2 (pp - rank - 1) + (virtual - 1) pp`` forwards fill the pipe before the
    steady one-forward-one-backward.  ``m`` must then be a multiple of ``pp``."""
    for name, n in (("pp", pp), ("virtual", virtual), ("m", m)):
        if n < 1:
            raise ValueError(f"pipeline_schedule: {name} must be at least 1, got {n}")
    if not 0 <= rank < pp:
        raise ValueError(f"pipeline_schedule: rank must be in [0, {pp}), got {rank}")
    if virtual == 1:
        warm = min(pp - rank - 1, m)
        ops = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i, 0), ("B", i, 0)]
        return ops + [("B", i, 0) for i in range(m - warm, m)]
    if m % pp:
        raise ValueError(f"pipeline_schedule: the interleaved schedule runs micro-batches in groups of the {pp} "
                         f"stages; {m} micro-batches is not a multiple of {pp}")
    total, group = m * virtual, pp * virtual

    def micro(k: int) -> int:  # the k-th forward (or backward) works on this micro-batch
        return (k // group) * pp + k % pp

    def chunk(k: int, forward: bool) -> int:
        c = (k % group) // pp
        return c if forward else virtual - 1 - c

    warm = min(2 * (pp - rank - 1) + (virtual - 1) * pp, total)
    ops = [("F", micro(k), chunk(k, True)) for k in range(warm)]
    for k in range(total - warm):
        ops += [("F", micro(warm + k), chunk(warm + k, True)), ("B", micro(k), chunk(k, False))]
    return ops + [("B", micro(k), chunk(k, False)) for k in range(total - warm, total)]


def _needs(op: tuple[str, int, int], rank: int, pp: int, stages: int) -> list[tuple[str, int, int]]:
    """What an operation waits for, as (kind, micro-batch, virtual stage): a forward the previous
    virtual stage's forward of its micro-batch; a backward its own forward and the next virtual
    stage's backward."""
    kind, i, c = op
    k = c * pp + rank
    if kind == "F":
        return [("F", i, k - 1)] if k > 0 else []
    return [("F", i, k)] + ([("B", i, k + 1)] if k < stages - 1 else [])


def simulate_schedule(pp: int, virtual: int, m: int, forward: float = 1.0, backward: float = 1.0) -> dict:
    """Run every rank's ``pipeline_schedule`` on a clock where a chunk's forward takes
    ``forward`` and its backward ``backward`` (communication free), each operation as soon as
    its rank is free and what it waits for is done.  Returns ``makespan``, per rank ``busy`` and
    ``idle_fraction`` (the share of the makespan the rank waits: the bubble), and ``order``: the
    operations as they finished, ``(end, rank, kind, micro-batch, chunk)``.  Raises RuntimeError
    if the schedule deadlocks or misses or repeats an operation."""
    stages = pp * virtual
    lists = [pipeline_schedule(pp, virtual, m, r) for r in range(pp)]
    for r, ops in enumerate(lists):
        want = {(kind, i, c) for kind in "FB" for i in range(m) for c in range(virtual)}
        if len(ops) != len(want) or set(ops) != want:
            raise RuntimeError(f"simulate_schedule: rank {r} does not run every operation exactly once")
    done: dict[tuple[str, int, int], float] = {}
    pos, free, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    order = []
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                op = lists[r][pos[r]]
                needs = _needs(op, r, pp, stages)
                if not all(n in done for n in needs):
                    break
                cost = forward if op[0] == "F" else backward
                end = max([free[r]] + [done[n] for n in needs]) + cost
                done[(op[0], op[1], op[2] * pp + r)] = end
                free[r], busy[r] = end, busy[r] + cost
                order.append((end, r) + op)
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: lists[r][pos[r]] for r in range(pp) if pos[r] < len(lists[r])}
            raise RuntimeError(f"simulate_schedule: deadlock, each rank waiting at {stuck}")
    makespan = max(free)
    return {"makespan": makespan, "busy": busy, "idle_fraction": [(makespan - b) / makespan for b in busy],
            "order": sorted(order)}


def bubble_fraction(pp: int, virtual: int, m: int) -> float:
    """The share of a step each rank idles in the pipeline's bubble when every chunk's forward
    and backward cost the same: (pp - 1) / (virtual * m + pp - 1) (1F1B with ``virtual == 1``)."""
    return (pp - 1) / (virtual * m + pp - 1)


class _Inbox:
    """The activations and gradients this rank receives, by (kind, micro-batch, virtual stage).

    helios.comm matches point-to-point messages per pair of ranks in issue order, not by tag;
    with two ranks the same pair carries both directions' chunks.  Each rank knows every rank's
    schedule, so it knows the order in which each neighbour sends to it, and receives in that
    order: a message that arrives before it is needed is kept until its operation asks for it.
    Waiting for a message never waits longer than the schedule itself does, since the sender
    sends every earlier message first."""

    def __init__(self, stage: "InterleavedPipelineStage", lists: list[list[tuple[str, int, int]]],
                 shapes: list[tuple[int, ...]], receive) -> None:
        pp, stages = stage.pp, stage.pp * stage.virtual
        self.shapes, self.receive, self.ranks = shapes, receive, stage.ranks
        self.expected: dict[int, list] = {}  # sender's pp rank -> what it sends to this rank, in its order
        for s, ops in enumerate(lists):
            for kind, i, c in ops:
                k = c * pp + s
                if kind == "F" and k < stages - 1 and (s + 1) % pp == stage.stage:
                    self.expected.setdefault(s, []).append(("act", i, k))
                elif kind == "B" and k > 0 and (s - 1) % pp == stage.stage:
                    self.expected.setdefault(s, []).append(("grad", i, k))
        self.cursor = {s: 0 for s in self.expected}
        self.kept: dict[tuple[str, int, int], object] = {}

    def take(self, key: tuple[str, int, int], sender: int):
        """The message ``key`` from pp rank ``sender``, receiving what comes before it first."""
        while key not in self.kept:
            queue = self.expected.get(sender, [])
            if self.cursor.get(sender, 0) >= len(queue):
                raise RuntimeError(f"pipeline: internal: {key} is not in pp rank {sender}'s schedule")
            nxt = queue[self.cursor[sender]]
            self.cursor[sender] += 1
            buf = flat.empty(self.shapes[nxt[1]], dt.float32)
            self.receive(buf, self.ranks[sender])
            self.kept[nxt] = buf
        return self.kept.pop(key)


class InterleavedPipelineStage(PipelineStage):
    """This rank's ``virtual`` chunks of ``gpt`` on ``grid``, trained with Megatron-LM's
    interleaved 1F1B schedule (``--pp-virtual``).

    The layers split into ``pp x virtual`` virtual stages balanced by parameter count and go
    round-robin over the ranks: chunk c of rank r is virtual stage ``c * pp + r``, so the
    activations pass rank 0, 1, ..., pp - 1, then rank 0's next chunk (the last rank's chunk c
    sends to rank 0's chunk c + 1), ``virtual`` times.  The embeddings are on virtual stage 0
    (rank 0), the final LayerNorm and the output layer on the last (rank pp - 1), and the tied
    table's two gradients are summed between those ranks as in ``PipelineStage``.  The bubble
    shrinks to (pp - 1) / (virtual x m + pp - 1) of a step; ``m`` must be a multiple of pp.
    ``virtual == 1`` is allowed and runs ``pipeline_schedule``'s 1F1B order on this class's
    code (``PipelineStage`` is the trainer's 1F1B)."""

    def __init__(self, gpt, grid, virtual: int, weights: list[float] | None = None) -> None:
        if not isinstance(virtual, int) or virtual < 1:
            raise ValueError(f"pipeline: virtual must be at least 1 chunk per rank, got {virtual!r}")
        if virtual > 1 and grid.pp < 2:
            raise ValueError(f"pipeline: virtual {virtual} interleaves the stages of a pipeline; the grid has pp 1")
        stages = grid.pp * virtual
        if stages > gpt.config.n_layer:
            raise ValueError(f"pipeline: {grid.pp} ranks x {virtual} chunks is {stages} virtual stages, more than the "
                             f"model's {gpt.config.n_layer} transformer layers")
        self._build(gpt, grid, virtual, weights)
        self.chunks = [_Blocks({i: gpt.h[i] for i in ids}) for ids in self.chunk_blocks]
        self.n_stages = stages

    def chunk_parameters(self, c: int) -> list:
        """The parameters chunk c reads, the ones its backward gives gradients to: its blocks',
        with the embeddings on virtual stage 0 and the final LayerNorm and the tied output layer
        on the last.  Built once per chunk: every micro-batch's backward asks for it."""
        cache = self.__dict__.setdefault("_chunk_params", {})
        if c not in cache:
            k = c * self.pp + self.stage
            mods = [self.chunks[c]]
            if k == 0:
                mods += [self.wte, self.wpe]
            if k == self.n_stages - 1:
                mods += [self.ln_f, self.wte]
            cache[c] = list({id(p): p for m in mods for p in m.parameters()}.values())  # (the tied table once)
        return cache[c]

    def _peer(self, step: int) -> int:
        """The pp rank ``step`` places from this one (wrapping round: virtual stages go round the ranks)."""
        return (self.stage + step) % self.pp

    def _chunk_forward(self, c: int, x_in, idx, targets, scale: float):
        k = c * self.pp + self.stage
        return self._through(self.chunks[c], k == 0, k == self.n_stages - 1, x_in, idx, targets, scale)

    def _train_step(self, inputs: list, targets: list, phase=None) -> float | None:
        """Forward and backward of every (micro-batch, chunk) in the interleaved order
        (``pipeline_schedule``); gradients accumulate in the stage's parameters.  As
        ``PipelineStage.train_step`` (which calls it, with its ``autocast``): every rank gets the
        same lists, the mean loss comes back on the last rank (None elsewhere), ``phase`` times
        "forward", "backward" and "comm", and ``last_idle_fraction`` is the share of the step
        spent waiting on a neighbour."""
        m = len(inputs)
        if m < 1:
            raise ValueError("pipeline: give at least one micro-batch")
        if self.virtual > 1 and m % self.pp:
            raise ValueError(f"pipeline: {m} micro-batches with {self.pp} stages x {self.virtual} virtual: the "
                             f"interleaved schedule needs a multiple of {self.pp}")
        timed = phase or (lambda name: contextlib.nullcontext())
        self._moe_step = None  # (load-balancing loss, dropped pairs) of this step's micro-batches
        lists = [pipeline_schedule(self.pp, self.virtual, m, r) for r in range(self.pp)]
        shapes = [self._activation_shape(x) for x in inputs]
        waited = [0.0]

        def receive(buf, peer) -> None:
            waited[0] += self._timed_recv(buf, peer, timed)

        inbox = _Inbox(self, lists, shapes, receive)
        last_stage = self.n_stages - 1
        held: dict = {}  # (micro-batch, chunk) -> (input leaf, output) until its backward
        sends: list = []
        total = None  # the scaled losses summed in micro-batch order, on the device
        t_start = time.perf_counter()
        for kind, i, c in lists[self.stage]:
            k = c * self.pp + self.stage
            if kind == "F":
                with timed("forward"):
                    x_in = None
                    if k > 0:
                        x_in = inbox.take(("act", i, k - 1), self._peer(-1))
                        x_in.requires_grad = True
                    idx = tensor(np.asarray(inputs[i], np.int64), dtype=dt.int64) if k == 0 else None
                    tgt = tensor(np.asarray(targets[i], np.int64), dtype=dt.int64) if k == last_stage else None
                    out = self._chunk_forward(c, x_in, idx, tgt, 1.0 / m)
                    if k == last_stage:
                        # chunk v - 1's forwards run in micro-batch order: the sum is one device's
                        total = out.detach() if total is None else total + out.detach()
                    else:
                        sends.append(dist.isend(out.detach(), self.ranks[self._peer(1)]))
                    self._sync()
                held[(i, c)] = (x_in, out)
            else:
                x_in, out = held.pop((i, c))
                with timed("backward"), self.chunk_scope(self.chunk_parameters(c)):
                    if k == last_stage:
                        self._seeded(out).backward()
                    else:
                        out.backward(inbox.take(("grad", i, k + 1), self._peer(1)))
                    if k > 0:
                        sends.append(dist.isend(x_in.grad, self.ranks[self._peer(-1)]))
                    self._sync()
        self._finish_step(sends, waited[0], t_start, timed)
        return total.item() if self.last else None

    @no_grad()
    def _forward_only(self, inputs: list, targets: list | None) -> list:
        """Each micro-batch through the virtual stages in turn without gradients; the last
        rank's outputs (scaled losses, or logits without ``targets``), [] elsewhere."""
        m = len(inputs)
        lists = [[("F", i, c) for i in range(m) for c in range(self.virtual)] for _ in range(self.pp)]
        shapes = [self._activation_shape(x) for x in inputs]
        inbox = _Inbox(self, lists, shapes, lambda buf, peer: dist.recv(buf, peer))
        last_stage = self.n_stages - 1
        outs, sends = [], []
        for _, i, c in lists[self.stage]:
            k = c * self.pp + self.stage
            x_in = inbox.take(("act", i, k - 1), self._peer(-1)) if k > 0 else None
            idx = tensor(np.asarray(inputs[i], np.int64), dtype=dt.int64) if k == 0 else None
            tgt = None
            if k == last_stage and targets is not None:
                tgt = tensor(np.asarray(targets[i], np.int64), dtype=dt.int64)
            out = self._chunk_forward(c, x_in, idx, tgt, 1.0 / m)
            if k == last_stage:
                outs.append(out)
            else:
                self._sync()
                sends.append((dist.isend(out, self.ranks[self._peer(1)]), out))  # kept until sent
        for w, _ in sends:
            w.wait()
        return outs


def _tp_sharded(p) -> bool:
    layout = getattr(p, "tp_layout", None)
    return layout is not None and layout.tp > 1


def _squares(params) -> float:
    """The sum of the squared gradients of ``params`` (one device sum, one read)."""
    total = None
    for p in params:
        if p.grad is not None:
            s = F.sum(p.grad * p.grad)
            total = s if total is None else total + s
    return 0.0 if total is None else float(total.item())


def clip_grad_norm_(stage: PipelineStage, max_norm: float) -> float:
    """Scale the stage's gradients so the whole model's norm is at most ``max_norm`` (a
    collective over the pipeline group, and over the groups that hold the shards of the
    stage's sharded parameters: the tensor-parallel group, or the group a shard's layout
    names, as a mixture of experts' expert tensors do; shards' squares are summed over their
    group while replicated parameters count once); returns the norm."""
    owned = stage.owned_parameters()
    by_group: dict[int, tuple] = {}  # one sum per group, in the parameters' order (alike on the group's ranks)
    for p in owned:
        if _tp_sharded(p):
            g = p.tp_layout.group if p.tp_layout.group is not None else stage.tp_group
            by_group.setdefault(id(g), (g, []))[1].append(p)
    with no_grad():
        total = np.array([_squares([p for p in owned if not _tp_sharded(p)])], np.float64)
        for g, ps in by_group.values():
            part = np.array([_squares(ps)], np.float64)
            if g is not None and group_size(g) > 1:
                dist.all_reduce(part, group=g)
            total += part
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


_MARKS = {"forward": "F", "backward": "B", "comm": ".", "grad_clip": "c", "optimizer": "o"}


def timeline(trace: dict, width: int = 80) -> str:
    """The first profiled step of a helios-train Chrome trace as one line per rank, ``width``
    characters for the longest rank's step: ``F`` forward, ``B`` backward, ``.`` waiting (on a
    neighbour, or in a collective), ``c`` gradient clipping, ``o`` the optimizer, a space
    anything else.  Each line starts at its rank's step start (the ranks leave the previous
    step's last collective together)."""
    names, spans, steps = {}, {}, {}
    for e in trace.get("traceEvents", []):
        pid = e.get("pid")
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[pid] = e["args"]["name"]
        elif e.get("ph") == "X" and e.get("cat") == "step":
            if pid not in steps or e["ts"] < steps[pid][0]:
                steps[pid] = (e["ts"], e["dur"])
        elif e.get("ph") == "X" and e.get("cat") == "phase":
            spans.setdefault(pid, []).append((e["ts"], e["dur"], e["name"]))
    if not steps:
        raise ValueError("timeline: the trace holds no profiled step (a helios-train --trace of at least one step)")
    per_char = max(d for _, d in steps.values()) / width
    lines = []
    for pid in sorted(steps):
        t0, dur = steps[pid]
        mine = [s for s in spans.get(pid, []) if t0 <= s[0] < t0 + dur]
        row = []
        for i in range(int(round(dur / per_char))):
            t = t0 + (i + 0.5) * per_char
            inside = [s for s in mine if s[0] <= t < s[0] + s[1]]
            # The innermost phase owns the time: it starts last (a wait inside a forward).
            top = max(inside, key=lambda s: (s[0], -s[1]))[2] if inside else None
            row.append(_MARKS.get(top, " "))
        label = names.get(pid, f"pid {pid}").removesuffix(" host").removeprefix("helios ")
        lines.append(f"{label:>8} |{''.join(row)}|")
    return "\n".join(lines)


__all__ = ["InterleavedPipelineStage", "PipelineStage", "balance", "bubble_fraction", "clip_grad_norm_",
           "describe_stages", "layer_times", "layer_weights", "pipeline_schedule", "simulate_schedule", "timeline"]
