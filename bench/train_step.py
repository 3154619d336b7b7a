"""Training-step throughput: the same GPT in PyTorch (eager, CPU or --peer cuda) and in Helios (default device or --device).

Prints one JSON line per config: tokens/s of each, their ratio, and MFU of each against
the device peak of helios.profile.mfu (a labelled estimate on CPUs; lavapipe runs on the
same CPU cores, so both use the CPU's fp32 peak).  Helios runs twice: every step through
Python and autograd (``helios_*``), and the first step captured with ``hl.graph`` and the
others replayed (``replay_*``, what helios-train does by default on one device).
``host_ms_*`` is the host's time to issue one step (recording and submitting, up to the
flush; not the wait for the loss), median over the timed steps.

    python bench/train_step.py [--config tiny] [--steps 5] [--device cuda:0 --peer cuda] [--dtype bf16]

``--dtype bf16`` runs both sides under autocast (Helios' ``hl.autocast``, PyTorch's
``torch.autocast``): the matmuls in bfloat16 (on ``cuda:N`` Helios' tensor-core kernel, on
``--peer cuda`` cuBLAS's), the rest in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np


def torch_loss_fn(cfg, B, T, params):
    """The GPT's loss in PyTorch over the parameter dict ``params`` (Helios' names), on their device."""
    import torch
    import torch.nn.functional as TF

    C, H = cfg.n_embd, cfg.n_head
    dev = next(iter(params.values())).device
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))
    pos = torch.arange(T, device=dev)

    def lin(t, name):
        return t @ params[name + ".weight"].T + params[name + ".bias"]

    def loss_fn(x, y):
        h = params["wte.weight"][x] + params["wpe.weight"][pos]
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            a = TF.layer_norm(h, (C,), params[p + "ln_1.weight"], params[p + "ln_1.bias"])
            q, k, v = lin(a, p + "attn.c_attn").split(C, dim=2)
            q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))).masked_fill(~mask, float("-inf")).softmax(-1)
            h = h + lin((att @ v).transpose(1, 2).reshape(B, T, C), p + "attn.c_proj")
            m = TF.layer_norm(h, (C,), params[p + "ln_2.weight"], params[p + "ln_2.bias"])
            h = h + lin(TF.gelu(lin(m, p + "mlp.c_fc"), approximate="tanh"), p + "mlp.c_proj")
        h = TF.layer_norm(h, (C,), params["ln_f.weight"], params["ln_f.bias"])
        return TF.cross_entropy((h @ params["wte.weight"].T).reshape(B * T, -1), y.reshape(-1))

    return loss_fn


def torch_step_fn(cfg, B, T, params, opt, dtype: str = "fp32"):
    import contextlib

    import torch

    loss_fn = torch_loss_fn(cfg, B, T, params)
    dev = next(iter(params.values())).device.type

    def step(x, y):
        with (torch.autocast(dev, torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()):
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def time_steps(step, batches, warmup: int) -> float:
    for x, y in batches[:warmup]:
        step(x, y)
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:
        step(x, y)
    return (time.perf_counter() - t0) / (len(batches) - warmup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None, help="Helios device (default: HELIOS_DEVICE or the best one), e.g. cuda:0")
    ap.add_argument("--peer", choices=("cpu", "cuda"), default="cpu",
                    help="PyTorch eager on the host's CPU threads, or on the GPU (cuda, TF32 off: fp32 as Helios)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: both sides under autocast (matmuls in bfloat16, as helios-train --dtype bf16)")
    args = ap.parse_args()

    import torch

    import helios as hl
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW, clip_grad_norm_
    from helios.profile.mfu import compute_mfu, peak_flops
    from helios.runtime import get_runtime, set_device
    from helios.train import CONFIGS

    if args.device:
        set_device(args.device)
    tdev = torch.device(args.peer)
    if args.peer == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    c = CONFIGS[args.config]
    B, T = c["batch_size"], c["block_size"]
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (B, T)), rng.integers(0, 256, (B, T))) for _ in range(args.steps + args.warmup)]

    model = GPT(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    rt = get_runtime()
    host = {"eager": [], "replay": []}

    def step(m, o, x, y):
        """One training step of model ``m`` with optimizer ``o`` on device tensors; the loss."""
        if args.dtype == "bf16":
            with hl.autocast("bfloat16"):
                _, loss = m(x, y)
        else:
            _, loss = m(x, y)
        loss.backward()
        clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        o.zero_grad()
        return loss

    def helios_step(x, y):
        t0 = time.perf_counter()
        loss = step(model, opt, hl.tensor(x), hl.tensor(y))
        rt.flush()
        host["eager"].append(time.perf_counter() - t0)
        return loss.item()

    # The same model again, its step captured on the first call and replayed after.
    model_r = GPT(cfg, seed=0)
    opt_r = AdamW(model_r.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    captured = {}

    def replay_step(x, y):
        if not captured:
            xt, yt = hl.tensor(x), hl.tensor(y)
            with hl.graph.capture(inputs=(xt, yt)) as g:
                loss = step(model_r, opt_r, xt, yt)
            captured.update(graph=g, loss=loss)
            return loss.item()
        t0 = time.perf_counter()
        captured["graph"].replay(x, y)
        host["replay"].append(time.perf_counter() - t0)
        return captured["loss"].item()

    tparams = {n: torch.tensor(p.numpy(), device=tdev, requires_grad=True) for n, p in model.named_parameters()}
    topt = torch.optim.AdamW(list(tparams.values()), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tstep = torch_step_fn(cfg, B, T, tparams, topt, args.dtype)
    tbatches = [(torch.tensor(x, device=tdev), torch.tensor(y, device=tdev)) for x, y in batches]

    # Interleave to share the machine's noise: helios, replay, torch, twice; keep the best of each.
    h_times, r_times, t_times = [], [], []
    for _ in range(2):
        h_times.append(time_steps(helios_step, batches, args.warmup))
        r_times.append(time_steps(replay_step, batches, args.warmup))
        t_times.append(time_steps(tstep, tbatches, args.warmup))
    h, r, t = min(h_times), min(r_times), min(t_times)
    tokens = B * T
    fpt = model.flops_per_token()
    peak = peak_flops(rt.info["name"], args.dtype, rt.info["type"])
    h_tps, r_tps, t_tps = tokens / h, tokens / r, tokens / t
    d0 = rt.stats()["dispatches"]
    helios_step(*batches[0])
    per_step = rt.stats()["dispatches"] - d0  # kernel launches in one step (copies and fills not counted)
    host_eager = statistics.median(host["eager"][args.warmup:])
    host_replay = statistics.median(host["replay"])
    print(json.dumps({
        "bench": "train_step", "config": args.config, "dtype": args.dtype, "params": model.num_parameters(),
        "tokens_per_step": tokens,
        "device": rt.name, "device_name": rt.info["name"], "helios_tok_s": round(h_tps, 1),
        "peer": f"torch_{args.peer}", "peer_tok_s": round(t_tps, 1),
        "ratio": round(h_tps / t_tps, 4), "helios_ms_per_step": round(h * 1e3, 1), "peer_ms_per_step": round(t * 1e3, 1),
        "replay_tok_s": round(r_tps, 1), "replay_ratio": round(r_tps / t_tps, 4), "replay_ms_per_step": round(r * 1e3, 1),
        "dispatches_per_step": per_step, "host_ms_eager": round(host_eager * 1e3, 3), "host_ms_replay": round(host_replay * 1e3, 3),
        "host_replay_share": round(host_replay / host_eager, 4),
        "helios_mfu": compute_mfu(fpt, h_tps, peak), "peer_mfu": compute_mfu(fpt, t_tps, peak),
        "peak": peak.label if peak else None, "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
