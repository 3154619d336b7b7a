"""Start N ranks of a Python program on this host for multi-rank tests (no launcher in between).

Each rank gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, a shared HELIOS_JOB_ID and
LP_NUM_THREADS=1 (several ranks on few cores oversubscribe lavapipe's threads).  Every
spawn has a hard deadline; on a failure or a timeout every rank still running is killed,
so a test never leaves processes behind.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from helios.comm.launcher import free_port, proc_stat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RankResult:
    rank: int
    code: int
    out: str
    err: str


def run_ranks(argv: list[str], world: int, timeout: float = 120.0, env: dict | None = None,
              cwd: str | None = None, argv_per_rank=None) -> list[RankResult]:
    """Run ``python argv...`` as ranks 0..world-1 and return each rank's exit code and output.

    ``argv_per_rank(rank, argv)``, when given, returns the arguments of one rank (to start
    ranks with different settings on purpose)."""
    port, job = free_port(), secrets.token_hex(4)
    procs = []
    files = []
    for r in range(world):
        e = _rank_env(r, world, port, job, env)
        fo = open(_tmp(job, r, "out"), "w+")
        fe = open(_tmp(job, r, "err"), "w+")
        files.append((fo, fe))
        args = argv_per_rank(r, list(argv)) if argv_per_rank else argv
        procs.append(subprocess.Popen([sys.executable, *args], env=e, stdout=fo, stderr=fe, cwd=cwd or ROOT,
                                      start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    results = []
    for r, (p, (fo, fe)) in enumerate(zip(procs, files)):
        fo.seek(0)
        fe.seek(0)
        results.append(RankResult(r, p.returncode, fo.read(), fe.read()))
        fo.close()
        fe.close()
        os.unlink(fo.name)
        os.unlink(fe.name)
    return results


def start_ranks(argv: list[str], world: int, env: dict | None = None, cwd: str | None = None) -> list[subprocess.Popen]:
    """Start ``python argv...`` as ranks 0..world-1 without waiting (stdout and stderr piped, as text)."""
    port, job = free_port(), secrets.token_hex(4)
    procs = []
    for r in range(world):
        e = _rank_env(r, world, port, job, env)
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=cwd or ROOT, start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process, waiting ``timeout`` seconds for them all;
    any still running then is killed (a test never leaves ranks behind)."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def sigterm_launcher_when_ready(script, cwd, marker: str, launcher_args: tuple = (), ranks: int = 2,
                                timeout: float = 30.0) -> tuple[int, str, str]:
    """Run ``script`` under helios-run, SIGTERM the launcher once ``ranks`` output lines hold
    ``marker``, and return (exit code, stdout, stderr)."""
    p = subprocess.Popen([sys.executable, "-m", "helios.comm.launcher", "--nproc-per-node", str(ranks),
                          *launcher_args, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=cwd)
    try:
        seen = 0
        while seen < ranks:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            seen += marker in line
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:  # say what every process of the job was doing
            raise AssertionError(f"helios-run still running {timeout} s after SIGTERM; its processes:\n"
                                 f"{process_states(p.pid)}\nstdout so far: {e.stdout!r}") from None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err


def process_states(root: int) -> str:
    """One line per process under ``root`` (itself, its children, and their process groups):
    pid, parent, process group, state, and its pending, blocked, ignored and caught signal masks,
    from /proc."""
    procs = {pid: st for pid in (int(n) for n in os.listdir("/proc") if n.isdigit())
             if (st := proc_stat(pid)) is not None}
    groups = {pid for pid, (_, ppid, _) in procs.items() if ppid == root}  # a launcher's ranks lead their groups
    lines = []
    for pid, (_, ppid, pgrp) in sorted(procs.items()):
        if pid != root and ppid != root and pgrp not in groups:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except OSError:
            continue
        masks = " ".join(f"{k}={status.get(k, '?')}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        lines.append(f"pid {pid} ppid {ppid} pgrp {pgrp} {status.get('State', '?')} {masks}")
    return "\n".join(lines)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process still running and reap them all."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _rank_env(rank: int, world: int, port: int, job: str, extra: dict | None) -> dict:
    """The environment of one rank: this process's, the launch variables, then ``extra``."""
    e = dict(os.environ)
    e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(port), HELIOS_JOB_ID=job, LP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra or {})
    return e


def _tmp(job: str, rank: int, kind: str) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"helios-test-{job}-r{rank}.{kind}")


def check_ok(results: list[RankResult]) -> None:
    """Assert every rank exited 0, showing every rank's output otherwise."""
    bad = [r for r in results if r.code != 0]
    if bad:
        text = "\n".join(f"--- rank {r.rank} exit {r.code}\n{r.out[-3000:]}\n{r.err[-3000:]}" for r in results)
        raise AssertionError(f"ranks {[r.rank for r in bad]} failed:\n{text}")


def shm_job() -> dict[str, str]:
    """Environment naming a job's shared-memory segments with a prefix of its own: ``shm_left(env)``
    then finds what the job left behind, whatever else runs on the machine (tests in parallel)."""
    return {"HELIOS_SHM_PREFIX": secrets.token_hex(4)}


def shm_left(job: dict[str, str] | str) -> list[str]:
    """The segments in /dev/shm of the job started with ``job`` (``shm_job()``'s env, or its prefix)."""
    from helios.comm import shm

    start = shm.name_prefix(job if isinstance(job, str) else job["HELIOS_SHM_PREFIX"])
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(start))
