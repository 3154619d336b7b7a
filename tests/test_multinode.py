"""Jobs over several nodes: ``helios-run --nnodes N --node-rank K --master-addr A --master-port P``
on each node (torchrun's flags), and what happens when a node's link or ranks are lost.

The nodes are fake hosts made of namespaces (tests/cluster_fixture.py); launch mistakes are
checked on loopback, where two helios-run on one machine are two nodes all the same.  Ranks
of the small checks are this file run as a script (``python test_multinode.py <mode>``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from cluster_fixture import clusters  # noqa: E402
from ranks import finish  # noqa: E402

from helios.comm.launcher import free_port  # noqa: E402

PY = sys.executable
HELIOS_RUN = os.path.join(os.path.dirname(PY), "helios-run")
ROOT = os.path.dirname(os.path.dirname(HERE))
SECRET = "multinode-test-secret-0123456789"

pytestmark = pytest.mark.multiproc
fake_cluster = pytest.fixture(clusters, name="fake_cluster")


# =============================================================================== rank side
def rank_env() -> None:
    """What helios-run told this rank, and that the world all-reduces."""
    import helios.comm as dist

    dist.init_process_group(timeout=30)
    x = np.full(3, dist.get_rank() + 1, np.int32)
    dist.all_reduce(x)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT")
    print("RESULT " + json.dumps({"sum": int(x[0]), **{k: os.environ[k] for k in keys}}), flush=True)
    dist.destroy_process_group()


def rank_loop() -> None:
    """All-reduce (flat ring and hierarchical, in turn) until a CommError; print when and what."""
    import helios.comm as dist

    from helios.errors import CommError

    dist.init_process_group(timeout=float(os.environ["TEST_TIMEOUT"]))
    x = np.ones(1 << 18, np.float32)
    dist.all_reduce(x)
    print("READY", flush=True)
    k = 0
    try:
        while True:
            t0 = time.time()
            dist.all_reduce(x, algorithm=("ring", "hierarchical")[k % 2])
            k += 1
    except CommError as e:
        print("ERR " + json.dumps({"t": time.time(), "t_op": t0, "rank": dist.get_rank(), "msg": str(e)}), flush=True)


# ============================================================================== test side
def _env(**extra) -> dict:
    e = dict(os.environ, LP_NUM_THREADS="1", OMP_NUM_THREADS="1", HELIOS_JOB_SECRET=SECRET, PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HELIOS_LAUNCHER", "HELIOS_JOB_ID",
              "HELIOS_COMM_BACKEND", "HELIOS_JOB_SECRET_FILE"):
        e.pop(k, None)
    e.update(extra)
    return e


def _start(argvs: list[list[str]], env: dict, hosts=None) -> list[subprocess.Popen]:
    """Start one helios-run per node: ``argvs[k]`` on ``hosts[k]`` (fake hosts), or here."""
    kw = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    return [hosts[k].popen(argv, **kw) if hosts else subprocess.Popen(argv, **kw) for k, argv in enumerate(argvs)]


def _nodes(argvs: list[list[str]], env: dict, hosts=None, timeout: float = 60) -> list[tuple[int, str, str]]:
    """Run one helios-run per node (see ``_start``); (exit code, stdout, stderr) of each."""
    return finish(_start(argvs, env, hosts), timeout)


def _results(stdout: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line]


def test_torchrun_flags_and_launch_mistakes_across_nodes():
    """On loopback: two helios-run, torchrun's spellings, are one job of 2 x 2 ranks; nodes started
    differently, or without the job's secret, stop with one line each and never wait."""
    port = free_port("127.0.0.1")

    def node(k: int, nproc: int = 2) -> list[str]:
        return [HELIOS_RUN, "--nproc_per_node", str(nproc), "--nnodes", "2:2", "--node_rank", str(k), "--master_addr",
                "127.0.0.1", "--master_port", str(port), HERE, "env"]

    runs = _nodes([node(0), node(1)], _env())
    for code, o, e in runs:
        assert code == 0, e[-3000:]
    res = sorted((r for _, o, _ in runs for r in _results(o)), key=lambda r: int(r["RANK"]))
    assert [int(r["RANK"]) for r in res] == [0, 1, 2, 3]
    for r in res:
        rank = int(r["RANK"])
        assert r["sum"] == 10 and r["WORLD_SIZE"] == "4" and r["LOCAL_WORLD_SIZE"] == "2"
        assert int(r["LOCAL_RANK"]) == rank % 2 and int(r["NODE_RANK"]) == int(r["GROUP_RANK"]) == rank // 2
    # The ranks' store has a port node 0 picked and handed every node; the given port is the nodes'.
    assert len({r["MASTER_PORT"] for r in res}) == 1 and res[0]["MASTER_PORT"] != str(port)

    t0 = time.monotonic()
    runs = _nodes([node(0), node(1, nproc=1)], _env(), timeout=30)
    assert time.monotonic() - t0 < 20, "a node waited for a job that could not start"
    for code, o, e in runs:
        assert code == 1 and "Traceback" not in e, e
        assert "--nproc-per-node 1 on node 1, 2 on node 0" in e, e
    code, _, e = _nodes([node(1)], {k: v for k, v in _env().items() if k != "HELIOS_JOB_SECRET"})[0]
    assert code == 1 and e.count("\n") == 1 and "HELIOS_JOB_SECRET" in e, e


