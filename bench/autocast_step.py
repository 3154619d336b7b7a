"""--dtype bf16 against fp32 on one device: helios-train's training throughput in each, alternately.

    python bench/autocast_step.py [--configs tiny small] [--steps 40] [--rounds 3] [--device vulkan:0] [--smoke]

For each config, ``--rounds`` rounds of two helios-train child processes, ``--dtype fp32`` then
``--dtype bf16`` (the same seed, so the same batches), the second half of the steps profiled
(``--profile-steps``).  One JSON line per run: tokens/s from its summary line and, per profiled
step from its run.db's op_profile table, the kernels dispatched, their device time and the share
of it the cast kernels took (ops ``cast`` and ``cast_backward``: autocast's conversions that
did not ride in a product).  Then one line per config: the medians over the rounds and the
bf16 / fp32 ratios.  The peer is the fp32 run on the same device in the same run: bf16 is
worth using where it is the faster of the two.

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): the nano config, 4 steps, one
round; the same lines, their figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile

SEED = 1337  # helios-train's default --seed


def run(config: str, dtype: str, steps: int, device: str | None, out: str) -> dict:
    """One helios-train run in a child process: its summary figures and the profiled steps' kernels."""
    first = steps // 2
    cmd = [sys.executable, "-m", "helios.train", "--config", config, "--dtype", dtype, "--steps", str(steps),
           "--seed", str(SEED), "--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "0", "--no-progress",
           "--profile-steps", f"{first}:{steps}", "--out", out] + (["--device", device] if device else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"autocast_step: helios-train --config {config} --dtype {dtype} exited with {r.returncode}")
    summary = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        (device_name,) = con.execute("SELECT device FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
        dispatches, device_ns = con.execute("SELECT sum(dispatches), sum(device_ns) FROM op_profile").fetchone()
        cast_ns = con.execute("SELECT coalesce(sum(device_ns), 0) FROM op_profile WHERE name IN ('cast', 'cast_backward')"
                              ).fetchone()[0]
    finally:
        con.close()
    n = steps - first
    return {"bench": "autocast_step", "config": config, "dtype": dtype, "device": device_name,
            "tok_s": summary["tok_per_s"], "final_train_loss": summary["final_train_loss"],
            "dispatches_per_step": dispatches / n, "device_ms_per_step": device_ns / n / 1e6,
            "cast_ms_per_step": cast_ns / n / 1e6}


def summarize(config: str, runs: list[dict]) -> dict:
    """The medians of each dtype's runs and the bf16 / fp32 ratios."""
    med = {d: {k: statistics.median(r[k] for r in runs if r["dtype"] == d)
               for k in ("tok_s", "dispatches_per_step", "device_ms_per_step", "cast_ms_per_step")} for d in ("fp32", "bf16")}
    return {"bench": "autocast_step_summary", "config": config, "rounds": len(runs) // 2,
            **{f"{d}_{k}": round(v, 2) for d, m in med.items() for k, v in m.items()},
            "bf16_over_fp32_tok_s": round(med["bf16"]["tok_s"] / med["fp32"]["tok_s"], 3),
            "bf16_over_fp32_device_ms": round(med["bf16"]["device_ms_per_step"] / med["fp32"]["device_ms_per_step"], 3),
            "bf16_over_fp32_dispatches": round(med["bf16"]["dispatches_per_step"] / med["fp32"]["dispatches_per_step"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="helios-train --dtype bf16 against fp32 on one device, alternately")
    ap.add_argument("--configs", nargs="+", default=None, help="helios-train configs (default tiny; --smoke nano)")
    ap.add_argument("--steps", type=int, default=None, help="steps a run, the second half profiled (default 40; --smoke 4)")
    ap.add_argument("--rounds", type=int, default=None, help="fp32 + bf16 pairs per config (default 3; --smoke 1)")
    ap.add_argument("--device", default=None, help="the device, e.g. vulkan:0 (default: helios-train's)")
    ap.add_argument("--smoke", action="store_true", help="nano, 4 steps, one round (CI)")
    args = ap.parse_args(argv)
    configs = args.configs or (["nano"] if args.smoke else ["tiny"])
    steps = args.steps or (4 if args.smoke else 40)
    rounds = args.rounds or (1 if args.smoke else 3)
    if steps < 2 or rounds < 1:
        ap.error("--steps must be at least 2 and --rounds at least 1")
    with tempfile.TemporaryDirectory(prefix="autocast_step_") as tmp:
        for config in configs:
            runs = []
            for i in range(rounds):
                for dtype in ("fp32", "bf16"):
                    res = run(config, dtype, steps, args.device, os.path.join(tmp, f"{config}_{dtype}_{i}"))
                    print(json.dumps({**res, "round": i + 1}), flush=True)
                    runs.append(res)
            print(json.dumps(summarize(config, runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
