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


# The phases Workload.step opens, in its order (of helios.profile.timers.PHASES, those a plain step has).
STEP_PHASES = ("host_to_device", "forward", "backward", "grad_clip", "optimizer", "device_to_host")


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="nano")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode per round (default 10; --smoke 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds over the modes (default 5; --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run: 2 steps per mode, one round")
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.smoke else 10)
    args.rounds = args.rounds or (1 if args.smoke else 5)
    return args


class Workload:
    """A helios-train config's GPT, its AdamW and one fixed batch: the step each mode times."""

    def __init__(self, config: str) -> None:
        import helios as hl
        from helios.nn import GPT, GPTConfig
        from helios.optim import AdamW, clip_grad_norm_
        from helios.profile.timers import StepTimer
        from helios.train import CONFIGS

        # Kept here, not imported in step(): an import statement there would run inside the timed loop.
        self.hl, self.clip, self.StepTimer = hl, clip_grad_norm_, StepTimer
        c = CONFIGS[config]
        self.B, self.T = c["batch_size"], c["block_size"]
        cfg = GPTConfig(vocab_size=256, block_size=self.T, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
        self.model = GPT(cfg, seed=0)
        self.opt = AdamW(self.model.parameters(), lr=1e-3)
        rng = np.random.default_rng(0)
        self.x, self.y = rng.integers(0, 256, (self.B, self.T)), rng.integers(0, 256, (self.B, self.T))

    def step(self, timer=None) -> float:
        """One training step, each phase under ``timer`` when one is given; the loss."""
        hl, clip_grad_norm_ = self.hl, self.clip
        if timer is None:
            _, loss = self.model(hl.tensor(self.x), hl.tensor(self.y))
            loss.backward()
            clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad()
            return loss.item()
        timer.start_step()
        with timer.phase("host_to_device"):
            xt, yt = hl.tensor(self.x), hl.tensor(self.y)
        with timer.phase("forward"):
            _, loss = self.model(xt, yt)
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("grad_clip"):
            clip_grad_norm_(self.model.parameters(), 1.0)
        with timer.phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad()
        with timer.phase("device_to_host"):
            v = loss.item()
        timer.end_step(0, self.B * self.T, loss=v)
        return v

    def run(self, mode: str, steps: int) -> list[float]:
        """``steps`` step times in ``mode``: off, timers (a StepTimer), or full (timers inside one
        profiling session, as helios-train --profile-steps opens)."""
        out = []
        timer = self.StepTimer() if mode != "off" else None
        session = self.hl.profile.profile() if mode == "full" else None
        prof = session.__enter__() if session else None
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step(timer)
            out.append(time.perf_counter() - t0)
        if session:
            session.__exit__(None, None, None)
            assert len(prof.collector.events) > 0
        return out


def _isolated_timer_cost(n: int, tokens: int) -> float:
    """The timers' own cost, isolated from machine noise: seconds of one step's phase
    bookkeeping without the work, over ``n`` steps in a tight loop."""
    from helios.profile.timers import StepTimer

    timer = StepTimer()
    t0 = time.perf_counter()
    for _ in range(n):
        timer.start_step()
        for ph in STEP_PHASES:
            with timer.phase(ph):
                pass
        timer.end_step(0, tokens)
    return (time.perf_counter() - t0) / n


def main() -> None:
    """The three modes interleaved round by round; one JSON line of medians and overheads."""
    args = _parse_args()
    w = Workload(args.config)
    for _ in range(3):
        w.step()  # warm up pipelines
    times = {"off": [], "timers": [], "full": []}
    for _ in range(args.rounds):
        for mode in times:
            times[mode] += w.run(mode, args.steps)
    med = {m: statistics.median(v) for m, v in times.items()}
    timer_cost = _isolated_timer_cost(200 if args.smoke else 2000, w.B * w.T)
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
