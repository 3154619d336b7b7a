"""Real launchers for tests: a throwaway Slurm cluster, srun, sbatch and mpirun.

``slurm_cluster_session`` (the body of a module-scoped fixture) starts munged,
slurmctld and slurmd in a temporary directory and stops them afterwards.  The daemons use
their own munge key and socket, free ports and a configuration free of cgroups
(``proctrack/linuxproc``, ``task/none``), so the cluster runs as root in a container as well
as on a plain host, next to any Slurm or munge already installed, and leaves nothing behind.
``start_slurm(hosts=...)`` makes the nodes fake hosts (tests/cluster_fixture.py) instead: one
slurmd in each host, named by the host's name with its own address, slurmctld and the client
commands on the first.

``run_srun``, ``run_sbatch`` and ``run_mpirun`` run any command (``[sys.executable, "-m",
"helios.train", ...]``) as N tasks and return a :class:`LaunchResult` that holds each task's
stdout and stderr.  The children get a clean launch environment (no ``RANK``, ``SLURM_*`` or
``OMPI_*`` from the caller), ``LP_NUM_THREADS=1`` and unbuffered Python output.  Every run
has a deadline; whatever a run started is killed afterwards, found by a token in its
environment, so no task outlives its test.  ``run_mpirun(where=host.argv([]))`` starts mpirun
inside a fake host.

The packages come from ``scripts/setup.sh --test`` (Debian: slurmd, slurmctld,
slurm-client, munge, openmpi-bin).  When a program is missing the tests fail, naming it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pytest

from helios.comm.launcher import exit_status, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN_VAR = "HELIOS_LAUNCH_TOKEN"  # marks what one run started
CLUSTER_VAR = "HELIOS_SLURM_TOKEN"  # marks what anything started on one test cluster
_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
_PACKAGES = {"munged": "munge", "munge": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "mpirun": "openmpi-bin",
             **{c: "slurm-client" for c in ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")}}
# Launch variables of an outer job that must not leak into the tasks we start.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "HELIOS_JOB_ID", "HELIOS_LAUNCHER", "HELIOS_RESTART_COUNT", "HELIOS_MAX_RESTARTS", "HELIOS_SHM_PREFIX",
                TOKEN_VAR, CLUSTER_VAR)
_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                 "OUT_OF_MEMORY"}
_LAUNCH_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_", "PMIX_", "PMI_", "PRTE_")


def tool(name: str) -> str:
    """Absolute path of a launcher program; fails the test (naming the package) when it is missing."""
    path = shutil.which(name, path=_SBIN_PATH)
    if path is None:
        pytest.fail(f"`{name}` is not installed (Debian package {_PACKAGES.get(name, name)}); "
                    "run ./scripts/setup.sh --test, which installs what the launcher tests need.", pytrace=False)
    return path


def missing(*names: str) -> str | None:
    """None when every program is installed, else a skip reason naming the first that is not."""
    for name in names:
        if shutil.which(name, path=_SBIN_PATH) is None:
            return f"`{name}` is not installed (Debian package {_PACKAGES.get(name, name)}; ./scripts/setup.sh --test)"
    return None


SLURM_PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel", "scontrol")


class LaunchResult(subprocess.CompletedProcess):
    """A finished launch: the launcher's command line, exit code and output, plus each task's.

    ``stdout`` / ``stderr`` are the launcher's own (for sbatch, ``stdout`` is the job's
    output file); ``task_stdout[r]`` / ``task_stderr[r]`` are those of task ``r``.
    ``timed_out`` is true when the deadline passed and the run was killed."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, task_stdout: list[str],
                 task_stderr: list[str], job_id: str | None = None, timed_out: bool = False,
                 seconds: float = 0.0) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.task_stdout = task_stdout
        self.task_stderr = task_stderr
        self.job_id = job_id
        self.timed_out = timed_out
        self.seconds = seconds

    def describe(self, tail: int = 3000) -> str:
        """Everything a failure report needs: command, exit code, launcher and task output."""
        what = "timed out" if self.timed_out else f"exit code {self.returncode}"
        parts = [f"$ {shlex.join(self.args)}\n{what} after {self.seconds:.1f} s"
                 + (f" (job {self.job_id})" if self.job_id else ""),
                 f"--- launcher stdout\n{self.stdout[-tail:]}", f"--- launcher stderr\n{self.stderr[-tail:]}"]
        for r, (o, e) in enumerate(zip(self.task_stdout, self.task_stderr)):
            parts.append(f"--- task {r} stdout\n{o[-tail:]}\n--- task {r} stderr\n{e[-tail:]}")
        return "\n".join(parts)

    def check(self) -> LaunchResult:
        """Raise AssertionError with :meth:`describe` unless the launch exited 0 in time."""
        if self.timed_out or self.returncode != 0:
            raise AssertionError(self.describe())
        return self


