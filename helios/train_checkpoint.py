"""helios-train's checkpoints: resuming a run (--resume, or a job that helios-run --max-restarts
relaunched after a lost rank) and saving one, each rank its shard, written in the background.

Checkpoints always hold the whole model's tensors under one device's names, so a run resumes on
any layout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from helios import legacy_checkpoint as ckpt
from helios.errors import CheckpointError
from helios.schedule import checkpoint as sharded
from helios.schedule import train_state
from helios.train_report import quiet


def resume(args: argparse.Namespace, s, job, m, loader) -> int:
    """The step the run starts at: 0, or the step of the checkpoint it continues from, whose
    model, optimizer, data order and loss scale are then loaded (into the whole model by name: a
    stage's parameters are its own objects)."""
    run, say = job.run, job.say
    # A job that helios-run --max-restarts relaunched after a lost rank continues from its last checkpoint.
    restarted = int(os.environ.get("HELIOS_RESTART_COUNT") or 0) > 0
    if restarted and not args.resume and (_latest_checkpoint(args.out, quiet) or ckpt.has_checkpoint(args.out)):
        say(f"restart {os.environ['HELIOS_RESTART_COUNT']} of the job: resuming from the last complete checkpoint")
        args.resume = True
    if not args.resume:
        return 0
    found = _latest_checkpoint(args.out, say)
    if found is not None:
        # A stage's parameters are the whole model's own objects: loading the whole model by
        # name fills the stage's parameters (and, through the optimizer, their moments).
        meta = train_state.load_training(found[1], m.whole, m.opt, loader, m.tp_rank)
        resumed_from = found[1]
        afresh = train_state.load_comm_hook(found[1], meta, s.comm_hook, run.rank, run.world)
        if afresh:
            say(f"--grad-compression: {afresh}")
    elif ckpt.has_checkpoint(args.out):  # a single-file checkpoint of an earlier Helios
        if m.zero or s.pipeline:
            flag = "--zero" if m.zero else "--pp"
            raise CheckpointError(f"{ckpt.checkpoint_path(args.out)} is a single-file checkpoint of an earlier "
                                  f"Helios: resume it without {flag} once, then go on with {flag}")
        meta = ckpt.load_training_state(args.out, m.gpt, m.opt, loader)
        resumed_from = ckpt.checkpoint_path(args.out)
    else:
        raise CheckpointError(f"--resume: no complete checkpoint in {os.path.join(args.out, 'ckpt')}; start "
                              "without --resume or point --out at an earlier run")
    run_meta = m.run_meta
    if meta["config"] != run_meta["config"] or meta["train"] != run_meta["train"]:
        raise SystemExit(f"helios-train: --resume with different settings than the checkpoint in {args.out}:\n"
                         f"  checkpoint: {json.dumps(meta['config'])} {json.dumps(meta['train'])}\n"
                         f"  now:        {json.dumps(run_meta['config'])} {json.dumps(run_meta['train'])}")
    start_step = int(meta["step"])
    if m.scaler.is_enabled() and meta.get("grad_scaler"):
        m.scaler.load_state_dict(meta["grad_scaler"])  # the loss scale goes on where it was
    n = meta.get("world_size")
    saved_grid = "".join(f", {k.replace('_', ' ')} {v}" for k, v in meta.get("grid", {}).items()
                         if k in ("tp", "pp", "pp_virtual") and v > 1)
    was = f" (saved by {n} rank{'s' if n != 1 else ''}{saved_grid}, ZeRO-{meta.get('zero', 0)})" if n else ""
    say(f"resumed from {resumed_from} at step {start_step}{was}")
    # Once every rank has read it, drop what a dead attempt left after it: a stray shard of
    # a later step could otherwise complete, with this run's files, a checkpoint of two runs.
    run.barrier()
    if run.is_main:
        sharded.discard_newer(args.out, start_step)
    return start_step


class Checkpointer:
    """Saves this rank's shard of the training state: a snapshot taken at once, written by a
    background thread while training goes on."""

    def __init__(self, args: argparse.Namespace, s, job, m, loader):
        self.out, self.s, self.run, self.m, self.loader = args.out, s, job.run, m, loader
        self.writer = sharded.AsyncCheckpointer(args.out, job.run.rank, job.run.world)

    def save(self, at_step: int) -> str:
        """Snapshot this rank's shard now; the background thread writes it while training goes on."""
        s, run, m = self.s, self.run, self.m
        comm_hook, layout = s.comm_hook, s.layout
        shards = {**_training_shards(m.gpt, m.opt, run, m.grid if s.pipeline else None, m.tp_group),
                  **train_state.comm_hook_shards(comm_hook, run.rank)}
        meta = train_state.training_meta(m.opt, self.loader, at_step, m.run_meta, run.world, m.zero)
        if m.scaler.is_enabled():
            meta["grad_scaler"] = m.scaler.state_dict()
        meta["grid"] = {"tp": layout.tp, "pp": layout.pp, "pp_virtual": layout.virtual, "dp": layout.dp,
                        "microbatches": layout.microbatches}
        if comm_hook is not None:
            meta["comm_hook"] = train_state.comm_hook_meta(comm_hook, run.world)
        # The shards were just read from the device (or copied from the hook) into fresh arrays:
        # they are the snapshot.
        self.writer.save(at_step, shards, meta, copy=False)
        return sharded.step_dir(self.out, at_step)

    def wait(self) -> None:
        """Until the checkpoint being written (if any) is on disk."""
        self.writer.wait()

    def step_dir(self, step: int) -> str:
        return sharded.step_dir(self.out, step)


def _training_shards(gpt, opt, run, grid, tp_group) -> dict:
    """The training-state tensors this rank writes.  With a pipeline grid, a stage's tensors are
    written by the stage's ranks (its tensor x data-parallel ranks), each an even share, under the
    whole model's names; the tied table once, by the first stage."""
    if grid is None:
        return train_state.training_shards(gpt, opt, run.rank, run.world, tp_group)
    writer = (grid.dp_rank * grid.cp + grid.cp_rank) * grid.tp + grid.tp_rank
    shards = train_state.training_shards(gpt, opt, writer, grid.dp * grid.cp * grid.tp, tp_group)
    return {k: v for k, v in shards.items() if gpt.owns(_param_of(k))}


def _param_of(key: str) -> str:
    """The parameter a checkpoint tensor belongs to: ``model.<name>`` or ``optim.<moment>.<name>``."""
    return key.split(".", 1)[1] if key.startswith("model.") else key.split(".", 2)[2]


def _latest_checkpoint(run_dir: str, say):
    """The newest complete sharded checkpoint; a newer unusable one is reported in one line
    through ``say`` (``quiet`` to ignore it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = sharded.latest_complete(run_dir)
    for w in caught:
        say(f"helios-train: warning: {w.message}", file=sys.stderr)
    return found
