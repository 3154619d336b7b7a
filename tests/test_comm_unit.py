"""helios.comm pieces that need no second process: env resolution, store, reductions, cost model."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helios.comm import cost, env
from helios.comm import reduce_ops as R
from helios.comm.algorithms import binomial, bounds
from helios.comm.buffers import as_buffer
from helios.comm.store import PrefixStore, TCPStore

from helios.errors import CommError, DTypeError


def test_env_explicit_slurm_ompi_and_disagreement():
    c = env.resolve({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (c.rank, c.world_size, c.local_rank, c.master_addr, c.master_port) == (2, 4, 1, "h0", 1234)
    s = env.resolve({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                     "SLURM_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "4242123"})
    assert (s.rank, s.world_size, s.local_rank, s.master_addr, s.master_port) == (5, 8, 1, "gpu07", 15000 + 2123)
    o = env.resolve({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                     "MASTER_ADDR": "a"})
    assert (o.rank, o.world_size, o.local_rank) == (1, 2, 1)
    with pytest.raises(CommError, match="disagree"):
        env.resolve({"RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "MASTER_ADDR": "a"})
    # Under helios-run the launcher's variables win over the scheduler's.
    assert env.resolve({"RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                        "MASTER_ADDR": "a", "HELIOS_LAUNCHER": "1"}).rank == 0
    with pytest.raises(CommError, match="MASTER_ADDR"):
        env.resolve({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(CommError, match="no launch environment"):
        env.resolve({})
    with pytest.raises(CommError, match="outside"):
        env.resolve({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "a"})
    assert env.first_host("node01") == "node01"


def test_store_set_get_add_wait_and_deadlines():
    server = TCPStore("127.0.0.1", 0, 3, is_server=True, timeout=5, job_id="j")
    clients = [TCPStore("127.0.0.1", server.port, 3, timeout=5, job_id="j") for _ in range(2)]
    got = []
    t = threading.Thread(target=lambda: got.append(clients[0].get("k", 5)))
    t.start()
    server.set("k", b"v")
    t.join(5)
    assert got == [b"v"]
    assert [c.add("n", 2) for c in clients] == [2, 4]
    p = PrefixStore("g", clients[1])
    p.set("x", b"1")
    assert server.get("g/x") == b"1" and p.check("x") and not p.check("y")
    server.wait(["k", "g/x"], 1)
    with pytest.raises(CommError, match="not set within"):
        clients[1].get("never", 0.2)
    with pytest.raises(CommError, match="world size"):
        TCPStore("127.0.0.1", server.port, 4, timeout=2, job_id="j")
    with pytest.raises(CommError, match="job id"):
        TCPStore("127.0.0.1", server.port, 3, timeout=2, job_id="other")
    with pytest.raises(CommError, match="cannot listen"):
        TCPStore("127.0.0.1", server.port, 3, is_server=True, timeout=1, job_id="j", bind_retry_s=0.5).close()
    for c in clients:
        c.close()
    server.close()


def test_store_unreachable_fails_fast():
    with pytest.raises(CommError, match="could not reach the store"):
        TCPStore("127.0.0.1", 9, 2, timeout=0.5)


def test_bf16_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, np.inf, np.nan], dtype=np.float32)
    b = R.f32_to_bf16(x)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa (1.0) wins; 1 + 3*2^-8 rounds up to 1 + 2^-6.
    assert b[0] == 0x3F80 and b[1] == 0x3F80 and b[2] == 0x3F82
    back = R.bf16_to_f32(b)
    assert back[3] == -2.5 and np.isinf(back[5]) and np.isnan(back[6])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64", "uint8", "float64"])
@pytest.mark.parametrize("op", R.OPS)
def test_reduce_many_matches_reference(dtype, op):
    rng = np.random.default_rng(0)
    vals = [rng.integers(1, 3, size=37) for _ in range(4)]
    store = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    enc = [R.f32_to_bf16(v.astype(np.float32)) if dtype == "bfloat16" else v.astype(store) for v in vals]
    out = np.empty(37, dtype=store)
    R.reduce_many(out, enc, op, dtype)
    R.finish_avg(out, 4, op, dtype)
    ref = {"sum": sum(vals), "avg": sum(vals), "max": np.maximum.reduce(vals), "min": np.minimum.reduce(vals),
           "prod": np.prod(vals, axis=0)}[op]
    got = R.bf16_to_f32(out) if dtype == "bfloat16" else out.astype(np.float64)
    if op == "avg":
        ref = ref // 4 if dtype in ("int32", "int64", "uint8") else ref / 4
        if dtype == "float16":
            ref = np.float16(ref)
        if dtype == "bfloat16":
            ref = R.bf16_to_f32(R.f32_to_bf16(ref.astype(np.float32)))
    np.testing.assert_array_equal(got, np.asarray(ref, dtype=np.float64))


def test_buffers_numpy_tensor_and_errors():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = as_buffer(a)
    assert b.flat.base is not None and np.shares_memory(b.flat, a)
    strided = a[:, ::2]
    sb = as_buffer(strided)
    sb.flat[:] = -1
    sb.commit()
    assert (a[:, ::2] == -1).all() and (a[:, 1::2] != -1).all()

    class FakeTensor:
        dtype = "bfloat16"

        def __init__(self) -> None:
            self.data = np.array([1.0, 2.0, 3.0], np.float32)

        def numpy(self):
            return self.data.copy()

        def copy_(self, arr):
            self.data[...] = arr

    t = FakeTensor()
    tb = as_buffer(t)
    assert tb.dtype == "bfloat16" and tb.flat.dtype == np.uint16
    tb.flat[:] = R.f32_to_bf16(np.array([4.0, 5.0, 6.0], np.float32))
    tb.commit()
    assert t.data.tolist() == [4.0, 5.0, 6.0]
    with pytest.raises(DTypeError):
        as_buffer(np.zeros(2, np.complex64))
    with pytest.raises(DTypeError):
        as_buffer(np.zeros(2, np.float32), "bfloat16")
    with pytest.raises(DTypeError):
        as_buffer([1, 2])
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(ro)
    assert as_buffer(ro, writable=False).count == 4


def test_cost_model_prefers_latency_algorithms_small_and_ring_large():
    for n in (4, 8):
        assert cost.choose("all_reduce", 4096, n, "tcp") in ("tree", "halving_doubling")
        assert cost.choose("all_reduce", 64 << 20, n, "tcp") == "ring"
        assert cost.choose("broadcast", 64 << 20, n, "tcp") == "ring"
        assert cost.choose("broadcast", 1024, n, "tcp") == "tree"
    assert cost.estimate("all_reduce", "ring", 1 << 20, 1, "tcp") == 0.0


def test_helpers_bounds_and_binomial():
    assert bounds(10, 3) == [0, 4, 7, 10] and bounds(2, 4) == [0, 1, 2, 2, 2]
    assert binomial(8, 0) == (None, [4, 2, 1]) and binomial(8, 6) == (4, [7]) and binomial(5, 4) == (0, [])


def test_ibverbs_probe_reads_the_kernels_device_lists_before_loading_cffi(tmp_path, monkeypatch):
    # Every rank asks at init whether ibverbs can be used; where the kernel lists no RDMA
    # device the answer comes from sysfs alone, without parsing the cffi declarations.
    from helios.comm import ibverbs

    empty, missing = tmp_path / "infiniband", tmp_path / "infiniband_verbs"
    empty.mkdir()
    monkeypatch.setattr(ibverbs, "SYSFS_CLASSES", (str(empty), str(missing)))
    loads = []

    def load():
        loads.append(1)
        raise OSError("cannot load library 'libibverbs.so.1'")

    monkeypatch.setattr(ibverbs, "_load", load)
    assert ibverbs.available() == f"no RDMA devices (none listed under {empty})"
    assert loads == []
    (empty / "mlx5_0").mkdir()  # a listed device: the verbs library decides
    assert ibverbs.available().startswith("libibverbs is not installed")
    assert loads == [1]
