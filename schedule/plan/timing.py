"""Seconds per optimizer step, by component.

Compute
-------
Per micro-batch, the rank's FLOPs (forward ``2 P + 4 s h`` per token and layer, the LM head
``2 V h``, backward twice the forward, plus what recomputation runs again: the attention
core ``4 s h`` for selective recomputation and for FlashAttention, whose backward recomputes
the scores; the whole layer forward for full recomputation) run at ``achievable x peak``
(hardware.py).  The memory-bound kernels around the GEMMs (LayerNorm, GELU, dropout,
softmax, residual adds) move ``MEM_PASSES_FWD`` (forward) and ``MEM_PASSES_BWD`` (backward)
times the layer's activation bytes (memory.py, the unrecomputed form) through the device's
memory at its full bandwidth; a full recomputation moves the forward's share again.
Devices that run launches one after another (lavapipe) add ``launch_s`` per kernel; where the
ranks share one machine's cores (``shared_host``), launches share them as the GEMMs do.
These add up: GEMMs and memory-bound kernels do not overlap.

Communication: α-β
------------------
A collective over n ranks on a link of α seconds per message and bandwidth B (times
``link_efficiency``) costs, with β = 1 / (B x efficiency) -- the formulas of
helios.comm.cost (a test checks they agree)::

    all-reduce (ring)       2(n-1) α + 2(n-1)/n S β
    all-gather / reduce-scatter (ring)   (n-1) α + (n-1)/n S β      (S = the whole buffer)
    all-to-all              (n-1) α + (n-1)/n S β                     (S = bytes a rank sends + keeps)
    send/recv               α + S β

Which link: rank order is TP, CP, DP, PP (layout.py); a group inside one node uses the node's
link, otherwise the network's per-device bandwidth.

* TP (Megatron column + row parallel): 2 all-reduces of ``b s h`` activations forward and 2
  backward per layer, 2 more when a full recomputation reruns the forward.  With sequence
  parallelism they are all-gathers + reduce-scatters of the same volume.  On the critical path.
* CP (ring attention): cp - 1 steps of the local K, V chunk forward, K, V, dK, dV backward,
  each hidden behind the attention of the chunk it overlaps (exposed: the excess).
* EP: an all-to-all to dispatch and one to combine, forward and backward, per MoE layer.
  On the critical path.
* PP: the scatter/gather send of ``b s h / t`` activations forward and gradients backward per
  micro-batch and stage boundary, on the critical path of each 1F1B slot.
* DP: gradient reduction of the rank's parameters over dp x cp ranks: an all-reduce (ZeRO 0),
  reduce-scatter + all-gather of the parameters after the step (ZeRO 1), a reduce-scatter per
  micro-batch + the all-gather (ZeRO 2), and per micro-batch an all-gather forward, one
  backward and a reduce-scatter (ZeRO 3: 1.5x the all-reduce's volume, Rajbhandari et al.
  section 7; one more all-gather under full recomputation).

Overlap (``Settings.overlap``): gradient reduction overlaps the backward compute of the last
micro-batch (earlier micro-batches accumulate locally, as DDP's no_sync), bucket by bucket: the
gradient bytes complete evenly through that backward, cut in DDP's order into buckets (a
small first one, then ``bucket_bytes`` each), and each bucket's reduction starts when both it
is complete and the one before it is done, so at least the last bucket's reduction is
exposed (:func:`bucketed_exposure`); ZeRO-2's earlier
reduce-scatters and ZeRO-3's gathers overlap the compute of their own micro-batch; what
exceeds the compute it hides behind is exposed.  The post-step parameter all-gather of
ZeRO 1/2 is exposed.  With ``overlap=False`` every DP byte is on the critical path.

Pipeline (1F1B, Narayanan et al. 2021): ``(m + p - 1)`` slots of the slowest stage's forward +
backward; the ``p - 1`` extra slots are the bubble, ``(p - 1)/m`` of the ideal time.

Optimizer: Adam reads and writes the fp32 master weights and moments and reads the gradient,
writes the parameter: ``(2K + G + P)`` bytes per parameter it updates, at memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .hardware import Device
from .layout import Parallel, Settings, group_link
from .memory import layer_activation_bytes, rank_params
from .model import ModelShape

MEM_PASSES_FWD = 2.0
MEM_PASSES_BWD = 4.0

COMPONENTS = ("compute", "memory_bound", "launch", "tp", "cp", "ep", "pp_p2p", "bubble", "dp", "optimizer")
COMM = ("tp", "cp", "ep", "pp_p2p", "dp")


# ---------------------------------------------------------------------------- α-β collectives


def all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(n-1)α + 2(n-1)/n S β."""
    return 0.0 if n <= 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def all_gather(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-gather (and reduce-scatter) of an S-byte buffer: (n-1)α + (n-1)/n S β."""
    return 0.0 if n <= 1 else (n - 1) * alpha + (n - 1) / n * nbytes * beta


reduce_scatter = all_gather
all_to_all = all_gather


def send_recv(nbytes: float, alpha: float, beta: float) -> float:
    return alpha + nbytes * beta


def link(dev: Device, kind: str) -> tuple[float, float]:
    """(α, β) of ``intra``/``inter`` on ``dev``, β including the link efficiency."""
    if kind == "intra":
        return dev.intra_alpha, 1.0 / (dev.intra_bw * dev.link_efficiency)
    return dev.inter_alpha, 1.0 / (dev.inter_bw * dev.link_efficiency)


# ---------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by component (they add up to ``step``), and what follows from them."""

    parts: dict
    step: float
    tokens_per_s: float
    mfu: float
    hfu: float
    micro_batches: int
    links: dict

    def to_dict(self) -> dict:
        return {"step_s": self.step, "parts_s": dict(self.parts), "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "hfu": self.hfu, "micro_batches": self.micro_batches, "links": dict(self.links)}


def effective_recompute(recompute: str, attention: str) -> str:
    """The HFU recompute class: FlashAttention's backward recomputes the scores (selective's extra)."""
    return "selective" if (recompute == "none" and attention == "flash") else recompute


class _Rank(NamedTuple):
    """What one rank works with: its compute rate and memory bandwidth (shared where ranks share a
    host), the tokens of its micro-batch, its layers (the heaviest stage's) and the recompute class."""

    ranks_here: int
    rate: float
    hbm: float
    tok: float
    layers: float
    recompute: str


class _MicroBatch(NamedTuple):
    """Seconds of one micro-batch on one rank of the heaviest stage, by kind."""

    gemm_f: float
    gemm_b: float
    mem_f: float
    mem_b: float
    launch: float


def _rank(shape: ModelShape, par: Parallel, st: Settings, dev: Device, peak: float) -> _Rank:
    ranks_here = min(par.gpus, dev.compute_ranks or dev.per_node) if dev.shared_host else 1
    return _Rank(ranks_here, dev.achievable * peak / ranks_here, dev.hbm_bw / ranks_here,
                 par.mb * shape.seq / par.cp,  # split over tp in the work, not the count
                 shape.n_layer / par.pp, effective_recompute(par.recompute, st.attention))


def _micro_batch(shape: ModelShape, par: Parallel, st: Settings, dev: Device, r: _Rank) -> _MicroBatch:
    """FLOPs of the heaviest stage (the last: layers + LM head) at the rank's rate, the memory-bound
    kernels' passes over the activations, and the launches."""
    t, s, h = par.tp, shape.seq, shape.d_model
    f_layer = r.tok * (2 * shape.layer_active_params() + 4 * s * h) / t
    extra = {"none": 0.0, "selective": r.tok * 4 * s * h / t, "full": f_layer}[r.recompute]
    head = r.tok * 2 * shape.vocab * h / t
    fwd_flops = r.layers * f_layer + head
    bwd_flops = 2 * fwd_flops + r.layers * extra
    act_layer = layer_activation_bytes(shape, par, st, "none" if st.attention == "materialized" else "selective")
    mem_f = r.layers * MEM_PASSES_FWD * act_layer / r.hbm
    mem_b = r.layers * (MEM_PASSES_BWD + (MEM_PASSES_FWD if par.recompute == "full" else 0.0)) * act_layer / r.hbm
    launch = dev.launch_s * dev.kernels_per_layer * shape.n_layer / par.pp * r.ranks_here
    return _MicroBatch(fwd_flops / r.rate, bwd_flops / r.rate, mem_f, mem_b, launch)


def _group_links(par: Parallel, per_node: int) -> dict:
    """``intra`` or ``inter`` for each parallel group (rank order TP, CP, DP, PP; layout.py)."""
    t, cp = par.tp, par.cp
    return {"tp": group_link(1, t, per_node), "cp": group_link(t, cp, per_node),
            "dp": group_link(t * cp, par.dp * cp if cp > 1 else par.dp, per_node),
            "ep": group_link(t * cp, par.ep, per_node), "pp": group_link(t * cp * par.dp, par.pp, per_node)}


def _model_parallel(shape: ModelShape, par: Parallel, st: Settings, dev: Device, links: dict, r: _Rank) -> dict:
    """Seconds of the tensor-, context-, expert- and pipeline-parallel traffic of one micro-batch."""
    t, cp, h = par.tp, par.cp, shape.d_model
    act_b = st.param_bytes  # activations travel in the compute dtype
    out = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "pp_p2p": 0.0}
    if t > 1:  # 2 + 2 all-reduce volumes per layer (+2 under full recomputation)
        a, bt = link(dev, links["tp"])
        n_ar = 4 + (2 if par.recompute == "full" else 0)
        out["tp"] = r.layers * n_ar * all_reduce(r.tok * h * act_b, t, a, bt)
    if cp > 1:  # ring attention, each step hidden behind the attention on the chunk in hand
        a, bt = link(dev, links["cp"])
        chunk = 2 * r.tok * h / t * act_b  # K and V of the local tokens
        attn_step = 4 * r.tok * r.tok * h / t / r.rate  # local queries against one chunk, forward
        fwd = max(0.0, send_recv(chunk, a, bt) - attn_step) if st.overlap else send_recv(chunk, a, bt)
        bwd = max(0.0, send_recv(2 * chunk, a, bt) - 2 * attn_step) if st.overlap else send_recv(2 * chunk, a, bt)
        out["cp"] = r.layers * (cp - 1) * (fwd + bwd)
    if shape.moe and par.ep > 1:  # dispatch + combine, forward and backward
        a, bt = link(dev, links["ep"])
        tok_rank = r.tok / t if (st.sequence_parallel and t > 1) else r.tok
        out["ep"] = r.layers * 4 * all_to_all(tok_rank * shape.top_k * h * act_b, par.ep, a, bt)
    if par.pp > 1:  # activations forward and gradients backward (scatter/gather: 1/t per rank)
        a, bt = link(dev, links["pp"])
        out["pp_p2p"] = 2 * send_recv(r.tok * h * act_b / t, a, bt)
    return out


def _data_parallel(par: Parallel, st: Settings, dev: Device, links: dict, m: int, dense: float, expert: float,
                   mb: _MicroBatch) -> float:
    """Exposed seconds of the data-parallel traffic over dp x cp ranks for the rank's (last stage's)
    ``dense`` and ``expert`` parameters, by ZeRO stage, hidden behind the backward where it overlaps."""
    nd = par.dp * par.cp
    if nd <= 1:
        return 0.0
    a, bt = link(dev, links["dp"])
    P, G = st.param_bytes, st.grad_b

    def cost(psi: float, n: int) -> tuple[float, float, float]:
        """(reduction at the end, per-micro-batch forward gathers, per-micro-batch backward traffic)"""
        if n <= 1 or psi <= 0:
            return 0.0, 0.0, 0.0
        if par.zero == 0:
            return all_reduce(G * psi, n, a, bt), 0.0, 0.0
        if par.zero == 1:
            return reduce_scatter(G * psi, n, a, bt) + all_gather(P * psi, n, a, bt), 0.0, 0.0
        if par.zero == 2:
            return all_gather(P * psi, n, a, bt), 0.0, reduce_scatter(G * psi, n, a, bt)
        ag = all_gather(P * psi, n, a, bt)
        return 0.0, ag, ag * (2 if par.recompute == "full" else 1) + reduce_scatter(G * psi, n, a, bt)

    end_d, fw_d, bw_d = cost(dense, nd)
    end_e, fw_e, bw_e = cost(expert, max(1, nd // par.ep))
    end, fw, bw = end_d + end_e, fw_d + fw_e, bw_d + bw_e
    comp_f, comp_b = mb.gemm_f + mb.mem_f, mb.gemm_b + mb.mem_b
    if par.zero <= 1:
        # the gradient reduction (for ZeRO-1, half the end's traffic: its reduce-scatter) hides behind
        # the last micro-batch's backward, bucket by bucket; the rest (ZeRO-1's all-gather) is exposed
        red = end if par.zero == 0 else end / 2
        rest = end - red
        grad_bytes = (dense + expert) * st.grad_b
        return (bucketed_exposure(grad_bytes, red, comp_b, st.first_bucket_bytes, st.bucket_bytes) + rest
                if st.overlap else end)
    if par.zero == 2:
        return (m * max(0.0, bw - comp_b) + end) if st.overlap else m * bw + end
    return m * (max(0.0, fw - comp_f) + max(0.0, bw - comp_b)) if st.overlap else m * (fw + bw)


def step_time(shape: ModelShape, par: Parallel, st: Settings, dev: Device, dtype: str) -> StepTime:
    """Modelled seconds of one optimizer step of ``par`` (see the module docstring)."""
    peak = dev.peak_for(dtype)
    m = max(1, par.micro_batches(st.global_batch))
    r = _rank(shape, par, st, dev, peak)
    mb = _micro_batch(shape, par, st, dev, r)
    links = _group_links(par, dev.per_node)
    comm = _model_parallel(shape, par, st, dev, links, r)
    slot = (mb.gemm_f + mb.gemm_b + mb.mem_f + mb.mem_b + mb.launch
            + comm["tp"] + comm["cp"] + comm["ep"] + comm["pp_p2p"])  # (in this order: the same float sums)
    dense, expert = rank_params(shape, par, "last" if par.pp > 1 else "only")
    dp_t = _data_parallel(par, st, dev, links, m, dense, expert, mb)
    # Optimizer: Adam over the parameters this rank updates.
    nd = par.dp * par.cp
    psi_opt = (dense / (nd if par.zero >= 1 else 1)) + (expert / (max(1, nd // par.ep) if par.zero >= 1 else 1))
    opt_t = (2 * st.opt_bytes + st.grad_b + st.param_bytes) * psi_opt / r.hbm
    parts = {
        "compute": m * (mb.gemm_f + mb.gemm_b), "memory_bound": m * (mb.mem_f + mb.mem_b), "launch": m * mb.launch,
        **{k: m * v for k, v in comm.items()}, "bubble": (par.pp - 1) * slot, "dp": dp_t, "optimizer": opt_t,
    }
    step = sum(parts.values())
    tps = st.global_batch * shape.seq / step
    mfu = shape.flops_per_token() * tps / (peak * par.gpus)
    hfu = shape.hardware_flops_per_token(r.recompute) * tps / (peak * par.gpus)
    return StepTime(parts, step, tps, mfu, hfu, m, links)


def bucketed_exposure(total_bytes: float, reduce_s: float, backward_s: float, first_bytes: float,
                      bucket_bytes: float) -> float:
    """Seconds of a gradient reduction of ``reduce_s`` in all left after a backward of ``backward_s``.

    The ``total_bytes`` of gradients complete evenly through the backward and are cut into a first
    bucket of ``first_bytes``, then buckets of ``bucket_bytes``, the last one the remainder; a
    bucket's reduction takes its share of ``reduce_s`` and starts once it is complete and the
    bucket before it is reduced.  One queue: the reduction ends at the latest, over buckets i,
    of (bucket i complete + the reductions of buckets i, i+1, ...).  Within the run of equal
    buckets that sum is linear in i, so only the first, second, last full and last buckets can
    give the latest end."""
    if total_bytes <= 0 or reduce_s <= 0:
        return 0.0
    first = min(first_bytes, total_bytes)
    n_full = int((total_bytes - first) // bucket_bytes)
    tail = total_bytes - first - n_full * bucket_bytes
    sizes_at = {0: first}  # bucket index -> bytes, for the candidate indices
    for i in (1, n_full):
        if 1 <= i <= n_full:
            sizes_at[i] = bucket_bytes
    last = n_full + (1 if tail > 0 else 0)
    if tail > 0:
        sizes_at[last] = tail

    def done_before(i: int) -> float:  # bytes in buckets 0 .. i-1
        return 0.0 if i == 0 else first + min(i - 1, n_full) * bucket_bytes

    latest = max(backward_s * (done_before(i) + sizes_at[i]) / total_bytes
                 + reduce_s * (total_bytes - done_before(i)) / total_bytes for i in sizes_at)
    return max(0.0, latest - backward_s)


def binding(parts: dict) -> str:
    """What bounds the step: compute (GEMMs, memory-bound kernels, launches), a link, or the bubble."""
    comp = parts["compute"] + parts["memory_bound"] + parts["launch"] + parts["optimizer"]
    comm = {k: parts[k] for k in COMM}
    comm_total = sum(comm.values())
    top = max(comm, key=comm.get)
    best = max((("compute", comp), ("bandwidth", comm_total), ("bubble", parts["bubble"])), key=lambda kv: kv[1])[0]
    return f"bandwidth ({top})" if best == "bandwidth" else best
