"""Shared-memory transport between the ranks of one host.

Each rank owns one segment, ``/dev/shm/helios-<uid>-<job token>-<group>-r<rank>``, created
with ``O_EXCL`` and mapped by every peer.  Once all peers have mapped it the name is
unlinked, so a crash at any later point leaves nothing behind in ``/dev/shm``: the
memory goes away with the last mapping.  Until then, every failure path unlinks it.

Layout (every flag alone on a 64-byte line; a flag is a u64 generation counter followed
by a u32 sleeper count, see ``native/shm.c``)::

    line 0        header: magic, pid, world, abort flag, culprit + 1, reporter + 1 (who is at fault)
    line 1        doorbell: rung by any peer that moved something this rank may wait on
    line 2        progress: generation counter of the direct collectives
    lines 3..     tail[p]: bytes written into the ring this rank -> p   (written by this rank only)
    lines 3+n..   head[p]: bytes consumed from the ring p -> this rank (written by this rank only)
    line 3+2n..   abort text: what happened to the culprit (to the end of the control pages)
    rings         one byte ring per peer (this rank -> p), ``HELIOS_SHM_RING_BYTES`` each
    slots         two slots of ``HELIOS_SHM_SLOT_BYTES`` for the direct collectives

Two paths use it.  The point-to-point path gives the progress engine a byte stream per
ordered pair (a single-producer single-consumer ring, head and tail owned by opposite
sides), which carries sends, receives and the forced ring / tree / halving-doubling
algorithms.  The direct path (``ShmDirect``) is the default for collectives: every rank
copies its piece into its own slot, publishes its generation counter, and reads its
peers' slots directly, which needs no message framing at all.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

import numpy as np
from helios.comm.engine import Fault, Link, PeerLost, Transport

from helios.errors import CommError

try:
    from helios.comm import _shm
except ImportError:  # pragma: no cover - depends on the build
    _shm = None

LINE = 64
_ABORT_FLAG = 24  # byte offset of the abort flag in the header line
MAGIC = 0x48454C494F53484D  # "HELIOSHM"
SHM_DIR = "/dev/shm"


def native():
    """The native module of the shared-memory transport (helios.comm._shm: the ring's atomics and
    doorbells), or None where it was not built (:func:`available` says why)."""
    return _shm


def available() -> str | None:
    """None when the shared-memory transport can run here, else the reason it cannot."""
    if _shm is None:
        return "the native module helios.comm._shm is not built (pip install -e . with a C compiler)"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is missing or not writable"
    return None


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


def peer_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class Segment:
    """One rank's mapping of a segment (its own, or a peer's)."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path, self.size = path, size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise CommError(f"helios.comm: shm segment {path} has {os.fstat(fd).st_size} bytes, expected {size}.")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = int(self.arr.ctypes.data)
        self.u64 = self.arr[: 4 * LINE].view(np.uint64)

    def close(self) -> None:
        """Drop the mapping (numpy views must be gone first)."""
        self.arr = self.u64 = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still exists somewhere; the mapping goes when it does


class ShmLink(Link):
    """Byte ring ``me -> peer`` in my segment, ring ``peer -> me`` in the peer's segment."""

    def __init__(self, t: ShmTransport, peer: int) -> None:
        me = t.rank
        self.t, self.peer, self.cap = t, peer, t.ring_bytes
        mine, theirs = t.segs[me], t.segs[peer]
        self.out_ring = memoryview(mine.mm)[t.ring_off(peer): t.ring_off(peer) + self.cap]
        self.in_ring = memoryview(theirs.mm)[t.ring_off(me): t.ring_off(me) + self.cap]
        self.my_tail_addr = mine.base + t.tail_line(peer)
        self.peer_head_addr = theirs.base + t.head_line(me)
        self.peer_tail_addr = theirs.base + t.tail_line(me)
        self.my_head_addr = mine.base + t.head_line(peer)
        self.peer_bell = theirs.base + LINE
        self.tail = 0
        self.head = 0

    def send_some(self, data: memoryview) -> int:
        space = self.cap - (self.tail - _shm.load(self.peer_head_addr))
        k = min(space, data.nbytes)
        if k <= 0:
            return 0
        pos = self.tail % self.cap
        first = min(k, self.cap - pos)
        self.out_ring[pos:pos + first] = data[:first]
        if k > first:
            self.out_ring[: k - first] = data[first:k]
        self.tail += k
        _shm.publish(self.my_tail_addr, self.tail)
        _shm.ring(self.peer_bell)
        return k

    def recv_some(self, into: memoryview) -> int:
        avail = _shm.load(self.peer_tail_addr) - self.head
        k = min(avail, into.nbytes)
        if k <= 0:
            return 0
        pos = self.head % self.cap
        first = min(k, self.cap - pos)
        into[:first] = self.in_ring[pos:pos + first]
        if k > first:
            into[first:k] = self.in_ring[: k - first]
        self.head += k
        _shm.publish(self.my_head_addr, self.head)
        _shm.ring(self.peer_bell)
        return k

    def release(self) -> None:
        """Drop the memoryviews into the mappings."""
        self.out_ring.release()
        self.in_ring.release()


