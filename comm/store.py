"""Rendezvous store: a small key-value server over TCP, hosted by rank 0.

Operations: ``set``, ``get`` (waits for the key up to a deadline), ``add`` (atomic counter),
``wait`` (several keys), ``check`` and ``delete``.  Every call has a deadline and raises
:class:`helios.errors.CommError` naming the key and the store's address when it passes.
The wire format is a fixed binary frame (never pickle).  A handshake carries the world size
and job id, so a rank that reached another job's store fails at once instead of waiting on
keys that never come.

Only the job's ranks get in: the server listens on the master address (not every
interface), and every connection must first prove the job's secret (comm/auth.py) within
:data:`helios.comm.auth.AUTH_TIMEOUT_S`; until then nothing it sends is read as a request.
Keys are at most :data:`MAX_KEY_BYTES`, values :data:`MAX_VALUE_BYTES`; connections, those
still proving and those proven, are bounded (4 x world size + 16 each).  A connection
refused for any of these reasons is closed and counted (``StoreServer.rejected``), and the
first one is logged at ``HELIOS_DEBUG=1``.

The store lives in rank 0's process, so a rank 0 that finished its work first would take it
away from ranks still using it (forming a group, waiting on a key).  At a clean exit the
hosting process therefore waits, up to the store's timeout or :data:`LINGER_MAX_S`, until
every other rank has closed its connection (done with the job, or dead: a dead rank's
connection closes too); it says so on stderr after a second.  It does not wait when it exits
on an uncaught exception, nor after its communicator failed (helios.comm closes the store with
``linger=False`` then): the other ranks then learn at once that the store is gone.
"""

from __future__ import annotations

import atexit
import errno
import socket
import struct
import sys
import threading
import time
import weakref

from helios.comm import auth
from helios.profile.debug import debug_level

from helios.errors import CommError

_SET, _GET, _ADD, _CHECK, _DELETE, _HELLO = range(1, 7)
_OK, _MISSING, _BAD = 0, 1, 2
_REQ = struct.Struct("!BIIq")  # op, key length, value length, integer argument
_RESP = struct.Struct("!BIq")  # status, payload length, integer result
_LABEL = b"helios-store"
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20

