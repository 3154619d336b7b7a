"""helios-train's evaluation and sampling: the validation loss (spread over the ranks as the model's
layout allows) and a text continued from a fixed prompt."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

import helios as hl
from helios.schedule.context_parallel import context_parallel_off


def evaluate(args: argparse.Namespace, s, run, m, val_loader) -> float:
    """The mean validation loss over --eval-batches batches.

    Each rank takes every world-th validation batch; the mean is the one rank's mean.  Under
    ZeRO-3 a forward gathers parameters (collective), so every rank runs every batch.  A
    pipeline's stages pass each batch through in micro-batches of the training size; its loss is
    on the last stage only (the others count nothing in the mean)."""
    gpt = m.gpt
    m.model.eval()
    total, count = 0.0, 0
    # (Expert parallelism exchanges tokens in every forward: every rank runs every batch too.)
    share = 1 if m.zero == 3 or m.ep_group is not None else run.data_world  # TP peers run the same batches
    with hl.no_grad():
        for i, (x, y) in enumerate(val_loader.iter_eval(args.eval_batches)):
            if i % share != run.data_rank % share:
                continue
            if s.pipeline:
                parts = len(x) // s.micro_rows
                loss = gpt.evaluate(np.split(x, parts), np.split(y, parts), autocast=m.autocast)
            else:
                if m.cp is not None:
                    x, y = m.cp.shard(x), m.cp.shard(y)
                with m.autocast():
                    loss = gpt(x, y)[1].item()
            if loss is not None:
                total += loss
                count += 1
    m.model.train()
    return run.all_mean(total, count) if share > 1 or s.pipeline else total / count


def sample(model, tok, T: int, n: int, step: int, collective: bool = False) -> str:
    """Text continued from a fixed prompt with temperature 0.8 (seeded by step: deterministic).

    A model with ``stream`` (helios.models': a LLaMA, a GPT-2 with an untied head) generates with
    its key/value cache, its context sliding at T tokens (helios.sample.stream_tokens); the others
    (helios.nn.GPT, a tensor-parallel or pipeline model, or any whose forward is a collective)
    recompute the last T tokens for every new one."""
    ids = list(tok.encode(b"def "))
    if hasattr(model, "stream") and not collective:
        from helios.sample import stream_tokens

        ids += list(stream_tokens(model, ids, n, T, temperature=0.8, seed=step))
        return tok.decode(np.array(ids)).decode("utf-8", errors="replace")
    rng = np.random.default_rng(step)
    model.eval()
    whole = contextlib.nullcontext()
    if getattr(model, "context_parallel", None) is not None:  # one rank continues whole sequences
        whole = context_parallel_off(model)
    with hl.no_grad(), whole:
        for _ in range(n):
            ids.append(_next_token(model, np.array([ids[-T:]], np.int64), rng))
    model.train()
    return tok.decode(np.array(ids)).decode("utf-8", errors="replace")


def _next_token(model, ctx: np.ndarray, rng) -> int:
    """A token drawn from the model's last-position logits at temperature 0.8.  A pipeline stage
    runs its part of the forward, and every stage gets the token the last stage drew."""
    stage = hasattr(model, "from_last_stage")
    logits = model.infer(ctx) if stage else model(ctx)[0]
    token = -1
    if logits is not None:
        # A tensor-parallel model holds a slice of the vocabulary: gather the whole row.
        whole = model.full_logits(logits) if hasattr(model, "full_logits") else logits.numpy()
        last = whole[0, -1].astype(np.float64) / 0.8
        p = np.exp(last - last.max())
        p /= p.sum()
        token = int(rng.choice(len(p), p=p))
    return model.from_last_stage(token) if stage else token
