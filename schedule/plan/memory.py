"""Bytes one rank holds at its peak, by kind.

Model states (Rajbhandari et al. 2020, "ZeRO", section 5): Psi parameters on a rank, data-
parallel degree Nd, K optimizer bytes per parameter::

    stage 0:  (P + G + K) Psi          stage 1:  (P + G) Psi + K Psi / Nd
    stage 2:  P Psi + (G + K) Psi/Nd   stage 3:  (P + G + K) Psi / Nd

with P = 2, G = 2, K = 12 in mixed precision (16 Psi unsharded: "2 + 2 + 12"), and P = 4,
G = 4, K = 8 in fp32 training, which is what helios' ZeroAdamW holds (schedule/zero.py,
``expected_memory``; a test checks the two agree).  Psi here is what the rank holds after
tensor and pipeline parallelism: its stage's layers / tp (+ the embedding on the first
stage, the tied LM head's copy on the last).  The data-parallel group of dense parameters
is dp x cp (context-parallel ranks reduce gradients too); experts are sharded over ep and
data-parallel over dp x cp / ep.

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", table 2), s tokens, b sequences, h width,
a heads, t = tp, 2-byte tensors::

    no parallelism        s b h (34 + 5 a s / h)
    TP                    s b h (10 + 24/t + 5 a s / (h t))
    TP + SP               s b h / t (34 + 5 a s / h)
    selective recompute   the 5as/h term is gone (attention core recomputed)
    full recompute        2 s b h / t (the layer input; one layer's full set while it is recomputed)

34 = 10 replicated (LayerNorm inputs 4, QKV and MLP inputs 2 + 2, two dropout masks) +
24 sharded (Q, K 4, V 2, projection input 2, GELU input and output 16 = 4f/h).  A wider
MLP or top-k experts scale the 16 as 4 f k / h.  FlashAttention never stores the scores:
its activations are the selective form.  Context parallel keeps s/cp tokens per rank.

1F1B (PipeDream-Flush) keeps min(p, m) micro-batches in flight on the first stage, each
with L/p layers: L layers' worth whatever p is; the last stage holds one micro-batch and
the logits, 4 s b V / t bytes (fp32 for the loss, as Korthikanti count them).

Transient: ZeRO-3 gathers the parameters of the layer it runs and prefetches the next
(2 layers in the parameter dtype).  Allowance: the device's ``reserve`` (runtime, context,
communication buffers: 2 GB on a GPU) plus ``frag`` (10 %) of activations and transients
for the allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Device
from .layout import Parallel, Settings
from .model import ModelShape

KINDS = ("params", "grads", "optimizer", "activations", "transient", "allowance")


@dataclass(frozen=True)
class Memory:
    """Bytes per kind on the rank with the most (``stage``: first or last)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    allowance: float
    stage: str

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.allowance

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in KINDS} | {"total": self.total, "stage": self.stage}


def zero_states(psi: float, nd: int, stage: int, p: int, g: int, k: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of ``psi`` parameters under ZeRO ``stage`` over ``nd`` ranks."""
    nd = max(1, nd)
    return (p * psi / (nd if stage >= 3 else 1),
            g * psi / (nd if stage >= 2 else 1),
            k * psi / (nd if stage >= 1 else 1))


def layer_activation_bytes(shape: ModelShape, par: Parallel, st: Settings, recompute: str | None = None) -> float:
    """Stored activation bytes of one layer for one micro-batch on one rank (Korthikanti's table 2)."""
    rc = par.recompute if recompute is None else recompute
    t = par.tp
    s_l = shape.seq / par.cp
    sbh = s_l * par.mb * shape.d_model
    sp = st.sequence_parallel and t > 1
    k_eff = shape.top_k if shape.moe else 1
    sharded = 8 * sbh + 4 * s_l * par.mb * shape.f * k_eff
    replicated = 10 * sbh
    scores = 5 * shape.n_head * s_l * shape.seq * par.mb  # softmax output 2, dropout mask 1, dropout output 2
    if rc == "full":
        b = 2 * sbh / (t if sp else 1)
    else:
        b = (sharded + replicated) / t if sp else replicated + sharded / t
        if rc == "none" and st.attention == "materialized":
            b += scores / t
    return b * st.act_scale


def rank_params(shape: ModelShape, par: Parallel, stage: str) -> tuple[float, float]:
    """(dense, expert) parameters one rank of ``stage`` (first/last/only) holds."""
    lp = shape.n_layer / par.pp
    dense = lp * shape.layer_dense_params() / par.tp
    expert = lp * shape.layer_expert_params() / (par.tp * par.ep)
    emb = shape.embedding_params() / par.tp
    if stage in ("first", "only"):
        dense += emb + shape.position_params()
    if stage in ("last", "only"):
        dense += 2 * shape.d_model
        if stage == "last":
            dense += emb  # the tied LM head's copy on the last stage
    return dense, expert


def memory_per_rank(shape: ModelShape, par: Parallel, st: Settings, dev: Device) -> Memory:
    """The peak bytes of the fullest rank (first or last pipeline stage)."""
    m = max(1, par.micro_batches(st.global_batch))
    nd = par.dp * par.cp
    stages = ("only",) if par.pp == 1 else ("first", "last")
    best: Memory | None = None
    for stage in stages:
        dense, expert = rank_params(shape, par, stage)
        p_b, g_b, k_b = st.param_bytes, st.grad_b, st.opt_bytes
        pd, gd, od = zero_states(dense, nd, par.zero, p_b, g_b, k_b)
        pe, ge, oe = zero_states(expert, max(1, nd // par.ep), par.zero, p_b, g_b, k_b)
        layers = shape.n_layer / par.pp
        in_flight = min(par.pp, m) if stage == "first" else 1
        act = in_flight * layers * layer_activation_bytes(shape, par, st)
        if par.recompute == "full":  # the layer being recomputed holds its full set
            act += layer_activation_bytes(shape, par, st, "none" if st.attention == "materialized" else "selective")
        if stage in ("last", "only"):
            act += 4 * (shape.seq / par.cp) * par.mb * shape.vocab / par.tp * st.act_scale
        transient = 0.0
        if par.zero >= 3:
            transient += 2 * (shape.layer_dense_params() + shape.layer_expert_params() / par.ep) / par.tp * p_b
        allowance = dev.reserve + st.frag * (act + transient)
        mem = Memory(pd + pe, gd + ge, od + oe, act, transient, allowance, stage)
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best