# The longest a store's host waits at exit for the ranks still connected (also bounded by the
# store's timeout).  Enough for ranks a few steps behind; bounded because a rank 0 that exits with
# an error through sys.exit (not an uncaught exception) may leave ranks waiting on a key only it
# would have set: they then fail this much later instead of at once.
LINGER_MAX_S = 60.0
_CLIENTS: weakref.WeakSet = weakref.WeakSet()  # every TCPStore of this process (their connections close at exit)
_HOSTED: list[StoreServer] = []  # the servers this process hosts, drained at its exit (_drain_at_exit)
_hooked = False  # sys.excepthook wrapped (_host, once)
_uncaught = False  # whether the process is exiting on an uncaught exception (_flag_uncaught)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def resolve(host: str) -> str:
    """The IPv4 address ``host`` (MASTER_ADDR) names here; CommError (one line) when it names none."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise CommError(f"helios.comm: MASTER_ADDR={host} does not resolve to an IPv4 address here ({e}); "
                        "give rank 0's address or a host name every rank can resolve.") from None


def listen_address(host: str, resolved: str, world_size: int, secret: bytes) -> str:
    """Where rank 0's store listens: the master address itself (loopback for a one-host job).

    The one exception: a host *name* that resolves to loopback on rank 0's host (a Debian-style
    ``127.0.1.1 node01`` line in /etc/hosts) may name a routable address on the other hosts,
    so a job with a secret (every connection authenticated) listens on every interface then."""
    try:
        socket.inet_aton(host)
        literal = host.count(".") == 3
    except OSError:
        literal = False
    if secret and world_size > 1 and auth.is_loopback(resolved) and not literal and host != "localhost":
        return "0.0.0.0"
    return resolved


class StoreServer:
    """The store's server: one thread per connection (bounded), a condition variable for waits.

    ``rejected`` counts the connections closed without serving them: strangers (no proof of
    ``secret`` within ``auth_timeout_s``), connections over the bound, oversized frames."""

    def __init__(self, host: str, port: int, world_size: int, job_id: str = "", bind_retry_s: float = 5.0,
                 secret: bytes = b"", auth_timeout_s: float = auth.AUTH_TIMEOUT_S, linger_s: float = LINGER_MAX_S) -> None:
        self.world_size = world_size
        self.linger_s = linger_s  # the longest this process waits at exit for the ranks still connected
        self.job_id = job_id
        self.max_connections = 4 * world_size + 16
        self.rejected = 0
        self._secret, self._auth_timeout = secret, auth_timeout_s
        self._proving = self._proven = 0  # connections in each phase (under _count_lock)
        self._count_lock = threading.Lock()
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._sock = _bind(host, port, bind_retry_s)
        self._sock.listen(256)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="helios-store", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._count_lock:
                room = self._proving < self.max_connections
                self._proving += room
            if not room:  # closed at once: a flood of strangers never blocks this loop
                conn.close()
                self._reject(peer, "over the connection bound")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        proven = False
        try:
            conn.settimeout(self._auth_timeout)
            ok = auth.accept(conn, self._secret, _LABEL) is not None
            with self._count_lock:
                self._proving -= 1
                proven = ok and self._proven < self.max_connections
                self._proven += proven
            if not proven:
                self._reject(peer, "did not prove the job's secret" if not ok else "over the connection bound")
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._serve_frames(conn, peer)
        except (ConnectionError, OSError, struct.error):
            pass
        finally:
            if proven:
                with self._count_lock:
                    self._proven -= 1
            conn.close()

    def _serve_frames(self, conn: socket.socket, peer) -> None:
        while True:
            op, klen, vlen, arg = _REQ.unpack(_recv_exact(conn, _REQ.size))
            if klen > MAX_KEY_BYTES or vlen > MAX_VALUE_BYTES:
                msg = f"frame over the store's limits ({MAX_KEY_BYTES} B keys, {MAX_VALUE_BYTES} B values)".encode()
                conn.sendall(_RESP.pack(_BAD, len(msg), 0) + msg)
                self._reject(peer, "sent an oversized frame")
                return
            key = _recv_exact(conn, klen) if klen else b""
            val = _recv_exact(conn, vlen) if vlen else b""
            status, payload, result = self._handle(op, key, val, arg)
            conn.sendall(_RESP.pack(status, len(payload), result) + payload)

    def _reject(self, peer, why: str) -> None:
        with self._count_lock:
            self.rejected += 1
            first = self.rejected == 1
        if first and debug_level() >= 1:
            print(f"helios: the store at {self.host}:{self.port} closed a connection from {peer[0]}:{peer[1]} "
                  f"that {why} (later ones are only counted: StoreServer.rejected)", file=sys.stderr, flush=True)

    def _handle(self, op: int, key: bytes, val: bytes, arg: int) -> tuple[int, bytes, int]:
        with self._cond:
            if op == _HELLO:
                ok = arg == self.world_size and val.decode() == self.job_id
                return (_OK if ok else _BAD), f"{self.world_size}|{self.job_id}".encode(), 0
            if op == _SET:
                self._data[key] = val
                self._cond.notify_all()
                return _OK, b"", 0
            if op == _ADD:
                cur = int(self._data.get(key, b"0")) + arg
                self._data[key] = str(cur).encode()
                self._cond.notify_all()
                return _OK, b"", cur
            if op == _CHECK:
                return (_OK if key in self._data else _MISSING), b"", 0
            if op == _DELETE:
                existed = self._data.pop(key, None) is not None
                return (_OK if existed else _MISSING), b"", 0
            if op == _GET:
                deadline = time.monotonic() + arg / 1000.0
                while key not in self._data:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return _MISSING, b"", 0
                    self._cond.wait(min(left, 1.0))
                return _OK, self._data[key], 0
        return _BAD, b"unknown op", 0

    def connected(self) -> int:
        """The connections that proved the job's secret and are open now."""
        with self._count_lock:
            return self._proven

    def wait_idle(self, timeout: float) -> None:
        """Wait until no proven connection is open, at most ``timeout`` seconds, saying on stderr
        after a second that it waits."""
        start, told = time.monotonic(), False
        while (n := self.connected()) and time.monotonic() - start < timeout:
            if not told and time.monotonic() - start > 1.0:
                print(f"helios.comm: this process hosts the job's store; waiting up to {timeout:.0f} s for the {n} "
                      "rank(s) still connected to it to finish", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.05)

    def finished(self) -> bool:
        """Whether it is closed and no proven connection is open: nothing left to wait for at exit."""
        return self._closed and not self.connected()

    def close(self) -> None:
        """Stop accepting connections (the open ones are served until they close or the process exits)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _bind(host: str, port: int, retry_s: float) -> socket.socket:
    """A socket bound to ``host:port``, retrying a port in use for ``retry_s`` seconds."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind((host, port))
            return sock
        except OSError as e:
            # A port held by a socket in TIME_WAIT or by a job that is just exiting frees
            # itself within seconds; a port held by a live server does not.
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                sock.close()
                hint = ("Another job holds the port: pick a free one with MASTER_PORT (helios-run picks one when "
                        "--master-port is 0)." if e.errno == errno.EADDRINUSE else
                        "MASTER_ADDR must be an address of rank 0's host.")
                raise CommError(f"helios.comm: the store cannot listen on {host}:{port}: {e.strerror}. {hint}") from None
            time.sleep(0.2)


