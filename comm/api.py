"""The public functions of helios.comm (``import helios.comm as dist``).

Naming follows torch.distributed: ``src``/``dst`` are global ranks even inside a group,
``get_rank(group)`` is the rank inside the group, and ``new_group`` must be called by every
rank in the same order (ranks outside the group get a handle they cannot run ops on).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from typing import Any

from helios.comm import algorithms as A
from helios.comm import auth
from helios.comm import env as envmod
from helios.comm.env import BACKENDS  # noqa: F401  (re-exported: helios.comm.BACKENDS)
from helios.comm import shm as shmmod
from helios.comm import topology as topomod
from helios.comm.buffers import Buffer, as_buffer
from helios.comm.group import ProcessGroup, Work
from helios.comm.reduce_ops import check_op
from helios.comm.store import PrefixStore, TCPStore
from helios.comm.tcp import TcpTransport, pick_address

from helios.errors import CommError, DTypeError, ShapeError


class _NonMember:
    """What ``new_group`` returns on a rank outside the group."""

    def __init__(self, ranks: list[int], name: str) -> None:
        self.ranks, self.name = ranks, name


class _State:
    def __init__(self) -> None:
        self.world: ProcessGroup | None = None
        self.store: TCPStore | None = None
        self.pstore: PrefixStore | None = None
        self.groups: list[ProcessGroup] = []
        self.ngroups = 0
        self.inits = 0
        self.rank = -1
        self.infos: list[dict[str, Any]] = []
        self.token = ""
        self.local_addr = "127.0.0.1"
        self.backend = ""
        self.timeout = 300.0
        self.topo: topomod.Topology | None = None
        self.host_group: ProcessGroup | None = None


_S = _State()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ibverbs_ok() -> bool:
    try:
        from helios.comm import ibverbs

        return ibverbs.available() is None
    except ImportError:
        return False


def init_process_group(backend: str = "auto", timeout: float = 300.0, *, rank: int | None = None,
                       world_size: int | None = None, master_addr: str | None = None,
                       master_port: int | None = None) -> None:
    """Join the job: rendezvous through the store, pick a backend, connect the world group.

    ``backend``: ``"shm"`` (one host), ``"tcp"``, ``"ibverbs"`` or ``"auto"`` (shm when every
    rank is on this host, else ibverbs when every rank has an RDMA device, else tcp).
    ``timeout`` (seconds) bounds every wait, in rendezvous and in every operation.
    ``HELIOS_COMM_BACKEND`` names the backend when ``backend`` is ``"auto"``.
    """
    if backend == "auto" and os.environ.get("HELIOS_COMM_BACKEND"):
        backend = os.environ["HELIOS_COMM_BACKEND"]
        if backend not in BACKENDS:
            raise ValueError(f"helios.comm: HELIOS_COMM_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}.")
    if backend not in BACKENDS:
        raise ValueError(f"helios.comm: backend {backend!r} is not one of {', '.join(BACKENDS)}.")
    if _S.world is not None:
        raise CommError("helios.comm: init_process_group() was already called; destroy_process_group() first.")
    if rank is not None and world_size is not None:
        cfg = envmod.LaunchConfig(rank, world_size, 0, master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                  int(master_port or os.environ.get("MASTER_PORT", envmod.DEFAULT_PORT)), "arguments",
                                  os.environ.get("HELIOS_JOB_ID", ""))
    else:
        cfg = envmod.resolve()
        if master_addr or master_port:
            cfg = envmod.LaunchConfig(cfg.rank, cfg.world_size, cfg.local_rank, master_addr or cfg.master_addr,
                                      int(master_port or cfg.master_port), cfg.source, cfg.job_id)
    store = TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_server=cfg.rank == 0, timeout=timeout,
                     job_id=cfg.job_id)
    try:
        ps = PrefixStore(f"init{_S.inits}", store)
        _S.inits += 1
        if cfg.rank == 0:
            ps.set("token", shmmod.new_token().encode())
        token = ps.get("token", timeout).decode()
        local_addr = pick_address(os.environ.get("HELIOS_SOCKET_IFNAME"), store._sock.getsockname()[0])
        probe = topomod.Probe()
        try:
            info = {"host": socket.gethostname(), "addr": local_addr, "boot": _boot_id(), "pid": os.getpid(),
                    "shm": shmmod.available() is None, "ib": backend in ("auto", "ibverbs") and _ibverbs_ok(),
                    **probe.info()}
            ps.set(f"info/{cfg.rank}", json.dumps(info).encode())
            infos = [json.loads(ps.get(f"info/{r}", timeout)) for r in range(cfg.world_size)]
            # Hosts by fact: the ranks that can open each other's shared memory (comm/topology.py).
            topo = topomod.discover(ps, cfg.rank, cfg.world_size, infos, timeout)
        finally:
            probe.close()
        one_host = topo.nnodes == 1
        if backend == "auto":
            backend = "shm" if one_host and all(i["shm"] for i in infos) else (
                "ibverbs" if all(i["ib"] for i in infos) else "tcp")
        elif backend == "shm" and not one_host:
            raise CommError(f"helios.comm: backend='shm' needs every rank on one host (ranks that can open each "
                            f"other's shared memory); the ranks are on {topo.describe()} "
                            f"(hostnames {sorted({i['host'] for i in infos})}). Use backend='tcp' or 'auto'.")
        _S.store, _S.pstore, _S.rank, _S.infos = store, ps, cfg.rank, infos
        _S.token, _S.local_addr, _S.backend, _S.timeout = token, local_addr, backend, timeout
        _S.topo = topo
        _S.world = _make_group(ps, "world", list(range(cfg.world_size)), backend, timeout)
        if topo.nnodes > 1:
            # The ranks of this host, over shared memory where every one of them has it.
            hranks = list(topo.local_ranks)
            hb = "shm" if all(infos[r]["shm"] for r in hranks) and topo.by_probe else backend
            _S.host_group = _make_group(ps, f"host{topo.node_rank}", hranks, hb, timeout)
            _S.host_group.role = "host"
            if topo.uniform and topo.local_world_size > 1 and hb == "shm":
                _S.world.hier = _make_hierarchy(ps, topo, backend, timeout)
    except BaseException:
        _S.world = None
        if _S.host_group is not None:
            _S.host_group.close()
            _S.host_group = None
        store.close()
        _S.store = None
        raise


def _make_group(store: PrefixStore, name: str, ranks: list[int], backend: str, timeout: float) -> ProcessGroup:
    me = ranks.index(_S.rank)
    gstore = PrefixStore(name, store)
    if backend == "shm":
        pids = [int(_S.infos[r]["pid"]) for r in ranks]
        t = shmmod.ShmTransport(gstore, me, len(ranks), pids, _S.token, name, timeout)
    elif backend == "tcp":
        assert _S.store is not None
        key = auth.link_key(_S.store.secret, _S.token.encode())  # only peers holding the job secret get in
        t = TcpTransport(gstore, me, len(ranks), _S.local_addr, key, timeout)
    else:
        from helios.comm import ibverbs

        t = ibverbs.IbvTransport(gstore, me, len(ranks), _S.token, timeout)
    g = ProcessGroup(t, ranks, name, timeout)
    g.name_hosts([f"{_S.infos[r]['host']} ({_S.infos[r]['addr']})" for r in ranks])
    return g


def _make_hierarchy(ps: PrefixStore, topo: topomod.Topology, backend: str, timeout: float):
    """The two private levels of the world's hierarchical collectives, calibrated (comm/hierarchical.py)."""
    from helios.comm.hierarchical import Hierarchy

    intra = _make_group(ps, f"hier-intra{topo.node_rank}", list(topo.local_ranks), "shm", timeout)
    try:
        inter = _make_group(ps, f"hier-inter{topo.local_rank}", [h[topo.local_rank] for h in topo.hosts], backend,
                            timeout)
    except BaseException:
        intra.close()
        raise
    h = Hierarchy(topo, intra, inter)
    try:
        if os.environ.get("HELIOS_COMM_HIER_CALIBRATE", "1") != "0":
            h.calibrate(ps, timeout)
            # Nobody leaves (rank 0 may close the store) before every rank has read the figures.
            assert _S.world is not None
            _S.world.run_op("barrier", 0, A.barrier, "barrier")
    except BaseException:
        h.close()
        raise
    return h


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Release a group, or (no argument) every group, the world and the store."""
    if group is not None and group is not _S.world:
        if isinstance(group, ProcessGroup):
            group.close()
            if group in _S.groups:
                _S.groups.remove(group)
        return
    closed = [*_S.groups, _S.host_group, _S.world]
    for g in _S.groups:
        g.close()
    _S.groups = []
    if _S.host_group is not None:
        _S.host_group.close()
        _S.host_group = None
    _S.topo = None
    if _S.world is not None:
        _S.world.close()
        _S.world = None
    if _S.store is not None:
        # a failed job's host does not wait at exit for ranks that may never leave the store
        _S.store.close(linger=not any(g is not None and g.broken is not None for g in closed))
        _S.store = None
    _S.ngroups = 0


atexit.register(destroy_process_group)


def is_initialized() -> bool:
    """Whether init_process_group() has run (and destroy_process_group() has not)."""
    return _S.world is not None


def _group(group: Any) -> ProcessGroup:
    if _S.world is None:
        raise CommError("helios.comm: the process group is not initialised; call init_process_group() first.")
    if group is None:
        return _S.world
    if isinstance(group, _NonMember):
        raise ValueError(f"helios.comm: rank {_S.rank} is not a member of group {group.name} {group.ranks}; "  # noqa: TRY004 - a group object of the wrong kind is a bad value, as in torch
                         "only members may call collectives on it.")
    return group


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the world by default); -1 outside the group."""
    if isinstance(group, _NonMember):
        return -1
    return _group(group).rank


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (the world by default)."""
    if isinstance(group, _NonMember):
        return len(group.ranks)
    return _group(group).size


def get_backend(group: Any = None) -> str:
    """Transport of ``group``: shm, tcp or ibverbs."""
    return _group(group).backend


def get_topology() -> topomod.Topology:
    """The hosts of the job (:class:`helios.comm.topology.Topology`): ``hosts``, ``node_of``, ...

    Ranks share a host when they can open each other's shared memory (probed in
    ``init_process_group``), not merely when their hostnames agree.
    """
    _group(None)
    assert _S.topo is not None
    return _S.topo


def get_local_rank() -> int:
    """This rank's index among the ranks of its host (ascending global ranks)."""
    return get_topology().local_rank


