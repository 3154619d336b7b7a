"""Train a small GPT on bytes of Python source, PyTorch style, with Helios.

    .venv/bin/python examples/train_gpt.py                 # a tiny model, 60 steps: seconds on lavapipe
    .venv/bin/python examples/train_gpt.py --steps 600 --n-embd 128 --n-layer 4

The model is written here as one writes it for PyTorch (``nn.Module`` subclasses, ``forward``,
``F.scaled_dot_product_attention``, AdamW, gradient clipping): with ``import torch`` it would read
the same but for the imports and the tensor constructors.  ``helios-train`` trains
``helios.nn.GPT`` (GPT-2 with tied embeddings and fused kernels) with evaluation, checkpoints,
profiling and several ranks: docs/training.md.
"""

import argparse
import json
import math
import os
import time

import numpy as np

import helios as hl
import helios.nn as nn
import helios.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(hl.arange(T))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=os.path.join(os.path.dirname(json.__file__), "decoder.py"), help="a text file")
    args = p.parse_args()

    # Data: the bytes of a text file (by default a standard-library module: no download), 90 % to train on.
    with open(args.data, "rb") as f:
        data = np.frombuffer(f.read(), np.uint8).astype(np.int64)
    split = int(0.9 * len(data))
    rng = np.random.default_rng(args.seed)

    def batch(part: np.ndarray):
        i = rng.integers(0, len(part) - args.block_size - 1, args.batch_size)
        x = np.stack([part[j:j + args.block_size] for j in i])
        y = np.stack([part[j + 1:j + 1 + args.block_size] for j in i])
        return hl.tensor(x), hl.tensor(y)

    hl.manual_seed(args.seed)
    model = GPT(256, args.block_size, args.n_layer, args.n_embd, args.n_head)
    opt = hl.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {hl.current_device()}, {n_params:,} parameters")

    t0 = time.time()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 10) * 0.5 * (1 + math.cos(math.pi * (step - 1) / args.steps))  # warmup, cosine
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(data[:split])
        _, loss = model(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.time() - t0:.1f} s")

    model.eval()
    with hl.no_grad():
        x, y = batch(data[split:])
        print(f"validation loss {model(x, y)[1].item():.3f} (uniform over 256 bytes: {math.log(256):.3f})")
        ids = list(b"def ")
        for _ in range(60):  # sample a continuation, temperature 0.8
            logits, _ = model(hl.tensor(np.array([ids[-args.block_size:]], np.int64)))
            z = logits.numpy()[0, -1].astype(np.float64) / 0.8
            prob = np.exp(z - z.max())
            ids.append(int(rng.choice(256, p=prob / prob.sum())))
    print("sample:", bytes(ids).decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
