"""Cost of profiling a training step: off, step timers only, and per-dispatch timestamps.

    python bench/profile_overhead.py [--config nano] [--steps 10] [--rounds 5] [--smoke]

Prints one JSON line with the median step time of each mode and the overheads
relative to profiling off (targets: timers < 2 %, full per-dispatch timing < 15 %).
The modes are interleaved round by round so machine noise hits them alike.

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): 2 steps per mode, one round,
200 steps of the isolated timer loop; the same line, its figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="nano")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode per round (default 10; --smoke 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds over the modes (default 5; --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 2 steps per mode, one round")
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.smoke else 10)
    args.rounds = args.rounds or (1 if args.smoke else 5)

    import helios as hl
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW, clip_grad_norm_
    from helios.profile.timers import StepTimer
    from helios.train import CONFIGS

    c = CONFIGS[args.config]
    B, T = c["batch_size"], c["block_size"]
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
    model = GPT(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (B, T)), rng.integers(0, 256, (B, T))

    def step(timer=None):
        if timer is None:
            _, loss = model(hl.tensor(x), hl.tensor(y))
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.item()
        timer.start_step()
        with timer.phase("host_to_device"):
            xt, yt = hl.tensor(x), hl.tensor(y)
        with timer.phase("forward"):
            _, loss = model(xt, yt)
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("grad_clip"):
            clip_grad_norm_(model.parameters(), 1.0)
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        with timer.phase("device_to_host"):
            v = loss.item()
        timer.end_step(0, B * T, loss=v)
        return v

    def run(mode: str) -> list[float]:
        out = []
        timer = StepTimer() if mode != "off" else None
        # "full": one profiling session over the steps, as helios-train --profile-steps opens
        session = hl.profile.profile() if mode == "full" else None
        prof = session.__enter__() if session else None
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(timer)
            out.append(time.perf_counter() - t0)
        if session:
            session.__exit__(None, None, None)
            assert len(prof.collector.events) > 0
        return out

    for _ in range(3):
        step()  # warm up pipelines
    times = {"off": [], "timers": [], "full": []}
    for _ in range(args.rounds):
        for mode in times:
            times[mode] += run(mode)
    med = {m: statistics.median(v) for m, v in times.items()}
    # The timers' own cost, isolated from machine noise: the phase bookkeeping of one step
    # without the work, in a tight loop.
    timer = StepTimer()
    n_iso = 200 if args.smoke else 2000
    t0 = time.perf_counter()
    for _ in range(n_iso):
        timer.start_step()
        for ph in ("host_to_device", "forward", "backward", "grad_clip", "optimizer", "device_to_host"):
            with timer.phase(ph):
                pass
        timer.end_step(0, B * T)
    timer_cost = (time.perf_counter() - t0) / n_iso
    print(json.dumps({
        "bench": "profile_overhead", "config": args.config,
        "off_ms": round(med["off"] * 1e3, 2), "timers_ms": round(med["timers"] * 1e3, 2), "full_ms": round(med["full"] * 1e3, 2),
        "timers_overhead_pct": round(100 * (med["timers"] / med["off"] - 1), 2),
        "full_overhead_pct": round(100 * (med["full"] / med["off"] - 1), 2),
        "steps_per_mode": args.steps * args.rounds,
        "timers_isolated_us_per_step": round(timer_cost * 1e6, 2),
        "timers_isolated_pct": round(100 * timer_cost / med["off"], 4),
    }))


if __name__ == "__main__":
    main()