def get_local_world_size() -> int:
    """Number of ranks on this rank's host."""
    return get_topology().local_world_size


def get_node_rank() -> int:
    """Index of this rank's host; hosts are numbered by their lowest global rank."""
    return get_topology().node_rank


def get_num_nodes() -> int:
    """Number of hosts in the job."""
    return get_topology().nnodes


def get_host_group() -> ProcessGroup:
    """The group of the ranks on this rank's host: shared memory where they all have it (the world
    itself when the job runs on one host).  Made by ``init_process_group`` on every rank; its
    collectives are this host's alone (the other hosts run theirs on their own host groups)."""
    world = _group(None)
    return _S.host_group if _S.host_group is not None else world


def new_group(ranks: list[int] | None = None, timeout: float | None = None,
              role: str = "") -> ProcessGroup | _NonMember:
    """A sub-communicator over global ``ranks``; every rank must call it, in the same order.
    ``role`` says what the group is for ("tp", "dp", "pp", "ep", "cp", ...): a profile's
    trace puts each role's collectives on a track of its own."""
    world = _group(None)
    ranks = sorted(set(range(world.size) if ranks is None else ranks))
    if not ranks or ranks[0] < 0 or ranks[-1] >= world.size:
        raise ValueError(f"helios.comm: new_group ranks {ranks} must be a non-empty subset of 0..{world.size - 1}.")
    gid = _S.ngroups
    _S.ngroups += 1
    name = f"g{gid}"
    if _S.rank not in ranks:
        return _NonMember(ranks, name)
    assert _S.pstore is not None
    g = _make_group(_S.pstore, name, ranks, _S.backend, timeout or _S.timeout)
    g.role = role
    _S.groups.append(g)
    return g


