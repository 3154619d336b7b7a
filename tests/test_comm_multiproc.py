"""helios.comm across processes: exact collectives, faults, debug checks, launcher, two hosts.

Ranks are this file run as a script (``python test_comm_multiproc.py <mode>``), one process
group per (backend, world size), each checking many cases, so the suite stays short on a
2-core machine.  Every spawn has a hard timeout and every test kills what it started and
checks that no shared-memory segment is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helios.comm.launcher import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import finish, shm_job, shm_left, sigterm_launcher_when_ready  # noqa: E402

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
DTYPES = ["float32", "float16", "bfloat16", "int32", "int64", "uint8"]
OPS = ["sum", "avg", "max", "min", "prod"]
ALGS = ["auto", "ring", "tree", "halving_doubling"]


# =============================================================================== rank side
def _storage(dtype: str):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def _encode(vals: np.ndarray, dtype: str) -> np.ndarray:
    from helios.comm.reduce_ops import f32_to_bf16

    if dtype == "bfloat16":
        return f32_to_bf16(vals.astype(np.float32))
    return vals.astype(np.int64).astype(_storage(dtype)) if dtype in ("int32", "int64", "uint8") else vals.astype(dtype)


def _inputs(q: int, count: int, op: str, salt: int = 0) -> np.ndarray:
    """Small integers: every sum, product, avg of them is exact in every dtype (same exponent range)."""
    i = np.arange(count, dtype=np.int64) + salt
    if op == "prod":
        return 1 + (q + i) % 2
    if op in ("max", "min"):
        return (q * 7 + i) % 11
    return q % 3 + i % 3 + 1


def _expected(n: int, count: int, op: str, dtype: str, salt: int = 0) -> np.ndarray:
    from helios.comm.reduce_ops import f32_to_bf16

    vals = [_inputs(q, count, op, salt) for q in range(n)]
    if op in ("sum", "avg"):
        acc = sum(vals)
    elif op == "prod":
        acc = np.prod(vals, axis=0)
    else:
        acc = (np.maximum if op == "max" else np.minimum).reduce(vals)
    if op == "avg":
        if dtype in ("int32", "int64", "uint8"):
            return (acc.astype(np.int64).astype(_storage(dtype)) // np.array(n).astype(_storage(dtype)))
        q = acc.astype(np.float32) / np.float32(n)
        if dtype == "bfloat16":
            return f32_to_bf16(q)
        return q.astype(dtype)
    return _encode(acc, dtype)


class Checker:
    """Runs one case after another on the current process group and counts them."""

    def __init__(self) -> None:
        import helios.comm as dist

        self.d = dist
        self.r, self.n = dist.get_rank(), dist.get_world_size()
        self.cases = 0

    def eq(self, got: np.ndarray, exp: np.ndarray, what: str) -> None:
        self.cases += 1
        if got.shape != exp.shape or not np.array_equal(got.view(np.uint8), exp.view(np.uint8)):
            bad = np.nonzero(got != exp)[0][:5]
            raise AssertionError(f"rank {self.r}/{self.n} {what}: mismatch at {bad.tolist()}: got {got[bad]} "
                                 f"expected {exp[bad]}")

    def all_reduce(self, count: int, dtype: str, op: str, alg: str, g=None, ranks=None) -> None:
        d = self.d
        ranks = ranks or list(range(self.n))
        me = ranks.index(self.r)
        x = _encode(_inputs(me, count, op), dtype)
        d.all_reduce(x, op=op, algorithm=alg, dtype=dtype, group=g)
        self.eq(x, _expected(len(ranks), count, op, dtype), f"all_reduce {alg} {dtype} {op} n={count}")

    def all_gather(self, count: int, dtype: str, alg: str, inplace: bool) -> None:
        n, r = self.n, self.r
        exp = np.concatenate([_encode(_inputs(q, count, "sum", 5), dtype) for q in range(n)])
        out = np.zeros(count * n, dtype=_storage(dtype))
        if inplace:
            out[r * count:(r + 1) * count] = _encode(_inputs(r, count, "sum", 5), dtype)
            x = out[r * count:(r + 1) * count]
        else:
            x = _encode(_inputs(r, count, "sum", 5), dtype)
        self.d.all_gather(out, x, algorithm=alg, dtype=dtype)
        self.eq(out, exp, f"all_gather {alg} {dtype} n={count} inplace={inplace}")

    def reduce_scatter(self, count: int, dtype: str, op: str, alg: str, inplace: bool = False) -> None:
        n, r = self.n, self.r
        x = _encode(_inputs(r, count * n, op), dtype)
        out = x[r * count:(r + 1) * count] if inplace else np.zeros(count, dtype=_storage(dtype))
        self.d.reduce_scatter(out, x, op=op, algorithm=alg, dtype=dtype)
        full = _expected(n, count * n, op, dtype)
        self.eq(out, full[r * count:(r + 1) * count], f"reduce_scatter {alg} {dtype} {op} n={count} inplace={inplace}")

    def misaligned_all_reduce(self, count: int, dtype: str, alg: str) -> None:
        # An operand that starts one element into a larger array: not 64-byte aligned.
        big = np.zeros(count + 3, dtype=_storage(dtype))
        x = big[1:1 + count]
        x[...] = _encode(_inputs(self.r, count, "sum"), dtype)
        self.d.all_reduce(x, algorithm=alg, dtype=dtype)
        self.eq(x, _expected(self.n, count, "sum", dtype), f"misaligned all_reduce {alg} {dtype} n={count}")
        self.eq(big[[0, -2, -1]], np.zeros(3, dtype=big.dtype), "bytes around a misaligned operand")

    def broadcast(self, count: int, dtype: str, alg: str, src: int) -> None:
        x = _encode(_inputs(self.r, count, "sum", src), dtype)
        self.d.broadcast(x, src=src, algorithm=alg, dtype=dtype)
        self.eq(x, _encode(_inputs(src, count, "sum", src), dtype), f"broadcast {alg} {dtype} src={src} n={count}")

    def reduce(self, count: int, dtype: str, op: str, alg: str, dst: int) -> None:
        mine = _encode(_inputs(self.r, count, op), dtype)
        x = mine.copy()
        self.d.reduce(x, dst=dst, op=op, algorithm=alg, dtype=dtype)
        exp = _expected(self.n, count, op, dtype) if self.r == dst else mine
        self.eq(x, exp, f"reduce {alg} {dtype} {op} dst={dst} n={count}")

    def all_to_all(self, count: int, dtype: str) -> None:
        n, r = self.n, self.r
        x = np.concatenate([_encode(_inputs(r * n + j, count, "sum"), dtype) for j in range(n)])
        out = np.zeros_like(x)
        self.d.all_to_all(out, x, dtype=dtype)
        exp = np.concatenate([_encode(_inputs(j * n + r, count, "sum"), dtype) for j in range(n)])
        self.eq(out, exp, f"all_to_all {dtype} n={count}")


def rank_matrix(full: bool) -> None:
    """The exact-results matrix; prints ``OK <cases>``."""
    import helios.comm as dist

    dist.init_process_group(backend=os.environ["TEST_BACKEND"], timeout=float(os.environ.get("TEST_TIMEOUT", "60")))
    c = Checker()
    n, r = c.n, c.r
    # 0, 1, fewer than the ranks, not divisible by them, and across segment / slot boundaries
    # (the parent sets HELIOS_COMM_SEGMENT_BYTES=64 and HELIOS_SHM_SLOT_BYTES=512).
    sizes = sorted({0, 1, max(n - 1, 0), 2 * n + 1, 301})
    dtypes = DTYPES if full else ["float32", "bfloat16", "int64"]
    for alg in ALGS:
        for dt in dtypes:
            for count in sizes:
                c.all_reduce(count, dt, "sum", alg)
                c.all_gather(count, dt, alg, inplace=count % 2 == 1)
                c.reduce_scatter(count, dt, "sum", alg, inplace=count % 2 == 1)
                c.broadcast(count, dt, alg, src=count % n)
                c.reduce(count, dt, "max" if count % 2 else "sum", alg, dst=(count + 1) % n)
            for op in OPS:
                c.all_reduce(29, dt, op, alg)
                c.reduce_scatter(5, dt, op, alg)
        c.misaligned_all_reduce(301, "float32", alg)
        c.misaligned_all_reduce(37, "float16", alg)
        for root in range(n):
            c.broadcast(33, "int32", alg, src=root)
            c.reduce(33, "int32", "sum", alg, dst=root)
    if full:
        for dt in DTYPES:
            for op in OPS:
                for count in sizes:
                    c.all_reduce(count, dt, op, "auto")
    for dt in dtypes:
        for count in (0, 1, 3, 70):
            c.all_to_all(count, dt)
    # A Helios tensor (duck-typed: .numpy() and .copy_()) that hands bfloat16 out widened to float32.
    class FakeTensor:
        dtype = "bfloat16"

        def __init__(self, data: np.ndarray) -> None:
            self.data = data

        def numpy(self) -> np.ndarray:
            return self.data.copy()

        def copy_(self, arr: np.ndarray) -> None:
            self.data[...] = arr

    t = FakeTensor((_inputs(r, 41, "sum") + 0.5).astype(np.float32))
    dist.all_reduce(t)
    exp = (sum(_inputs(q, 41, "sum") for q in range(n)) + 0.5 * n).astype(np.float32)
    c.eq(t.data, exp, "tensor all_reduce (bfloat16)")
    # Large enough for several shm slot pieces and the two-phase direct path.
    c.all_reduce(40_000, "float32", "sum", "auto")
    c.all_reduce(40_000, "bfloat16", "avg", "ring")
    # Many asynchronous operations in flight, then wait on all of them.
    xs = [_encode(_inputs(r, 50 + k, "sum"), "int32") for k in range(64)]
    works = [dist.all_reduce(x, async_op=True, algorithm=ALGS[k % 4]) for k, x in enumerate(xs)]
    outs = [np.zeros(3 * n, np.int64) for _ in range(8)]
    works += [dist.all_gather(o, np.full(3, r, np.int64), async_op=True) for o in outs]
    for w in works:
        w.wait()
    for k, x in enumerate(xs):
        c.eq(x, _expected(n, 50 + k, "sum", "int32"), f"async all_reduce #{k}")
    for o in outs:
        c.eq(o, np.repeat(np.arange(n, dtype=np.int64), 3), "async all_gather")
    # Point to point: a ring of isend / recv, then blocking send / recv pairs.
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        sbuf, rbuf = np.arange(1000, dtype=np.int64) + r, np.zeros(1000, np.int64)
        h = dist.isend(sbuf, right)
        dist.recv(rbuf, left)
        h.wait()
        c.eq(rbuf, np.arange(1000, dtype=np.int64) + left, "isend/recv ring")
        if r % 2 == 0 and r + 1 < n:
            dist.send(np.full(7, r, np.float32), r + 1)
        elif r % 2 == 1:
            y = np.zeros(7, np.float32)
            dist.recv(y, r - 1)
            c.eq(y, np.full(7, r - 1, np.float32), "send/recv")
    # Sub-groups: evens and odds (every rank calls new_group for both, in the same order).
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2)) or [0]
    ge, go = dist.new_group(evens), dist.new_group(odds)
    mine, ranks = (ge, evens) if r in evens else (go, odds)
    if r in ranks:
        assert dist.get_world_size(mine) == len(ranks) and dist.get_rank(mine) == ranks.index(r)
        for alg in ALGS:
            c.all_reduce(77, "int32", "sum", alg, g=mine, ranks=ranks)
        x = np.full(4, r, np.int64)
        dist.broadcast(x, src=ranks[-1], group=mine)
        c.eq(x, np.full(4, ranks[-1], np.int64), "group broadcast")
    dist.barrier()
    c.all_reduce(10, "int64", "sum", "auto")  # the world still works after the groups
    dist.destroy_process_group()
    print(f"OK {c.cases}", flush=True)


def rank_fault() -> None:
    """Loop all-reduces until the parent kills or stops the victim; report the error."""
    import helios.comm as dist

    from helios.errors import CommError

    dist.init_process_group(backend=os.environ["TEST_BACKEND"], timeout=float(os.environ["TEST_TIMEOUT"]))
    r = dist.get_rank()
    x = np.ones(16384, np.float32)
    dist.all_reduce(x)
    print("READY", flush=True)
    try:
        while True:
            x[:] = 1
            dist.all_reduce(x)
    except CommError as e:
        t = time.time()
        again = ""
        try:
            dist.all_reduce(x)
        except CommError as e2:
            again = str(e2)
        print("ERR " + json.dumps({"t": t, "msg": str(e), "again": again, "rank": r}), flush=True)


def rank_debug() -> None:
    """Rank 1 calls all_reduce with another size: every rank must get a clear CommError."""
    import helios.comm as dist

    from helios.errors import CommError

    dist.init_process_group(backend=os.environ["TEST_BACKEND"], timeout=10)
    r = dist.get_rank()
    x = np.ones(100 if r == 1 else 64, np.float32)
    try:
        dist.all_reduce(x)
        print("NOERROR", flush=True)
    except CommError as e:
        print("MISMATCH " + json.dumps(str(e)), flush=True)
    y = np.ones(8, np.int32)
    dist.all_reduce(y)  # the communicator is still usable: nothing was transferred
    assert (y == dist.get_world_size()).all()
    print("OK", flush=True)


# ================================================================================ test side
def _spawn(n: int, mode: str, env: dict[str, str], prefix: list[str] | None = None,
           addr: str = "127.0.0.1") -> list[subprocess.Popen]:
    port = free_port("127.0.0.1")
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR=addr, MASTER_PORT=str(port),
                 PYTHONUNBUFFERED="1", HELIOS_COMM_SEGMENT_BYTES="64", HELIOS_SHM_SLOT_BYTES="512",
                 HELIOS_SHM_RING_BYTES="4096")
        e.update(env)
        cmd = (prefix[r] if prefix else []) + [PY, HERE, mode]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=os.path.dirname(HERE)))
    return procs


def _run_matrix(backend: str, n: int, full: bool, timeout: float = 150) -> int:
    job = shm_job()
    res = finish(_spawn(n, "matrix_full" if full else "matrix", {"TEST_BACKEND": backend, **job}), timeout)
    for rc, o, e in res:
        assert rc == 0 and "OK" in o, f"rank failed (rc={rc}):\n{o}\n{e[-3000:]}"
    assert not shm_left(job), f"shared-memory segments left behind: {shm_left(job)}"
    return int(re.search(r"OK (\d+)", res[0][1]).group(1))


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("n", [3, 4])
def test_collectives_exact_full_matrix(backend, n):
    assert _run_matrix(backend, n, full=True) > 1000


@pytest.mark.multiproc
# (tcp at 3 and 4 ranks: the full matrix above; 6 was dropped for time, 5 and 8 cover odd and even)
@pytest.mark.parametrize("backend,n", [("shm", 1), ("shm", 2), ("shm", 5), ("shm", 7), ("shm", 8), ("tcp", 1),
                                       ("tcp", 2), ("tcp", 5), ("tcp", 8)])
def test_collectives_exact_world_sizes(backend, n):
    assert _run_matrix(backend, n, full=False) > 300


def _fault(backend: str, sig: int, n: int = 3, timeout: float = 2.0) -> None:
    job = shm_job()
    procs = _spawn(n, "fault", {"TEST_BACKEND": backend, "TEST_TIMEOUT": str(timeout), **job,
                                "HELIOS_COMM_SEGMENT_BYTES": str(1 << 20), "HELIOS_SHM_SLOT_BYTES": str(1 << 20),
                                "HELIOS_SHM_RING_BYTES": str(1 << 20)})
    victim = n - 1
    try:
        for p in procs:
            line = p.stdout.readline()
            assert "READY" in line, (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(0.2)
        t_kill = time.time()
        os.kill(procs[victim].pid, sig)
        res = finish(procs[:victim], timeout=4 * timeout + 10)
    finally:
        procs[victim].kill()
        procs[victim].wait()
    for rc, o, e in res:
        assert rc == 0, e[-2000:]
        m = re.search(r"ERR (.*)", o)
        assert m, f"no CommError reported:\n{o}\n{e[-2000:]}"
        info = json.loads(m.group(1))
        elapsed = info["t"] - t_kill
        assert elapsed < 2 * timeout, f"rank {info['rank']} took {elapsed:.2f} s (timeout {timeout})"
        msg = info["msg"]
        assert re.search(r"all_reduce #\d+", msg) and "bytes" in msg and "rank" in msg, msg
        if sig == signal.SIGKILL:
            # Whoever noticed first names the dead rank; the others learn it from an abort.
            assert f"rank {victim}" in msg or "abort" in msg or "closed" in msg, msg
        assert "unusable" in info["again"], info["again"]
    assert not shm_left(job), f"shared-memory segments left behind: {shm_left(job)}"


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_peer_killed_or_stopped_raises_commerror(backend, sig):
    _fault(backend, sig)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_debug_mode_reports_size_mismatch(backend):
    res = finish(_spawn(3, "debug", {"TEST_BACKEND": backend, "HELIOS_COMM_DEBUG": "1"}), 60)
    for rc, o, e in res:
        assert rc == 0, e[-2000:]
        m = re.search(r"MISMATCH (.*)", o)
        assert m and "OK" in o, o
        msg = json.loads(m.group(1))
        assert "differs between ranks" in msg and "all_reduce 400 bytes" in msg and "all_reduce 256 bytes" in msg


@pytest.mark.multiproc
def test_launcher_stops_job_when_a_rank_exits_3(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "import helios.comm as dist\n"
        "dist.init_process_group(timeout=30)\n"
        "print('rank says hi', dist.get_rank(), os.environ['LOCAL_RANK'], flush=True)\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    p = subprocess.run([PY, "-m", "helios.comm.launcher", "--nproc-per-node", "3", "--grace", "2", str(script)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert time.monotonic() - t0 < 30
    for r in range(3):
        assert f"[rank {r}] rank says hi {r} {r}" in p.stdout
    assert re.search(r"rank 1 \(pid \d+\) exited with code 3; stopped the other ranks", p.stderr), p.stderr


def _ibverbs_reason() -> str | None:
    try:
        from helios.comm import ibverbs
    except ImportError as e:  # pragma: no cover
        return str(e)
    return ibverbs.available()


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_exact_ibverbs(n):
    reason = _ibverbs_reason()
    if reason:
        pytest.skip(f"ibverbs: {reason}")
    assert _run_matrix("ibverbs", n, full=False) > 300


@pytest.mark.multiproc
def test_peer_killed_ibverbs_raises_commerror():
    reason = _ibverbs_reason()
    if reason:
        pytest.skip(f"ibverbs: {reason}")
    _fault("ibverbs", signal.SIGKILL)


@pytest.mark.multiproc
def test_launcher_forwards_sigterm_to_every_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "def bye(sig, frame):\n"
        "    print('got SIGTERM', os.environ['RANK'], flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    code, out, err = sigterm_launcher_when_ready(script, tmp_path, "ready")
    assert code == 128 + signal.SIGTERM, (out, err)
    assert "[rank 0] got SIGTERM 0" in out and "[rank 1] got SIGTERM 1" in out, out


def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True, timeout=20)


@pytest.mark.multiproc
def test_two_hosts_tcp_in_network_namespaces():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns + veth)")
    if subprocess.run("command -v ip", shell=True, capture_output=True, check=False).returncode != 0:
        pytest.skip("the ip tool (iproute2) is not installed")
    tag = f"hx{os.getpid() % 100000}"
    ns = [f"{tag}a", f"{tag}b"]
    try:
        try:
            _sh(f"ip netns add {ns[0]} && ip netns add {ns[1]}")
            _sh(f"ip link add {tag}0 type veth peer name {tag}1")
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
        for i in range(2):
            _sh(f"ip link set {tag}{i} netns {ns[i]}")
            _sh(f"ip -n {ns[i]} addr add 10.213.7.{i + 1}/24 dev {tag}{i}")
            _sh(f"ip -n {ns[i]} link set {tag}{i} up && ip -n {ns[i]} link set lo up")
        prefix = [["ip", "netns", "exec", ns[i]] for i in range(2)]
        # "^lo": every interface but loopback, i.e. the veth end inside each namespace.
        # A store reachable from the network admits only ranks holding the job's secret.
        procs = _spawn(2, "matrix", {"TEST_BACKEND": "tcp", "HELIOS_SOCKET_IFNAME": "^lo",
                                     "HELIOS_JOB_SECRET": "two-hosts-test-secret"}, prefix=prefix, addr="10.213.7.1")
        res = finish(procs, 150)
        for rc, o, e in res:
            assert rc == 0 and "OK" in o, f"{o}\n{e[-3000:]}"
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, check=False)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("matrix"):
        rank_matrix(full=mode == "matrix_full")
    elif mode == "fault":
        rank_fault()
    elif mode == "debug":
        rank_debug()
    else:
        raise SystemExit(f"unknown mode {mode}")
