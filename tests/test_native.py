"""Tests of the native Vulkan addon ``helios._vulkan`` (runs on Mesa lavapipe without a GPU).

Small GLSL test shaders are compiled with glslc into a temporary directory once per module.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

v = pytest.importorskip("helios._vulkan", reason="the native addon is not built (python setup.py build_ext --inplace)")

pytestmark = pytest.mark.vulkan

if not v.enumerate_devices():
    pytest.skip(f"no Vulkan device: {v.last_error()}", allow_module_level=True)

# y[i] = x[i] * MUL + c over the first n elements; MUL is specialization constant 0.
ADD_GLSL = """
#version 450
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint MUL = 1;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; float c; } p;
void main() {
  uint i = gl_GlobalInvocationID.x;
  if (i < p.n) y[i] = x[i] * float(MUL) + p.c;
}
"""

# z[i] = x[i] + y[i]: three bindings, no push constants.
SUM_GLSL = """
#version 450
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Y { float y[]; };
layout(std430, binding = 2) writeonly buffer Z { float z[]; };
void main() {
  uint i = gl_GlobalInvocationID.x;
  if (i < x.length()) z[i] = x[i] + y[i];
}
"""

# Uses binding 3 while callers may claim fewer buffers (the addon must refuse that).
WIDE_GLSL = """
#version 450
layout(local_size_x = 1) in;
layout(std430, binding = 3) buffer B { float b[]; };
void main() { b[0] = 1.0; }
"""

# y[i] = x[i] + c read through a samplerBuffer: the addon binds binding 0 as a uniform texel
# buffer (an rgba32f view), because the SPIR-V says so.
TEXEL_GLSL = """
#version 450
layout(local_size_x = 64) in;
layout(binding = 0) uniform samplerBuffer x;
layout(std430, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; float c; } p;
void main() {
  uint i = gl_GlobalInvocationID.x;
  if (i < p.n) y[i] = texelFetch(x, int(i >> 2))[i & 3u] + p.c;
}
"""

# y[i] = word i of x read through a usamplerBuffer: the addon binds it as an rgba32ui view,
# whose texels are the stored words as they are (packed 16-bit values, in the matmul kernels).
UTEXEL_GLSL = """
#version 450
layout(local_size_x = 64) in;
layout(binding = 0) uniform usamplerBuffer x;
layout(std430, binding = 1) writeonly buffer Y { uint y[]; };
layout(push_constant) uniform P { uint n; } p;
void main() {
  uint i = gl_GlobalInvocationID.x;
  if (i < p.n) y[i] = texelFetch(x, int(i >> 2))[i & 3u];
}
"""

# y[i] = the size of the subgroup invocation i ran in (a pipeline may require it).
SUBGROUP_GLSL = """
#version 450
#extension GL_KHR_shader_subgroup_basic : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Y { uint y[]; };
void main() { y[gl_GlobalInvocationID.x] = gl_SubgroupSize; }
"""

# A storage image: not a binding kind Helios makes (refused when the pipeline is made).
IMAGE_GLSL = """
#version 450
layout(local_size_x = 1) in;
layout(binding = 0, rgba32f) uniform readonly imageBuffer img;
layout(std430, binding = 1) writeonly buffer Y { vec4 y[]; };
void main() { y[0] = imageLoad(img, 0); }
"""


def _compile(tmp, name: str, src: str, target: str = "vulkan1.0") -> bytes:
    path = tmp / f"{name}.comp"
    path.write_text(src)
    out = tmp / f"{name}.spv"
    subprocess.run(["glslc", f"--target-env={target}", "-O", str(path), "-o", str(out)], check=True, capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def shaders(tmp_path_factory):
    if shutil.which("glslc") is None:
        pytest.skip("glslc is not installed (needed to compile the test shaders)")
    tmp = tmp_path_factory.mktemp("spv")
    return {"add": _compile(tmp, "add", ADD_GLSL), "sum": _compile(tmp, "sum", SUM_GLSL),
            "wide": _compile(tmp, "wide", WIDE_GLSL), "texel": _compile(tmp, "texel", TEXEL_GLSL),
            "utexel": _compile(tmp, "utexel", UTEXEL_GLSL),
            "image": _compile(tmp, "image", IMAGE_GLSL),
            "subgroup": _compile(tmp, "subgroup", SUBGROUP_GLSL, "vulkan1.1")}  # subgroup built-ins: SPIR-V 1.3


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    d = v.Device(0, str(tmp_path_factory.mktemp("pcache")))
    yield d
    d.close()


@pytest.fixture()
def fresh(dev):
    """The shared device, synchronized and with zeroed counters."""
    dev.synchronize()
    dev.set_profiling(False)
    dev.take_events()
    dev.auto_submit_dispatches = 256
    dev.reset_stats()
    return dev


def add_push(n: int, c: float) -> bytes:
    return struct.pack("<If", n, c)


def groups_for(n: int) -> tuple[int, int, int]:
    return ((n + 63) // 64, 1, 1)


def upload(d, arr: np.ndarray, pool: str = "activations") -> int:
    h = d.alloc(arr.nbytes, pool)
    d.write(h, 0, arr)
    return h


def download(d, h: int, n: int, offset: int = 0) -> np.ndarray:
    out = np.empty(n, np.float32)
    d.read(h, offset, out)
    return out


# ---------------------------------------------------------------- enumeration


def test_enumeration_fields_and_order():
    devs = v.enumerate_devices()
    rank = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}
    assert [d["index"] for d in devs] == list(range(len(devs)))
    ranks = [rank[d["type"]] for d in devs]
    assert ranks == sorted(ranks)
    for d in devs:
        assert isinstance(d["name"], str) and d["name"]
        assert re.fullmatch(r"\d+\.\d+\.\d+", d["api_version"])
        assert re.fullmatch(r"[0-9a-f]{32}", d["pipeline_cache_uuid"])
        for key in ("vendor_id", "device_id", "driver_version", "device_local_bytes"):
            assert isinstance(d[key], int) and d[key] >= 0
        lim = d["limits"]
        assert lim["max_storage_buffer_range"] >= 1 << 27 or lim["max_storage_buffer_range"] > 0
        assert len(lim["max_workgroup_size"]) == 3 and len(lim["max_workgroup_count"]) == 3
        assert lim["min_storage_buffer_offset_alignment"] in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        assert lim["max_push_constants"] >= 128 and lim["max_memory_allocation_size"] > 0
        assert lim["timestamp_period"] > 0 and lim["subgroup_size"] >= 1
        assert set(d["features"]) == {"float16", "storage16", "storage8", "int64", "int16", "push_descriptor",
                                      "calibrated_timestamps", "unified_memory"}
        assert all(isinstance(x, bool) for x in d["features"].values())
    assert v.last_error() == ""


def test_device_info_matches_enumeration(dev):
    assert dev.info == v.enumerate_devices()[0]
    with pytest.raises(ValueError, match="index out of range"):
        v.Device(len(v.enumerate_devices()), "")


def test_no_driver_gives_empty_list_and_reason():
    env = dict(os.environ, VK_ICD_FILENAMES="/nonexistent/icd.json", VK_DRIVER_FILES="/nonexistent/icd.json")
    code = "import helios._vulkan as v; print(len(v.enumerate_devices())); print(v.last_error())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    count, reason = out.stdout.splitlines()[:2]
    assert count == "0" and reason  # e.g. "vkCreateInstance failed: VK_ERROR_INCOMPATIBLE_DRIVER"


def test_out_of_memory_error_type():
    assert issubclass(v.OutOfMemoryError, MemoryError)


# ---------------------------------------------------------------- memory


def test_alloc_write_read_roundtrip_at_offsets(fresh):
    d = fresh
    rng = np.random.default_rng(0)
    for n in (1, 3, 255, 256, 257, 4096, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        h = d.alloc(n)
        assert d.size_of(h) == n
        d.write(h, 0, data)
        out = np.empty(n, np.uint8)
        d.read(h, 0, out)
        np.testing.assert_array_equal(out, data)
        if n > 8:
            patch = bytes(range(5))
            d.write(h, n - 7, patch)
            tail = bytearray(7)
            d.read(h, n - 7, tail)
            assert bytes(tail[:5]) == patch and bytes(tail[5:]) == data[n - 2:].tobytes()
        d.free(h)


def test_offsets_are_aligned_and_distinct(fresh):
    d = fresh
    hs = [d.alloc(n) for n in (1, 100, 256, 300, 1000, 5000)]
    locs = [d.location(h) for h in hs]
    assert all(off % 256 == 0 for _, off in locs)
    assert len(set(locs)) == len(locs)
    for h in hs:
        d.free(h)


def test_pool_stats(fresh):
    d = fresh
    before = d.pool_stats()
    assert set(before) == {"weights", "activations", "staging"}
    h1 = d.alloc(1000, "weights")
    h2 = d.alloc(3000, "weights")
    st = d.pool_stats()["weights"]
    assert st["allocs"] == before["weights"]["allocs"] + 2
    assert st["in_use_bytes"] - before["weights"]["in_use_bytes"] >= 4000
    assert st["reserved_bytes"] >= st["in_use_bytes"] and st["blocks"] >= 1
    assert st["peak_in_use_bytes"] >= st["in_use_bytes"]
    assert d.pool_stats()["activations"] == before["activations"]  # pools are separate
    d.free(h1)
    d.free(h2)
    st2 = d.pool_stats()["weights"]
    assert st2["frees"] == st["frees"] + 2
    assert st2["in_use_bytes"] == before["weights"]["in_use_bytes"]
    with pytest.raises(ValueError, match="pool"):
        d.alloc(16, "scratch")


def test_zero_byte_alloc(fresh):
    d = fresh
    h = d.alloc(0)
    assert d.size_of(h) == 0
    d.write(h, 0, b"")
    d.read(h, 0, bytearray(0))
    with pytest.raises(ValueError):
        d.write(h, 0, b"x")
    d.free(h)


def test_double_free_and_unknown_handle(fresh):
    d = fresh
    h = d.alloc(64)
    d.free(h)
    with pytest.raises(ValueError, match="already freed"):
        d.free(h)
    with pytest.raises(ValueError, match="unknown"):
        d.free(123456789)
    with pytest.raises(ValueError):
        d.size_of(h)


def test_deferred_free_not_reused_while_pending(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 1024
    a = upload(d, np.full(n, 5, np.float32))
    b = d.alloc(n * 4)
    d.dispatch(p, [(a, 0, n * 4, False), (b, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "add")
    loc_a = d.location(a)
    d.free(a)  # the recorded dispatch still reads a
    c = d.alloc(n * 4)
    assert d.location(c) != loc_a
    assert d.pool_stats()["activations"]["pending_free_bytes"] >= n * 4
    d.write(c, 0, np.zeros(n, np.float32))  # must not clobber what the dispatch reads
    np.testing.assert_array_equal(download(d, b, n), np.full(n, 6, np.float32))
    d.synchronize()
    e = d.alloc(n * 4)
    assert d.location(e) == loc_a  # reclaimed after completion, same size class
    for h in (b, c, e):
        d.free(h)


def test_out_of_memory_absurd_size_then_still_usable(fresh):
    d = fresh
    asked = 1 << 50
    with pytest.raises(v.OutOfMemoryError) as ei:
        d.alloc(asked)
    msg = str(ei.value)
    assert str(asked) in msg and "activations" in msg and "weights" in msg and "staging" in msg
    assert isinstance(ei.value, MemoryError)
    h = upload(d, np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(download(d, h, 10), np.arange(10, dtype=np.float32))
    d.free(h)


def test_large_allocation_bound_in_windows(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    size = 130 << 20  # above maxStorageBufferRange on lavapipe (128 MiB)
    big = d.alloc(size)
    assert d.pool_stats()["activations"]["dedicated"] >= 1
    n = 256
    win = size - 4096  # a window near the end, 16-byte aligned
    d.write(big, win, np.full(n, 41, np.float32))
    out = d.alloc(n * 4)
    d.dispatch(p, [(big, win, n * 4, False), (out, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "window")
    np.testing.assert_array_equal(download(d, out, n), np.full(n, 42, np.float32))
    # write the result back into the big buffer through a window, then read it there
    d.dispatch(p, [(out, 0, n * 4, False), (big, size - 1024, n * 4, True)], add_push(n, 1.0), groups_for(n), "back")
    np.testing.assert_array_equal(download(d, big, n, size - 1024), np.full(n, 43, np.float32))
    with pytest.raises(ValueError, match="maxStorageBufferRange"):
        d.dispatch(p, [(big, 0, size, False), (out, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "toolarge")
    d.free(big)
    d.free(out)


# ---------------------------------------------------------------- dispatch, hazards, submission


def test_dependent_chain_few_submits(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 1000
    a = upload(d, np.zeros(n, np.float32))
    b = d.alloc(n * 4)
    push = add_push(n, 1.0)
    for i in range(1000):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        d.dispatch(p, [(src, 0, n * 4, False), (dst, 0, n * 4, True)], push, groups_for(n), "inc")
    st = d.stats()
    assert st["dispatches"] == 1000 and st["pending_dispatches"] > 0
    np.testing.assert_array_equal(download(d, a, n), np.full(n, 1000, np.float32))
    st = d.stats()
    assert st["submits"] <= 10  # batched: 256 per submit, not one per op
    assert st["barriers"] == 999  # one RAW barrier per link
    d.free(a)
    d.free(b)


def test_spec_constant_and_push_constant(fresh, shaders):
    d = fresh
    p3 = d.pipeline(shaders["add"], 2, 8, [3], "mul3")
    assert p3 == d.pipeline(shaders["add"], 2, 8, [3], "mul3")  # cached
    assert p3 != d.pipeline(shaders["add"], 2, 8, [1], "mul1")
    n = 100
    a = upload(d, np.arange(n, dtype=np.float32))
    b = d.alloc(n * 4)
    d.dispatch(p3, [(a, 0, n * 4, False), (b, 0, n * 4, True)], add_push(n, 0.5), groups_for(n), "mul3")
    np.testing.assert_array_equal(download(d, b, n), np.arange(n, dtype=np.float32) * 3 + 0.5)
    d.free(a)
    d.free(b)


def test_sampler_buffer_binding_reads_through_a_texel_view(fresh, shaders):
    """A samplerBuffer binding is bound as an rgba32f texel view of the range: at an offset, and
    with a length that ends inside a texel (the view is rounded up to whole texels)."""
    d = fresh
    p = d.pipeline(shaders["texel"], 2, 8, [], "texel")
    n = 37
    x = np.arange(100, dtype=np.float32)
    a = upload(d, x)
    y = d.alloc(n * 4)
    for off in (0, 48):  # bytes: 16-aligned, as storage bindings are
        d.dispatch(p, [(a, off, n * 4, False), (y, 0, n * 4, True)], add_push(n, 0.5), groups_for(n), "texel")
        np.testing.assert_array_equal(download(d, y, n), x[off // 4: off // 4 + n] + 0.5)
    with pytest.raises(ValueError, match="samplerBuffer"):
        d.pipeline(shaders["image"], 2, 0, [], "image")
    d.free(a)
    d.free(y)


def test_usampler_buffer_binding_reads_raw_words_through_an_rgba32ui_view(fresh, shaders):
    """A usamplerBuffer binding is bound as an rgba32ui view: every word comes back as stored,
    those that are NaNs or denormals as floats included, and the same range read through an
    rgba32f view by another pipeline (a view per format) keeps its float values."""
    d = fresh
    pu = d.pipeline(shaders["utexel"], 2, 4, [], "utexel")
    pf = d.pipeline(shaders["texel"], 2, 8, [], "texel")
    words = np.array([0x7F800001, 0xFFFFFFFF, 0x00000001, 0x3F800000, 0xFF80FFC1, 0x80000000, 0x7FC00000,
                      0x12345678] * 5, dtype=np.uint32)
    n = words.size
    a = upload(d, words)
    y = d.alloc(n * 4)
    for off in (0, 16):
        m = n - off // 4
        d.dispatch(pu, [(a, off, m * 4, False), (y, 0, m * 4, True)], struct.pack("<I", m), groups_for(m), "utexel")
        got = np.empty(m, np.uint32)
        d.read(y, 0, got)
        np.testing.assert_array_equal(got, words[off // 4:])
    floats = upload(d, np.arange(n, dtype=np.float32))
    d.dispatch(pu, [(floats, 0, n * 4, False), (y, 0, n * 4, True)], struct.pack("<I", n), groups_for(n), "utexel")
    got = np.empty(n, np.uint32)
    d.read(y, 0, got)
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32).view(np.uint32))
    d.dispatch(pf, [(floats, 0, n * 4, False), (y, 0, n * 4, True)], add_push(n, 0.0), groups_for(n), "texel")
    np.testing.assert_array_equal(download(d, y, n), np.arange(n, dtype=np.float32))
    for h in (a, y, floats):
        d.free(h)


def test_barriers_independent_raw_war(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 256
    nb = n * 4
    x = upload(d, np.ones(n, np.float32))
    outs = [d.alloc(nb) for _ in range(8)]
    d.synchronize()
    d.reset_stats()
    # Independent: same input, disjoint outputs -> no barrier.
    for i, o in enumerate(outs):
        d.dispatch(p, [(x, 0, nb, False), (o, 0, nb, True)], add_push(n, float(i)), groups_for(n), "indep")
    assert d.stats()["barriers"] == 0
    # Disjoint windows of one allocation are independent too.
    wide = d.alloc(4 * nb)
    for k in range(4):
        d.dispatch(p, [(x, 0, nb, False), (wide, k * nb, nb, True)], add_push(n, 0.0), groups_for(n), "win")
    assert d.stats()["barriers"] == 0
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(download(d, o, n), np.full(n, 1 + i, np.float32))
    # RAW chain of 5 links -> 4 barriers.
    d.synchronize()
    d.reset_stats()
    chain = [x] + outs[:5]
    for s, t in zip(chain[:-1], chain[1:]):
        d.dispatch(p, [(s, 0, nb, False), (t, 0, nb, True)], add_push(n, 1.0), groups_for(n), "raw")
    assert d.stats()["barriers"] == 4
    np.testing.assert_array_equal(download(d, outs[4], n), np.full(n, 6, np.float32))
    # WAR: read outs[6], then overwrite outs[6] from another source -> one barrier.
    d.synchronize()
    d.reset_stats()
    d.dispatch(p, [(outs[6], 0, nb, False), (outs[7], 0, nb, True)], add_push(n, 0.0), groups_for(n), "read6")
    d.dispatch(p, [(x, 0, nb, False), (outs[6], 0, nb, True)], add_push(n, 100.0), groups_for(n), "war")
    assert d.stats()["barriers"] == 1
    np.testing.assert_array_equal(download(d, outs[7], n), np.full(n, 7, np.float32))
    np.testing.assert_array_equal(download(d, outs[6], n), np.full(n, 101, np.float32))
    for h in [x, wide, *outs]:
        d.free(h)


def test_host_write_waits_for_pending_reader(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 512
    a = upload(d, np.full(n, 2, np.float32))
    b = d.alloc(n * 4)
    other = d.alloc(n * 4)
    d.synchronize()
    d.reset_stats()
    d.dispatch(p, [(a, 0, n * 4, False), (b, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "reader")
    # A disjoint write happens at once: nothing is submitted.
    d.write(other, 0, np.zeros(n, np.float32))
    assert d.stats()["submits"] == 0 and d.stats()["pending_dispatches"] == 1
    # A read of a range nothing writes does not submit either.
    download(d, a, n)
    assert d.stats()["submits"] == 0
    # Overwriting the input of the recorded dispatch must first let it run.
    d.write(a, 0, np.full(n, 100, np.float32))
    assert d.stats()["submits"] == 1
    np.testing.assert_array_equal(download(d, b, n), np.full(n, 3, np.float32))
    for h in (a, b, other):
        d.free(h)


def test_auto_submit_threshold(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 64
    a = upload(d, np.zeros(n, np.float32))
    outs = [d.alloc(n * 4) for _ in range(10)]
    d.synchronize()
    d.reset_stats()
    d.auto_submit_dispatches = 4
    for o in outs:
        d.dispatch(p, [(a, 0, n * 4, False), (o, 0, n * 4, True)], add_push(n, 1.0), (1, 1, 1), "t")
    st = d.stats()
    assert st["submits"] == 2 and st["pending_dispatches"] == 2
    d.flush()
    assert d.stats()["submits"] == 3 and d.stats()["pending_dispatches"] == 0
    d.synchronize()
    with pytest.raises(ValueError):
        d.auto_submit_dispatches = 0
    for h in [a, *outs]:
        d.free(h)


def test_numpy_integer_arguments(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [np.uint32(2)], "np")
    n = np.int64(64)
    a = upload(d, np.ones(64, np.float32))
    b = d.alloc(int(n) * 4)
    d.dispatch(np.int32(p), [(np.uint64(a), np.int64(0), n * 4, np.bool_(False)), (b, 0, n * 4, True)],
               add_push(64, 1.0), (np.int64(1), 1, 1), "np", flops=np.int64(64), nbytes=np.int64(512))
    np.testing.assert_array_equal(download(d, b, 64), np.full(64, 3, np.float32))
    with pytest.raises(TypeError):
        d.dispatch(p, [(a, 0.5, 16, False), (b, 0, 16, True)], add_push(64, 1.0), (1, 1, 1), "float")
    d.free(a)
    d.free(b)


def test_zero_groups_skipped(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    a = d.alloc(256)
    d.dispatch(p, [(a, 0, 0, False), (a, 0, 0, True)], add_push(0, 1.0), (0, 1, 1), "empty")
    assert d.stats()["dispatches"] == 0 and d.stats()["pending_dispatches"] == 0
    d.free(a)


def test_three_buffer_kernel_in_place(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["sum"], 3, 0, [], "sum")
    n = 300
    x = upload(d, np.arange(n, dtype=np.float32))
    y = upload(d, np.full(n, 2, np.float32))
    for _ in range(3):  # x = x + y, in place (binding 0 and 2 are the same range)
        d.dispatch(p, [(x, 0, n * 4, False), (y, 0, n * 4, False), (x, 0, n * 4, True)], b"", groups_for(n), "sum")
    np.testing.assert_array_equal(download(d, x, n), np.arange(n, dtype=np.float32) + 6)
    d.free(x)
    d.free(y)


def test_copy_and_fill(fresh):
    d = fresh
    n = 1000
    a = d.alloc(n * 4)
    b = d.alloc(n * 4)
    bits = struct.unpack("<I", struct.pack("<f", 2.5))[0]
    d.fill(a, 0, n * 4, bits)
    d.fill(b, 0, n * 4, 0)
    d.copy(a, 40, b, 400, 400)  # floats 10..109 of a into 100..199 of b
    out = download(d, b, n)
    expect = np.zeros(n, np.float32)
    expect[100:200] = 2.5
    np.testing.assert_array_equal(out, expect)
    st = d.stats()
    assert st["copies"] == 1
    assert st["barriers"] == 1  # the copy reads what the first fill wrote (RAW); the fills are independent
    with pytest.raises(ValueError, match="multiples of 4"):
        d.fill(a, 2, 8, 0)
    with pytest.raises(ValueError, match="multiples of 4"):
        d.fill(a, 0, 6, 0)
    with pytest.raises(ValueError, match="overlap"):
        d.copy(a, 0, a, 8, 16)
    with pytest.raises(ValueError, match="outside"):
        d.copy(a, 0, b, n * 4 - 8, 16)
    d.free(a)
    d.free(b)


# ---------------------------------------------------------------- profiling


def _check_events(d, expect: int, slack_ns: int = 2_000_000):
    d.synchronize()
    taken = d.take_events()
    events, submits = taken["events"], taken["submits"]
    assert len(events) == expect
    window = {s["submit"]: s for s in submits}
    assert sum(s["dispatches"] for s in submits) >= sum(1 for e in events if e["name"] not in ("copy", "fill", "upload", "download"))
    for e in events:
        assert e["end_ns"] >= e["start_ns"]
        s = window[e["submit"]]
        assert s["host_submit_ns"] - slack_ns <= e["start_ns"]
        assert e["end_ns"] <= s["host_done_ns"] + slack_ns
        assert e["host_record_ns"] <= s["host_submit_ns"]
    assert d.take_events() == {"events": [], "submits": []}
    return events


def test_profiling_events(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 4096
    a = upload(d, np.zeros(n, np.float32))
    b = d.alloc(n * 4)
    d.auto_submit_dispatches = 8
    d.set_profiling(True)
    t0 = time.monotonic_ns()
    for i in range(20):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        d.dispatch(p, [(src, 0, n * 4, False), (dst, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "prof_add",
                   flops=n, nbytes=8 * n)
    events = _check_events(d, 20)
    assert all(e["name"] == "prof_add" and e["flops"] == n and e["bytes"] == 8 * n for e in events)
    assert all(e["host_record_ns"] >= t0 for e in events)
    assert len({e["submit"] for e in events}) == 3  # 8 + 8 + 4
    starts = [e["start_ns"] for e in events]
    assert starts == sorted(starts)  # dependent chain: in order
    d.fill(a, 0, 64, 0)
    d.copy(a, 0, b, 0, 64)
    names = [e["name"] for e in _check_events(d, 2)]
    assert names == ["fill", "copy"]
    d.set_profiling(False)
    d.dispatch(p, [(a, 0, n * 4, False), (b, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "unprofiled")
    _check_events(d, 0)
    d.free(a)
    d.free(b)


def test_take_events_does_not_wait(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 64
    a = upload(d, np.zeros(n, np.float32))
    b = d.alloc(n * 4)
    d.set_profiling(True)
    d.dispatch(p, [(a, 0, n * 4, False), (b, 0, n * 4, True)], add_push(n, 1.0), (1, 1, 1), "later")
    assert d.take_events()["events"] == []  # still recorded, not submitted
    assert d.stats()["pending_dispatches"] == 1
    assert len(_check_events(d, 1)) == 1
    d.set_profiling(False)
    d.free(a)
    d.free(b)


# ---------------------------------------------------------------- pipelines and the cache file


def test_pipeline_cache_file_written_atomically(tmp_path, shaders):
    cache_dir = tmp_path / "pc" / "nested"  # created on save, parents included
    d = v.Device(0, str(cache_dir))
    assert not d.pipeline_cache_loaded
    d.pipeline(shaders["add"], 2, 8, [1], "add")
    d.save_pipeline_cache()
    uuid = d.info["pipeline_cache_uuid"]
    path = cache_dir / f"pipeline_cache_{uuid}.bin"
    assert d.pipeline_cache_path == str(path)
    data = path.read_bytes()
    assert len(data) >= 32
    hdr_len, hdr_ver, vendor, device = struct.unpack("<4I", data[:16])
    assert hdr_ver == 1 and vendor == d.info["vendor_id"] and device == d.info["device_id"]
    assert data[16:32].hex() == uuid
    assert os.listdir(cache_dir) == [path.name]  # no temp file left behind
    os.remove(path)
    d.close()  # close saves again
    assert path.exists()
    d1 = v.Device(0, str(cache_dir))
    assert d1.pipeline_cache_loaded  # header matches this device
    d1.close()
    # A corrupt cache file is ignored, not fatal.
    path.write_bytes(b"\x00" * 64)
    d2 = v.Device(0, str(cache_dir))
    d2.pipeline(shaders["add"], 2, 8, [1], "add")
    d2.close()
    assert path.read_bytes()[16:32].hex() == uuid


def test_closed_device_raises(shaders):
    d = v.Device(0, "")
    h = d.alloc(16)
    d.close()
    assert d.closed
    for call in (lambda: d.alloc(16), lambda: d.free(h), lambda: d.synchronize(), lambda: d.stats(),
                 lambda: d.pipeline(shaders["add"], 2, 8, [1], "add")):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    d.close()  # idempotent


# ---------------------------------------------------------------- bad arguments


def test_bad_dispatch_arguments_name_the_op(fresh, shaders):
    d = fresh
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 256
    a = d.alloc(n * 4)
    b = d.alloc(n * 4)
    ok = [(a, 0, n * 4, False), (b, 0, n * 4, True)]
    push = add_push(n, 1.0)
    align = d.info["limits"]["min_storage_buffer_offset_alignment"]
    maxg = d.info["limits"]["max_workgroup_count"][0]
    bad = {
        "misaligned": ([(a, align // 2 or 1, 64, False), ok[1]], push, (1, 1, 1)),
        "outside": ([(a, 0, n * 4 + 16, False), ok[1]], push, (1, 1, 1)),
        "pushsize": (ok, push + b"\0\0\0\0", (1, 1, 1)),
        "toomanygroups": (ok, push, (maxg + 1, 1, 1)),
        "nbufs": (ok[:1], push, (1, 1, 1)),
        "badhandle": ([(999999, 0, 16, False), ok[1]], push, (1, 1, 1)),
        "groupsshape": (ok, push, (1, 1)),
    }
    if align == 1:
        del bad["misaligned"]
    for name, (bufs, pc, g) in bad.items():
        with pytest.raises(ValueError, match=f"'{name}'"):
            d.dispatch(p, bufs, pc, g, name)
    with pytest.raises(ValueError, match="unknown pipeline"):
        d.dispatch(10_000, ok, push, (1, 1, 1), "nopipe")
    assert d.stats()["dispatches"] == 0 and d.stats()["pending_dispatches"] == 0
    d.free(a)
    d.free(b)


def test_bad_pipeline_and_transfer_arguments(fresh, shaders):
    d = fresh
    with pytest.raises(ValueError, match="SPIR-V"):
        d.pipeline(b"\x01\x02\x03\x04" * 8, 2, 8, [], "junk")
    with pytest.raises(ValueError, match="multiple of 4"):
        d.pipeline(shaders["add"][:-2], 2, 8, [], "short")
    with pytest.raises(ValueError, match="binding 3"):
        d.pipeline(shaders["wide"], 2, 0, [], "wide")
    assert d.pipeline(shaders["wide"], 4, 0, [], "wide4") >= 0
    with pytest.raises(ValueError, match="push_size"):
        d.pipeline(shaders["add"], 2, 6, [], "odd")
    h = d.alloc(100)
    with pytest.raises(ValueError, match="outside"):
        d.write(h, 96, b"12345678")
    with pytest.raises(ValueError, match="outside"):
        d.read(h, 0, bytearray(101))
    with pytest.raises(ValueError, match="writable"):
        d.read(h, 0, b"immutable")
    with pytest.raises(ValueError, match="contiguous"):
        d.write(h, 0, np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(ValueError):
        d.alloc(-1)
    d.free(h)


def test_a_pipeline_runs_in_the_subgroup_size_it_requires(fresh, shaders):
    # The cooperative-matrix kernels' lane shares are planned for one subgroup size; the addon
    # makes the driver keep to it (Vulkan 1.3's required subgroup size, full subgroups).
    d = fresh
    lim = v.enumerate_devices()[0]["limits"]
    lo, hi = lim["min_subgroup_size"], lim["max_subgroup_size"]
    if lo == 0:
        with pytest.raises(ValueError, match="cannot require a subgroup size"):
            d.pipeline(shaders["subgroup"], 1, 0, [], "sg", subgroup_size=32)
        return
    n = 256
    for size in sorted({lo, hi}):
        p = d.pipeline(shaders["subgroup"], 1, 0, [], f"sg{size}", subgroup_size=size)
        assert p != d.pipeline(shaders["subgroup"], 1, 0, [], "sg-any")  # its own pipeline, not the driver's choice
        y = d.alloc(n * 4)
        d.dispatch(p, [(y, 0, n * 4, True)], b"", groups_for(n), "sg")
        np.testing.assert_array_equal(download(d, y, n).view(np.uint32), np.full(n, size, np.uint32))
        d.free(y)
    for bad in (lo // 2, hi * 2, lo + 1 if hi > lo + 1 else 3 * hi):
        with pytest.raises(ValueError, match=f"subgroup_size {bad} is not a power of two in the device's {lo}..{hi}"):
            d.pipeline(shaders["subgroup"], 1, 0, [], "sg-bad", subgroup_size=bad)
    with pytest.raises(ValueError, match="subgroup_size must be 0"):
        d.pipeline(shaders["subgroup"], 1, 0, [], "sg-neg", subgroup_size=-1)


# ---------------------------------------------------------------- paths of other hardware


@pytest.mark.parametrize("env", ["HELIOS_VK_FORCE_STAGING", "HELIOS_VK_NO_PUSH_DESCRIPTOR",
                                 "HELIOS_VK_NO_CALIBRATED_TIMESTAMPS", "HELIOS_VK_NO_TIMELINE_SEMAPHORE"])
def test_fallback_paths(monkeypatch, shaders, env):
    """Staging copies (discrete GPUs), descriptor-set pools, uncalibrated timestamps, a fence per
    command buffer (Vulkan 1.1 devices, no timeline semaphore)."""
    monkeypatch.setenv(env, "1")
    d = v.Device(0, "")
    vulkan_1_2 = tuple(int(x) for x in d.info["api_version"].split(".")[:2]) >= (1, 2)
    assert d.timeline_semaphore is (env != "HELIOS_VK_NO_TIMELINE_SEMAPHORE" and vulkan_1_2)
    if env == "HELIOS_VK_NO_PUSH_DESCRIPTOR":
        assert d.info["features"]["push_descriptor"] is False
    if env == "HELIOS_VK_NO_CALIBRATED_TIMESTAMPS":
        assert d.info["features"]["calibrated_timestamps"] is False
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    n = 3000
    base = np.arange(n, dtype=np.float32)
    a = upload(d, base)
    b = d.alloc(n * 4)
    if env == "HELIOS_VK_FORCE_STAGING":
        assert d.stats()["copies"] == 1  # the upload went through a staging copy
        big = np.random.default_rng(1).integers(0, 255, (40 << 20) // 4, dtype=np.uint32)  # > one staging chunk
        hb = upload(d, big, "weights")
        back = np.empty_like(big)
        d.read(hb, 0, back)
        np.testing.assert_array_equal(back, big)
        d.free(hb)
    d.auto_submit_dispatches = 600  # > one descriptor pool's worth of sets in one command buffer
    d.set_profiling(True)
    for i in range(600):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        d.dispatch(p, [(src, 0, n * 4, False), (dst, 0, n * 4, True)], add_push(n, 1.0), groups_for(n), "fb")
    np.testing.assert_array_equal(download(d, a, n), base + 600)
    # Staging readbacks are timed copies ("download") of their own.
    extra = 1 if env == "HELIOS_VK_FORCE_STAGING" else 0
    events = _check_events(d, 600 + extra)
    assert sum(e["name"] == "fb" for e in events) == 600
    # a texel-buffer binding through each path (descriptor-set pools hold texel buffers too)
    pt = d.pipeline(shaders["texel"], 2, 8, [], "texel")
    for _ in range(300):  # more sets than one pool holds
        d.dispatch(pt, [(a, 0, n * 4, False), (b, 0, n * 4, True)], add_push(n, 0.5), groups_for(n), "tx")
    np.testing.assert_array_equal(download(d, b, n), base + 600.5)
    d.close()


def test_out_of_memory_retry_reclaims_and_trims(monkeypatch, shaders):
    """vkAllocateMemory failure path: synchronize, reclaim deferred frees, release empty blocks, retry."""
    monkeypatch.setenv("HELIOS_VK_MEMORY_LIMIT_MB", "160")
    d = v.Device(0, "")
    assert d.block_size == 64 << 20
    p = d.pipeline(shaders["add"], 2, 8, [1], "add")
    mib = 1 << 20
    a1, a2, a3 = (d.alloc(30 * mib) for _ in range(3))  # two 64 MiB blocks
    assert d.pool_stats()["activations"]["reserved_bytes"] == 128 * mib
    out = d.alloc(4096)
    d.dispatch(p, [(a1, 0, 4096, False), (out, 0, 4096, True)], add_push(1024, 1.0), groups_for(1024), "pending")
    d.free(a1)
    d.free(a2)  # both frees wait for the recorded dispatch
    assert d.stats()["submits"] == 0
    big = d.alloc(40 * mib)  # dedicated; fits only after the first block is released
    st = d.pool_stats()["activations"]
    assert d.stats()["submits"] == 1  # the retry synchronized
    assert st["reserved_bytes"] == 64 * mib + 40 * mib and st["dedicated"] == 1
    with pytest.raises(v.OutOfMemoryError) as ei:
        d.alloc(100 * mib, "weights")
    msg = str(ei.value)
    assert str(100 * mib) in msg and "weights: reserved 0 B" in msg and f"activations: reserved {104 * mib} B" in msg
    d.write(big, 40 * mib - 4, b"\x01\x02\x03\x04")  # still usable
    got = bytearray(4)
    d.read(big, 40 * mib - 4, got)
    assert bytes(got) == b"\x01\x02\x03\x04"
    for h in (a3, out, big):
        d.free(h)
    d.close()


VALIDATION_SCENARIO = r"""
import struct, sys
import numpy as np
import helios._vulkan as v
add, total, texel, utexel = (open(path, "rb").read() for path in sys.argv[1:5])
d = v.Device(0, "")
p = d.pipeline(add, 2, 8, [1], "add")
s = d.pipeline(total, 3, 0, [], "sum")
t = d.pipeline(texel, 2, 8, [], "texel")    # rgba32f and rgba32ui views of one range
u = d.pipeline(utexel, 2, 4, [], "utexel")
n = 1024
nb = n * 4
push = struct.pack("<If", n, 1.0)
a, b, c = (d.alloc(nb) for _ in range(3))
wide = d.alloc(4 * nb)
d.write(a, 0, np.zeros(n, np.float32))
d.set_profiling(True)
for i in range(300):                                   # RAW chain across several submits
    src, dst = (a, b) if i % 2 == 0 else (b, a)
    d.dispatch(p, [(src, 0, nb, False), (dst, 0, nb, True)], push, (16, 1, 1), "chain")
