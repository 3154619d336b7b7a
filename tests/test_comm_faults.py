"""Fault attribution: a rank that dies mid-collective is the rank every survivor names.

When rank 1 of 3 is SIGKILLed, the survivor that notices first aborts its transport; the
other survivor may see that abort (a closed socket, a raised flag) before it sees rank 1
gone.  The abort carries the original culprit, so every survivor's CommError names rank 1
(``... failed on rank R: rank 1 ... (reported by rank Q)``), and each raises well within
twice the timeout.  Ranks are this file run as a script, as in test_comm_multiproc.py.

Also ``helios-run --max-restarts``: a failed rank restarts the whole job (fresh port,
``HELIOS_RESTART_COUNT``), with no process or shared-memory segment outliving an attempt; and
the store's host (rank 0) finishing before a rank that still uses the store.
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
PY = sys.executable


# =============================================================================== rank side
def rank_loop() -> None:
    """Loop collectives of every algorithm until a peer dies; print the CommError as JSON."""
    import helios.comm as dist

    from helios.errors import CommError

    dist.init_process_group(backend=os.environ["TEST_BACKEND"], timeout=float(os.environ["TEST_TIMEOUT"]))
    r, n = dist.get_rank(), dist.get_world_size()
    big = np.ones(1 << 18, np.float32)
    small = np.ones(300, np.float32)
    out = np.empty(n * 4096, np.float32)
    dist.all_reduce(big)
    print("READY", flush=True)
    k = 0
    try:
        while True:
            alg = ("ring", "tree", "halving_doubling", "auto")[k % 4]
            big[:] = 1
            dist.all_reduce(big, algorithm=alg)
            dist.all_reduce(small, algorithm=alg)
            dist.all_gather(out, big[:4096], algorithm="auto" if alg == "tree" else alg)
            dist.broadcast(small, src=k % n)
            k += 1
    except CommError as e:
        t = time.time()
        print("ERR " + json.dumps({"t": t, "msg": str(e), "rank": r}), flush=True)


def rank_relay() -> None:
    """Rank 2 gives up blaming rank 1 (which is alive); ranks 0 and 1 must hear that it names rank 1."""
    import helios.comm as dist
    from helios.comm.engine import Fault

    from helios.errors import CommError

    dist.init_process_group(backend=os.environ["TEST_BACKEND"], timeout=float(os.environ["TEST_TIMEOUT"]))
    r = dist.get_rank()
    x = np.ones(1000, np.float32)
    dist.all_reduce(x)
    if r == 2:
        g = dist.api._S.world
        g.poison("test", Fault(1, "was declared lost by the test", 2), frames=True)
        print("ERR " + json.dumps({"t": time.time(), "msg": "", "rank": r}), flush=True)
        return
    try:
        while True:
            dist.all_reduce(x, algorithm=os.environ.get("TEST_ALG", "auto"))
    except CommError as e:
        print("ERR " + json.dumps({"t": time.time(), "msg": str(e), "rank": r}), flush=True)


# ================================================================================ test side
def _spawn(n: int, env: dict[str, str], mode: str = "loop") -> list[subprocess.Popen]:
    port = free_port("127.0.0.1")
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 PYTHONUNBUFFERED="1", HELIOS_COMM_SEGMENT_BYTES=str(64 << 10))
        e.update(env)
        procs.append(subprocess.Popen([PY, HERE, mode], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=os.path.dirname(HERE)))
    return procs


def _kill_one(backend: str, victim: int, n: int = 3, timeout: float = 3.0) -> list[dict]:
    job = shm_job()
    procs = _spawn(n, {"TEST_BACKEND": backend, "TEST_TIMEOUT": str(timeout), **job})
    try:
        for p in procs:
            line = p.stdout.readline()
            assert "READY" in line, (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(0.3)
        t_kill = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        survivors = [p for i, p in enumerate(procs) if i != victim]
        deadline = time.monotonic() + 4 * timeout + 10
        res = []
        for p in survivors:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            res.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for s in (p.stdout, p.stderr):
                s.close()
    infos = []
    for rc, o, e in res:
        assert rc == 0, e[-2000:]
        m = re.search(r"ERR (.*)", o)
        assert m, f"no CommError reported:\n{o}\n{e[-2000:]}"
        info = json.loads(m.group(1))
        info["elapsed"] = info["t"] - t_kill
        infos.append(info)
    assert not shm_left(job), f"shared-memory segments left behind: {shm_left(job)}"
    return infos


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_every_survivor_names_the_killed_rank(backend):
    timeout = 3.0
    for attempt in range(2):  # which survivor notices first varies from run to run
        infos = _kill_one(backend, victim=1, timeout=timeout)
        assert sorted(i["rank"] for i in infos) == [0, 2]
        for info in infos:
            msg = info["msg"]
            assert info["elapsed"] < 2 * timeout, f"rank {info['rank']} took {info['elapsed']:.2f} s: {msg}"
            # The part after "failed on rank R:" says who is at fault: rank 1, whoever noticed.
            m = re.search(r"failed on rank (\d+): rank (\d+) ", msg)
            assert m, msg
            assert int(m.group(1)) == info["rank"], msg
            assert m.group(2) == "1", f"attempt {attempt}: rank {info['rank']} blames rank {m.group(2)}: {msg}"
            assert re.search(r"(all_reduce|all_gather|broadcast) #\d+ on group world \(\d+ bytes\)", msg), msg


# ============================================================= helios-run --max-restarts
# Attempt 0: rank 1 fails (how: the first argument), the others wait in a collective or in
# setup.  Attempt 1: every rank all-reduces, checks the sum and says "done".
_RESTART_JOB = """
import os, signal, subprocess, sys, time
import numpy as np
import helios.comm as dist
from helios.comm import shm

