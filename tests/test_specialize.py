"""Specialization constants frozen into SPIR-V by spirv-opt before the driver builds a pipeline
(helios.kernels_spirv.specialize): the same bits as the driver's own specialization, a
smaller module, a disk cache, and the driver's path wherever spirv-opt cannot help."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from helios.kernels_spirv import registry, specialize as S

needs_opt = pytest.mark.skipif(S.spirv_opt() is None, reason="spirv-opt (spirv-tools) not installed")

# matmul_epi's subgroup kernel: WY 4, A / B modes 1 / 2, CVEC, wide loads, bias, EPI 2 (linear+gelu), EVEC.
EPI_SPEC = (4, 1, 2, 1, 1, 1, 1, 0, 0, 2, 0, 1)


def test_spec_constant_kinds_reads_ids_and_types():
    kinds = S.spec_constant_kinds(registry.spirv("layernorm", "f32_tx"))
    assert kinds[0] == "int" and kinds[1] == "bool" and kinds[4] == "bool"
    assert S.spec_constant_kinds(registry.spirv("matmul_epi", "f32_sg16x8"))[9] == "int"
    with pytest.raises(ValueError):
        S.spec_constant_kinds(b"\0" * 64)


@needs_opt
def test_specialized_module_is_smaller_cached_and_frozen(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    S._memo.clear()
    code = registry.spirv("matmul_epi", "f32_sg16x8")
    out = S.specialize(code, EPI_SPEC, wait=True)
    assert out is not None and len(out) < len(code) / 3
    assert S.spec_constant_kinds(out) == {}  # no constant left for the driver
    files = list((tmp_path / "helios" / "spv" / "specialized").iterdir())
    assert len(files) == 1 and files[0].read_bytes() == out
    S._memo.clear()
    files[0].write_bytes(out + b"\0\0\0\0")  # read back from disk, not rebuilt
    assert S.specialize(code, EPI_SPEC) == out + b"\0\0\0\0"
    assert S.specialize(code, EPI_SPEC[:9] + (1,) + EPI_SPEC[10:], wait=True) != out  # another epilogue, another module


@needs_opt
def test_a_miss_leaves_the_driver_to_it_and_freezes_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(S, "MODE", "1")  # the default, whatever the tests' environment says
    S._memo.clear()
    code = registry.spirv("matmul", "f32_sg16x8")
    spec = (4, 1, 2, 1, 1, 1, 0)
    earlier = list(S._background)  # jobs of other tests in this process
    assert S.specialize(code, spec) is None  # the first process to ask: the driver's pipeline, no job
    assert [p for p in S._background if p not in earlier] == []
    S._memo.clear()  # a second process asks: still the driver's pipeline, and a job to freeze it
    assert S.specialize(code, spec) is None
    assert S.specialize(code, spec) is None  # asked again: no second job
    jobs = [p for p in S._background if p not in earlier]
    assert len(jobs) == 1
    assert jobs[0].wait(timeout=120) == 0
    S._memo.clear()  # a later process finds it on disk, and the claim is gone
    made = S.specialize(code, spec)
    assert made is not None and S.spec_constant_kinds(made) == {}
    assert [p.name for p in (tmp_path / "helios" / "spv" / "specialized").iterdir() if not p.name.endswith(".spv")] == []


def test_driver_specializes_where_spirv_opt_cannot_help(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    S._memo.clear()
    code = registry.spirv("matmul_epi", "f32_sg16x8")
    assert S.specialize(code, ()) is None  # nothing to freeze
    assert S.specialize(registry.spirv("scan", "f32"), (0,)) is None  # small: freezing gains nothing
    monkeypatch.setenv("SPIRV_OPT", str(tmp_path / "no-such-tool"))
    assert S.specialize(code, EPI_SPEC, wait=True) is None
    S._memo.clear()
    assert S.specialize(code, EPI_SPEC) is None and not list((tmp_path / "helios").rglob("*.in"))
    S._memo.clear()
    monkeypatch.setattr(S, "ENABLED", False)
    assert S.specialize(code, EPI_SPEC) is None


_PROGRAM = r"""
import sys
import numpy as np
import helios as hl
import helios.nn.functional as F
from helios.functional.products import mlp_residual

rng = np.random.default_rng(0)
def t(*shape):
    return hl.tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True)
x, w1, b1, w2, b2, r = t(70, 48), t(96, 48), t(96), t(48, 96), t(48), t(70, 48)
y = mlp_residual(x, w1, b1, w2, b2, r)
z = F.layer_norm(y, (48,)).softmax(-1)
loss = F.cross_entropy(z, hl.tensor(rng.integers(0, 48, 70)))
loss.backward()
np.savez(sys.argv[1], y=y.numpy(), z=z.numpy(), loss=loss.numpy(),
         **{f"g{i}": v.grad.numpy() for i, v in enumerate((x, w1, b1, w2, b2, r))})
"""


@pytest.mark.vulkan
@needs_opt
def test_frozen_kernels_compute_the_drivers_bits(tmp_path):
    """A fused MLP block, LayerNorm, softmax and cross-entropy, forward and backward, in a process
    whose pipelines are specialized by spirv-opt and in one where the driver specializes them."""
    outs = {}
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    mesa_cache = os.environ.get("MESA_SHADER_CACHE_DIR", os.path.join(home, "mesa_shader_cache"))  # kept warm
    for on in ("1", "0"):
        env = dict(os.environ, HELIOS_SPECIALIZE="sync" if on == "1" else "0", LP_NUM_THREADS="1",
                   XDG_CACHE_HOME=str(tmp_path / "cache"), MESA_SHADER_CACHE_DIR=mesa_cache)
        path = tmp_path / f"out{on}.npz"
        res = subprocess.run([sys.executable, "-c", _PROGRAM, str(path)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[on] = np.load(path)
    assert len(list((tmp_path / "cache" / "helios" / "spv" / "specialized").iterdir())) >= 3  # frozen ones ran
    assert sorted(outs["1"].files) == sorted(outs["0"].files)
    for k in outs["1"].files:
        np.testing.assert_array_equal(outs["1"][k], outs["0"][k], err_msg=k)
