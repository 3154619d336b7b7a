"""Hierarchical collectives across hosts: shared memory inside a host, TCP (or ibverbs) between.

For a job of ``h`` hosts with ``L`` ranks each (the topology of ``comm/topology.py``), the
world communicator gets two private communicators per rank:

* ``intra``: the ``L`` ranks of its host, over shared memory (the direct path);
* ``inter``: local rank ``j`` of every host (``h`` ranks, in node order), over the world's
  transport.  There are ``L`` of them, one per local rank, so every rank's socket carries
  its share and the host's link is used by all its ranks at once.

all_reduce of S bytes is intra-host reduce-scatter (local rank j holds chunk j, reduced over
the host) -> all-reduce of the S/L-byte chunk over ``inter`` (ring, tree or
halving-doubling, by the cost model) -> intra-host all-gather.  Each host sends 2(h-1)/h·S
bytes over its link, where the flat ring over all L·h ranks sends 2(n-1)/n·S.  A large
all_reduce runs in pieces through the three levels at once (the link exchanges piece k on a
thread while shared memory reduces piece k+1 and gathers piece k-1), so the link does not
idle while the host's ranks reduce and gather.
reduce_scatter and all_gather are the same two halves with the chunks packed so that local
rank j's block holds the chunks of the ranks with local rank j; broadcast is an
intra-host broadcast on the root's host, a broadcast of chunk j over ``inter`` j, and an
intra-host all-gather.  Reductions run in a fixed order on every rank, so results are
deterministic from run to run (and exact for integers); ``avg`` sums at both levels and
divides once at the end.

The choice between this and the flat algorithms is the cost model's
(``cost.choose_multihost``), from the (alpha, beta) of each level measured when the process
group is created (``calibrate``), or forced: ``algorithm="hierarchical"`` or a flat one
(``"ring"``, ``"tree"``, ``"halving_doubling"``) per call, ``HELIOS_COMM_HIERARCHICAL=0|1``
for ``auto`` (default ``auto``: the model decides).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import numpy as np
from helios.comm import algorithms as A
from helios.comm import cost
from helios.comm import reduce_ops as R
from helios.comm.engine import Fault
from helios.comm.group import ProcessGroup
from helios.comm.topology import Topology

from helios.errors import CommError

INTER_RUN = {
    "ring": A.ring_all_reduce,
    "tree": A.tree_all_reduce,
    "halving_doubling": A.hd_all_reduce,
}


def wanted() -> str:
    """``HELIOS_COMM_HIERARCHICAL``: ``auto`` (default), ``1`` (always) or ``0`` (never) for algorithm="auto"."""
    v = os.environ.get("HELIOS_COMM_HIERARCHICAL", "auto").strip().lower()
    if v in ("1", "always", "true", "yes"):
        return "1"
    if v in ("0", "never", "false", "no"):
        return "0"
    return "auto"


def _pipelined(P: int, reduce_piece: Callable[[int], None], exchange_piece: Callable[[int], None],
               gather_piece: Callable[[int], None]) -> None:
    """Run P pieces through the three levels: this thread reduces pieces 0..P-1, then gathers
    each once its exchange is done; a thread exchanges each once it is reduced.

    Every rank of a host issues the intra-host operations in the same order, and every rank
    of an inter-host group its exchanges, whatever the timing (the order never depends on
    which piece is ready first).  A failure on either side ends both: the exchange thread
    stops before its next piece, and this thread waits for it (bounded by the operation's
    deadline) before raising the first error (an exchange's, when the host-mates then gave
    up on this rank's intra-host level because of it)."""
    reduced = [threading.Event() for _ in range(P)]
    exchanged = [threading.Event() for _ in range(P)]
    failed: list[BaseException] = []

    def exchanges() -> None:
        try:
            for k in range(P):
                reduced[k].wait()
                if failed:
                    return
                exchange_piece(k)
                exchanged[k].set()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread below
            failed.append(e)
        finally:
            for ev in exchanged:
                ev.set()

    t = threading.Thread(target=exchanges, name="helios-hier-exchange", daemon=True)
    t.start()
    try:
        for k in range(P):
            reduce_piece(k)
            reduced[k].set()
        for k in range(P):
            exchanged[k].wait()
            if failed:
                break
            gather_piece(k)
    except BaseException as e:  # noqa: BLE001 - re-raised once the exchange thread is done
        failed.append(e)  # after an exchange's error, if any: that one is the cause
    finally:
        for ev in reduced:
            ev.set()
        t.join()
    if failed:
        raise failed[0]


class Hierarchy:
    """The two levels of one rank: ``intra`` (its host, shm) and ``inter`` (its local rank across hosts)."""

    def __init__(self, topo: Topology, intra: ProcessGroup, inter: ProcessGroup) -> None:
        self.topo, self.intra, self.inter = topo, intra, inter
        self.L, self.h = topo.local_world_size, topo.nnodes
        self.n = self.L * self.h
        # order[k] = the global rank whose chunk is k-th in the packed layout (local rank major).
        self.order = [topo.hosts[b][j] for j in range(self.L) for b in range(self.h)]
        self.contiguous = self.order == [b * self.L + j for j in range(self.L) for b in range(self.h)]
        self.intra_ab = cost.params("shm")
        self.inter_ab = cost.params(inter.backend)
        self.measured = False
        # The deadline of the world's operation running now: its levels share it, so a
        # hierarchical collective fails within one timeout, like a flat one (None: each its own).
        self.deadline: float | None = None

    # ---- cost ------------------------------------------------------------------------
    def calibrate(self, store, timeout: float) -> None:
        """Measure (alpha, beta) of both levels once; every rank adopts global rank 0's figures.

        Rank 0's host measures its shared memory (a small and a 4 MiB all-reduce); local rank 0
        of every host measures the link between hosts (a small tree and a 1 MiB ring
        all-reduce over its ``inter`` group, the others idle so the link is theirs).  Figures
        given in ``HELIOS_COMM_ALPHA_US`` / ``HELIOS_COMM_GBPS`` win over the measurement.
        """
        t = self.topo
        key = "hier/ab"
        if t.rank == 0:
            ab = {"intra": self._measure(self.intra, 4 << 20, lambda c, b: self.intra.direct.all_reduce(b, "sum", "int32")),
                  "inter": self._measure(self.inter, 1 << 20, None)}
            store.set(key, json.dumps(ab).encode())
        else:
            if t.node_rank == 0:
                self._measure(self.intra, 4 << 20, lambda c, b: self.intra.direct.all_reduce(b, "sum", "int32"))
            if t.local_rank == 0:
                self._measure(self.inter, 1 << 20, None)
            ab = json.loads(store.get(key, timeout))
        if not os.environ.get("HELIOS_COMM_ALPHA_US") and not os.environ.get("HELIOS_COMM_GBPS"):
            self.intra_ab, self.inter_ab = tuple(ab["intra"]), tuple(ab["inter"])
            self.measured = True

    @staticmethod
    def _measure(g: ProcessGroup, big: int, run: Callable | None) -> list[float]:
        """(alpha, beta) of ``g`` from the best of a few small and two large all-reduces."""
        n = g.size

        def timed(nbytes: int, reps: int, alg: str) -> float:
            buf = np.zeros(max(1, nbytes // 4), np.int32)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                if run is not None:
                    g.run_op("calibrate", buf.nbytes, lambda c: run(c, buf), "calibrate")
                else:
                    g.run_op("calibrate", buf.nbytes, lambda c: INTER_RUN[alg](c, buf, "sum", "int32"), "calibrate")
                best = min(best, time.perf_counter() - t0)
            return best

        small = timed(4, 5, "tree")
        large = timed(big, 2, "ring")
        if run is not None:  # direct shm all-reduce: ~2 syncs, each rank moves 2(n-1)/n of the bytes
            alpha = small / 2
            beta = max(1e-12, (large - 2 * alpha) / (2 * (n - 1) / n * big))
        else:
            lg = max(1, (n - 1).bit_length())
            alpha = small / (2 * lg)
            beta = max(1e-12, (large - 2 * (n - 1) * alpha) / (2 * (n - 1) / n * big))
        return [alpha, beta]

    def choose(self, op: str, nbytes: int, algorithm: str, seg_bytes: int) -> str | None:
        """The inter-host algorithm when ``op`` runs hierarchically, else None (flat)."""
        if algorithm in ("ring", "tree", "halving_doubling"):
            return None
        w = wanted() if algorithm == "auto" else "1"
        hier, alg = cost.choose_multihost(op, nbytes, self.L, self.h, self.intra_ab, self.inter_ab, seg_bytes)
        if w == "0" or (w == "auto" and not hier):
            return None
        if not hier:  # forced: the model's best inter-host algorithm for the hierarchical form
            alg = cost.estimate_hierarchical(op, nbytes, self.L, self.h, self.intra_ab, self.inter_ab, seg_bytes)[0]
        return alg

    def bytes_sent(self) -> int:
        """Bytes both levels have sent (for the world's counters)."""
        return self.intra.counters.bytes_sent + self.inter.counters.bytes_sent

    # ---- the operations ---------------------------------------------------------------
    def _in(self, name: str, nbytes: int, fn: Callable[[], None]) -> None:
        self.intra.run_op(name, nbytes, lambda c: fn(), name, deadline=self.deadline)

    def _across(self, name: str, nbytes: int, fn: Callable[[A.Ctx], None]) -> None:
        try:
            self.inter.run_op(name, nbytes, fn, name, deadline=self.deadline)
        except CommError as e:
            self.tell_host_mates(self.inter, f"{name}: {str(e)[:300]}", self.inter.engine.fault)
            raise

    def tell_host_mates(self, failed: ProcessGroup, reason: str, fault: Fault | None) -> None:
        """Poison the intra-host level after ``failed`` (the world or the level between hosts) failed.

        The host's other ranks may be waiting for this one in the intra-host level (a collective
        this rank has not reached, or the next one): they learn which peer on another host was
        lost, at once, instead of finding this rank gone and blaming it.
        """
        peers = failed.engine.peers
        lost = (f"rank {fault.culprit} of group {failed.name} {peers[fault.culprit]}"
                if fault is not None and 0 <= fault.culprit < len(peers) and fault.culprit != failed.rank
                else reason[:300])
        self.intra.poison(reason, Fault(self.intra.rank, f"gave up on an operation between hosts ({lost})",
                                        self.intra.rank))

    def all_reduce(self, buf: np.ndarray, op: str, dtype: str, alg: str) -> None:
        """In-place all-reduce of the flat ``buf`` over every host.

        A large buffer goes in ``cost.pieces(...)`` pieces, pipelined: while the link carries piece
        k's exchange (on a thread of its own), the host's shared memory reduces piece k+1 and
        gathers piece k-1, so the link does not idle during the intra-host levels."""
        count = buf.size
        if count == 0:
            return
        red = "sum" if op == "avg" else op
        P = cost.pieces(count * buf.itemsize, self.L)
        q = -(-count // (P * self.L))  # elements of a local rank's shard of one piece
        x = buf
        if q * P * self.L != count:
            x = np.zeros(q * P * self.L, buf.dtype)
            x[:count] = buf
        segs = x.reshape(P, self.L * q)
        shards = np.empty((P, q), buf.dtype)

        def reduce_piece(k: int) -> None:
            self._in("all_reduce:reduce_scatter", segs[k].nbytes,
                     lambda: self.intra.direct.reduce_scatter(shards[k], segs[k], red, dtype))

        def exchange_piece(k: int) -> None:
            self._across("all_reduce:inter", shards[k].nbytes, lambda c: INTER_RUN[alg](c, shards[k], red, dtype))
            R.finish_avg(shards[k], self.n, op, dtype)

        def gather_piece(k: int) -> None:
            self._in("all_reduce:all_gather", segs[k].nbytes, lambda: self.intra.direct.all_gather(segs[k], shards[k]))

        if P == 1:
            reduce_piece(0)
            exchange_piece(0)
            gather_piece(0)
        else:
            _pipelined(P, reduce_piece, exchange_piece, gather_piece)
        if x is not buf:
            buf[:] = x[:count]

    def reduce_scatter(self, out: np.ndarray, x: np.ndarray, op: str, dtype: str, alg: str) -> None:
        """``out`` = chunk ``rank`` of ``x`` reduced over every rank (x: n chunks of out's size)."""
        m = out.size
        if m == 0:
            return
        red = "sum" if op == "avg" else op
        packed = x.reshape(self.n, m)[self.order].reshape(-1)  # block j: the chunks of local rank j's ranks
        mid = np.empty(self.h * m, out.dtype)
        self._in("reduce_scatter:intra", x.nbytes, lambda: self.intra.direct.reduce_scatter(mid, packed, red, dtype))
        rs = A.ring_reduce_scatter if alg == "ring" else A.hd_reduce_scatter
        self._across("reduce_scatter:inter", mid.nbytes, lambda c: rs(c, out, mid, red, dtype))
        R.finish_avg(out, self.n, op, dtype)

    def all_gather(self, out: np.ndarray, x: np.ndarray, alg: str) -> None:
        """``out`` (n chunks of x's size) receives every rank's ``x`` in rank order."""
        m = x.size
        if m == 0:
            return
        mid = np.empty(self.h * m, x.dtype)
        ag = A.ring_all_gather if alg == "ring" else A.hd_all_gather
        self._across("all_gather:inter", mid.nbytes, lambda c: ag(c, mid, x))
        big = np.empty(self.n * m, x.dtype)
        self._in("all_gather:intra", big.nbytes, lambda: self.intra.direct.all_gather(big, mid))
        if self.contiguous:
            out.reshape(self.h, self.L, m)[:] = big.reshape(self.L, self.h, m).transpose(1, 0, 2)
        else:
            out.reshape(self.n, m)[self.order] = big.reshape(self.n, m)

    def broadcast(self, buf: np.ndarray, src: int, alg: str) -> None:
        """Copy global rank ``src``'s ``buf`` to every rank."""
        count = buf.size
        if count == 0:
            return
        t, L = self.topo, self.L
        a_src = t.node_of[src]
        q = -(-count // L)
        if t.node_rank == a_src:
            j_src = t.hosts[a_src].index(src)
            self._in("broadcast:intra", buf.nbytes, lambda: self.intra.direct.broadcast(buf, j_src))
        x = np.zeros(q * L, buf.dtype)
        j = t.local_rank
        if t.node_rank == a_src:
            x[:count] = buf
        piece = x[j * q:(j + 1) * q]
        shape = A.chain if alg == "ring" else A.binomial
        self._across("broadcast:inter", piece.nbytes, lambda c: A.tree_broadcast(c, piece, a_src, shape))
        mine = piece.copy()
        self._in("broadcast:all_gather", x.nbytes, lambda: self.intra.direct.all_gather(x, mine))
        buf[:] = x[:count]

    def close(self) -> None:
        """Release both levels."""
        self.intra.close()
        self.inter.close()