class ShmTransport(Transport):
    """Shared-memory links and slots among ranks of one host."""

    name = "shm"
    abort_frames = False  # the abort flag in the segment header carries the fault

    def __init__(self, store, rank: int, world: int, pids: list[int], token: str, group: str, timeout: float) -> None:
        reason = available()
        if reason:
            raise CommError(f"helios.comm: the shm backend is unavailable: {reason}. Use backend='tcp'.")
        self.rank, self.world, self.pids = rank, world, pids
        self.ring_bytes = _env_int("HELIOS_SHM_RING_BYTES", 1 << 20)
        self.slot_bytes = _env_int("HELIOS_SHM_SLOT_BYTES", 8 << 20)
        ncpu = len(os.sched_getaffinity(0))
        # Spinning only helps when every rank has a core; oversubscribed, it steals the core
        # the peer needs, so go to the futex almost at once.
        self.spin_ns = _env_int("HELIOS_SHM_SPIN_US", 50 if world <= ncpu else 2) * 1000
        self.ctrl = -(-(3 + 2 * world) * LINE // 4096) * 4096
        # (3 + 2n) lines are an odd number of lines, so the page-rounded control area always
        # leaves at least one line after them: the abort text.
        self.text_off = (3 + 2 * world) * LINE
        self.fault: Fault | None = None
        self.slots_off = self.ctrl + world * self.ring_bytes
        size = self.slots_off + 2 * self.slot_bytes
        self.names = [f"{SHM_DIR}/{name_prefix(token)}-{group}-r{r}" for r in range(world)]
        self.segs: list[Segment] = [None] * world  # type: ignore[list-item]
        self._linked = False
        try:
            seg = Segment(self.names[rank], size, create=True)
            self._linked = True
            self.segs[rank] = seg
            seg.u64[0], seg.u64[1], seg.u64[2], seg.u64[3] = MAGIC, os.getpid(), world, 0
            store.set(f"shm/ready/{rank}", b"1")
            for r in range(world):
                if r != rank:
                    store.get(f"shm/ready/{r}", timeout)
                    self.segs[r] = Segment(self.names[r], size, create=False)
                    if int(self.segs[r].u64[0]) != MAGIC or int(self.segs[r].u64[1]) != pids[r]:
                        raise CommError(f"helios.comm: shm segment {self.names[r]} is not rank {r}'s.")
            # Every peer has mapped every segment: the names can go.
            if store.add("shm/mapped", 1) == world:
                store.set("shm/all", b"1")
            store.get("shm/all", timeout)
            self._unlink_own()
        except BaseException:
            self._unlink_own()
            # A peer that died before unlinking its name leaves it to us.
            for r in range(world):
                if r != rank and not peer_alive(pids[r]):
                    try:
                        os.unlink(self.names[r])
                    except OSError:
                        pass
            self.close()
            raise
        self.links: list[Link] = [ShmLink(self, p) if p != rank else None for p in range(world)]  # type: ignore[misc]
        self.my_bell = self.segs[rank].base + LINE
        self._last_check = 0.0
        self._suspects: set[int] = set()

    # ---- layout ------------------------------------------------------------------
    def tail_line(self, peer: int) -> int:
        """Offset of the tail flag of ring this rank -> ``peer``."""
        return (3 + peer) * LINE

    def head_line(self, peer: int) -> int:
        """Offset of the head flag of ring ``peer`` -> this rank."""
        return (3 + self.world + peer) * LINE

    def ring_off(self, peer: int) -> int:
        """Offset of the ring this rank -> ``peer`` inside this rank's segment."""
        return self.ctrl + peer * self.ring_bytes

    def slot(self, rank: int, idx: int) -> np.ndarray:
        """Slot ``idx`` (0 or 1) of ``rank``'s segment as uint8."""
        off = self.slots_off + idx * self.slot_bytes
        return self.segs[rank].arr[off: off + self.slot_bytes]

    # ---- liveness ------------------------------------------------------------------
    def check_peers(self, peers, force: bool = False) -> None:
        """Raise PeerLost when one of ``peers`` has aborted, or its process is gone (rate-limited).

        Only the peers this rank is waiting on count: a peer that finished its part and
        exited is no error.  A dead peer is reported on the second look, so bytes it wrote
        just before it exited are still consumed by one more progress pass.
        """
        now = time.monotonic()
        if not force and now - self._last_check < 0.05:
            return
        self._last_check = now
        for r in peers:
            if r == self.rank:
                continue
            if _shm.load(self.segs[r].base + _ABORT_FLAG) != 0:
                self._raise(self._aborted(r))
            if not peer_alive(self.pids[r]):
                if r in self._suspects:
                    self._raise(PeerLost(r, f"is dead (process {self.pids[r]} exited or was killed)"))
                self._suspects.add(r)
                self._last_check = 0.0  # look again right after the next progress pass

    def _raise(self, e: PeerLost) -> None:
        self.fault = Fault.of(e, self.rank)
        raise e

    def _aborted(self, r: int) -> PeerLost:
        """What peer ``r``'s abort says: the rank at fault and what happened to it."""
        u = self.segs[r].u64
        culprit, reporter = int(u[4]) - 1, int(u[5]) - 1
        if not 0 <= culprit < self.world or not 0 <= reporter < self.world:
            return PeerLost(r, "aborted the communicator after its own failure")
        text = bytes(self.segs[r].arr[self.text_off: self.ctrl]).split(b"\0", 1)[0].decode(errors="replace")
        return PeerLost(culprit, text or "aborted the communicator", reporter)

    def wait_activity(self, send_peers: list[int], recv_peers: list[int], timeout: float) -> None:
        self.check_peers(set(send_peers) | set(recv_peers))
        if self._last_check == 0.0:
            return  # a peer looked dead: let the engine drain what it left before deciding
        bell = _shm.load(self.my_bell)
        # A spurious return is fine: the engine re-checks every link.  The rings ring our
        # bell after every move, so sleeping on it cannot miss one.
        _shm.wait_change(self.my_bell, bell, self.spin_ns, int(min(timeout, 0.05) * 1e9))

    def abort(self, reason: str) -> None:
        self.abort_fault(None, reason)

    def abort_fault(self, fault: Fault | None, reason: str) -> None:
        seg = self.segs[self.rank]
        if seg is not None and seg.u64 is not None:
            if fault is not None and 0 <= fault.culprit < self.world and 0 <= fault.reporter < self.world:
                cap = self.ctrl - self.text_off
                seg.arr[self.text_off: self.ctrl] = np.frombuffer(
                    fault.what.encode()[: cap - 1].ljust(cap, b"\0"), np.uint8)
                seg.u64[4], seg.u64[5] = fault.culprit + 1, fault.reporter + 1
            _shm.store(seg.base + _ABORT_FLAG, 1)  # release: the fault above is visible first
            for r in range(self.world):
                if r != self.rank and self.segs[r] is not None:
                    _shm.ring(self.segs[r].base + LINE)

    def _unlink_own(self) -> None:
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.names[self.rank])
            except OSError:
                pass

    def close(self) -> None:
        self._unlink_own()
        for link in getattr(self, "links", []):
            if link is not None:
                link.release()
        self.links = []
        for i, s in enumerate(self.segs):
            if s is not None:
                s.close()
                self.segs[i] = None  # type: ignore[call-overload]


def name_prefix(token: str = "") -> str:
    """How the names in SHM_DIR of this user's segments (of job token ``token``) begin."""
    return f"helios-{os.getuid()}-{token}"


def new_token() -> str:
    """A short random job token for segment names.

    Under helios-run it starts with ``HELIOS_SHM_PREFIX`` (hex, one per launch attempt), so
    the launcher can remove every segment of an attempt whose ranks died before unlinking
    them, even one whose header was never written.
    """
    prefix = os.environ.get("HELIOS_SHM_PREFIX", "")
    if not (prefix.isalnum() and prefix.isascii() and len(prefix) <= 16):
        prefix = ""
    return prefix + secrets.token_hex(3 if prefix else 6)