@dataclass
class SlurmCluster:
    """A running Slurm cluster (see :func:`start_slurm`): ``node`` is the first of ``nodes``;
    ``login`` prefixes the client commands (a fake host's nsenter line; empty: here)."""

    root: str
    conf: str
    node: str
    cpus: int
    user: str
    token: str
    partition: str = "debug"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    login: list[str] = field(default_factory=list)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm commands against this cluster (``SLURM_CONF`` set; jobs inherit the
        cluster's token, by which :meth:`stop` finds whatever they left)."""
        e = clean_env(extra)
        e.update(SLURM_CONF=self.conf, **{CLUSTER_VAR: self.token})
        return e

    def logs(self, lines: int = 30) -> str:
        """The last lines of every daemon's log."""
        out = []
        logdir = os.path.join(self.root, "log")
        for name in sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []:
            with open(os.path.join(logdir, name), errors="replace") as f:
                text = f.read().splitlines()[-lines:]
            out.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(out)

    def command(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sinfo``, ``squeue``, ...) against this cluster."""
        return subprocess.run([*self.login, tool(argv[0]), *argv[1:]], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def node_state(self) -> str:
        """The nodes' states as sinfo gives them (``idle``; one word per node, by name, for several)."""
        try:
            r = self.command("sinfo", "-h", "-N", "-n", ",".join(self.nodes or [self.node]), "-o", "%t", timeout=10)
        except subprocess.TimeoutExpired:
            return "(sinfo timed out)"
        return " ".join(r.stdout.split()) if r.returncode == 0 else f"(sinfo failed: {r.stderr.strip()})"

    def idle(self) -> bool:
        """True once every node is idle."""
        return self.node_state().split() == ["idle"] * len(self.nodes or [self.node])

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL) and kill anything left."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.command("scancel", f"--user={self.user}", timeout=10)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and self.command("squeue", "-h", timeout=10).stdout.strip():
                    time.sleep(0.2)
        daemons = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in daemons:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for name in daemons:
            p = self.procs.get(name)
            if p is None:
                continue
            # Wait without reaping: while the daemon is unreaped its pid, its group's id, is still
            # its own, so the SIGKILL below cannot reach a group that got the number since.
            while exit_status(p) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the daemon and anything left in its process group
            p.wait()
        kill_tagged(self.token, CLUSTER_VAR)
        kill_using(self.root)  # slurmstepd rewrites its environment (process title) but keeps slurmd's log open


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any outer job's launch variables, plus ``extra``."""
    e = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    e.update(LP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra or {})
    return e


def kill_tagged(token: str, var: str = TOKEN_VAR) -> list[int]:
    """SIGKILL every process (other than this one) whose environment holds ``var=token``."""
    needle = f"{var}={token}".encode()
    killed = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue
    return killed


