"""``helios-run``: start N ranks of a script on this host and watch them.

::

    helios-run --nproc-per-node 4 train.py --lr 3e-4
    helios-run --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr node01 --master-port 29500 train.py

Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ``HELIOS_JOB_ID``, ``HELIOS_LAUNCHER=1``,
``HELIOS_RESTART_COUNT`` (0 on the first run) and ``HELIOS_MAX_RESTARTS``.  Every line a
rank prints is prefixed with ``[rank R]``.  SIGINT, SIGTERM and SIGHUP are forwarded to
every rank.  When a rank fails, the others get SIGTERM, then SIGKILL after ``--grace``
seconds (the process groups of every rank, so what a rank started goes too), the
shared-memory segments the ranks left are removed, and helios-run exits with the failed
rank's exit code (128 + signal number when a signal killed it), after naming the rank and
what ended it.

``--max-restarts K``: instead of exiting, start the whole job again (on one host with a
fresh ``MASTER_PORT``), at most K times, with ``HELIOS_RESTART_COUNT`` counting the
restarts so the program can resume from its checkpoint.  A signal sent to helios-run
(Ctrl-C, SIGTERM, SIGHUP) is forwarded and never leads to a restart.

Across hosts (``--nnodes > 1``, torchrun's flags and spellings) the helios-run of every node
meet through node 0's (``comm/node_rendezvous.py``): they start each attempt together, a
failure on any node stops the ranks of every node, and restarts happen on all nodes at once.
The job's secret must then come from ``HELIOS_JOB_SECRET`` or ``HELIOS_JOB_SECRET_FILE``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from helios.comm import auth
from helios.comm.node_rendezvous import NodeRendezvous, RendezvousError

from helios.errors import CommError


def free_port(host: str = "") -> int:
    """A TCP port the OS says is free on ``host`` ("" = every interface) right now."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _nnodes(text: str) -> int | None:
    """``--nnodes``: ``N``, or torchrun's ``MIN:MAX`` with MIN == MAX (None when the two differ)."""
    lo, _, hi = text.partition(":")
    n = int(lo)
    return n if not hi or int(hi) == n else None


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
    # torchrun's spellings (--nproc_per_node, --node_rank, ...) are accepted beside helios-run's own.
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, required=True,
                   help="ranks to start on this host")
    p.add_argument("--nnodes", type=_nnodes, default=1, help="hosts in the job, N or torchrun's N:N (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="index of this host, 0..nnodes-1")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node 0 (default 127.0.0.1 on one host)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="store port on node 0 (default: a free port on one host, 29500 across hosts, where it is "
                        "the port of the nodes' rendezvous)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="when a rank fails, stop the job and start it again up to this many times (default 0); "
                        "the ranks see HELIOS_RESTART_COUNT (0 on the first run) and resume from their checkpoint")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="across hosts: seconds to wait for every node's helios-run to join a round (default 600)")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("script", help="the Python script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    a = p.parse_args(argv)
    if a.nnodes is None:
        p.error("--nnodes takes N or N:N (helios-run does not grow or shrink a job between attempts)")
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        p.error("need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    if a.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if a.nnodes > 1 and not a.master_addr:
        p.error("--master-addr is required with --nnodes > 1 (the address of node 0)")
    return a


def _launch(a: argparse.Namespace, world: int, addr: str, port: int, job: str, attempt: int, shm_prefix: str,
            lock: threading.Lock) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    """Start this host's ranks (attempt ``attempt`` of the job) and the threads that prefix their output."""
    target = ["-m", a.script] if a.module else [a.script]
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for local in range(a.nproc_per_node):
        rank = a.node_rank * a.nproc_per_node + local
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank), NODE_RANK=str(a.node_rank),
                   MASTER_ADDR=addr,
                   MASTER_PORT=str(port), HELIOS_JOB_ID=job, HELIOS_LAUNCHER="1", PYTHONUNBUFFERED="1",
                   HELIOS_RESTART_COUNT=str(attempt), HELIOS_MAX_RESTARTS=str(a.max_restarts),
                   HELIOS_SHM_PREFIX=shm_prefix)
        # One BLAS/OpenMP thread per rank unless the user chose (torchrun does the same for OpenMP): a
        # rank's numpy work is host-side bookkeeping, and each rank's pool of BLAS threads only spins
        # on cores the ranks already share (a nano helios-train rank: 0.91 -> 0.77 CPU-s).
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            env.setdefault(var, "1")
        # Own session per rank: a terminal's Ctrl-C reaches helios-run once, which forwards it
        # once, and killing a rank's process group also ends what that rank started.
        p = subprocess.Popen([sys.executable, *target, *a.args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[rank {rank}] ".encode(), lock), daemon=True)
            t.start()
            pumps.append(t)
    return procs, pumps


def main(argv: list[str] | None = None) -> int:
    """Entry point of helios-run; returns (and exits with) the job's exit status."""
    a = parse_args(argv)
    world = a.nproc_per_node * a.nnodes
    addr = a.master_addr or "127.0.0.1"
    first_port = a.master_port if a.master_port is not None else (29500 if a.nnodes > 1 else free_port())
    job = os.environ.get("HELIOS_JOB_ID") or os.environ.get("SLURM_JOB_ID") or (
        secrets.token_hex(4) if a.nnodes == 1 else f"{addr}:{first_port}")
    if a.nnodes == 1 and not (os.environ.get("HELIOS_JOB_SECRET") or os.environ.get("HELIOS_JOB_SECRET_FILE")):
        # Only this job's ranks may use its store and TCP links (comm/auth.py); the ranks inherit
        # it.  Across hosts every node needs the same one, so there it comes from the user.
        os.environ["HELIOS_JOB_SECRET"] = secrets.token_hex(16)
    lock = threading.Lock()
    received: list[int] = []
    procs: list[subprocess.Popen] = []  # the running attempt's ranks (the signal handler reads it)

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        _signal_groups(procs, signum, running_only=True)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)

    nodes = None
    if a.nnodes > 1:
        try:
            nodes = NodeRendezvous(addr, first_port, a.nnodes, a.node_rank, job,
                                   {"nproc_per_node": a.nproc_per_node, "max_restarts": a.max_restarts},
                                   a.join_timeout, lambda: _rank_store_port(addr), lambda: bool(received),
                                   _shared_secret())
        except RendezvousError as e:
            sys.stderr.write(f"{e}\n")
            return 128 + received[0] if received else 1
    try:
        return _attempts(a, world, addr, first_port, job, nodes, procs, received, lock)
    finally:
        if nodes is not None:
            nodes.close()


@dataclass
class Failure:
    """Why an attempt ended: a rank of this node (``rank``, its exit ``code``) or another node's report."""

    what: str
    code: int
    rank: int | None = None


def _attempts(a: argparse.Namespace, world: int, addr: str, first_port: int, job: str, nodes: NodeRendezvous | None,
              procs: list[subprocess.Popen], received: list[int], lock: threading.Lock) -> int:
    """Run the job, restarting it after a failure up to ``--max-restarts`` times; the exit status."""
    cancelled = lambda: bool(received)
    attempt = 0
    while True:
        if received:  # a signal came while the job was being torn down for a restart, or while joining
            if nodes is not None:
                try:
                    _tell_nodes(nodes, attempt, None, received)
                except RendezvousError:
                    pass  # node 0 is gone: nobody is left to tell
            sys.stderr.write(f"helios-run: got {signal.Signals(received[0]).name}; not restarting the job.\n")
            return 128 + received[0]
        shm_prefix = secrets.token_hex(4)  # names this attempt's shared-memory segments
        try:
            if nodes is not None:  # every node's helios-run meets on node 0, which names the ranks' port
                port = nodes.join(attempt, cancelled)
                if port is None:
                    continue
            else:  # a relaunch on one host takes a fresh store port: the old one may linger in TIME_WAIT
                port = first_port if attempt == 0 or a.master_port is not None else free_port()
            started, pumps = _launch(a, world, addr, port, job, attempt, shm_prefix, lock)
            procs[:] = started
            if received:  # a signal that came while the ranks were starting
                _signal_groups(procs, received[0], running_only=True)
            failed = _watch(procs, a, received, nodes, attempt)
        except RendezvousError as e:
            _stop(procs, a.grace, every_group=True)
            _remove_segments([p.pid for p in procs], shm_prefix)
            sys.stderr.write(f"{e}\n")
            return 1
        if failed is not None or received:
            # Whatever the ranks left behind: processes they started, segments they never unlinked.
            if received:
                _stop(procs, a.grace, every_group=True)
            _remove_segments([p.pid for p in procs], shm_prefix)
        _reap(procs)
        for t in pumps:
            t.join(timeout=10.0)  # the last lines a rank printed before it exited (a loaded machine is slow)
        try:
            failed = _tell_nodes(nodes, attempt, failed, received)
        except RendezvousError as e:
            sys.stderr.write(f"{e}\n")
            return 1
        if failed is None:
            return 128 + received[0] if received else 0
        stopped = nodes.stopped() if nodes is not None else None
        if received or attempt >= a.max_restarts or stopped:
            where = "the other ranks" if nodes is None else ("this node's ranks" if failed.rank is None else
                                                             "the job on every node")
            sys.stderr.write(f"helios-run: {failed.what}; stopped {where}.\n")
            sys.stderr.flush()
            return failed.code
        attempt += 1
        sys.stderr.write(f"helios-run: {failed.what}; restarting the job (restart {attempt} of {a.max_restarts})\n")
        sys.stderr.flush()


def _tell_nodes(nodes: NodeRendezvous | None, attempt: int, failed: Failure | None,
                received: list[int]) -> Failure | None:
    """Across hosts: report this node's failure, or wait for the other nodes to end the attempt too.

    Returns the attempt's failure as this node sees it (another node's when only that one failed)."""
    if nodes is None:
        return failed
    if received:  # stopped by a signal: the job ends on every node, none restarts it
        nodes.report_failure(attempt, f"node {nodes.node}'s helios-run got {signal.Signals(received[0]).name}",
                             final=True)
        return failed
    if failed is not None:  # reported by _watch the moment it was seen
        return failed
    why = nodes.finish(attempt, lambda: bool(received))
    return Failure(why, 1) if why else None


def _shared_secret() -> bytes:
    """The secret every node of a multi-node job holds: HELIOS_JOB_SECRET or HELIOS_JOB_SECRET_FILE.

    One helios-run cannot make it up for the others, so a multi-node launch without one stops."""
    try:
        secret = auth.job_secret()
    except CommError as e:
        raise RendezvousError(f"helios-run: {str(e).removeprefix('helios.comm: ')}") from None
    if not secret:
        raise RendezvousError(f"helios-run: a job over several nodes needs one secret on every node: {auth.HOW_TO_SET}.")
    return secret


def _rank_store_port(addr: str) -> int:
    """Node 0: a free port for the ranks' store on the master address (any interface if it is not ours)."""
    try:
        return free_port(addr)
    except OSError:
        return free_port()


def _watch(procs: list[subprocess.Popen], a: argparse.Namespace, received: list[int],
           nodes: NodeRendezvous | None = None, attempt: int = 0) -> Failure | None:
    """Wait for every rank to end; on the first failure (not caused by a forwarded signal) stop the others.

    Across hosts (``nodes``) a failure here is reported to every node at once, and a failure
    another node reported stops this node's ranks too.  Returns the failure that ended the
    attempt, or None.
    """
    failed: Failure | None = None
    next_look = 0.0
    while True:
        codes = [exit_status(p) for p in procs]
        if failed is None and not received:
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # Several seen at once: a rank killed by a signal is more likely the cause than
                # ranks that exited with an error (a CommError) because of it.
                i, c = min(bad, key=lambda ic: (ic[1] > 0, ic[0]))
                rank = a.node_rank * a.nproc_per_node + i
                where = f", node {a.node_rank} ({socket.gethostname()})" if a.nnodes > 1 else ""
                failed = Failure(f"rank {rank} (pid {procs[i].pid}{where}) {_describe(c)}", c if c > 0 else 128 - c,
                                 rank)
                if nodes is not None:
                    # A rank that failed on another node first is the cause: every node names that one.
                    first = nodes.report_failure(attempt, failed.what)
                    if first != failed.what:
                        failed = Failure(first, failed.code, rank)
            elif nodes is not None and time.monotonic() >= next_look and any(c is None for c in codes):
                next_look = time.monotonic() + 0.25
                what = nodes.failure(attempt)
                if what is not None:
                    failed = Failure(what, 1)
            if failed is not None:
                _stop(procs, a.grace, every_group=True)
                continue
        if all(c is not None for c in codes):
            return failed
        time.sleep(0.05)


def exit_status(p: subprocess.Popen) -> int | None:
    """A rank's exit code (minus the signal that killed it), or None while it runs, without
    reaping it (any child started in a session of its own: tests/launchers.py's daemons too).

    Until it is reaped an exited rank stays a zombie that holds its pid, which is its process
    group's id, so no other process can be given that number while helios-run may still signal
    the group (what the rank started).  A rank reaped first, and its number then reused by a
    new group (a shell's job, another job's rank), would get the signals meant for this job's.
    """
    if p.returncode is not None:
        return p.returncode
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (by Popen, a moment ago): not running, whatever its code
        code = p.poll()
        return 0 if code is None else code
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _reap(procs: list[subprocess.Popen]) -> None:
    """Reap the ranks once nothing will signal their groups any more (they have all exited)."""
    for p in procs:
        p.wait()


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, process group) of process ``pid`` from /proc; None where it is
    gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    state, ppid, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]  # the name may hold spaces and ")"
    return state.decode(), int(ppid), int(pgrp)


