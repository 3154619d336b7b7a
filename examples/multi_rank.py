"""Data-parallel training on 2 ranks: each rank trains a replica on its slice of every global batch.

    .venv/bin/helios-run --nproc-per-node 2 examples/multi_rank.py      # the launcher starts 2 ranks
    .venv/bin/python examples/multi_rank.py                             # the same: it calls helios-run itself
    srun -n 2 python examples/multi_rank.py                             # or Slurm / mpirun: the ranks read their variables

``helios.comm.init_process_group()`` reads the rank and world size the launcher set;
``DistributedDataParallel`` broadcasts rank 0's weights, then averages gradients in buckets
while backward runs, so every replica takes the same optimizer step.  The ranks see the
data one rank would see, and train the same model.  helios-train does this (and ZeRO,
tensor, pipeline, context and expert parallelism) from flags: docs/distributed.md.
"""

import argparse
import os
import sys

import numpy as np

LAUNCHED = any(v in os.environ for v in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="global batch: split over the ranks")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not started by a launcher")
    args = p.parse_args()
    if not LAUNCHED:  # started by hand: start the job through helios-run
        from helios.comm.launcher import main as helios_run

        return helios_run(["--nproc-per-node", str(args.nproc), os.path.abspath(__file__), *sys.argv[1:]])

    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.schedule import DistributedDataParallel as DDP

    dist.init_process_group()  # RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks")
    T, local = 32, args.batch_size // world
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32)
    model = DDP(GPT(cfg, seed=0))  # checks every rank built the same parameters, broadcasts rank 0's
    opt = hl.optim.AdamW(model.module.parameters(), lr=1e-2)  # after the wrap, as in PyTorch

    rng = np.random.default_rng(0)  # the same seed on every rank: every rank draws the same global batch
    for step in range(1, args.steps + 1):
        start, stride = rng.integers(0, 64, (args.batch_size, 1)), rng.integers(1, 4, (args.batch_size, 1))
        seq = (start + stride * np.arange(T + 1)) % 64
        mine = slice(rank * local, (rank + 1) * local)  # this rank's contiguous slice
        x, y = hl.tensor(seq[mine, :-1]), hl.tensor(seq[mine, 1:])
        _, loss = model(x, y)
        loss.backward()  # returns with gradients averaged over the ranks
        hl.nn.utils.clip_grad_norm_(model.module.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = np.array([loss.item()], np.float32)
        dist.all_reduce(mean, op="avg")  # the global batch's loss
        if rank == 0:
            print(f"step {step:3d}  loss {mean[0]:.4f}  ({world} ranks x {local} sequences)", flush=True)

    # Every replica holds the same weights: compare a checksum over the ranks.
    total = np.array([sum(float(np.abs(p.numpy()).sum()) for p in model.module.parameters())], np.float64)
    every = np.empty(world, np.float64)
    dist.all_gather(every, total)
    if rank == 0:
        print(f"parameter checksums per rank: {every.tolist()}")
        assert np.all(every == every[0]), "replicas diverged"
        print("replicas identical")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
