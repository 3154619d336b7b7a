"""The progress engine alone, over real loopback TCP links (no launcher, no store)."""

from __future__ import annotations

import select
import socket
import struct
import time

import numpy as np
import pytest

from helios.comm.engine import ABORT_MAGIC, HEADER, Engine, OpInfo, Transport
from helios.comm.tcp import TcpLink
from helios.errors import CommError


class _Pair(Transport):
    """Rank 0 of a world of 3 with one real TCP link, to rank 1; rank 2 is elsewhere."""

    name = "test"

    def __init__(self, ours: socket.socket) -> None:
        self.rank, self.world = 0, 3
        ours.setblocking(False)
        self.links = [None, TcpLink(ours, 1), None]

    def wait_activity(self, send_peers, recv_peers, timeout):
        fds = [self.links[p].fd for p in set(send_peers) | set(recv_peers) if self.links[p] is not None]
        select.select(fds, fds, [], timeout)


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    return a, b


def test_a_broken_pipe_still_reads_the_abort_left_in_the_link():
    """Rank 1 aborted (naming rank 2) and reset the connection while rank 0 was still sending
    to it: rank 0's send fails first, yet the fault it reports is rank 2's, not rank 1's."""
    ours, theirs = _loopback_pair()
    try:
        what = b"closed the connection (it exited, crashed or gave up)"
        theirs.sendall(HEADER.pack(ABORT_MAGIC, 2, 1, len(what)) + what)
        ours.send(b"x" * 1000)  # unread input on rank 1's side: its close resets the connection
        time.sleep(0.05)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        theirs.close()
        time.sleep(0.05)
        eng = Engine(_Pair(ours))
        eng.info = OpInfo("all_reduce", 7, 1 << 20)
        eng.post_send(1, 5, np.zeros(1 << 20, np.uint8))
        with pytest.raises(CommError) as e:
            eng.wait_all(time.monotonic() + 5)
        assert "rank 2 closed the connection" in str(e.value) and "reported by rank 1" in str(e.value), str(e.value)
        assert (eng.fault.culprit, eng.fault.reporter) == (2, 1)
    finally:
        ours.close()


def test_a_plain_reset_blames_the_peer():
    """No abort frame in the link: the peer that reset the connection is the one at fault."""
    ours, theirs = _loopback_pair()
    try:
        ours.send(b"x" * 1000)
        time.sleep(0.05)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        theirs.close()
        time.sleep(0.05)
        eng = Engine(_Pair(ours))
        eng.post_send(1, 5, np.zeros(1 << 20, np.uint8))
        with pytest.raises(CommError, match=r"rank 1 dropped the connection"):
            eng.wait_all(time.monotonic() + 5)
        assert eng.fault.culprit == 1
    finally:
        ours.close()