def _groups_alive(pgids: list[int]) -> bool:
    """Whether a live process is still in any of the process groups ``pgids`` (a rank's zombie
    leader is not one); /proc is read once for all of them."""
    candidates = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            return True
        candidates.add(pgid)
    if not candidates:
        return False
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:  # no /proc: the groups exist, count them alive
        return True
    for pid in pids:
        st = proc_stat(pid)
        if st is not None and st[2] in candidates and st[0] != "Z":
            return True
    return False


def _signal_groups(procs: list[subprocess.Popen], sig: int, running_only: bool = False) -> None:
    """Send ``sig`` to the process group of every rank (only of the ranks still running with ``running_only``).

    A rank's group is its own session (pgid = its pid), so this reaches what the rank started
    too, even after the rank itself has exited (not reaped yet: :func:`exit_status`).
    """
    for p in procs:
        if p.returncode is not None or (running_only and exit_status(p) is not None):
            continue  # reaped: its number may be another process's now
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(procs: list[subprocess.Popen], grace: float, every_group: bool = False) -> None:
    """SIGTERM every running rank's group, give them ``grace`` seconds, then SIGKILL, and reap.

    ``every_group``: also the groups of ranks that already exited (what they started), and wait
    (a few seconds at most) until every group is empty, so nothing outlives the job.  The ranks
    are reaped last, so each group's id stays this job's until then.
    """
    _signal_groups(procs, signal.SIGTERM, running_only=not every_group)

    def busy() -> bool:
        running = [exit_status(p) is None for p in procs]
        return any(running) or (every_group and _groups_alive([p.pid for p in procs]))

    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and busy():
        time.sleep(0.05)
    _signal_groups(procs, signal.SIGKILL, running_only=not every_group)
    while any(exit_status(p) is None for p in procs):  # SIGKILL: a moment
        time.sleep(0.01)
    if every_group:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _groups_alive([p.pid for p in procs]):
            time.sleep(0.02)
    _reap(procs)


def _remove_segments(pids: list[int], prefix: str) -> None:
    """Unlink the shared-memory segments that an attempt's ranks (all dead now) left in /dev/shm.

    A rank unlinks its segment's name once every peer has mapped it; one killed before that
    leaves the name behind.  This attempt's segments are those named with ``prefix`` (the
    ``HELIOS_SHM_PREFIX`` its ranks got) or whose header holds one of ``pids``.
    """
    from helios.comm import shm

    start, job_start = shm.name_prefix(), shm.name_prefix(prefix)
    mine = set(pids)
    try:
        names = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(start)]
    except OSError:
        return
    for n in names:
        path = os.path.join(shm.SHM_DIR, n)
        ours = n.startswith(job_start)
        if not ours:
            try:
                with open(path, "rb") as f:
                    head = f.read(16)
            except OSError:
                continue
            ours = len(head) == 16 and struct.unpack("<QQ", head) in {(shm.MAGIC, pid) for pid in mine}
        if ours:
            try:
                os.unlink(path)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
