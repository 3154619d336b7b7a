"""ibverbs transport: RC queue pairs, registered rings, RDMA write with immediate.

A cffi binding in ABI mode (``dlopen("libibverbs.so.1")``, no compiler, no headers): the
exported verbs are declared as in ``infiniband/verbs.h`` and the data-path calls that the
header defines inline (``ibv_post_send``, ``ibv_post_recv``, ``ibv_poll_cq``) go through
the context's ops table exactly as the inline functions do.

Each ordered pair of ranks has a byte ring of ``HELIOS_IB_RING_BYTES`` in the *receiver's*
registered memory.  The sender copies a chunk into its registered staging copy of that ring
and posts one RDMA_WRITE_WITH_IMM at the same offset, the immediate carrying the byte
count; the receiver's completion tells it how many bytes landed (the RC queue pair keeps
them in order).  After copying bytes out, the receiver RDMA-writes its consumed count into
the sender's credit word, which the sender reads before writing again.  This gives the
progress engine the same ordered byte stream per peer as TCP and shared memory, so every
algorithm runs unchanged.

Faults: queue pairs use timeout 14 (about 67 ms), 7 retries and infinite RNR retries, as
Gloo does; a dead peer surfaces as a completion error (retry exceeded) within about half a
second, and a stopped one at the operation's deadline.  ``abort`` moves every queue pair to
the error state, which fails the peers' pending writes at once.

Environment: ``HELIOS_IB_DEVICE`` (default: the first device with an active port),
``HELIOS_IB_PORT`` (1), ``HELIOS_IB_GID_INDEX`` (0; on RoCE pick the IPv4-mapped GID, see
``show_gids``), ``HELIOS_IB_RING_BYTES`` (4 MiB).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import numpy as np
from helios.comm.engine import Link, PeerLost, Transport

from helios.errors import CommError

_CDEF = """
typedef struct { int _opaque[10]; } pthread_mutex_t;
typedef struct { int _opaque[12]; } pthread_cond_t;
union ibv_gid { uint8_t raw[16]; struct { uint64_t subnet_prefix; uint64_t interface_id; } global; };
struct ibv_device;
struct ibv_pd { struct ibv_context *context; uint32_t handle; };
struct ibv_mr { struct ibv_context *context; struct ibv_pd *pd; void *addr; size_t length;
                uint32_t handle; uint32_t lkey; uint32_t rkey; };
struct ibv_comp_channel { struct ibv_context *context; int fd; int refcnt; };
struct ibv_cq { struct ibv_context *context; struct ibv_comp_channel *channel; void *cq_context;
                uint32_t handle; int cqe; pthread_mutex_t mutex; pthread_cond_t cond;
                uint32_t comp_events_completed; uint32_t async_events_completed; };
struct ibv_srq;
struct ibv_qp { struct ibv_context *context; void *qp_context; struct ibv_pd *pd; struct ibv_cq *send_cq;
                struct ibv_cq *recv_cq; struct ibv_srq *srq; uint32_t handle; uint32_t qp_num; int state;
                int qp_type; pthread_mutex_t mutex; pthread_cond_t cond; uint32_t events_completed; };
struct ibv_qp_cap { uint32_t max_send_wr; uint32_t max_recv_wr; uint32_t max_send_sge; uint32_t max_recv_sge;
                    uint32_t max_inline_data; };
struct ibv_qp_init_attr { void *qp_context; struct ibv_cq *send_cq; struct ibv_cq *recv_cq; struct ibv_srq *srq;
                          struct ibv_qp_cap cap; int qp_type; int sq_sig_all; };
struct ibv_global_route { union ibv_gid dgid; uint32_t flow_label; uint8_t sgid_index; uint8_t hop_limit;
                          uint8_t traffic_class; };
struct ibv_ah_attr { struct ibv_global_route grh; uint16_t dlid; uint8_t sl; uint8_t src_path_bits;
                     uint8_t static_rate; uint8_t is_global; uint8_t port_num; };
