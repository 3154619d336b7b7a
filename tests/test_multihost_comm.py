"""helios.comm across fake hosts (network + UTS + mount namespaces, tests/cluster_fixture.py):
topology found by probing shared memory, hierarchical collectives, bytes on the wire.

Ranks are this file run as a script (``python test_multihost_comm.py <mode>``), started by
``helios-run --nnodes H --node-rank K`` inside each host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from cluster_fixture import clusters  # noqa: E402

PY = sys.executable
PORT = 29500

pytestmark = pytest.mark.multiproc
fake_cluster = pytest.fixture(clusters, name="fake_cluster")


# =============================================================================== rank side
def _emit(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def rank_topo() -> None:
    import helios.comm as dist

    dist.init_process_group(timeout=60)
    t = dist.get_topology()
    hg = dist.get_host_group()
    x = np.full(5, dist.get_rank() + 1, np.int32)
    dist.all_reduce(x, group=hg)  # the host's ranks only
    _emit(rank=dist.get_rank(), local_rank=dist.get_local_rank(), node_rank=dist.get_node_rank(),
          local_world_size=dist.get_local_world_size(), nnodes=dist.get_num_nodes(), hosts=[list(h) for h in t.hosts],
          host_ranks=hg.ranks, host_backend=hg.backend, backend=dist.get_backend(), by_probe=t.by_probe,
          host_sum=int(x[0]), env_local_rank=int(os.environ.get("LOCAL_RANK", -1)))
    dist.destroy_process_group()


# ============================================================================== test side
def _launch(hosts, nproc: int, mode: str, extra_env: dict | None = None, timeout: float = 120) -> dict[int, dict]:
    """Start ``nproc`` ranks of ``mode`` on each of ``hosts`` (helios-run per host); return each rank's RESULT."""
    env = dict(os.environ, LP_NUM_THREADS="1", OMP_NUM_THREADS="1", **(extra_env or {}))
    env.pop("HELIOS_COMM_BACKEND", None)
    procs = []
    for k, h in enumerate(hosts):
        cmd = [PY, "-m", "helios.comm.launcher", "--nproc-per-node", str(nproc), "--nnodes", str(len(hosts)),
               "--node-rank", str(k), "--master-addr", hosts[0].addr, "--master-port", str(PORT), HERE, mode]
        procs.append(h.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results: dict[int, dict] = {}
    for code, o, e in outs:
        assert code == 0, f"helios-run exited {code}:\n{o[-3000:]}\n{e[-4000:]}"
        for line in o.splitlines():
            if "RESULT " in line:
                r = json.loads(line.split("RESULT ", 1)[1])
                results[r["rank"]] = r
    return results


def test_topology_two_hosts_two_ranks_each(fake_cluster):
    c = fake_cluster(2)
    res = _launch(c.hosts, 2, "topo")
    assert sorted(res) == [0, 1, 2, 3]
    for r, x in res.items():
        assert x["hosts"] == [[0, 1], [2, 3]] and x["nnodes"] == 2 and x["by_probe"]
        assert x["node_rank"] == r // 2 and x["local_rank"] == r % 2 and x["local_world_size"] == 2
        assert x["local_rank"] == x["env_local_rank"]
        assert x["host_ranks"] == [2 * (r // 2), 2 * (r // 2) + 1]
        assert x["host_backend"] == "shm" and x["backend"] == "tcp"
        assert x["host_sum"] == sum(q + 1 for q in x["host_ranks"])
    for h in c.hosts:  # the probes and segments are gone
        assert "helios-" not in h.run(["ls", "/dev/shm"]).stdout


def test_containers_with_own_shm_but_one_hostname_are_two_hosts(fake_cluster):
    """Two "containers" on one host: same hostname, boot id and network, separate /dev/shm."""
    c = fake_cluster(1)
    a, b = c.hosts[0].container(), c.hosts[0].container()
    assert a.run(["hostname"]).stdout == b.run(["hostname"]).stdout
    res = _launch([a, b], 2, "topo")
    for r, x in res.items():
        assert x["hosts"] == [[0, 1], [2, 3]], x
        assert x["node_rank"] == r // 2 and x["local_rank"] == r % 2
        assert x["host_backend"] == "shm" and x["backend"] == "tcp"
        assert x["host_sum"] == sum(q + 1 for q in x["host_ranks"])


if __name__ == "__main__":
    globals()["rank_" + sys.argv[1]]()
