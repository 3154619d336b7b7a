"""``emit_gemm``: a GEMM configuration (or a variant name) to PTX text."""

from __future__ import annotations

from . import gen_mma, gen_simt, gen_wgmma
from .config import GemmConfig, variants
from .ir import Kernel
from .render import render


def build_kernel(config: GemmConfig | str) -> Kernel:
    """The IR kernel for ``config`` (a :class:`GemmConfig` or a name from :func:`variants`)."""
    cfg = resolve(config)
    cfg.validate()
    gen = {"simt": gen_simt.generate, "mma_sync": gen_mma.generate, "wgmma": gen_wgmma.generate}[cfg.kind]
    return gen(cfg)


def resolve(config: GemmConfig | str) -> GemmConfig:
    """Accept a config or a variant name."""
    if isinstance(config, GemmConfig):
        return config
    vs = variants()
    if config not in vs:
        raise KeyError(f"unknown GEMM variant {config!r}; choose one of {sorted(vs)}")
    return vs[config]


def emit_gemm(config: GemmConfig | str) -> str:
    """PTX text (one module, one ``.entry``) for the GEMM kernel ``config`` describes."""
    return render(build_kernel(config))