class TCPStore:
    """Client of a :class:`StoreServer`; rank 0 also starts the server (``is_server=True``).

    ``secret`` is the job's (comm/auth.py; None: :func:`helios.comm.auth.job_secret`, from the
    environment); every rank must hold the same one.  A job of several ranks without one runs
    only when ``host`` is a loopback address; a one-rank job without one makes up its own
    (nobody else joins)."""

    def __init__(self, host: str, port: int, world_size: int, *, is_server: bool = False, timeout: float = 300.0,
                 job_id: str = "", bind_retry_s: float = 5.0, secret: bytes | None = None) -> None:
        self.host, self.timeout = host, timeout
        secret = auth.job_secret() if secret is None else secret
        resolved = resolve(host)
        auth.check_exposure(secret, host, resolved, world_size)
        if not secret and world_size == 1 and is_server:
            secret = auth.new_secret().encode()
        self.secret = secret
        self.server = StoreServer(listen_address(host, resolved, world_size, secret), port, world_size, job_id,
                                  bind_retry_s, secret, linger_s=min(timeout, LINGER_MAX_S)) if is_server else None
        if self.server is not None:
            _host(self.server)
        self.port = self.server.port if self.server else port
        self._lock = threading.Lock()
        self._sock = self._connect(timeout)
        _CLIENTS.add(self)
        status, payload, _ = self._call(_HELLO, b"", job_id.encode(), world_size, timeout)
        if status != _OK:
            their_world, their_job = payload.decode().split("|", 1)
            self.close()
            raise CommError(
                f"helios.comm: the store at {host}:{self.port} serves a job with world size {their_world} and job id "
                f"{their_job!r}, this rank expects world size {world_size} and job id {job_id!r}. Two jobs share "
                "MASTER_PORT, or WORLD_SIZE differs between ranks: fix the launch line."
            )

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        delay, last = 0.05, None
        while True:
            why = None
            try:
                s = socket.create_connection((self.host, self.port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                s.settimeout(max(0.1, min(auth.AUTH_TIMEOUT_S, deadline - time.monotonic())))
                why = auth.connect(s, self.secret, _LABEL)
                if why is None:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return s
                s.close()
                last = why
            except OSError as e:
                last = e
            if why is not None and why != auth.UNGREETED:  # a store that refuses our proof will keep refusing it
                raise CommError(f"helios.comm: the store at {self.host}:{self.port} {why}: every rank needs the same "
                                "HELIOS_JOB_SECRET (helios-run hands its ranks one), or another job holds MASTER_PORT.")
            if time.monotonic() + delay > deadline:
                raise CommError(
                    f"helios.comm: could not reach the store at {self.host}:{self.port} within {timeout:.0f} s "
                    f"(last error: {last}). Is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _call(self, op: int, key: bytes, val: bytes, arg: int, timeout: float) -> tuple[int, bytes, int]:
        if len(key) > MAX_KEY_BYTES or len(val) > MAX_VALUE_BYTES:
            raise CommError(f"helios.comm: store key {key[:64].decode(errors='replace')!r} ({len(key)} B, value "
                            f"{len(val)} B) is over the store's limits ({MAX_KEY_BYTES} B keys, {MAX_VALUE_BYTES} B "
                            "values); keep large data off the store.")
        with self._lock:
            try:
                self._sock.settimeout(timeout + 5.0)
                self._sock.sendall(_REQ.pack(op, len(key), len(val), arg) + key + val)
                status, plen, result = _RESP.unpack(_recv_exact(self._sock, _RESP.size))
                if plen > MAX_VALUE_BYTES:
                    raise ConnectionError(f"a {plen}-byte answer, over the store's value limit")
                payload = _recv_exact(self._sock, plen) if plen else b""
                return status, payload, result
            except (OSError, ConnectionError) as e:
                raise CommError(
                    f"helios.comm: lost the store at {self.host}:{self.port} ({e}); rank 0, which hosts it, "
                    "has probably exited."
                ) from None

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``."""
        self._call(_SET, key.encode(), bytes(value), 0, self.timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Value of ``key``, waiting until it is set or ``timeout`` passes (CommError)."""
        t = self.timeout if timeout is None else timeout
        status, payload, _ = self._call(_GET, key.encode(), b"", int(t * 1000), t)
        if status != _OK:
            raise CommError(
                f"helios.comm: store key {key!r} was not set within {t:.1f} s (store {self.host}:{self.port}); "
                "a rank did not arrive or is stuck before this point."
            )
        return payload

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the integer at ``key`` (0 when unset) and return the new value."""
        return self._call(_ADD, key.encode(), b"", delta, self.timeout)[2]

    def check(self, key: str) -> bool:
        """Whether ``key`` is set."""
        return self._call(_CHECK, key.encode(), b"", 0, self.timeout)[0] == _OK

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        return self._call(_DELETE, key.encode(), b"", 0, self.timeout)[0] == _OK

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Wait until every key is set (one shared deadline)."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        for k in keys:
            self.get(k, max(0.0, deadline - time.monotonic()))

    def close(self, linger: bool = True) -> None:
        """Close the connection (and the server, on rank 0: no new connections; the other ranks'
        open ones are served until they close, and waited for at a clean exit unless ``linger`` is
        False: the job failed, and its other ranks may never close theirs)."""
        try:
            self._sock.close()
        finally:
            if self.server is not None:
                self.server.close()
                if not linger and self.server in _HOSTED:
                    _HOSTED.remove(self.server)


def _host(server: StoreServer) -> None:
    """Keep ``server`` (hosted by this process) for the wait at exit, and let go of the finished
    ones (a process that makes store after store keeps only those still in use); the first time,
    wrap sys.excepthook so that an exit on an uncaught exception can be told from a clean one."""
    global _hooked
    if not _hooked:
        sys.excepthook = _flag_uncaught(sys.excepthook)
        _hooked = True
    _HOSTED[:] = [s for s in _HOSTED if not s.finished()]
    _HOSTED.append(server)


def _flag_uncaught(previous):
    """An exception hook that notes the process is exiting on an uncaught exception, then calls ``previous``."""
    def hook(*exc_info):
        global _uncaught
        _uncaught = True
        previous(*exc_info)
    return hook


def _drain_at_exit() -> None:
    """At exit: close this process's own connections to any store, then, unless exiting on an
    uncaught exception, wait for the other processes' connections to each store this process
    hosts to close (StoreServer.wait_idle, up to the server's wait).  Registered when this module
    is imported, before helios.comm's destroy_process_group, so it runs after that (atexit runs
    last-registered first): this rank's groups are closed, and ranks waiting on it in a collective
    learn it has left, before it waits for them."""
    for client in list(_CLIENTS):
        client._sock.close()
    for server in _HOSTED:
        if not _uncaught:
            server.wait_idle(server.linger_s)
        server.close()


atexit.register(_drain_at_exit)


class PrefixStore:
    """A view of a store whose keys are scoped as ``prefix/key``."""

    def __init__(self, prefix: str, store: TCPStore | PrefixStore) -> None:
        self.prefix, self.store = prefix, store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        """Set ``prefix/key``."""
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Get ``prefix/key`` (waits)."""
        return self.store.get(self._k(key), timeout)

    def add(self, key: str, delta: int) -> int:
        """Atomic add on ``prefix/key``."""
        return self.store.add(self._k(key), delta)

    def check(self, key: str) -> bool:
        """Whether ``prefix/key`` is set."""
        return self.store.check(self._k(key))

    def delete(self, key: str) -> bool:
        """Remove ``prefix/key``."""
        return self.store.delete(self._k(key))

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Wait for several keys under the prefix."""
        self.store.wait([self._k(k) for k in keys], timeout)
