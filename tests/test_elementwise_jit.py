"""Run-time fusion of elementwise chains (helios.elementwise_jit): random chains of table ops fused
against HELIOS_FUSION=0 bit for bit, one dispatch per chain, intermediates the user keeps,
freed intermediates never reused under a queued op, capture and replay, the kernel cache."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios import elementwise_jit, fused_kernels
from helios.runtime import get_runtime

sys.path.insert(0, os.path.dirname(__file__))
from switches import count_dispatches, switched  # noqa: E402

pytestmark = pytest.mark.vulkan

# Ops a random chain draws from, with scalars that keep values finite and in range.
UNARY = [("neg", 0.0, 0.0), ("exp", 0.0, 0.0), ("tanh", 0.0, 0.0), ("sigmoid", 0.0, 0.0), ("relu", 0.0, 0.0),
         ("gelu_tanh", 0.0, 0.0), ("gelu", 0.0, 0.0), ("abs", 0.0, 0.0), ("add_s", 1.25, 0.0),
         ("mul_s", -0.7, 0.0), ("pow_s", 2.0, 0.0), ("rsub_s", 0.3, 0.0), ("clamp", -1.5, 1.5), ("sin", 0.0, 0.0),
         ("cos", 0.0, 0.0), ("div_s", 3.0, 0.0), ("sqrt", 0.0, 0.0), ("log", 0.0, 0.0)]
BINARY = [("add", 1.0), ("add", 0.5), ("sub", 1.0), ("mul", 1.0), ("div", 1.0), ("maximum", 1.0), ("minimum", 1.0),
          ("gelu_tanh_bwd", 1.0), ("sigmoid_bwd", 1.0), ("tanh_bwd", 1.0), ("relu_bwd", 1.0), ("pow", 1.0)]


FIXED = [[("u", "mul_s", -0.7, 0.0), ("u", "add_s", 1.25, 0.0)],
         [("b", "mul", 1.0, 0, True), ("b", "add", 0.5, 1, False), ("b", "sub", 1.0, 0, True)]]


def _bits(t: hl.Tensor) -> np.ndarray:
    a = t.numpy()
    return np.ascontiguousarray(a).view(np.uint8)


def _chain(rng, k: int):
    """A random chain of k ops: ("u", name, p0, p1) or ("b", name, alpha, operand index, chain first)."""
    steps = []
    for _ in range(k):
        if rng.random() < 0.5:
            name, p0, p1 = UNARY[rng.integers(len(UNARY))]
            steps.append(("u", name, p0, p1))
        else:
            name, alpha = BINARY[rng.integers(len(BINARY))]
            steps.append(("b", name, alpha, int(rng.integers(2)), bool(rng.integers(2))))
    return steps


def _run(steps, xs, keep=()):
    """Run ``steps`` on the tensors ``xs`` (x = xs[0]; binary ops take xs[1] or xs[2] as the other
    operand); return the result and the intermediates whose index is in ``keep``."""
    v = xs[0]
    kept = []
    for i, s in enumerate(steps):
        if s[0] == "u":
            v = K.unary(s[1], v, s[2], s[3])
        else:
            other = xs[1 + s[3]]
            v = K.binary(s[1], v, other, s[2]) if s[4] else K.binary(s[1], other, v, s[2])
        if i in keep:
            kept.append(v)
    return v, kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_chains_equal_the_unfused_ops_bit_for_bit(dtype):
    rt = get_runtime()
    if dtype != "float32" and not rt.features.get("storage16", False):
        pytest.skip("no 16-bit storage on this device")
    rng = np.random.default_rng(7)
    n_fused = ew_fusion_count = 0
    for trial in range(16 if dtype == "float32" else 6):
        n = int(rng.choice([1, 3, 256, 1000, 4099]))
        arrs = [rng.uniform(0.1, 2.0, n), rng.standard_normal(n), rng.uniform(0.5, 1.5, n)]
        xs = [hl.tensor(a.astype(np.float32)).to(getattr(hl, dtype)) for a in arrs]
        # first a multiply feeding an add (a driver contracting them into an fma would differ)
        steps = FIXED[trial] if trial < len(FIXED) else _chain(rng, int(rng.integers(2, 7)))
        keep = {int(rng.integers(len(steps)))} if trial % 3 == 0 else set()
        with switched(fused_kernels, "ENABLED", False):
            ref, ref_kept = _run(steps, xs, keep)
            ref_bits = [_bits(t) for t in [ref, *ref_kept]]
        q = rt.ew_queue
        before = q.fused
        got, got_kept = _run(steps, xs, keep)
        got_bits = [_bits(t) for t in [got, *got_kept]]
        ew_fusion_count += q.fused - before
        n_fused += 1
        for a, b in zip(ref_bits, got_bits):
            assert np.array_equal(a, b), f"{dtype} n={n} {steps}"
    assert ew_fusion_count >= n_fused  # every chain ran fused


def test_every_fusible_table_op_fuses_bit_for_bit():
    # chains of 4 over all the table's float ops (a new table entry is covered here at once)
    from helios.kernels_spirv import ew_ops

    rng = np.random.default_rng(11)
    ops = [op for op in ew_ops.OPS if op.glsl and op.kind in ("unary", "binary")]
    rng.shuffle(ops)
    arrs = [rng.uniform(0.5, 1.5, 777), rng.uniform(0.5, 1.5, 777), rng.standard_normal(777)]
    xs = [hl.tensor(a.astype(np.float32)) for a in arrs]
    for i in range(0, len(ops), 4):
        steps = [("u", op.name, 0.75, 1.25) if op.kind == "unary" else ("b", op.name, 0.5, j % 2, bool(j % 3))
                 for j, op in enumerate(ops[i:i + 4])]
        with switched(fused_kernels, "ENABLED", False):
            ref = _bits(_run(steps, xs)[0])
        with count_dispatches() as names:
            got = _bits(_run(steps, xs)[0])
        assert np.array_equal(ref, got), steps
        assert names["ew_fused"] == (len(steps) > 1), (steps, names)


def test_a_chain_of_k_ops_is_one_dispatch_and_kept_intermediates_stay_right():
    rng = np.random.default_rng(3)
    x = hl.tensor(rng.standard_normal(5000).astype(np.float32))
    z = hl.tensor(rng.standard_normal(5000).astype(np.float32))
    for k in range(2, 7):
        with count_dispatches() as names:
            y = x
            for _ in range(k):
                y = y * 0.9 + z if k % 2 else (y * 0.5).relu()
            out = y.numpy()
        with switched(fused_kernels, "ENABLED", False):
            y = x
            for _ in range(k):
                y = y * 0.9 + z if k % 2 else (y * 0.5).relu()
            ref = y.numpy()
        assert np.array_equal(out.view(np.uint8), ref.view(np.uint8))
        ops = 2 * k
        assert sum(names.values()) == (ops + elementwise_jit.MAX_OPS - 1) // elementwise_jit.MAX_OPS, names
        assert set(names) == {"ew_fused"}
    # the brief's example, with the intermediate after relu kept by the user
    with count_dispatches() as names:
        a = (x * 2.0 + 1.0).relu()
        y = (a - z).exp()
        got_y, got_a = y.numpy(), a.numpy()
    assert names == {"ew_fused": 1}
    with switched(fused_kernels, "ENABLED", False):
        a = (x * 2.0 + 1.0).relu()
        y = (a - z).exp()
        assert np.array_equal(got_y.view(np.uint8), y.numpy().view(np.uint8))
        assert np.array_equal(got_a.view(np.uint8), a.numpy().view(np.uint8))


@pytest.mark.parametrize("n", [1000, 1001])  # the vec4 path and the scalar one
def test_a_zero_dim_operand_fuses_as_one_element_seen_everywhere(n):
    rng = np.random.default_rng(9)
    x = hl.tensor(rng.standard_normal(n).astype(np.float32))
    s = hl.tensor(np.float32(0.37))  # 0-d: the scale autograd and clipping multiply by

    def chain():
        return ((x * s + 1.0).tanh() - s).exp()

    with count_dispatches() as names:
        got = chain().numpy()
    assert names == {"ew_fused": 1}, names
    with switched(fused_kernels, "ENABLED", False):
        ref = chain().numpy()
    assert got.tobytes() == ref.tobytes()


def test_freed_intermediates_are_not_stored_and_not_reused_while_queued():
    rt = get_runtime()
    q = rt.ew_queue
    x = hl.tensor(np.arange(1024, dtype=np.float32))
    rt.synchronize()
    t = x + 1.0
    h = t._st.handle
    y = t * 2.0
    del t  # the temporary dies while its op is queued: its free waits for the emission
    assert q.ops and h in q.dead
    others = [hl.empty(1024) for _ in range(4)]  # allocations meanwhile must not get its bytes
    for o in others:
        o.fill_(7.0)
    # the fill emitted the queue first: the chain ran (storing only y), then t was freed
    assert not q.ops and not q.dead
    np.testing.assert_array_equal(y.numpy(), (np.arange(1024, dtype=np.float32) + 1.0) * 2.0)
    for o in others:
        np.testing.assert_array_equal(o.numpy(), np.full(1024, 7.0, np.float32))


def test_fused_kernel_names_list_the_ops_at_debug_level():
    rt = get_runtime()
    x = hl.tensor(np.ones(64, np.float32))
    with count_dispatches() as names:
        old = rt.debug
        rt.debug = 1
        try:
            y = (x * 2.0 + 1.0).exp()
            rt.ew_queue.emit()
        finally:
            rt.debug = old
        rt.synchronize()
    assert names == {"ew_fused[mul_s > add_s > exp]": 1}
    np.testing.assert_allclose(y.numpy(), np.exp(3.0) * np.ones(64), rtol=1e-6)


def test_the_fused_kernel_is_cached_on_disk_by_its_source(tmp_path, monkeypatch):
    sig = ("f32", 1, ((0, False),), 1, (("unary", "add_s", (("b", 0),), -1, (0,)), ("unary", "exp", (("v", 0),), 0, ())))
    src = elementwise_jit.source(sig)
    assert "x + p0" in src and "exp(x)" in src  # the table's expressions
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = elementwise_jit.cache_path(src)
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    code = elementwise_jit.spirv(src)
    assert os.path.exists(path) and code[:4] == b"\x03\x02\x23\x07"
    os.utime(path, (1, 1))
    assert elementwise_jit.spirv(src) == code and os.path.getmtime(path) == 1  # read back, not rebuilt
    assert elementwise_jit.cache_path(src + "\n") != path


@pytest.mark.parametrize("switch", [fused_kernels, elementwise_jit])
def test_off_switch_queues_nothing(switch):
    rt = get_runtime()
    x = hl.tensor(np.ones(64, np.float32))
    with switched(switch, "ENABLED", False), count_dispatches() as names:
        y = (x + 1.0) * 2.0
        assert not rt.ew_queue.ops
        rt.synchronize()
    assert names == {"add_s": 1, "mul_s": 1}
    np.testing.assert_array_equal(y.numpy(), np.full(64, 4.0, np.float32))


def test_a_captured_step_with_a_chain_replays_bit_identically():
    rng = np.random.default_rng(5)
    x = hl.tensor(rng.standard_normal(3000).astype(np.float32))
    z = hl.tensor(rng.standard_normal(3000).astype(np.float32))

    def step(x, z):
        return ((x * 2.0 + 1.0).relu() - z).exp().sum()

    with hl.graph.capture(inputs=(x, z)) as g:
        loss = step(x, z)
    names = [args[4] for kind, args in g.ops if kind == 0]
    assert names.count("ew_fused") == 1 and "mul_s" not in names
    for _ in range(3):
        xb = rng.standard_normal(3000).astype(np.float32)
        zb = rng.standard_normal(3000).astype(np.float32)
        g.replay(xb, zb)
        got = loss.numpy()
        with switched(fused_kernels, "ENABLED", False):
            ref = step(hl.tensor(xb), hl.tensor(zb)).numpy()
        assert got.tobytes() == ref.tobytes()
    g.release()


def test_only_the_queuing_thread_records_the_queue_and_a_collective_records_it_when_issued():
    """A host access from another thread (the comm engine polling a tensor) never records the
    ops another thread queued (they could land after work that thread records meanwhile), and
    wrapping a tensor for a collective records the work that makes it on the caller's thread."""
    import threading

    from helios.comm.buffers import as_buffer

    rt = get_runtime()
    x = hl.ones(4096)
    hl.synchronize()
    y = (x * 2.0) + 1.0
    q = rt.ew_queue
    assert len(q.ops) == 2
    seen = []
    t = threading.Thread(target=lambda: seen.append(rt.ready(y._st.handle, 0, 4)))
    t.start()
    t.join()
    assert len(q.ops) == 2 and seen  # polled, not recorded
    buf = as_buffer(y)
    assert q.ops == []  # recorded on this thread when wrapped
    assert np.array_equal(buf.flat, np.full(4096, 3.0, np.float32))