def enqueue(program, group: Any = None, name: str = "program") -> Work:
    """Run ``program()`` on the communicator's thread after every operation issued before
    it, and return its Work.  Collectives that ``program`` calls on ``group`` run at once,
    inside it, in its order: a chain such as compress, all-reduce, decompress runs as one
    unit that overlaps the caller (DistributedDataParallel's compression hooks).  Every
    rank must enqueue the same programs in the same order.  An exception in the program
    makes the communicator unusable (the peers may be waiting on its next collective)."""
    return _group(group).enqueue(name, program)


def comm_counters(group: Any = None) -> dict:
    """What ``group`` (the world by default; ``"all"``: every group this rank is in, summed) has
    done since it was created: per operation name the calls and operand bytes, and
    ``bytes_sent``, the bytes this rank sent to its peers (see
    :class:`helios.comm.group.CommCounters`).  Subtract two readings for a step."""
    if group != "all":
        return _group(group).counters.snapshot()
    total: dict = {"calls": {}, "payload_bytes": {}, "bytes_sent": 0}
    for g in [_group(None), *_S.groups]:
        c = g.counters.snapshot()
        total["bytes_sent"] += c["bytes_sent"]
        for key in ("calls", "payload_bytes"):
            for name, v in c[key].items():
                total[key][name] = total[key].get(name, 0) + v
    return total


