"""The emulated CUDA driver: the runner's host code (parameters, tensor maps, grid, shared
memory opt-in, copies) checked against the driver API's rules, without a GPU."""

from __future__ import annotations

import ctypes
import json
import warnings

import numpy as np
import pytest

import helios.cuda_ptx as cp
from helios.cuda_ptx import driver, dtypes, operands, smoke
from helios.cuda_ptx.emit import build_kernel
from helios.cuda_ptx.emu.driver import EmulatedDriver, decode_tensor_map, emulated_context
from helios.cuda_ptx.emu.state import EmulationError, TensorMap
from helios.cuda_ptx.render import render
from helios.cuda_ptx.runner import GemmLaunch
from helios.errors import DeviceError

pytest.importorskip("cuda.bindings")


def _ints(rng, shape):
    return rng.integers(-3, 4, shape).astype(np.float32)


def _encode(cu, out_align=128, **change):
    """cuTensorMapEncodeTiled, called through its C entry point as Context does, on a bf16
    256 x 128 matrix with a 64 x 64 box, some arguments changed: (CUresult, 128 bytes)."""
    args = dict(dtype=cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank=2, address=0x7F00_0000_0000,
                dims=[128, 256], strides=[256], box=[64, 64], element_strides=[1, 1],
                interleave=cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle=cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                l2_promotion=cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                oob_fill=cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    args.update(change)
    err, pfn, _ = cu.cuGetProcAddress(b"cuTensorMapEncodeTiled", 12000, 0)
    assert err == cu.CUresult.CUDA_SUCCESS
    raw = ctypes.create_string_buffer(128 + 128 + 128)  # slack to align, the offset, the map
    out = (ctypes.addressof(raw) + 127) // 128 * 128 + (out_align % 128)
    arr = lambda t, v: (t * len(v))(*v)  # noqa: E731
    code = driver.ENCODE_TILED(pfn)(out, int(args["dtype"]), args["rank"], args["address"],
                                    arr(ctypes.c_uint64, args["dims"]), arr(ctypes.c_uint64, args["strides"]),
                                    arr(ctypes.c_uint32, args["box"]), arr(ctypes.c_uint32, args["element_strides"]),
                                    int(args["interleave"]), int(args["swizzle"]), int(args["l2_promotion"]),
                                    int(args["oob_fill"]))
    return cu.CUresult(code), ctypes.string_at(out, 128)


def test_the_context_sees_a_hopper_device_that_loads_ptx():
    ctx = emulated_context(sm_count=6)
    assert (ctx.cc, ctx.arch, ctx.sm_count, ctx.jit) == ((9, 0), "sm_90a", 6, True)
    assert ctx.name.startswith("Helios PTX emulator")


@pytest.mark.parametrize("b_major", ["k", "n"])
def test_a_persistent_cluster_launch_hands_the_kernel_what_the_operands_describe(b_major):
    """GemmLaunch on the emulated driver: the grid fills the resident clusters, every tensor
    map the kernel receives is the box operands.tma_boxes describes, in parameter order,
    and the product is exact."""
    cfg = cp.variants()["wgmma_cluster"].with_(b_major=b_major)
    rng = np.random.default_rng(1)
    a, b = _ints(rng, (4 * cfg.bm - 7, 2 * cfg.bk)), _ints(rng, (2 * cfg.bk, 2 * cfg.bn - 9))
    ctx = emulated_context(sm_count=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the occupancy query answers: no fallback warning
        launch = GemmLaunch(cfg, a.shape[0], b.shape[1], a.shape[1], ctx)
    assert launch.grid == (4, 1)  # 4 SMs hold two clusters of two; there are four 2 x 1 blocks
    launch.upload(a, b)
    launch.run()
    np.testing.assert_array_equal(launch.result(), a @ b)
    (seen,) = ctx.cu.launches
    kern = build_kernel(cfg)
    assert seen["kernel"] == kern.name and seen["block"] == (kern.threads, 1, 1)
    assert seen["grid"] == (4, 1, 1) and seen["shared_bytes"] == kern.shared_bytes > 48 * 1024
    boxes = operands.tma_boxes(cfg, launch.padded)
    got = [seen["params"][f"tmap_{box.operand}"] for box in boxes]
    ptrs = {"a": launch.a_ptr, "b": launch.b_ptr, "c": launch.c_ptr}
    assert got == [TensorMap(ptrs[x.operand], x.rows, x.cols, x.box_rows, x.box_cols, x.itemsize) for x in boxes]
    assert (seen["params"]["c"], seen["params"]["M"], seen["params"]["N"], seen["params"]["K"]) == (
        launch.c_ptr, launch.mp, launch.np_, launch.kp)
    launch.close()


def test_parameters_out_of_order_are_caught_at_launch():
    cfg = cp.variants()["wgmma_tma"]
    ctx = emulated_context()
    launch = GemmLaunch(cfg, 64, 128, 64, ctx)
    launch.upload(np.ones((64, 64), np.float32), np.ones((64, 128), np.float32))
    tmap_a, tmap_b, c, *dims = launch.args
    wrong = [("u64", launch.c_ptr), tmap_b, tmap_a, *dims]  # a pointer where tensor map A belongs
    with pytest.raises(EmulationError, match="not bytes cuTensorMapEncodeTiled made"):
        ctx.launch(launch.fn, (*launch.grid, 1), (launch.threads, 1, 1), wrong)


@pytest.mark.parametrize("change,code,why", [
    ({"address": 0x7F00_0000_0008}, "INVALID_VALUE", "16-byte aligned"),
    ({"dims": [0, 256]}, "INVALID_VALUE", "globalDim"),
    ({"strides": [200]}, "INVALID_VALUE", "multiple of 16"),
    ({"box": [64, 257]}, "INVALID_VALUE", "1..256"),
    ({"box": [4, 64]}, "INVALID_VALUE", "multiple of 16"),
    ({"box": [128, 64]}, "INVALID_VALUE", "exceeds the 128-byte swizzle"),
    ({"element_strides": [1, 9]}, "INVALID_VALUE", "elementStrides"),
    ({"rank": 6}, "INVALID_VALUE", "tensorRank 6"),
    ({"out_align": 32}, "INVALID_VALUE", "must be 64-byte aligned"),
    ({"swizzle": 99}, "INVALID_VALUE", "CUtensorMapSwizzle"),
    ({"strides": [128]}, "INVALID_VALUE", "shorter than a row"),
])
def test_tensor_map_arguments_are_held_to_the_driver_api_rules(change, code, why):
    cu = EmulatedDriver()
    err, raw = _encode(cu, **change)
    assert err.name == f"CUDA_ERROR_{code}" and raw == bytes(128)  # nothing written
    assert why in cu.cuGetErrorString(err)[1].decode()


def test_the_jit_log_buffer_must_be_bytes_as_in_the_bindings():
    cu = EmulatedDriver()
    opts = [cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    with pytest.raises(TypeError, match="expected bytes, int found"):
        cu.cuModuleLoadDataEx(b"x\0", 2, opts, [ctypes.addressof(ctypes.create_string_buffer(64)), 64])


def test_a_tensor_map_round_trips_through_its_128_bytes():
    cu = EmulatedDriver()
    err, raw = _encode(cu, out_align=64)
    assert err == cu.CUresult.CUDA_SUCCESS
    assert decode_tensor_map(raw) == TensorMap(0x7F00_0000_0000, 256, 128, 64, 64, 2)
    err, raw = _encode(cu, out_align=64, strides=[512])  # rows 512 bytes apart: a view of a wider matrix
    assert err == cu.CUresult.CUDA_SUCCESS
    assert decode_tensor_map(raw) == TensorMap(0x7F00_0000_0000, 256, 128, 64, 64, 2, pitch=512)


def test_the_context_refuses_tensor_maps_it_knows_the_driver_would():
    ctx = emulated_context()
    with pytest.raises(DeviceError, match="16-byte aligned base"):
        ctx.tensor_map(0x7F00_0000_0008, "bf16", 256, 128, 64, 64)
    with pytest.raises(DeviceError, match=r"cuTensorMapEncodeTiled failed: CUDA_ERROR_INVALID_VALUE: .*globalDim"):
        ctx.tensor_map(0x7F00_0000_0000, "bf16", 0, 128, 64, 64)


def test_driver_errors_reach_the_user_with_the_reason():
    ctx = emulated_context()
    with pytest.raises(DeviceError, match=r"cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX.*\nJIT log:\nptx parse"):
        ctx.load(b"not ptx\0", "k", 0)
    with pytest.raises(DeviceError, match="CUDA_ERROR_INVALID_IMAGE.*not cubins"):
        ctx.load(b"\x7fELF....", "k", 0)
    ptx = render(build_kernel(cp.variants()["simt"]))
    with pytest.raises(DeviceError, match=r"cuModuleGetFunction\(nope\) failed: CUDA_ERROR_NOT_FOUND"):
        ctx.load_kernel(ptx, "nope", 0, "sm_80")
    with pytest.raises(DeviceError, match=r"cuMemcpyHtoD failed: .*outside every allocation"):
        ctx.upload(0x10, np.ones(4, np.float32))


def test_launches_the_driver_would_refuse_are_refused():
    cfg = cp.variants()["wgmma_cluster"].with_(persistent=False)
    kern = build_kernel(cfg)
    ctx = emulated_context()
    fn = ctx.load_kernel(render(kern), kern.name, kern.shared_bytes, cfg.target)
    with pytest.raises(DeviceError, match="CUDA_ERROR_INVALID_CLUSTER_SIZE.*clusters of 2 CTAs"):
        ctx.launch(fn, (3, 1, 1), (kern.threads, 1, 1), [])
    with pytest.raises(DeviceError, match=r"CUDA_ERROR_INVALID_VALUE.*exceed the kernel's \.maxntid"):
        ctx.launch(fn, (2, 1, 1), (kern.threads + 32, 1, 1), [])
    # without the opt-in (cuFuncSetAttribute) a function gets 48 KiB of dynamic shared memory
    shy = driver.Function(ctx._check("cuModuleGetFunction", ctx.cu.cuModuleGetFunction(ctx._modules[-1],
                                                                                         kern.name.encode())),
                          kern.name, kern.shared_bytes)
    with pytest.raises(DeviceError, match="MAX_DYNAMIC_SHARED_SIZE_BYTES"):
        ctx.launch(shy, (2, 1, 1), (kern.threads, 1, 1), [])


def test_memory_copies_free_and_events():
    ctx = emulated_context()
    p = ctx.alloc(64)
    ctx.upload(p, np.arange(16, dtype=np.float32))
    out = np.zeros(16, np.float32)
    ctx.download(out, p)
    np.testing.assert_array_equal(out, np.arange(16))
    ctx.memset0(p, 32)
    ctx.download(out, p)
    assert not out[:8].any() and out[8:].tolist() == list(range(8, 16))
    assert ctx.time_ms(lambda: None, 3) >= 0
    ctx.free(p)
    with pytest.raises(DeviceError, match="outside every allocation"):
        ctx.download(out, p)
    with pytest.raises(DeviceError, match="cuMemFree failed.*not the start of a live allocation"):
        ctx.free(p)


def test_jit_is_chosen_where_ptxas_is_missing_or_asked_for(monkeypatch):
    monkeypatch.delenv("HELIOS_CUDA_JIT", raising=False)
    monkeypatch.setattr(driver.toolchain, "find_tool", lambda name: "/usr/bin/ptxas")
    assert driver.Context(cu=EmulatedDriver()).jit is False
    monkeypatch.setenv("HELIOS_CUDA_JIT", "1")
    assert driver.Context(cu=EmulatedDriver()).jit is True
    monkeypatch.delenv("HELIOS_CUDA_JIT")
    monkeypatch.setattr(driver.toolchain, "find_tool", lambda name: None)
    assert driver.Context(cu=EmulatedDriver()).jit is True


@pytest.fixture
def emulated_device(monkeypatch):
    """HELIOS_CUDA_DEVICE=emulator for this test and the processes it starts, with the
    process-wide context built afresh before and after."""
    monkeypatch.setenv("HELIOS_CUDA_DEVICE", "emulator:4")
    driver.context.cache_clear()
    yield
    driver.context.cache_clear()


def test_gemm_runs_on_the_emulated_device_as_a_user_calls_it(emulated_device):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((130, 96)).astype(np.float32), rng.standard_normal((96, 200)).astype(np.float32)
    assert driver.context().name.startswith("Helios PTX emulator")
    c = cp.gemm(a, b)  # the device's default variant (wgmma_ws), B read N-major as numpy holds it
    ref = dtypes.decode(dtypes.encode(a, "bf16"), "bf16").astype(np.float64) @ dtypes.decode(
        dtypes.encode(b, "bf16"), "bf16")
    assert c.shape == (130, 200) and np.abs(c - ref).max() / np.abs(ref).max() < 1e-5
    (seen,) = driver.context().cu.launches
    assert seen["kernel"].startswith("helios_gemm_wgmma_bf16_f32_bn_128x256x64")


def test_the_smoke_run_passes_on_the_emulated_device(emulated_device, capsys):
    """The first thing a GPU session runs, dry-run end to end: a subprocess per launch,
    the launch check's own code, its JSON line and its classification."""
    assert smoke.main(["wgmma_cluster", "wgmma_fp8"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["name"], x["b_major"], x["status"]) for x in lines] == [
        ("wgmma_cluster", "k", "ok"), ("wgmma_cluster", "n", "ok"), ("wgmma_fp8", "k", "ok")]


@pytest.mark.parametrize("value", ["gpu", "emulator:0", "emulator:x"])
def test_a_bad_device_name_is_refused(monkeypatch, value):
    monkeypatch.setenv("HELIOS_CUDA_DEVICE", value)
    driver.context.cache_clear()
    with pytest.raises(DeviceError, match="HELIOS_CUDA_DEVICE"):
        driver.context()
    driver.context.cache_clear()


class _BindingsProbe:
    """Answers like the emulated driver, but first hands every call's arguments to the real
    ``cuda.bindings``: without a driver library they convert them and then fail to load
    it, so a ``TypeError`` (or ``ValueError``) there is an argument the real bindings
    would refuse on a GPU machine -- as the int arrays of cuTensorMapEncodeTiled once were."""

    def __init__(self, emulated: EmulatedDriver) -> None:
        from cuda.bindings import driver as real
        from cuda.pathfinder import DynamicLibNotFoundError

        self._emu, self._real, self._missing = emulated, real, DynamicLibNotFoundError
        self.probed: set[str] = set()

    def __getattr__(self, name):
        answer = getattr(self._emu, name)
        if not name.startswith("cu") or not callable(answer):
            return answer

        def call(*args):
            with pytest.raises(self._missing):  # not TypeError: the bindings took the arguments
                getattr(self._real, name)(*args)
            self.probed.add(name)
            return answer(*args)

        return call


@pytest.mark.skipif(driver.driver_status()[0], reason="a CUDA driver is present: the real calls would run")
def test_every_call_the_context_makes_fits_the_real_bindings():
    probe = _BindingsProbe(EmulatedDriver(sm_count=2))
    ctx = driver.Context(cu=probe, jit=True)
    cfg = cp.variants()["wgmma_cluster"]
    rng = np.random.default_rng(3)
    a, b = _ints(rng, (2 * cfg.bm, cfg.bk)), _ints(rng, (cfg.bk, cfg.bn))
    launch = GemmLaunch(cfg, *a.shape[:1], b.shape[1], a.shape[1], ctx)
    launch.upload(a, b)
    assert ctx.time_ms(launch.run, 1) >= 0
    np.testing.assert_array_equal(launch.result(), a @ b)
    ctx.memset0(launch.c_ptr, 16)
    launch.close()
    assert probe.probed >= {
        "cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuDeviceGetAttribute",
        "cuDeviceGetName", "cuModuleLoadDataEx", "cuModuleGetFunction", "cuFuncSetAttribute",
        "cuOccupancyMaxActiveClusters", "cuMemAlloc", "cuMemcpyHtoD", "cuGetProcAddress", "cuLaunchKernel",
        "cuCtxSynchronize", "cuMemcpyDtoH", "cuMemsetD8", "cuMemFree", "cuEventCreate", "cuEventRecord",
        "cuEventSynchronize", "cuEventElapsedTime", "cuEventDestroy"}


def test_portable_ptx_is_assembled_for_the_device_it_runs_on():
    # An sm_80 cubin does not load on an sm_90 GPU (CUDA_ERROR_NO_BINARY_FOR_GPU, seen on an
    # H200): PTX written for a portable target is assembled for the device's own arch.
    ctx = emulated_context()
    assert ctx.cc == (9, 0)
    assert ctx.cubin_arch("sm_80") == "sm_90a"
    assert ctx.cubin_arch("sm_90a") == "sm_90a"