how = sys.argv[1]
attempt = int(os.environ["HELIOS_RESTART_COUNT"])
rank = int(os.environ["RANK"])
print("attempt", attempt, "port", os.environ["MASTER_PORT"], "of", os.environ["HELIOS_MAX_RESTARTS"],
      "shm", os.environ["HELIOS_SHM_PREFIX"], flush=True)
doomed = attempt == 0 and rank == 1
if doomed:
    child = subprocess.Popen(["sleep", "120"])  # must not outlive the job
    print("child", child.pid, flush=True)
    if how == "setup":
        # Die right after creating this rank's shared-memory segment, before any peer mapped
        # it: its name stays in /dev/shm, and the peers' too (SIGTERM kills them in setup).
        real = shm.Segment.__init__
        def dying(self, path, size, create):
            real(self, path, size, create)
            if create:
                os.kill(os.getpid(), signal.SIGKILL)
        shm.Segment.__init__ = dying
dist.init_process_group(backend="shm", timeout=30)
x = np.full(5, rank + 1, np.int64)
dist.all_reduce(x)
if doomed:
    if how == "exit":
        os._exit(7)
    os.kill(os.getpid(), signal.SIGKILL)
if attempt == 0:
    try:
        dist.all_reduce(x)  # a peer is dead: CommError (or the launcher's SIGTERM first)
    except dist.CommError:
        time.sleep(60)  # wait for the launcher's SIGTERM, so rank 1 is the one that failed