for k in range(4):                                     # independent windows of one allocation
    d.dispatch(p, [(a, 0, nb, False), (wide, k * nb, nb, True)], push, (16, 1, 1), "win")
d.dispatch(p, [(a, 0, nb, False), (c, 0, nb, True)], push, (16, 1, 1), "readA")
d.dispatch(p, [(b, 0, nb, False), (a, 0, nb, True)], push, (16, 1, 1), "WAR")
d.dispatch(s, [(a, 0, nb, False), (c, 0, nb, False), (a, 0, nb, True)], b"", (16, 1, 1), "inplace")
d.fill(c, 0, nb, 0)
d.copy(wide, 0, c, 0, nb)
d.dispatch(p, [(c, 0, nb, False), (b, 0, nb, True)], push, (16, 1, 1), "afterCopy")
out = np.empty(n, np.float32)
d.read(b, 0, out)
d.write(a, 0, out)                                     # host write over a range the stream read
d.free(c)
e = d.alloc(nb)                                        # deferred free: a fresh range
d.dispatch(p, [(a, 0, nb, False), (e, 0, nb, True)], push, (16, 1, 1), "fresh")
d.synchronize()
d.free(e)
f = d.alloc(nb)                                        # reused range after completion
d.dispatch(p, [(b, 0, nb, False), (f, 0, nb, True)], push, (16, 1, 1), "reuse")
d.dispatch(t, [(f, 0, nb, False), (wide, 0, nb, True)], push, (16, 1, 1), "texel")
d.dispatch(u, [(f, 0, nb, False), (wide, nb, nb, True)], push[:4], (16, 1, 1), "utexel")
d.read(f, 0, out)
d.take_events()
d.close()
print("SCENARIO-OK")
"""


@pytest.mark.parametrize("env", [{}, {"HELIOS_VK_NO_PUSH_DESCRIPTOR": "1", "HELIOS_VK_FORCE_STAGING": "1",
                                      "HELIOS_VK_NO_TIMELINE_SEMAPHORE": "1"}])
def test_clean_under_validation_layers(tmp_path, shaders, env):
    """The stream's barriers satisfy Khronos synchronization validation, and texel views have the
    format their shader reads (skipped without the layer)."""
    paths = [tmp_path / f"{name}.spv" for name in ("add", "sum", "texel", "utexel")]
    for path in paths:
        path.write_bytes(shaders[path.stem])
    run_env = dict(os.environ, VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation", VK_LOADER_DEBUG="layer",
                   VK_LAYER_ENABLES="VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT",
                   VK_LAYER_REPORT_FLAGS="error,warn", VK_LAYER_DEBUG_ACTION="VK_DBG_LAYER_ACTION_LOG_MSG", **env)
    out = subprocess.run([sys.executable, "-c", VALIDATION_SCENARIO, *map(str, paths)], env=run_env,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    if 'Insert instance layer "VK_LAYER_KHRONOS_validation"' not in text:
        pytest.skip("the Khronos validation layer is not installed (Debian: vulkan-validationlayers)")
    assert out.returncode == 0 and "SCENARIO-OK" in out.stdout, text[-3000:]
    problems = [ln for ln in text.splitlines() if re.search(r"VUID-|SYNC-|Validation (Error|Warning)", ln)]
    assert not problems, "\n".join(problems[:10])


def test_garbage_collection_closes_and_saves(tmp_path, shaders):
    import gc

    d = v.Device(0, str(tmp_path))
    d.pipeline(shaders["add"], 2, 8, [1], "add")
    path = d.pipeline_cache_path
    h = d.alloc(1024)
    d.write(h, 0, b"\1" * 1024)
    del d
    gc.collect()
    assert os.path.exists(path)  # closing (which saves the cache) ran on collection


EXIT_SCENARIO = r"""
import struct, sys
import helios._vulkan as v
add = open(sys.argv[1], "rb").read()
d = v.Device(0, sys.argv[2])
p = d.pipeline(add, 2, 8, [1], "add")
a, b = d.alloc(4096), d.alloc(4096)
d.set_profiling(True)
for i in range(300):  # leaves recorded and in-flight work behind
    d.dispatch(p, [(a, 0, 4096, False), (b, 0, 4096, True)], struct.pack("<If", 1024, 1.0), (16, 1, 1), "x")
