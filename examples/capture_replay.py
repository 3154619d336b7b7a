"""Capture one training step and replay its device work for the next steps (what CUDA graphs are to PyTorch).

    .venv/bin/python examples/capture_replay.py              # tiny GPT, 20 steps: seconds on lavapipe
    .venv/bin/python examples/capture_replay.py --steps 100

The first step runs under ``hl.graph.capture``: it is a real step (forward, backward, clip, AdamW)
and every command it gives the device is recorded.  ``g.replay(xb, yb)`` copies the next batch into
the step's input tensors and issues the recorded commands again, without running the model's
Python, autograd or shape logic.  AdamW's step count and learning rate follow at each replay.
The same steps are then run the plain way from the same weights: the losses agree bit for bit.
helios-train does this by default on one device (``--no-capture`` turns it off).
"""

import argparse
import time

import numpy as np

import helios as hl
from helios.nn import GPT, GPTConfig


def batches(steps: int, B: int, T: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):  # rows counting up from a random start by a random stride: learnable from the context
        start, stride = rng.integers(0, vocab, (B, 1)), rng.integers(1, 4, (B, 1))
        seq = (start + stride * np.arange(T + 1)) % vocab
        yield seq[:, :-1], seq[:, 1:]


def make(cfg: GPTConfig):
    model = GPT(cfg, seed=0)
    return model, hl.optim.AdamW(model.parameters(), lr=1e-2)


def lr_at(step: int, steps: int) -> float:
    return 1e-2 * (1 - step / steps)  # linear decay: a replay reads AdamW's learning rate each time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=64, block_size=args.block_size, n_layer=2, n_head=2, n_embd=32)
    data = list(batches(args.steps, args.batch_size, args.block_size, cfg.vocab_size))

    # 1. Captured once, replayed for every later step.
    model, opt = make(cfg)
    xb, yb = data[0]
    x, y = hl.tensor(xb), hl.tensor(yb)  # the step's inputs: created before the capture
    with hl.graph.capture(inputs=(x, y)) as g:
        _, loss = model(x, y)
        loss.backward()
        hl.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    replayed = [loss.item()]  # the captured step ran: its loss is there
    t0 = time.perf_counter()
    for step, (xb, yb) in enumerate(data[1:], start=1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps)
        g.replay(xb, yb)  # same shapes; new contents for x and y
        replayed.append(loss.item())  # ``loss`` is the captured step's output tensor, written again
    t_replay = (time.perf_counter() - t0) / (args.steps - 1)
    g.release()  # the graph held every buffer its commands touch

    # 2. The same steps through Python and autograd, from the same initial weights.
    model, opt = make(cfg)
    plain = []
    t0 = time.perf_counter()
    for step, (xb, yb) in enumerate(data):
        if step == 1:
            t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps)
        _, loss = model(hl.tensor(xb), hl.tensor(yb))
        loss.backward()
        hl.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())
    t_plain = (time.perf_counter() - t0) / (args.steps - 1)

    for step in range(0, args.steps, max(1, args.steps // 5)):
        print(f"step {step:3d}  replayed {replayed[step]:.6f}  plain {plain[step]:.6f}")
    print(f"per step: replayed {1e3 * t_replay:.1f} ms, plain {1e3 * t_plain:.1f} ms")
    assert replayed == plain, "a replay should give the plain step's losses bit for bit"
    print("losses identical bit for bit")


if __name__ == "__main__":
    main()
