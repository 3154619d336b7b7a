"""TCP transport: a full mesh of sockets, one per peer, picked interface, non-blocking I/O.

Each rank listens on an ephemeral port of the chosen interface and publishes
``host:port`` in the store; the higher rank of each pair connects, the lower accepts,
and a handshake pairs them, so there is no port to collide on.  The handshake is the
mutual challenge-response of comm/auth.py over the communicator's key (the job secret
bound to its token) carrying the connecting rank: a peer that cannot prove the key is
closed, and strangers are answered in threads of their own, each within
:data:`helios.comm.auth.AUTH_TIMEOUT_S`, so they cannot hold up the mesh.
``HELIOS_SOCKET_IFNAME`` picks the interface: ``eth0``, a list ``eth0,eth1`` (first that
exists), or an exclusion ``^lo,docker0``.  Without it, the interface that routes to the
store is used.
"""

from __future__ import annotations

import fcntl
import queue
import select
import socket
import struct
import threading
import time

from helios.comm import auth
from helios.comm.engine import Fault, Link, PeerLost, Transport

from helios.errors import CommError

_RANK = struct.Struct("<I")  # the connecting rank, carried (and authenticated) by the handshake
_LABEL = b"helios-tcp"
_BUF = 4 * 1024 * 1024
_SIOCOUTQ = 0x5411  # bytes in a socket's send queue not yet acknowledged by the peer
_ABORT_FLUSH = 0.2  # seconds an aborting rank waits for its last bytes (the abort frame) to leave


def interface_address(name: str) -> str | None:
    """IPv4 address of interface ``name`` (None when it has none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def pick_address(spec: str | None, fallback: str) -> str:
    """The local address to listen on and advertise, following ``HELIOS_SOCKET_IFNAME``."""
    if not spec:
        return fallback
    names = [n for _, n in socket.if_nameindex()]
    if spec.startswith("^"):
        excluded = set(spec[1:].split(","))
        cands = [n for n in names if n not in excluded]
    else:
        cands = [n for n in spec.split(",") if n]
    for n in cands:
        addr = interface_address(n)
        if addr:
            return addr
    raise CommError(
        f"helios.comm: HELIOS_SOCKET_IFNAME={spec!r} matches no interface with an IPv4 address; "
        f"this host has {', '.join(names)}."
    )


class TcpLink(Link):
    """One connected non-blocking socket."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock, self.peer = sock, peer
        self.fd = sock.fileno()

    def send_some(self, data: memoryview) -> int:
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            raise PeerLost(self.peer, f"dropped the connection ({e.strerror or e})") from None

    def recv_some(self, into: memoryview) -> int:
        if into.nbytes == 0:
            return 0
        try:
            k = self.sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            raise PeerLost(self.peer, f"dropped the connection ({e.strerror or e})") from None
        if k == 0:
            raise PeerLost(self.peer, "closed the connection (it exited, crashed or gave up)")
        return k


