"""Loader/runner of helios.cuda_ptx: behaviour without a driver, and GPU numerics in a subprocess."""

import json
import textwrap

import helios.cuda_ptx as cp
import numpy as np
import pytest
from helios.cuda_ptx import driver, runner, smoke

from helios.errors import DeviceError, DTypeError, ShapeError

HAVE_DRIVER, WHY = driver.driver_status()


def test_bad_shapes_and_dtypes_fail_before_the_device():
    with pytest.raises(ShapeError, match=r"\(M, K\) @ \(K, N\)"):
        cp.gemm(np.ones((4, 3)), np.ones((4, 5)))
    with pytest.raises(DTypeError, match="out_dtype"):
        cp.gemm(np.ones((4, 4)), np.ones((4, 4)), out_dtype="float64")


@pytest.mark.skipif(HAVE_DRIVER, reason="a CUDA driver is present")
def test_without_a_driver_gemm_says_why():
    assert WHY and WHY != "ok"
    with pytest.raises(DeviceError, match="cannot use the CUDA driver"):
        cp.gemm(np.ones((4, 4)), np.ones((4, 4)))


def test_max_active_clusters_asks_the_driver_and_falls_back_with_a_warning():
    """Without a GPU: the query's launch config and both of its outcomes, on a stand-in driver."""
    from cuda.bindings import driver as real

    class FakeDriver:
        CUlaunchConfig, CUresult = real.CUlaunchConfig, real.CUresult
        answer = (real.CUresult.CUDA_SUCCESS, 60)

        def cuOccupancyMaxActiveClusters(self, handle, cfg):
            self.seen = (handle, cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes)
            return self.answer

        def cuGetErrorName(self, err):
            return real.CUresult.CUDA_SUCCESS, b"CUDA_ERROR_INVALID_CLUSTER_SIZE"

        def cuGetErrorString(self, err):
            return real.CUresult.CUDA_SUCCESS, b"invalid cluster size"

    ctx = object.__new__(driver.Context)
    ctx.cu, ctx.sm_count = FakeDriver(), 132
    fn = driver.Function("handle", "k", 229376)
    assert ctx.max_active_clusters(fn, 2, 384) == 60
    assert ctx.cu.seen == ("handle", 2, 384, 229376)
    ctx.cu.answer = (real.CUresult.CUDA_ERROR_INVALID_CLUSTER_SIZE, None)  # what the bindings return on failure
    with pytest.warns(RuntimeWarning, match="CUDA_ERROR_INVALID_CLUSTER_SIZE.*assuming 66"):
        assert ctx.max_active_clusters(fn, 2, 384) == 66
    ctx.cu.answer = (real.CUresult.CUDA_SUCCESS, 0)
    with pytest.warns(RuntimeWarning, match="no cluster fits; assuming 66"):
        assert ctx.max_active_clusters(fn, 2, 384) == 66


def test_configs_the_device_cannot_load_are_refused_by_name():
    ctx = object.__new__(driver.Context)
    ctx.name, ctx.cc = "NVIDIA A100", (8, 0)
    with pytest.raises(DeviceError, match=r"wgmma_cluster is built for sm_90a .* A100\) is sm_80"):
        runner.check_device(cp.variants()["wgmma_cluster"], ctx)
    runner.check_device(cp.variants()["mma_sync"], ctx)  # sm_80 code runs
    ctx.cc = (7, 5)
    with pytest.raises(DeviceError, match="needs sm_80 or newer"):
        runner.check_device(cp.variants()["simt"], ctx)
    ctx.cc = (9, 0)
    runner.check_device(cp.variants()["wgmma_cluster"], ctx)


def test_emulating_some_ctas_of_a_cluster_kernel_runs_their_whole_clusters():
    from helios.cuda_ptx.emu.launch import emulate_gemm

    cfg = cp.variants()["wgmma_cluster"].with_(persistent=False, tma_store=False)
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, (2 * cfg.bm, cfg.bk)).astype(np.float32)
    b = rng.integers(-3, 4, (cfg.bk, 2 * cfg.bn)).astype(np.float32)
    c = emulate_gemm(a, b, cfg, ctas=[(1, 0)])  # CTA 1 is rank 1 of cluster 0: block (0, 0)
    np.testing.assert_array_equal(c[:, : cfg.bn], (a @ b)[:, : cfg.bn])  # both CTAs of the cluster ran
    assert np.isnan(c[:, cfg.bn:]).all()  # cluster 1 (block 0, 1) did not


def test_isolated_run_times_out_with_a_hang_message():
    with pytest.raises(DeviceError, match="mbarrier"):
        runner.run_isolated("import time; time.sleep(30)", timeout=0.5)


