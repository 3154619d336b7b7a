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

Fault attribution: a rank that gives up records a :class:`Fault` (the rank at fault, what
happened to it, who found it).  Before its transport closes the links, :meth:`Engine.send_abort`
finishes the frame each link is in the middle of and sends an *abort frame* carrying that
fault, so a peer that reads the abort before it notices anything itself still names the rank
that actually failed ("rank 1 closed the connection ... (reported by rank 2)") instead of
the rank that merely gave up because of it.
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
# An abort frame: HEADER(ABORT_MAGIC, culprit, reporter, len(text)) + text (what happened to the culprit).
ABORT_MAGIC = 0x48414254  # "HABT"
_ABORT_TEXT = 1024  # longest text an abort frame carries
_RELAY_FRAMES = 64  # frames read from a closed link while looking for its abort frame
ABORT_BUDGET = 0.2  # seconds an aborting rank spends pushing abort frames out before closing
_INLINE = 64 * 1024  # payloads below this travel in the same write as their header
_DRAIN_AFTER = 0.05  # seconds of stuck sends before reading from peers nothing is expected from


class PeerLost(Exception):
    """A link found its peer gone (closed, reset, crashed or aborted).

    ``peer`` is the rank at fault and ``what`` what happened to it (it reads after
    "rank N ").  ``reporter`` is set when another rank found the fault and relayed it in
    its abort; ``reason`` is then ``what`` plus "(reported by rank R)".
    """

    def __init__(self, peer: int, reason: str, reporter: int | None = None) -> None:
        self.peer, self.what, self.reporter = peer, reason, reporter
        self.reason = reason if reporter is None or reporter == peer else f"{reason} (reported by rank {reporter})"
        super().__init__(f"rank {peer} {self.reason}")