def kill_using(root: str) -> list[int]:
    """SIGKILL every process (other than this one) whose working directory or an open file lies under ``root``."""
    root = os.path.realpath(root) + os.sep
    killed = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == os.getpid():
            continue
        try:
            links = [os.readlink(f"/proc/{pid}/cwd")]
            links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any((link + os.sep).startswith(root) for link in links):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def _port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _first_job_id() -> int:
    """A first job id whose default rendezvous ports (15000 + last four digits) are free for a while."""
    for _ in range(50):
        base = secrets.randbelow(8000) + 1000
        if all(_port_free(15000 + base + i) for i in range(0, 40, 3)):
            return base
    return secrets.randbelow(8000) + 1000


def _node_name() -> str:
    """This host's short name when it resolves (Slurm's node list then names a reachable host), else localhost."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def _wait_for(cond, timeout: float, cluster: SlurmCluster, what) -> None:
    """Poll ``cond`` until true; raise with ``what()`` and the logs when a daemon dies or time runs out."""
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [f"{n} exited with code {p.returncode}" for n, p in cluster.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = "; ".join(dead) if dead else f"not within {timeout:.0f} s"
            raise RuntimeError(f"Slurm test cluster: {what()}: {why}.\n{cluster.logs()}")
        time.sleep(0.1)


def _spawn(cluster: SlurmCluster, name: str, argv: list[str], env: dict[str, str]) -> None:
    log = open(os.path.join(cluster.root, "log", f"{name}.out"), "w")
    try:
        cluster.procs[name] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def _slurm_root(root: str | None) -> str:
    """The cluster's directory, made (a new temporary one when ``root`` is None) with its subdirectories."""
    if root is None:
        # Short paths: slurmd puts Unix sockets in its spool directory (108-byte limit).
        base = tempfile.gettempdir()
        root = tempfile.mkdtemp(prefix="helios-slurm-", dir=base if len(base) < 40 else "/tmp")
    os.chmod(root, 0o755)  # munged wants the socket's directory searchable by all, writable by its owner only
    for d in ("log", "state", "spool", "run", "munge", "jobs"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "munge"), 0o700)
    os.chmod(os.path.join(root, "jobs"), 0o1777)
    return root


def _munge_key(root: str) -> str:
    """A fresh munge key under ``root`` (mode 0400, owned by this user, who runs the daemons)."""
    key = os.path.join(root, "munge", "munge.key")
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    return key


