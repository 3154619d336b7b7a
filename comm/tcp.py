"""TCP transport: a full mesh of sockets, one per peer, picked interface, non-blocking I/O.

Each rank listens on an ephemeral port of the chosen interface and publishes
``host:port`` in the store; the higher rank of each pair connects, the lower accepts,
and a handshake (rank, job token) pairs them, so there is no port to collide on.
``HELIOS_SOCKET_IFNAME`` picks the interface: ``eth0``, a list ``eth0,eth1`` (first that
exists), or an exclusion ``^lo,docker0``.  Without it, the interface that routes to the
store is used.
"""

from __future__ import annotations

import fcntl
import select
import socket
import struct
import time

from helios.comm.engine import Fault, Link, PeerLost, Transport

from helios.errors import CommError

_HELLO = struct.Struct("<II16s")  # magic, rank, job token
_HELLO_MAGIC = 0x48544350
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

    def __init__(self, store, rank: int, world: int, local_addr: str, token: bytes, timeout: float) -> None:
        self.rank, self.world = rank, world
        self.links: list[Link] = [None] * world  # type: ignore[list-item]
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _size_buffers(lsock)  # inherited by accepted sockets, before the window scale is negotiated
        lsock.bind((local_addr, 0))
        lsock.listen(world)
        store.set(f"tcp/{rank}", f"{local_addr}:{lsock.getsockname()[1]}".encode())
        deadline = time.monotonic() + timeout
        socks: dict[int, socket.socket] = {}
        token = token[:16].ljust(16, b"\0")
        try:
            for peer in range(rank):  # connect to every lower rank
                host, port = store.get(f"tcp/{peer}", timeout).decode().rsplit(":", 1)
                s = self._connect(host, int(port), deadline, peer)
                s.sendall(_HELLO.pack(_HELLO_MAGIC, rank, token))
                socks[peer] = s
            lsock.settimeout(1.0)
            while len(socks) < world - 1:
                if time.monotonic() > deadline:
                    missing = [p for p in range(world) if p != rank and p not in socks]
                    raise CommError(f"helios.comm: tcp mesh: ranks {missing} never connected to rank {rank} "
                                    f"within {timeout:.0f} s; check HELIOS_SOCKET_IFNAME and firewalls.")
                try:
                    conn, _ = lsock.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                try:
                    magic, peer, their = _HELLO.unpack(_recv_all(conn, _HELLO.size))
                except (OSError, ConnectionError, struct.error):
                    conn.close()
                    continue
                if magic != _HELLO_MAGIC or their != token or not rank < peer < world or peer in socks:
                    conn.close()  # a stray connection (another job, a port scan): ignore it
                    continue
                socks[peer] = conn
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        finally:
            lsock.close()
        for peer, s in socks.items():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            self.links[peer] = TcpLink(s, peer)
        self._poll = select.poll()
        self._fd_peer = {link.fd: p for p, link in enumerate(self.links) if link is not None}

    @staticmethod
    def _connect(host: str, port: int, deadline: float, peer: int) -> socket.socket:
        delay = 0.02
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _size_buffers(s)
            s.settimeout(max(0.5, deadline - time.monotonic()))
            try:
                s.connect((host, port))
                return s
            except OSError as e:
                s.close()
                if time.monotonic() + delay > deadline:
                    raise CommError(f"helios.comm: tcp mesh: cannot connect to rank {peer} at {host}:{port}: {e}. "
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


def _size_buffers(s: socket.socket) -> None:
    # Large buffers let a whole pipeline segment sit in the kernel, so a rank blocks (and
    # waits to be scheduled again) less often.  They must be set before connect/listen for
    # the TCP window scale to allow them.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUF)


def _recv_all(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during handshake")
        buf += chunk
    return buf

