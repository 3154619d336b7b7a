"""Profile a few training steps and write a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

    .venv/bin/python examples/profile_trace.py                    # tiny GPT, 3 profiled steps -> trace.json
    .venv/bin/python examples/profile_trace.py --out runs/trace.json --steps 5

Every dispatch is bracketed by device timestamps and linked to the host op that recorded it; the
step timer's phases (forward, backward, grad_clip, optimizer) become a "step phases" track.
helios-train does the same with ``--trace FILE --profile-steps A:B``.
"""

import argparse
import json

import numpy as np

import helios as hl
import helios.profile as hp
from helios.nn import GPT, GPTConfig
from helios.profile.trace import validate_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="trace.json", help="Chrome trace to write")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after one warm-up step)")
    args = p.parse_args()

    B, T = 4, 32
    model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32), seed=0)
    opt = hl.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    timer = hp.StepTimer()

    def step(i: int) -> float:
        x, y = (hl.tensor(rng.integers(0, 64, (B, T))) for _ in range(2))
        timer.start_step()
        with timer.phase("forward"):
            _, loss = model(x, y)
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("grad_clip"):
            hl.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        with timer.phase("device_to_host"):
            value = loss.item()  # reading the loss waits for the step's device work
        timer.end_step(i, tokens=B * T, loss=value)
        return value

    step(0)  # warm-up: first-use work (pipelines, buffers) stays out of the profile
    with hp.profile() as prof:
        for i in range(1, args.steps + 1):
            print(f"step {i}  loss {step(i):.4f}")

    print(prof.key_averages().table(sort_by="device_time", row_limit=10))
    path = prof.export_chrome_trace(args.out)
    with open(path) as f:
        trace = json.load(f)
    problems = validate_trace(trace)
    assert not problems, problems
    kernels = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel")
    print(f"trace written to {path}: {len(trace['traceEvents'])} events, {kernels} kernels")


if __name__ == "__main__":
    main()
