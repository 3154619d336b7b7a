"""Where a rank learns who it is: explicit variables, then Slurm, then Open MPI.

Sources, in order of precedence:

1. ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (set by
   ``helios-run`` or by hand);
2. Slurm: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` (or ``SLURM_STEP_NUM_TASKS``)
   and the first host of ``SLURM_NODELIST``; the port defaults to 15000 + the last four
   digits of ``SLURM_JOB_ID`` (the same rule as Lightning);
3. Open MPI: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``.

When a source's rank or world size disagrees with a higher one, the rank stops at once
with a message naming both (a mixed-up launch line otherwise hangs in rendezvous).  Under
``helios-run`` (``HELIOS_LAUNCHER=1``) the launcher's variables win and the scheduler's are
not compared, because there the scheduler counts launchers, not ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from helios.errors import CommError

DEFAULT_PORT = 29500
BACKENDS = ("auto", "shm", "tcp", "ibverbs")  # what HELIOS_COMM_BACKEND (and init_process_group's backend) may name


@dataclass(frozen=True)
class LaunchConfig:
    """Rank, world size, local rank and the store's address of this process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    job_id: str


def first_host(nodelist: str) -> str:
    """First host name of a Slurm node list (``node[01-04,07],gpu3`` -> ``node01``)."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise CommError(f"helios.comm: cannot parse SLURM_NODELIST={nodelist!r}; set MASTER_ADDR explicitly.")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int(env: Mapping[str, str], key: str) -> int | None:
    val = env.get(key)
    if val is None or val == "":
        return None
    try:
        return int(val)
    except ValueError:
        raise CommError(f"helios.comm: {key}={val!r} is not an integer; fix the launch environment.") from None


def resolve(env: Mapping[str, str] | None = None) -> LaunchConfig:
    """Resolve this process's :class:`LaunchConfig` from the environment (see module doc)."""
    env = os.environ if env is None else env
    explicit = (_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"))
    ntasks = _int(env, "SLURM_NTASKS")
    if ntasks is None:
        ntasks = _int(env, "SLURM_STEP_NUM_TASKS")
    slurm = (_int(env, "SLURM_PROCID"), ntasks, _int(env, "SLURM_LOCALID"))
    ompi = (_int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"))
    sources = [("RANK/WORLD_SIZE", explicit), ("Slurm (SLURM_PROCID/SLURM_NTASKS)", slurm),
               ("Open MPI (OMPI_COMM_WORLD_RANK/SIZE)", ompi)]
    present = [(name, v) for name, v in sources if v[0] is not None and v[1] is not None]
    if not present:
        if explicit[0] is not None or explicit[1] is not None:
            raise CommError("helios.comm: RANK and WORLD_SIZE must be set together; one of them is missing.")
        raise CommError(
            "helios.comm: no launch environment found: expected RANK and WORLD_SIZE (helios-run sets them), "
            "or Slurm's SLURM_PROCID/SLURM_NTASKS, or Open MPI's OMPI_COMM_WORLD_RANK/SIZE. "
            "Start the script with `helios-run --nproc-per-node N script.py`."
        )
    name, (rank, world, local) = present[0]
    if env.get("HELIOS_LAUNCHER") != "1":
        for other, (orank, oworld, _) in present[1:]:
            if orank != rank or oworld != world:
                raise CommError(
                    f"helios.comm: launch variables disagree: {name} says rank {rank} of {world}, "
                    f"{other} says rank {orank} of {oworld}. Unset one set of variables, or start the "
                    "ranks with helios-run."
                )
    if not 0 <= rank < world:
        raise CommError(f"helios.comm: rank {rank} is outside world size {world} (from {name}).")
    local = 0 if local is None else local
    addr = env.get("MASTER_ADDR")
    if not addr:
        if name.startswith("Slurm") and env.get("SLURM_NODELIST"):
            addr = first_host(env["SLURM_NODELIST"])
        elif world == 1:
            addr = "127.0.0.1"
        else:
            raise CommError(
                f"helios.comm: MASTER_ADDR is not set and {name} names no host for rank 0; "
                "export MASTER_ADDR (the address of rank 0's host)."
            )
    port = _int(env, "MASTER_PORT")
    if port is None:
        job = env.get("SLURM_JOB_ID", "")
        port = 15000 + int(job[-4:]) if name.startswith("Slurm") and job[-4:].isdigit() else DEFAULT_PORT
    job_id = env.get("HELIOS_JOB_ID") or env.get("SLURM_JOB_ID") or env.get("OMPI_MCA_ess_base_jobid") or ""
    return LaunchConfig(rank, world, local, addr, port, name, job_id)