# --------------------------------------------------------------------------- collectives
def _desc(name: str, nbytes: int, *parts: Any) -> str:
    return " ".join([name, f"{nbytes} bytes"] + [str(p) for p in parts])


def _finish(g: ProcessGroup, name: str, nbytes: int, body, desc: str, bufs: list[Buffer], async_op: bool,
            p2p: bool = False) -> Work | None:
    def run() -> None:
        g.run_op(name, nbytes, body, desc, p2p)
        for b in bufs:
            b.commit()

    return g.submit(name, run, async_op)


def _hier(g: ProcessGroup, op: str, nbytes: int, algorithm: str) -> str | None:
    """The inter-host algorithm when ``op`` runs hierarchically on ``g`` (see comm/hierarchical.py), else None."""
    if g.hier is None:
        return None
    if algorithm not in ("auto", "ring", "tree", "halving_doubling", "hierarchical"):
        return None  # g.pick reports it
    return g.hier.choose(op, nbytes, algorithm, g.seg_bytes)


def _run_hier(g: ProcessGroup, fn) -> None:
    """Run a hierarchical operation; its two levels' bytes count as ``g``'s."""
    before = g.hier.bytes_sent()
    g.hier.deadline = g.op_deadline  # both levels within the one timeout of g's operation
    try:
        fn()
    finally:
        g.hier.deadline = None
        g.counters.bytes_sent += g.hier.bytes_sent() - before


def all_reduce(x: Any, op: str = "sum", group: Any = None, async_op: bool = False, algorithm: str = "auto",
               dtype: str | None = None) -> Work | None:
    """In-place all-reduce of ``x`` with ``op`` in sum | avg | max | min | prod."""
    g = _group(group)
    b = as_buffer(x, dtype)
    check_op(op, b.dtype)
    hier = _hier(g, "all_reduce", b.nbytes, algorithm)
    alg = g.pick("all_reduce", b.nbytes, algorithm)

    def body(c: A.Ctx) -> None:
        flat = b.flat  # a device tensor is reached here, on the thread that runs the operation
        if hier is not None:
            _run_hier(g, lambda: g.hier.all_reduce(flat, op, b.dtype, hier))
        elif alg == "direct":
            g.direct.all_reduce(flat, op, b.dtype)
        elif alg == "ring":
            A.ring_all_reduce(c, flat, op, b.dtype)
        elif alg == "tree":
            A.tree_all_reduce(c, flat, op, b.dtype)
        else:
            A.hd_all_reduce(c, flat, op, b.dtype)

    return _finish(g, "all_reduce", b.nbytes, body, _desc("all_reduce", b.nbytes, b.dtype, op), [b], async_op)


def _same_dtype(a: Buffer, b: Buffer, name: str) -> None:
    if a.dtype != b.dtype:
        raise DTypeError(f"helios.comm: {name}: output dtype {a.dtype} differs from input dtype {b.dtype}.")