@dataclass
class Fault:
    """Who is to blame for a failed operation: what an abort tells the peers.

    ``culprit`` is the (transport) rank at fault, ``what`` reads after "rank N " (e.g.
    "closed the connection ..."), ``reporter`` is the rank that found it.
    """

    culprit: int
    what: str
    reporter: int

    def lost(self) -> PeerLost:
        """The PeerLost a peer raises on receiving this fault in an abort."""
        return PeerLost(self.culprit, self.what, self.reporter)

    @classmethod
    def of(cls, e: PeerLost, me: int) -> Fault:
        """The fault a PeerLost describes, found by rank ``me`` unless it was relayed."""
        return cls(e.peer, e.what, me if e.reporter is None else e.reporter)


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
    __slots__ = ("abort", "dst", "got", "nbytes", "on_done", "peer", "stash", "tag")

    def __init__(self, peer: int, tag: int, dst: memoryview, on_done: Callable[[], None] | None) -> None:
        self.peer, self.tag, self.dst, self.nbytes = peer, tag, dst, dst.nbytes
        self.got, self.on_done, self.stash = 0, on_done, False
        self.abort: tuple[int, int] | None = None  # (culprit, reporter) of an abort frame


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
        self._gone: dict[int, PeerLost] = {}
        self.info = OpInfo("?", 0, 0)
        self.fault: Fault | None = None  # set when an operation fails because of a peer
        self._scratch = np.empty(0, np.uint8)
        self._soff = 0
        self.bytes_sent = 0  # payload bytes handed to the links, ever (the communicator's counters read it)
        self.peers: list[str] = []  # per rank of the transport, where it runs (set by the group; errors name it)
        self.agree_s = 0.0  # the end of a timeout spent hearing whom the peers wait for (set by the group)
        # The very end of a timeout goes to the abort frames and the transport's flush of them
        # (ABORT_BUDGET each at most), so the CommError is raised by the deadline, not after it.
        self.abort_s = 2 * ABORT_BUDGET if transport.abort_frames else 0.0

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
        self.bytes_sent += mv.nbytes

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
            raise self._lost(self._gone[peer])
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
                left = deadline - self.agree_s - self.abort_s - now
                if left <= 0:
                    self._raise_timeout(deadline)
                wait = min(left, 0.1 if drain or not self._pending_sends else _DRAIN_AFTER)
                self.t.wait_activity(self._wanted_send(), self._wanted_recv(drain), wait)
        except PeerLost as e:
            raise self._lost(self._relayed(e)) from None

    def _relayed(self, e: PeerLost) -> PeerLost:
        """The abort a peer left in its link before closing, if any; else ``e`` itself.

        A peer that gives up first sends every link an abort frame naming the culprit, then
        closes.  A rank that was sending to it may see the close (a broken pipe) before it
        reads that frame: read what the link still holds so the fault names the rank really
        at fault, not the messenger.
        """
        if e.reporter is not None or not 0 <= e.peer < len(self.t.links) or self.t.links[e.peer] is None:
            return e
        try:
            for _ in range(_RELAY_FRAMES):
                if not self._recv_frame(e.peer):
                    break
        except PeerLost as relayed:
            if relayed.reporter is not None:
                return relayed
        except CommError:
            pass
        return e

    def _lost(self, e: PeerLost) -> CommError:
        self.fault = Fault.of(e, self.t.rank)
        return CommError(self._describe(f"rank {e.peer} {e.reason}", e.peer))

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
            if self._posted[p] or self._cur[p] is not None or self._hdr_got[p] or e.reporter is not None:
                raise  # expected from it, or it aborted the communicator: this operation cannot finish
            # Drained only to avoid a deadlock, and nothing is expected from it: a peer that
            # finished and left is no error until someone waits on it.
            self._gone[p] = e
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
            magic, culprit, tag, nbytes = HEADER.unpack(hdr)
            if magic == ABORT_MAGIC and nbytes <= _ABORT_TEXT:
                # The peer gave up: read what it says about who is at fault, then raise.
                cur = _Recv(p, -1, memoryview(np.empty(nbytes, np.uint8)), None)
                cur.stash, cur.abort = True, (culprit, tag)
                self._cur[p] = cur
                if nbytes == 0:
                    self._complete(p, cur)
                return True
            if magic != MAGIC:
                self.fault = Fault(p, f"sent a corrupt frame header (magic {magic:#x})", self.t.rank)
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
        if r.abort is not None:
            culprit, reporter = r.abort
            what = bytes(r.dst).decode(errors="replace") or "aborted the communicator"
            if not 0 <= culprit < self.t.world or not 0 <= reporter < self.t.world:
                culprit, reporter = p, p
            raise PeerLost(culprit, what, reporter)
        if r.stash:
            self._stash[p][r.tag] = r.dst  # type: ignore[assignment]
            return
        self._pending_recvs -= 1
        if r.on_done is not None:
            r.on_done()

    # ---- errors --------------------------------------------------------------------
    def _check_size(self, peer: int, tag: int, came: int, expected: int) -> None:
        if came != expected:
            self.fault = Fault(peer, f"sent {came} bytes where rank {self.t.rank} expected {expected} (the ranks "
                                     "called the collective with different sizes)", self.t.rank)
            raise CommError(self._describe(
                f"rank {peer} sent {came} bytes for message tag {tag:#x} where this rank expected {expected}: the "
                "ranks called the collective with different sizes (HELIOS_COMM_DEBUG=1 checks every call)", peer))

    def _raise_timeout(self, deadline: float) -> None:
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
        waited = f"timed out waiting for rank {peer} ({pending} bytes still pending with it){hint}"
        if peer < 0:
            raise CommError(self._describe(f"{waited}; the peer is stuck, stopped or slower than the timeout", peer))
        self.fault = Fault(peer, f"stopped responding (rank {self.t.rank} timed out waiting for it)", self.t.rank)
        root, via = self._agree_on_culprit(self.fault, deadline - self.abort_s)
        if root == peer:
            raise CommError(self._describe(f"{waited}; the peer is stuck, stopped or slower than the timeout", peer))
        self.fault = Fault(root, f"stopped responding (rank {via} timed out waiting for it)", via)
        chain = "" if via == peer else f" (through rank {via})"
        raise CommError(self._describe(
            f"{waited}, which was itself waiting for rank {root}{chain}: rank {root} stopped responding (it is "
            "stuck, stopped or unreachable)", root))

    def _agree_on_culprit(self, fault: Fault, deadline: float) -> tuple[int, int]:
        """After a timeout: whom the peers were waiting for, so every rank names the same rank at fault.

        In a ring, a rank waits on its neighbour, which may itself be waiting on a rank behind
        a dead link: each would blame the one it waits for.  Until ``deadline`` (the last
        ``agree_s`` of the timeout) this rank sends its abort frame (whom it waits for) and
        reads the peers' ones; following "A waits for B" from the rank it blamed leads to a
        rank it did not hear from, which is the one at fault.  Returns ``(that rank, the rank
        that named it)``.  (The abort this rank sends later, when the group is poisoned, names
        that rank.)"""
        if self.agree_s <= 0:
            return fault.culprit, self.t.rank
        blames: dict[int, int] = {}
        self.send_abort(fault, budget=min(ABORT_BUDGET, self.agree_s / 2))
        todo = [p for p in range(self.t.world)
                if p != self.t.rank and p not in self._gone and self.t.links[p] is not None]
        while todo and time.monotonic() < deadline:
            for p in list(todo):
                try:
                    while self._recv_frame(p):
                        pass
                except PeerLost as e:
                    todo.remove(p)
                    if e.reporter is not None and e.reporter == p:
                        blames[p] = e.peer  # "p waits for e.peer"
                except CommError:
                    todo.remove(p)
            if todo:
                try:
                    self.t.wait_activity([], todo, max(0.0, min(0.05, deadline - time.monotonic())))
                except PeerLost as e:
                    if e.peer in todo:
                        todo.remove(e.peer)
        root, via, seen = fault.culprit, self.t.rank, {self.t.rank}
        while root in blames and root not in seen:
            seen.add(root)
            root, via = blames[root], root
        return (root, via) if root not in seen else (fault.culprit, self.t.rank)

    def _describe(self, what: str, peer: int) -> str:
        i = self.info
        # Across hosts, a peer's rank alone does not say which machine or link to look at.
        where = f" (rank {peer} {self.peers[peer]})" if 0 <= peer < len(self.peers) and peer != self.t.rank else ""
        return (f"helios.comm: {i.name} #{i.seq} on group {i.group} ({i.nbytes} bytes) failed on rank {self.t.rank}: "
                f"{what}{where}. The communicator is now unusable: destroy_process_group() and init_process_group() "
                "again.")

    def send_abort(self, fault: Fault, budget: float = ABORT_BUDGET) -> None:
        """Best effort, before the transport closes: tell every peer who is at fault.

        Each link first gets the rest of the frame it is in the middle of (the real bytes,
        so the peer's framing stays intact), then an abort frame carrying ``fault``.  Links
        that cannot take it within ``budget`` seconds (a dead or stuck peer) are left as
        they are: their peers see the connection close instead.  The rank at fault gets a
        single try (it is most likely gone).  Call it on the thread that
        ran the failed operation (the engine is not thread-safe).
        """
        text = fault.what.encode()[:_ABORT_TEXT]
        frame = HEADER.pack(ABORT_MAGIC, fault.culprit, fault.reporter, len(text)) + text
        todo: dict[int, list[memoryview]] = {}
        for p in range(self.t.world):
            if p == self.t.rank or p in self._gone or p >= len(self.t.links) or self.t.links[p] is None:
                continue
            parts: list[memoryview] = []
            q = self._sendq[p]
            if q and (q[0].idx or q[0].off):
                s = q[0]
                parts = [s.parts[s.idx][s.off:], *s.parts[s.idx + 1:]]
            parts.append(memoryview(frame))
            todo[p] = parts
        end = time.monotonic() + budget
        while todo:
            moved = False
            for p in list(todo):
                parts = todo[p]
                try:
                    while parts:
                        k = self.t.links[p].send_some(parts[0])
                        if k == 0:
                            break
                        moved = True
                        parts[0] = parts[0][k:]
                        if parts[0].nbytes == 0:
                            parts.pop(0)
                except Exception:  # noqa: BLE001 - a dead link: nothing more to tell it
                    parts.clear()
                if not parts:
                    del todo[p]
            # The rank at fault gets one try, not a wait: it is most likely dead or stuck.
            todo.pop(fault.culprit, None)
            left = end - time.monotonic()
            if not todo or left <= 0:
                return
            if not moved:
                try:
                    self.t.wait_activity(list(todo), [], min(left, 0.01))
                except PeerLost as e:
                    todo.pop(e.peer, None)
                except Exception:  # noqa: BLE001 - best effort
                    return

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

    #: whether the engine sends abort frames over the links before ``abort`` (a transport
    #: with its own way to publish the fault, like shm's abort flag, turns it off)
    abort_frames = True

    def abort(self, reason: str) -> None:
        """Tell peers this rank is giving up, so their waits end now rather than at their deadline."""
        raise NotImplementedError

    def abort_fault(self, fault: Fault, reason: str) -> None:
        """Abort, publishing ``fault`` where the transport has a place for it (default: plain abort)."""
        self.abort(reason)

    def close(self) -> None:
        """Release sockets, mappings and segments."""
        raise NotImplementedError