assert (x == sum(range(1, dist.get_world_size() + 1))).all(), x
dist.destroy_process_group()
print("done", attempt, flush=True)
"""


def _alive(pid: int) -> bool:
    from helios.comm.shm import peer_alive

    return peer_alive(pid)


def _run_launcher(tmp_path, how: str, restarts: int, n: int = 3) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(_RESTART_JOB)
    t0 = time.monotonic()
    p = subprocess.run([PY, "-m", "helios.comm.launcher", "--nproc-per-node", str(n), "--grace", "2",
                        "--max-restarts", str(restarts), str(script), how],
                       capture_output=True, text=True, timeout=90, cwd=tmp_path, check=False)
    return p, time.monotonic() - t0


def _no_leftovers(out: str) -> None:
    for pid in map(int, re.findall(r"\[rank 1\] child (\d+)", out)):
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"process {pid}, started by a failed rank, outlived the job"
    prefixes = re.findall(r"\] attempt \d+ port \d+ of \d+ shm (\w+)", out)
    assert prefixes, out
    left = [n for prefix in prefixes for n in shm_left(prefix)]
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.mark.multiproc
@pytest.mark.parametrize("how,died", [("kill", "was killed by SIGKILL"), ("exit", "exited with code 7"),
                                      ("setup", "was killed by SIGKILL")])
def test_launcher_restarts_the_job_after_a_rank_fails(tmp_path, how, died):
    p, took = _run_launcher(tmp_path, how, restarts=2)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, (out, err)
    assert len(re.findall(r"restarting the job", err)) == 1, err
    assert re.search(rf"helios-run: rank 1 \(pid \d+\) {died}; restarting the job \(restart 1 of 2\)", err), err
    for r in range(3):
        assert f"[rank {r}] attempt 0 port" in out and f"[rank {r}] attempt 1 port" in out, out
        assert f"[rank {r}] done 1" in out and f"[rank {r}] done 0" not in out, out
    ports = {int(m) for m in re.findall(r"attempt \d port (\d+) of 2", out)}
    assert len(ports) == 2, f"a restart on one host takes a fresh MASTER_PORT: {ports}"
    assert "attempt 2" not in out
    assert took < 45
    _no_leftovers(out)


@pytest.mark.multiproc
def test_launcher_without_restarts_exits_naming_the_rank(tmp_path):
    p, _ = _run_launcher(tmp_path, "kill", restarts=0)
    assert p.returncode == 128 + signal.SIGKILL, (p.stdout, p.stderr)
    assert re.search(r"helios-run: rank 1 \(pid \d+\) was killed by SIGKILL; stopped the other ranks", p.stderr), \
        p.stderr
    assert "restarting" not in p.stderr and "attempt 1" not in p.stdout
    _no_leftovers(p.stdout)


@pytest.mark.multiproc
def test_launcher_gives_each_rank_one_blas_thread_unless_the_user_chose(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os\nprint(os.environ.get('OPENBLAS_NUM_THREADS'), os.environ.get('OMP_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    for user, want in (({}, "1 1"), ({"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "2"}, "3 2")):
        p = subprocess.run([PY, "-m", "helios.comm.launcher", "--nproc-per-node", "2", str(script)],
                           env={**env, **user}, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert sorted(p.stdout.splitlines()) == [f"[rank 0] {want}", f"[rank 1] {want}"], p.stdout


@pytest.mark.multiproc
def test_launcher_restarts_run_out(tmp_path):
    """A rank that fails on every attempt: K restarts, then helios-run exits with its code."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint('attempt', os.environ['HELIOS_RESTART_COUNT'], flush=True)\n"
                      "sys.exit(5 if os.environ['RANK'] == '1' else 0)\n")
    p = subprocess.run([PY, "-m", "helios.comm.launcher", "--nproc-per-node", "2", "--max-restarts", "2",
                        str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert p.returncode == 5, (p.stdout, p.stderr)
    assert re.findall(r"restart (\d) of 2", p.stderr) == ["1", "2"], p.stderr
    assert re.search(r"rank 1 \(pid \d+\) exited with code 5; stopped the other ranks", p.stderr), p.stderr
    assert sorted(re.findall(r"\[rank 1\] attempt (\d)", p.stdout)) == ["0", "1", "2"], p.stdout


@pytest.mark.multiproc
def test_launcher_sigterm_never_restarts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, time\nprint('ready', os.environ['HELIOS_RESTART_COUNT'], flush=True)\n"
                      "time.sleep(60)\n")  # the default SIGTERM action: killed by the signal
    code, out, err = sigterm_launcher_when_ready(script, tmp_path, "ready 0", ("--max-restarts", "3"))
    assert code == 128 + signal.SIGTERM, (out, err)
    assert "restarting" not in err and "ready 1" not in out, (out, err)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,alg", [("tcp", "auto"), ("shm", "auto"), ("shm", "ring")])
def test_abort_relays_the_culprit(backend, alg):
    """An abort names the rank at fault, not the aborting rank: even that rank itself hears it."""
    job = shm_job()
    procs = _spawn(3, {"TEST_BACKEND": backend, "TEST_TIMEOUT": "10", "TEST_ALG": alg, **job}, mode="relay")
    res = finish(procs, 40)
    for r, (rc, o, e) in enumerate(res):
        assert rc == 0 and "ERR" in o, f"rank {r}: {o}\n{e[-2000:]}"
        if r == 2:
            continue
        msg = json.loads(re.search(r"ERR (.*)", o).group(1))["msg"]
        assert f"failed on rank {r}: rank 1 was declared lost by the test (reported by rank 2)" in msg, msg
    assert not shm_left(job), f"shared-memory segments left behind: {shm_left(job)}"


if __name__ == "__main__":
    if sys.argv[1] == "loop":
        rank_loop()
    elif sys.argv[1] == "relay":
        rank_relay()
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]}")


