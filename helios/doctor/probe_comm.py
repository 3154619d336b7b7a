"""The communication section: shared memory, ibverbs and RDMA devices, the launcher's environment, helios-run."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping

from .report import Section
from .util import human_bytes

SHM_DIR = "/dev/shm"
SHM_MIN = 1 << 30  # below 1 GiB (Docker's default is 64 MiB) the ring segments of a few ranks do not fit
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "HELIOS_LAUNCHER")


def shm_reason() -> str | None:
    """Why the shared-memory transport cannot run here, or None (:func:`helios.comm.shm.available`)."""
    from helios.comm import shm

    return shm.available()


def ibverbs_reason() -> str | None:
    """Why ibverbs cannot be used here, or None (:func:`helios.comm.ibverbs.available`)."""
    from helios.comm import ibverbs

    return ibverbs.available()


def rdma_devices(root: str | None = None) -> list[dict]:
    """RDMA devices as the kernel lists them (sysfs, ``root`` by default where the ibverbs transport
    looks: :data:`helios.comm.ibverbs.SYSFS_CLASSES`): name and each port's state, link layer and rate."""
    if root is None:
        from helios.comm import ibverbs

        root = ibverbs.SYSFS_CLASSES[0]
    out = []
    if not os.path.isdir(root):
        return out
    for dev in sorted(os.listdir(root)):
        ports = []
        pdir = os.path.join(root, dev, "ports")
        for p in sorted(os.listdir(pdir), key=lambda x: int(x) if x.isdigit() else 0) if os.path.isdir(pdir) else []:
            def read(f, p=p):
                try:
                    with open(os.path.join(pdir, p, f)) as fh:
                        return fh.read().strip()
                except OSError:
                    return ""
            # state reads "4: ACTIVE"; keep the word.
            ports.append({"port": int(p) if p.isdigit() else p, "state": read("state").partition(": ")[2] or read("state"),
                          "link_layer": read("link_layer"), "rate": read("rate")})
        out.append({"name": dev, "ports": ports})
    return out


def resolve_launch(env: Mapping[str, str]):
    """:func:`helios.comm.env.resolve` on ``env`` (raises CommError when the variables are inconsistent)."""
    from helios.comm import env as envmod

    return envmod.resolve(env)


def _launcher_env(env: Mapping[str, str], s: Section) -> None:
    present = {k: env[k] for k in LAUNCH_VARS if env.get(k) not in (None, "")}
    s.data["launch_env"] = present
    if not any(k in present for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE")):
        s.info("launcher environment", "none (a single process; helios-run, srun or mpirun set RANK/WORLD_SIZE for each rank)")
        return
    from helios.errors import HeliosError

    try:
        cfg = resolve_launch(env)
    except (HeliosError, ValueError) as e:
        s.data["launch"] = None
        msg = str(e).removeprefix("helios.comm: ")
        s.fail("launcher environment", msg, "unset the stale variables (env | grep -E 'RANK|WORLD|SLURM|OMPI') "
                                            "or start the ranks with helios-run")
        return
    s.data["launch"] = {"rank": cfg.rank, "world_size": cfg.world_size, "local_rank": cfg.local_rank,
                        "master": f"{cfg.master_addr}:{cfg.master_port}", "source": cfg.source}
    s.ok("launcher environment", f"rank {cfg.rank} of {cfg.world_size} (local {cfg.local_rank}) from {cfg.source}; "
                                 f"store at {cfg.master_addr}:{cfg.master_port}")


def probe(env: Mapping[str, str] | None = None, shm: Callable = shm_reason, ib: Callable = ibverbs_reason,
          rdma: Callable = rdma_devices) -> Section:
    """The communication section; ``shm``, ``ib`` and ``rdma`` are the probes (tests fake them)."""
    env = os.environ if env is None else env
    s = Section("comm", "Communication")

    why = shm()
    try:
        st = os.statvfs(SHM_DIR)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        size = free = None
    s.data["shm"] = {"path": SHM_DIR, "usable": why is None, "reason": why, "bytes": size, "free": free}
    if why is not None:
        s.fail("shared memory", why, "mount a writable tmpfs on /dev/shm (Docker: --shm-size=8g); "
                                     "ranks of one host fall back to TCP")
    elif size is not None and size < SHM_MIN:
        s.fail("shared memory", f"{SHM_DIR} holds only {human_bytes(size)}",
               "enlarge it (Docker: --shm-size=8g; else mount -o remount,size=8G /dev/shm)")
    else:
        s.ok("shared memory", f"{SHM_DIR}: {human_bytes(size)}, {human_bytes(free)} free (transport between ranks of one host)")

    why = ib()
    devs = rdma()
    s.data["ibverbs"] = {"usable": why is None, "reason": why, "devices": devs}
    if why is None:
        s.ok("ibverbs", "an RDMA device with an active port is usable")
    elif "not installed" in why and "cffi" in why:
        s.fail("ibverbs", why, "pip install 'helios[ibverbs]' (cffi)")
    elif "libibverbs" in why:
        s.fail("ibverbs", "libibverbs.so.1 cannot be loaded",
               "apt-get install libibverbs1 ibverbs-providers (RDMA between hosts; without it Helios uses TCP)")
    else:
        s.fail("ibverbs", why, "nothing to do unless the hosts have InfiniBand/RoCE NICs: between hosts Helios uses TCP")
    for d in devs:
        ports = ", ".join(f"port {p['port']} {p['state'] or '?'} {p['link_layer']} {p['rate']}".strip() for p in d["ports"])
        s.info(f"RDMA {d['name']}", ports or "no ports")

    from helios.comm.env import BACKENDS  # the names helios.comm accepts (imported here, as the probes above import comm)

    backend = env.get("HELIOS_COMM_BACKEND")
    if backend and backend not in BACKENDS:
        s.fail("HELIOS_COMM_BACKEND", f"{backend!r} is not one of {', '.join(BACKENDS)}",
               f"unset HELIOS_COMM_BACKEND or set it to {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}")
    elif backend:
        s.ok("HELIOS_COMM_BACKEND", backend)
    ifname = env.get("HELIOS_SOCKET_IFNAME")
    if ifname:
        from helios.comm.tcp import pick_address
        from helios.errors import CommError

        try:
            s.ok("HELIOS_SOCKET_IFNAME", f"{ifname} -> {pick_address(ifname, '127.0.0.1')}")
        except CommError as e:
            s.fail("HELIOS_SOCKET_IFNAME", str(e).removeprefix("helios.comm: "), "set it to an interface `ip -br addr` lists")

    _launcher_env(env, s)

    on_path = shutil.which("helios-run", path=env.get("PATH"))
    beside = os.path.join(os.path.dirname(sys.executable), "helios-run")
    s.data["helios_run"] = on_path or (beside if os.access(beside, os.X_OK) else None)
    if on_path:
        s.ok("helios-run", on_path)
    elif os.access(beside, os.X_OK):
        s.fail("helios-run", f"installed at {beside} but not on PATH",
               f"activate the environment (source {os.path.dirname(sys.executable)}/activate) or call it by its path")
    else:
        s.fail("helios-run", "not installed", "pip install -e . (installs helios-run with the package)")
    return s
