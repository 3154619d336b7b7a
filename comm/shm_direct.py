"""Direct shared-memory collectives: copy into your slot, publish, read everyone's slot.

The protocol is one monotonic generation counter per rank (its *progress* flag) and two
slots per rank, used alternately by successive pieces.  Every piece of every operation
follows the same rule:

1. write your own slot (when you contribute),
2. publish ``gen + 1`` (release) and ring every peer's doorbell,
3. wait until every peer's progress is ``>= gen + 1`` (acquire),
4. read the peers' slots.

A rank's first publish of a piece comes after all its reads of the previous piece, and
every piece waits for every peer's first publish, so the slot written by piece ``k + 2``
is never still being read for piece ``k``: no extra "done" flag is needed.  Large
all-reduces use a second phase inside the piece (reduce your chunk in place, publish
``gen + 2``, then everyone copies every chunk out), which divides the reduction work by
the number of ranks.  Every wait has the operation's deadline and checks peer liveness.
"""

from __future__ import annotations

import os
import time

import numpy as np
from helios.comm import reduce_ops as R
from helios.comm.engine import OpInfo, PeerLost
from helios.comm.shm import ShmTransport, native

from helios.errors import CommError

_shm = native()  # the ring's atomics and doorbells (None where not built: the transport is then never chosen)

# All-reduces up to this size use one phase (each rank reduces every buffer): one
# synchronisation instead of two, which wins while the reduction is cheap.
ONE_PHASE_MAX = 64 * 1024
# Bytes of each rank's chunk per piece of a large all-reduce (HELIOS_SHM_PIECE_BYTES).
PIECE_PER_RANK = int(os.environ.get("HELIOS_SHM_PIECE_BYTES") or 512 * 1024)


