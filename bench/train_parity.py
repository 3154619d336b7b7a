"""Training-loss parity: helios-train against a PyTorch twin, same initial weights, same batches.

    python bench/train_parity.py [--config gpt2] [--dtype bf16] [--steps 200] [--device cuda:0]
                                 [--peer cuda] [--out DIR] [--tolerance 0.05] [--smoke]

Helios: ``helios-train --config C --dtype D --steps N [--device DEV]`` as a child process
(``--eval-every 0 --ckpt-every 0 --sample-tokens 1 --no-progress``, run folder ``--out``/helios;
its output goes to this script's stderr), every step's loss read from its run database (its
final checkpoint deleted afterwards unless ``--keep-checkpoint``).

The twin: the same GPT in PyTorch eager on ``--peer`` (``cuda``: the GPU, TF32 off; ``cpu``),
bench/torch_twin.py's ``torch_loss_fn`` with the attention through
``scaled_dot_product_attention``, trained as helios-train trains: Helios' initial parameters
(``hl.manual_seed(seed)`` and ``GPT(cfg, seed=seed)`` on the device helios-train uses),
the same batches (``helios.data.BatchLoader`` over the same corpus, helios-train's seed),
AdamW (betas 0.9 / 0.95, weight decay 0.1 on the matrices only) with helios-train's cosine
learning rate and warm-up (5 % of the steps), the gradient norm clipped at 1, ``--dtype bf16``
under ``torch.autocast`` (bfloat16) as Helios runs under ``hl.autocast``.  At the end both
sides' validation loss over helios-train's 8 validation batches.

One JSON line: {"bench": "train_parity", "config", "dtype", "steps", "device", "device_name",
"peer", "helios_first_loss", "peer_first_loss" (step 1: the same weights and batch, so these
agree to rounding), "helios_final_train_loss", "peer_final_train_loss" (the last step's),
"helios_last10_mean", "peer_last10_mean" (the last 10 steps' mean, less noisy),
"rel_diff_last10", "helios_final_val_loss", "peer_final_val_loss", "helios_curve" /
"peer_curve" (the loss at 1, 1/4, 1/2, 3/4 and all of the steps), "helios_tok_s", "peer_tok_s",
"same_start", "ok"}.  ``same_start``: the first losses within 2 % of each other; ``ok``: that and
``rel_diff_last10`` within ``--tolerance`` (5 %); the exit status is 1 when not ok (or when
helios-train failed).  Both curves in full go to ``--out``/curves.json.

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): ``--config nano --dtype fp32
--steps 5 --peer cpu`` on the default device (each of them still settable); the same line and
the same check (fp32 on the same weights and batches: the two curves agree to rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import numpy as np

from torch_twin import gpt_config, helios_weights, torch_loss_fn

SEED = 1337  # helios-train's default --seed
EVAL_BATCHES = 8  # helios-train's default --eval-batches


def run_helios(args, out: str) -> tuple[dict | None, list[float], float]:
    """helios-train in a child process: (its JSON summary or None, every step's loss, wall seconds)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "helios.train", "--config", args.config, "--dtype", args.dtype, "--steps", str(args.steps),
           "--seed", str(SEED), "--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "1", "--no-progress",
           "--out", out] + (["--device", args.device] if args.device else [])
    print("train_parity: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    summary = None
    for line in p.stdout:
        sys.stderr.write(line)
        if line.startswith("{"):
            try:
                summary = json.loads(line)
            except ValueError:
                pass
    rc = p.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        print(f"train_parity: helios-train exited with {rc}", file=sys.stderr)
        return None, [], wall
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        rows = con.execute("SELECT step, loss FROM step_timing WHERE rank = 0 ORDER BY step").fetchall()
    finally:
        con.close()
    if not args.keep_checkpoint:  # the final checkpoint (GPT-2's weights and AdamW moments: ~1 GB) is not needed here
        shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)
    return summary, [float(loss) for _, loss in rows], wall


