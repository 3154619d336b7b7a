"""Collectives on real Helios tensors on the Vulkan device (not stand-ins).

The ranks are this file run as a script.  Each case checks exact results (small
integers, exact in every dtype), that a device tensor reaches the transport without a
host copy where memory is host-visible, that an asynchronous all-reduce issued while the
tensor is still being produced waits for the device work, that a Parameter is reduced in
place under no_grad, and that bfloat16 travels as bfloat16.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ranks import check_ok, run_ranks  # noqa: E402


def _rank_main() -> None:
    import helios as hl
    import helios.comm as dist
    from helios.comm import buffers
    from helios.nn import Parameter

    dist.init_process_group(backend=sys.argv[1])
    r, n = dist.get_rank(), dist.get_world_size()
    tri = n * (n + 1) // 2

    # float32 all-reduce, in place, reduced in mapped device memory (no host copy on lavapipe).
    x = hl.tensor(np.arange(1000, dtype=np.float32)) * float(r + 1)  # still only recorded on the device
    dist.all_reduce(x)
    assert np.array_equal(x.numpy(), np.arange(1000, dtype=np.float32) * tri)
    if x._st.rt.dev.map(x._st.handle, 0, 4, False) is not None:
        # Host-visible memory: the transport works on the device bytes themselves.
        buf = buffers.as_buffer(x)
        buf.flat[:2] = (-1.0, -2.0)
        buf.commit()
        assert not buf._staged and np.array_equal(x.numpy()[:3], [-1.0, -2.0, 2.0 * tri])

    # async: issued while a long chain of device work still produces the tensor; other device
    # work is recorded meanwhile; wait() gives the reduced values.
    y = hl.ones(4096) * float(r + 1)
    for _ in range(20):
        y = y + 0.0
    w = dist.all_reduce(y, async_op=True)
    z = hl.ones(512, 512) @ hl.ones(512, 512)  # unrelated work recorded while the all-reduce runs
    w.wait()
    assert np.array_equal(y.numpy(), np.full(4096, tri, np.float32))
    assert z.numpy()[0, 0] == 512

    # bfloat16 travels as bfloat16 (a float32 wire would double the bytes and round differently).
    b = hl.tensor(np.full(64, r + 1, np.float32), dtype=hl.bfloat16)
    buf = buffers.as_buffer(b)
    assert buf.dtype == "bfloat16" and buf.nbytes == 128, (buf.dtype, buf.nbytes)
    dist.all_reduce(b)
    assert b.dtype is hl.bfloat16 and np.array_equal(b.numpy(), np.full(64, tri, np.float32))

    # int64 and int32, max.
    i = hl.tensor(np.arange(10) * (r + 1), dtype=hl.int64)
    dist.all_reduce(i, op="max")
    assert np.array_equal(i.numpy(), np.arange(10) * n)

    # A Parameter (a leaf that requires grad), reduced in place under no_grad, as DDP does;
    # its version moves so a stale saved-for-backward copy would be caught.
    p = Parameter(hl.full((8,), float(r)))
    v0 = p._st.version
    with hl.no_grad():
        dist.all_reduce(p, op="sum")
    assert np.array_equal(p.numpy(), np.full(8, sum(range(n)), np.float32)) and p._st.version > v0

    # all_gather into a tensor, reduce_scatter out of a view of a flat buffer, broadcast.
    src = hl.full((3,), float(r))
    out = hl.zeros(3 * n)
    dist.all_gather(out, src)
    assert np.array_equal(out.numpy(), np.repeat(np.arange(n, dtype=np.float32), 3))
    flat = hl.tensor(np.arange(4 * n, dtype=np.float32))
    mine = hl.zeros(4)
    dist.reduce_scatter(mine, flat)
    assert np.array_equal(mine.numpy(), np.arange(4 * r, 4 * r + 4, dtype=np.float32) * n)
    big = hl.zeros(10, 10)
    view = big[2]  # a contiguous view at an offset inside its storage
    if r == 0:
        view.copy_(hl.full((10,), 7.0))
    dist.broadcast(view, src=0)
    got = big.numpy()
    assert np.array_equal(got[2], np.full(10, 7.0, np.float32)) and not got[[0, 1, 3]].any()

    # A non-contiguous output is refused before any peer is involved (the communicator stays usable).
    try:
        dist.all_reduce(hl.zeros(4, 4).T)
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("a non-contiguous output was accepted")
    dist.barrier()
    dist.destroy_process_group()
    print("ok", r)


@pytest.mark.vulkan
@pytest.mark.multiproc
@pytest.mark.parametrize("world,backend", [(2, "shm"), (3, "tcp")])
def test_collectives_on_helios_tensors(world, backend):
    res = run_ranks([__file__, backend], world, timeout=180)
    check_ok(res)
    assert all(f"ok {r.rank}" in r.out for r in res)


if __name__ == "__main__":
    _rank_main()
