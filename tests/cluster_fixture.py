"""A fake cluster for tests: N "hosts" made of Linux namespaces (scripts/fake_cluster.sh).

Each host has its own network namespace (address ``10.77.0.(i+1)``), hostname (UTS
namespace), ``/dev/shm`` (a private tmpfs in its mount namespace) and ``/etc/hosts`` naming
every host of the cluster; the hosts' links go
through a bridge in a namespace of its own and may be shaped with ``tc ... tbf rate R``.
Commands run inside a host through ``nsenter`` on the host's holder process.

Use it as a context manager or through the ``fake_cluster`` pytest fixture (a factory)::

    from cluster_fixture import clusters
    fake_cluster = pytest.fixture(clusters, name="fake_cluster")

    def test_x(fake_cluster):
        c = fake_cluster(2, rate="200mbit")
        c.hosts[0].run(["hostname"])

Everything is torn down after the test, also when it fails (``down`` in a ``finally``).
Tests using it are skipped, with the reason, when not root or when ``ip netns`` is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "fake_cluster.sh")
PY = sys.executable


def unavailable() -> str | None:
    """None when fake clusters can be made here, else why not."""
    if os.geteuid() != 0:
        return "fake clusters need root (network namespaces, tmpfs mounts)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"fake clusters need `{tool}` (iproute2 / util-linux)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` is not available: {r.stderr.strip()}"
    return None


class Host:
    """One fake host: ``index``, ``addr``, ``name`` (its hostname, which every host resolves), the
    holder's ``pid``; run commands inside it."""

    def __init__(self, cluster: FakeCluster, index: int, pid: int, addr: str, name: str) -> None:
        self.cluster, self.index, self.pid, self.addr, self.name = cluster, index, pid, addr, name

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed to run in this host's network, UTS and mount namespaces."""
        return ["nsenter", "--target", str(self.pid), "--net", "--uts", "--mount", *cmd]

    def run(self, cmd: Sequence[str], timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside the host and wait (text output captured)."""
        r = subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"host {self.index}: {cmd} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return r

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` inside the host."""
        return subprocess.Popen(self.argv(cmd), **kw)

    def python(self, code: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run Python ``code`` inside the host (this interpreter)."""
        return self.run([PY, "-c", code], timeout=timeout, **kw)

    def tx_bytes(self, dev: str = "eth0") -> int:
        """Bytes this host has sent on ``dev`` (its link to the bridge)."""
        return int(self.run(["cat", f"/sys/class/net/{dev}/statistics/tx_bytes"]).stdout)

    def container(self) -> Container:
        """A "container" on this host: same network namespace and hostname, its own /dev/shm."""
        c = Container(self)
        self.cluster._containers.append(c)
        return c


class Container(Host):
    """A mount namespace with a private /dev/shm inside a host (same net and UTS namespaces)."""

    def __init__(self, host: Host) -> None:
        script = "mount -t tmpfs -o mode=1777,size=256m tmpfs /dev/shm && echo ok && exec sleep infinity"
        self.proc = subprocess.Popen(host.argv(["unshare", "--mount", "--propagation", "private", "sh", "-c", script]),
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ok":
            self.proc.kill()
            raise RuntimeError(f"container on host {host.index} did not start")
        # nsenter, unshare and sh each exec the next: the Popen's pid is the holder (sleep, in the end).
        pid = self.proc.pid
        super().__init__(host.cluster, host.index, pid, host.addr, host.name)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class FakeCluster:
    """``n`` hosts (``hosts[i]``), shaped at ``rate`` (a tc rate such as ``"200mbit"``) or not."""

    def __init__(self, n: int, rate: str | None = None, mtu: int = 1500, hostnames: Sequence[str] | None = None,
                 prefix: str | None = None) -> None:
        self.n, self.rate, self.mtu = n, rate, mtu
        self.prefix = prefix or "t" + secrets.token_hex(3)
        self.hostnames = list(hostnames) if hostnames else None
        self.hosts: list[Host] = []
        self._containers: list[Container] = []

    def __enter__(self) -> FakeCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def rsh_agent(self) -> str:
        """The command line of this cluster's ssh (``fake_cluster.sh rsh --prefix P``), for
        ``mpirun --mca plm_rsh_agent``: ``<agent> HOST CMD...`` runs CMD in the host named HOST."""
        return f"{SCRIPT} rsh --prefix {self.prefix}"

    def _script(self, *args: str, check: bool = True) -> str:
        r = subprocess.run([SCRIPT, *args, "--prefix", self.prefix], capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"fake_cluster.sh {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def up(self) -> None:
        args = ["up", str(self.n), "--mtu", str(self.mtu)]
        if self.rate:
            args += ["--rate", self.rate]
        if self.hostnames:
            args += ["--hostnames", ",".join(self.hostnames)]
        try:
            self._script(*args)
            d = f"/run/helios-fake-cluster/{self.prefix}"
            for i in range(self.n):
                with open(f"{d}/holder-{i}") as f:
                    pid = int(f.read())
                with open(f"{d}/addr-{i}") as f:
                    addr = f.read().strip()
                with open(f"{d}/name-{i}") as f:
                    name = f.read().strip()
                self.hosts.append(Host(self, i, pid, addr, name))
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Kill what runs in the hosts and remove every namespace (idempotent)."""
        for c in self._containers:
            c.close()
        self._containers = []
        self._script("down", check=False)
        self.hosts = []


def clusters() -> Iterator:
    """The body of the ``fake_cluster`` fixture (a test module says ``fake_cluster = pytest.fixture(clusters)``).

    Factory: ``fake_cluster(n, rate=None, mtu=1500, hostnames=None)`` -> an up FakeCluster; all torn down after."""
    why = unavailable()
    if why:
        pytest.skip(why)
    made: list[FakeCluster] = []

    def make(n: int, rate: str | None = None, mtu: int = 1500, hostnames: Sequence[str] | None = None) -> FakeCluster:
        c = FakeCluster(n, rate, mtu, hostnames)
        made.append(c)
        c.up()
        return c

    try:
        yield make
    finally:
        for c in made:
            c.down()
