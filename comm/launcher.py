"""``helios-run``: start N ranks of a script on this host and watch them.

::

    helios-run --nproc-per-node 4 train.py --lr 3e-4
    helios-run --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr node01 --master-port 29500 train.py

Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ``HELIOS_JOB_ID`` and ``HELIOS_LAUNCHER=1``.  Every line a
rank prints is prefixed with ``[rank R]``.  SIGINT, SIGTERM and SIGHUP are forwarded to
every rank.  When a rank fails, the others get SIGTERM, then SIGKILL after ``--grace``
seconds, and helios-run exits with the failed rank's exit code (128 + signal number when
a signal killed it), after naming the rank and what ended it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port(host: str = "") -> int:
    """A TCP port the OS says is free on ``host`` ("" = every interface) right now."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of helios-run."""
    p = argparse.ArgumentParser(prog="helios-run", description="Start the ranks of a Helios job on this host.")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start on this host")
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="index of this host, 0..nnodes-1")
    p.add_argument("--master-addr", default=None, help="address of node 0 (default 127.0.0.1 on one host)")
    p.add_argument("--master-port", type=int, default=None,
                   help="store port on node 0 (default: a free port on one host, 29500 across hosts)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("script", help="the Python script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    a = p.parse_args(argv)
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        p.error("need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    if a.nnodes > 1 and not a.master_addr:
        p.error("--master-addr is required with --nnodes > 1 (the address of node 0)")
    return a


def main(argv: list[str] | None = None) -> int:
    """Entry point of helios-run; returns (and exits with) the job's exit status."""
    a = parse_args(argv)
    world = a.nproc_per_node * a.nnodes
    addr = a.master_addr or "127.0.0.1"
    port = a.master_port if a.master_port is not None else (29500 if a.nnodes > 1 else free_port())
    job = os.environ.get("HELIOS_JOB_ID") or os.environ.get("SLURM_JOB_ID") or (
        secrets.token_hex(4) if a.nnodes == 1 else f"{addr}:{port}")
    target = ["-m", a.script] if a.module else [a.script]
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for local in range(a.nproc_per_node):
        rank = a.node_rank * a.nproc_per_node + local
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank), MASTER_ADDR=addr,
                   MASTER_PORT=str(port), HELIOS_JOB_ID=job, HELIOS_LAUNCHER="1", PYTHONUNBUFFERED="1")
        # Own session per rank: a terminal's Ctrl-C reaches helios-run once, which forwards it
        # once, and killing a rank's process group also ends what that rank started.
        p = subprocess.Popen([sys.executable, *target, *a.args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[rank {rank}] ".encode(), lock), daemon=True)
            t.start()
            pumps.append(t)

    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)

    failed: tuple[int, int] | None = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            for i, c in enumerate(codes):
                if c not in (None, 0) and not received:
                    failed = (a.node_rank * a.nproc_per_node + i, c)
                    break
            if failed is not None:
                _stop(procs, a.grace)
                continue
        if all(c is not None for c in codes):
            break
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=2.0)
    if failed is not None:
        rank, code = failed
        pid = procs[rank - a.node_rank * a.nproc_per_node].pid
        sys.stderr.write(f"helios-run: rank {rank} (pid {pid}) {_describe(code)}; stopped the other ranks.\n")
        sys.stderr.flush()
        return code if code > 0 else 128 - code
    if received:
        return 128 + received[0]
    return 0


def _signal_running(procs: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to the process group of every rank still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every running rank's group, give them ``grace`` seconds, then SIGKILL and reap."""
    _signal_running(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    _signal_running(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


if __name__ == "__main__":
    sys.exit(main())
