"""The progress engine: tagged messages over byte-stream links, with deadlines.

Every transport (TCP sockets, shared-memory rings, ibverbs) offers one ordered byte
stream per peer and direction (a :class:`Link`).  The engine frames messages on it
(24-byte header: magic, tag, length), matches incoming frames to posted receives by
``(peer, tag)``, keeps early arrivals in a per-peer stash, and drives every link without
blocking, so a rank can send to and receive from many peers at once (a ring step, an
all-to-all) without deadlock.  A receive may carry a completion callback that posts more
work; the ring algorithms pipeline their segments through it.

A dead link, a size mismatch or a passed deadline raises :class:`helios.errors.CommError`
naming the operation, its sequence number, the peer and the bytes still pending.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from helios.errors import CommError

HEADER = struct.Struct("<IIQQ")  # magic, reserved, tag, nbytes
MAGIC = 0x48434F4D  # "HCOM"
_INLINE = 64 * 1024  # payloads below this travel in the same write as their header
_DRAIN_AFTER = 0.05  # seconds of stuck sends before reading from peers nothing is expected from


class PeerLost(Exception):
    """A link found its peer gone (closed, reset, crashed or aborted)."""

    def __init__(self, peer: int, reason: str) -> None:
        super().__init__(f"rank {peer} {reason}")
        self.peer, self.reason = peer, reason


class Link:
    """A non-blocking ordered byte stream to one peer (implemented by each transport)."""

    def send_some(self, data: memoryview) -> int:
        """Write as much of ``data`` as fits now; the byte count (0 when full). Raises PeerLost."""
        raise NotImplementedError

    def recv_some(self, into: memoryview) -> int:
        """Read what is available into ``into``; the byte count (0 when none). Raises PeerLost."""
        raise NotImplementedError


@dataclass
class OpInfo:
    """What an error message says about the operation that was running."""

    name: str
    seq: int
    nbytes: int
    group: str = "world"


class _Send:
    __slots__ = ("idx", "nbytes", "off", "parts", "peer", "tag")

    def __init__(self, peer: int, tag: int, payload: memoryview) -> None:
        self.peer, self.tag, self.nbytes = peer, tag, payload.nbytes
        hdr = HEADER.pack(MAGIC, 0, tag, payload.nbytes)
        # Small payloads ride in one write with the header (one system call, one segment).
        self.parts = [memoryview(hdr + payload.tobytes())] if payload.nbytes < _INLINE else [memoryview(hdr), payload]
        self.idx = self.off = 0


class _Recv:
    __slots__ = ("dst", "got", "nbytes", "on_done", "peer", "stash", "tag")

    def __init__(self, peer: int, tag: int, dst: memoryview, on_done: Callable[[], None] | None) -> None:
        self.peer, self.tag, self.dst, self.nbytes = peer, tag, dst, dst.nbytes
        self.got, self.on_done, self.stash = 0, on_done, False


class Engine:
    """Matches, sends and receives framed messages over a transport's links."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport
        n = transport.world
        self._sendq: list[deque[_Send]] = [deque() for _ in range(n)]
        self._posted: list[dict[int, _Recv]] = [{} for _ in range(n)]
        self._stash: list[dict[int, memoryview]] = [{} for _ in range(n)]
        self._hdr = [bytearray(HEADER.size) for _ in range(n)]
        self._hdr_got = [0] * n
        self._cur: list[_Recv | None] = [None] * n
        self._pending_recvs = 0
        self._pending_sends = 0
        self._gone: dict[int, str] = {}
        self.info = OpInfo("?", 0, 0)
        self._scratch = np.empty(0, np.uint8)
        self._soff = 0

    def scratch(self, count: int, dtype) -> np.ndarray:
        """Temporary array for the running operation, carved from a block reused across operations.

        Reuse matters: fresh memory costs a page fault per 4 KiB on first touch, which for a
        large all-reduce costs as much as the reduction.  Call ``reset_scratch`` between
        operations (one operation runs at a time on an engine).
        """
        dt = np.dtype(dtype)
        nb = count * dt.itemsize
        off = -(-self._soff // 64) * 64
        if off + nb > self._scratch.nbytes:
            # Views handed out earlier keep the old block alive; later operations use the new one.
            self._scratch = np.empty(max(2 * self._scratch.nbytes, off + nb, 1 << 16), np.uint8)
            off = 0
        self._soff = off + nb
        return self._scratch[off: off + nb].view(dt)

    def reset_scratch(self) -> None:
        """Start a new operation's scratch allocations."""
        self._soff = 0

    # ---- posting -------------------------------------------------------------------
    def post_send(self, peer: int, tag: int, data: np.ndarray | memoryview | bytes) -> None:
        """Queue ``data`` for ``peer`` under ``tag`` (the buffer must stay untouched until done)."""
        mv = data if isinstance(data, memoryview) else memoryview(data)
        self._sendq[peer].append(_Send(peer, tag, mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv))
        self._pending_sends += 1

    def post_recv(self, peer: int, tag: int, dst: np.ndarray | memoryview,
                  on_done: Callable[[], None] | None = None) -> None:
        """Receive the message ``(peer, tag)`` into ``dst``; ``on_done`` runs when it has landed."""
        mv = dst if isinstance(dst, memoryview) else memoryview(dst)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        early = self._stash[peer].pop(tag, None)
        if early is not None:
            self._check_size(peer, tag, len(early), mv.nbytes)
            mv[:] = early
            if on_done is not None:
                on_done()
            return
        cur = self._cur[peer]
        if cur is not None and cur.stash and cur.tag == tag:
            # The message is arriving right now into a stash buffer: land the rest in place.
            self._check_size(peer, tag, cur.nbytes, mv.nbytes)
            mv[:cur.got] = cur.dst[:cur.got]
            cur.dst, cur.stash, cur.on_done = mv, False, on_done
            self._pending_recvs += 1
            return
        if peer in self._gone:
            raise CommError(self._describe(f"rank {peer} {self._gone[peer]}", peer))
        if tag in self._posted[peer]:
            raise CommError(f"helios.comm: internal: two receives posted for tag {tag:#x} from rank {peer}.")
        self._posted[peer][tag] = _Recv(peer, tag, mv, on_done)
        self._pending_recvs += 1

    # ---- driving -------------------------------------------------------------------
    def wait_all(self, deadline: float) -> None:
        """Drive every link until all posted sends and receives are done, or raise at the deadline."""
        stuck = 0.0
        try:
            while self._pending_sends or self._pending_recvs:
                # Draining peers we expect nothing from is only for cycles of ranks that all
                # send first: do it once sends have been stuck a few milliseconds, not by
                # default (it would park the next operation's early data in the stash).
                drain = bool(stuck) and time.monotonic() - stuck > _DRAIN_AFTER
                if self._progress(drain):
                    stuck = 0.0
                    continue
                now = time.monotonic()
                if self._pending_sends and not stuck:
                    stuck = now
                left = deadline - now
                if left <= 0:
                    self._raise_timeout()
                wait = min(left, 0.1 if drain or not self._pending_sends else _DRAIN_AFTER)
                self.t.wait_activity(self._wanted_send(), self._wanted_recv(drain), wait)
        except PeerLost as e:
            raise CommError(self._describe(f"rank {e.peer} {e.reason}", e.peer)) from None

    def _wanted_send(self) -> list[int]:
        return [p for p, q in enumerate(self._sendq) if q]

    def _wanted_recv(self, drain: bool = False) -> list[int]:
        # When draining, read from every peer: parking their messages in the stash lets a
        # cycle of ranks that all send first (isend around a ring) make progress.
        if drain:
            return [p for p in range(self.t.world) if p != self.t.rank and p not in self._gone]
        return [p for p in range(self.t.world) if self._posted[p] or self._cur[p] is not None or self._hdr_got[p]]

    def _progress(self, drain: bool = False) -> bool:
        moved = False
        for p, q in enumerate(self._sendq):
            while q:
                s = q[0]
                link = self.t.links[p]
                while s.idx < len(s.parts):
                    part = s.parts[s.idx]
                    k = link.send_some(part[s.off:])
                    if k == 0:
                        break
                    moved = True
                    s.off += k
                    if s.off == part.nbytes:
                        s.idx, s.off = s.idx + 1, 0
                if s.idx < len(s.parts):
                    break
                q.popleft()
                self._pending_sends -= 1
        for p in self._wanted_recv(drain):
            while self._recv_from(p, drain):
                moved = True
        return moved

    def _recv_from(self, p: int, drain: bool) -> bool:
        if not drain and self._cur[p] is None and not self._hdr_got[p] and not self._posted[p]:
            return False  # the next frame belongs to a later operation: leave it in the socket
        try:
            return self._recv_frame(p)
        except PeerLost as e:
            if self._posted[p] or self._cur[p] is not None or self._hdr_got[p]:
                raise
            # Drained only to avoid a deadlock, and nothing is expected from it: a peer that
            # finished and left is no error until someone waits on it.
            self._gone[p] = e.reason
            return False

    def _recv_frame(self, p: int) -> bool:
        link = self.t.links[p]
        cur = self._cur[p]
        if cur is None:
            hdr = self._hdr[p]
            got = self._hdr_got[p]
            k = link.recv_some(memoryview(hdr)[got:])
            if k == 0:
                return False
            got += k
            self._hdr_got[p] = got
            if got < HEADER.size:
                return True
            self._hdr_got[p] = 0
            magic, _, tag, nbytes = HEADER.unpack(hdr)
            if magic != MAGIC:
                raise CommError(self._describe(f"rank {p} sent a corrupt frame header (magic {magic:#x})", p))
            cur = self._posted[p].pop(tag, None)
            if cur is None:
                cur = _Recv(p, tag, memoryview(np.empty(nbytes, np.uint8)), None)
                cur.stash = True
            else:
                self._check_size(p, tag, nbytes, cur.nbytes)
            self._cur[p] = cur
            if nbytes == 0:
                self._complete(p, cur)
            return True
        k = link.recv_some(cur.dst[cur.got:])
        if k == 0:
            return False
        cur.got += k
        if cur.got == cur.nbytes:
            self._complete(p, cur)
        return True

    def _complete(self, p: int, r: _Recv) -> None:
        self._cur[p] = None
        if r.stash:
            self._stash[p][r.tag] = r.dst  # type: ignore[assignment]
            return
        self._pending_recvs -= 1
        if r.on_done is not None:
            r.on_done()

    # ---- errors --------------------------------------------------------------------
    def _check_size(self, peer: int, tag: int, came: int, expected: int) -> None:
        if came != expected:
            raise CommError(self._describe(
                f"rank {peer} sent {came} bytes for message tag {tag:#x} where this rank expected {expected}: the "
                "ranks called the collective with different sizes (HELIOS_COMM_DEBUG=1 checks every call)", peer))

    def _raise_timeout(self) -> None:
        peer, pending = -1, 0
        for p in range(self.t.world):
            b = sum(r.nbytes - r.got for r in self._posted[p].values())
            b += sum(s.nbytes for s in self._sendq[p])
            cur = self._cur[p]
            if cur is not None:
                b += cur.nbytes - cur.got
            if b > pending or (peer < 0 and (self._posted[p] or self._sendq[p])):
                peer, pending = p, b
        stash = {p: sorted(s) for p, s in enumerate(self._stash) if s}
        hint = f"; early messages parked from {stash}" if stash else ""
        raise CommError(self._describe(
            f"timed out waiting for rank {peer} ({pending} bytes still pending with it){hint}; the peer is stuck, "
            "stopped or slower than the timeout", peer))

    def _describe(self, what: str, peer: int) -> str:
        i = self.info
        return (f"helios.comm: {i.name} #{i.seq} on group {i.group} ({i.nbytes} bytes) failed on rank {self.t.rank}: "
                f"{what}. The communicator is now unusable: destroy_process_group() and init_process_group() again.")

    def reset(self) -> None:
        """Forget pending work (after a failure, before the communicator is dropped)."""
        for q in self._sendq:
            q.clear()
        for d in self._posted:
            d.clear()
        self._pending_recvs = self._pending_sends = 0


class Transport:
    """Links to every peer plus a way to sleep until one of them may move."""

    rank: int
    world: int
    links: list[Link]
    name: str

    def wait_activity(self, send_peers: list[int], recv_peers: list[int], timeout: float) -> None:
        """Block up to ``timeout`` until a wanted link may make progress (spurious returns are fine)."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """Tell peers this rank is giving up, so their waits end now rather than at their deadline."""
        raise NotImplementedError

    def close(self) -> None:
        """Release sockets, mappings and segments."""
        raise NotImplementedError