def test_isolated_run_returns_output():
    r = runner.run_isolated("print(6 * 7)", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "42"


# ---------------------------------------------------------------------------- GPU tier

GPU_CHECK = textwrap.dedent("""
    import json, numpy as np
    import helios.cuda_ptx as cp
    from helios.cuda_ptx import dtypes
    name, out_dtype, m, n, k = {args!r}
    cfg = cp.variants()[name]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = cp.gemm(a, b, out_dtype=out_dtype, variant=name)
    # reference from the inputs as the kernel sees them (rounded to its input dtype)
    ra = dtypes.decode(dtypes.encode(a, cfg.in_dtype), cfg.in_dtype).astype(np.float64)
    rb = dtypes.decode(dtypes.encode(b, cfg.in_dtype), cfg.in_dtype).astype(np.float64)
    ref = ra @ rb
    err = float(np.abs(c - ref).max() / np.abs(ref).max())
    print(json.dumps({{"shape": list(c.shape), "rel_err": err}}))
""")


def _gpu_ready(name: str | None = None, b_major: str | None = None):
    if not HAVE_DRIVER:
        pytest.skip(f"no usable CUDA driver: {WHY}")
    if (name, b_major) in smoke.skipped_on_gpu():
        pytest.skip(f"{name} with B {b_major}-major hung in the smoke run (HELIOS_GPU_SKIP)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(cp.variants()))
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_gemm_matches_numpy_on_gpu(name, out_dtype):
    _gpu_ready(name, runner.native_b_major(cp.variants()[name]))
    # odd sizes exercise the zero padding to tile multiples
    r = runner.run_isolated(GPU_CHECK.format(args=(name, out_dtype, 300, 520, 200)), timeout=180)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["shape"] == [300, 520]
    # bf16 output rounds to 8 bits; Hopper's fp8 wgmma accumulates with fewer than fp32's bits
    tol = 1e-2 if out_dtype == "bfloat16" else smoke.tolerance(cp.variants()[name].in_dtype)
    assert res["rel_err"] < tol, res




@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wgmma_tma", "wgmma_pipe", "wgmma_ws", "wgmma_persistent", "wgmma_cluster"])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_wgmma_both_b_layouts_on_gpu(name, b_major):
    """gemm() runs 16-bit wgmma N-major; this keeps the K-major (Linear weight) form covered too."""
    _gpu_ready(name, b_major)
    r = runner.run_isolated(smoke.launch_check(name, b_major, 300, 520, 200), timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["rel_err"] < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wgmma_persistent", "wgmma_cluster"])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_persistent_ctas_take_several_tiles_on_gpu(name, b_major):
    """More tiles than CTAs (ragged 4000 x 2000: 32 x 8 tiles), so each CTA walks several;
    a cluster kernel launches whole clusters, as many as the device holds at once."""
    _gpu_ready(name, b_major)
    r = runner.run_isolated(smoke.launch_check(name, b_major, 4000, 2000, 264), timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tiles"] > res["ctas"] and res["ctas"] <= res["sm_count"], res
    assert res["ctas"] % cp.variants()[name].cluster == 0, res
    assert res["rel_err"] < 1e-5, res


# ---------------------------------------------------------------------------- smoke run


def test_smoke_layouts_and_skip_list(monkeypatch):
    assert smoke.layouts("wgmma_ws") == ["k", "n"] and smoke.layouts("simt") == ["n", "k"]
    assert smoke.layouts("wgmma_fp8") == ["k"]  # wgmma reads 8-bit B K-major only
    monkeypatch.setenv("HELIOS_GPU_SKIP", "wgmma_ws:k, simt:n,,junk")
    assert smoke.skipped_on_gpu() == {("wgmma_ws", "k"), ("simt", "n")}


def test_smoke_calls_a_deadline_overrun_a_hang(monkeypatch):
    def hang(code, timeout):
        raise DeviceError(f"GPU check did not finish in {timeout:.0f} s (...)\nmore")

    monkeypatch.setattr(smoke, "run_isolated", hang)
    res = smoke.smoke_one("wgmma_ws", "k", timeout=5)
    assert res["status"] == "hang" and res["detail"].startswith("GPU check did not finish in 5 s")


@pytest.mark.skipif(HAVE_DRIVER, reason="a CUDA driver is present")
def test_smoke_without_a_driver_reports_each_run_as_an_error(capsys):
    assert smoke.main(["simt", "--timeout", "60"]) == 1
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["name"], x["b_major"], x["status"]) for x in lines] == [("simt", "n", "error"), ("simt", "k", "error")]
    assert "CUDA driver" in lines[0]["detail"]
