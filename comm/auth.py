"""Who may talk to a job: its secret, and the handshake that proves a peer holds it.

Every connection to the rendezvous store and every link of the TCP data plane starts with a
mutual challenge-response.  The accepting side sends a magic and a random nonce; the
connecting side answers with its own nonce, optional fixed-size ``extra`` bytes (the TCP
mesh sends its rank) and HMAC-SHA256(key, label | "c" | server nonce | client nonce | extra);
the accepting side checks it with ``hmac.compare_digest`` and only then answers with the
MAC of the other direction, which the connecting side checks.  The key never travels, and
fresh nonces on both sides make a recorded handshake useless later.

Where the secret comes from (:func:`job_secret`): ``HELIOS_JOB_SECRET``, else the file named
by ``HELIOS_JOB_SECRET_FILE`` (refused when group or others may read it), else none.
``helios-run`` generates one per job and hands it to its ranks.  Without a secret, a store
on a loopback address still runs (only this host's processes reach it); a store reachable
from the network refuses to start (:func:`check_exposure`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
from collections.abc import Mapping

from helios.errors import CommError

MAGIC = b"HLA1"
NONCE_BYTES = 16
MAC_BYTES = 32
AUTH_TIMEOUT_S = 5.0  # a connection that has not proved the secret by then is closed
MIN_SECRET_CHARS = 16
HOW_TO_SET = ("set HELIOS_JOB_SECRET to the same random string on every rank (e.g. "
              "`export HELIOS_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')`) "
              "or HELIOS_JOB_SECRET_FILE to a file only you can read")


def job_secret(env: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``HELIOS_JOB_SECRET`` or ``HELIOS_JOB_SECRET_FILE``; b"" when neither is set.

    A secret shorter than :data:`MIN_SECRET_CHARS`, or a file that group or others may read,
    is refused with a CommError naming the variable (or the file)."""
    env = os.environ if env is None else env
    text = env.get("HELIOS_JOB_SECRET", "")
    name = "HELIOS_JOB_SECRET"
    if not text and env.get("HELIOS_JOB_SECRET_FILE"):
        path = env["HELIOS_JOB_SECRET_FILE"]
        name = f"HELIOS_JOB_SECRET_FILE={path}"
        text = _read_private_file(path)
    text = text.strip()
    if text and len(text) < MIN_SECRET_CHARS:
        raise CommError(f"helios.comm: {name} holds {len(text)} characters; a job secret needs at least "
                        f"{MIN_SECRET_CHARS} (e.g. secrets.token_hex(16)).")
    return text.encode()


def _read_private_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read()
    except OSError as e:
        raise CommError(f"helios.comm: cannot read HELIOS_JOB_SECRET_FILE={path}: {e.strerror}.") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CommError(f"helios.comm: HELIOS_JOB_SECRET_FILE={path} may be read by group or others "
                        f"(mode {stat.S_IMODE(mode):04o}); `chmod 600 {path}`.")
    return text


def new_secret() -> str:
    """A fresh job secret (what helios-run hands its ranks)."""
    return secrets.token_hex(16)


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an IPv4 address) is a loopback address."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def check_exposure(secret: bytes, master_addr: str, resolved: str, world_size: int) -> None:
    """Refuse (CommError, one line) a job of several ranks whose store is reachable from the network
    (``resolved``, the store's address, is not loopback) when it has no secret."""
    if secret or world_size <= 1 or is_loopback(resolved):
        return
    raise CommError(f"helios.comm: the store at MASTER_ADDR={master_addr} ({resolved}) is reachable from the "
                    f"network and this job has no secret: {HOW_TO_SET}; helios-run sets one on a single host.")


def link_key(secret: bytes, token: bytes) -> bytes:
    """The key of one communicator's data-plane handshakes: the job secret bound to the
    communicator's token (without a secret, the token alone, which only the store's clients know)."""
    return hmac.new(secret, b"helios-link|" + token, hashlib.sha256).digest()


def _mac(key: bytes, label: bytes, side: bytes, snonce: bytes, cnonce: bytes, extra: bytes) -> bytes:
    return hmac.new(key, b"|".join((label, side, snonce, cnonce, extra)), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        buf += chunk
    return bytes(buf)


def accept(sock: socket.socket, key: bytes, label: bytes, extra_bytes: int = 0) -> bytes | None:
    """Accepting side of the handshake on a connected socket (its timeout is the caller's deadline).

    Returns the peer's ``extra`` bytes when it proved ``key``, None for a stranger (wrong key,
    garbage, silence past the timeout, or a closed connection); nothing is read beyond the
    fixed-size answer, so a stranger cannot make this side allocate or wait longer."""
    snonce = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + snonce)
        msg = _recv_exact(sock, NONCE_BYTES + extra_bytes + MAC_BYTES)
    except (OSError, ConnectionError):
        return None
    cnonce, extra, mac = msg[:NONCE_BYTES], msg[NONCE_BYTES:-MAC_BYTES], msg[-MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, label, b"c", snonce, cnonce, extra)):
        return None
    try:
        sock.sendall(_mac(key, label, b"s", snonce, cnonce, extra))
    except OSError:
        return None
    return extra


UNGREETED = "closed the connection before its greeting (it is full, or it is not a Helios endpoint)"


def connect(sock: socket.socket, key: bytes, label: bytes, extra: bytes = b"") -> str | None:
    """Connecting side of the handshake: None when the accepting side proved ``key`` too, else why not.

    :data:`UNGREETED` means the other side closed before greeting (a store at its connection
    bound closes new connections at once; worth a retry); the other reasons are final: it
    refused this side's proof, did not prove the key itself, or is not a Helios endpoint.
    Socket timeouts are the caller's."""
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    except (OSError, ConnectionError):
        return UNGREETED
    if hello[:len(MAGIC)] != MAGIC:
        return "is not a Helios endpoint (no handshake greeting)"
    snonce, cnonce = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    try:
        sock.sendall(cnonce + extra + _mac(key, label, b"c", snonce, cnonce, extra))
        proof = _recv_exact(sock, MAC_BYTES)
    except (OSError, ConnectionError):
        return "refused this side's proof of the job secret"
    if not hmac.compare_digest(proof, _mac(key, label, b"s", snonce, cnonce, extra)):
        return "did not prove it holds the job secret"
    return None
