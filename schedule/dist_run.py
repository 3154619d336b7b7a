"""What helios-train needs to run as one of N data-parallel ranks.

``DistRun.from_env()`` joins the job when a launcher started this process (helios-run,
Slurm, Open MPI: anything that sets a world size above one, or ``HELIOS_LAUNCHER``), and
is a one-rank stand-in otherwise, so the trainer has one code path.  It holds the rank
and world size and the few collective steps the trainer takes besides the gradients':
checking that every rank runs the same settings, slicing each global batch, agreeing on
when to stop, and gathering each step's timing to rank 0.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")

@dataclass
class DistRun:
    """This process's place in the job (rank 0 of 1 when not launched as several ranks)."""

    rank: int = 0
    world: int = 1
    active: bool = False  # a process group exists
    data_rank: int = -1  # this rank's data-parallel replica (the rank, unless model parallel splits it)
    data_world: int = -1  # data-parallel replicas (the world size, unless model parallel splits it)

    def __post_init__(self) -> None:
        if self.data_rank < 0:
            self.data_rank, self.data_world = self.rank, self.world

    def use_data_parallel_coords(self, data_rank: int, data_world: int) -> None:
        """Slice batches by data-parallel replica: tensor-parallel peers read the same rows."""
        self.data_rank, self.data_world = data_rank, data_world

    @staticmethod
    def launch_world() -> int:
        """The world size the launcher set (1 without one), read before any rank connects, so a
        setting that cannot work is refused by every rank alike instead of by rank 0 alone."""
        from helios.comm import env as envmod

        if not any(os.environ.get(k) for k in _LAUNCH_VARS):
            return 1
        return envmod.resolve().world_size

    @classmethod
    def from_env(cls, timeout: float = 300.0) -> DistRun:
        """Join the job the environment describes, or stand alone when there is none."""
        from helios.comm import env as envmod

        launched = os.environ.get("HELIOS_LAUNCHER") == "1"
        if not any(os.environ.get(k) for k in _LAUNCH_VARS):
            return cls()  # a plain single-process run
        cfg = envmod.resolve()  # a CommError names what is inconsistent
        if cfg.world_size <= 1 and not launched:
            return cls()
        import helios.comm as dist

        dist.init_process_group(timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), True)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, samples and writes the run database."""
        return self.rank == 0

    def check_same(self, settings: dict) -> None:
        """Stop every rank with one clear line when the ranks were started with different settings."""
        if not self.active:
            return
        from helios.schedule.ddp import check_same_on_all_ranks

        text = json.dumps(settings, sort_keys=True, default=str)
        try:
            check_same_on_all_ranks(text, "settings (--config, --seed, sizes, data, --zero, ...)")
        except ValueError as e:
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            raise SystemExit(f"helios-train: rank {self.rank}: {e} This rank's settings hash {digest}: {text}") from None

    def shard(self, x: np.ndarray) -> np.ndarray:
        """This replica's contiguous slice of a global batch (rows), in the order one rank would see them."""
        per = x.shape[0] // self.data_world
        return x[self.data_rank * per:(self.data_rank + 1) * per]

    def agree(self, loss: float, stop: bool) -> tuple[float, bool]:
        """The mean of the ranks' losses (of equal slices: the global batch's loss) and whether any rank stops."""
        if not self.active:
            return loss, stop
        import helios.comm as dist

        a = np.array([loss, 1.0 if stop else 0.0], np.float64)
        dist.all_reduce(a)
        return float(a[0] / self.world), bool(a[1] > 0)

    def gather_step(self, values: dict[str, float]) -> np.ndarray:
        """Every rank's ``values`` (the same keys, in the same order, on every rank) as a
        (world, len(values)) float64 array; only rank 0 uses it."""
        mine = np.array([float(v) for v in values.values()], np.float64)
        if not self.active:
            return mine[None, :]
        import helios.comm as dist

        out = np.empty(self.world * mine.size, np.float64)
        dist.all_gather(out, mine)
        return out.reshape(self.world, mine.size)

    def comm_bytes(self) -> tuple[int, int]:
        """(bytes sent, operand bytes) of this rank's collectives so far, over every group it is in
        (0, 0 alone)."""
        if not self.active:
            return 0, 0
        import helios.comm as dist

        c = dist.comm_counters("all")
        return c["bytes_sent"], sum(c["payload_bytes"].values())

    def all_mean(self, value: float, count: float = 1.0) -> float:
        """The mean over ranks of a sum ``value`` of ``count`` items (a validation loss)."""
        if not self.active:
            return value / count
        import helios.comm as dist

        a = np.array([value, count], np.float64)
        dist.all_reduce(a)
        return float(a[0] / a[1])

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Rank 0 gets every rank's ``data`` (a trace); the others get None."""
        if not self.active:
            return [data]
        import helios.comm as dist

        sizes = np.empty(self.world, np.int64)
        dist.all_gather(sizes, np.array([len(data)], np.int64))
        cap = int(sizes.max())
        mine = np.zeros(cap, np.uint8)
        mine[:len(data)] = np.frombuffer(data, np.uint8)
        every = np.empty(cap * self.world, np.uint8)
        dist.all_gather(every, mine)
        if not self.is_main:
            return None
        return [bytes(every[r * cap: r * cap + int(sizes[r])]) for r in range(self.world)]

    def barrier(self) -> None:
        """Wait for every rank (no-op alone)."""
        if self.active:
            import helios.comm as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if self.active:
            import helios.comm as dist

            dist.destroy_process_group()
            self.active = False


def merge_rank_traces(traces: list[dict]) -> dict:
    """One Chrome trace from each rank's: rank r's processes get ids 100 r + their own and
    names that start with the rank, and flow-event ids are made unique per rank."""
    events = []
    for r, tr in enumerate(traces):
        for ev in tr.get("traceEvents", []):
            ev = dict(ev)
            ev["pid"] = 100 * r + int(ev.get("pid", 0))
            if "id" in ev:
                ev["id"] = f"r{r}.{ev['id']}"
            if ev.get("ph") == "M" and ev.get("name") == "process_sort_index":
                ev["args"] = {"sort_index": 100 * r + int(ev["args"].get("sort_index", 0))}
            events.append(ev)
    merged = {k: v for k, v in traces[0].items() if k != "traceEvents"}
    merged["traceEvents"] = events
    return merged