# ======================================================= the store's host leaving before the others
_HOST = ("import sys\n"
         "from helios.comm.store import TCPStore\n"
         "s = TCPStore('127.0.0.1', 0, 2, is_server=True, timeout=20, job_id='j')\n"
         "print(s.port, flush=True)\n"
         "sys.stdin.readline()\n"
         "if sys.argv[1] == 'fail': raise RuntimeError('the host fails')\n"
         "if sys.argv[1] == 'failed': s.close(linger=False)\n")


def _host_and_client(how: str):
    """A store host process (this file's _HOST, ending as ``how`` says once told to) and this
    process's client of it."""
    from helios.comm.store import TCPStore

    host = subprocess.Popen([PY, "-c", _HOST, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    client = TCPStore("127.0.0.1", int(host.stdout.readline()), 2, timeout=5, job_id="j")
    host.stdin.write("go\n")
    host.stdin.flush()
    return host, client


def test_the_store_host_waits_at_exit_for_ranks_still_using_it():
    # rank 0 done first (its script ends) while another rank still has store work to do (forming
    # a group): the store stays until that rank leaves it, then rank 0 exits
    host, client = _host_and_client("clean")
    try:
        time.sleep(1.5)
        assert host.poll() is None  # still there, serving
        client.set("k", b"v")
        assert client.get("k", 1) == b"v" and client.add("n", 1) == 1
        t0 = time.monotonic()
        client.close()
        assert host.wait(10) == 0 and time.monotonic() - t0 < 3
        assert "waiting up to 20 s for the 1 rank(s) still connected" in host.stderr.read()
    finally:
        host.kill()


@pytest.mark.parametrize("how", ["fail", "failed"])
def test_a_failed_store_host_leaves_at_once(how):
    # on an uncaught exception, or after its communicator failed (close(linger=False)), the host
    # does not wait for ranks that may never leave: they learn at once that the store is gone
    from helios.errors import CommError

    host, client = _host_and_client(how)
    try:
        assert host.wait(5) == (1 if how == "fail" else 0)
        with pytest.raises(CommError, match="lost the store"):
            client.get("k", 1)
    finally:
        client.close()
        host.kill()


def test_a_process_keeps_only_the_stores_still_in_use():
    # a closed store with no rank connected has nothing to wait for at exit: the next store this
    # process hosts lets go of it; one a rank still uses is kept
    from helios.comm import store as st

    done = st.TCPStore("127.0.0.1", 0, 2, is_server=True, timeout=5, job_id="a")
    done.close()
    used = st.TCPStore("127.0.0.1", 0, 2, is_server=True, timeout=5, job_id="b")
    client = st.TCPStore("127.0.0.1", used.port, 2, timeout=5, job_id="b")
    client.set("k", b"v")  # proven and open
    used.close()
    fresh = st.TCPStore("127.0.0.1", 0, 2, is_server=True, timeout=5, job_id="c")
    try:
        assert done.server not in st._HOSTED
        assert used.server in st._HOSTED and fresh.server in st._HOSTED
    finally:
        client.close()
        fresh.close()
