"""bench/ptx_gemm.py without a GPU: its --set overrides, and the line it prints when it cannot run."""

import importlib.util
import json
import os
import subprocess
import sys

import helios.cuda_ptx as cp
import pytest
from helios.cuda_ptx import driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "ptx_gemm.py")


def _bench_module():
    spec = importlib.util.spec_from_file_location("ptx_gemm_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overrides_apply_where_the_config_can_take_them():
    bench = _bench_module()
    v = cp.variants()
    sets = {"inflight": 0, "persistent": True, "cluster": 2}
    assert bench._applicable(v["simt"], sets) == {}
    assert bench._applicable(v["wgmma_pipe"], sets) == {"inflight": 0}  # no producer: no persistent, no cluster
    fp8 = v["wgmma_fp8"].with_(**bench._applicable(v["wgmma_fp8"], sets))
    fp8.validate()
    assert fp8.persistent and fp8.cluster == 2 and fp8.inflight == 0


def test_bad_set_is_refused_and_without_a_driver_it_says_why():
    r = subprocess.run([sys.executable, SCRIPT, "--set", "clusters=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--set takes inflight=, group_m=, stages=, tma_store=, persistent=, cluster=" in r.stderr
    if driver.driver_status()[0]:
        pytest.skip("a CUDA driver is present: the benchmark would run")
    r = subprocess.run([sys.executable, SCRIPT, "--variants", "wgmma_fp8", "--set", "cluster=2"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["skipped"] and "CUDA driver" in line["reason"]


def test_the_benchmark_dry_runs_on_the_emulated_device():
    """Every line of the timed path (launch, timing, error against the reference, the
    cuBLAS and _scaled_mm peers) runs, with kernels on the CPU emulator and torch on the CPU."""
    pytest.importorskip("torch")
    env = dict(os.environ, HELIOS_CUDA_DEVICE="emulator")
    r = subprocess.run([sys.executable, SCRIPT, "--sizes", "256", "--iters", "1", "--variants", "wgmma_ws", "wgmma_fp8",
                        "--set", "cluster=2"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["bench"] for x in lines] == ["gemm_wgmma_ws_bf16_256", "gemm_wgmma_fp8_e4m3_256"]
    for x in lines:
        assert x["emulated"] and x["device"].startswith("Helios PTX emulator") and x["cluster"] == 2
        assert x["rel_err"] < 1e-5 and x["peer_rel_err"] < 1e-2
        assert x["helios"] >= 0 and x["peer"] >= 0 and x["unit"] == "TFLOP/s"  # rates, rounded; meaningless here
