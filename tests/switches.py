"""Helpers of the tests that compare a fast path with its reference: flip a module switch for a
block, and count the kernels a block dispatches."""

from __future__ import annotations

import collections
import contextlib

from helios.runtime import get_runtime


@contextlib.contextmanager
def switched(module, name: str, value):
    """``module.name = value`` inside the block (helios.fused_kernels.ENABLED, tape.GRADS_IN_PLACE, ...)."""
    prev = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, prev)


@contextlib.contextmanager
def count_dispatches():
    """A Counter of the kernels dispatched on the current device inside the block, by name."""
    rt = get_runtime()
    names = collections.Counter()
    orig = rt.dispatch

    def counting(pid, buffers, push, groups, name, *a, **k):
        names[name] += 1
        return orig(pid, buffers, push, groups, name, *a, **k)

    rt.dispatch = counting
    try:
        yield names
    finally:
        del rt.dispatch  # the instance attribute goes; the method is back


def use_matmul_kernel(which: str, monkeypatch, request, dtype: str) -> None:
    """Run the test's products on matmul kernel ``which``: "cpu" (the CPU-driver kernel; skips where the
    device does not run it) or "gpu" (the GPU shared-memory kernel, forced on: it runs on lavapipe
    too, and on a GPU instead of the cooperative-matrix kernel).  Skips where a matrix engine takes
    ``dtype`` products."""
    from helios._kernels import coopmat, gemm

    rt = get_runtime()
    if which == "gpu":
        monkeypatch.setattr(gemm, "_cpu_mm_kernel", lambda rt: False)
        was = coopmat.set_enabled(False)
        request.addfinalizer(lambda: coopmat.set_enabled(was))
    elif not gemm._cpu_mm_kernel(rt):
        import pytest

        pytest.skip("the device does not run the CPU-driver kernel")
    if rt.has_gemm(dtype):
        import pytest

        pytest.skip(f"a matrix engine runs {dtype} products here")