struct ibv_qp_attr { int qp_state; int cur_qp_state; int path_mtu; int path_mig_state; uint32_t qkey;
                     uint32_t rq_psn; uint32_t sq_psn; uint32_t dest_qp_num; unsigned int qp_access_flags;
                     struct ibv_qp_cap cap; struct ibv_ah_attr ah_attr; struct ibv_ah_attr alt_ah_attr;
                     uint16_t pkey_index; uint16_t alt_pkey_index; uint8_t en_sqd_async_notify;
                     uint8_t sq_draining; uint8_t max_rd_atomic; uint8_t max_dest_rd_atomic;
                     uint8_t min_rnr_timer; uint8_t port_num; uint8_t timeout; uint8_t retry_cnt;
                     uint8_t rnr_retry; uint8_t alt_port_num; uint8_t alt_timeout; uint32_t rate_limit; };
struct ibv_port_attr { int state; int max_mtu; int active_mtu; int gid_tbl_len; uint32_t port_cap_flags;
                       uint32_t max_msg_sz; uint32_t bad_pkey_cntr; uint32_t qkey_viol_cntr;
                       uint16_t pkey_tbl_len; uint16_t lid; uint16_t sm_lid; uint8_t lmc; uint8_t max_vl_num;
                       uint8_t sm_sl; uint8_t subnet_timeout; uint8_t init_type_reply; uint8_t active_width;
                       uint8_t active_speed; uint8_t phys_state; uint8_t link_layer; uint8_t flags;
                       uint16_t port_cap_flags2; };
struct ibv_sge { uint64_t addr; uint32_t length; uint32_t lkey; };
struct ibv_send_wr { uint64_t wr_id; struct ibv_send_wr *next; struct ibv_sge *sg_list; int num_sge; int opcode;
                     unsigned int send_flags; uint32_t imm_data;
                     union { struct { uint64_t remote_addr; uint32_t rkey; } rdma;
                             struct { uint64_t remote_addr; uint64_t compare_add; uint64_t swap; uint32_t rkey; } atomic;
                             struct { void *ah; uint32_t remote_qpn; uint32_t remote_qkey; } ud; } wr;
                     union { struct { uint32_t remote_srqn; } xrc; } qp_type;
                     union { struct { void *mw; uint32_t rkey; struct { void *mr; uint64_t addr; uint64_t length;
                                      unsigned int mw_access_flags; } bind_info; } bind_mw;
                             struct { void *hdr; uint16_t hdr_sz; uint16_t mss; } tso; } ext; };
struct ibv_recv_wr { uint64_t wr_id; struct ibv_recv_wr *next; struct ibv_sge *sg_list; int num_sge; };
struct ibv_wc { uint64_t wr_id; int status; int opcode; uint32_t vendor_err; uint32_t byte_len; uint32_t imm_data;
                uint32_t qp_num; uint32_t src_qp; unsigned int wc_flags; uint16_t pkey_index; uint16_t slid;
                uint8_t sl; uint8_t dlid_path_bits; };
struct ibv_context_ops {
    void *(*_compat_query_device)(void); void *_compat_query_port; void *(*_compat_alloc_pd)(void);
    void *(*_compat_dealloc_pd)(void); void *(*_compat_reg_mr)(void); void *(*_compat_rereg_mr)(void);
    void *(*_compat_dereg_mr)(void); void *alloc_mw; void *bind_mw; void *dealloc_mw;
    void *(*_compat_create_cq)(void);
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    void *(*_compat_cq_event)(void); void *(*_compat_resize_cq)(void); void *(*_compat_destroy_cq)(void);
    void *(*_compat_create_srq)(void); void *(*_compat_modify_srq)(void); void *(*_compat_query_srq)(void);
    void *(*_compat_destroy_srq)(void); void *post_srq_recv;
    void *(*_compat_create_qp)(void); void *(*_compat_query_qp)(void); void *(*_compat_modify_qp)(void);
    void *(*_compat_destroy_qp)(void);
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
    void *(*_compat_create_ah)(void); void *(*_compat_destroy_ah)(void); void *(*_compat_attach_mcast)(void);
    void *(*_compat_detach_mcast)(void); void *(*_compat_async_event)(void);
};
struct ibv_context { struct ibv_device *device; struct ibv_context_ops ops; int cmd_fd; int async_fd;
                     int num_comp_vectors; pthread_mutex_t mutex; void *abi_compat; };
struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *port_attr);
int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_destroy_cq(struct ibv_cq *cq);
struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
int ibv_destroy_qp(struct ibv_qp *qp);
const char *ibv_wc_status_str(int status);
"""

# Constants of infiniband/verbs.h.
_QPT_RC = 2
_QPS_INIT, _QPS_RTR, _QPS_RTS, _QPS_ERR = 1, 2, 3, 6
_ACCESS_LOCAL_WRITE, _ACCESS_REMOTE_WRITE = 1, 2
_QP_STATE, _QP_ACCESS_FLAGS, _QP_PKEY_INDEX, _QP_PORT = 1, 1 << 3, 1 << 4, 1 << 5
_QP_AV, _QP_PATH_MTU, _QP_TIMEOUT, _QP_RETRY_CNT, _QP_RNR_RETRY = 1 << 7, 1 << 8, 1 << 9, 1 << 10, 1 << 11
_QP_RQ_PSN, _QP_MAX_QP_RD_ATOMIC, _QP_MIN_RNR_TIMER, _QP_SQ_PSN = 1 << 12, 1 << 13, 1 << 15, 1 << 16
_QP_MAX_DEST_RD_ATOMIC, _QP_DEST_QPN = 1 << 17, 1 << 20
_WR_RDMA_WRITE, _WR_RDMA_WRITE_WITH_IMM = 0, 1
_SEND_SIGNALED = 1 << 1
_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1
_PORT_ACTIVE = 4
_LINK_ETHERNET = 2
_SEND_DEPTH, _RECV_DEPTH = 128, 128
_KIND_DATA, _KIND_CREDIT, _KIND_RECV = 1, 2, 3

_lib = None
_ffi = None


def _load():
    global _lib, _ffi
    if _lib is None:
        import cffi

        ffi = cffi.FFI()
        ffi.cdef(_CDEF)
        _lib = ffi.dlopen("libibverbs.so.1")
        _ffi = ffi
    return _ffi, _lib


# Where the kernel lists RDMA devices and their verbs interfaces (libibverbs finds its devices
# from the same lists).  When both are empty there is nothing to open, and saying so needs no
# cffi: parsing the declarations costs ~50 ms of CPU, which every rank paid at init.
SYSFS_CLASSES = ("/sys/class/infiniband", "/sys/class/infiniband_verbs")


def _kernel_lists_devices() -> bool:
    """Whether the kernel lists any RDMA device or verbs interface (SYSFS_CLASSES)."""
    for folder in SYSFS_CLASSES:
        try:
            if os.listdir(folder):
                return True
        except OSError:
            pass
    return False


def available() -> str | None:
    """None when an RDMA device with an active port can be used, else the reason it cannot."""
    if not _kernel_lists_devices():
        return f"no RDMA devices (none listed under {SYSFS_CLASSES[0]})"
    try:
        ffi, lib = _load()
    except ImportError:
        return "cffi is not installed (pip install 'helios[ibverbs]')"
    except OSError as e:
        return f"libibverbs is not installed ({e})"
    num = ffi.new("int *")
    devs = lib.ibv_get_device_list(num)
    if devs == ffi.NULL:
        return f"no RDMA devices (ibv_get_device_list failed: {os.strerror(ffi.errno)})"
    try:
        if num[0] == 0:
            return "no RDMA device on this host"
        want = os.environ.get("HELIOS_IB_DEVICE")
        port = int(os.environ.get("HELIOS_IB_PORT", "1"))
        for i in range(num[0]):
            name = ffi.string(lib.ibv_get_device_name(devs[i])).decode()
            if want and name != want:
                continue
            ctx = lib.ibv_open_device(devs[i])
            if ctx == ffi.NULL:
                continue
            attr = ffi.new("struct ibv_port_attr *")
            ok = lib.ibv_query_port(ctx, port, attr) == 0 and attr.state == _PORT_ACTIVE
            lib.ibv_close_device(ctx)
            if ok:
                return None
        return f"no RDMA device with an active port {port}" + (f" named {want}" if want else "")
    finally:
        lib.ibv_free_device_list(devs)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CommError(f"helios.comm: ibverbs: {what} failed ({os.strerror(rc if rc > 0 else _ffi.errno)}).")


class _Device:
    """Opened device, protection domain, one completion queue for everything."""

    def __init__(self) -> None:
        ffi, lib = _load()
        self.ffi, self.lib = ffi, lib
        want = os.environ.get("HELIOS_IB_DEVICE")
        self.port = int(os.environ.get("HELIOS_IB_PORT", "1"))
        self.gid_index = int(os.environ.get("HELIOS_IB_GID_INDEX", "0"))
        num = ffi.new("int *")
        devs = lib.ibv_get_device_list(num)
        if devs == ffi.NULL or num[0] == 0:
            raise CommError("helios.comm: ibverbs: no RDMA device on this host; use backend='tcp'.")
        self.ctx = ffi.NULL
        try:
            for i in range(num[0]):
                name = ffi.string(lib.ibv_get_device_name(devs[i])).decode()
                if want and name != want:
                    continue
                ctx = lib.ibv_open_device(devs[i])
                attr = ffi.new("struct ibv_port_attr *")
                if ctx != ffi.NULL and lib.ibv_query_port(ctx, self.port, attr) == 0 and attr.state == _PORT_ACTIVE:
                    self.ctx, self.name, self.port_attr = ctx, name, attr
                    break
                if ctx != ffi.NULL:
                    lib.ibv_close_device(ctx)
        finally:
            lib.ibv_free_device_list(devs)
        if self.ctx == ffi.NULL:
            raise CommError(f"helios.comm: ibverbs: no device with an active port {self.port}"
                            + (f" named {want}" if want else "") + ".")
        self.gid = ffi.new("union ibv_gid *")
        _check(lib.ibv_query_gid(self.ctx, self.port, self.gid_index, self.gid), "ibv_query_gid")
        self.pd = lib.ibv_alloc_pd(self.ctx)
        if self.pd == ffi.NULL:
            raise CommError("helios.comm: ibverbs: ibv_alloc_pd failed.")
        self.cq = lib.ibv_create_cq(self.ctx, 4 * (_SEND_DEPTH + _RECV_DEPTH) * 8, ffi.NULL, ffi.NULL, 0)
        if self.cq == ffi.NULL:
            raise CommError("helios.comm: ibverbs: ibv_create_cq failed.")
        self.wc = ffi.new("struct ibv_wc[64]")

    def reg(self, arr: np.ndarray):
        """Register a numpy array for local write and remote write."""
        mr = self.lib.ibv_reg_mr(self.pd, self.ffi.cast("void *", arr.ctypes.data), arr.nbytes,
                                 _ACCESS_LOCAL_WRITE | _ACCESS_REMOTE_WRITE)
        if mr == self.ffi.NULL:
            raise CommError(f"helios.comm: ibverbs: ibv_reg_mr of {arr.nbytes} bytes failed "
                            f"({os.strerror(self.ffi.errno)}); raise the locked-memory limit (ulimit -l).")
        return mr


class IbvLink(Link):
    """Byte stream to one peer over an RC queue pair."""

    def __init__(self, t: IbvTransport, peer: int) -> None:
        self.t, self.peer = t, peer
        self.cap = t.ring_bytes
        self.tail = 0           # bytes written to the peer
        self.remote_head = 0    # the peer's consumed count, as last read from our credit word
        self.head = 0           # bytes consumed from the peer
        self.landed = 0         # bytes the peer has written to us (from immediates)
        self.last_credit = 0
        self.outstanding = 0
        self.error: str | None = None

    def send_some(self, data: memoryview) -> int:
        t = self.t
        if self.error:
            raise PeerLost(self.peer, self.error)
        t.poll()
        self.remote_head = int(t.credit_in[self.peer])
        space = self.cap - (self.tail - self.remote_head)
        pos = self.tail % self.cap
        k = min(space, data.nbytes, self.cap - pos, t.max_write)
        if k <= 0 or self.outstanding >= _SEND_DEPTH - 2:
            return 0
        stage = t.stage[self.peer]
        stage[pos:pos + k] = np.frombuffer(data[:k], dtype=np.uint8)
        t.post_write(self.peer, t.stage_mr[self.peer], stage.ctypes.data + pos, k,
                     t.remote[self.peer]["ring_addr"] + pos, t.remote[self.peer]["ring_rkey"], imm=k, kind=_KIND_DATA)
        self.outstanding += 1
        self.tail += k
        return k

    def recv_some(self, into: memoryview) -> int:
        t = self.t
        if self.error:
            raise PeerLost(self.peer, self.error)
        t.poll()
        k = min(self.landed - self.head, into.nbytes)
        if k <= 0:
            return 0
        ring = t.ring[self.peer]
        pos = self.head % self.cap
        first = min(k, self.cap - pos)
        into[:first] = ring[pos:pos + first]
        if k > first:
            into[first:k] = ring[:k - first]
        self.head += k
        # Return credit once a quarter of the ring is consumed, or when we caught up.
        if self.head - self.last_credit >= self.cap // 4 or self.head == self.landed:
            self.flush_credit()
        return k

    def flush_credit(self) -> None:
        """RDMA-write our consumed count into the peer's credit word (deferred while the send queue is full)."""
        t = self.t
        if self.head == self.last_credit or self.outstanding >= _SEND_DEPTH - 1:
            return
        t.credit_out[self.peer] = self.head
        t.post_write(self.peer, t.credit_out_mr, t.credit_out.ctypes.data + 8 * self.peer, 8,
                     t.remote[self.peer]["credit_addr"] + 8 * t.rank, t.remote[self.peer]["credit_rkey"],
                     imm=None, kind=_KIND_CREDIT)
        self.outstanding += 1
        self.last_credit = self.head