def _slurm_conf(root: str, user: str, sock: str, controller: tuple[str, str], nodes: Sequence[tuple[str, str]],
                cpus: int) -> str:
    """slurm.conf of a test cluster: slurmctld on ``controller`` (name, address), one
    ``NodeName=name NodeAddr=address`` line per node, everything else under ``root``."""
    ctld_port, slurmd_port = free_port(), free_port()
    while slurmd_port == ctld_port:
        slurmd_port = free_port()
    node_lines = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in nodes)
    return f"""\
ClusterName=helios-test
SlurmctldHost={controller[0]}({controller[1]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS={root}/jobs
# No cgroups anywhere: processes tracked through /proc, no task binding, no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobContainerType=job_container/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
FirstJobId={_first_job_id()}
KillWait=2
InactiveLimit=0
MinJobAge=300
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def start_slurm(root: str | None = None, timeout: float = 60.0, hosts: Sequence | None = None) -> SlurmCluster:
    """Start munged, slurmctld and slurmd; return once every node is idle.

    Without ``hosts`` this host is the one node.  With ``hosts`` (fake hosts of
    tests/cluster_fixture.py) each is a node: ``NodeName`` its name, ``NodeAddr`` its address,
    one slurmd inside it; slurmctld runs on the first host and so do the client commands
    (srun, sinfo, ...: the root namespace cannot reach the hosts); munged runs here, its
    socket reached through the shared filesystem.  Everything lives under ``root`` (a new
    temporary directory by default): the munge key (mode 0400, owned by the user the daemons
    run as, i.e. this one), munge's socket, the configuration, state, spool, pid and log files.
    Raises RuntimeError with the daemons' logs when the nodes are not idle within ``timeout``
    seconds (after stopping what started)."""
    for name in SLURM_PROGRAMS:
        tool(name)
    made_root = root is None
    root = _slurm_root(root)
    cpus = len(os.sched_getaffinity(0))
    if hosts:
        nodes = [(h.name, h.addr) for h in hosts]
        controller, places, login = nodes[0], [h.argv([]) for h in hosts], hosts[0].argv([])
    else:
        # slurmctld only runs where SlurmctldHost names this host.
        nodes = [(_node_name(), "127.0.0.1")]
        controller, places, login = (socket.gethostname().split(".")[0], "127.0.0.1"), [[]], []
    cluster = SlurmCluster(root=root, conf=os.path.join(root, "slurm.conf"), node=nodes[0][0], cpus=cpus,
                           user=pwd.getpwuid(os.getuid()).pw_name, token=secrets.token_hex(8),
                           nodes=[n for n, _ in nodes], login=login)
    key, sock = _munge_key(root), os.path.join(root, "munge.sock")
    with open(cluster.conf, "w") as f:
        f.write(_slurm_conf(root, cluster.user, sock, controller, nodes, cpus))
    if hosts:
        # slurmd 22.05 initialises a cgroup plugin even with proctrack/linuxproc and task/none, and
        # its autodetection finds nothing on /sys/fs/cgroup in a host (/sys there is the network
        # namespace's sysfs): naming the v1 plugin skips the detection.
        with open(os.path.join(root, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
    for n, _ in nodes:
        os.makedirs(os.path.join(root, "spool", n), exist_ok=True)  # slurmd's Unix sockets go there
    env = cluster.env()
    try:
        _spawn(cluster, "munged", [tool("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                                   f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
                                   f"--seed-file={root}/munge/munged.seed"], env)
        _wait_for(lambda: os.path.exists(sock), 10, cluster, lambda: "munged did not create its socket")
        _spawn(cluster, "slurmctld", [*login, tool("slurmctld"), "-D", "-i", "-f", cluster.conf], env)
        for (n, _), place in zip(nodes, places):
            _spawn(cluster, f"slurmd-{n}", [*place, tool("slurmd"), "-D", "-N", n, "-f", cluster.conf], env)
        _wait_for(cluster.idle, timeout, cluster,
                  lambda: f"nodes {','.join(cluster.nodes)} did not become idle (sinfo says {cluster.node_state()!r})")
    except BaseException:
        cluster.stop()
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
        raise
    return cluster


@contextlib.contextmanager
def slurm_cluster_running(timeout: float = 60.0, hosts: Sequence | None = None) -> Iterator[SlurmCluster]:
    """Context manager: a started cluster (on fake ``hosts`` if given, see :func:`start_slurm`),
    stopped and its directory removed on exit."""
    cluster = start_slurm(timeout=timeout, hosts=hosts)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def slurm_cluster_session(timeout: float = 60.0) -> Iterator[SlurmCluster]:
    """Body of a Slurm cluster fixture: start (failing the test with the daemons' logs when the
    node does not come up), yield the cluster, stop it and remove its directory::

        @pytest.fixture(scope="module")
        def cluster():
            yield from slurm_cluster_session()
    """
    try:
        cluster = start_slurm(timeout=timeout)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


# ---------------------------------------------------------------- runs


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _run(cmd: list[str], env: dict[str, str], timeout: float, cwd: str,
         on_timeout=None) -> tuple[int, str, str, bool, float]:
    """Run a launcher in its own session with a deadline; on timeout stop it and its tasks."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        if on_timeout is not None:
            with contextlib.suppress(Exception):
                on_timeout()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
    finally:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        kill_tagged(env[TOKEN_VAR])
    return p.returncode, out, err, timed_out, time.monotonic() - t0


