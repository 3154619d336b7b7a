"""The kernel registry: (kernel, variant) -> SPIR-V words and binding layout.

SPIR-V comes from the package's ``spv/`` folder, compiled at build time.  When a
variant is missing there, or its GLSL source is newer (an editable checkout being
edited), it is compiled with glslc into the user cache (``$XDG_CACHE_HOME/helios/spv``)
through the same build step, so generated or edited kernels take the same path.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGED_SPV = os.path.join(_HERE, "spv")


def cache_dir() -> str:
    """Helios' user cache folder (kernels, pipeline caches, token caches)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "helios")


@dataclass(frozen=True)
class KernelInfo:
    """What the runtime needs to make a pipeline for a kernel."""

    name: str
    num_buffers: int
    push_size: int


# Binding count and push-constant size of each kernel (must match the GLSL).
KERNELS: dict[str, KernelInfo] = {
    k.name: k
    for k in (
        KernelInfo("ew_unary", 2, 80),
        KernelInfo("ew_binary", 3, 104),
        KernelInfo("ew_where", 4, 120),
        KernelInfo("copy", 2, 112),
        KernelInfo("reduce", 4, 48),
        KernelInfo("softmax", 3, 24),
        KernelInfo("layernorm", 9, 44),
        KernelInfo("cross_entropy", 6, 24),
        KernelInfo("embedding", 6, 36),
        KernelInfo("rotary", 4, 68),  # RoPE forward and backward (helios.functional.rotary)
        KernelInfo("rng", 1, 36),
        KernelInfo("iota", 1, 32),
        KernelInfo("matmul", 4, 72),
        KernelInfo("matmul_epi", 6, 80),  # matmul.glsl with a fused epilogue (helios.fused_kernels)
        KernelInfo("matmul_coop", 6, 72),  # cooperative matrices (GPUs listing them): matmul_epi's bindings, its first 18 words
        KernelInfo("adamw", 4, 48),
        KernelInfo("sort", 3, 24),
        KernelInfo("scan", 2, 16),
        KernelInfo("gather", 3, 96),
        KernelInfo("scatter", 4, 28),
        KernelInfo("flash_attn", 10, 124),
        KernelInfo("flash_coop", 10, 124),  # cooperative matrices (GPUs listing them): flash_attn's bindings and words
    )
}

_builder = None
_spirv_cache: dict[tuple[str, str], bytes] = {}
_spirv_paths: dict[tuple[str, str], str] = {}  # the file each cached entry was read from


def load_builder():
    """kernels_spirv/build.py as a module (loaded once): the one place that knows the kernels, their
    variants and how to compile them."""
    global _builder
    if _builder is None:
        spec = importlib.util.spec_from_file_location("helios_kernel_build", os.path.join(_HERE, "build.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _builder = mod
    return _builder


def variants(name: str) -> list[str]:
    """The variant names of kernel ``name``, as its .variants file lists them."""
    return list(load_builder().kernel_variants(name))


def needs_coopmat(name: str) -> bool:
    """Whether kernel ``name`` is a cooperative-matrix kernel (GL_KHR_cooperative_matrix: run only on
    Vulkan GPUs that list cooperative matrices, built for Vulkan 1.3)."""
    return load_builder().needs_coopmat(name)


_buildable: dict[str, bool] = {}


def can_build(name: str) -> bool:
    """Whether every variant of kernel ``name`` has current SPIR-V here or a compiler that can build it
    (matmul_coop needs one that knows GL_KHR_cooperative_matrix, which glslc may not); asked once."""
    ok = _buildable.get(name)
    if ok is None:
        builder = load_builder()
        current = all(os.path.exists(p) and os.path.getmtime(p) >= builder.source_mtime(name)
                      for p in (spirv_path(name, v) for v in variants(name)))
        try:
            ok = current or bool(builder.find_coopmat_compiler() if builder.needs_coopmat(name) else builder.find_glslc())
        except RuntimeError:
            ok = False
        _buildable[name] = ok
    return ok


def source_path(name: str) -> str:
    """The GLSL source of kernel ``name``."""
    return os.path.join(_HERE, "glsl", name + ".comp")


def spirv_path(name: str, variant: str) -> str:
    """Where the SPIR-V of ``name``'s ``variant`` is read from (packaged, or the user cache when rebuilt):
    the file :func:`spirv` loaded, once it has; before that, the newer of the two."""
    loaded = _spirv_paths.get((name, variant))
    if loaded is not None:
        return loaded
    fname = f"{name}.{variant}.spv"
    cached = os.path.join(cache_dir(), "spv", fname)
    packaged = os.path.join(PACKAGED_SPV, fname)
    if os.path.exists(cached) and (not os.path.exists(packaged) or os.path.getmtime(cached) > os.path.getmtime(packaged)):
        return cached
    return packaged


def spirv(name: str, variant: str) -> bytes:
    """SPIR-V bytes of ``name``'s ``variant``, compiling it first if it is missing or stale."""
    key = (name, variant)
    code = _spirv_cache.get(key)
    if code is not None:
        return code
    fname = f"{name}.{variant}.spv"
    path = os.path.join(PACKAGED_SPV, fname)
    src = source_path(name)
    builder = None
    if os.path.exists(src):
        builder = load_builder()
        if variant not in builder.kernel_variants(name):
            raise KeyError(f"kernel {name!r} has no variant {variant!r}: known {sorted(builder.kernel_variants(name))}")
        stale = not os.path.exists(path) or os.path.getmtime(path) < builder.source_mtime(name)
        if stale:
            path = os.path.join(cache_dir(), "spv", fname)
            if not os.path.exists(path) or os.path.getmtime(path) < builder.source_mtime(name):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                builder.compile_variant(name, variant, builder.kernel_variants(name)[variant], path)
    elif not os.path.exists(path):
        raise KeyError(f"no SPIR-V for kernel {name!r} variant {variant!r} (and no GLSL source to build it)")
    with open(path, "rb") as f:
        code = f.read()
    _spirv_cache[key] = code
    _spirv_paths[key] = path
    return code
