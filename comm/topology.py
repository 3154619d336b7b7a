"""Which ranks share a host, found by fact: the ranks that can open each other's shared memory.

A hostname and a boot id do not say it: two containers on one machine have the same boot id
and may have the same hostname, yet separate ``/dev/shm`` mounts, and then the shared-memory
transport cannot connect them.  So, as NCCL checks its host hash *and* ``/dev/shm``, every
rank creates a small named segment holding a random nonce (``/dev/shm/helios-<uid>-<token>-probe``),
publishes its name and nonce through the store, and tries to open every peer's: two ranks are
on one host when each can open the other's segment and read the nonce it published.  Ranks
where shared memory is unusable (no writable ``/dev/shm``) fall back to ``(hostname, boot id)``.

Hosts are numbered (node rank) by their lowest global rank; inside a host, ranks are numbered
(local rank) in global-rank order.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from helios.comm import shm as shmmod

NONCE_BYTES = 16


@dataclass(frozen=True)
class Topology:
    """The hosts of a job as seen from one rank.

    ``hosts[k]`` lists the global ranks on host (node) ``k``, ascending; hosts are ordered by
    their first rank.  ``node_of[r]`` is the node rank of global rank ``r``.
    """

    rank: int
    hosts: tuple[tuple[int, ...], ...]
    node_of: tuple[int, ...]
    by_probe: bool  # whether the shared-memory probe decided (False: hostname + boot id)

    @property
    def nnodes(self) -> int:
        """Number of hosts."""
        return len(self.hosts)

    @property
    def node_rank(self) -> int:
        """This rank's host index."""
        return self.node_of[self.rank]

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Global ranks on this rank's host."""
        return self.hosts[self.node_rank]

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its host."""
        return self.local_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        """Number of ranks on this rank's host."""
        return len(self.local_ranks)

    @property
    def uniform(self) -> bool:
        """Whether every host has the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    def describe(self) -> str:
        """One line: ``2 hosts: [0, 1] [2, 3]``."""
        return f"{self.nnodes} host{'s' if self.nnodes != 1 else ''}: " + " ".join(str(list(h)) for h in self.hosts)


class Probe:
    """This rank's probe segment: created at once, unlinked by :meth:`close` (always call it)."""

    def __init__(self) -> None:
        self.path = ""
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        if shmmod.available() is not None:
            return
        path = os.path.join(shmmod.SHM_DIR, shmmod.name_prefix(shmmod.new_token()) + "-probe")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return
        try:
            os.write(fd, self.nonce)
        finally:
            os.close(fd)
        self.path = path

    def info(self) -> dict[str, Any]:
        """What the peers need to try it (goes into the rank's published info)."""
        return {"probe": os.path.basename(self.path), "nonce": self.nonce.hex()} if self.path else {"probe": ""}

    def close(self) -> None:
        """Unlink the segment (idempotent)."""
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = ""


def can_open(info: dict[str, Any]) -> bool:
    """Whether this process can open the probe described by a peer's ``info`` and read its nonce."""
    name = info.get("probe") or ""
    if not name or "/" in name:
        return False
    try:
        with open(os.path.join(shmmod.SHM_DIR, name), "rb") as f:
            return f.read(NONCE_BYTES + 1).hex() == info.get("nonce")
    except OSError:
        return False


def reach_of(rank: int, infos: list[dict[str, Any]]) -> list[int]:
    """The ranks whose probe this rank can open (itself included when it has one)."""
    return [r for r, i in enumerate(infos) if r == rank and i.get("probe") or r != rank and can_open(i)]


def build(rank: int, infos: list[dict[str, Any]], reach: list[list[int]]) -> Topology:
    """Group the ranks into hosts: ranks that can open each other's probe (both ways) share a host.

    ``reach[r]`` is what rank ``r`` reported from :func:`reach_of`.  A rank without a usable
    probe is grouped with the ranks of the same (hostname, boot id) that have none either.
    """
    n = len(infos)
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    sets = [set(r) for r in reach]
    probe_ok = [bool(i.get("probe")) and r in sets[r] for r, i in enumerate(infos)]
    for a in range(n):
        for b in range(a + 1, n):
            if probe_ok[a] and probe_ok[b]:
                same = b in sets[a] and a in sets[b]
            elif not probe_ok[a] and not probe_ok[b]:
                same = (infos[a].get("host"), infos[a].get("boot")) == (infos[b].get("host"), infos[b].get("boot"))
            else:
                same = False
            if same:
                parent[find(b)] = find(a)
    groups: dict[int, list[int]] = {}
    for r in range(n):
        groups.setdefault(find(r), []).append(r)
    hosts = tuple(sorted((tuple(sorted(g)) for g in groups.values()), key=lambda h: h[0]))
    node_of = [0] * n
    for k, h in enumerate(hosts):
        for r in h:
            node_of[r] = k
    return Topology(rank, hosts, tuple(node_of), all(probe_ok))


def discover(store, rank: int, world: int, infos: list[dict[str, Any]], timeout: float) -> Topology:
    """Exchange probe results through ``store`` (a PrefixStore of this init) and build the topology.

    Every rank must call it after publishing its info (with :meth:`Probe.info`); the caller
    unlinks its probe afterwards (every rank has finished probing once this returns).
    """
    mine = reach_of(rank, infos)
    store.set(f"reach/{rank}", json.dumps(mine).encode())
    reach = [json.loads(store.get(f"reach/{r}", timeout)) for r in range(world)]
    return build(rank, infos, reach)
