"""The fake cluster itself (scripts/fake_cluster.sh, tests/cluster_fixture.py): hosts made of
namespaces reach each other, have their own hostnames and /dev/shm, resolve each other's
names, are entered by name as over ssh (``rsh``), and their links carry about the rate they
are shaped to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_fixture import SCRIPT, FakeCluster, clusters, unavailable  # noqa: E402

pytestmark = pytest.mark.multiproc
fake_cluster = pytest.fixture(clusters, name="fake_cluster")

# ICMP echo with a raw socket (no ping binary needed): exit 0 when the reply comes.
PING = r"""
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xFFFF); s += s >> 16
    return ~s & 0xFFFF
ident = os.getpid() & 0xFFFF
pkt = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"helios"
pkt = pkt[:2] + struct.pack("!H", csum(pkt)) + pkt[4:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(2.0)
s.sendto(pkt, (sys.argv[1], 0))
end = time.monotonic() + 2
while time.monotonic() < end:
    data, src = s.recvfrom(2048)
    ihl = (data[0] & 15) * 4
    typ, _, _, rid, _ = struct.unpack("!BBHHH", data[ihl:ihl + 8])
    if typ == 0 and rid == ident and src[0] == sys.argv[1]:
        print("reply from", src[0]); sys.exit(0)
sys.exit(1)
"""

SINK = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 5001)); srv.listen(1); print("listening", flush=True)
c, _ = srv.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""

SOURCE = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], 5001)); s.sendall(b"\0" * int(sys.argv[2])); s.close()
"""


def test_hosts_ping_have_own_hostname_and_shm(fake_cluster):
    c = fake_cluster(2)
    h0, h1 = c.hosts
    assert h0.run([sys.executable, "-c", PING, h1.addr]).returncode == 0
    assert h1.run([sys.executable, "-c", PING, h0.addr]).returncode == 0
    names = [h.run(["hostname"]).stdout.strip() for h in c.hosts]
    assert names[0] != names[1] and names == [h.name for h in c.hosts], names
    assert os.uname().nodename not in names
    # Every host resolves every host's name (its own /etc/hosts); the real host's is untouched.
    assert h0.run(["getent", "hosts", h1.name]).stdout.split() == [h1.addr, h1.name]
    assert h1.run(["getent", "hosts", h0.name]).stdout.split() == [h0.addr, h0.name]
    assert h1.name not in open("/etc/hosts").read()
    # rsh, the launch agent: one shell command line, in the named host, with a login's environment only.
    agent = c.rsh_agent().split()
    r = subprocess.run([*agent, h1.name, "echo", "$(hostname)", '"[$HELIOS_PROBE]"'], capture_output=True,
                       text=True, env=dict(os.environ, HELIOS_PROBE="leaked"), timeout=30)
    assert r.returncode == 0 and r.stdout.split() == [h1.name, "[]"], r
    assert subprocess.run([*agent, h0.addr, "hostname"], capture_output=True, text=True).stdout.strip() == h0.name
    r = subprocess.run([*agent, "nohost", "true"], capture_output=True, text=True)
    assert r.returncode != 0 and "no host named nohost" in r.stderr, r
    h0.run(["sh", "-c", "echo hello > /dev/shm/helios-fake-probe"])
    assert h0.run(["cat", "/dev/shm/helios-fake-probe"]).stdout.strip() == "hello"
    assert h1.run(["test", "-e", "/dev/shm/helios-fake-probe"], check=False).returncode == 1
    assert not os.path.exists("/dev/shm/helios-fake-probe")  # nor in the real host's
    # The addresses are the namespaces': the root namespace has no 10.77.0.x.
    assert "10.77.0." not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout


def test_shaped_link_carries_about_its_rate(fake_cluster):
    rate_bps = 100e6
    c = fake_cluster(2, rate="100mbit")
    h0, h1 = c.hosts
    sink = h1.popen([sys.executable, "-c", SINK, h1.addr], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None and sink.stdout.readline().startswith("listening")
        nbytes = 8 << 20
        h0.run([sys.executable, "-c", SOURCE, h1.addr, str(nbytes)], timeout=60)
        got, secs = sink.stdout.readline().split()
        sink.wait(timeout=30)
    finally:
        sink.kill()
        sink.wait()
    assert int(got) == nbytes
    gbps = nbytes * 8 / float(secs)
    # tbf counts frames (headers too): payload goes at ~0.95 of the rate; the 256 kB burst adds a little.
    print(f"measured {gbps / 1e6:.1f} Mbit/s")
    assert 0.8 * rate_bps < gbps < 1.1 * rate_bps, f"{gbps / 1e6:.1f} Mbit/s over a 100 Mbit/s link"


def test_down_removes_everything_also_after_a_failure():
    why = unavailable()
    if why:
        pytest.skip(why)
    c = FakeCluster(3)
    with pytest.raises(RuntimeError, match="boom"):
        with c:
            assert len(c.hosts) == 3
            raise RuntimeError("boom")
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert c.prefix + "-" not in r
    assert not os.path.exists(f"/run/helios-fake-cluster/{c.prefix}")
    # down on nothing is fine
    assert subprocess.run([SCRIPT, "down", "--prefix", c.prefix]).returncode == 0