def _run_dir(parent: str | None) -> str:
    d = tempfile.mkdtemp(prefix="run-", dir=parent)
    os.chmod(d, 0o755)
    return d


def _tasks(directory: str, ntasks: int) -> tuple[list[str], list[str]]:
    return ([_read(os.path.join(directory, f"task-{r}.out")) for r in range(ntasks)],
            [_read(os.path.join(directory, f"task-{r}.err")) for r in range(ntasks)])


def run_srun(cluster: SlurmCluster, ntasks: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
             timeout: float = 120.0, cwd: str | None = None, srun_args: Sequence[str] = ()) -> LaunchResult:
    """``srun --ntasks N argv...`` on ``cluster``; each task's stdout/stderr go to their own file.

    ``cwd`` defaults to a fresh directory of this run (not the checkout, whose ``profile/``
    would shadow the standard library for ``python -m``).  ``env`` is added to the clean
    launch environment; srun passes it all to the tasks."""
    run = _run_dir(os.path.join(cluster.root, "jobs"))
    token = secrets.token_hex(8)
    name = f"helios-{token}"
    e = cluster.env({**(env or {}), TOKEN_VAR: token})
    cmd = [*cluster.login, tool("srun"), f"--ntasks={ntasks}", f"--job-name={name}", f"--output={run}/task-%t.out",
           f"--error={run}/task-%t.err", "--kill-on-bad-exit=1", f"--time={max(1, int(timeout // 60) + 1)}",
           *(["--overcommit"] if ntasks > cluster.cpus else []), *srun_args, "--", *argv]
    code, out, err, timed_out, secs = _run(cmd, e, timeout, cwd or run,
                                           on_timeout=lambda: cluster.command("scancel", f"--name={name}"))
    task_out, task_err = _tasks(run, ntasks)
    return LaunchResult(cmd, code, out, err, task_out, task_err, None, timed_out, secs)


def run_sbatch(cluster: SlurmCluster, ntasks: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float = 120.0, cwd: str | None = None, sbatch_args: Sequence[str] = (),
               srun_args: Sequence[str] = ()) -> LaunchResult:
    """Submit a batch job of ``ntasks`` tasks whose script runs ``srun argv...``; wait for it to end.

    The job script (``job.sh`` in the run's directory) carries its options as ``#SBATCH``
    lines; ``stdout`` of the result is the job's output file, ``job_id`` its id, and the
    exit code is the job's (as ``sbatch --wait`` gives it; 128 + signal when one ended it)."""
    run = _run_dir(os.path.join(cluster.root, "jobs"))
    token = secrets.token_hex(8)
    name = f"helios-{token}"
    over = ntasks > cluster.cpus
    lines = ["#!/bin/sh", f"#SBATCH --job-name={name}", f"#SBATCH --ntasks={ntasks}",
             f"#SBATCH --output={run}/job.out", f"#SBATCH --error={run}/job.err",
             f"#SBATCH --time={max(1, int(timeout // 60) + 1)}", *(["#SBATCH --overcommit"] if over else []),
             'echo "batch job $SLURM_JOB_ID: $SLURM_NTASKS tasks on $SLURM_JOB_NODELIST"',
             shlex.join(["srun", f"--output={run}/task-%t.out", f"--error={run}/task-%t.err", "--kill-on-bad-exit=1",
                         *(["--overcommit"] if over else []), *srun_args, "--", *argv])]
    script = os.path.join(run, "job.sh")
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")
    e = cluster.env({**(env or {}), TOKEN_VAR: token})
    cmd = [*cluster.login, tool("sbatch"), "--parsable", f"--chdir={cwd or run}", *sbatch_args, script]
    t0 = time.monotonic()
    sub = subprocess.run(cmd, env=e, cwd=cwd or run, capture_output=True, text=True, timeout=30,
                         stdin=subprocess.DEVNULL)
    job_id = sub.stdout.strip().split(";")[0] or None
    if sub.returncode != 0 or not job_id:
        return LaunchResult(cmd, sub.returncode or 1, sub.stdout, sub.stderr, [""] * ntasks, [""] * ntasks,
                            None, False, time.monotonic() - t0)
    # Poll the job (sbatch --wait backs off to seconds between looks); exit code as sbatch --wait gives it.
    code, state, timed_out = None, "", False
    try:
        while code is None:
            info = cluster.command("scontrol", "-o", "show", "job", job_id).stdout
            fields = dict(kv.split("=", 1) for kv in info.split() if "=" in kv)
            state = fields.get("JobState", "")
            if state in _FINAL_STATES:
                status, _, sig = fields.get("ExitCode", "1:0").partition(":")
                code = 128 + int(sig) if sig.isdigit() and int(sig) else int(status or 1)
                if code == 0 and state != "COMPLETED":
                    code = 1
            elif time.monotonic() - t0 > timeout:
                timed_out, code = True, -signal.SIGKILL
            else:
                time.sleep(0.1)
    finally:
        if timed_out or code is None:
            cluster.command("scancel", job_id)
        kill_tagged(token)
    task_out, task_err = _tasks(run, ntasks)
    return LaunchResult(cmd, code, _read(os.path.join(run, "job.out")),
                        sub.stderr + (f"job {job_id} ended {state}\n" if state else "") + _read(os.path.join(run, "job.err")),
                        task_out, task_err, job_id, timed_out, time.monotonic() - t0)