def run_twin(args, cfg, init: dict, ds, c: dict) -> tuple[list[float], float, float]:
    """The PyTorch twin: (every step's loss, final validation loss, wall seconds of the training)."""
    import contextlib

    import torch

    from helios.data import BatchLoader
    from helios.optim import cosine_lr

    dev = torch.device(args.peer)
    if args.peer == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    bs, T, lr_max, steps = c["batch_size"], c["block_size"], c["lr"], args.steps
    warmup = max(1, steps // 20)  # helios-train's default --warmup
    params = {n: torch.tensor(a, device=dev, requires_grad=True) for n, a in init.items()}
    groups = [{"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr_max, betas=(0.9, 0.95))
    loss_fn = torch_loss_fn(cfg, bs, T, params, sdpa=True)

    def autocast():
        return torch.autocast(dev.type, torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()

    loader = BatchLoader(ds.train, bs, T, seed=SEED)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, lr_max, warmup, steps)
        x, y = loader.next_batch()
        with autocast():
            loss = loss_fn(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    wall = time.perf_counter() - t0
    val_loader = BatchLoader(ds.val, bs, T, seed=SEED + 1)
    with torch.no_grad(), autocast():
        val = [loss_fn(torch.from_numpy(vx).to(dev), torch.from_numpy(vy).to(dev)).item()
               for vx, vy in val_loader.iter_eval(EVAL_BATCHES)]
    return losses, sum(val) / len(val), wall


def curve_points(losses: list[float]) -> dict:
    """The loss at step 1, 1/4, 1/2, 3/4 and all of the run (steps counted from 1)."""
    n = len(losses)
    return {str(s): round(losses[s - 1], 4) for s in sorted({1, max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4), n})} if n else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="helios-train vs a PyTorch twin: same initial weights, same batches")
    ap.add_argument("--config", default=None, help="helios-train config (default gpt2; --smoke nano)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default bf16; --smoke fp32")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 200; --smoke 5)")
    ap.add_argument("--device", default=None, help="Helios' device, e.g. cuda:0 (default: helios-train's)")
    ap.add_argument("--peer", choices=("cuda", "cpu"), default=None,
                    help="where the PyTorch twin trains (default cuda; --smoke cpu)")
    ap.add_argument("--out", default=None, help="helios-train's run folder and curves.json (default: a temporary one)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest relative difference of the last 10 steps' mean loss")
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep helios-train's final checkpoint in --out")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: nano, fp32, 5 steps, the twin on the CPU")
    args = ap.parse_args(argv)
    args.config = args.config or ("nano" if args.smoke else "gpt2")
    args.dtype = args.dtype or ("fp32" if args.smoke else "bf16")
    args.steps = args.steps or (5 if args.smoke else 200)
    args.peer = args.peer or ("cpu" if args.smoke else "cuda")

    from helios.data import prepare_dataset
    from helios.runtime import get_runtime, set_device
    from helios.train import CONFIGS

    if args.peer == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"bench": "train_parity", "skipped": True, "reason": "torch has no CUDA device (--peer cuda)"}))
            return 0
    tmp = None
    out = args.out
    if out is None:
        import tempfile

        out = tmp = tempfile.mkdtemp(prefix="train_parity-")
    try:
        c = CONFIGS[args.config]
        # The corpus helios-train reads (its token cache filled here, before the child reads it) and
        # Helios' initial weights, made on the device helios-train uses, as it makes them.
        ds = prepare_dataset(None, "byte")
        cfg = gpt_config(args.config, ds.tokenizer.vocab_size)
        if args.device:
            set_device(args.device)
        rt = get_runtime()
        init = helios_weights(cfg, SEED, manual_seed=True)

        summary, h_losses, h_wall = run_helios(args, os.path.join(out, "helios"))
        p_losses, p_val, p_wall = run_twin(args, cfg, init, ds, c)
        tokens = c["batch_size"] * c["block_size"] * args.steps
        res = {"bench": "train_parity", "config": args.config, "dtype": args.dtype, "steps": args.steps,
               "device": rt.name, "device_name": rt.info["name"], "peer": f"torch_{args.peer}_eager"}
        if summary is None or len(h_losses) != args.steps:
            res["helios_failed"] = ("helios-train failed (its output is above)" if summary is None
                                    else f"{len(h_losses)} step losses in its run database, not {args.steps}")
        else:
            last_h, last_p = float(np.mean(h_losses[-10:])), float(np.mean(p_losses[-10:]))
            rel = abs(last_h - last_p) / abs(last_p)
            same_start = abs(h_losses[0] - p_losses[0]) <= 0.02 * abs(p_losses[0])
            res.update(helios_first_loss=round(h_losses[0], 4), peer_first_loss=round(p_losses[0], 4),
                       helios_final_train_loss=round(h_losses[-1], 4), peer_final_train_loss=round(p_losses[-1], 4),
                       helios_last10_mean=round(last_h, 4), peer_last10_mean=round(last_p, 4),
                       rel_diff_last10=round(rel, 4),
                       helios_final_val_loss=summary.get("final_val_loss"), peer_final_val_loss=round(p_val, 4),
                       helios_curve=curve_points(h_losses), peer_curve=curve_points(p_losses),
                       helios_tok_s=summary.get("tok_per_s"), helios_wall_s=round(h_wall, 1),
                       peer_tok_s=round(tokens / p_wall, 1), peer_wall_s=round(p_wall, 1),
                       tolerance=args.tolerance, same_start=same_start, ok=bool(same_start and rel <= args.tolerance))
        if args.out:
            with open(os.path.join(out, "curves.json"), "w") as f:
                json.dump({"helios": h_losses, "peer": p_losses}, f)
        print(json.dumps(res), flush=True)
        return 0 if res.get("ok") else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
