"""The model against published runs (``helios-plan --validate``; tests/test_plan.py holds each to 10 %).

Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21), table 1: GPT models of 1.7B to 1T parameters on up to
3072 A100 80GB GPUs (Selene: DGX A100 nodes, NVLink + NVSwitch inside, 8 x 200 Gb/s HDR
InfiniBand out), sequence 2048, vocabulary 51,200, mixed precision, full activation
recomputation, teraFLOP/s per GPU counted with their eq. (3).  Modelled as they ran: TP
then PP inside the stated degrees, DP the rest, micro-batch 1, 1F1B, materialized
attention, TP without sequence parallelism (2021), gradients reduced after the pipeline
flush (no overlap), fp16 gradients.

ZeRO, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC20): model-state bytes per GPU of figure 1 (7.5B parameters, 64-way
data parallel: 120 GB baseline, 31.4 GB P_os, 16.6 GB P_os+g, 1.88 GB P_os+g+p) and
section 5's 1T model on 1024 GPUs with P_os+g+p (15.6 GB), and section 3.1's GPT-2 1.5B
(24 GB of model states in mixed-precision Adam).
"""

from __future__ import annotations

from dataclasses import replace

from .hardware import get_device
from .layout import Parallel, Settings
from .memory import memory_per_rank, zero_states
from .model import ModelShape, megatron_flops_per_iteration
from .timing import step_time

TOLERANCE = 0.10

#: (params in billions, heads, hidden, layers, TP, PP, GPUs, batch, teraFLOP/s per GPU) -- Narayanan et al. 2021, table 1.
MEGATRON_2021 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

#: (label, Psi, ZeRO stage, data-parallel degree, published GB per GPU) -- Rajbhandari et al. 2020.
ZERO_2020 = (
    ("7.5B, 64 GPUs, baseline (fig. 1)", 7.5e9, 0, 64, 120.0),
    ("7.5B, 64 GPUs, P_os (fig. 1)", 7.5e9, 1, 64, 31.4),
    ("7.5B, 64 GPUs, P_os+g (fig. 1)", 7.5e9, 2, 64, 16.6),
    ("7.5B, 64 GPUs, P_os+g+p (fig. 1)", 7.5e9, 3, 64, 1.88),
    ("1T, 1024 GPUs, P_os+g+p (sec. 5)", 1e12, 3, 1024, 15.6),
    ("GPT-2 1.5B, 1 GPU (sec. 3.1)", 1.5e9, 0, 1, 24.0),
)


def megatron_case(row: tuple) -> dict:
    """The planner's figures for one row of Narayanan et al.'s table 1."""
    pb, a, h, L, t, p, n, B, published = row
    shape = ModelShape(L, h, a, 51200, 2048, name=f"Megatron {pb}B")
    dev = get_device("a100")
    par = Parallel(dp=n // (t * p), tp=t, pp=p, mb=1, recompute="full")
    st = Settings(global_batch=B, tokens=1.0, grad_bytes=2, attention="materialized", sequence_parallel=False, overlap=False)
    tm = step_time(shape, par, st, dev, "bf16")
    mem = memory_per_rank(shape, par, st, dev)
    predicted = megatron_flops_per_iteration(B, 2048, L, h, 51200) / (n * tm.step) / 1e12
    return {"params_b": pb, "n_params": shape.n_params(), "gpus": n, "tp": t, "pp": p, "dp": par.dp, "batch": B,
            "published_tflops": published, "predicted_tflops": predicted, "error": predicted / published - 1,
            "step_s": tm.step, "memory_gb": mem.total / 1e9, "fits": mem.total <= dev.memory}


def zero_case(row: tuple) -> dict:
    """Model-state GB per GPU under ZeRO (2 + 2 + 12 bytes per parameter)."""
    label, psi, stage, nd, published = row
    gb = sum(zero_states(psi, nd, stage, 2, 2, 12)) / 1e9
    return {"case": label, "published_gb": published, "predicted_gb": gb, "error": gb / published - 1}


def training_days_case() -> dict:
    """Narayanan et al. 2021 section 5.1: GPT-3 175B, 300B tokens, 1024 A100s at 140 TFLOP/s: 34 days (their eq. 4)."""
    shape = ModelShape(96, 12288, 96, 51200, 2048, name="GPT-3 175B")
    dev = replace(get_device("a100"))
    par = Parallel(dp=8, tp=8, pp=16, mb=1, recompute="full")
    st = Settings(global_batch=1536, tokens=300e9, grad_bytes=2, attention="materialized", sequence_parallel=False,
                  overlap=False)
    tm = step_time(shape, par, st, dev, "bf16")
    days = st.tokens / tm.tokens_per_s / 86400
    return {"published_days": 34.0, "predicted_days": days, "error": days / 34.0 - 1}


def report() -> tuple[str, bool]:
    """The comparison as text, and whether every case is within ``TOLERANCE``."""
    ok = True
    lines = ["Megatron-LM (Narayanan et al. 2021, table 1; A100 80GB, seq 2048, full recompute): teraFLOP/s per GPU",
             f"  {'params':>8} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'batch':>5}  {'published':>9} {'planned':>8} "
             f"{'error':>7}  {'GB/GPU':>6}"]
    for row in MEGATRON_2021:
        c = megatron_case(row)
        ok &= abs(c["error"]) <= TOLERANCE and c["fits"]
        lines.append(f"  {c['params_b']:>7}B {c['gpus']:>5} {c['tp']:>3} {c['pp']:>3} {c['dp']:>4} {c['batch']:>5}  "
                     f"{c['published_tflops']:>9} {c['predicted_tflops']:>8.1f} {100 * c['error']:>+6.1f}%  "
                     f"{c['memory_gb']:>6.1f}")
    d = training_days_case()
    ok &= abs(d["error"]) <= TOLERANCE
    lines.append(f"  GPT-3 175B, 300B tokens on 1024 A100s (section 5.1): published ~34 days, planned "
                 f"{d['predicted_days']:.1f} ({100 * d['error']:+.1f}%)")
    lines.append("ZeRO (Rajbhandari et al. 2020): model-state GB per GPU, mixed-precision Adam (2 + 2 + 12 bytes per parameter)")
    for row in ZERO_2020:
        c = zero_case(row)
        ok &= abs(c["error"]) <= TOLERANCE
        lines.append(f"  {c['case']:36s} published {c['published_gb']:>7.2f}  planned {c['predicted_gb']:>7.2f}  "
                     f"{100 * c['error']:+.1f}%")
    lines.append(f"all within {100 * TOLERANCE:.0f} %: {'yes' if ok else 'NO'}")
    return "\n".join(lines), ok
