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


# Cooperative-matrix shapes a lavapipe emulating them lists (emulate_coopmat): 16x16x16 with fp32 sums
EMULATED_COOPMAT = [dict(m=16, n=16, k=16, a=t, b=t, c="f32", result="f32", scope="subgroup", saturating=False)
                    for t in ("f16", "bf16")]


def emulate_coopmat(monkeypatch, rt) -> bool:
    """Make lavapipe (``rt``, a CPU Vulkan driver) run the cooperative-matrix kernels' emulated
    variants: its facts list :data:`EMULATED_COOPMAT` and say "discrete" (past the CPU-driver
    kernels), and matmul_coop's and flash_coop's pipelines are built from their ``_emu`` variants,
    where plain code does the cooperative-matrix operations and the rest is what a GPU runs.
    Through ``monkeypatch`` (undone with it); False, with nothing changed, on any other device
    or where the kernels are not built."""
    from helios._kernels import coopmat

    info = getattr(rt, "info", None) or {}
    if info.get("type") != "cpu" or not (coopmat.kernel_built() and coopmat.kernel_built(coopmat.FLASH_KERNEL)):
        return False
    monkeypatch.setitem(rt.info, "cooperative_matrix", EMULATED_COOPMAT)
    monkeypatch.setitem(rt.info, "type", "discrete")
    real = rt.pipeline

    def emulated(kernel, variant, spec=(), subgroup_size=0):
        if kernel == coopmat.KERNEL:
            variant += "_emu"
        elif kernel == coopmat.FLASH_KERNEL:
            variant = variant.replace("_d", "_emu_d")
        return real(kernel, variant, spec, subgroup_size)

    monkeypatch.setattr(rt, "pipeline", emulated)
    return True


@contextlib.contextmanager
def coopmat_device(chosen):
    """The current device with its cooperative-matrix kernels on inside the block (a test module's
    fixture; _coopmat_on says how and when it skips), the emulation undone on exit."""
    import pytest

    rt = get_runtime()
    with pytest.MonkeyPatch.context() as mp:
        _coopmat_on(mp, rt, chosen)
        yield rt


def _coopmat_on(monkeypatch, rt, chosen) -> None:
    """coopmat_device's switch, through ``monkeypatch``: a GPU that lists cooperative matrices as
    it is, lavapipe through emulate_coopmat; skips where neither can, or where ``chosen(rt)`` (a
    coopmat.Choice) is not a cooperative-matrix one."""
    import pytest

    from helios._kernels import coopmat

    if not coopmat.shapes_of(getattr(rt, "info", None) or {}) and not emulate_coopmat(monkeypatch, rt):
        pytest.skip(f"{rt.name} lists no cooperative matrices")
    choice = chosen(rt)
    if not choice.coopmat:
        pytest.skip(f"{rt.name}: the cooperative-matrix kernel is not chosen: {choice.reason}")


def use_matmul_kernel(which: str, monkeypatch, request, dtype: str) -> None:
    """Run the test's products on matmul kernel ``which``: "cpu" (the CPU-driver kernel; skips where the
    device does not run it), "gpu" (the GPU shared-memory kernel, forced on: it runs on lavapipe
    too, and on a GPU instead of the cooperative-matrix kernel) or "coop" (the cooperative-matrix
    kernel: a GPU's that lists shapes, or lavapipe's emulation, emulate_coopmat).  Skips where a
    matrix engine takes ``dtype`` products."""
    import pytest

    from helios._kernels import coopmat, gemm

    rt = get_runtime()
    if which == "coop":
        _coopmat_on(monkeypatch, rt, lambda r: coopmat.choice_for(r, dtype, 256, 256, 256))
    elif which == "gpu":
        monkeypatch.setattr(gemm, "_cpu_mm_kernel", lambda rt: False)
        was = coopmat.set_enabled(False)
        request.addfinalizer(lambda: coopmat.set_enabled(was))
    elif not gemm._cpu_mm_kernel(rt):
        pytest.skip("the device does not run the CPU-driver kernel")
    if rt.has_gemm(dtype):
        pytest.skip(f"a matrix engine runs {dtype} products here")


def autocast_block(dtype, seed: int = 6) -> tuple[list, int]:
    """A GPT block's autocast products on the current device from float32 leaves, forward and
    backward: c_fc with its GELU, c_proj with its float32 residual, the tied output embedding.
    Returns (the outputs and every gradient as arrays, the number of cast kernels it ran: copies
    between dtypes, K.copy's included)."""
    import numpy as np

    import helios as hl

    rng = np.random.default_rng(seed)
    shapes = {"x": (2, 8, 32), "w1": (64, 32), "b1": (64,), "w2": (32, 64), "b2": (32,), "emb": (48, 32)}
    t = {k: hl.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True) for k, s in shapes.items()}
    gs = hl.tensor(rng.standard_normal((2, 8, 48)).astype(np.float32))
    with counting_casts() as casts:
        with hl.autocast(dtype):
            h = hl.nn.functional.linear_gelu(t["x"], t["w1"], t["b1"])
            y = hl.nn.functional.linear_residual(h, t["w2"], t["b2"], t["x"])
            logits = y @ t["emb"].mT
        (logits.float() * gs).sum().backward()
    return [y.numpy(), logits.float().numpy()] + [t[k].grad.numpy() for k in shapes], sum(casts)


@contextlib.contextmanager
def counting_casts():
    """The copies run inside the block, K.copy's and the callers' of K.copy_into: yields a list
    that gets one bool a copy, True for a cast (a copy between dtypes)."""
    from helios import _kernels as K
    from helios._kernels import elementwise

    casts = []
    real = elementwise.copy_into

    def counted(dst, src):
        casts.append(dst.dtype is not src.dtype)
        return real(dst, src)

    elementwise.copy_into = K.copy_into = counted
    try:
        yield casts
    finally:
        elementwise.copy_into = K.copy_into = real
