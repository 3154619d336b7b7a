"""helios-train's loop: record a step, read it back (at once, or once the next step is recorded),
evaluate / sample / checkpoint when due, log it (run.db, the progress line), until the last step,
--stop-after or Ctrl-C; then the final checkpoint, validation loss, sample and summary.

Phase timing: device marks (no wait per phase; where deferring, a step is read once the next is
recorded) or, where refused, a device synchronisation at the end of every device phase."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import helios as hl
from helios.interrupt import StopFlag
from helios.profile.mfu import compute_mfu, format_mfu
from helios.profile.timers import StepTimer, device_phase_ns
from helios.train_eval import evaluate, sample
from helios.train_report import breakdown, finish_profile, profile_window, record_of_row, timing_row
from helios.train_step import StepRunner


def defer_steps(rt) -> bool:
    """Whether a step is read only once the next one is recorded (the host records step k+1 while
    the device runs step k).  HELIOS_DEFER_STEPS=1 / 0 decides; by default yes, but not on a CPU
    device (lavapipe): there the host and the "device" share the cores and the device's own time
    per step grew with the overlap (nano: 12.5 -> 15-16 ms), so the default captured step got
    slower (nano 13.2-14.1 -> 15.6-16.8 ms, tiny within noise); only a host-heavy --no-capture
    step gained (nano 17.9-19.2 -> 15.5-16.5 ms).  Figures: bench/README.md."""
    v = os.environ.get("HELIOS_DEFER_STEPS", "")
    if v:
        return v != "0"
    return rt.info.get("type") != "cpu"


def phase_marks_refusal(args: argparse.Namespace, run, pipeline: bool, zero: int, rt) -> str | None:
    """Why helios-train times its device phases by synchronising rather than by device marks
    (None: marks)."""
    if os.environ.get("HELIOS_PHASE_SYNC", "") not in ("", "0"):
        return "HELIOS_PHASE_SYNC is set"
    if run.world > 1:
        return "several ranks: their collectives wait on the host"
    if pipeline:
        return "--pp"
    if zero:
        return "--zero"
    if args.dtype == "fp16":
        return "--dtype fp16 reads its inf/nan check back each step"
    if args.moe_experts:
        return "mixture of experts counts dropped tokens on the host"
    if not rt.has_marks:
        return f"{rt.name} writes no device timestamps"
    return None


class _NoBar:
    """The progress bar where none is drawn (``--no-progress``, a log file, ranks other than 0):
    the calls the loop makes on a tqdm bar, drawing nothing; ``write`` prints, as tqdm's does."""

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(text: str) -> None:
        print(text, flush=True)


