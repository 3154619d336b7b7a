"""Only the job's ranks get in (comm/auth.py): the store and the TCP data plane against a client
without the job's secret, on loopback and across two namespace hosts.

The job is this file run as a script (``python test_comm_auth.py attacked``) under helios-run:
rank 0 writes the store's port to a file once every rank has joined, the ranks all-reduce
known integers until a stop file appears, and rank 0 then reports what the store holds and
how many connections it refused.  The attacks run from the test meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helios.comm import auth
from helios.comm.launcher import free_port
from helios.comm.store import _GET, _REQ, _RESP, _SET, MAX_VALUE_BYTES, PrefixStore, StoreServer, TCPStore
from helios.comm.tcp import TcpTransport

from helios.errors import CommError

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from cluster_fixture import clusters  # noqa: E402
from ranks import finish  # noqa: E402

PY = sys.executable
GREETING = len(auth.MAGIC) + auth.NONCE_BYTES
FLOOD = 100
fake_cluster = pytest.fixture(clusters, name="fake_cluster")


# =============================================================================== rank side
def rank_attacked() -> None:
    import helios.comm as dist
    from helios.comm import api

    dist.init_process_group(backend="tcp", timeout=60)
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:  # every rank has joined: the attacks may start
        ready = os.environ["AUTH_TEST_READY"]
        with open(ready + ".tmp", "w") as f:
            f.write(os.environ["MASTER_PORT"])
        os.rename(ready + ".tmp", ready)
    base = np.arange(4096, dtype=np.int64) % 1000
    want = (base * n + n * (n - 1) // 2).astype(np.int32)
    steps = bad = 0
    parent, give_up = os.getppid(), time.monotonic() + 180  # a test that died never leaves ranks spinning
    while True:
        done = os.path.exists(os.environ["AUTH_TEST_STOP"]) or os.getppid() != parent or time.monotonic() > give_up
        stop = np.array([int(r == 0 and done)], np.int32)
        dist.broadcast(stop, src=0)
        if stop[0]:
            break
        x = (base + r).astype(np.int32)
        dist.all_reduce(x)
        bad += not np.array_equal(x, want)
        steps += 1
    res = {"rank": r, "steps": steps, "bad": bad,
           "secret": hashlib.sha256(os.environ.get("HELIOS_JOB_SECRET", "").encode()).hexdigest()[:12]}
    if r == 0:
        store = api._S.store
        res.update(rejected=store.server.rejected, listen=store.server.host, evil=store.check("evil"),
                   info0_pid=json.loads(store.get("init0/info/0"))["pid"], pid=os.getpid())
    print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()  # rank 0 hosts the store: nobody leaves before every rank has reported
    dist.destroy_process_group()


# ============================================================================== test side
def _launch_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HELIOS_LAUNCHER", "HELIOS_JOB_ID",
                        "HELIOS_JOB_SECRET", "HELIOS_JOB_SECRET_FILE", "HELIOS_COMM_BACKEND")}
    env.update(LP_NUM_THREADS="1", OMP_NUM_THREADS="1", AUTH_TEST_READY=str(tmp_path / "ready"),
               AUTH_TEST_STOP=str(tmp_path / "stop"), **extra)
    return env


def _wait_ready(tmp_path, procs, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    ready = tmp_path / "ready"
    while not ready.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            outs = finish(procs, 5)
            raise AssertionError(f"the job never got ready: {[(c, o[-1500:], e[-3000:]) for c, o, e in outs]}")
        time.sleep(0.05)
    return int(ready.read_text())


def _stop(procs) -> None:
    """End launchers still running: SIGTERM (helios-run stops its ranks), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def _results(outs) -> dict[int, dict]:
    res = {}
    for code, o, e in outs:
        assert code == 0, f"helios-run exited {code}:\n{o[-3000:]}\n{e[-3000:]}"
        for line in o.splitlines():
            if "RESULT " in line:
                r = json.loads(line.split("RESULT ", 1)[1])
                res[r["rank"]] = r
    return res