@pytest.mark.parametrize("pieces", ["1", "4"], ids=["levels_in_turn", "pipelined"])
def test_a_link_taken_down_mid_collective_fails_every_rank_naming_the_other_host(fake_cluster, pieces):
    """2 hosts x 2 ranks all-reducing; host 1's link goes down: every rank raises CommError within
    the timeout, naming the host (and address) it can no longer reach (the hierarchical calls'
    levels one after another, or pipelined, the exchange on a thread of its own)."""
    timeout = 3.0
    c = fake_cluster(2, rate="1gbit")
    names = [h.run(["hostname"]).stdout.strip() for h in c.hosts]
    port = free_port()
    procs = []
    for r in range(4):
        env = _env(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2), MASTER_ADDR=c.hosts[0].addr,
                   MASTER_PORT=str(port), HELIOS_JOB_ID="linkdown", TEST_TIMEOUT=str(timeout),
                   HELIOS_COMM_HIER_PIECES=pieces)
        procs.append(c.hosts[r // 2].popen([PY, HERE, "loop"], env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            line = p.stdout.readline()
            assert "READY" in line, (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(0.3)
        t_before = time.time()
        c.hosts[1].run(["ip", "link", "set", "eth0", "down"])
        t_down = time.time()  # the link is down by now
        outs = [p.communicate(timeout=4 * timeout + 10) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    first = {}
    for r, (o, e) in enumerate(outs):
        assert procs[r].returncode == 0, e[-2000:]
        err = [json.loads(line[4:]) for line in o.splitlines() if line.startswith("ERR ")]
        assert err, f"rank {r} raised no CommError:\n{o[-1000:]}\n{e[-2000:]}"
        first[r] = err[0]
        print(f"rank {r}: CommError {err[0]['t'] - t_down:.2f} s after the link went down "
              f"({err[0]['t'] - t_before:.2f} s after the command started, {err[0]['t'] - err[0]['t_op']:.2f} s "
              f"after the failed all_reduce started): {err[0]['msg']}")
    for r, err in first.items():
        other, msg = c.hosts[1 - r // 2], err["msg"]
        assert f"{names[1 - r // 2]} ({other.addr})" in msg, msg  # the host it can no longer reach
        # Within the timeout of the failed operation (a little later than the link, whose last
        # bytes may still complete an operation after the command).  A rank waiting on its
        # host-mate in the intra-host level hears from the mate which host it lost, as the mate
        # gives up, not that the mate is gone.
        assert "is dead" not in msg, msg
        assert err["t"] - err["t_op"] <= timeout + 0.1, msg
        assert err["t"] - t_down <= timeout + 0.3, msg
    for h in c.hosts:
        assert "helios-" not in h.run(["ls", "/dev/shm"]).stdout


# ====================================================================== helios-train on 2 nodes
def _train_nodes(c, out, *flags: str, restarts: int = 0) -> list[list[str]]:
    """Each fake host's helios-run line for a 2 x 2-rank helios-train run (test_train_dist's settings + flags)."""
    from test_train_dist import _train_args

    port = str(free_port())
    return [[HELIOS_RUN, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(k), "--master-addr",
             c.hosts[0].addr, "--master-port", port, "--max-restarts", str(restarts), "-m", "helios.train",
             *_train_args(out, *flags)] for k in range(2)]


def _no_leftovers(c) -> None:
    """Nothing of the job runs in any host, and no host's /dev/shm holds a segment."""
    for h in c.hosts:
        ns = f"{c.prefix}-h{h.index}"
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        assert [int(p) for p in pids] == [h.pid], f"processes left in host {h.index}: {pids} (holder {h.pid})"
        assert "helios-" not in h.run(["ls", "/dev/shm"]).stdout, f"segments left in host {h.index}"


@pytest.mark.vulkan
@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_what_one_rank_trains(fake_cluster, tmp_path, one_rank_run):
    from test_train_dist import STEPS, final_params, losses

    c = fake_cluster(2)
    out = tmp_path / "nodes"
    runs = _nodes(_train_nodes(c, out), _env(), c.hosts, timeout=300)
    for code, o, e in runs:
        assert code == 0, o[-2000:] + e[-3000:]
    assert '"world_size": 4' in runs[0][1]  # rank 0, on node 0, prints the summary
    one = one_rank_run()
    assert len(losses(out)) == STEPS
    np.testing.assert_allclose(losses(out), losses(one), rtol=1e-5)
    a, b = final_params(one), final_params(out)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=k)
    _no_leftovers(c)


def _wait_for_a_complete_checkpoint(out, procs, deadline_s: float = 120) -> None:
    """Wait until the run in ``out`` has a complete checkpoint (a loaded host may still be writing it)."""
    import warnings

    from helios.schedule.checkpoint import latest_complete

    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a node's helios-run ended early")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a checkpoint still being written is reported as unusable
            if latest_complete(str(out)) is not None:
                return
        time.sleep(0.1)
    raise AssertionError(f"no complete checkpoint in {out} within {deadline_s} s")


@pytest.mark.vulkan
@pytest.mark.slow
def test_a_node_whose_ranks_all_die_restarts_the_job_on_every_node_from_the_checkpoint(fake_cluster, tmp_path,
                                                                                       one_rank_run):
    """Host 1's ranks are killed at step >= 6 (checkpoints every 4 steps): both helios-run stop their
    ranks, meet again, and the job resumes on both nodes from step 4, ending on the uninterrupted
    run's loss and weights; nothing is left running or in any host's /dev/shm."""
    from test_train_dist import _rank_pid, _wait_for_steps, final_params, losses

    steps = ("--steps", "16", "--ckpt-every", "4")
    c = fake_cluster(2)
    out = tmp_path / "lossy"
    procs = _start(_train_nodes(c, out, *steps, restarts=1), _env(), c.hosts)
    try:
        _wait_for_steps(out, 6, procs)
        _wait_for_a_complete_checkpoint(out, procs)  # step 4's is written in the background
        victims = [_rank_pid(procs[1].pid, r) for r in (2, 3)]
        assert None not in victims, victims
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        runs = finish(procs, timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for code, o, e in runs:
        assert code == 0, o[-2000:] + e[-3000:]
        line = next((x for x in e.splitlines() if "restarting the job (restart 1 of 1)" in x), None)
        # Every node names the rank that died first, on node 1, whoever noticed.
        assert line is not None and "node 1" in line and ("rank 2 " in line or "rank 3 " in line), e[-3000:]
    assert "resuming from the last complete checkpoint" in runs[0][1]
    ref = one_rank_run(*steps)
    a, b = final_params(ref), final_params(out)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=k)
    import sqlite3

    con = sqlite3.connect(out / "run.db")
    last = con.execute("SELECT loss FROM step_timing WHERE rank = 0 AND step = 16 ORDER BY run_id DESC").fetchone()[0]
    con.close()
    assert last == pytest.approx(losses(ref)[-1], rel=1e-5)
    _no_leftovers(c)


if __name__ == "__main__":
    globals()["rank_" + sys.argv[1]]()
