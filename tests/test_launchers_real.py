"""helios.comm under real launchers: srun and sbatch on a throwaway Slurm cluster, and mpirun.

Each task is this file run as a script: it calls ``init_process_group()`` with no
arguments, so it must find its rank, the world size and rank 0's address in what the
launcher set (``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_NODELIST`` / ``SLURM_JOB_ID``, or
``OMPI_COMM_WORLD_*`` with ``MASTER_ADDR`` / ``MASTER_PORT``), then all-reduces integer-valued
arrays and prints one JSON line that the test checks exactly.  The launchers, the cluster
and the packages they need (``scripts/setup.sh --test``) are described in ``launchers.py``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launchers import python_argv, run_mpirun, run_sbatch, run_srun, slurm_cluster_session  # noqa: E402

HERE = os.path.abspath(__file__)
N = 1001  # odd, not a multiple of the world size
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    yield from slurm_cluster_session()  # started once for the module


def task_main(backend: str | None) -> None:
    import helios.comm as dist
    from helios.comm import env as envmod

    cfg = envmod.resolve()
    if backend is None:
        dist.init_process_group()  # everything from the launcher's environment
    else:
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ints = np.arange(N, dtype=np.int64) * (rank + 1)
    dist.all_reduce(ints)
    floats = np.full(4099, rank + 1, dtype=np.float32)
    dist.all_reduce(floats)
    top = np.array([rank, -rank], dtype=np.int32)
    dist.all_reduce(top, op="max")
    tri = world * (world + 1) // 2
    ok = (np.array_equal(ints, np.arange(N, dtype=np.int64) * tri) and bool(np.all(floats == tri))
          and top.tolist() == [world - 1, 0])
    print("RESULT " + json.dumps({
        "rank": rank, "world": world, "local_rank": cfg.local_rank, "source": cfg.source, "job_id": cfg.job_id,
        "master_addr": cfg.master_addr, "master_port": cfg.master_port, "backend": dist.get_backend(),
        "int_sum": int(ints.sum()), "int_last": int(ints[-1]), "float0": float(floats[0]), "max": top.tolist(),
        "ok": bool(ok)}), flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def results(res, ntasks: int) -> list[dict]:
    """One parsed RESULT line per task, in task order; fail with everything when one is missing."""
    res.check()
    out = []
    for r in range(ntasks):
        lines = [ln for ln in res.task_stdout[r].splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, f"task {r} printed {len(lines)} RESULT lines\n{res.describe()}"
        out.append(json.loads(lines[0][len("RESULT "):]))
    return out


def check_exact(rows: list[dict], world: int, source: str) -> None:
    tri = world * (world + 1) // 2
    assert sorted(row["rank"] for row in rows) == list(range(world))
    for r, row in enumerate(rows):
        assert row["rank"] == r and row["world"] == world, row  # task r of the launcher is rank r of Helios
        assert row["source"].startswith(source), row
        assert row["ok"] is True, row
        assert row["int_sum"] == tri * (N - 1) * N // 2 and row["int_last"] == tri * (N - 1), row
        assert row["float0"] == tri and row["max"] == [world - 1, 0], row
    assert len({(row["master_addr"], row["master_port"], row["job_id"]) for row in rows}) == 1, rows


@pytest.mark.parametrize("backend", [None, "tcp"], ids=["default", "tcp"])
def test_srun_two_tasks(cluster, backend):
    res = run_srun(cluster, 2, python_argv(HERE, *([backend] if backend else [])), timeout=60)
    rows = results(res, 2)
    check_exact(rows, 2, "Slurm")
    for row in rows:
        # Rank 0's host is the cluster's node; the port is 15000 + the job id's last four digits.
        assert row["master_addr"] == cluster.node, row
        assert row["job_id"].isdigit() and row["master_port"] == 15000 + int(row["job_id"][-4:]), row
        assert row["local_rank"] == row["rank"], row  # one node: local rank = rank
        assert row["backend"] == (backend or "shm"), row  # auto picks shm on one host


def test_sbatch_two_tasks(cluster):
    res = run_sbatch(cluster, 2, python_argv(HERE), timeout=60)
    rows = results(res, 2)
    check_exact(rows, 2, "Slurm")
    assert res.job_id and all(row["job_id"] == res.job_id for row in rows), (res.job_id, rows)
    assert f"batch job {res.job_id}: 2 tasks on {cluster.node}" in res.stdout, res.describe()


def test_mpirun_two_ranks():
    res = run_mpirun(2, python_argv(HERE), timeout=60)
    rows = results(res, 2)
    check_exact(rows, 2, "Open MPI")
    assert all(row["master_addr"] == "127.0.0.1" and row["backend"] == "shm" for row in rows), rows
    assert all(row["local_rank"] == row["rank"] for row in rows), rows


if __name__ == "__main__":
    task_main(sys.argv[1] if len(sys.argv) > 1 else None)


# --------------------------------------------------------------------- the trainer under each launcher
TRAIN_ARGS = ["--config", "nano", "--steps", "6", "--batch-size", "8", "--block-size", "16", "--no-progress",
              "--eval-every", "0", "--sample-tokens", "4", "--ckpt-every", "0"]


def _losses(out) -> list[float]:
    import sqlite3

    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return [r[0] for r in con.execute("SELECT loss FROM step_timing WHERE rank = 0 ORDER BY step")]
    finally:
        con.close()


@pytest.fixture(scope="module")
def helios_run_losses(shared_dir):
    """The losses of the same training under helios-run, the reference the launchers must give."""
    import subprocess

    def make(out):
        env = dict(os.environ, LP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HELIOS_LAUNCHER", "HELIOS_JOB_ID"):
            env.pop(k, None)
        r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "helios-run"), "--nproc-per-node", "2",
                            "-m", "helios.train", *TRAIN_ARGS, "--out", str(out)], env=env, capture_output=True,
                           text=True, timeout=300, cwd=str(out))
        assert r.returncode == 0, r.stderr[-3000:]

    return _losses(shared_dir("launchers_real-helios_run", make))


def _check_training(res, out, reference) -> None:
    res.check()
    assert sum('"world_size": 2' in t for t in res.task_stdout or [res.stdout]) == 1, res.describe()
    np.testing.assert_allclose(_losses(out), reference, rtol=1e-6)


def test_trainer_under_srun_gives_the_losses_of_helios_run(cluster, tmp_path, helios_run_losses):
    res = run_srun(cluster, 2, python_argv("-m", "helios.train", *TRAIN_ARGS, "--out", str(tmp_path)), timeout=300)
    _check_training(res, tmp_path, helios_run_losses)


def test_trainer_under_sbatch_gives_the_losses_of_helios_run(cluster, tmp_path, helios_run_losses):
    res = run_sbatch(cluster, 2, python_argv("-m", "helios.train", *TRAIN_ARGS, "--out", str(tmp_path)), timeout=300)
    res.check()
    np.testing.assert_allclose(_losses(tmp_path), helios_run_losses, rtol=1e-6)


def test_trainer_under_mpirun_gives_the_losses_of_helios_run(tmp_path, helios_run_losses):
    res = run_mpirun(2, python_argv("-m", "helios.train", *TRAIN_ARGS, "--out", str(tmp_path)), timeout=300)
    _check_training(res, tmp_path, helios_run_losses)