def _exchange(addr: str, port: int, data: bytes, half_close: bool = True) -> bytes:
    """Connect, send ``data`` (half-closing after it), and return all the server sent back until it closed."""
    with socket.create_connection((addr, port), timeout=10) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:  # closed with our bytes unread: the greeting may be lost with them
            pass
    return got


def _only_greeting(got: bytes) -> bool:
    """Whether a stranger got nothing but the store's challenge (or not even that)."""
    return len(got) in (0, GREETING) and got[:len(auth.MAGIC)] in (b"", auth.MAGIC)


def _attack_store(addr: str, port: int) -> int:
    """Every attack of a client without the secret on the store at ``addr:port``; returns how many
    connections it made (each one the store must refuse and count)."""
    # A GET of the transport token and a SET of rank 0's info, as plain frames: the store answers
    # with its greeting only (a challenge), and closes without reading a frame.
    for frame in (_REQ.pack(_GET, 11, 0, 1000) + b"init0/token",
                  _REQ.pack(_SET, 12, 2, 0) + b"init0/info/0" + b"{}",
                  _REQ.pack(_SET, 4, 4, 0) + b"evil" + b"evil"):
        got = _exchange(addr, port, frame)
        assert len(got) == GREETING and got.startswith(auth.MAGIC), got  # half-closed: the store read it all
    # A frame header announcing 4 GiB key and value: never parsed, nothing allocated.
    got = _exchange(addr, port, _REQ.pack(_SET, 0xFFFFFFFF, 0xFFFFFFFF, 0) + bytes(64), half_close=False)
    assert _only_greeting(got), got
    # The handshake done right, with the wrong secret: refused, and the store proves nothing back.
    with socket.create_connection((addr, port), timeout=10) as s:
        assert auth.connect(s, b"not the job's secret", b"helios-store") == "refused this side's proof of the job secret"
    # A flood: FLOOD connections at once, each sending an oversized frame header and holding on.
    flood = []
    try:
        for _ in range(FLOOD):
            s = socket.create_connection((addr, port), timeout=10)
            s.sendall(_REQ.pack(_SET, 0xFFFFFFFF, 0xFFFFFFFF, 0))
            flood.append(s)
        time.sleep(0.5)  # the job keeps stepping meanwhile
    finally:
        for s in flood:
            s.close()
    return 5 + FLOOD


def _check_job(res: dict[int, dict], ranks: int, refused: int) -> None:
    assert sorted(res) == list(range(ranks)), res
    for r, x in res.items():
        assert x["bad"] == 0 and x["steps"] > 0, x
    assert len({x["secret"] for x in res.values()}) == 1  # one secret for the whole job
    zero = res[0]
    assert not zero["evil"] and zero["info0_pid"] == zero["pid"], zero  # nothing written
    assert zero["rejected"] == refused, zero


