"""One helios-train step's device work, recorded and not read back: the step's micro-batches
through forward and backward (plain), through this rank's pipeline stage (pipeline), or a replay
of the first step's captured device work (captured); then the clip and optimizer phases.

Each device phase is timed by :class:`helios.profile.timers.StepTimer`: by device marks, or where
those are refused by a device synchronisation at the phase's end (``phase_sync``)."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

import helios as hl
import helios.comm as dist
from helios import _kernels as K
from helios.optim import clip_grad_norm_, cosine_lr
from helios.schedule.moe import (aux_loss, average_expert_gradients, dropped_pairs, expert_gradient_copies,
                                 restore_expert_gradients)
from helios.schedule.pipeline import clip_grad_norm_ as pp_clip
from helios.schedule.tensor_parallel import clip_grad_norm_ as tp_clip


def capture_refusal(args: argparse.Namespace, run, pipeline: bool, zero: int) -> str | None:
    """Why helios-train does not capture the step (None: it does).  A replay repeats one device's
    commands: collectives and host-side loss scaling are not a static stream of them."""
    if args.no_capture:
        return "--no-capture"
    if run.world > 1:
        return "several ranks exchange data through the host"
    if args.dtype == "fp16":
        return "--dtype fp16 checks for inf/nan on the host each step"
    if pipeline:
        return "--pp"
    if args.moe_experts:
        return "mixture of experts counts dropped tokens on the host"
    if zero:
        return "--zero"
    if args.dropout:
        return "--dropout draws new random masks every step"
    return None


class StepRunner:
    """Records one training step at a time.  ``capture``: the first step runs under hl.graph
    capture and later ones replay its device work with the next batch in its input tensors;
    ``hold_submit``: a replay is recorded but not submitted (the loop submits it once the step
    before is read); ``loss_hold``: a replayed step read only after the next one keeps its loss
    in one of two small buffers (the replay writes the captured loss tensor again)."""

    def __init__(self, args: argparse.Namespace, s, job, m, loader, timer, capture: bool, defer: bool,
                 hold_submit: bool, say):
        self.args, self.s, self.run, self.rt, self.m, self.loader, self.timer = args, s, job.run, job.rt, m, loader, timer
        self.say, self.hold_submit = say, hold_submit
        self.n_micro = args.grad_accum * s.layout.microbatches  # micro-batches per step on each replica
        zero_experts = bool(m.zero) and m.ep_group is not None
        self.zero_experts = zero_experts
        # ZeRO-1/2 reduce the experts (and the rest) after backward, each over its own ranks; ZeRO-3
        # reduces every unit's gradients during backward, as they complete.
        self.reduce_after = zero_experts and m.zero < 3
        self.moe_step = None  # the step's load-balancing loss and dropped (token, choice) pairs, logged by the loop
        self.capture = {} if capture else None  # {"graph", "loss"} once captured; None: every step through Python
        self.loss_hold = [hl.zeros(()), hl.zeros(())] if defer and capture else None
        if s.pipeline:  # the whole model's norm: every stage's squares, each shard and the tied table once
            self.clip = lambda params, max_norm: pp_clip(m.gpt, max_norm)  # (each shard over its layout's group)
        elif m.tensor_parallel:  # the global norm sums every shard once, over the tensor-parallel group
            self.clip = lambda params, max_norm: tp_clip(params, max_norm, m.tp_group)
        else:
            self.clip = clip_grad_norm_

    def phase_sync(self) -> None:
        """The end of a device phase timed on the host: wait for its work (marks need no wait)."""
        if not self.timer.device_marks:
            self.rt.synchronize()

    def record(self, step: int, deferred: bool, profiling: bool) -> dict:
        """Record the device work of step ``step + 1`` (read nothing back); what the loop needs to read it.
        A profiled step runs through Python (its trace shows the ops and phases); replays go on after."""
        args, s, m, timer, rt = self.args, self.s, self.m, self.timer, self.rt
        lr = cosine_lr(step, s.lr_max, s.warmup, s.steps)
        for g in m.opt.param_groups:
            g["lr"] = lr
        d0 = rt.stats()["dispatches"]
        p = {"step": step + 1, "lr": lr, "bytes0": self.run.comm_bytes(), "loss_dev": None, "stage_loss": None}
        if self.capture is not None and not profiling:
            p["loss_dev"] = self.captured()
            if deferred and self.capture is not None and self.capture.get("graph") is not None:  # (None: refused)
                hold = self.loss_hold[step % 2]
                with hl.no_grad():
                    hold.copy_(p["loss_dev"])
                p["loss_dev"] = hold
        elif s.pipeline:
            p["stage_loss"] = self.pipeline()
            if args.moe_experts:
                self.moe_step = m.gpt.moe_totals()  # summed over the stages, as one device has them
            self.update()
        else:
            p["loss_dev"] = self.plain()
            if self.reduce_after:
                with timer.phase("comm"):
                    m.opt.reduce_gradients()  # dense over every replica, experts over their own replicas
            elif m.ep_group is not None and not self.zero_experts:
                with timer.phase("comm"):
                    average_expert_gradients(m.gpt, m.edp_group, self.run.data_world)
            self.update()
        p["marks"] = timer.take_marks()
        if timer.device_marks:
            p["end_mark"] = rt.mark()  # after everything the step recorded
            if not self.hold_submit:
                rt.flush()  # the device starts on it now, while the host goes on
        p["dispatches"] = rt.stats()["dispatches"] - d0
        return p

    def micro_batches(self):
        """This replica's micro-batches of the step: the --microbatches slices of each of the
        --grad-accum batches, in order."""
        run, cp, microbatches = self.run, self.m.cp, self.s.layout.microbatches
        for _ in range(self.args.grad_accum):
            with self.timer.phase("data_load"):
                x, y = self.loader.next_batch()
                x, y = run.shard(x), run.shard(y)
                if cp is not None:  # this rank's tokens of each sequence
                    x, y = cp.shard(x), cp.shard(y)
            yield from zip(np.split(x, microbatches), np.split(y, microbatches))

    def plain(self, tensors=None):
        """Forward and backward of each micro-batch (``tensors``: the step's (x, y) device tensors,
        else the loader's next micro-batches), gradients accumulated; the step's mean loss (a device
        scalar)."""
        m, timer, n_micro, moe = self.m, self.timer, self.n_micro, self.args.moe_experts
        model, gpt = m.model, m.gpt
        loss_dev = None
        for i, (x, y) in enumerate(self.micro_batches() if tensors is None else tensors):
            if tensors is None:
                with timer.phase("host_to_device"):
                    xt = hl.tensor(x, dtype=hl.int64)
                    yt = hl.tensor(y, dtype=hl.int64)
            else:
                xt, yt = x, y
            # Gradient accumulation: only the last micro-batch's backward communicates (ZeRO-1/2 with
            # experts: none, the optimizer reduces each group over its own ranks afterwards).
            local = (i < n_micro - 1 or self.reduce_after) and self.run.active
            with model.no_sync() if local and model is not gpt else contextlib.nullcontext():
                with timer.phase("forward"):
                    with m.autocast():
                        _, loss = model(xt, yt)
                    aux = aux_loss(gpt) if moe else None
                    if n_micro > 1:
                        loss = loss * (1.0 / n_micro)
                        aux = aux * (1.0 / n_micro) if aux is not None else None
                    self.phase_sync()
                with timer.phase("backward"):
                    m.scaler.scale(loss + aux if aux is not None else loss).backward()
                    self.phase_sync()
            loss_dev = loss if loss_dev is None else loss_dev + loss.detach()
            if aux is not None:
                drop = dropped_pairs(gpt)
                ms = self.moe_step
                self.moe_step = (aux.detach(), drop) if ms is None else (ms[0] + aux.detach(), ms[1] + drop)
        return loss_dev

    def pipeline(self) -> float | None:
        """The step's micro-batches through this stage in 1F1B (or interleaved) order, then the stage's gradients
        averaged over the data-parallel replicas; the mean loss on the last stage, None elsewhere."""
        m, timer = self.m, self.timer
        gpt, opt, grid = m.gpt, m.opt, m.grid
        xs, ys = zip(*self.micro_batches())
        if m.zero == 3:
            # ZeRO-3 gathers each block around its forward and again for its backward, so every
            # micro-batch's backward reduce-scatters the stage's gradients into the shards (adding
            # to the earlier ones); the tied table's two halves are then summed shard by shard.
            loss = gpt.train_step(list(xs), list(ys), phase=timer.phase, autocast=m.autocast,
                                  loss_scale=m.scaler.get_scale())
            if gpt.embedding_group is not None:
                with timer.phase("comm"):
                    opt.all_reduce_gradient("wte.weight", gpt.embedding_group)
            return loss
        if m.zero:
            # The stage runs backward itself: its gradients accumulate locally (the tied table's
            # two summed between the first and the last stage), then ZeRO reduces them over the
            # stage's data-parallel ranks (stage 1 all-reduces, stage 2 reduce-scatters).
            with m.model.no_sync():
                loss = gpt.train_step(list(xs), list(ys), phase=timer.phase, autocast=m.autocast,
                                      loss_scale=m.scaler.get_scale())
            with timer.phase("comm"):
                opt.reduce_gradients()
            return loss
        loss = gpt.train_step(list(xs), list(ys), phase=timer.phase, autocast=m.autocast,
                              loss_scale=m.scaler.get_scale())
        if grid.dp > 1:
            with timer.phase("comm"):
                if m.ep_group is not None:  # the experts differ between ranks: averaged apart, below
                    experts = expert_gradient_copies(gpt)
                _average_gradients(opt, grid.dp_group)
                if m.ep_group is not None:
                    restore_expert_gradients(experts)
                    average_expert_gradients(gpt, m.edp_group, grid.dp)
        return loss

    def update(self) -> None:
        """The clip and optimizer phases of a step (its gradients are complete)."""
        args, s, m, timer = self.args, self.s, self.m, self.timer
        opt, scaler = m.opt, m.scaler
        with timer.phase("grad_clip"):
            scaler.unscale_(opt)  # fp16: the true gradients, for the norm and the inf/nan test
            if args.grad_clip > 0:
                if m.zero:
                    # the global norm over every rank's shard (and every tensor-parallel part, and
                    # every pipeline stage: the tied table counted once, by the first stage)
                    opt.clip_grad_norm_(args.grad_clip, tp_group=m.tp_group if args.tp > 1 else None,
                                        pp_group=m.gpt.group if s.pipeline else None,
                                        counted=m.gpt.owns if s.pipeline else None)
                else:
                    self.clip(m.gpt.parameters(), args.grad_clip)
            self.phase_sync()
        with timer.phase("optimizer"):
            scaler.step(opt)  # fp16: skipped when a gradient is inf or nan
            scaler.update()
            opt.zero_grad()
            self.phase_sync()

    def captured(self):
        """One step by capture or replay (clip and optimizer included): the first call runs the
        step under capture with its micro-batches in new input tensors, later calls refill them
        and replay.  A refused capture is said once; the step then runs again the plain way on
        the same micro-batches, and so do all later steps."""
        timer = self.timer
        batches = list(self.micro_batches())
        g = self.capture.get("graph")
        if g is not None:
            with timer.phase("replay"):
                # The refill does not wait for the previous replay (graph.upload).
                g.replay(*(a for xy in batches for a in xy), flush=not self.hold_submit)
                self.phase_sync()
            return self.capture["loss"]
        with timer.phase("host_to_device"):
            tensors = [(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64)) for x, y in batches]
        try:
            with hl.graph.capture(inputs=[t for xy in tensors for t in xy]) as g:
                loss = self.plain(tensors)
                self.update()
        except hl.graph.GraphCaptureError as e:
            self.say(f"graph capture refused, training without it: {e}", flush=True)
            self.capture = None
            self.m.opt.zero_grad()
            loss = self.plain(tensors)
            self.update()
            return loss
        self.capture.update(graph=g, loss=loss)
        return loss


def _average_gradients(opt, group) -> None:
    """Average a pipeline stage's gradients over its data-parallel replicas once the pipeline has
    flushed (as Megatron-LM does): one all-reduce per flat gradient buffer of the optimizer."""
    for fg in opt.flat:
        for p in fg.params:
            if p.grad is not None and p.grad.untyped_storage() is not fg.g.untyped_storage():
                K.copy_into(p.grad_slot, p.grad)  # a gradient outside its slot: put it in place first
                p.grad = p.grad_slot
        dist.all_reduce(fg.g, op="avg", group=group)
