"""The error hierarchy at the API surface (DESIGN.md, Conventions): each case asserts the
exception type, its builtin base, and the facts the message must carry (the op, what
was expected, what came, what to do), and that the process stays usable afterwards."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import helios as hl
from helios import _kernels as K
from helios.runtime import get_runtime

pytestmark = pytest.mark.vulkan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str, **env_over) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the given environment overrides."""
    env = dict(os.environ)
    env.pop("HELIOS_DEVICE", None)
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)


# -- ShapeError ---------------------------------------------------------------------------------
SHAPE_CASES = [
    ("add", lambda: hl.ones(3, 4) + hl.ones(5, 4), ["add", "(3, 4)", "(5, 4)"]),
    ("mul", lambda: hl.ones(2, 3) * hl.ones(2), ["mul", "(2, 3)", "(2,)"]),
    ("sub", lambda: hl.sub(hl.ones(7), hl.ones(6)), ["sub", "(7,)", "(6,)"]),
    ("compare", lambda: hl.ones(4) < hl.ones(3), ["lt", "(4,)", "(3,)"]),
    ("where", lambda: hl.where(hl.ones(3) > 0, hl.ones(3), hl.ones(2)), ["where", "(3,)", "(2,)"]),
    ("matmul", lambda: hl.ones(3, 4) @ hl.ones(5, 6), ["matmul", "(3, 4)", "(5, 6)"]),
    ("matmul-batch", lambda: hl.ones(2, 3, 4) @ hl.ones(3, 4, 5), ["matmul", "(2,)", "(3,)"]),
    ("reshape", lambda: hl.ones(3, 4).reshape(5, 3), ["reshape", "(3, 4)", "(5, 3)"]),
    ("expand", lambda: hl.ones(3, 2).expand(3, 4), ["expand", "(3, 2)", "(3, 4)"]),
    ("cat", lambda: hl.cat([hl.ones(2, 3), hl.ones(2, 4)], dim=0), ["cat", "(2, 4)", "(2, 3)"]),
    ("stack", lambda: hl.stack([hl.ones(2), hl.ones(3)]), ["stack", "(3,)", "(2,)"]),
    ("layer_norm", lambda: hl.layer_norm(hl.ones(2, 5), (4,)), ["layer_norm", "(2, 5)", "(4,)"]),
    ("cross_entropy", lambda: hl.cross_entropy(hl.ones(4, 10), hl.tensor(np.zeros(3, np.int64))),
     ["cross_entropy", "(4, 10)", "(3,)"]),
    ("masked_fill", lambda: hl.ones(3, 4).masked_fill(hl.ones(3) > 0, 0.0), ["masked_fill", "(3, 4)", "(3,)"]),
]


@pytest.mark.parametrize("name,fn,facts", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_shape_error_names_op_and_both_shapes(name, fn, facts):
    with pytest.raises(hl.ShapeError) as ei:
        fn()
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, hl.HeliosError)
    msg = str(ei.value)
    for fact in facts:
        assert fact in msg, f"{name}: {fact!r} missing from {msg!r}"