class TrainLoop:
    """The run from ``start_step`` to its end.  ``summ``: the dataset's summary; ``saver``: a
    helios.train_checkpoint.Checkpointer; ``db``: rank 0's RunDB (None elsewhere); ``peak``: the
    device's peak FLOP/s for MFU (None: unknown); ``capture``: whether steps are captured."""

    def __init__(self, args: argparse.Namespace, s, job, m, ds, summ: dict, loader, val_loader, saver, db,
                 start_step: int, peak, capture: bool):
        self.args, self.s, self.job, self.m, self.ds, self.summ = args, s, job, m, ds, summ
        self.val_loader, self.saver, self.db, self.start_step = val_loader, saver, db, start_step
        run, rt, say = job.run, job.rt, job.say
        self.run, self.rt, self.say = run, rt, say
        marks_reason = phase_marks_refusal(args, run, s.pipeline, m.zero, rt)
        self.marks_on = marks_on = marks_reason is None
        self.defer = marks_on and defer_steps(rt)
        self.timer = timer = StepTimer(mark=rt.mark if marks_on else None)
        if self.defer:
            say("phase timing: device timestamps (no wait per phase; a step is read once the next is recorded)")
        elif marks_on:
            say("phase timing: device timestamps (no wait per phase; each step read before the next is recorded: "
                "on a CPU device the overlap measured slower; HELIOS_DEFER_STEPS=1 turns it on)")
        else:
            say(f"phase timing: each phase ends with a device synchronisation ({marks_reason})")
        # A forward that gathers parameters (ZeRO-3), splits them (tensor parallel) or passes
        # through the stages (pipeline) is a collective: then every rank samples alike.
        self.collective = m.zero == 3 or m.tensor_parallel or s.pipeline
        if m.model is not m.gpt:  # a data-parallel wrapper: time its end-of-backward wait as "comm"
            m.model.wait_context = lambda: timer.phase("comm")
        self.stopper = StopFlag("finishing the step, saving a checkpoint, then exiting")
        self.window = profile_window(args, start_step, s.steps, say)
        self.prof = None  # (session, profiler) while the profiled window is open
        self.tokens_per_step = s.bs * s.T * args.grad_accum  # the global batch, over every rank
        self.job_peak = peak * run.world if peak else None
        # lavapipe (Mesa 22.3) makes a submission's completion visible only once the submissions
        # queued behind it have run too (measured: waiting for the first of two 150-200 ms
        # submissions returned after both), so reading step k after step k+1 was submitted would
        # wait for k+1 as well.  On a CPU device step k+1 is therefore recorded while the device
        # runs step k but submitted once step k is read; a GPU gets it at once.
        self.hold_submit = self.defer and rt.info.get("type") == "cpu"
        self.runner = StepRunner(args, s, job, m, loader, timer, capture, self.defer, self.hold_submit, say)
        # A log file (stderr not a terminal) gets plain lines, not a carriage-return progress bar.
        self.plain = args.no_progress or not sys.stderr.isatty()
        if self.plain or not run.is_main:
            self.bar = _NoBar()
        else:
            from tqdm import tqdm  # here: importing tqdm costs ~30 ms, which ranks without a bar need not pay

            self.bar = tqdm(total=s.steps, initial=start_step, dynamic_ncols=True, unit="step")
        self.val_loss = None  # the latest validation loss
        self.last = {}  # the latest step's loss, lr, tokens/s and MFU
        self.step = start_step  # steps recorded
        self.mark_times: dict = {}  # resolved device marks not yet used: {id: device ns}

    def run_to_end(self) -> int:
        """Train, then finish the run; the exit status (130 after Ctrl-C)."""
        exit_code = self._loop()
        if exit_code:
            self.say(f"stopped at step {self.step}; checkpoint saved in {self.saver.step_dir(self.step)} "
                     "(continue with --resume)")
            if self.db is not None:
                self.db.finish(status="interrupted")
            self.run.close()
            return 130 if exit_code == 130 else 0
        return self._finish()

    def _loop(self) -> int:
        """Record and read every step; 0 at the last step, 130 after Ctrl-C, 3 after --stop-after."""
        args, timer = self.args, self.timer
        steps = self.s.steps
        pending = None  # a recorded step not read yet (device marks on)
        exit_code = 0
        try:
            while self.step < steps or pending is not None:
                if pending is not None and (self.step >= steps or self.must_read(self.step + 1)):
                    # The next step evaluates, checkpoints, stops (...): read this one before recording it.
                    left, pending = self.read_step(pending), None
                    if left:
                        exit_code = 130 if self.stopper.stop else 3
                        break
                    continue
                if self.window and self.step == self.window[0]:
                    session = hl.profile.profile(device_timestamps=not args.profile_host_only)
                    self.prof = (session, session.__enter__())
                if not timer.in_step:
                    timer.start_step()
                timer.device_marks = self.marks_on and self.prof is None
                deferred = not self.must_read(self.step + 1)
                cur = self.runner.record(self.step, deferred, self.prof is not None)
                self.step += 1
                if pending is not None:
                    self.read_step(pending, newer=True)  # step k, read once the host has recorded step k+1
                    pending = None
                if deferred and not self.stopper.stop:
                    pending = cur
                elif self.read_step(cur):
                    exit_code = 130 if self.stopper.stop else 3
                    break
        finally:
            self.bar.close()
            self.stopper.restore()
            self.saver.wait()  # a checkpoint being written is finished, also when training failed
            if self.prof is not None and sys.exc_info()[0] is None:
                finish_profile(self.prof, args, self.db, self.step, self.run)
        return exit_code

    def must_read(self, n: int) -> bool:
        """Whether step ``n`` is read before the next step is recorded: every step when steps are not
        deferred, and those that evaluate, sample, checkpoint, stop or end the run, or are profiled."""
        args = self.args
        return (not self.defer or self.prof is not None or self.stopper.stop or n >= self.s.steps
                or bool(args.eval_every and n % args.eval_every == 0)
                or bool(args.sample_every and n % args.sample_every == 0)
                or bool(args.ckpt_every and n % args.ckpt_every == 0)
                or (args.stop_after is not None and n - self.start_step >= args.stop_after)
                or bool(self.window and n == self.window[0]))

    def read_step(self, p: dict, newer: bool = False) -> bool:
        """Read step p's results back, evaluate / sample / checkpoint when due, log it (run.db, the
        progress line); True when the run leaves after it.  ``newer``: the next step is recorded
        already; then step p's window ends when the host sees p's work finished (the next window
        opens there: the device goes on with the next step), and p cannot be the step a Ctrl-C
        stops at (its parameters are moving on) nor one that evaluates."""
        timer, rt = self.timer, self.rt
        if not timer.in_step:
            timer.start_step()
        n = p["step"]
        device_ns = self._device_time(p) if "end_mark" in p else None
        closed = None
        if newer:
            closed = timer.end_step(n, self.tokens_per_step, lr=p["lr"], dispatches=p["dispatches"], complete=False)
            timer.start_step()
        d0 = rt.stats()["dispatches"]
        loss_val = self._read_loss(p)
        evaluated, leaving = self._when_due(n, newer)
        if closed is None:
            rec = timer.end_step(n, self.tokens_per_step, loss=loss_val, lr=p["lr"],
                                 dispatches=p["dispatches"] + rt.stats()["dispatches"] - d0, device_ns=device_ns)
        else:
            rec = timer.complete_step(closed, device_ns, loss=loss_val)
        self._log(p, rec, loss_val, evaluated)
        if self.prof is not None and self.window and n >= self.window[1]:
            finish_profile(self.prof, self.args, self.db, n, self.run, self.bar.write)
            self.prof = None
        return leaving

    def _device_time(self, p: dict) -> dict:
        """Wait for step p's end mark (its work only; a later step's may still run) and return the
        device time of its phases."""
        rt, mark_times = self.rt, self.mark_times
        rt.wait_mark(p["end_mark"])
        if self.hold_submit:
            rt.flush()  # the next step's work, recorded meanwhile (hold_submit above)
        mark_times.update(rt.take_marks())
        device_ns = device_phase_ns(p["marks"], mark_times)
        for _, a, b in p["marks"]:
            mark_times.pop(a, None)
            mark_times.pop(b, None)
        mark_times.pop(p["end_mark"], None)
        return device_ns

    def _read_loss(self, p: dict) -> float:
        """Step p's loss, the mean over the replicas; every rank learns whether any was asked to stop."""
        run, stopper, scaler, n = self.run, self.stopper, self.m.scaler, p["step"]
        with self.timer.phase("device_to_host"):
            if self.s.pipeline:
                # Only the last stage has the loss: counted pp times there and 0 elsewhere, the
                # mean over every rank below is the mean over the replicas.
                stage_loss = p["stage_loss"]
                loss_val = stage_loss * self.s.layout.pp if stage_loss is not None else 0.0
            else:
                loss_val = p["loss_dev"].item()
        if run.active:
            # One small collective per step: the mean loss, and whether any rank was asked to stop
            # (a Ctrl-C reaches the ranks at slightly different times: they must leave together).
            with self.timer.phase("comm"):
                loss_val, stop_any = run.agree(loss_val, stopper.stop)
            stopper.stop = stopper.stop or stop_any
        if scaler.last_step_skipped:
            self.say(f"step {n}: inf/nan in the fp16 gradients, step skipped ({scaler.skipped_steps} so far); "
                     f"loss scale now {scaler.get_scale():g}", flush=True)
        elif not math.isfinite(loss_val):
            raise FloatingPointError(f"loss became {loss_val} at step {n}; lower --lr or check the data")
        return loss_val

    def _when_due(self, n: int, newer: bool) -> tuple[float | None, bool]:
        """Evaluate, sample and checkpoint after step n where due; (the validation loss if
        evaluated, whether the run leaves after step n)."""
        args, run, steps, timer = self.args, self.run, self.s.steps, self.timer
        evaluated = None
        if args.eval_every and n % args.eval_every == 0 and n < steps:
            with timer.phase("sample_gen"):
                self.val_loss = evaluated = evaluate(args, self.s, run, self.m, self.val_loader)
        if args.sample_every and n % args.sample_every == 0 and n < steps and (run.is_main or self.collective):
            with timer.phase("sample_gen"):  # ZeRO-3: every rank samples alike (its forwards gather)
                text = sample(self.m.gpt, self.ds.tokenizer, self.s.T, args.sample_tokens, n, self.collective)
                if run.is_main:
                    self.bar.write(f"--- sample at step {n} ---\n{text}\n---")
        leaving = (self.stopper.stop and not newer) or (args.stop_after is not None
                                                        and n - self.start_step >= args.stop_after and n < steps)
        if (args.ckpt_every and n % args.ckpt_every == 0) or leaving:
            with timer.phase("checkpoint"):
                self.saver.save(n)
        return evaluated, leaving

    def _log(self, p: dict, rec, loss_val: float, evaluated: float | None) -> None:
        """Step p in run.db (every rank's timing, gathered on rank 0) and on the progress line."""
        run, db, n, steps = self.run, self.db, p["step"], self.s.steps
        sent = [b1 - b0 for b1, b0 in zip(run.comm_bytes(), p["bytes0"])]  # before the gather: its bytes are not the step's
        rows = run.gather_step({**timing_row(rec), "comm_bytes": sent[0], "comm_payload_bytes": sent[1]})
        mfu = compute_mfu(self.m.fpt, rec.tokens_per_s, self.job_peak)
        if db is not None:
            for r in range(run.world):
                nbytes = {"comm_bytes": int(rows[r][-2]), "comm_payload_bytes": int(rows[r][-1])} if run.active else {}
                if r == 0:
                    db.log_step(rec, mfu=mfu, val_loss=evaluated, **nbytes)
                else:
                    db.log_step(record_of_row(rec, rows[r]), rank=r, **nbytes)
        self.last = {"loss": loss_val, "lr": p["lr"], "tok_s": rec.tokens_per_s, "mfu": mfu}
        post = {"loss": f"{loss_val:.4f}", "lr": f"{p['lr']:.2e}", "tok/s": f"{rec.tokens_per_s:,.0f}",
                "MFU": format_mfu(mfu)}
        scaler, moe_step = self.m.scaler, self.runner.moe_step
        if scaler.is_enabled():
            post["scale"] = f"{scaler.get_scale():g}"
            post["skipped"] = str(scaler.skipped_steps)
        if moe_step is not None:  # rank 0's replica's load-balancing loss (the loss above leaves it out)
            post["aux"] = f"{float(moe_step[0]):.4f}"
            post["dropped"] = str(int(moe_step[1]))
            self.runner.moe_step = None
        if self.val_loss is not None:
            post["val"] = f"{self.val_loss:.4f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        if self.plain and (n % 10 == 0 or n == steps):
            self.say(f"step {n}/{steps} " + " ".join(f"{k} {v}" for k, v in post.items()), flush=True)

    def _finish(self) -> int:
        """The last checkpoint, the final validation loss and sample, and rank 0's summary."""
        args, run, say, m, step, last = self.args, self.run, self.say, self.m, self.step, self.last
        final_ckpt = self.saver.save(step)
        val_loss = evaluate(args, self.s, run, m, self.val_loader)
        self.saver.wait()
        if self.db is not None:
            self.db.set_val_loss(step, val_loss)
        say(f"step {step}/{self.s.steps} loss {last.get('loss', float('nan')):.4f} val {val_loss:.4f} (final)",
            flush=True)
        wall = time.monotonic() - self.job.t_start
        text = sample(m.gpt, self.ds.tokenizer, self.s.T, args.sample_tokens, step, self.collective) \
            if run.is_main or self.collective else ""
        if run.is_main:
            print(breakdown(self.timer.records))
            print(f"--- sample ---\n{text}\n---")
            summary = {"steps": step, "wall_s": round(wall, 1), "final_train_loss": round(last.get("loss", float('nan')), 4),
                       "final_val_loss": round(val_loss, 4), "unigram_entropy": round(self.summ["unigram_entropy_nats"], 4),
                       "tok_per_s": round(last.get("tok_s") or 0, 1), "mfu": format_mfu(last.get("mfu")),
                       "world_size": run.world, "checkpoint": final_ckpt, "run_db": self.db.path, "dtype": args.dtype}
            if m.scaler.is_enabled():
                summary.update(loss_scale=m.scaler.get_scale(), skipped_steps=m.scaler.skipped_steps)
            print(json.dumps(summary))
            self.db.finish(status="finished")
        run.close()
        return 0