def all_gather(out: Any, x: Any, group: Any = None, async_op: bool = False, algorithm: str = "auto",
               dtype: str | None = None) -> Work | None:
    """``out`` (world copies of x's size) receives every rank's ``x`` in rank order."""
    g = _group(group)
    bx, bo = as_buffer(x, dtype, what="input", writable=False), as_buffer(out, dtype, what="output")
    _same_dtype(bo, bx, "all_gather")
    if bo.count != bx.count * g.size:
        raise ShapeError(f"helios.comm: all_gather: output has {bo.count} elements, expected {g.size} x {bx.count} "
                         f"= {g.size * bx.count} (world size times the input).")
    hier = _hier(g, "all_gather", bo.nbytes, algorithm)
    alg = g.pick("all_gather", bo.nbytes, algorithm)

    def body(c: A.Ctx) -> None:
        if hier is not None:
            _run_hier(g, lambda: g.hier.all_gather(bo.flat, bx.flat, hier))
        elif alg == "direct":
            g.direct.all_gather(bo.flat, bx.flat)
        elif alg == "ring":
            A.ring_all_gather(c, bo.flat, bx.flat)
        else:
            A.hd_all_gather(c, bo.flat, bx.flat)

    return _finish(g, "all_gather", bo.nbytes, body, _desc("all_gather", bx.nbytes, bx.dtype), [bo], async_op)


def reduce_scatter(out: Any, x: Any, op: str = "sum", group: Any = None, async_op: bool = False,
                   algorithm: str = "auto", dtype: str | None = None) -> Work | None:
    """``x`` holds world chunks; ``out`` receives the reduction of chunk ``rank`` over ranks."""
    g = _group(group)
    bx, bo = as_buffer(x, dtype, what="input", writable=False), as_buffer(out, dtype, what="output")
    _same_dtype(bo, bx, "reduce_scatter")
    check_op(op, bx.dtype)
    if bx.count != bo.count * g.size:
        raise ShapeError(f"helios.comm: reduce_scatter: input has {bx.count} elements, expected {g.size} x {bo.count} "
                         f"= {g.size * bo.count} (world size times the output).")
    hier = _hier(g, "reduce_scatter", bx.nbytes, algorithm)
    alg = g.pick("reduce_scatter", bx.nbytes, algorithm)

    def body(c: A.Ctx) -> None:
        if hier is not None:
            _run_hier(g, lambda: g.hier.reduce_scatter(bo.flat, bx.flat, op, bx.dtype, hier))
        elif alg == "direct":
            g.direct.reduce_scatter(bo.flat, bx.flat, op, bx.dtype)
        elif alg == "ring":
            A.ring_reduce_scatter(c, bo.flat, bx.flat, op, bx.dtype)
        else:
            A.hd_reduce_scatter(c, bo.flat, bx.flat, op, bx.dtype)

    return _finish(g, "reduce_scatter", bx.nbytes, body, _desc("reduce_scatter", bx.nbytes, bx.dtype, op), [bo],
                   async_op)


def broadcast(x: Any, src: int = 0, group: Any = None, async_op: bool = False, algorithm: str = "auto",
              dtype: str | None = None) -> Work | None:
    """Copy global rank ``src``'s ``x`` into every rank's ``x``."""
    g = _group(group)
    b = as_buffer(x, dtype)
    root = g.group_rank(src, "src")
    hier = _hier(g, "broadcast", b.nbytes, algorithm)
    alg = g.pick("broadcast", b.nbytes, algorithm)

    def body(c: A.Ctx) -> None:
        if hier is not None:
            _run_hier(g, lambda: g.hier.broadcast(b.flat, src, hier))
        elif alg == "direct":
            g.direct.broadcast(b.flat, root)
        elif alg == "ring":
            A.tree_broadcast(c, b.flat, root, A.chain)
        else:
            A.tree_broadcast(c, b.flat, root, A.binomial)

    return _finish(g, "broadcast", b.nbytes, body, _desc("broadcast", b.nbytes, b.dtype, "src", src), [b], async_op)