@pytest.mark.multiproc
def test_a_client_without_the_secret_gets_nothing_from_a_running_job(tmp_path):
    """Two ranks under helios-run (which makes up the job's secret) on loopback, over tcp."""
    env = _launch_env(tmp_path, HELIOS_DEBUG="1")
    port = free_port("127.0.0.1")
    procs = [subprocess.Popen([PY, "-m", "helios.comm.launcher", "--nproc-per-node", "2", "--master-port", str(port),
                               HERE, "attacked"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        assert _wait_ready(tmp_path, procs) == port
        refused = _attack_store("127.0.0.1", port)
        time.sleep(0.5)  # the store counts the flood's connections as they close
        (tmp_path / "stop").touch()
        outs = finish(procs, 60)
    finally:
        _stop(procs)
    res = _results(outs)
    _check_job(res, 2, refused)
    assert res[0]["listen"] == "127.0.0.1"  # the master address, not every interface
    assert res[0]["secret"] != hashlib.sha256(b"").hexdigest()[:12]  # helios-run handed its ranks one
    err = outs[0][2]
    assert err.count("closed a connection from") == 1, err[-3000:]  # logged once at HELIOS_DEBUG=1


def test_job_secret_sources_and_refusals(tmp_path, monkeypatch):
    assert auth.job_secret({"HELIOS_JOB_SECRET": " 0123456789abcdef\n"}) == b"0123456789abcdef"
    assert auth.job_secret({}) == b""
    f = tmp_path / "secret"
    f.write_text("fedcba9876543210fedcba\n")
    f.chmod(0o600)
    assert auth.job_secret({"HELIOS_JOB_SECRET_FILE": str(f)}) == b"fedcba9876543210fedcba"
    f.chmod(0o640)
    with pytest.raises(CommError, match=f"HELIOS_JOB_SECRET_FILE={f} may be read by group or others"):
        auth.job_secret({"HELIOS_JOB_SECRET_FILE": str(f)})
    with pytest.raises(CommError, match="cannot read HELIOS_JOB_SECRET_FILE"):
        auth.job_secret({"HELIOS_JOB_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(CommError, match="at least 16"):
        auth.job_secret({"HELIOS_JOB_SECRET": "short"})
    # Several ranks, a store reachable from the network, no secret: refused before anything listens.
    monkeypatch.delenv("HELIOS_JOB_SECRET", raising=False)
    monkeypatch.delenv("HELIOS_JOB_SECRET_FILE", raising=False)
    with pytest.raises(CommError, match=r"MASTER_ADDR=192\.0\.2\.1 .* no secret: set HELIOS_JOB_SECRET"):
        TCPStore("192.0.2.1", 1, 2, is_server=True, timeout=1)
    auth.check_exposure(b"", "localhost", "127.0.0.1", 2)  # loopback: this host's processes only
    auth.check_exposure(b"", "10.0.0.1", "10.0.0.1", 1)  # one rank: it makes up its own secret


def test_store_bounds_deadline_and_frame_limits():
    secret = b"0123456789abcdef0123"
    server = StoreServer("127.0.0.1", 0, 1, "j", secret=secret, auth_timeout_s=0.3)
    try:
        # Silence: closed after the deadline, having sent nothing but its challenge.
        t0 = time.monotonic()
        assert len(_exchange("127.0.0.1", server.port, b"", half_close=False)) == GREETING
        assert time.monotonic() - t0 < 3.0
        # The bound (4 x 1 + 16 connections proving at once): the ones over it are closed at once,
        # and a rank joining meanwhile is let in as soon as the strangers' deadline frees a slot.
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(server.max_connections)]
        time.sleep(0.1)
        assert _exchange("127.0.0.1", server.port, b"", half_close=False) == b""
        store = TCPStore("127.0.0.1", server.port, 1, timeout=10, job_id="j", secret=secret)
        for s in held:
            s.close()
        time.sleep(0.2)
        assert server.rejected >= 2 + server.max_connections  # silence, over the bound, the held ones timed out
        before = server.rejected
        store.set("k", b"v")
        assert store.get("k") == b"v"
        with pytest.raises(CommError, match="over the store's limits"):
            store.set("big", bytes(MAX_VALUE_BYTES + 1))
        # A proven client's oversized frame: answered with the limits and closed; the store serves on.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            assert auth.connect(s, secret, b"helios-store") is None
            s.sendall(_REQ.pack(_SET, 5000, 0, 0))
            status, plen, _ = _RESP.unpack(s.recv(_RESP.size, socket.MSG_WAITALL))
            assert status == 2 and b"limits" in s.recv(plen, socket.MSG_WAITALL) and s.recv(1) == b""
        assert store.get("k") == b"v"
        with pytest.raises(CommError, match="refused this side's proof of the job secret"):
            TCPStore("127.0.0.1", server.port, 1, timeout=5, job_id="j", secret=b"another job's secret!")
        store.close()
        assert server.rejected == before + 2  # the oversized frame, the wrong secret
    finally:
        server.close()


def test_tcp_data_plane_admits_only_the_key_holder():
    """A mesh listener refuses a peer with the wrong key (and a silent one) and still pairs the true peer."""
    store = TCPStore("127.0.0.1", 0, 2, is_server=True, timeout=10, job_id="j", secret=b"0123456789abcdef")
    other = TCPStore("127.0.0.1", store.port, 2, timeout=10, job_id="j", secret=b"0123456789abcdef")  # rank 1's
    key = auth.link_key(store.secret, b"token")
    made: dict[int, TcpTransport] = {}
    t = threading.Thread(target=lambda: made.setdefault(0, TcpTransport(PrefixStore("g", store), 0, 2, "127.0.0.1",
                                                                        key, 20)))
    t.start()
    try:
        host, port = other.get("g/tcp/0", 10).decode().rsplit(":", 1)
        silent = socket.create_connection((host, int(port)), timeout=5)  # holds one slot, says nothing
        with socket.create_connection((host, int(port)), timeout=5) as s:
            wrong = auth.link_key(b"someone else's secret", b"token")
            assert auth.connect(s, wrong, b"helios-tcp", (1).to_bytes(4, "little")) is not None
        with pytest.raises(CommError, match="every rank needs the same HELIOS_JOB_SECRET"):
            TcpTransport(PrefixStore("g", other), 1, 2, "127.0.0.1", wrong, 5)
        one = TcpTransport(PrefixStore("g", other), 1, 2, "127.0.0.1", key, 10)
        t.join(10)
        zero = made[0]
        msg = b"only ranks with the key"
        assert one.links[0].send_some(memoryview(msg)) == len(msg)
        buf = bytearray(len(msg))
        deadline = time.monotonic() + 5
        got = 0
        while got < len(msg) and time.monotonic() < deadline:
            got += zero.links[1].recv_some(memoryview(buf)[got:])
        assert bytes(buf) == msg
        silent.close()
        one.close()
        zero.close()
    finally:
        t.join(10)
        other.close()
        store.close()


@pytest.mark.multiproc
def test_two_hosts_store_listens_on_the_master_address_and_refuses_strangers(fake_cluster, tmp_path):
    """One rank on each of two namespace hosts; the attacker is a process on host 1 without the secret."""
    c = fake_cluster(2)
    h0, h1 = c.hosts
    # Without a secret a store reachable from the network is refused, in one line that says what to set.
    env = _launch_env(tmp_path)
    r = h1.run([PY, HERE, "attacked"], check=False, timeout=60,
               env=dict(env, RANK="1", WORLD_SIZE="2", MASTER_ADDR=h0.addr, MASTER_PORT="29500"))
    assert r.returncode != 0 and "no secret: set HELIOS_JOB_SECRET" in r.stderr.strip().splitlines()[-1], r.stderr
    env = _launch_env(tmp_path, HELIOS_JOB_SECRET=auth.new_secret())
    procs = [h.popen([PY, "-m", "helios.comm.launcher", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank",
                      str(k), "--master-addr", h0.addr, "--master-port", "29500", HERE, "attacked"], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k, h in enumerate(c.hosts)]
    try:
        port = _wait_ready(tmp_path, procs)
        attack = (f"import sys; sys.path.insert(0, {os.path.dirname(HERE)!r}); import test_comm_auth as t; "
                  f"print(t._attack_store({h0.addr!r}, {port}))")
        refused = int(h1.python(attack, timeout=60).stdout)
        # Rank 0's store listens on the master address only: on host 0's loopback nothing answers.
        probe = h0.python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)", check=False)
        assert "ConnectionRefusedError" in probe.stderr, probe.stderr
        time.sleep(0.5)
        (tmp_path / "stop").touch()
        outs = finish(procs, 60)
    finally:
        _stop(procs)
    res = _results(outs)
    _check_job(res, 2, refused)
    assert res[0]["listen"] == h0.addr


if __name__ == "__main__":
    globals()["rank_" + sys.argv[1]]()