def run_mpirun(ntasks: int, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120.0,
               cwd: str | None = None, master_port: int | None = None, mpirun_args: Sequence[str] = (),
               where: Sequence[str] = ()) -> LaunchResult:
    """``mpirun -n N argv...`` (Open MPI) on this host, with rank 0's address given as Helios expects.

    Sets ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port unless given) and exports
    them and every variable of ``env`` with ``-x``; runs as root with ``--allow-run-as-root``;
    ``--oversubscribe`` so N may exceed the cores.  Each rank's output is read from
    ``--output-filename`` (a directory every host must see: here, a shared filesystem).
    ``where`` prefixes mpirun (a fake host's ``host.argv([])``: mpirun runs inside that host;
    give the other hosts and the launch agent in ``mpirun_args``)."""
    run = _run_dir(None)
    try:
        token = secrets.token_hex(8)
        extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port or free_port()), **(env or {}),
                 TOKEN_VAR: token}
        e = clean_env(extra)
        exported = sorted({*extra, "LP_NUM_THREADS", "PYTHONUNBUFFERED"})
        outdir = os.path.join(run, "output")
        cmd = [*where, tool("mpirun"), "-n", str(ntasks), "--oversubscribe", "--bind-to", "none", "--output-filename", outdir,
               *(["--allow-run-as-root"] if os.getuid() == 0 else []),
               *[a for k in exported for a in ("-x", k)], *mpirun_args, *argv]
        code, out, err, timed_out, secs = _run(cmd, e, timeout, cwd or run)
        task_out, task_err = [""] * ntasks, [""] * ntasks
        for dirpath, _, files in os.walk(outdir):  # Open MPI 4: <outdir>/1/rank.<r>/stdout (r may be zero-padded)
            leaf = os.path.basename(dirpath)
            if leaf.startswith("rank.") and leaf[5:].isdigit() and int(leaf[5:]) < ntasks:
                r = int(leaf[5:])
                task_out[r] = _read(os.path.join(dirpath, "stdout")) if "stdout" in files else ""
                task_err[r] = _read(os.path.join(dirpath, "stderr")) if "stderr" in files else ""
        return LaunchResult(cmd, code, out, err, task_out, task_err, None, timed_out, secs)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def python_argv(*args: str) -> list[str]:
    """``[sys.executable, *args]``: this interpreter (the virtual environment's) as the task."""
    return [sys.executable, *args]
