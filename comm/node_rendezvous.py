"""How the helios-run of each node of a multi-node job meets the others (``--nnodes > 1``).

Node 0's helios-run hosts a small store (``comm/store.py``) on ``--master-addr:--master-port``;
every node's helios-run connects to it.  The job runs in rounds, one per attempt (round 0,
then one per restart):

* **join**: each node adds itself to round ``k``; node 0 picks the port the ranks' own store
  will listen on (a free one, so a restarted job never waits on a port in TIME_WAIT) and
  publishes it; when the last node has joined, every node starts its ranks with that
  ``MASTER_PORT``.  The first round also checks that every node was given the same
  ``--nproc-per-node`` and ``--max-restarts`` and that no two nodes claim one node rank.
* **run**: a node whose rank fails reports it (the first report of a round wins and says
  which rank on which node ended how); the other nodes see the report on their next look
  (a few times a second), stop their ranks and join round ``k + 1`` (or, with no restarts
  left, exit naming the failure), as torchrun's elastic agent does through its rendezvous.
* **finish**: a node whose ranks all exited 0 says so and waits until every node has (the
  job succeeded) or one reported a failure (then it restarts with the others).

Losing node 0's helios-run ends the job (it holds the store); the others say so in one line.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

from helios.comm.store import TCPStore

from helios.errors import CommError

POLL_TIMEOUT = 15.0  # seconds one store call may take before node 0 counts as lost
LEAVE_WAIT = 5.0  # seconds node 0 keeps the store up for the others to read how the job ended


class RendezvousError(Exception):
    """A multi-node launch cannot go on; ``str()`` is the one line to print."""


class NodeRendezvous:
    """This node's side of the rounds of a multi-node job (see the module doc)."""

    def __init__(self, addr: str, port: int, nnodes: int, node_rank: int, job: str, conf: dict,
                 join_timeout: float, pick_port: Callable[[], int], cancelled: Callable[[], bool],
                 secret: bytes) -> None:
        self.addr, self.port, self.nnodes, self.node = addr, port, nnodes, node_rank
        self.join_timeout, self.pick_port, self.conf = join_timeout, pick_port, conf
        if node_rank != 0:
            _await_listener(addr, port, join_timeout, cancelled)
        try:
            self.store = TCPStore(addr, port, nnodes, is_server=node_rank == 0, timeout=join_timeout,
                                  job_id=f"{job}/nodes", secret=secret)
        except CommError as e:
            where = (f"cannot host the nodes' rendezvous on port {port}" if node_rank == 0 else
                     f"cannot meet node 0's helios-run at {addr}:{port}")
            raise RendezvousError(f"helios-run: node {node_rank} {where} (--master-addr/--master-port, --nnodes "
                                  f"{nnodes}): {_short(e)}") from None
        self.store.timeout = POLL_TIMEOUT  # every later call: node 0 answers in milliseconds or is gone

    # ---- store calls, every failure one line ---------------------------------------------------
    def _call(self, fn: Callable, *args):
        try:
            return fn(*args)
        except CommError as e:
            raise RendezvousError(f"helios-run: lost node 0's helios-run at {self.addr}:{self.port} "
                                  f"({_short(e)}); this node's ranks are stopped.") from None

    def _wait_count(self, key: str, want: int, cancelled: Callable[[], bool], what: str,
                    fail_key: str | None = None) -> bool:
        """Wait until counter ``key`` reaches ``want`` (True) or ``fail_key`` is non-zero (False).

        Raises RendezvousError after the join timeout; returns False at once when ``cancelled()``."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            if self._call(self.store.add, key, 0) >= want:
                return True
            if fail_key is not None and self._call(self.store.add, fail_key, 0) > 0:
                return False
            why = self.stopped()
            if why is not None:
                raise RendezvousError(f"helios-run: the job was stopped: {why}.")
            if cancelled():
                return False
            if time.monotonic() > deadline:
                raise RendezvousError(f"helios-run: {what} within {self.join_timeout:.0f} s (--join-timeout); "
                                      "is helios-run running on every node with the same --master-addr/--master-port?")
            time.sleep(0.1 if self.nnodes <= 8 else 0.3)

    # ---- the rounds --------------------------------------------------------------------------
    def join(self, k: int, cancelled: Callable[[], bool]) -> int | None:
        """Join round ``k``; once every node has, the ranks' ``MASTER_PORT`` (None when cancelled)."""
        s = self.store
        if k == 0:
            self._check_conf()
        if self._call(s.add, f"r{k}/node{self.node}", 1) != 1:
            self._refuse(f"two nodes joined as --node-rank {self.node}; give each node its own --node-rank in "
                         f"0..{self.nnodes - 1}")
        if self.node == 0:
            self._call(s.set, f"r{k}/port", str(self.pick_port()).encode())
        self._call(s.add, f"r{k}/joined", 1)
        if not self._wait_count(f"r{k}/joined", self.nnodes, cancelled,
                                f"not every one of the {self.nnodes} nodes joined (round {k})"):
            return None
        return int(self._call(s.get, f"r{k}/port", POLL_TIMEOUT))

    def _check_conf(self) -> None:
        """Every node must run the job the same way (its ranks' numbers depend on it)."""
        mine = json.dumps(self.conf, sort_keys=True).encode()
        self._call(self.store.set, f"conf/{self.node}", mine)
        ref = self._call(self.store.get, "conf/0", self.join_timeout) if self.node else mine
        if ref != mine:
            theirs, ours = json.loads(ref), self.conf
            diff = ", ".join(f"--{k.replace('_', '-')} {ours[k]} on node {self.node}, {theirs.get(k)} on node 0"
                             for k in sorted(ours) if theirs.get(k) != ours[k])
            self._refuse(f"the nodes were started differently: {diff}; give every node the same")

    def _refuse(self, why: str) -> None:
        """A launch mistake: stop the job on every node (none waits for this one), and say why here."""
        self._call(self.store.set, "stop", why.encode())
        raise RendezvousError(f"helios-run: {why}.")

    def failure(self, k: int) -> str | None:
        """What another node reported failed in round ``k``, or None (one look, no wait)."""
        if self._call(self.store.add, f"r{k}/failed", 0) == 0:
            return None
        return self._call(self.store.get, f"r{k}/why", POLL_TIMEOUT).decode()

    def report_failure(self, k: int, what: str, final: bool = False) -> str:
        """Tell every node that round ``k`` failed; the report kept for the round (the first one made).

        ``final``: the job must not be restarted (a signal stopped this node's helios-run)."""
        if final:
            self._call(self.store.set, "stop", what.encode())
        if self._call(self.store.add, f"r{k}/failed", 1) == 1:
            self._call(self.store.set, f"r{k}/why", what.encode())
            return what
        return self._call(self.store.get, f"r{k}/why", POLL_TIMEOUT).decode()

    def stopped(self) -> str | None:
        """Why the job may not be restarted (a node's helios-run was stopped by a signal), or None."""
        if not self._call(self.store.check, "stop"):
            return None
        return self._call(self.store.get, "stop", POLL_TIMEOUT).decode()

    def finish(self, k: int, cancelled: Callable[[], bool]) -> str | None:
        """This node's ranks all succeeded: wait for the others; a failure one of them reported, else None."""
        self._call(self.store.add, f"r{k}/done", 1)
        if self._wait_count(f"r{k}/done", self.nnodes, cancelled, f"not every node finished round {k}",
                            fail_key=f"r{k}/failed"):
            return None
        return None if cancelled() else self.failure(k)

    def close(self) -> None:
        """Leave; node 0 keeps the store up until the others have left (or a few seconds have passed)."""
        try:
            if self.node == 0:
                end = time.monotonic() + LEAVE_WAIT
                while time.monotonic() < end and self.store.add("left", 0) < self.nnodes - 1:
                    time.sleep(0.05)
            else:
                self.store.add("left", 1)
        except CommError:
            pass  # node 0 is gone already: nothing to tell
        self.store.close()


def _await_listener(addr: str, port: int, timeout: float, cancelled: Callable[[], bool]) -> None:
    """Wait (a signal to helios-run ends the wait) until something listens on ``addr:port``.

    Node 0's helios-run may start after the others; the store client's own retries cannot
    be interrupted, so they only begin once node 0 is there."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not cancelled():
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise RendezvousError(f"helios-run: nothing answered at {addr}:{port} within {timeout:.0f} s "
                                      f"(--join-timeout): is node 0's helios-run running with --master-addr {addr} "
                                      f"--master-port {port}? ({e.strerror or e})") from None
        time.sleep(delay)
        delay = min(2 * delay, 1.0)
    raise RendezvousError("helios-run: stopped while waiting for node 0's helios-run.")


def _short(e: Exception) -> str:
    return str(e).removeprefix("helios.comm: ").split(". ")[0]
