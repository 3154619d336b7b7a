"""Enumerate the legal layouts, keep those that fit, rank them by step time.

Legal (each rule is a reason shown when it empties the search):

* ``dp x tp x pp x cp`` = the GPUs; ``ep`` divides the experts and ``dp x cp`` (experts are
  sharded inside the data-parallel group, as Megatron-LM does); dense models have ep = 1.
* ``tp`` divides the heads and is at most a node's devices (TP across nodes is never worth it).
* ``pp`` divides the layers (no uneven stages).
* ``cp`` is a power of two dividing the context, with at least 256 tokens per rank.
* ``dp x mb`` divides the global batch (``m`` = micro-batches per pipeline per step).
* ZeRO only with more than one data-parallel rank; ZeRO 2 and 3 not with ``pp > 1`` (gradients accumulate across micro-batches on a stage;
  DeepSpeed refuses the combination too).
* recomputation none / selective / full; with FlashAttention "selective" is what the kernel
  already does and is not listed separately.

A layout fits when its fullest rank's bytes (memory.py) are within the device's memory.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from .hardware import Device
from .layout import RECOMPUTE, Parallel, Settings
from .memory import Memory, memory_per_rank
from .model import ModelShape, PlanError
from .timing import StepTime, binding, step_time

MEMORY_TIGHT = 0.9  # a plan using this fraction of memory or more is memory-bound too


@dataclass(frozen=True)
class Plan:
    """One evaluated layout."""

    par: Parallel
    mem: Memory
    time: StepTime
    capacity: float

    @property
    def fits(self) -> bool:
        return self.mem.total <= self.capacity

    @property
    def bound(self) -> str:
        b = binding(self.time.parts)
        if self.mem.total >= MEMORY_TIGHT * self.capacity:
            return f"memory ({100 * self.mem.total / self.capacity:.0f}%), {b}"
        return b


@dataclass
class SearchResult:
    plans: list  # fitting plans, fastest first
    evaluated: int
    rejected: Counter = field(default_factory=Counter)
    smallest: Plan | None = None  # the least memory among legal layouts (when nothing fits)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def candidates(shape: ModelShape, st: Settings, dev: Device, gpus: int, fixed: dict | None = None):
    """Yield every legal :class:`Parallel` (and count the reasons others were not)."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    check_fixed(shape, st, dev, gpus, fixed)
    tps = [fixed["tp"]] if "tp" in fixed else [t for t in _divisors(shape.n_head) if t <= dev.per_node and gpus % t == 0]
    pps = [fixed["pp"]] if "pp" in fixed else [p for p in _divisors(shape.n_layer) if gpus % p == 0]
    cps = [fixed["cp"]] if "cp" in fixed else [c for c in _pow2_upto(gpus) if shape.seq % c == 0 and shape.seq // c >= 256
                                               or c == 1]
    recs = [fixed["recompute"]] if "recompute" in fixed else \
        [r for r in RECOMPUTE if not (st.attention == "flash" and r == "selective")]
    zeros = [fixed["zero"]] if "zero" in fixed else [0, 1, 2, 3]
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if "dp" in fixed and dp != fixed["dp"]:
                    continue
                if st.global_batch % dp:
                    continue
                eps = [fixed["ep"]] if "ep" in fixed else \
                    ([e for e in _divisors(shape.n_experts) if (dp * cp) % e == 0] if shape.moe else [1])
                mbs = [fixed["mb"]] if "mb" in fixed else _pow2_upto(min(64, st.global_batch // dp))
                for ep in eps:
                    if (dp * cp) % ep:
                        continue
                    for zero in zeros:
                        if (zero >= 2 and pp > 1) or (zero > 0 and dp * cp == 1):
                            continue  # ZeRO over one rank is plain data parallelism
                        for mb in mbs:
                            if st.global_batch % (dp * mb):
                                continue
                            for rc in recs:
                                yield Parallel(dp, tp, pp, cp, ep, zero, mb, rc)


def check_fixed(shape: ModelShape, st: Settings, dev: Device, gpus: int, fixed: dict) -> None:
    """One line for a fixed degree that can never be legal."""
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    t = fixed.get("tp")
    if t is not None:
        if t < 1 or shape.n_head % t:
            raise PlanError(f"--tp {t} does not divide the {shape.n_head} attention heads; "
                            f"try one of {', '.join(str(d) for d in _divisors(shape.n_head) if d <= dev.per_node)}")
    p = fixed.get("pp")
    if p is not None and (p < 1 or shape.n_layer % p):
        raise PlanError(f"--pp {p} does not divide the {shape.n_layer} layers; "
                        f"try one of {', '.join(str(d) for d in _divisors(shape.n_layer) if d <= 64)}")
    c = fixed.get("cp")
    if c is not None and (c < 1 or shape.seq % c):
        raise PlanError(f"--cp {c} does not divide the context of {shape.seq} tokens")
    e = fixed.get("ep")
    if e is not None and (e < 1 or shape.n_experts % e):
        raise PlanError(f"--ep {e} does not divide the {shape.n_experts} experts" +
                        ("" if shape.moe else " (a dense model: pass --experts E to plan a mixture of experts)"))
    z = fixed.get("zero")
    if z is not None and z not in (0, 1, 2, 3):
        raise PlanError(f"--zero must be 0, 1, 2 or 3, got {z}")
    mb = fixed.get("mb")
    if mb is not None and (mb < 1 or st.global_batch % mb):
        raise PlanError(f"--micro-batch {mb} does not divide the global batch of {st.global_batch} sequences")
    prod = 1
    for k in ("tp", "pp", "cp", "dp"):
        prod *= fixed.get(k, 1)
    if gpus % prod:
        raise PlanError(f"the fixed degrees multiply to {prod}, which does not divide --gpus {gpus}")


def search(shape: ModelShape, st: Settings, dev: Device, gpus: int, dtype: str, fixed: dict | None = None) -> SearchResult:
    """Every legal layout evaluated; the fitting ones sorted by step time."""
    res = SearchResult([], 0)
    for par in candidates(shape, st, dev, gpus, fixed):
        mem = memory_per_rank(shape, par, st, dev)
        res.evaluated += 1
        if mem.total > dev.memory:
            res.rejected["memory"] += 1
            if res.smallest is None or mem.total < res.smallest.mem.total:
                res.smallest = Plan(par, mem, step_time(shape, par, st, dev, dtype), dev.memory)
            continue
        res.plans.append(Plan(par, mem, step_time(shape, par, st, dev, dtype), dev.memory))
    # Fastest first; within 0.2 % of the same time the simpler layout (no CP, fewer stages, lower ZeRO) first.
    res.plans.sort(key=lambda p: (round(math.log(p.time.step) / math.log(1.002)), p.par.cp, p.par.pp, p.par.ep,
                                  p.par.zero, p.mem.total))
    return res


def explain_empty(res: SearchResult, shape: ModelShape, st: Settings, dev: Device, gpus: int) -> str:
    """The one line for a search that found nothing."""
    if res.evaluated == 0:
        return (f"no legal layout of {gpus} GPU(s): the global batch of {st.global_batch} sequences, the "
                f"{shape.n_head} heads, {shape.n_layer} layers and context {shape.seq} admit no dp x tp x pp x cp = {gpus} "
                f"(the global batch must be a multiple of dp; tp at most {dev.per_node}, dividing the heads)")
    sm = res.smallest
    assert sm is not None
    floor = 16 * shape.n_params() / gpus  # 2 + 2 + 12 (mixed) or 4 + 4 + 8 (fp32) bytes per parameter
    return (f"no plan fits: the {shape.n_params():.3g}-parameter model needs at least {sm.mem.total / 1e9:.1f} GB per GPU "
            f"in the leanest of {res.evaluated} legal layouts ({sm.par.label()}; model states alone are "
            f"{floor / 1e9:.1f} GB per GPU fully sharded), and a {dev.name} has {dev.memory / 1e9:.0f} GB: "
            f"use more GPUs or a device with more memory")
