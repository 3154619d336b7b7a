"""helios.comm: collectives over shared memory, TCP and ibverbs.

::

    import helios.comm as dist
    dist.init_process_group(backend="auto", timeout=300)
    dist.all_reduce(x, op="sum")

See comm/README.md for the backends, the algorithm choice, the environment variables and
multi-host launches (helios-run, Slurm, mpirun).
"""

from helios.comm.api import (
    BACKENDS,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    comm_counters,
    destroy_process_group,
    enqueue,
    get_backend,
    get_host_group,
    get_local_rank,
    get_local_world_size,
    get_node_rank,
    get_num_nodes,
    get_rank,
    get_topology,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    send,
)
from helios.comm.group import ProcessGroup, Work

from helios.errors import CommError

__all__ = [
    "BACKENDS", "CommError", "ProcessGroup", "Work", "all_gather", "all_reduce", "all_to_all", "barrier", "broadcast",
    "comm_counters", "destroy_process_group", "enqueue", "get_backend", "get_host_group",
    "get_local_rank", "get_local_world_size", "get_node_rank", "get_num_nodes", "get_rank", "get_topology",
    "get_world_size", "init_process_group", "irecv",
    "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter", "send",
]
