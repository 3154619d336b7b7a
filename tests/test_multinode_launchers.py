"""helios-train on two namespace hosts under the real launchers, as a cluster runs it.

* Open MPI: ``mpirun -np 4`` inside host 0 with a hostfile naming both hosts (2 slots each);
  its daemon reaches host 1 through the fake cluster's ssh (``scripts/fake_cluster.sh rsh``,
  given as ``--mca plm_rsh_agent``), which enters the host's namespaces with a login's clean
  environment, so ``MASTER_ADDR`` and the job's secret travel by ``-x`` as over ssh.
* Slurm: slurmctld on host 0, one slurmd per host (``NodeName`` the host's name, ``NodeAddr``
  its address), ``srun -N 2 --ntasks-per-node 2``; rank 0's address is the first node of
  ``SLURM_NODELIST``, which each host resolves through its own /etc/hosts.

Each job gives the one-rank run's losses and weights (test_multinode's oracle), and leaves no
process in either host, nothing in either host's /dev/shm, no daemon and no directory.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_fixture import clusters  # noqa: E402
from launchers import SLURM_PROGRAMS, missing, python_argv, run_mpirun, run_srun, slurm_cluster_running  # noqa: E402

SECRET = "multinode-launchers-secret-0123456789"
pytestmark = [pytest.mark.multiproc, pytest.mark.vulkan, pytest.mark.slow]
fake_cluster = pytest.fixture(clusters, name="fake_cluster")


def _reporting_host(argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first prints ``HOST <hostname>``: where the launcher put the task."""
    return ["sh", "-c", 'echo "HOST $(hostname)"; exec "$@"', "sh", *argv]


def _check_tasks_and_training(launcher: str, res, c, out, one) -> None:
    """Tasks 0, 1 on host 0 and 2, 3 on host 1; one summary (rank 0's) of a 4-rank job; the
    one-rank run's losses and final weights."""
    from test_train_dist import STEPS, final_params, losses

    res.check()
    print(f"{launcher}: 4 ranks on 2 hosts, {res.seconds:.1f} s")
    hosts = [next((ln.split()[1] for ln in o.splitlines() if ln.startswith("HOST ")), None) for o in res.task_stdout]
    assert hosts == [c.hosts[r // 2].name for r in range(4)], (hosts, res.describe())
    assert sum('"world_size": 4' in o for o in res.task_stdout) == 1, res.describe()
    assert len(losses(out)) == STEPS
    np.testing.assert_allclose(losses(out), losses(one), rtol=1e-5)
    a, b = final_params(one), final_params(out)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_mpirun_across_two_hosts_trains_what_one_rank_trains(fake_cluster, tmp_path, one_rank_run):
    why = missing("mpirun", "orted")
    if why:
        pytest.skip(why)
    from test_multinode import _no_leftovers
    from test_train_dist import _train_args

    c = fake_cluster(2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.name} slots=2\n" for h in c.hosts))
    out = tmp_path / "mpirun"
    res = run_mpirun(4, _reporting_host(python_argv("-m", "helios.train", *_train_args(out))),
                     env={"MASTER_ADDR": c.hosts[0].name, "HELIOS_JOB_SECRET": SECRET}, timeout=150,
                     where=c.hosts[0].argv([]),
                     mpirun_args=["--hostfile", str(hostfile), "--mca", "plm_rsh_agent", c.rsh_agent()])
    _check_tasks_and_training("mpirun", res, c, out, one_rank_run())
    _no_leftovers(c)


def test_srun_on_two_slurm_nodes_trains_what_one_rank_trains(fake_cluster, tmp_path, one_rank_run):
    why = missing(*SLURM_PROGRAMS)
    if why:
        pytest.skip(why)
    from test_multinode import _no_leftovers
    from test_train_dist import _train_args

    c = fake_cluster(2)
    out = tmp_path / "srun"
    with slurm_cluster_running(hosts=c.hosts) as cluster:
        assert cluster.node_state() == "idle idle"
        # No MASTER_ADDR: rank 0's host is the first node of SLURM_NODELIST, its port from the job id.
        res = run_srun(cluster, 4, _reporting_host(python_argv("-m", "helios.train", *_train_args(out))),
                       env={"HELIOS_JOB_SECRET": SECRET}, timeout=150,
                       srun_args=["--nodes=2", "--ntasks-per-node=2"])
    _check_tasks_and_training("srun", res, c, out, one_rank_run())
    assert all(p.poll() is not None for p in cluster.procs.values()), cluster.procs
    assert not os.path.exists(cluster.root)
    _no_leftovers(c)
