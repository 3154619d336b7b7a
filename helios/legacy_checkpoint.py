"""Single-file training checkpoints (``RUN_DIR/ckpt.helios``): the format of earlier Helios
versions, still read by ``helios-train --resume``; new runs write sharded checkpoints
(``helios.schedule.checkpoint``).

A checkpoint holds the model parameters, the optimizer moments, the RNG state, the
data loader position, the step and the run's configuration.  It is written through
``helios.fileio.save_checkpoint`` (temp file, fsync, rename; SHA-256 over the payload),
so a crash never leaves a torn file and a corrupt one raises ``CheckpointError``.
"""

from __future__ import annotations

import os

from helios import random as hrandom
from helios.errors import CheckpointError
from helios.fileio import load_checkpoint

CKPT_NAME = "ckpt.helios"


def checkpoint_path(run_dir: str) -> str:
    return os.path.join(run_dir, CKPT_NAME)


def has_checkpoint(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a checkpoint to resume from."""
    return os.path.exists(checkpoint_path(run_dir))


def load_training_state(run_dir: str, model, optimizer, loader) -> dict:
    """Restore a run from its single-file checkpoint; returns its meta (with ``step``).

    The file (``helios.fileio`` container) holds ``model.<parameter name>`` and
    ``optim.<group>.<index in group>.exp_avg`` / ``.exp_avg_sq`` arrays, and meta with the
    run's config, ``step``, ``optimizer`` (step, groups), ``rng`` and ``loader``."""
    path = checkpoint_path(run_dir)
    if not os.path.exists(path):
        raise CheckpointError(f"--resume: no checkpoint at {path}; start without --resume or point --out at an earlier run")
    arrays, meta = load_checkpoint(path)
    model.load_state_dict({k[len("model."):]: v for k, v in arrays.items() if k.startswith("model.")})
    optimizer.load_state_dict({"step": meta["optimizer"]["step"], "groups": meta["optimizer"]["groups"],
                               "state": {k[len("optim."):]: v for k, v in arrays.items() if k.startswith("optim.")}})
    hrandom.set_rng_state(meta["rng"])
    loader.load_state_dict(meta["loader"])
    return meta

