"""Packaging: the import root, the standard library's profile module, built kernels."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["autograd", "kernels_spirv", "comm", "profile", "schedule", "cuda_ptx"])
def test_top_level_folders_import_under_helios(name):
    mod = __import__(f"helios.{name}", fromlist=["_"])
    assert os.path.dirname(mod.__file__) == os.path.join(ROOT, name)


def test_checkout_root_on_sys_path_does_not_shadow_stdlib_profile():
    # `python -m ...` from the checkout puts its root on sys.path, where profile/ lives.
    code = ("import sys; sys.path.insert(0, %r); import cProfile, profile; "
            "assert callable(profile.run), profile.__file__; import helios.profile as hp; assert hp.profile") % ROOT
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def test_every_kernel_variant_has_spirv():
    from helios.kernels_spirv import build, registry

    for name in build.kernel_names():
        assert name in registry.KERNELS, f"{name}.comp has no KernelInfo in the registry"
        for variant in build.kernel_variants(name):
            code = registry.spirv(name, variant)
            assert code[:4] == b"\x03\x02\x23\x07", f"{name}.{variant} is not SPIR-V"


@pytest.mark.slow  # one of the longest single-process tests: full runs only, not the inner loop
def test_gpu_check_script_installs_without_native_parts_and_runs_the_gate(tmp_path):
    from helios.cuda_ptx import driver, gate

    if driver.driver_status()[0]:
        pytest.skip("a CUDA driver is present: the script would run the whole GPU benchmark")
    out = tmp_path / "results"
    # the gate's emulation runs are test_cuda_ptx_gate's; here the script and its install are under test
    env = dict(os.environ, PYTHON=sys.executable, HELIOS_GATE_ARGS="--no-emulate")
    r = subprocess.run([os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)], capture_output=True, text=True,
                       env=env, timeout=600)
    # 2: the gate passed and there is no driver to go further
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no usable CUDA driver" in r.stderr
    lines = [json.loads(x) for x in (out / "gate.log").read_text().splitlines() if x.startswith("{")]
    assert [x["name"] for x in lines] == list(gate.gate_configs()) + list(gate.flash_gate_configs())
    assert all(x["ok"] for x in lines), lines
    assert "ptxas" in (out / "env.txt").read_text()
    bad = subprocess.run([os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out), "everything"], capture_output=True,
                         text=True, env=env, timeout=60)
    parts = "all, tests, bench, device, attention, coopmat, coopmat-ops, coopmat-train"
    assert bad.returncode == 1 and f"one of {parts}; not 'everything'" in bad.stderr
    # the benchmark half alone skips the gate, and stops at the missing driver
    bench_only = tmp_path / "bench-only"
    r = subprocess.run([os.path.join(ROOT, "scripts", "gpu_check.sh"), str(bench_only), "bench"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 2 and "no usable CUDA driver" in r.stderr, r.stdout + r.stderr
    assert not (bench_only / "gate.log").exists()



def test_package_data_carries_every_kernel_source_file():
    # A non-editable install carries the GLSL sources, so the registry reads the .variants file
    # next to each one: one left out of the package data made every kernel with variants
    # "unknown" outside the checkout (a GPU machine's install found no ew_unary f32).
    import fnmatch
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["helios.kernels_spirv"]
    glsl = os.path.join(ROOT, "kernels_spirv", "glsl")
    missing = [n for n in sorted(os.listdir(glsl)) if not any(fnmatch.fnmatch("glsl/" + n, g) for g in globs)]
    assert not missing, f"not in helios.kernels_spirv's package data: {missing}"
    assert any(n.endswith(".variants") for n in os.listdir(glsl))
