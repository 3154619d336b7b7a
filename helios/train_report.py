"""What helios-train tells its user and writes down: the banner at the start, the run database,
the profiled window (its steps, its Chrome trace), each rank's step timing gathered on rank 0, and
the step-time breakdown at the end."""

from __future__ import annotations

import argparse
import json

from helios.profile.mfu import peak_flops
from helios.profile.profiler import parse_profile_steps
from helios.profile.rundb import RunDB
from helios.profile.timers import ALL_PHASES, StepRecord
from helios.profile.trace import build_trace, write_trace
from helios.schedule.dist_run import merge_rank_traces
from helios.schedule.pipeline import describe_stages
from helios.train_model import describe_config
from helios.train_settings import usage


def quiet(*args, **kwargs) -> None:
    """print() on ranks other than 0."""


def describe_run(args: argparse.Namespace, s, job, m, summ: dict, capture_reason: str | None) -> tuple:
    """Say the device (with the peak MFU is measured against), the model, the precision, graph
    capture, experts, pipeline stages and data; returns (peak FLOP/s or None, its label)."""
    rt, run, say, layout = job.rt, job.run, job.say, s.layout
    dev = rt.info
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
        peak_label = f"{args.peak_tflops} TFLOP/s (--peak-tflops)"
    else:
        pk = peak_flops(dev["name"], args.dtype, dev["type"])  # bf16 / fp16 products run at their own peak
        peak, peak_label = (pk.flops, pk.label) if pk else (None, "n/a (unknown device: pass --peak-tflops)")
    extras = (", sequence parallel" if args.sequence_parallel else "") + (f", ZeRO-{args.zero}" if args.zero else "")
    if m.cp is not None:
        extras += f", context parallel {m.cp.world} ({m.cp.layout}: {s.T // m.cp.world} tokens of each sequence a rank)"
    ranks = f" x {run.world} ranks ({layout.describe()}{extras})" if run.active else ""
    say(f"device: {rt.name} {dev['name']} ({dev['type']}){ranks}; peak for MFU: {peak_label}")
    say(f"model: {m.n_params / 1e6:.2f}M parameters, {describe_config(m.cfg)}")
    if args.dtype != "fp32":
        say(f"mixed precision: --dtype {args.dtype}, matmuls in {'bfloat16' if args.dtype == 'bf16' else 'float16'}, "
            "float32 master weights" + (f", loss scale {m.scaler.get_scale():g}" if m.scaler.is_enabled() else ""))
    if capture_reason is None:
        say("graph capture: on (the first step is captured, the others replay it; --no-capture turns it off)")
    elif not args.no_capture:
        say(f"graph capture: off ({capture_reason})")
    if args.moe_experts:
        say(f"mixture of experts: {args.moe_experts} experts per block, top-{args.moe_top_k}, capacity factor "
            f"{args.moe_capacity}, load-balancing loss x {args.moe_aux_alpha} (logged as aux)")
    if s.pipeline:
        stages = f"pipeline stages: {describe_stages(m.gpt.bounds, m.cfg.n_layer, layout.pp, m.times)}"
        # Balanced by time, every rank says the split it built (they must not disagree).
        (print if m.times is not None else say)(stages)
    if run.is_main:  # (the other ranks' summaries leave the entropy out)
        say(f"data: {summ['corpus']}, {summ['train_tokens']:,} train / {summ['val_tokens']:,} val tokens, "
            f"tokenizer {summ['tokenizer']}; unigram entropy {summ['unigram_entropy_nats']:.3f} nats "
            f"(uniform {summ['uniform_loss_nats']:.3f})")
    return peak, peak_label


def open_run_db(args: argparse.Namespace, s, job, m, peak, peak_label: str) -> RunDB | None:
    """Rank 0's run database (the run's settings, and the model-state memory this rank holds);
    None on the other ranks."""
    run, layout = job.run, s.layout
    if not run.is_main:
        return None
    return RunDB(args.out, device=job.rt.info["name"], dtype=args.dtype, n_devices=run.world, peak_flops=peak,
                 peak_label=peak_label, flops_per_token=m.fpt, n_params=m.n_params,
                 config={**m.run_meta, "steps": s.steps, "world_size": run.world, "zero": m.zero, "tp": args.tp,
                         "pp": args.pp, "pp_virtual": layout.virtual, "microbatches": layout.microbatches,
                         "memory": _model_state_bytes(m.model, m.opt, job.rt, m.zero)})