def test_failed_inplace_op_leaves_target_unchanged():
    x = hl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(hl.ShapeError, match=r"add_.*\(2, 3\)"):
        x.add_(hl.ones(4, 2, 3))
    with pytest.raises(hl.ShapeError):
        x.copy_(hl.ones(3, 2))
    np.testing.assert_array_equal(x.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


# -- DTypeError ---------------------------------------------------------------------------------
DTYPE_CASES = [
    ("unknown-name", lambda: hl.ones(3, dtype="complex64"), ["complex64", "float32", "int64"]),
    ("numpy-complex", lambda: hl.tensor(np.ones(3, np.complex64)), ["complex64", "float32"]),
    ("mean-int", lambda: hl.ones(3, dtype=hl.int64).mean(), ["mean", "int64", "float32"]),
    ("grad-int", lambda: hl.ones(3, dtype=hl.int32).requires_grad_(), ["int32", "floating"]),
    ("matmul-int", lambda: hl.ones(2, 2, dtype=hl.int32) @ hl.ones(2, 2, dtype=hl.int32), ["matmul", "int32"]),
    ("embedding-float-index", lambda: hl.embedding(hl.ones(3), hl.ones(4, 2)), ["embedding", "float32"]),
    ("ce-float-target", lambda: hl.cross_entropy(hl.ones(2, 3), hl.ones(2)), ["cross_entropy", "float32"]),
    ("neg-bool", lambda: -(hl.ones(3) > 0), ["neg", "bool", "logical_not"]),
    ("kernel-mismatch", lambda: K.binary("add", hl.ones(2), hl.ones(2, dtype=hl.int32)), ["add", "float32", "int32"]),
]


@pytest.mark.parametrize("name,fn,facts", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
def test_dtype_error(name, fn, facts):
    with pytest.raises(hl.DTypeError) as ei:
        fn()
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, hl.HeliosError)
    msg = str(ei.value)
    for fact in facts:
        assert fact in msg, f"{name}: {fact!r} missing from {msg!r}"


# -- DeviceError --------------------------------------------------------------------------------
def test_no_vulkan_device_names_the_packages():
    # A loader that finds no driver (ICD) behaves like a machine without Vulkan.
    r = _run_python("""
        import helios as hl
        assert hl.devices() == [], hl.devices()
        try:
            hl.ones(3)
        except hl.DeviceError as e:
            assert isinstance(e, RuntimeError)
            print("DEVICE_ERROR:", e)
        else:
            raise SystemExit("no DeviceError")
    """, VK_ICD_FILENAMES="/nonexistent/helios_test_icd.json", VK_DRIVER_FILES="/nonexistent/helios_test_icd.json")
    assert r.returncode == 0, r.stdout + r.stderr
    msg = r.stdout.split("DEVICE_ERROR:", 1)[1]
    for fact in ("no Vulkan device", "libvulkan1", "mesa-vulkan-drivers", "vulkaninfo"):
        assert fact in msg, f"{fact!r} missing from {msg!r}"


def test_set_device_out_of_range():
    n = len(hl.devices())
    current = hl.current_device()
    with pytest.raises(hl.DeviceError) as ei:
        hl.set_device(f"vulkan:{n + 6}")
    msg = str(ei.value)
    assert f"vulkan:{n + 6}" in msg and "vulkan:0" in msg and hl.devices()[0].description in msg
    with pytest.raises(hl.DeviceError, match="tpu:0.*vulkan:N"):
        hl.set_device("tpu:0")
    with pytest.raises(hl.DeviceError, match="integer"):
        hl.set_device("vulkan:x")
    # the current device is untouched
    assert hl.current_device() == current
    assert (hl.ones(3) * 2).sum().item() == 6.0


# -- OutOfMemoryError ----------------------------------------------------------------------------
def _in_use() -> int:
    return sum(p["in_use_bytes"] for p in get_runtime().dev.pool_stats().values())


def test_absurd_allocation_raises_oom_and_process_stays_usable():
    x = hl.ones(1000)
    # An earlier test's cyclic garbage, collected mid-test, would free pool bytes and read as a
    # change (seen under pytest-xdist: in use fell 10240 -> 7424): collect it first.
    gc.collect()
    hl.synchronize()
    before = _in_use()
    with pytest.raises(hl.OutOfMemoryError) as ei:
        hl.empty(1 << 40)
    e = ei.value
    assert isinstance(e, hl.DeviceError) and isinstance(e, MemoryError)
    msg = str(e)
    assert str(4 << 40) in msg, msg  # bytes asked (float32)
    for fact in ("activations", "weights", "staging", "in use", "reserved", "Pools"):
        assert fact in msg, f"{fact!r} missing from {msg!r}"
    assert _in_use() == before, "a failed allocation must not leak"
    # the device still works
    y = (x * 3 + 1).sum()
    assert y.item() == 4000.0
    z = hl.randn(256, 64, seed=1) @ hl.ones(64, 8)
    assert z.shape == (256, 8) and np.isfinite(z.numpy()).all()


def test_device_memory_exhausted_raises_oom_then_recovers():
    # Cap the Device at 256 MiB so "full" comes quickly, then free and allocate again.
    r = _run_python("""
        import helios as hl
        held = []
        try:
            for _ in range(10):
                held.append(hl.empty(25_000_000))  # 100 MB each
        except hl.OutOfMemoryError as e:
            print("OOM:", e)
        else:
            raise SystemExit("no OutOfMemoryError")
        assert 1 <= len(held) < 10, len(held)
        held.clear()
        again = hl.empty(25_000_000)
        print("VALUE:", (hl.ones(1000) * 2).sum().item())
    """, HELIOS_VK_MEMORY_LIMIT_MB="256")
    assert r.returncode == 0, r.stdout + r.stderr
    msg = r.stdout.split("OOM:", 1)[1].split("\nVALUE:", 1)[0]
    for fact in ("100000000 bytes", "activations", "in use", "reserved", "HELIOS_VK_MEMORY_LIMIT_MB"):
        assert fact in msg, f"{fact!r} missing from {msg!r}"
    assert "VALUE: 2000.0" in r.stdout


# -- the hierarchy itself ------------------------------------------------------------------------
def test_hierarchy():
    assert issubclass(hl.ShapeError, ValueError) and issubclass(hl.DTypeError, TypeError)
    assert issubclass(hl.OutOfMemoryError, hl.DeviceError) and issubclass(hl.CommError, TimeoutError)
    for cls in (hl.ShapeError, hl.DTypeError, hl.DeviceError, hl.OutOfMemoryError, hl.CommError, hl.CheckpointError):
        assert issubclass(cls, hl.HeliosError)
