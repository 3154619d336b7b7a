"""The device contract (helios.backend.Runtime) and its CUDA runtime on the emulated driver.

The CUDA runtime's allocator, transfers, launch ABI and profiling run here on
``HELIOS_CUDA_DEVICE=emulator`` (no GPU, no translator: a launch test stands a handwritten
PTX kernel in for ``spirv_ptx.translate()``); ops that run translated kernels are tested
with the translator.  ``cuda:N`` without a driver must be one DeviceError that says why and
what to do, from ``set_device`` and from ``helios-train --device``.
"""

import inspect
import struct
import sys
import time
import types
from dataclasses import dataclass

import numpy as np
import pytest

import helios as hl
from helios import backend, op_trace, runtime
from helios.cuda_ptx import driver
from helios.cuda_ptx.emu import driver as emu_driver
from helios.cuda_ptx import tensor_runtime as tr

NO_GPU = "cuInit failed: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected"


@pytest.fixture
def no_driver(monkeypatch):
    """A machine whose CUDA driver answers NO_GPU (whatever this one has)."""
    monkeypatch.delenv("HELIOS_CUDA_DEVICE", raising=False)
    monkeypatch.setattr(driver, "driver_status", lambda: (False, NO_GPU))
    monkeypatch.delitem(runtime._runtimes, "cuda:0", raising=False)


@pytest.fixture
def emulated(monkeypatch):
    """HELIOS_CUDA_DEVICE=emulator, and cuda:0 opened fresh (closed from the registry afterwards)."""
    monkeypatch.setenv("HELIOS_CUDA_DEVICE", "emulator")
    runtime.close_device("cuda:0")
    monkeypatch.setattr(driver, "context", lambda: emu_driver.emulated_context(sm_count=1))
    yield
    runtime.close_device("cuda:0")


@pytest.fixture
def rt():
    """A CudaRuntime on a fresh emulated device of its own."""
    return tr.CudaRuntime(0, ctx=emu_driver.emulated_context(sm_count=1))