def _model_state_bytes(model, opt, rt, zero: int) -> dict:
    """Bytes of model states this rank holds (the weights pool, where parameters, gradients and
    moments live) and what the ZeRO formula says for them."""
    rt.synchronize()
    held = rt.pool_stats()["weights"]["in_use_bytes"]
    if zero:
        expected, psi = opt.expected_memory(), opt.optimizer.padded_numel
    else:
        psi = sum(fg.n for fg in opt.flat)
        expected = {"params": 4 * psi, "grads": 4 * psi, "moments": 8 * psi}
    return {"weights_pool_in_use": held, "psi": psi, "expected": expected, "expected_total": sum(expected.values())}


# ---- step timing -------------------------------------------------------------------------------
def timing_row(rec) -> dict:
    """A step's timing as one rank sends it to rank 0: wall time and each phase's time."""
    return {"wall_ns": rec.wall_ns, **{f"{p}_ns": rec.phases_ns.get(p, 0) for p in ALL_PHASES}}


def record_of_row(rec, row):
    """Another rank's StepRecord, rebuilt on rank 0 from its gathered timing row."""
    phases = {p: int(row[1 + i]) for i, p in enumerate(ALL_PHASES)}
    return StepRecord(rec.step, rec.start_ns, rec.start_ns + int(row[0]), phases, rec.tokens, rec.loss, rec.lr)


def breakdown(records) -> str:
    """A table of the mean time per phase over the run's steps."""
    if not records:
        return "no steps timed"
    n = len(records)
    wall = sum(r.wall_ns for r in records) / n
    lines = [f"step time breakdown (mean over {n} steps, {wall / 1e6:.1f} ms/step):"]
    for ph in ALL_PHASES:
        v = sum(r.phases_ns.get(ph, 0) for r in records) / n
        if v:
            lines.append(f"  {ph:<16} {v / 1e6:9.2f} ms  {100 * v / wall:5.1f}%")
    return "\n".join(lines)


# ---- the profiled window -----------------------------------------------------------------------
def profile_window(args: argparse.Namespace, start_step: int, steps: int, say) -> tuple[int, int] | None:
    """The steps [start, stop) to profile: --profile-steps, or with --trace alone a default
    window of 5 steps after a few warm-up steps; a window outside the run is refused."""
    if not args.profile_steps:
        if not args.trace:
            return None
        if steps - start_step < 2:
            usage(f"--trace {args.trace}: the run has {steps - start_step} step(s) left, too few to profile one after a "
                  "warm-up step; give more --steps or --profile-steps")
        lo = start_step + min(10, (steps - start_step) // 2)
        window = (lo, min(steps, lo + 5))
        say(f"--trace without --profile-steps: profiling steps {window[0]}:{window[1]}")
        return window
    try:
        r = parse_profile_steps(args.profile_steps)
    except ValueError as e:
        usage(f"--profile-steps {args.profile_steps}: {e}")
    if r.start >= steps or r.start < start_step:
        usage(f"--profile-steps {args.profile_steps}: the run trains steps {start_step}..{steps - 1}; profile "
              "steps inside it")
    return (r.start, r.stop)


def finish_profile(prof, args: argparse.Namespace, db, step: int, run, write=print) -> None:
    """Close the profiling window; rank 0 logs it and writes one trace with a process per rank."""
    session, profiler = prof
    session.__exit__(None, None, None)
    if db is not None:
        db.log_profile(profiler.collector, step)
    if not args.trace:
        return
    mine = json.dumps(build_trace(profiler.collector, process_name=f"helios rank {run.rank}")).encode()
    every = run.gather_bytes(mine)
    if every is not None:
        traces = [json.loads(b) for b in every]
        write_trace(args.trace, traces[0] if len(traces) == 1 else merge_rank_traces(traces))
        write(f"trace written to {args.trace}")