class TcpTransport(Transport):
    """Full mesh of TCP links among the ranks of one communicator."""

    name = "tcp"

    def __init__(self, store, rank: int, world: int, local_addr: str, key: bytes, timeout: float) -> None:
        """Connect the mesh; ``key`` is this communicator's handshake key (``auth.link_key``)."""
        self.rank, self.world = rank, world
        self.links: list[Link] = [None] * world  # type: ignore[list-item]
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _size_buffers(lsock)  # inherited by accepted sockets, before the window scale is negotiated
        lsock.bind((local_addr, 0))
        lsock.listen(4 * world + 16)
        # Higher ranks are admitted from now on, while this rank connects to the lower ones.
        admission = _Admission(lsock, rank, world, key)
        store.set(f"tcp/{rank}", f"{local_addr}:{lsock.getsockname()[1]}".encode())
        deadline = time.monotonic() + timeout
        socks: dict[int, socket.socket] = {}
        try:
            for peer in range(rank):  # connect to every lower rank
                host, port = store.get(f"tcp/{peer}", timeout).decode().rsplit(":", 1)
                socks[peer] = self._connect(host, int(port), deadline, peer, key, rank)
            admission.collect(socks, deadline, timeout)
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        finally:
            admission.close()
        for peer, s in socks.items():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            self.links[peer] = TcpLink(s, peer)
        self._poll = select.poll()
        self._fd_peer = {link.fd: p for p, link in enumerate(self.links) if link is not None}

    @staticmethod
    def _connect(host: str, port: int, deadline: float, peer: int, key: bytes, rank: int) -> socket.socket:
        """A socket to ``peer`` that proved ``key`` (and to which this rank proved it, with its rank)."""
        delay = 0.02
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _size_buffers(s)
            s.settimeout(max(0.5, deadline - time.monotonic()))
            try:
                s.connect((host, port))
                why = auth.connect(s, key, _LABEL, _RANK.pack(rank))
                if why is None:
                    return s
                err: object = why
            except OSError as e:
                err, why = e, None
            s.close()
            if why is not None and why != auth.UNGREETED:
                raise CommError(f"helios.comm: tcp mesh: rank {peer} at {host}:{port} {why}; every rank needs the "
                                "same HELIOS_JOB_SECRET.")
            if time.monotonic() + delay > deadline:
                raise CommError(f"helios.comm: tcp mesh: cannot connect to rank {peer} at {host}:{port}: {err}. "
                                "Check HELIOS_SOCKET_IFNAME and that the address is reachable.") from None
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def wait_activity(self, send_peers: list[int], recv_peers: list[int], timeout: float) -> None:
        masks: dict[int, int] = {}
        for p in recv_peers:
            if p != self.rank:
                masks[self.links[p].fd] = select.POLLIN
        for p in send_peers:
            if p != self.rank:
                fd = self.links[p].fd
                masks[fd] = masks.get(fd, 0) | select.POLLOUT
        for fd in self._fd_peer:
            if fd in masks:
                self._poll.register(fd, masks[fd])
            else:
                try:
                    self._poll.unregister(fd)
                except KeyError:
                    pass
        try:
            self._poll.poll(int(timeout * 1000) + 1)
        except InterruptedError:
            pass

    def abort(self, reason: str) -> None:
        self._abort(None)

    def abort_fault(self, fault: Fault, reason: str) -> None:
        # No point waiting for the rank at fault to take our last bytes: it is likely gone.
        self._abort(fault.culprit if fault.culprit != self.rank else None)

    def _abort(self, skip: int | None) -> None:
        # Closing every socket makes each peer's next read return EOF: their waits end now.
        # First a half-close: the FIN follows whatever is still queued (the abort frame the
        # engine just sent, naming the rank at fault), and the peers' data keeps being read
        # and dropped until the queue is empty, because closing a socket with unread input
        # resets the connection and throws away what was not yet transmitted.
        live = [link for link in self.links if link is not None and link.peer != skip]
        for link in live:
            try:
                link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        sink = bytearray(1 << 16)
        end = time.monotonic() + _ABORT_FLUSH
        while live and time.monotonic() < end:
            busy = []
            for link in live:
                try:
                    for _ in range(64):  # bounded: a peer still streaming must not hold us here
                        if not link.sock.recv_into(sink):
                            break
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    continue  # reset: nothing of ours can still be delivered
                try:
                    queued = struct.unpack("i", fcntl.ioctl(link.fd, _SIOCOUTQ, b"\0\0\0\0"))[0]
                except OSError:
                    queued = 0
                if queued:
                    busy.append(link)
            live = busy
            if live:
                time.sleep(0.002)
        self.close()

    def close(self) -> None:
        for link in self.links:
            if link is not None:
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                link.sock.close()
        self.links = [None] * self.world  # type: ignore[list-item]


class _Admission:
    """The accepting side of the mesh: a thread accepts, and each connection proves the key in a
    thread of its own (at most 4 x world + 16 at once, each within ``auth.AUTH_TIMEOUT_S``), so a
    stranger that connects and stays silent delays no peer; proven peers come out of a queue."""

    def __init__(self, lsock: socket.socket, rank: int, world: int, key: bytes) -> None:
        self.lsock, self.rank, self.world, self.key = lsock, rank, world, key
        self.proven: queue.Queue = queue.Queue()
        self.slots = threading.BoundedSemaphore(4 * world + 16)
        self.done = threading.Event()
        threading.Thread(target=self._accept_loop, name="helios-tcp-admit", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return  # closed: the mesh is complete or given up
            if not self.slots.acquire(blocking=False):
                conn.close()  # a flood of connections: drop what is over the bound
                continue
            threading.Thread(target=self._prove, args=(conn,), daemon=True).start()

    def _prove(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(auth.AUTH_TIMEOUT_S)
            extra = auth.accept(conn, self.key, _LABEL, _RANK.size)
            peer = _RANK.unpack(extra)[0] if extra is not None else -1
            if self.rank < peer < self.world and not self.done.is_set():
                self.proven.put((peer, conn))
            else:
                conn.close()  # a stranger, or a rank that cannot be a peer of this side
        finally:
            self.slots.release()

    def collect(self, socks: dict[int, socket.socket], deadline: float, timeout: float) -> None:
        """Add every higher rank's proven socket to ``socks``, or raise CommError at ``deadline``."""
        while len(socks) < self.world - 1:
            try:
                peer, conn = self.proven.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = [p for p in range(self.world) if p != self.rank and p not in socks]
                raise CommError(f"helios.comm: tcp mesh: ranks {missing} never connected to rank {self.rank} "
                                f"within {timeout:.0f} s; check HELIOS_SOCKET_IFNAME and firewalls.") from None
            if peer in socks:
                conn.close()
            else:
                socks[peer] = conn

    def close(self) -> None:
        """Stop admitting: close the listening socket and any proven socket nobody took."""
        self.done.set()
        try:
            self.lsock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        except OSError:
            pass
        self.lsock.close()
        while True:
            try:
                self.proven.get_nowait()[1].close()
            except queue.Empty:
                return


def _size_buffers(s: socket.socket) -> None:
    # Large buffers let a whole pipeline segment sit in the kernel, so a rank blocks (and
    # waits to be scheduled again) less often.  They must be set before connect/listen for
    # the TCP window scale to allow them.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUF)