# -- the contract ---------------------------------------------------------------------------------
def test_every_backend_implements_the_whole_contract():
    abstract = backend.Runtime.__abstractmethods__
    assert {"alloc", "free", "read", "write", "copy", "fill", "pool_stats", "pipeline", "dispatch", "synchronize",
            "stats"} <= abstract
    for cls in (runtime.VulkanRuntime, runtime.HostRuntime, tr.CudaRuntime):
        assert issubclass(cls, backend.Runtime) and not cls.__abstractmethods__, cls
        for name in abstract:  # the same parameters as the contract, so callers need not know the backend
            want = list(inspect.signature(getattr(backend.Runtime, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got[:len(want)] == want or got[1:] == ["args", "kwargs"], (cls.__name__, name, got)
    assert runtime.Runtime is backend.Runtime and isinstance(runtime.HOST, runtime.Runtime)


def test_a_registered_backend_is_a_device_like_the_others(monkeypatch):
    """helios.backends.register is all a new backend needs: its devices are spelled, listed, opened,
    chosen and closed by helios.runtime like vulkan's and cuda's (here a "fake" kind whose runtime
    is a CudaRuntime on the emulated driver)."""
    from helios import backends

    opened = []

    def open_fake(index):
        if index > 0:
            raise hl.DeviceError(f"cannot open fake:{index}: only fake:0 exists")
        opened.append(index)
        rt = tr.CudaRuntime(0, ctx=emu_driver.emulated_context(sm_count=1))
        rt.name, rt.device = f"fake:{index}", hl.device(f"fake:{index}")
        return rt

    listing = [backends.DeviceInfo("fake:0", "a test backend", "virtual", {})]
    monkeypatch.setitem(backends._BACKENDS, "fake", backends.Backend("fake", open_fake, lambda: listing))
    before = runtime.get_runtime().name
    try:
        assert "fake" in backends.kinds() and "'fake:N'" in backends.spellings()
        assert hl.device("fake:0").type == "fake" and "fake:0" in [d.name for d in hl.devices()]
        assert "fake:0 (a test backend)" in runtime.device_names()
        hl.set_device("fake:0")
        assert runtime.get_runtime().name == "fake:0" and opened == [0]
        x = hl.tensor([1.0, 2.0]) * 3
        assert x.device == "fake:0" and x.tolist() == [3.0, 6.0]
        with pytest.raises(hl.DeviceError, match=r"only fake:0 exists; devices here: cpu.*fake:0"):
            runtime.get_runtime("fake:1")
    finally:
        hl.set_device(before)
        runtime.close_device("fake:0")
    with pytest.raises(ValueError, match="identifier other than 'cpu'"):
        backends.register("cpu", open_fake, lambda: [])


def test_cuda_device_names():
    d = hl.device("cuda:0")
    assert (d.type, d.index, str(d), repr(d)) == ("cuda", 0, "cuda:0", "device(type='cuda', index=0)")
    assert hl.device("cuda", 1) == "cuda:1" and hl.device("cuda").type == "cuda" and hl.device("cuda").index is None
    for bad in ("cuda:x", "cuda:-1", "cud:0"):
        with pytest.raises(hl.DeviceError) as ei:
            hl.device(bad)
        assert "\n" not in str(ei.value) and repr(bad) in str(ei.value) and "cuda:N" in str(ei.value)


# -- no driver, no GPU ----------------------------------------------------------------------------
def test_cuda_without_a_gpu_is_one_line_saying_why_and_what_to_do(no_driver):
    for call in (lambda: hl.set_device("cuda:0"), lambda: runtime.get_runtime("cuda:0"),
                 lambda: hl.tensor([1.0], device="cuda:0")):
        with pytest.raises(hl.DeviceError) as ei:
            call()
        msg = str(ei.value)
        assert "\n" not in msg and "cuda:0" in msg and NO_GPU in msg, msg
        assert "install NVIDIA's driver" in msg and "HELIOS_CUDA_DEVICE=emulator" in msg, msg
    assert runtime._current is None or runtime._current.name != "cuda:0"


def test_cuda_reason_is_the_drivers_own_here(monkeypatch):
    monkeypatch.delenv("HELIOS_CUDA_DEVICE", raising=False)
    ok, why = driver.driver_status()
    if ok:
        pytest.skip("this machine has a CUDA driver and a GPU")
    monkeypatch.delitem(runtime._runtimes, "cuda:0", raising=False)
    with pytest.raises(hl.DeviceError) as ei:
        hl.set_device("cuda:0")
    assert " ".join(why.split()) in str(ei.value) and "\n" not in str(ei.value)


@pytest.mark.parametrize("program", ["train", "export", "sample"])
def test_device_cuda_without_a_gpu_exits_2_with_one_line(no_driver, capsys, tmp_path, program):
    """Each program's --device goes through one helper (train_settings.set_device_flag)."""
    import importlib

    (tmp_path / "run" / "ckpt").mkdir(parents=True)  # helios-export checks its RUN_DIR first
    rest = {"train": ["--steps", "1", "--out", str(tmp_path / "run")],
            "export": [str(tmp_path / "run"), str(tmp_path / "hf")],
            "sample": [str(tmp_path / "run"), "--prompt", "hi"]}[program]
    with pytest.raises(SystemExit) as ei:
        importlib.import_module(f"helios.{program}").main(["--device", "cuda:0", *rest])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"helios-{program}: error: --device cuda:0: ") and "\n" not in err, err
    assert NO_GPU in err and "HELIOS_CUDA_DEVICE=emulator" in err


# -- the CUDA allocator ---------------------------------------------------------------------------
def test_size_classes():
    assert [tr.size_class(n) for n in (0, 1, 512, 513, 1024, 1025, 4097, 1 << 20)] == \
        [512, 512, 512, 1024, 1024, 2048, 8192, 1 << 20]


def test_caching_allocator_reuses_blocks_by_class_and_pool(rt):
    a = rt.alloc(600, "weights")  # class 1024
    st = rt.pool_stats()["weights"]
    assert (st["in_use_bytes"], st["reserved_bytes"], st["blocks"], st["allocs"]) == (1024, 1024, 1, 1)
    rt.free(a)
    st = rt.pool_stats()["weights"]
    assert (st["in_use_bytes"], st["cached_bytes"], st["peak_in_use_bytes"], st["frees"]) == (0, 1024, 1024, 1)
    assert rt.alloc(1000, "weights") == a  # the same class: the cached block
    b = rt.alloc(1000, "activations")  # another pool: a block of its own
    c = rt.alloc(1025, "weights")  # another class: a new block
    assert len({a, b, c}) == 3 and a % tr.ALIGN == b % tr.ALIGN == c % tr.ALIGN == 0
    stats = rt.pool_stats()
    assert set(stats) == set(backend.POOLS)
    assert stats["weights"]["in_use_bytes"] == 1024 + 2048 and stats["activations"]["in_use_bytes"] == 1024
    assert stats["weights"]["peak_in_use_bytes"] == 3072 and stats["staging"]["blocks"] == 0
    rt.free(c)
    assert rt.empty_cache() == 2048
    st = rt.pool_stats()["weights"]
    assert (st["reserved_bytes"], st["blocks"], st["cached_bytes"]) == (1024, 1, 0)
    assert len(rt.cu.memory._bases) == 2  # the driver got the cached block back


def test_read_write_fill_copy_at_offsets(rt):
    h = rt.alloc(4096)
    data = np.arange(256, dtype=np.uint8)
    rt.write(h, 100, data)
    out = np.empty(256, np.uint8)
    rt.read(h, 100, out)
    np.testing.assert_array_equal(out, data)
    rt.fill(h, 1024, 64, 0xDEADBEEF)
    rt.fill(h, 2048, 16, 0)
    got = np.empty(64, np.uint8)
    rt.read(h, 1024, got)
    np.testing.assert_array_equal(got.view(np.uint32), np.full(16, 0xDEADBEEF, np.uint32))
    rt.read(h, 2048, got[:16])
    assert not got[:16].any()
    g = rt.alloc(300, "staging")
    rt.copy(h, 100, g, 4, 256)
    rt.read(g, 4, out)
    np.testing.assert_array_equal(out, data)
    assert rt.stats()["copies"] == 1 and rt.stats()["fills"] == 2


def test_allocator_errors_name_the_argument(rt):
    with pytest.raises(ValueError, match="pool must be one of weights, activations, staging, got 'scratch'"):
        rt.alloc(8, "scratch")
    h = rt.alloc(100)  # a 512-byte block
    with pytest.raises(ValueError, match="outside the 512-byte block"):
        rt.read(h, 500, np.empty(16, np.uint8))
    with pytest.raises(ValueError, match="multiples of 4"):
        rt.fill(h, 0, 6, 1)
    with pytest.raises(hl.DeviceError, match="not an allocation of cuda:0"):
        rt.write(h + 4, 0, np.zeros(4, np.uint8))
    rt.free(h)
    with pytest.raises(ValueError, match="not a live allocation"):
        rt.free(h)


def test_device_facts_choose_the_gpu_kernels(rt):
    from helios import _kernels as K

    assert rt.info["type"] == "discrete" and rt.info["limits"]["subgroup_size"] == 32
    assert rt.max_range == 2**31 - 1 and rt.align == 256 and not rt.is_host
    assert all(rt.features[k] for k in ("storage16", "storage8", "int64"))
    assert not K._cpu_mm_kernel(rt) and not K.fa_subgroup_kernel_runs_on(rt)
    for d in (hl.float32, hl.bfloat16, hl.float16, hl.int64, hl.bool):
        K._check_dtype_supported(rt, d)


# -- tensors on the emulated cuda:0 ---------------------------------------------------------------
def test_tensors_live_on_emulated_cuda(emulated):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    for d in (hl.float32, hl.bfloat16, hl.int64):
        t = hl.tensor(x, dtype=d, device="cuda:0")
        assert t.device == "cuda:0" and t.device.type == "cuda" and t.dtype is d
        c = t.to("cpu")
        np.testing.assert_array_equal(c.numpy(), t.numpy())
        back = c.to("cuda:0")
        np.testing.assert_array_equal(back.numpy(), t.numpy())
        assert back.device == "cuda:0" and t.to("cuda:0") is t
    assert runtime.get_runtime("cuda:0").pool_stats()["activations"]["in_use_bytes"] > 0


def test_helios_device_env_and_devices_list(emulated, monkeypatch):
    monkeypatch.setenv("HELIOS_DEVICE", "cuda:0")
    monkeypatch.setattr(runtime, "_current", None)
    assert runtime.get_runtime().name == "cuda:0" and hl.current_device() == "cuda:0"
    assert runtime.get_runtime("cuda").name == "cuda:0"
    hl.synchronize()  # every open runtime, of either backend


@pytest.mark.vulkan
def test_devices_lists_cuda_after_vulkan(emulated):
    names = [d.name for d in hl.devices()]
    assert names[-1] == "cuda:0" and all(n.startswith("vulkan:") for n in names[:-1])
    assert "cuda:0 (Helios PTX emulator" in runtime.device_names()
    with pytest.raises(hl.DeviceError, match="cuda:0 only"):
        runtime.get_runtime("cuda:1")


# -- launches: the ABI the translator's output is called with -------------------------------------
ADD_PTX = """.version 7.8
.target sm_90
.address_size 64

.visible .entry {name}(
	.param .u64 p0,
	.param .u64 p1,
	.param .u64 p2,
	.param .u32 p3,
	.param .u32 p4
)
.maxntid 64, 1, 1
{{
	.reg .pred %p<2>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [p0];
	ld.param.u64 %rd2, [p1];
	ld.param.u32 %r1, [p3];
	ld.param.u32 %r2, [p4];
	mov.u32 %r3, %tid.x;
	mov.u32 %r4, %ctaid.x;
	mad.lo.u32 %r6, %r4, 64, %r3;
	setp.ge.u32 %p1, %r6, %r1;
	@%p1 bra $done;
	mul.wide.u32 %rd3, %r6, 4;
	add.u64 %rd4, %rd2, %rd3;
	ld.global.u32 %r7, [%rd4];
	add.u32 %r7, %r7, %r2;
	add.u64 %rd5, %rd1, %rd3;
	st.global.u32 [%rd5], %r7;
$done:
	ret;
}}
"""


@dataclass(frozen=True)
class _Translated:
    ptx: str
    entry: str
    block: tuple
    bindings: tuple
    push_words: int
    shared_bytes: int


@pytest.fixture
def fake_translator(monkeypatch):
    """spirv_ptx's translation (translate and translate_cached) stood in by a handwritten kernel: out[i] = in[i] + push word 1 for
    i < push word 0, with parameters (binding 1, binding 0, binding 2, 2 push words)."""
    calls = []

    def translate(spirv, spec, name, target="sm_90"):
        assert spirv[:4] == struct.pack("<I", 0x07230203), "not SPIR-V"
        calls.append((spec, name, target))
        return _Translated(ADD_PTX.format(name=name), name, (64, 1, 1), (1, 0, 2), 2, 0)

    fake = types.ModuleType("helios.cuda_ptx.spirv_ptx")
    fake.translate = fake.translate_cached = translate
    import helios.cuda_ptx as pkg

    monkeypatch.setitem(sys.modules, "helios.cuda_ptx.spirv_ptx", fake)
    monkeypatch.setattr(pkg, "spirv_ptx", fake, raising=False)
    return calls


def _launch_add(rt, n=100, add=7, push_words=2):
    pid = rt.pipeline("ew_unary", "f32", (3, 1))
    src, dst = rt.alloc(4 * n + 256), rt.alloc(4 * n + 512)
    rt.write(src, 256, np.arange(n, dtype=np.uint32).view(np.uint8))
    push = struct.pack("<II", n, add)[:4 * push_words]
    rt.dispatch(pid, [(src, 256, 4 * n, False), (dst, 512, 4 * n, True)], push, ((n + 63) // 64, 1, 1), "add_k",
                flops=n, nbytes=8 * n)
    out = np.empty(n, np.uint32)
    rt.read(dst, 512, out.view(np.uint8))
    return src, dst, out


def test_dispatch_passes_bindings_then_push_words(rt, fake_translator):
    src, dst, out = _launch_add(rt)
    np.testing.assert_array_equal(out, np.arange(100, dtype=np.uint32) + 7)
    launch = rt.cu.launches[-1]
    assert launch["grid"] == (2, 1, 1) and launch["block"] == (64, 1, 1)
    # binding 1's range, binding 0's range, binding 2 (not given): 0, then the push words
    assert launch["params"] == {"p0": dst + 512, "p1": src + 256, "p2": 0, "p3": 100, "p4": 7}
    assert fake_translator == [((3, 1), "ew_unary_f32", "sm_90")]
    assert rt.pipeline("ew_unary", "f32", (3, 1)) == 0 and len(fake_translator) == 1  # cached
    _, _, out = _launch_add(rt, n=10, push_words=1)  # short push constants are padded with zeros
    np.testing.assert_array_equal(out, np.arange(10, dtype=np.uint32))
    assert rt.stats()["dispatches"] == 2


def test_dispatch_refuses_an_operand_from_another_device(rt, fake_translator):
    pid = rt.pipeline("ew_unary", "f32", (3, 1))
    with pytest.raises(hl.DeviceError, match=r"add_k: an operand is not on cuda:0.*\.to\('cuda:0'\)"):
        rt.dispatch(pid, [(np.zeros(8, np.uint8), 0, 8, False)], b"", (1, 1, 1), "add_k")


def test_profiler_gets_device_events_from_cuda_launches(rt, fake_translator, monkeypatch, tmp_path):
    monkeypatch.setitem(runtime._runtimes, "cuda:7", rt)  # an open runtime, so the session's hooks reach it
    _launch_add(rt)  # before the session: not in it
    with hl.profile.profile() as prof:
        _launch_add(rt)
        h = rt.alloc(64)
        rt.fill(h, 0, 64, 1)
        rt.synchronize()
        _launch_add(rt, n=10)  # drained by the session's closing hook
    col = prof.collector
    assert [e.name for e in col.events] == ["add_k", "fill", "add_k"]
    assert [e.dispatch_seq for e in col.events] == [0, 1, 2]
    assert col.events[0].flops == 100 and col.events[0].bytes == 800
    assert all(col.start_ns <= e.start_ns <= e.end_ns <= col.end_ns for e in col.events)
    assert [op.dispatch_ids for op in col.ops if op.name == "add_k"] == [[0], [2]]
    assert any(op.name == "fence_wait" for op in col.ops)
    assert {m.pool for m in col.memory} == set(backend.POOLS) and len(col.submits) == 2
    assert "add_k" in prof.key_averages().table(sort_by="device_time")
    assert (tmp_path / "t.json").exists() is False and prof.export_chrome_trace(str(tmp_path / "t.json"))
    assert not rt._timing and not rt._pending


def test_device_times_stay_inside_the_session_when_the_host_resumes_late(rt, fake_translator, monkeypatch):
    # The device clock is anchored by an event recorded on the idle device: were the anchor's host
    # time read after the wait for it, a host slow to resume (here 50 ms) would place every
    # device time that much later, the session's last launches past its end.
    monkeypatch.setitem(runtime._runtimes, "cuda:7", rt)
    wait = rt.cu.cuEventSynchronize

    def slow_to_resume(event):
        res = wait(event)
        time.sleep(0.05)
        return res

    monkeypatch.setattr(rt.cu, "cuEventSynchronize", slow_to_resume)
    with hl.profile.profile() as prof:
        _launch_add(rt, n=10)
    col = prof.collector
    assert [e.name for e in col.events] == ["add_k"]
    assert all(col.start_ns <= e.start_ns <= e.end_ns <= col.end_ns for e in col.events)


def test_helios_debug_prints_a_line_per_cuda_launch(fake_translator, monkeypatch, capsys):
    monkeypatch.setenv("HELIOS_DEBUG", "1")
    trace = op_trace.current()
    monkeypatch.setattr(trace, "notes_on", False)
    monkeypatch.setattr(trace, "operands", ("", ""))
    rt = tr.CudaRuntime(0, ctx=emu_driver.emulated_context(sm_count=1))
    assert trace.notes_on and rt._timing
    op_trace.note_operands(("(100,)", "float32"))
    _launch_add(rt)
    h = rt.alloc(64)
    rt.fill(h, 0, 64, 0)
    rt.synchronize()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "add_k" in lines[0] and "(100,)" in lines[0] and "fill" in lines[1], lines
    assert not rt._pending


def test_each_thread_makes_the_context_current(rt):
    import threading

    calls = []
    real = rt.cu.cuCtxSetCurrent
    rt.cu.cuCtxSetCurrent = lambda c: (calls.append(threading.get_ident()), real(c))[1]
    h = rt.alloc(64)
    rt.write(h, 0, np.arange(64, dtype=np.uint8))
    rt.write(h, 0, np.arange(64, dtype=np.uint8))
    assert len(calls) <= 1  # once per thread, not per call
    got = np.empty(64, np.uint8)
    t = threading.Thread(target=rt.read, args=(h, 0, got))  # a comm worker reading a tensor
    t.start()
    t.join()
    assert calls[-1] != threading.get_ident() and np.array_equal(got, np.arange(64, dtype=np.uint8))


def test_host_access_through_the_contract(rt):
    """What comm's zero-copy buffers use: ready/map/host_wrote; CUDA memory is not host-mapped, so
    callers fall back to read/write (stream-ordered, so the range is always ready for them)."""
    h = rt.alloc(64)
    assert rt.ready(h, 0, 64, True) and rt.map(h, 0, 64) is None and rt.host_wrote(h, 0, 64) is None
    buf = runtime.HOST.alloc(16)
    view = runtime.HOST.map(buf, 4, 8, True)
    np.frombuffer(view, np.uint8)[...] = 7
    assert runtime.HOST.ready(buf, 0, 16) and list(buf[3:13]) == [buf[3]] + [7] * 8 + [buf[12]]


@pytest.mark.vulkan
def test_vulkan_host_access_forwards_to_the_addon():
    vk = runtime.get_runtime("vulkan:0")
    t = hl.tensor(np.arange(4, dtype=np.float32), device="vulkan:0")
    h, off = t._st.handle, t._off * 4
    vk.synchronize()
    assert vk.ready(h, off, 16)
    view = vk.map(h, off, 16)
    if view is not None:  # host-visible memory (lavapipe, integrated GPUs)
        np.testing.assert_array_equal(np.frombuffer(view, np.float32), np.arange(4, dtype=np.float32))
    vk.host_wrote(h, off, 16)