class IbvTransport(Transport):
    """RC queue pairs to every peer, connected through the store."""

    name = "ibverbs"

    def __init__(self, store, rank: int, world: int, token: str, timeout: float) -> None:
        reason = available()
        if reason:
            raise CommError(f"helios.comm: the ibverbs backend is unavailable: {reason}. Use backend='tcp'.")
        self.rank, self.world = rank, world
        self.ring_bytes = int(os.environ.get("HELIOS_IB_RING_BYTES") or 4 << 20)
        self.max_write = min(self.ring_bytes // 4, 1 << 20)
        d = self.dev = _Device()
        ffi, lib = d.ffi, d.lib
        self.ffi, self.lib = ffi, lib
        peers = [p for p in range(world) if p != rank]
        # Registered memory: inbound rings, outbound staging, credit words in and out.
        self.ring = {p: np.zeros(self.ring_bytes, np.uint8) for p in peers}
        self.stage = {p: np.zeros(self.ring_bytes, np.uint8) for p in peers}
        self.credit_in = np.zeros(world, np.uint64)
        self.credit_out = np.zeros(world, np.uint64)
        self.ring_mr = {p: d.reg(a) for p, a in self.ring.items()}
        self.stage_mr = {p: d.reg(a) for p, a in self.stage.items()}
        self.credit_in_mr, self.credit_out_mr = d.reg(self.credit_in), d.reg(self.credit_out)
        self.qp: dict[int, object] = {}
        for p in peers:
            init = ffi.new("struct ibv_qp_init_attr *")
            init.send_cq = init.recv_cq = d.cq
            init.cap.max_send_wr, init.cap.max_recv_wr = _SEND_DEPTH, _RECV_DEPTH
            init.cap.max_send_sge = init.cap.max_recv_sge = 1
            init.qp_type = _QPT_RC
            qp = lib.ibv_create_qp(d.pd, init)
            if qp == ffi.NULL:
                raise CommError(f"helios.comm: ibverbs: ibv_create_qp failed ({os.strerror(ffi.errno)}).")
            self.qp[p] = qp
            self._modify(qp, {"qp_state": _QPS_INIT, "pkey_index": 0, "port_num": d.port,
                              "qp_access_flags": _ACCESS_LOCAL_WRITE | _ACCESS_REMOTE_WRITE},
                         _QP_STATE | _QP_PKEY_INDEX | _QP_PORT | _QP_ACCESS_FLAGS)
            for _ in range(_RECV_DEPTH):
                self._post_recv(p)
        self.qp_of = {int(self.qp[p].qp_num): p for p in peers}
        psn = int.from_bytes(os.urandom(3), "little")
        for p in peers:
            info = {"qpn": int(self.qp[p].qp_num), "lid": int(d.port_attr.lid), "gid": bytes(ffi.buffer(d.gid.raw)).hex(),
                    "psn": psn, "ring_addr": int(self.ring[p].ctypes.data), "ring_rkey": int(self.ring_mr[p].rkey),
                    "credit_addr": int(self.credit_in.ctypes.data), "credit_rkey": int(self.credit_in_mr.rkey),
                    "mtu": int(d.port_attr.active_mtu), "host": socket.gethostname()}
            store.set(f"ib/{rank}->{p}", json.dumps(info).encode())
        self.remote: dict[int, dict] = {}
        for p in peers:
            r = json.loads(store.get(f"ib/{p}->{rank}", timeout))
            self.remote[p] = r
            self._connect(self.qp[p], r, psn)
        self.links: list[Link] = [IbvLink(self, p) if p != rank else None for p in range(world)]  # type: ignore[misc]
        # Every queue pair must be ready to receive before anyone writes.
        store.add("ib/ready", 1)
        deadline = time.monotonic() + timeout
        while int(store.add("ib/ready", 0)) < world:
            if time.monotonic() > deadline:
                raise CommError("helios.comm: ibverbs: peers did not finish connecting their queue pairs in time.")
            time.sleep(0.01)
        self._closed = False

    # ---- verbs helpers -----------------------------------------------------------------
    def _modify(self, qp, fields: dict, mask: int) -> None:
        attr = self.ffi.new("struct ibv_qp_attr *")
        for k, v in fields.items():
            if k == "ah":
                for ak, av in v.items():
                    if ak == "dgid":
                        self.ffi.memmove(attr.ah_attr.grh.dgid.raw, av, 16)
                    elif ak in ("sgid_index", "hop_limit"):
                        setattr(attr.ah_attr.grh, ak, av)
                    else:
                        setattr(attr.ah_attr, ak, av)
            else:
                setattr(attr, k, v)
        _check(self.lib.ibv_modify_qp(qp, attr, mask), f"ibv_modify_qp to state {fields.get('qp_state')}")

    def _connect(self, qp, r: dict, my_psn: int) -> None:
        d = self.dev
        roce = d.port_attr.link_layer == _LINK_ETHERNET
        ah = {"dlid": r["lid"], "sl": 0, "src_path_bits": 0, "port_num": d.port, "is_global": 1 if roce else 0}
        if roce:
            ah.update(dgid=bytes.fromhex(r["gid"]), sgid_index=d.gid_index, hop_limit=64)
        self._modify(qp, {"qp_state": _QPS_RTR, "path_mtu": min(int(d.port_attr.active_mtu), int(r["mtu"])),
                          "dest_qp_num": r["qpn"], "rq_psn": r["psn"], "max_dest_rd_atomic": 1,
                          "min_rnr_timer": 12, "ah": ah},
                     _QP_STATE | _QP_AV | _QP_PATH_MTU | _QP_DEST_QPN | _QP_RQ_PSN | _QP_MAX_DEST_RD_ATOMIC
                     | _QP_MIN_RNR_TIMER)
        # timeout 14 (4.096 us * 2^14, about 67 ms) x 7 retries; RNR retry 7 = infinite.
        self._modify(qp, {"qp_state": _QPS_RTS, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "sq_psn": my_psn,
                          "max_rd_atomic": 1},
                     _QP_STATE | _QP_TIMEOUT | _QP_RETRY_CNT | _QP_RNR_RETRY | _QP_SQ_PSN | _QP_MAX_QP_RD_ATOMIC)

    def _post_recv(self, peer: int) -> None:
        wr = self.ffi.new("struct ibv_recv_wr *")
        wr.wr_id = (peer << 8) | _KIND_RECV
        wr.num_sge = 0  # RDMA write with immediate: the data goes to the ring, only the immediate comes here
        bad = self.ffi.new("struct ibv_recv_wr **")
        qp = self.qp[peer]
        _check(qp.context.ops.post_recv(qp, wr, bad), "ibv_post_recv")

    def post_write(self, peer: int, mr, laddr: int, length: int, raddr: int, rkey: int, imm: int | None,
                   kind: int) -> None:
        """RDMA write ``length`` bytes from registered ``laddr`` to the peer's ``raddr``."""
        ffi = self.ffi
        sge = ffi.new("struct ibv_sge *")
        sge.addr, sge.length, sge.lkey = laddr, length, mr.lkey
        wr = ffi.new("struct ibv_send_wr *")
        wr.wr_id = (peer << 8) | kind
        wr.sg_list, wr.num_sge = sge, 1
        wr.opcode = _WR_RDMA_WRITE_WITH_IMM if imm is not None else _WR_RDMA_WRITE
        wr.send_flags = _SEND_SIGNALED
        if imm is not None:
            wr.imm_data = struct.unpack("<I", struct.pack(">I", imm))[0]  # network byte order
        wr.wr.rdma.remote_addr, wr.wr.rdma.rkey = raddr, rkey
        bad = ffi.new("struct ibv_send_wr **")
        qp = self.qp[peer]
        rc = qp.context.ops.post_send(qp, wr, bad)
        if rc != 0:
            raise PeerLost(peer, f"cannot take more RDMA writes (ibv_post_send: {os.strerror(rc)})")

    def poll(self) -> None:
        """Drain the completion queue: count landed bytes, retire writes, surface errors."""
        cq = self.dev.cq
        wc = self.dev.wc
        while True:
            n = cq.context.ops.poll_cq(cq, 64, wc)
            if n <= 0:
                return
            for i in range(n):
                w = wc[i]
                peer, kind = int(w.wr_id) >> 8, int(w.wr_id) & 0xFF
                link = self.links[peer] if 0 <= peer < self.world else None
                if w.status != 0:
                    msg = self.ffi.string(self.lib.ibv_wc_status_str(w.status)).decode()
                    if link is not None:
                        link.error = f"is unreachable or gone (RDMA completion error: {msg})"
                        raise PeerLost(peer, link.error)
                    continue
                if kind == _KIND_RECV and link is not None:
                    link.landed += struct.unpack(">I", struct.pack("<I", int(w.imm_data)))[0]
                    self._post_recv(peer)
                elif kind in (_KIND_DATA, _KIND_CREDIT) and link is not None:
                    link.outstanding -= 1

    def wait_activity(self, send_peers: list[int], recv_peers: list[int], timeout: float) -> None:
        # Completions and credit words are polled; spin briefly, then yield the core.
        for link in self.links:
            if link is not None:
                link.flush_credit()
        end = time.monotonic() + min(timeout, 0.001)
        while time.monotonic() < end:
            self.poll()
            for p in recv_peers:
                link = self.links[p]
                if link is not None and link.landed > link.head:
                    return
            for p in send_peers:
                link = self.links[p]
                if link is not None and int(self.credit_in[p]) != link.remote_head:
                    return
        time.sleep(0.0002)

    def abort(self, reason: str) -> None:
        for qp in self.qp.values():
            try:
                self._modify(qp, {"qp_state": _QPS_ERR}, _QP_STATE)
            except CommError:
                pass

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        lib = self.lib
        for qp in self.qp.values():
            lib.ibv_destroy_qp(qp)
        for mr in [*self.ring_mr.values(), *self.stage_mr.values(), self.credit_in_mr, self.credit_out_mr]:
            lib.ibv_dereg_mr(mr)
        lib.ibv_destroy_cq(self.dev.cq)
        lib.ibv_dealloc_pd(self.dev.pd)
        lib.ibv_close_device(self.dev.ctx)