class Cycle:
    pass
c = Cycle()
c.me = c
c.dev = v.Device(0, "")
c.h = c.dev.alloc(100)
print("exiting")
"""


def test_interpreter_exit_with_live_devices_is_clean(tmp_path, shaders):
    spv = tmp_path / "add.spv"
    spv.write_bytes(shaders["add"])
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", EXIT_SCENARIO, str(spv), str(cache)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exiting" and out.stderr == ""
    assert [p.name for p in cache.iterdir()] == [f"pipeline_cache_{v.enumerate_devices()[0]['pipeline_cache_uuid']}.bin"]


def test_size_classes_and_exact_reuse(fresh):
    d = fresh
    base = d.pool_stats()["weights"]["in_use_bytes"]
    expect = {1: 256, 256: 256, 257: 512, 1000: 1024, 1025: 1280, 5000: 5120, 70_000: 81_920}
    for asked, cls in expect.items():
        h = d.alloc(asked, "weights")
        assert d.pool_stats()["weights"]["in_use_bytes"] - base == cls, asked
        loc = d.location(h)
        d.free(h)  # nothing pending: reusable at once
        h2 = d.alloc(cls - 1 if cls > 256 else 1, "weights")  # same class, same range
        assert d.location(h2) == loc
        d.free(h2)