class ShmDirect:
    """The direct collectives of one shared-memory communicator."""

    def __init__(self, t: ShmTransport) -> None:
        self.t = t
        self.n, self.rank = t.world, t.rank
        me = t.segs[t.rank]
        self.my_prog = me.base + 2 * LINE_
        peers = [r for r in range(self.n) if r != self.rank]
        self.peers = peers
        self.peer_addrs = [t.segs[r].base + 2 * LINE_ for r in peers]
        self.peer_prog = np.array(self.peer_addrs, dtype=np.uint64).tobytes()
        self.peer_bells = [t.segs[r].base + LINE_ for r in peers]
        self.gen = 0
        self.piece = 0
        self.info = OpInfo("?", 0, 0)
        self.deadline = 0.0
        self.bytes_sent = 0  # bytes this rank wrote into its own slots for the peers to read, ever
        self._slots = [[t.slot(r, i) for i in (0, 1)] for r in range(self.n)]

    # ---- synchronisation -----------------------------------------------------------
    def _publish(self, value: int) -> None:
        _shm.publish(self.my_prog, value)
        for b in self.peer_bells:
            _shm.ring(b)

    def _wait(self, target: int) -> None:
        if not self.peers:
            return
        while True:
            left = self.deadline - time.monotonic()
            slice_ns = int(max(0.0, min(left, 0.05)) * 1e9)
            lag = _shm.wait_all_ge(self.peer_prog, target, self.t.my_bell, self.t.spin_ns, slice_ns)
            if lag < 0:
                return
            # Only peers that have not reached the target matter (one that published and
            # then exited is done, not dead to us).
            try:
                behind = [r for r, a in zip(self.peers, self.peer_addrs) if _shm.load(a) < target]
                self.t.check_peers(behind, force=True)  # a dead one becomes a suspect
                # Re-read the flags after the liveness check: a suspect still behind now
                # died without publishing.
                behind = [r for r, a in zip(self.peers, self.peer_addrs) if _shm.load(a) < target]
                self.t.check_peers(behind, force=True)
            except PeerLost as e:
                raise CommError(self._describe(f"rank {e.peer} {e.reason}")) from None
            if time.monotonic() >= self.deadline:
                raise CommError(self._describe(
                    f"timed out waiting for rank {self.peers[lag]} to reach step {target} of the shared-memory "
                    "protocol; the peer is stuck, stopped or slower than the timeout"))

    def _describe(self, what: str) -> str:
        i = self.info
        return (f"helios.comm: {i.name} #{i.seq} on group {i.group} ({i.nbytes} bytes) failed on rank {self.rank}: "
                f"{what}. The communicator is now unusable: destroy_process_group() and init_process_group() again.")

    def _step(self) -> int:
        """Start a piece: the slot index it uses."""
        idx = self.piece & 1
        self.piece += 1
        return idx

    def _sync(self) -> None:
        self.gen += 1
        self._publish(self.gen)
        self._wait(self.gen)

    def _cap(self, per_piece: int) -> int:
        """Bytes per rank of one piece when each rank writes ``per_piece`` blocks of it to its slot.

        Small enough that a piece is still in cache when the peers read it (PIECE_PER_RANK),
        and never more than the slot holds.
        """
        return max(1, min(self.t.slot_bytes // per_piece, PIECE_PER_RANK))

    def _pieces(self, nbytes: int, unit: int, cap: int) -> list[tuple[int, int]]:
        """Split ``nbytes`` into pieces of at most ``cap`` bytes, multiples of ``unit``."""
        step = max(unit, cap // unit * unit)
        return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)] or [(0, 0)]

    # ---- collectives ------------------------------------------------------------------
    def barrier(self) -> None:
        """Every rank has arrived."""
        self._step()
        self._sync()

    def all_reduce(self, buf: np.ndarray, op: str, dtype: str) -> None:
        """In-place all-reduce of the flat array ``buf``.

        Small pieces: one phase (copy in, publish, every rank reduces every slot).  Large
        pieces: each rank publishes only the chunks its peers reduce (its own chunk never
        leaves its buffer), reduces its own chunk from its buffer and the peers' slots into
        its slot, publishes again, and everyone copies the reduced chunks out.  Pieces are
        sized so one rank's chunk stays in its L2 cache between the reduction and the
        copies.
        """
        raw = buf.view(np.uint8)
        isz, n, me = buf.itemsize, self.n, self.rank
        if raw.nbytes <= ONE_PHASE_MAX or n == 1:
            for off, nb in self._pieces(raw.nbytes, isz, self.t.slot_bytes):
                idx = self._step()
                self._slots[me][idx][:nb] = raw[off: off + nb]
                self.bytes_sent += nb
                self._sync()
                srcs = [self._slots[r][idx][:nb].view(buf.dtype) for r in range(n)]
                out = buf[off // isz: (off + nb) // isz]
                R.reduce_many(out, srcs, op, dtype)
                R.finish_avg(out, n, op, dtype)
            return
        for off, nb in self._pieces(raw.nbytes, isz, min(self.t.slot_bytes, n * PIECE_PER_RANK)):
            idx = self._step()
            mine = self._slots[me][idx]
            bounds = _bounds(nb // isz, n)
            for r in range(n):
                if r != me:
                    a, b = bounds[r] * isz, bounds[r + 1] * isz
                    mine[a:b] = raw[off + a: off + b]
                    self.bytes_sent += b - a
            self._sync()
            lo, hi = bounds[me] * isz, bounds[me + 1] * isz
            own = raw[off + lo: off + hi].view(buf.dtype)
            target = mine[lo:hi].view(buf.dtype)
            srcs = [own if r == me else self._slots[r][idx][lo:hi].view(buf.dtype) for r in range(n)]
            R.reduce_many(target, srcs, op, dtype)
            R.finish_avg(target, n, op, dtype)
            self.bytes_sent += hi - lo  # the reduced chunk every peer copies out
            self._sync()
            for r in range(n):
                a, b = bounds[r] * isz, bounds[r + 1] * isz
                raw[off + a: off + b] = self._slots[r][idx][a:b]

    def all_gather(self, out: np.ndarray, x: np.ndarray) -> None:
        """``out`` (n * x.nbytes) receives every rank's ``x`` in rank order."""
        xr, orr = x.view(np.uint8), out.view(np.uint8)
        m = xr.nbytes
        for off, nb in self._pieces(m, 1, self._cap(1)):
            idx = self._step()
            self._slots[self.rank][idx][:nb] = xr[off: off + nb]
            self.bytes_sent += nb
            self._sync()
            for r in range(self.n):
                orr[r * m + off: r * m + off + nb] = self._slots[r][idx][:nb]

    def reduce_scatter(self, out: np.ndarray, x: np.ndarray, op: str, dtype: str) -> None:
        """``out`` = reduction over ranks of chunk ``rank`` of ``x`` (x holds n chunks of out's size)."""
        xr = x.view(np.uint8)
        m, isz, n = out.nbytes, out.itemsize, self.n
        for off, nb in self._pieces(m, isz, self._cap(n)):
            idx = self._step()
            mine = self._slots[self.rank][idx]
            for j in range(n):
                mine[j * nb: (j + 1) * nb] = xr[j * m + off: j * m + off + nb]
            self.bytes_sent += (n - 1) * nb  # the peers' chunks (its own stays here)
            self._sync()
            lo = self.rank * nb
            srcs = [self._slots[r][idx][lo: lo + nb].view(out.dtype) for r in range(n)]
            target = out[off // isz: (off + nb) // isz]
            R.reduce_many(target, srcs, op, dtype)
            R.finish_avg(target, n, op, dtype)

    def broadcast(self, buf: np.ndarray, src: int) -> None:
        """Copy ``src``'s ``buf`` to every rank."""
        raw = buf.view(np.uint8)
        for off, nb in self._pieces(raw.nbytes, 1, self._cap(1)):
            idx = self._step()
            if self.rank == src:
                self._slots[src][idx][:nb] = raw[off: off + nb]
                self.bytes_sent += nb
            self._sync()
            if self.rank != src:
                raw[off: off + nb] = self._slots[src][idx][:nb]

    def reduce(self, buf: np.ndarray, dst: int, op: str, dtype: str) -> None:
        """``dst``'s ``buf`` receives the reduction over ranks; the others' are unchanged."""
        raw = buf.view(np.uint8)
        isz = buf.itemsize
        for off, nb in self._pieces(raw.nbytes, isz, self._cap(1)):
            idx = self._step()
            self._slots[self.rank][idx][:nb] = raw[off: off + nb]
            self.bytes_sent += nb
            self._sync()
            if self.rank == dst:
                srcs = [self._slots[r][idx][:nb].view(buf.dtype) for r in range(self.n)]
                target = buf[off // isz: (off + nb) // isz]
                R.reduce_many(target, srcs, op, dtype)
                R.finish_avg(target, self.n, op, dtype)

    def all_to_all(self, out: np.ndarray, x: np.ndarray) -> None:
        """Chunk j of ``x`` goes to rank j; chunk j of ``out`` came from rank j."""
        xr, orr = x.view(np.uint8), out.view(np.uint8)
        n = self.n
        m = xr.nbytes // n
        for off, nb in self._pieces(m, 1, self._cap(n)):
            idx = self._step()
            mine = self._slots[self.rank][idx]
            for j in range(n):
                mine[j * nb: (j + 1) * nb] = xr[j * m + off: j * m + off + nb]
            self.bytes_sent += (n - 1) * nb
            self._sync()
            lo = self.rank * nb
            for r in range(n):
                orr[r * m + off: r * m + off + nb] = self._slots[r][idx][lo: lo + nb]

    def release(self) -> None:
        """Drop the slot views so the mappings can close."""
        self._slots = []


LINE_ = 64


def _bounds(count: int, parts: int) -> list[int]:
    """Element boundaries of ``parts`` near-equal chunks of ``count``."""
    q, r = divmod(count, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out