def reduce(x: Any, dst: int = 0, op: str = "sum", group: Any = None, async_op: bool = False,
           algorithm: str = "auto", dtype: str | None = None) -> Work | None:
    """Reduce every rank's ``x`` into global rank ``dst``'s ``x`` (the others keep theirs)."""
    g = _group(group)
    b = as_buffer(x, dtype)
    check_op(op, b.dtype)
    root = g.group_rank(dst, "dst")
    alg = g.pick("reduce", b.nbytes, algorithm)

    def body(c: A.Ctx) -> None:
        if alg == "direct":
            g.direct.reduce(b.flat, root, op, b.dtype)
        elif alg == "ring":
            A.tree_reduce(c, b.flat, root, op, b.dtype, A.chain)
        else:
            A.tree_reduce(c, b.flat, root, op, b.dtype, A.binomial)

    bufs = [b] if g.rank == root else []
    return _finish(g, "reduce", b.nbytes, body, _desc("reduce", b.nbytes, b.dtype, op, "dst", dst), bufs, async_op)


def all_to_all(out: Any, x: Any, group: Any = None, async_op: bool = False, dtype: str | None = None) -> Work | None:
    """Chunk j of ``x`` goes to rank j; chunk j of ``out`` came from rank j."""
    g = _group(group)
    bx, bo = as_buffer(x, dtype, what="input", writable=False), as_buffer(out, dtype, what="output")
    _same_dtype(bo, bx, "all_to_all")
    if bx.count != bo.count or bx.count % g.size:
        raise ShapeError(f"helios.comm: all_to_all: input ({bx.count}) and output ({bo.count}) must have the same "
                         f"number of elements, divisible by the world size {g.size}.")
    direct = g.direct is not None

    def body(c: A.Ctx) -> None:
        if direct:
            g.direct.all_to_all(bo.flat, bx.flat)
        else:
            A.all_to_all(c, bo.flat, bx.flat)

    return _finish(g, "all_to_all", bx.nbytes, body, _desc("all_to_all", bx.nbytes, bx.dtype), [bo], async_op)


def barrier(group: Any = None, async_op: bool = False) -> Work | None:
    """Return once every rank of ``group`` has called barrier()."""
    g = _group(group)

    def body(c: A.Ctx) -> None:
        if g.direct is not None:
            g.direct.barrier()
        else:
            A.barrier(c)

    return _finish(g, "barrier", 0, body, "barrier", [], async_op)


# ---------------------------------------------------------------------- point to point
_P2P = 1 << 62


def _p2p(kind: str, x: Any, peer: int, group: Any, dtype: str | None, async_op: bool) -> Work | None:
    g = _group(group)
    b = as_buffer(x, dtype, writable=kind == "recv")
    p = g.group_rank(peer, "dst" if kind == "send" else "src")
    if p == g.rank:
        raise ValueError(f"helios.comm: {kind} to or from this same rank ({peer}); use a copy instead.")
    counters = g._p2p_send if kind == "send" else g._p2p_recv
    tag = _P2P | counters[p]  # per pair, in issue order: the n-th send matches the n-th recv
    counters[p] += 1
    def body(c: A.Ctx) -> None:
        raw = b.bytes_view()
        if kind == "send":
            c.e.post_send(p, tag, raw)
        else:
            c.e.post_recv(p, tag, raw)
        c.run()

    bufs = [b] if kind == "recv" else []
    return _finish(g, kind, b.nbytes, body, kind, bufs, async_op, p2p=True)


def send(x: Any, dst: int, group: Any = None, dtype: str | None = None) -> None:
    """Send ``x`` to global rank ``dst`` (returns once handed to the transport)."""
    _p2p("send", x, dst, group, dtype, False)


def recv(x: Any, src: int, group: Any = None, dtype: str | None = None) -> None:
    """Receive into ``x`` the next message from global rank ``src``."""
    _p2p("recv", x, src, group, dtype, False)


def isend(x: Any, dst: int, group: Any = None, dtype: str | None = None) -> Work:
    """Asynchronous send; ``wait()`` the handle before touching ``x``."""
    w = _p2p("send", x, dst, group, dtype, True)
    assert w is not None
    return w


def irecv(x: Any, src: int, group: Any = None, dtype: str | None = None) -> Work:
    """Asynchronous receive; ``x`` holds the message after ``wait()``."""
    w = _p2p("recv", x, src, group, dtype, True)
    assert w is not None
    return w

